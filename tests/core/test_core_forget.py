"""Tenants that come once leave nothing behind: idle flows are forgotten
(`EndpointQueues.forget_idle`) when their state would change no decision, and after
`DEBT_MEMORY_S` idle whatever they owe; unlisted tenants' policies are not kept per name."""

from __future__ import annotations

import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker_config.config import Config, UnlistedTenants
from broker_config.registry import Registry
from costmodel.units import Capacity, Usage
from dispatcher.core.endpoint import DEBT_MEMORY_S
from dispatcher.core.limits import MemoryLimiterStore
from dispatcher.core.scheduler import Scheduler
from tests.core_support import make_config, req

SLOTS = Capacity(4, 10**9, 1e12)
# Token-bound too: large heads do not fit and are set aside (or block, under FIFO).
ROOM = Capacity(4, 300, 1e12)
TENANTS = {f"t{n}": ("gold" if n % 3 else "silver", 1.0 + n % 2) for n in range(8)}


def run(policy: str, cost: str, seed: int, *, forget: bool) -> list[list[str]]:
    """A seeded random workload (sparse and busy tenants, deadlines that expire, cancels,
    requests given back by a failed worker, completions with usage other than
    estimated, output reported as generated); what each step dispatches and expires.
    With `forget`, idle flows are swept after every step, as the dispatcher does now and
    then, before any debt is old enough to be forgiven."""
    rng = random.Random(seed)
    scheduler = Scheduler(make_config(cost=cost, tenants=TENANTS), policy=policy)
    store = MemoryLimiterStore()
    running: list[tuple[str, str, int]] = []
    admitted: list[tuple[str, str]] = []
    steps, numbers = [], iter(range(10**6))
    for step in range(300):
        now = float(step)
        for _ in range(rng.choice((0, 0, 1, 3))):
            tenant = rng.choice(list(TENANTS))
            request = req(
                tenant,
                next(numbers),
                arrival=now,
                input_tokens=rng.randint(1, 80),
                max_tokens=rng.randint(1, 120),
                deadline=now + rng.randint(1, 30) if rng.random() < 0.2 else None,
            )
            assert scheduler.admit(request, now, store).admitted
            admitted.append((tenant, request.id))
        if admitted and rng.random() < 0.2:
            scheduler.cancel(*rng.choice(admitted))
        if running and rng.random() < 0.1:
            tenant, request_id, _ = running.pop(rng.randrange(len(running)))
            scheduler.requeue(tenant, request_id)
        if running and rng.random() < 0.5:
            scheduler.progress([((t, i), rng.randint(0, m)) for t, i, m in running])
        for t, i, m in [
            running.pop(rng.randrange(len(running)))
            for _ in range(min(len(running), rng.randint(0, 3)))
        ]:
            scheduler.complete(t, i, Usage(10, rng.randint(1, m), 0.0), now)
        expired = [f"{r.tenant}/{r.id}" for r in scheduler.expire(now)]
        batch = scheduler.next_batch("ep", ROOM, now, SLOTS)
        steps.append(expired + [f"{r.tenant}/{r.id}" for r in batch.requests])
        running += [(r.tenant, r.id, r.max_tokens) for r in batch.requests]
        if forget:
            scheduler.endpoints["ep"].forget_idle(now)
    return steps


@pytest.mark.parametrize("policy", ["fairq", "vtc", "fifo"])
@pytest.mark.parametrize("cost", ["token", "model_units"])
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32))
def test_forgetting_idle_flows_changes_no_decision(policy: str, cost: str, seed: int) -> None:
    assert run(policy, cost, seed, forget=True) == run(policy, cost, seed, forget=False)


def churn(scheduler: Scheduler, tenants: int, now: float) -> None:
    """`tenants` one-request tenants, each served and finished at `now`."""
    store = MemoryLimiterStore()
    for n in range(tenants):
        request = req(f"once{n}", 0, arrival=now, input_tokens=10, max_tokens=50)
        assert scheduler.admit(request, now, store).admitted
        assert scheduler.next_batch("ep", SLOTS, now).requests == [request]
        scheduler.complete(f"once{n}", "0", Usage(10, 50, 0.0), now)


def test_tenants_that_come_once_leave_no_flow_behind() -> None:
    config = make_config(tenants={"a": ("gold", 1.0)})
    scheduler = Scheduler(with_unlisted(config), policy="fairq")
    churn(scheduler, 500, 0.0)
    queues = scheduler.endpoints["ep"]
    assert len(queues.flows) == 500
    # Token mode charges at dispatch alone: each left at the floor the next joined at.
    assert queues.forget_idle(1.0) == 500 and not queues.flows


def test_a_debt_is_kept_until_repaid_or_old() -> None:
    config = make_config(cost="model_units", tenants={"a": ("gold", 1.0)})
    scheduler = Scheduler(with_unlisted(config), policy="fairq")
    # Each left at its prompt's charge, then owed its output, charged at completion.
    churn(scheduler, 3, 0.0)
    queues = scheduler.endpoints["ep"]
    floor = queues.selector.tiers[0].floor()
    assert all(queues.selector.standing(flow) > floor for flow in queues.flows.values())
    assert queues.forget_idle(DEBT_MEMORY_S - 1) == 0
    assert queues.forget_idle(DEBT_MEMORY_S) == 3 and not queues.flows


def test_an_unlisted_tenants_policy_is_made_per_call_not_kept() -> None:
    registry = Registry(with_unlisted(make_config(tenants={"a": ("gold", 1.0)})))
    first, again = registry.tenant("x1"), registry.tenant("x1")
    assert first == again and first.name == "x1" and registry.tenant("x2").name == "x2"
    assert registry.tenant("x2").limits is first.limits  # one resolution, shared
    assert set(registry._policies) == {"a"}


def with_unlisted(config: Config) -> Config:
    return msgspec.structs.replace(
        config, unlisted_tenants=UnlistedTenants(policy="admit", tier="gold", weight=1.0)
    )
