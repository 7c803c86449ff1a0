"""The Virtual Token Counter baseline (`fairq sim --policy vtc`) against small cases
computed by hand: counters of prompt + 2 x output tokens over the weight, the smallest
backlogged counter first, a tenant that becomes backlogged lifted to that smallest
counter (to the last one's that left when none is backlogged), misfits skipped."""

from __future__ import annotations

import pytest

from costmodel.units import Capacity, Usage
from dispatcher.core.limits import MemoryLimiterStore
from dispatcher.core.scheduler import Scheduler
from tests.core_support import ONE_SLOT, make_config, req

TOTAL = Capacity(64, 10**9, 1e12)


def vtc(**tenants: float) -> Scheduler:
    config = make_config(tenants={name: ("gold", weight) for name, weight in tenants.items()})
    return Scheduler(config, policy="vtc")


def admit(scheduler: Scheduler, *requests) -> None:
    store = MemoryLimiterStore()
    for request in requests:
        assert scheduler.admit(request, 0.0, store).admitted


def picks(scheduler: Scheduler, count: int) -> list[str]:
    """The next `count` dispatches, one at a time: tenant and request id."""
    return [
        f"{r.tenant}{r.id}"
        for _ in range(count)
        for r in scheduler.next_batch("ep", ONE_SLOT, 0.0, TOTAL).requests
    ]


def counters(scheduler: Scheduler) -> dict[str, float]:
    selector = scheduler.endpoints["ep"].selector
    return {flow.tenant: value for flow, value in selector.counters.items()}


def test_the_smallest_counter_goes_next_charged_prompt_then_output():
    scheduler = vtc(a=1.0, b=1.0)
    admit(
        scheduler,
        *(req("a", i, input_tokens=100) for i in range(3)),
        *(req("b", i, input_tokens=30) for i in range(3)),
    )
    # a:0 b:0 -> a (first backlogged) -> a:100; b:0 -> b:30 -> b:60 -> b:90 -> a ...
    assert picks(scheduler, 5) == ["a0", "b0", "b1", "b2", "a1"]
    assert counters(scheduler) == {"a": 200.0, "b": 90.0}
    # Output is charged on completion, two tokens' worth each.
    scheduler.complete("b", "0", Usage(30, 20, 0.0), 1.0)
    assert counters(scheduler)["b"] == 130.0


def test_output_is_charged_as_it_is_generated_and_the_rest_on_completion():
    scheduler = vtc(a=1.0, b=1.0)
    admit(
        scheduler,
        req("a", 0, input_tokens=10),
        req("a", 1, input_tokens=10),
        req("b", 0, input_tokens=25),
    )
    picks(scheduler, 1)  # a0: a 10
    scheduler.progress([(("a", "0"), 2)])  # two tokens so far: a 14
    scheduler.progress([(("a", "0"), 5), (("a", "0"), 4)])  # five (a stale 4 after): a 20
    assert counters(scheduler)["a"] == 20.0
    # b (0) still goes first, then a (20) before b (25): the counters are live.
    assert picks(scheduler, 2) == ["b0", "a1"]
    scheduler.complete("a", "0", Usage(10, 8, 0.0), 1.0)  # 3 tokens never reported: +6
    assert counters(scheduler)["a"] == 36.0
    scheduler.progress([(("a", "0"), 9)])  # no longer running: nothing to charge
    assert counters(scheduler)["a"] == 36.0


def test_a_tenant_that_becomes_backlogged_is_lifted_to_the_smallest_counter():
    scheduler = vtc(a=1.0, b=1.0, c=1.0)
    admit(
        scheduler,
        *(req("a", i, input_tokens=100) for i in range(4)),
        *(req("b", i, input_tokens=100) for i in range(4)),
    )
    picks(scheduler, 3)  # a0, b0, a1: a 200, b 100
    admit(scheduler, req("c", 0, input_tokens=100), req("c", 1, input_tokens=100))
    # c had no counter: it starts at b's 100, the smallest backlogged, not at 0, so its
    # idle time earns it no run of its own; b (tie-broken first, older entry) then c.
    assert counters(scheduler)["c"] == 100.0
    assert picks(scheduler, 3) == ["b1", "c0", "a2"]


def test_with_no_one_backlogged_a_newcomer_starts_at_the_last_counter_that_left():
    scheduler = vtc(a=1.0, b=1.0)
    admit(scheduler, req("a", 0, input_tokens=100))
    picks(scheduler, 1)  # a leaves at 100
    admit(scheduler, req("b", 0, input_tokens=10))
    assert counters(scheduler)["b"] == 100.0
    # A tenant with a counter already above the floor keeps it.
    admit(scheduler, req("a", 1, input_tokens=10))
    assert counters(scheduler)["a"] == 100.0


def test_weights_divide_the_charge():
    scheduler = vtc(a=2.0, b=1.0)
    admit(
        scheduler,
        *(req("a", i, input_tokens=100) for i in range(6)),
        *(req("b", i, input_tokens=100) for i in range(6)),
    )
    order = picks(scheduler, 9)
    # a is charged 50 per request, b 100: a gets two for each of b's.
    assert sum(p.startswith("a") for p in order) == 6
    assert counters(scheduler) == {"a": 300.0, "b": 300.0}


def test_a_head_that_does_not_fit_is_skipped_not_waited_for():
    scheduler = vtc(a=1.0, b=1.0)
    admit(
        scheduler,
        req("a", 0, input_tokens=60, max_tokens=10),
        req("b", 0, input_tokens=5, max_tokens=5),
    )
    batch = scheduler.next_batch("ep", Capacity(4, 50, 1e12), 0.0, Capacity(4, 100, 1e12))
    assert [r.tenant for r in batch.requests] == ["b"]  # work conserving, unlike FIFO


def test_an_unknown_policy_is_refused_by_name():
    with pytest.raises(ValueError, match="vtc"):
        Scheduler(make_config(), policy="lottery")
