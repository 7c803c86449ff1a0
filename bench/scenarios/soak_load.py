"""The soak's load (`bench.scenarios.soak`): its settings, its tenants by kind, their
arrivals, and the garbage bodies some of them send.

Kinds: steady (Poisson), bursty (bursts, then silence), flood (more than a tenant's
window at once, again), idle (one or two requests, then silence), garbage (bodies that
break the contract) and, with churn, once (new unlisted tenants that send one request).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

from bench.harness.measured import Arrival
from broker_config.wire import ErrorCode
from dispatcher.intake.shards import PARKED_CONSUMER_IDLE_S

KINDS = ("steady", "bursty", "flood", "idle", "garbage", "once")
# The kinds given a share of `tenants` (steady: the rest); `once` tenants come on top.
SHARED = KINDS[1:5]
INVALID = ErrorCode.INVALID_REQUEST.value
# Bodies that break the contract (docs/protocol.md), one drawn per garbage request.
GARBAGE = (
    b"\xff\xfe not json",
    b"",
    b"null",
    b"[1, 2, 3]",
    b'{"prompt": 42, "max_tokens": 8}',
    b'{"prompt": "hi", "max_tokens": "eight"}',
    b'{"prompt": "hi", "max_tokens": 8, "temperature": 0.7}',
    b'{"prompt": "hi", "max_tokens": 0}',
    b'{"max_tokens": 8}',
    b'{"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}',
    b'{"prompt": "hi", "id": "not-the-header-id"}',
)
# How long after the parked consumers' idle threshold the server has to remove them.


@dataclass(frozen=True, slots=True)
class Settings:
    minutes: float = 10.0
    tenants: int = 1_000
    seed: int = 1
    warmup_s: float = 120.0
    listed_share: float = 0.8
    # Shares of the tenants by kind; the rest are steady.
    bursty_share: float = 0.25
    flood_share: float = 0.01
    idle_share: float = 0.25
    garbage_share: float = 0.04
    # New unlisted tenants per second on top of `tenants`, one request each and never
    # again (churn: what a dispatcher keeps per tenant it has seen shows as growth).
    churn_per_s: float = 0.0
    steady_rate_per_s: tuple[float, float] = (0.02, 0.2)  # uniform, per tenant
    burst_size: tuple[int, int] = (20, 80)
    burst_gap_s: tuple[float, float] = (60.0, 240.0)
    flood_size: int = 500
    flood_gap_s: tuple[float, float] = (180.0, 300.0)
    idle_within_s: float = 60.0
    garbage_gap_s: float = 20.0
    # Short prompts: the engine's prefill (8,000 tokens/s) leaves room for bursts.
    input_tokens: tuple[int, int] = (8, 96)
    max_tokens: tuple[int, int] = (1, 16)  # the simulated engine draws [1, max_tokens]
    workers: int = 2
    time_scale: float = 0.5
    sample_s: float = 5.0
    finish_timeout_s: float = 120.0
    settle_s: float = PARKED_CONSUMER_IDLE_S + 15.0
    rss_goal: float = 0.10

    @property
    def duration_s(self) -> float:
        return 60.0 * self.minutes

    def __post_init__(self) -> None:
        if not 0 < self.warmup_s < self.duration_s:
            raise ValueError(
                f"the warm-up ({self.warmup_s:g} s) must end within the load "
                f"({self.duration_s:g} s)"
            )
        if self.tenants < len(SHARED) + 1:
            raise ValueError(f"at least {len(SHARED) + 1} tenants, one of each kind")


# About 70 s in all with the stack's start and stop: a CI smoke test.
SMOKE = Settings(
    minutes=0.75,
    tenants=100,
    warmup_s=15.0,
    burst_gap_s=(10.0, 30.0),
    flood_size=300,
    flood_gap_s=(15.0, 30.0),
    idle_within_s=10.0,
    garbage_gap_s=5.0,
    sample_s=2.0,
    finish_timeout_s=30.0,
    settle_s=4.0,
)


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    kind: str
    listed: bool


# -- the load ------------------------------------------------------------------------------


def make_tenants(settings: Settings, rng: random.Random) -> list[Tenant]:
    """The kinds by share (at least one of each but steady, the rest steady), listed or
    not at random, then the churn's unlisted `once` tenants; names say the kind."""
    n = settings.tenants
    counts = {kind: max(1, round(n * getattr(settings, f"{kind}_share"))) for kind in SHARED}
    counts = {"steady": n - sum(counts.values())} | counts
    if counts["steady"] < 1:
        raise ValueError("the shares leave no steady tenant")
    kinds = [kind for kind, count in counts.items() for _ in range(count)]
    rng.shuffle(kinds)
    numbers: Counter[str] = Counter()
    tenants = []
    for kind in kinds:
        tenants.append(Tenant(f"{kind}{numbers[kind]}", kind, rng.random() < settings.listed_share))
        numbers[kind] += 1
    once = round(settings.churn_per_s * settings.duration_s)
    return tenants + [Tenant(f"once{n}", "once", False) for n in range(once)]


def schedule(tenants: list[Tenant], settings: Settings, rng: random.Random) -> list[Arrival]:
    """Every tenant's arrivals over the load's duration, by kind (see the module doc)."""
    end = settings.duration_s

    def request(tenant: Tenant, at: float) -> Arrival:
        return Arrival(
            tenant.name, at, rng.randint(*settings.input_tokens), rng.randint(*settings.max_tokens)
        )

    def poisson(rate: float) -> list[float]:
        times, at = [], rng.expovariate(rate)
        while at < end:
            times.append(at)
            at += rng.expovariate(rate)
        return times

    def bursts(gap_s: tuple[float, float]) -> list[float]:
        starts, at = [], rng.uniform(0.0, gap_s[1])  # tenants start spread out
        while at < end:
            starts.append(at)
            at += rng.uniform(*gap_s)
        return starts

    arrivals: list[Arrival] = []
    for tenant in tenants:
        if tenant.kind == "steady":
            times = poisson(rng.uniform(*settings.steady_rate_per_s))
        elif tenant.kind == "bursty":
            times = [
                start + rng.uniform(0.0, 1.0)
                for start in bursts(settings.burst_gap_s)
                for _ in range(rng.randint(*settings.burst_size))
            ]
        elif tenant.kind == "flood":
            times = [
                start for start in bursts(settings.flood_gap_s) for _ in range(settings.flood_size)
            ]
        elif tenant.kind == "idle":
            times = [rng.uniform(0.0, settings.idle_within_s) for _ in range(rng.randint(1, 2))]
        elif tenant.kind == "garbage":
            times = poisson(1.0 / settings.garbage_gap_s)
        else:
            times = [rng.uniform(0.0, end)]
        arrivals += [request(tenant, at) for at in sorted(times) if at < end]
    return arrivals
