"""One contract for both limiter stores: the in-process one (through its async adapter)
and Redis (the Lua script, against a real redis-server). Each contract test runs on both;
`test_random_sequences_match_memory_store` drives both with the same random sequences
and requires the same decision at every step."""

from __future__ import annotations

import asyncio
import random
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import nats
import pytest
import redis.asyncio as aioredis

from broker_config.config import BrokerSettings, load_config
from broker_config.server import EmbeddedRedisServer
from dispatcher.admission.kv_store import KvLimiterStore, open_limiter_store
from dispatcher.admission.redis_store import (
    DEFAULT_PREFIX,
    AsyncLimiterStore,
    LimiterUnavailable,
    MemoryLimiterAsync,
    RedisLimiterStore,
)
from dispatcher.core.limits import (
    Check,
    QuotaCheck,
    RateCheck,
    Settlement,
    month_end,
    quota_check,
)
from dispatcher.core.types import ADMITTED, Decision, Outcome

# Unix time of 2023-11-14: a realistic wall clock for the calendar-quota tests.
WALL_T0 = 1_700_000_000.0


@pytest.fixture(
    params=[
        "memory",
        pytest.param("redis", marks=pytest.mark.integration),
        pytest.param("nats-kv", marks=pytest.mark.integration),
    ]
)
async def store(request: pytest.FixtureRequest) -> AsyncIterator[AsyncLimiterStore]:
    limiter: AsyncLimiterStore
    nc = None
    if request.param == "memory":
        limiter = MemoryLimiterAsync()
    elif request.param == "redis":
        limiter = RedisLimiterStore.from_url(request.getfixturevalue("redis_url"))
    else:
        nc = await nats.connect(request.getfixturevalue("nats_url"))
        # Written behind often, so the contract also runs across writes.
        limiter = await KvLimiterStore.open(nc, BrokerSettings(), flush_s=0.01)
    yield limiter
    await limiter.aclose()
    if nc is not None:
        await nc.close()


def rejected(outcome: Outcome, message: str, retry_after_s: float) -> Decision:
    return Decision(outcome, message, retry_after_s)


def assert_decision(actual: Decision, expected: Decision) -> None:
    assert actual.outcome is expected.outcome
    assert actual.message == expected.message
    if expected.retry_after_s is None:
        assert actual.retry_after_s is None
    else:
        assert actual.retry_after_s == pytest.approx(expected.retry_after_s, abs=1e-6)


# -- the contract, on both stores ------------------------------------------------------


async def test_burst_then_one_request_per_interval(store: AsyncLimiterStore) -> None:
    rpm = RateCheck("rpm:chat:acme", per_minute=60, burst=3, cost=1)
    for _ in range(3):
        assert await store.apply([rpm], 100.0) == ADMITTED
    limited = rejected(Outcome.RATE_LIMITED, "limit of 60 requests per minute exceeded", 1.0)
    assert_decision(await store.apply([rpm], 100.0), limited)
    assert_decision(
        await store.apply([rpm], 100.4), rejected(Outcome.RATE_LIMITED, limited.message, 0.6)
    )
    assert await store.apply([rpm], 101.0) == ADMITTED
    assert_decision(await store.apply([rpm], 101.0), limited)


async def test_request_on_its_emission_time_passes_despite_float_error(
    store: AsyncLimiterStore,
) -> None:
    # Interval 0.1: the tat after three steps is 0.30000000000000004, past now=0.3 by one
    # rounding error, which the clock epsilon forgives.
    rpm = RateCheck("rpm:chat:acme", per_minute=600, burst=1, cost=1)
    for now in (0.0, 0.1, 0.2, 0.3):
        assert await store.apply([rpm], now) == ADMITTED
    assert (await store.apply([rpm], 0.35)).outcome is Outcome.RATE_LIMITED


async def test_first_failing_check_decides_and_nothing_is_charged(store: AsyncLimiterStore) -> None:
    rpm = RateCheck("rpm:chat:acme", per_minute=60, burst=2, cost=1)
    tpm = RateCheck("tpm:chat:acme", per_minute=600, burst=10, cost=50)
    quota = QuotaCheck("quota:chat:acme:x", limit=10, cost=11, expires_at=200.0)

    # rpm and tpm would pass, the quota fails: its rejection, and no one is charged.
    assert_decision(
        await store.apply([rpm, tpm, quota], 100.0),
        rejected(Outcome.QUOTA_EXCEEDED, "monthly quota of 10 tokens exhausted", 100.0),
    )
    assert await store.apply([rpm], 100.0) == ADMITTED
    assert await store.apply([rpm], 100.0) == ADMITTED
    assert await store.apply([QuotaCheck(quota.key, 10, 10, 200.0)], 100.0) == ADMITTED

    # Now rpm and the quota both fail: the first one in the list decides.
    assert_decision(
        await store.apply([rpm, quota], 100.0),
        rejected(Outcome.RATE_LIMITED, "limit of 60 requests per minute exceeded", 1.0),
    )
    assert_decision(
        await store.apply([quota, rpm], 100.0),
        rejected(Outcome.QUOTA_EXCEEDED, "monthly quota of 10 tokens exhausted", 100.0),
    )
    # tpm was never charged: its whole bucket is still there (capped cost, see below).
    assert await store.apply([tpm], 100.0) == ADMITTED


async def test_check_outcome_is_the_rejections_outcome(store: AsyncLimiterStore) -> None:
    custom = RateCheck("rpm:embed:acme", per_minute=6, burst=1, cost=1, outcome=Outcome.OVERLOADED)
    assert await store.apply([custom], 0.0) == ADMITTED
    assert_decision(
        await store.apply([custom], 0.0),
        rejected(Outcome.OVERLOADED, "limit of 6 requests per minute exceeded", 10.0),
    )


async def test_request_bigger_than_bucket_is_charged_a_full_bucket(
    store: AsyncLimiterStore,
) -> None:
    big = RateCheck("tpm:chat:acme", per_minute=600, burst=50, cost=5000)
    small = RateCheck("tpm:chat:acme", per_minute=600, burst=50, cost=1)
    assert await store.apply([big], 0.0) == ADMITTED  # from an idle key: the whole bucket
    assert_decision(
        await store.apply([small], 0.0),
        rejected(Outcome.RATE_LIMITED, "limit of 600 tokens per minute exceeded", 0.1),
    )
    assert_decision(
        await store.apply([big], 0.0),
        rejected(Outcome.RATE_LIMITED, "limit of 600 tokens per minute exceeded", 5.0),
    )
    assert await store.apply([small], 0.1) == ADMITTED
    assert await store.apply([big], 5.1) == ADMITTED  # a full bucket again after 5 s


async def test_quota_resets_at_the_end_of_its_period(store: AsyncLimiterStore) -> None:
    end = month_end(WALL_T0)
    now = end - 10.0
    november = quota_check("acme", "chat", 100, 60, now)
    assert november.expires_at == end
    assert await store.apply([november], now) == ADMITTED
    assert_decision(
        await store.apply([november], now),
        rejected(Outcome.QUOTA_EXCEEDED, "monthly quota of 100 tokens exhausted", 10.0),
    )
    assert_decision(
        await store.apply([november], end - 1e-3),
        rejected(Outcome.QUOTA_EXCEEDED, "monthly quota of 100 tokens exhausted", 1e-3),
    )

    # At the period's end the counter is gone, even under the same key...
    assert await store.apply([november], end) == ADMITTED
    # ...and the next month's checks have their own key.
    december = quota_check("acme", "chat", 100, 100, end)
    assert december.key != november.key
    assert await store.apply([december], end) == ADMITTED
    assert (await store.apply([december], end)).outcome is Outcome.QUOTA_EXCEEDED


async def test_refund_gives_quota_back_but_never_below_zero(store: AsyncLimiterStore) -> None:
    def spend(cost: float, key: str = "quota:chat:acme:x") -> QuotaCheck:
        return QuotaCheck(key, limit=100, cost=cost, expires_at=1000.0)

    assert await store.apply([spend(80)], 0.0) == ADMITTED
    assert (await store.apply([spend(30)], 0.0)).outcome is Outcome.QUOTA_EXCEEDED
    await store.settle(Settlement(refund=(spend(50),)), 0.0)  # used: 30
    assert await store.apply([spend(30)], 1.0) == ADMITTED  # used: 60
    assert (await store.apply([spend(41)], 1.0)).outcome is Outcome.QUOTA_EXCEEDED
    assert await store.apply([spend(40)], 1.0) == ADMITTED  # used: exactly the limit

    await store.settle(Settlement(refund=(spend(1e6),)), 1.0)  # back to zero, not below
    assert await store.apply([spend(100)], 2.0) == ADMITTED
    assert (await store.apply([spend(1)], 2.0)).outcome is Outcome.QUOTA_EXCEEDED

    await store.settle(Settlement(refund=(spend(50, key="quota:chat:other:x"),)), 2.0)  # no credit
    assert await store.apply([spend(100, key="quota:chat:other:x")], 2.0) == ADMITTED
    assert (
        await store.apply([spend(1, key="quota:chat:other:x")], 2.0)
    ).outcome is Outcome.QUOTA_EXCEEDED


async def test_a_charge_is_taken_past_the_limit_and_delays_what_follows(
    store: AsyncLimiterStore,
) -> None:
    """Usage beyond what admission charged (an under-declared input) is charged on
    completion whatever the limit: the tenant then waits until it is paid back."""
    tpm = RateCheck("tpm:chat:acme", per_minute=600, burst=100, cost=10)
    quota = QuotaCheck("quota:chat:acme:x", limit=100, cost=10, expires_at=1000.0)
    assert await store.apply([tpm, quota], 0.0) == ADMITTED
    await store.settle(
        Settlement(
            charge=(RateCheck(tpm.key, 600, 100, 290), QuotaCheck(quota.key, 100, 290, 1000.0))
        ),
        0.0,
    )
    # 300 tokens taken from a bucket of 100 at 10 per second: 20 s of debt first.
    assert_decision(
        await store.apply([tpm], 0.0),
        rejected(Outcome.RATE_LIMITED, "limit of 600 tokens per minute exceeded", 21.0),
    )
    assert await store.apply([tpm], 21.0) == ADMITTED
    assert_decision(
        await store.apply([QuotaCheck(quota.key, 100, 1, 1000.0)], 21.0),
        rejected(Outcome.QUOTA_EXCEEDED, "monthly quota of 100 tokens exhausted", 979.0),
    )


async def test_a_rate_refund_gives_tokens_back_up_to_a_full_bucket(
    store: AsyncLimiterStore,
) -> None:
    tpm = RateCheck("tpm:chat:acme", per_minute=600, burst=100, cost=100)
    assert await store.apply([tpm], 0.0) == ADMITTED
    one = RateCheck(tpm.key, 600, 100, 1)
    assert (await store.apply([one], 0.0)).outcome is Outcome.RATE_LIMITED
    await store.settle(Settlement(refund=(RateCheck(tpm.key, 600, 100, 60),)), 0.0)
    assert await store.apply([RateCheck(tpm.key, 600, 100, 60)], 0.0) == ADMITTED
    assert (await store.apply([one], 0.0)).outcome is Outcome.RATE_LIMITED
    # Given back far more than was taken: a full bucket, not more.
    await store.settle(Settlement(refund=(RateCheck(tpm.key, 600, 100, 10_000),)), 1.0)
    assert await store.apply([RateCheck(tpm.key, 600, 100, 100)], 1.0) == ADMITTED
    assert (await store.apply([one], 1.0)).outcome is Outcome.RATE_LIMITED


async def test_concurrent_applies_admit_exactly_the_bucket(store: AsyncLimiterStore) -> None:
    rpm = RateCheck("rpm:chat:acme", per_minute=60, burst=10, cost=1)
    decisions = await asyncio.gather(*(store.apply([rpm], 50.0) for _ in range(40)))
    assert sum(decision.admitted for decision in decisions) == 10


@pytest.mark.parametrize(
    ("checks", "now", "error"),
    [
        ([RateCheck("rpm:a", per_minute=0, burst=1, cost=1)], 0.0, "per_minute must be"),
        ([RateCheck("rpm:a", per_minute=60, burst=0, cost=1)], 0.0, "burst must be"),
        ([RateCheck("rpm:a", per_minute=60, burst=1, cost=-1)], 0.0, "cost must be"),
        ([RateCheck("rpm:a", per_minute=float("inf"), burst=1, cost=1)], 0.0, "per_minute"),
        ([QuotaCheck("quota:a", limit=-1, cost=1, expires_at=9.0)], 0.0, "limit must be"),
        ([QuotaCheck("quota:a", limit=1, cost=float("nan"), expires_at=9.0)], 0.0, "cost must"),
        ([QuotaCheck("quota:a", limit=1, cost=1, expires_at=float("nan"))], 0.0, "expires_at"),
        ([QuotaCheck("", limit=1, cost=1, expires_at=9.0)], 0.0, "non-empty"),
        ([RateCheck("rpm:a", per_minute=60, burst=1, cost=1)], float("nan"), "now must be"),
        (["rpm:a"], 0.0, "not a limiter check"),
    ],
)
async def test_bad_checks_raise_a_clear_error_and_charge_nothing(
    store: AsyncLimiterStore, checks: list[Check], now: float, error: str
) -> None:
    valid = RateCheck("rpm:b", per_minute=60, burst=1, cost=1)
    with pytest.raises(ValueError, match=error):
        await store.apply([valid, *checks], now)
    assert await store.apply([valid], 0.0) == ADMITTED


async def test_a_settlement_with_a_bad_check_is_refused(store: AsyncLimiterStore) -> None:
    with pytest.raises(ValueError, match="per_minute must be a finite number > 0"):
        await store.settle(Settlement(charge=(RateCheck("rpm:a", 0, 1, 1),)), 0.0)
    with pytest.raises(ValueError, match="cost must be a finite number >= 0"):
        await store.settle(Settlement(refund=(QuotaCheck("quota:a", 10, -1, 5.0),)), 0.0)


async def test_no_checks_admit(store: AsyncLimiterStore) -> None:
    assert await store.apply([], 0.0) == ADMITTED


# -- Redis and memory side by side -----------------------------------------------------


@dataclass(frozen=True)
class RateKey:
    key: str
    per_minute: float
    burst: float


RATE_KEYS = [
    RateKey("rpm:chat:a", 60, 3),
    RateKey("tpm:chat:a", 600, 50),
    RateKey("rpm:chat:b", 180, 1),
]
QUOTA_KEYS = ["quota:chat:a", "quota:chat:b"]
QUOTA_PERIOD_S = 20.0
QUOTA_LIMIT = 120.0


def random_check(rng: random.Random, now: float) -> Check:
    if rng.random() < 0.7:
        spec = rng.choice(RATE_KEYS)
        per_minute = spec.per_minute if rng.random() < 0.9 else rng.uniform(1, 1000)
        cost = rng.choice([1.0, float(rng.randint(1, 10)), rng.uniform(0, spec.burst * 1.5)])
        return RateCheck(spec.key, per_minute, spec.burst, cost)
    period_end = (now // QUOTA_PERIOD_S + 1) * QUOTA_PERIOD_S
    # Sometimes a check from the previous period, as a late refund computes one.
    expires_at = period_end if rng.random() < 0.9 else period_end - QUOTA_PERIOD_S
    return QuotaCheck(
        rng.choice(QUOTA_KEYS),
        QUOTA_LIMIT,
        rng.choice([float(rng.randint(1, 40)), rng.uniform(0, 60)]),
        expires_at,
    )


def random_step(rng: random.Random, now: float) -> float:
    """The next time: often the same instant, often exactly on an emission time."""
    return now + rng.choice(
        [
            0.0,
            0.0,
            1.0,
            1.0 / 3.0,
            0.1,
            rng.expovariate(1.0),
            rng.uniform(0, 1e-6),
            rng.uniform(0, 30),
        ]
    )


@pytest.mark.integration
async def test_random_sequences_match_memory_store(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    outcomes: dict[Outcome, int] = {}
    try:
        for seed in range(12):
            rng = random.Random(seed)
            memory = MemoryLimiterAsync()
            # A prefix per sequence keeps each one's keys apart in the shared Redis.
            redis_store = RedisLimiterStore(client, prefix=f"seq{seed}:")
            now = rng.uniform(0, 1e6)
            for step in range(150):
                now = random_step(rng, now)
                if rng.random() < 0.15:
                    checks = tuple(random_check(rng, now) for _ in range(rng.randint(1, 3)))
                    settled = (
                        Settlement(charge=checks)
                        if rng.random() < 0.5
                        else Settlement(refund=checks)
                    )
                    await memory.settle(settled, now)
                    await redis_store.settle(settled, now)
                    continue
                checks = [random_check(rng, now) for _ in range(rng.randint(1, 4))]
                expected = await memory.apply(checks, now)
                actual = await redis_store.apply(checks, now)
                context = f"seed {seed} step {step} now {now!r} checks {checks}"
                assert actual.outcome is expected.outcome, context
                assert actual.message == expected.message, context
                assert (actual.retry_after_s is None) == (expected.retry_after_s is None)
                if expected.retry_after_s is not None:
                    assert actual.retry_after_s == pytest.approx(
                        expected.retry_after_s, abs=1e-6
                    ), context
                outcomes[expected.outcome] = outcomes.get(expected.outcome, 0) + 1
    finally:
        await client.aclose()
    # The sequences reach every branch, often.
    for outcome in (Outcome.ADMITTED, Outcome.RATE_LIMITED, Outcome.QUOTA_EXCEEDED):
        assert outcomes.get(outcome, 0) >= 50, outcomes


# -- Redis only: keys, expiry, script cache, outages ------------------------------------


async def _pttl(client: aioredis.Redis, key: str) -> int:
    return int(await client.pttl(key))


@pytest.mark.integration
async def test_keys_live_until_their_state_stops_mattering(redis_url: str) -> None:
    # Virtual time near zero, far from Redis's clock: expiry is relative to `now`.
    store = RedisLimiterStore.from_url(redis_url, prefix="t:")
    client = aioredis.Redis.from_url(redis_url)
    try:
        rpm = RateCheck("rpm:chat:acme", per_minute=60, burst=5, cost=3)  # tat = now + 3 s
        quota = QuotaCheck("quota:chat:acme:x", limit=100, cost=1, expires_at=110.0)
        assert await store.apply([rpm, quota], 100.0) == ADMITTED
        assert sorted(await client.keys("*")) == [
            b"t:tat:rpm:chat:acme",
            b"t:used:quota:chat:acme:x",
        ]
        # Remaining time plus the default one-second grace, in milliseconds.
        assert 3500 < await _pttl(client, "t:tat:rpm:chat:acme") <= 4000
        assert 10500 < await _pttl(client, "t:used:quota:chat:acme:x") <= 11000
        # A refund keeps the TTL.
        await store.settle(Settlement(refund=(QuotaCheck(quota.key, 100, 1, 110.0),)), 100.5)
        assert 10500 < await _pttl(client, "t:used:quota:chat:acme:x") <= 11000
    finally:
        await store.aclose()
        await client.aclose()


@pytest.mark.integration
async def test_idle_keys_disappear(redis_url: str) -> None:
    store = RedisLimiterStore.from_url(redis_url, expiry_grace_s=0.0)
    client = aioredis.Redis.from_url(redis_url)
    try:
        rpm = RateCheck("rpm:chat:acme", per_minute=600, burst=1, cost=1)  # tat + 0.1 s
        quota = QuotaCheck("quota:chat:acme:x", limit=100, cost=1, expires_at=0.3)
        assert await store.apply([rpm, quota], 0.0) == ADMITTED
        assert await client.dbsize() == 2
        assert 0 < await _pttl(client, f"{DEFAULT_PREFIX}tat:rpm:chat:acme") <= 100
        deadline = time.monotonic() + 5.0
        while await client.dbsize() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert await client.dbsize() == 0
        # A key whose state has already passed is not written at all.
        assert await store.apply([QuotaCheck("quota:old", 100, 1, -5.0)], 0.0) == ADMITTED
        assert await client.dbsize() == 0
    finally:
        await store.aclose()
        await client.aclose()


@pytest.mark.integration
async def test_script_is_loaded_again_after_redis_forgets_it(redis_url: str) -> None:
    store = RedisLimiterStore.from_url(redis_url)
    client = aioredis.Redis.from_url(redis_url)
    try:
        rpm = RateCheck("rpm:chat:acme", per_minute=60, burst=1, cost=1)
        assert await store.apply([rpm], 0.0) == ADMITTED
        await client.script_flush()
        assert (await store.apply([rpm], 0.0)).outcome is Outcome.RATE_LIMITED
    finally:
        await store.aclose()
        await client.aclose()


def _closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_unreachable_redis_raises_instead_of_deciding() -> None:
    store = RedisLimiterStore.from_url(f"redis://127.0.0.1:{_closed_port()}/0")
    rpm = RateCheck("rpm:chat:acme", per_minute=60, burst=1, cost=1)
    try:
        with pytest.raises(LimiterUnavailable, match="redis limiter store failed"):
            await store.apply([rpm], 0.0)
        with pytest.raises(LimiterUnavailable):
            await store.settle(Settlement(refund=(QuotaCheck("quota:a", 10, 1, 5.0),)), 0.0)
    finally:
        await store.aclose()


@pytest.mark.integration
async def test_redis_crash_raises_then_recovers(redis_binary: Path) -> None:
    server = EmbeddedRedisServer(binary=redis_binary)
    await asyncio.to_thread(server.start)
    store = RedisLimiterStore.from_url(server.url)
    rpm = RateCheck("rpm:chat:acme", per_minute=60, burst=1, cost=1)
    try:
        assert await store.apply([rpm], 0.0) == ADMITTED
        server.kill()
        started = time.monotonic()
        with pytest.raises(LimiterUnavailable):
            await store.apply([rpm], 1.0)
        assert time.monotonic() - started < 5.0  # fails fast, does not hang admission
        # Back on the same port, empty and without the script: it is loaded again.
        await asyncio.to_thread(server.start)
        assert await store.apply([rpm], 2.0) == ADMITTED
        assert (await store.apply([rpm], 2.0)).outcome is Outcome.RATE_LIMITED
    finally:
        await store.aclose()
        await asyncio.to_thread(server.stop)


@pytest.mark.integration
async def test_the_redis_url_picks_the_store(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        embedded = await open_limiter_store(None, nc, load_config())
        assert isinstance(embedded, KvLimiterStore)
        await embedded.aclose()
        store = await open_limiter_store("redis://127.0.0.1:1/0", nc, load_config())
        assert isinstance(store, RedisLimiterStore)
        await store.aclose()
        with pytest.raises(ValueError, match="scheme"):
            await open_limiter_store("http://127.0.0.1:6379", nc, load_config())
    finally:
        await nc.close()
    with pytest.raises(ValueError, match="expiry_grace_s"):
        RedisLimiterStore.from_url("redis://127.0.0.1:1/0", expiry_grace_s=-1.0)
