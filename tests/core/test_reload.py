"""A new configuration applied to a running scheduler (dispatcher/core/reconfigure.py):
queues kept in order across a tier move, weights and limits in force at once, a removed
tenant's queued requests handed back, an invalid reload refused whole."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker_config.config import ConfigError, Limits, parse_config
from costmodel.units import Capacity, Usage
from dispatcher.core.limits import MemoryLimiterStore
from dispatcher.core.reconfigure import UNLISTED, ReloadError, tenant_changes
from dispatcher.core.scheduler import Scheduler
from dispatcher.core.types import Decision, Outcome
from tests.core_support import ONE_SLOT, make_config, req

USED = Usage(1, 1, 1.0)


def admit(scheduler: Scheduler, requests, now: float = 0.0) -> None:
    store = MemoryLimiterStore()
    for request in requests:
        assert scheduler.admit(request, now, store).admitted, request


def dispatch_one(scheduler: Scheduler, now: float = 0.0, complete: bool = True) -> str | None:
    """`tenant/id` of the next request dispatched on a one-slot worker (completed at once
    unless `complete` is false), None when nothing is queued."""
    batch = scheduler.next_batch("ep", ONE_SLOT, now).requests
    if not batch:
        return None
    request = batch[0]
    if complete:
        assert scheduler.complete(request.tenant, request.id, USED, now) is not None
    return f"{request.tenant}/{request.id}"


def drain(scheduler: Scheduler, now: float = 0.0) -> list[str]:
    order = []
    while (name := dispatch_one(scheduler, now)) is not None:
        order.append(name)
    return order


def assert_counts_consistent(scheduler: Scheduler) -> None:
    """The endpoint's running sums equal a count from scratch."""
    endpoint = scheduler.endpoints["ep"]
    flows = {flow for _, flow in scheduler._running.values()} | set(endpoint.flows.values())
    present = [f for f in flows if len(f.queue) or f.running]
    assert endpoint.present_flows == len(present)
    assert endpoint.backlogged_flows == sum(1 for f in flows if len(f.queue))
    assert endpoint.present_weight == pytest.approx(sum(f.weight for f in present))
    by_rank = [0.0] * len(scheduler.config.tiers)
    for flow in present:
        by_rank[flow.tier_rank] += flow.weight
    assert endpoint.present_weight_by_rank == pytest.approx(by_rank)
    assert endpoint.running == sum(f.running for f in flows)


def mixed():
    """a's requests: priorities, a deadline, arrivals."""
    return [
        req("a", 1, arrival=0.0),
        req("a", 2, arrival=1.0, priority=5),
        req("a", 3, arrival=2.0, deadline=50.0),
        req("a", 4, arrival=3.0, priority=5),
        req("a", 5, arrival=4.0),
    ]


def test_a_tenant_moved_up_a_tier_keeps_its_order_and_runs_ahead_of_its_old_tier():
    tenants = {"a": ("bronze", 1.0), "b": ("bronze", 1.0), "c": ("silver", 1.0)}
    config = make_config(cost="request", tenants=tenants)
    moved = make_config(cost="request", tenants={**tenants, "a": ("gold", 1.0)})
    reference, scheduler = Scheduler(config), Scheduler(config)
    for each in (reference, scheduler):
        admit(
            each,
            [req("b", n, arrival=n) for n in range(5)]
            + [req("c", n, arrival=n) for n in range(5)]
            + mixed(),
        )
        assert dispatch_one(each, complete=False) == "c/0"  # runs across the reload
    # Before: a (bronze) comes after silver's c. After: first, in its own order.
    a_before = [n for n in drain(reference) if n.startswith("a/")]
    assert a_before == ["a/2", "a/4", "a/3", "a/1", "a/5"]  # priority, deadline, arrival
    assert scheduler.reconfigure(moved, 1.0) == []
    assert scheduler.flow("ep", "a").tier_rank == 0
    assert_counts_consistent(scheduler)
    assert drain(scheduler, 1.0)[:5] == a_before
    assert scheduler.complete("c", "0", USED, 2.0) is not None
    assert_counts_consistent(scheduler)
    assert scheduler.endpoints["ep"].present_flows == 0


def test_a_request_running_across_a_tier_move_is_accounted_in_its_new_tier():
    tenants = {"a": ("bronze", 2.0), "b": ("gold", 1.0)}
    config = make_config(cost="request", tenants=tenants)
    scheduler = Scheduler(config)
    admit(scheduler, [req("a", 1), req("a", 2)])
    assert dispatch_one(scheduler, complete=False) == "a/1"
    scheduler.reconfigure(
        make_config(cost="request", tenants={**tenants, "a": ("silver", 3.0)}), 1.0
    )
    endpoint = scheduler.endpoints["ep"]
    assert endpoint.present_weight_by_rank == [0.0, 3.0, 0.0]
    assert dispatch_one(scheduler, 1.0, complete=False) == "a/2"
    for rid in ("1", "2"):
        assert scheduler.complete("a", rid, USED, 2.0) is not None
    assert endpoint.present_weight_by_rank == [0.0, 0.0, 0.0]
    assert endpoint.running == endpoint.present_flows == 0


def served_shares(scheduler: Scheduler, rounds: int, now: float) -> dict[str, int]:
    served = {"a": 0, "b": 0}
    for _ in range(rounds):
        served[dispatch_one(scheduler, now).split("/")[0]] += 1
    return served


def test_a_new_weight_changes_the_served_shares_from_the_next_rounds():
    tenants = {"a": ("gold", 1.0), "b": ("gold", 1.0)}
    config = make_config(cost="request", tenants=tenants)
    scheduler = Scheduler(config)
    admit(scheduler, [req(t, n, arrival=n) for n in range(1000) for t in "ab"])
    assert served_shares(scheduler, 200, 0.0) == {"a": 100, "b": 100}
    scheduler.reconfigure(
        make_config(cost="request", tenants={"a": ("gold", 3.0), "b": ("gold", 1.0)}),
        1.0,
    )
    after = served_shares(scheduler, 400, 1.0)
    assert after["a"] == pytest.approx(300, abs=3) and after["b"] == pytest.approx(100, abs=3)
    assert_counts_consistent(scheduler)


def test_new_limits_hold_from_the_next_admission():
    config = make_config(tenants={"a": ("gold", 1.0)})
    scheduler, store = Scheduler(config), MemoryLimiterStore()
    for n in range(3):
        assert scheduler.admit(req("a", n), 0.0, store).admitted
    limited = msgspec.structs.replace(
        config,
        tenants={
            "a": msgspec.structs.replace(config.tenants["a"], limits={"ep": Limits(max_queued=3)})
        },
    )
    scheduler.reconfigure(limited, 0.0)
    assert scheduler.admit(req("a", 9), 0.0, store).outcome is Outcome.QUEUE_FULL


def test_a_removed_tenants_queued_requests_come_back_in_order_its_running_one_ends():
    tenants = {"a": ("gold", 1.0), "b": ("silver", 1.0)}
    scheduler = Scheduler(make_config(tenants=tenants))
    admit(scheduler, [req("a", n, arrival=n, priority=n % 2) for n in range(5)] + [req("b", 1)])
    assert dispatch_one(scheduler, complete=False) == "a/1"
    removed = scheduler.reconfigure(make_config(tenants={"b": ("silver", 1.0)}), 1.0)
    assert [r.id for r in removed] == ["3", "0", "2", "4"]
    assert scheduler.flow("ep", "a") is None
    assert scheduler.check(req("a", 9), 1.0) == Decision(
        Outcome.UNKNOWN_TENANT, "unknown tenant 'a'"
    )
    assert_counts_consistent(scheduler)
    # Its running request ends normally; b is served.
    assert scheduler.complete("a", "1", USED, 2.0) is not None
    assert drain(scheduler, 2.0) == ["b/1"]
    assert_counts_consistent(scheduler)
    assert scheduler.endpoints["ep"].present_flows == 0


def test_requests_of_a_removed_tenant_that_reach_a_queue_after_the_reload_are_set_aside():
    tenants = {"a": ("gold", 1.0), "b": ("silver", 1.0)}
    scheduler = Scheduler(make_config(tenants=tenants))
    admit(scheduler, [req("a", 1)])
    assert dispatch_one(scheduler, complete=False) == "a/1"
    late = req("a", 2)
    assert isinstance(scheduler.check(late, 0.0), list)  # checked before the reload
    assert scheduler.reconfigure(make_config(tenants={"b": ("silver", 1.0)}), 1.0) == []
    scheduler.enqueue(late, 1.0)  # enqueued after it
    assert scheduler.requeue("a", "1").id == "1"  # its worker was lost
    assert [r.id for r in scheduler.removed] == ["2", "1"]
    assert scheduler.queued_count() == 0 and dispatch_one(scheduler, 1.0) is None
    assert_counts_consistent(scheduler)
    assert scheduler.endpoints["ep"].present_flows == 0


def test_a_lost_request_of_a_tenant_removed_and_added_back_runs_again():
    tenants = {"a": ("gold", 1.0), "b": ("silver", 1.0)}
    scheduler = Scheduler(make_config(tenants=tenants))
    admit(scheduler, [req("a", 1)])
    assert dispatch_one(scheduler, complete=False) == "a/1"
    scheduler.reconfigure(make_config(tenants={"b": ("silver", 1.0)}), 1.0)
    scheduler.reconfigure(make_config(tenants=tenants), 2.0)  # back, with a new flow
    assert scheduler.requeue("a", "1").id == "1"  # its worker was lost
    assert scheduler.removed == []
    assert dispatch_one(scheduler, 2.0) == "a/1"
    assert_counts_consistent(scheduler)


def test_unlisted_tenants_turned_away_by_a_reload_are_removed():
    text = make_config_text(unlisted="admit")
    scheduler = Scheduler(parse_config(text))
    admit(scheduler, [req("someone", 1), req("a", 1)])
    new = parse_config(make_config_text(unlisted="reject"))
    assert tenant_changes(scheduler.registry, type(scheduler.registry)(new)).changed == [UNLISTED]
    assert [r.tenant for r in scheduler.reconfigure(new, 1.0)] == ["someone"]
    assert drain(scheduler, 1.0) == ["a/1"]


def make_config_text(unlisted: str) -> str:
    return f"""
[endpoints.ep]
cost = "request"
[[tiers]]
name = "gold"
[[tiers]]
name = "free"
[tenants.a]
tier = "gold"
[unlisted_tenants]
policy = "{unlisted}"
tier = "free"
"""


def test_tiers_added_and_reordered_keep_each_tiers_standings():
    tenants = {"a": ("gold", 1.0), "b": ("silver", 1.0)}
    scheduler = Scheduler(make_config(cost="request", tenants=tenants))
    admit(scheduler, [req("a", 1), req("a", 2), req("b", 1)])
    gold = scheduler.endpoints["ep"].selector.tiers[0]
    # silver above gold now, and a new top tier with a new tenant.
    new = make_config(
        cost="request",
        tiers=("platinum", "silver", "gold"),
        tenants={**tenants, "p": ("platinum", 1.0)},
    )
    assert scheduler.reconfigure(new, 1.0) == []
    assert scheduler.endpoints["ep"].selector.tiers[2] is gold
    admit(scheduler, [req("p", 1)], 1.0)
    assert drain(scheduler, 1.0) == ["p/1", "b/1", "a/1", "a/2"]
    assert_counts_consistent(scheduler)


def test_a_reload_outside_tenants_and_tiers_is_refused_whole():
    tenants = {"a": ("gold", 1.0), "b": ("silver", 1.0)}
    config = make_config(tenants=tenants)
    scheduler = Scheduler(config)
    admit(scheduler, [req("a", 1), req("b", 1)])
    registry = scheduler.registry
    changed = make_config(tenants={"a": ("bronze", 5.0)}, latency_target_s=7.0)
    changed = msgspec.structs.replace(
        changed, broker=msgspec.structs.replace(changed.broker, prefix="other")
    )
    with pytest.raises(ReloadError, match=r"section\(s\) endpoints, broker changed"):
        scheduler.reconfigure(changed, 1.0)
    assert scheduler.config is config and scheduler.registry is registry
    assert scheduler.flow("ep", "a").tier_rank == 0 and scheduler.flow("ep", "b") is not None
    assert drain(scheduler, 1.0) == ["a/1", "b/1"]


def test_removing_a_tier_still_named_is_a_config_error():
    text = make_config_text(unlisted="admit").replace('[[tiers]]\nname = "free"\n', "")
    with pytest.raises(ConfigError, match="unlisted_tenants.tier"):
        parse_config(text)


def test_tenant_changes_name_added_removed_and_changed_tenants():
    old = make_config(tenants={"a": ("gold", 1.0), "b": ("gold", 1.0), "c": ("gold", 1.0)})
    new = make_config(tenants={"a": ("gold", 1.0), "b": ("silver", 1.0), "d": ("gold", 1.0)})
    changes = tenant_changes(Scheduler(old).registry, Scheduler(new).registry)
    assert (changes.added, changes.removed, changes.changed) == (["d"], ["c"], ["b"])


# -- property: any sequence of reloads loses, repeats and reorders nothing ------------------

TIERS = ("gold", "silver", "bronze")
tenant_sets = st.dictionaries(
    st.sampled_from("abcd"),
    st.tuples(st.sampled_from(TIERS), st.sampled_from((0.5, 1.0, 3.0))),
    min_size=1,
)
steps = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.sampled_from("abcd"), st.integers(0, 3)),
        st.tuples(st.just("dispatch"), st.booleans()),
        st.tuples(st.just("complete"), st.integers(0, 10)),
        st.tuples(st.just("lose"), st.integers(0, 10)),
        st.tuples(st.just("reload"), tenant_sets),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(first=tenant_sets, steps=steps)
def test_reloads_lose_repeat_and_reorder_nothing(first, steps):
    scheduler = Scheduler(make_config(cost="request", tenants=first))
    store = MemoryLimiterStore()
    admitted: list[str] = []
    ended: list[str] = []  # every request that left: completed or removed
    queued_order: dict[str, list] = {}  # tenant -> its queued requests' keys, in order
    running: list = []
    now, serial = 0.0, 0
    for step in steps:
        now += 1.0
        if step[0] == "submit":
            serial += 1
            request = req(step[1], serial, arrival=now, priority=step[2])
            if scheduler.admit(request, now, store).admitted:
                admitted.append(request.id)
                queued_order.setdefault(step[1], []).append((-step[2], now, str(serial)))
        elif step[0] == "dispatch":
            for request in scheduler.next_batch("ep", Capacity(2, 10**9, 1e12), now).requests:
                running.append(request)
                # Its tenant's best queued request, by the order it was queued in.
                best = min(queued_order[request.tenant])
                assert best[2] == request.id
                queued_order[request.tenant].remove(best)
        elif running and step[0] in ("complete", "lose"):
            request = running.pop(step[1] % len(running))
            if step[0] == "complete":
                assert scheduler.complete(request.tenant, request.id, USED, now) is not None
                ended.append(request.id)
            else:
                assert scheduler.requeue(request.tenant, request.id) is request
                if scheduler.removed:
                    ended += [r.id for r in scheduler.removed]
                    scheduler.removed.clear()
                else:
                    queued_order[request.tenant].append(
                        (-request.priority, request.arrival, request.id)
                    )
        elif step[0] == "reload":
            for request in scheduler.reconfigure(make_config(cost="request", tenants=step[1]), now):
                ended.append(request.id)
                queued_order[request.tenant].remove(
                    (-request.priority, request.arrival, request.id)
                )
        assert_counts_consistent(scheduler)
    for request in running:
        assert scheduler.complete(request.tenant, request.id, USED, now) is not None
        ended.append(request.id)
    while batch := scheduler.next_batch("ep", Capacity(4, 10**9, 1e12), now).requests:
        for request in batch:
            best = min(queued_order[request.tenant])
            assert best[2] == request.id
            queued_order[request.tenant].remove(best)
            assert scheduler.complete(request.tenant, request.id, USED, now) is not None
            ended.append(request.id)
    assert not any(queued_order.values())
    assert sorted(ended) == sorted(admitted)  # each exactly once
    endpoint = scheduler.endpoints["ep"]
    assert endpoint.running == endpoint.present_flows == endpoint.backlogged_flows == 0
