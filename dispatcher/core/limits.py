"""Admission: GCRA rate limits, calendar-month quotas and the latency throttle.

The algorithm is split from its storage. `limit_checks` turns a tenant's limits into a
list of checks; a store applies a list atomically (all pass and are charged, or none
is). `MemoryLimiterStore` is the in-process store; `dispatcher.admission.redis_store` runs the
same arithmetic as one Lua script, and the same contract tests cover both.

GCRA with bucket size `burst` and emission interval T = 60 / per_minute: a request of
cost c is allowed at `now` when max(tat, now) + c*T - burst*T <= now, and then moves
the theoretical arrival time `tat` to max(tat, now) + c*T. From an idle key this admits
exactly `burst` unit requests at once and one more every T; in any window of length W
at most floor(W / T) + burst.

Token limits charge a request at admission with its input (counted by the dispatcher
where the endpoint has a tokenizer, else as declared) plus its max_tokens, and settle it
on completion at the engine's real usage (`settlement`): the difference is charged on
top, unconditionally, or given back. So a tenant that under-declares its input pays for
the truth, at the latest when its request finishes.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import msgspec

from broker_config.config import Config, Limits, Tier, UnlistedTenants
from dispatcher.core.types import ADMITTED, Decision, Outcome

# Slack when comparing times, so a request exactly on its emission time passes despite
# float rounding; a microsecond is above a double's resolution at today's unix times.
CLOCK_EPSILON_S = 1e-6

# Default bucket: a tenth of a minute's allowance, so short bursts pass and floods don't.
DEFAULT_BURST_FRACTION = 0.1


@dataclass(slots=True, frozen=True)
class RateCheck:
    """GCRA: `cost` units against `per_minute`, with a bucket of `burst` units."""

    key: str
    per_minute: float
    burst: float
    cost: float
    outcome: Outcome = Outcome.RATE_LIMITED

    @property
    def interval(self) -> float:
        return 60.0 / self.per_minute


@dataclass(slots=True, frozen=True)
class QuotaCheck:
    """A counter that may not exceed `limit` within the period ending at `expires_at`."""

    key: str
    limit: float
    cost: float
    expires_at: float
    outcome: Outcome = Outcome.QUOTA_EXCEEDED


Check = RateCheck | QuotaCheck


def gcra(tat: float, now: float, check: RateCheck) -> tuple[bool, float, float]:
    """One GCRA step: (allowed, new_tat, retry_after_s). Pure; stores call this."""
    interval = check.interval
    # A request bigger than the whole bucket could never pass; charge it a full bucket.
    cost = min(check.cost, check.burst)
    new_tat = max(tat, now) + cost * interval
    allow_at = new_tat - check.burst * interval
    if allow_at <= now + CLOCK_EPSILON_S:
        return True, new_tat, 0.0
    return False, tat, allow_at - now


def charged_tat(tat: float, now: float, check: RateCheck) -> float:
    """GCRA's tat after `check.cost` units taken without asking: the bucket may go into
    debt, and the tenant waits until it is paid back."""
    return max(tat, now) + check.cost * check.interval


def refunded_tat(tat: float, now: float, check: RateCheck) -> float:
    """GCRA's tat after `check.cost` units given back; a tat at or before `now` is a full
    bucket, so it never goes below that."""
    return max(tat - check.cost * check.interval, now)


def month_end(now: float) -> float:
    """Unix time at which the calendar month (UTC) containing `now` ends."""
    day = dt.datetime.fromtimestamp(now, tz=dt.UTC)
    first_next = (day.replace(day=1) + dt.timedelta(days=32)).replace(
        day=1, hour=0, minute=0, second=0, microsecond=0
    )
    return first_next.timestamp()


def month_key(now: float) -> str:
    return dt.datetime.fromtimestamp(now, tz=dt.UTC).strftime("%Y-%m")


def request_tokens(input_tokens: int, max_tokens: int) -> int:
    """Tokens a request is charged at admission: its input plus its output cap."""
    return input_tokens + max_tokens


def limit_checks(
    tenant: str,
    endpoint: str,
    limits: Limits,
    tokens: int,
    now: float,
    total_quota: int | None = None,
) -> list[Check]:
    """The checks one request must pass, for any store. `total_quota`: the tenant's
    monthly quota across all endpoints, if it has one."""
    checks: list[Check] = []
    if limits.rpm is not None:
        burst = limits.rpm_burst or _default_burst(limits.rpm)
        checks.append(RateCheck(f"rpm:{endpoint}:{tenant}", limits.rpm, burst, 1.0))
    checks.extend(token_checks(tenant, endpoint, limits, tokens, now, total_quota))
    return checks


def token_checks(
    tenant: str, endpoint: str, limits: Limits, tokens: float, at: float, total_quota: int | None
) -> list[Check]:
    """The limits counted in tokens, each costing `tokens`; quotas of the month of `at`."""
    checks: list[Check] = []
    if limits.tpm is not None:
        burst = limits.tpm_burst or _default_burst(limits.tpm)
        checks.append(RateCheck(f"tpm:{endpoint}:{tenant}", limits.tpm, burst, float(tokens)))
    if limits.monthly_quota_tokens is not None:
        checks.append(quota_check(tenant, endpoint, limits.monthly_quota_tokens, tokens, at))
    if total_quota is not None:
        checks.append(quota_check(tenant, None, total_quota, tokens, at))
    return checks


def quota_check(
    tenant: str, endpoint: str | None, limit: float, tokens: float, now: float
) -> QuotaCheck:
    """`endpoint` None: the tenant's quota across endpoints (a key of its own kind, since
    any name could be an endpoint's)."""
    scope = f"quota:{endpoint}" if endpoint is not None else "quota-total"
    return QuotaCheck(
        f"{scope}:{tenant}:{month_key(now)}", float(limit), float(tokens), month_end(now)
    )


@dataclass(slots=True, frozen=True)
class Settlement:
    """What a finished request still owes its token limits (`charge`, taken even past a
    limit: the tokens are spent) or is owed (`refund`: charged, never used)."""

    charge: tuple[Check, ...] = ()
    refund: tuple[Check, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.charge or self.refund)


def charged(checks: Sequence[Check]) -> tuple[Check, ...]:
    """What applying `checks` took: a rate check at most a full bucket (`gcra`)."""
    return tuple(
        replace(check, cost=min(check.cost, check.burst)) if isinstance(check, RateCheck) else check
        for check in checks
    )


def settlement(charges: Sequence[Check], used_tokens: float) -> Settlement:
    """Settle the token limits of a request that admission charged `charges` (as
    `charged` returns them) and that really used `used_tokens` (0: it never ran). Each
    limit is settled against what it took, in its own period, whatever the limits are
    now; requests per minute stay charged."""
    charge: list[Check] = []
    refund: list[Check] = []
    for check in charges:
        if isinstance(check, RateCheck) and not check.key.startswith("tpm:"):
            continue
        difference = used_tokens - check.cost
        if difference > 0:
            charge.append(replace(check, cost=difference))
        elif difference < 0:
            refund.append(replace(check, cost=-difference))
    return Settlement(tuple(charge), tuple(refund))


def _default_burst(per_minute: float) -> float:
    return max(1.0, math.floor(per_minute * DEFAULT_BURST_FRACTION))


class LimiterStore(Protocol):
    """Applies checks atomically: all pass and are charged, or the first failure is returned."""

    def apply(self, checks: list[Check], now: float) -> Decision: ...

    def settle(self, settlement: Settlement, now: float) -> None:
        """Charge `settlement.charge` unconditionally, give back `settlement.refund`."""
        ...


class MemoryLimiterStore:
    """The embedded default store: a dict per key, expired lazily."""

    def __init__(self) -> None:
        self._tat: dict[str, float] = {}
        self._used: dict[str, tuple[float, float]] = {}  # key -> (used, expires_at)

    def apply(self, checks: list[Check], now: float) -> Decision:
        updates_tat: list[tuple[str, float]] = []
        updates_used: list[tuple[str, float, float]] = []
        for check in checks:
            if isinstance(check, RateCheck):
                allowed, new_tat, retry = gcra(self._tat.get(check.key, now), now, check)
                if not allowed:
                    return rejection(check, retry)
                updates_tat.append((check.key, new_tat))
            else:
                used = self.quota_used(check.key, now)
                if used + check.cost > check.limit:
                    return rejection(check, check.expires_at - now)
                updates_used.append((check.key, used + check.cost, check.expires_at))
        for key, tat in updates_tat:
            self._tat[key] = tat
        for key, used, expires_at in updates_used:
            self._used[key] = (used, expires_at)
        self._forget_idle(now)
        return ADMITTED

    def settle(self, settlement: Settlement, now: float) -> None:
        for check in settlement.charge:
            if isinstance(check, RateCheck):
                self._tat[check.key] = charged_tat(self._tat.get(check.key, now), now, check)
            else:
                self._used[check.key] = (
                    self.quota_used(check.key, now) + check.cost,
                    check.expires_at,
                )
        for check in settlement.refund:
            if isinstance(check, RateCheck):
                self._tat[check.key] = refunded_tat(self._tat.get(check.key, now), now, check)
            elif check.key in self._used:
                used, expires_at = self._used[check.key]
                self._used[check.key] = (max(0.0, used - check.cost), expires_at)

    def set_quota_used(self, key: str, used: float, expires_at: float) -> None:
        """Take a counter's value from elsewhere (a store that keeps it durably)."""
        self._used[key] = (used, expires_at)

    def quota_used(self, key: str, now: float) -> float:
        used, expires_at = self._used.get(key, (0.0, math.inf))
        return used if now < expires_at else 0.0

    def _forget_idle(self, now: float) -> None:
        # A key whose tat has passed is indistinguishable from an absent one; dropping
        # those keeps memory bounded by the tenants active in the last bucket period.
        if len(self._tat) > 4096:
            self._tat = {k: t for k, t in self._tat.items() if t > now}
            self._used = {k: v for k, v in self._used.items() if v[1] > now}


def rejection(check: Check, retry_after_s: float) -> Decision:
    """The Decision for `check` failing, worded the same by every store."""
    if isinstance(check, RateCheck):
        kind = "requests" if check.key.startswith("rpm:") else "tokens"
        return Decision(
            check.outcome,
            f"limit of {check.per_minute:g} {kind} per minute exceeded",
            retry_after_s,
        )
    return Decision(
        check.outcome, f"monthly quota of {check.limit:.0f} tokens exhausted", retry_after_s
    )


def throttle(
    expected_wait_s: float,
    now: float,
    latency_target_s: float,
    deadline: float | None,
    waited_s: float = 0.0,
) -> Decision:
    """Reject at once a request whose queueing delay already misses its target (or its
    deadline); retry_after_s is how much the backlog must shrink first.

    `waited_s`: how long the request already waited before admission (in the broker);
    it counts against the latency target, not against the deadline, which is absolute.
    """
    budget, target = latency_target_s - waited_s, f"the {latency_target_s:g}s latency target"
    if deadline is not None and deadline - now < budget:
        budget, target = deadline - now, "the request's deadline"
    if expected_wait_s <= budget:
        return ADMITTED
    waited = f" after {waited_s:.1f}s waiting in the broker" if waited_s else ""
    return Decision(
        Outcome.OVERLOADED,
        f"expected wait {expected_wait_s:.1f}s{waited} exceeds {target}",
        expected_wait_s - budget,
    )


def scheduling_only(config: Config) -> Config:
    """`config` with admission out of the way, to study dispatch order alone.

    No rate limits, quotas or queue caps and no latency target (a request's own
    deadline still applies); every tenant is admitted into one tier with weight 1.
    Endpoints (profile, cost mode, caps, newcomer reserve) stay as they are.
    """
    endpoints = {
        name: msgspec.structs.replace(spec, latency_target_s=math.inf)
        for name, spec in config.endpoints.items()
    }
    return msgspec.structs.replace(
        config,
        endpoints=endpoints,
        tiers=[Tier(name="all")],
        tenants={},
        unlisted_tenants=UnlistedTenants(policy="admit", tier="all", weight=1.0),
    )
