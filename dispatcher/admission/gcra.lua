-- fairq rate limits in Redis: the arithmetic of dispatcher/core/admission.py, as one
-- atomic script. The caller passes the time; Redis's own clock is never read, so the
-- decisions equal those of MemoryLimiterStore, and tests may use virtual time.
--
-- Numbers cross the boundary as strings (%.17g, which round-trips a double), because
-- Redis turns a Lua number in a reply into an integer, and one in a command into 14 digits.
--
-- ARGV[1] = "apply" | "settle"
--
-- apply: ARGV[2] now, ARGV[3] clock epsilon, ARGV[4] expiry grace (seconds), then four
--   values per check, in the order of KEYS:
--     "rate",  per_minute, burst, cost       KEYS[i] holds the tat (a string)
--     "quota", limit, cost, expires_at       KEYS[i] is a hash {used, exp}
--   All checks are read first; if one fails nothing is written and the reply is
--   {i, retry_after_s} for the first failing check i; else all are charged and the
--   reply is {0}. A key lives until its state stops mattering (tat, or the quota
--   period's end, has passed) plus the grace, measured from `now`.
--
-- settle: ARGV[2] now, ARGV[3] expiry grace, then five values per key, in the order of
--   KEYS: "charge" | "refund", then the four of a check as for apply. A charge is taken
--   whatever the limit (the tokens are spent): a tat moves on from max(tat, now), a
--   quota counter grows. A refund gives back up to `cost`: a tat moves back, never below
--   now (a full bucket); a quota counter shrinks, never below 0, and one that is gone
--   (idle or expired) has nothing to give back. Reply {0}.

local function fmt(x)
  return string.format('%.17g', x)
end

-- Milliseconds until `at` (seconds, caller's clock), rounded up, plus the grace.
local function ttl_ms(at, now, grace)
  return math.ceil((at - now + grace) * 1000)
end

-- Keep `key` for ttl milliseconds; one with nothing left to remember is deleted.
local function keep(key, ttl)
  if ttl > 0 then
    redis.call('PEXPIRE', key, string.format('%.0f', ttl))
  else
    redis.call('DEL', key)
  end
end

local function rate_step(key, now, epsilon, per_minute, burst, cost)
  local interval = 60.0 / per_minute
  -- A request bigger than the whole bucket could never pass; charge it a full bucket.
  cost = math.min(cost, burst)
  local tat = tonumber(redis.call('GET', key)) or now
  local new_tat = math.max(tat, now) + cost * interval
  local allow_at = new_tat - burst * interval
  if allow_at <= now + epsilon then
    return true, new_tat
  end
  return false, allow_at - now
end

local function quota_step(key, now, limit, cost, expires_at)
  local stored = redis.call('HMGET', key, 'used', 'exp')
  local used, exp = tonumber(stored[1]), tonumber(stored[2])
  if used == nil or exp == nil or not (now < exp) then
    used = 0.0
  end
  if used + cost > limit then
    return false, expires_at - now
  end
  return true, used + cost
end

local function apply()
  local now, epsilon, grace = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
  local writes = {}
  for i, key in ipairs(KEYS) do
    local at = 4 + (i - 1) * 4
    local kind = ARGV[at + 1]
    local a, b, c = tonumber(ARGV[at + 2]), tonumber(ARGV[at + 3]), tonumber(ARGV[at + 4])
    local ok, value
    if kind == 'rate' then
      ok, value = rate_step(key, now, epsilon, a, b, c)
    elseif kind == 'quota' then
      ok, value = quota_step(key, now, a, b, c)
    else
      return redis.error_reply('fairq limits: unknown check kind ' .. tostring(kind))
    end
    if not ok then
      return {i, fmt(value)}
    end
    writes[i] = {kind, value, c}  -- c is a quota's expires_at
  end
  -- In check order, so a key named twice ends as its last check left it.
  for i, key in ipairs(KEYS) do
    local kind, value, expires_at = writes[i][1], writes[i][2], writes[i][3]
    if kind == 'rate' then
      redis.call('SET', key, fmt(value))
      keep(key, ttl_ms(value, now, grace))
    else
      redis.call('HSET', key, 'used', fmt(value), 'exp', fmt(expires_at))
      keep(key, ttl_ms(expires_at, now, grace))
    end
  end
  return {0}
end

local function settle_rate(key, now, grace, charge, per_minute, cost)
  local interval = 60.0 / per_minute
  local tat = tonumber(redis.call('GET', key)) or now
  if charge then
    tat = math.max(tat, now) + cost * interval
  else
    tat = math.max(tat - cost * interval, now)
  end
  redis.call('SET', key, fmt(tat))
  keep(key, ttl_ms(tat, now, grace))
end

local function settle_quota(key, now, grace, charge, cost, expires_at)
  local stored = redis.call('HMGET', key, 'used', 'exp')
  local used, exp = tonumber(stored[1]), tonumber(stored[2])
  if charge then
    if used == nil or exp == nil or not (now < exp) then
      used = 0.0
    end
    redis.call('HSET', key, 'used', fmt(used + cost), 'exp', fmt(expires_at))
    keep(key, ttl_ms(expires_at, now, grace))
  elseif used ~= nil then
    -- HSET keeps the key's expiry.
    redis.call('HSET', key, 'used', fmt(math.max(0.0, used - cost)))
  end
end

local function settle()
  local now, grace = tonumber(ARGV[2]), tonumber(ARGV[3])
  for i, key in ipairs(KEYS) do
    local at = 3 + (i - 1) * 5
    local charge, kind = ARGV[at + 1] == 'charge', ARGV[at + 2]
    local a, b, c = tonumber(ARGV[at + 3]), tonumber(ARGV[at + 4]), tonumber(ARGV[at + 5])
    if kind == 'rate' then
      settle_rate(key, now, grace, charge, a, c)
    elseif kind == 'quota' then
      settle_quota(key, now, grace, charge, b, c)
    else
      return redis.error_reply('fairq limits: unknown check kind ' .. tostring(kind))
    end
  end
  return {0}
end

if ARGV[1] == 'apply' then
  return apply()
elseif ARGV[1] == 'settle' then
  return settle()
end
return redis.error_reply('fairq limits: unknown operation ' .. tostring(ARGV[1]))
