"""Property-based tests of the scheduling core (acceptance points (a)-(g))."""

from __future__ import annotations

import math

from hypothesis import example, given, settings
from hypothesis import strategies as st

from costmodel.estimate import OutputEstimator
from costmodel.units import NO_CAPACITY, Capacity, Usage
from dispatcher.core.limits import MemoryLimiterStore, RateCheck
from dispatcher.core.scheduler import Scheduler
from tests.core_support import ONE_SLOT, make_config, req

SETTINGS = settings(max_examples=60, deadline=None)


def backlog(scheduler: Scheduler, tenant: str, sizes: list[int], start: int = 0) -> None:
    store = MemoryLimiterStore()
    for i, size in enumerate(sizes):
        decision = scheduler.admit(req(tenant, start + i, input_tokens=size), 0.0, store)
        assert decision.admitted, decision


def pick_one(scheduler: Scheduler):
    batch = scheduler.next_batch("ep", ONE_SLOT, 0.0)
    assert len(batch.requests) == 1
    return batch.requests[0]


# (a) -------------------------------------------------------------------------------


@SETTINGS
@given(
    sizes_a=st.lists(st.integers(1, 300), min_size=50, max_size=50),
    sizes_b=st.lists(st.integers(1, 300), min_size=50, max_size=50),
)
def test_equal_weights_service_gap_is_bounded(sizes_a, sizes_b):
    """The tenant served less sends next, so the gap never exceeds one request."""
    scheduler = Scheduler(make_config())
    # Each tenant repeats its pattern so both stay backlogged for the whole run.
    backlog(scheduler, "a", sizes_a * 20)
    backlog(scheduler, "b", sizes_b * 20)
    bound = max(sizes_a + sizes_b)
    served = {"a": 0, "b": 0}
    for _ in range(800):
        request = pick_one(scheduler)
        served[request.tenant] += request.input_tokens
        assert abs(served["a"] - served["b"]) <= bound


# (b) -------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    weights=st.lists(st.integers(1, 6), min_size=2, max_size=4),
    sizes=st.lists(st.integers(1, 100), min_size=5, max_size=20),
)
def test_weighted_shares_match_weights(weights, sizes):
    tenants = {f"t{i}": ("gold", float(w)) for i, w in enumerate(weights)}
    scheduler = Scheduler(make_config(tenants=tenants))
    store = MemoryLimiterStore()
    for tenant in tenants:
        backlog(scheduler, tenant, sizes)
    served = dict.fromkeys(tenants, 0)
    sent = 0
    # A tenant's error is at most one request (100 tokens) per unit of weight: 1% at most
    # after 100 of them per unit of weight.
    while sum(served.values()) < 100 * 100 * sum(weights):
        request = pick_one(scheduler)
        served[request.tenant] += request.input_tokens
        sent += 1
        # Refill so every tenant stays backlogged with the same size pattern.
        refill = req(request.tenant, f"r{sent}", input_tokens=sizes[sent % len(sizes)])
        assert scheduler.admit(refill, 0.0, store).admitted
    total = sum(served.values())
    for tenant, (_, weight) in tenants.items():
        expected = weight / sum(weights)
        assert abs(served[tenant] / total - expected) <= 0.02 * expected


@settings(max_examples=30, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 300), min_size=5, max_size=20),
    rounds=st.integers(20, 640),
)
def test_request_mode_shares_requests_by_weight(sizes, rounds):
    """cost = "request": weights 1:2:4 get requests 1:2:4, whatever their sizes, within
    one request per unit of the tenant's weight, plus one."""
    weights = {"t1": 1.0, "t2": 2.0, "t4": 4.0}
    tenants = {name: ("gold", weight) for name, weight in weights.items()}
    scheduler = Scheduler(make_config(cost="request", tenants=tenants))
    store = MemoryLimiterStore()
    for tenant in tenants:
        backlog(scheduler, tenant, sizes)
    served = dict.fromkeys(tenants, 0)
    total = rounds * int(sum(weights.values()))
    for sent in range(total):
        request = pick_one(scheduler)
        served[request.tenant] += 1
        refill = req(request.tenant, f"r{sent}", input_tokens=sizes[sent % len(sizes)])
        assert scheduler.admit(refill, 0.0, store).admitted
    for tenant, weight in weights.items():
        expected = total * weight / sum(weights.values())
        assert abs(served[tenant] - expected) <= weight + 1, (served, expected)


# (c) -------------------------------------------------------------------------------

operations = st.lists(
    st.one_of(
        st.tuples(
            st.just("admit"), st.sampled_from("abcde"), st.integers(1, 50), st.integers(1, 50)
        ),
        st.tuples(st.just("batch"), st.integers(0, 6), st.integers(0, 400)),
        st.tuples(st.just("complete"), st.integers(0, 100)),
        st.tuples(st.just("wait"), st.integers(0, 90)),
    ),
    min_size=1,
    max_size=120,
)


@SETTINGS
@given(ops=operations, reserve=st.sampled_from([0.0, 0.1, 0.25]))
# c has just left, so the reserve is held; b, held back by it after its first request,
# falls below its share once a starts.
@example(
    ops=[
        ("admit", "c", 1, 1),
        ("batch", 1, 2),
        ("complete", 0),
        ("admit", "b", 1, 1),
        ("admit", "a", 1, 1),
        ("admit", "b", 1, 1),
        ("batch", 3, 6),
    ],
    reserve=0.1,
)
def test_capacity_never_idle_while_admissible_work_waits(ops, reserve):
    tenants = {t: ("gold", 1.0 + i % 2) for i, t in enumerate("abcde")}
    scheduler = Scheduler(make_config(tenants=tenants, reserve=reserve))
    total = Capacity(8, 400, 1e12)
    store = MemoryLimiterStore()
    running: list = []
    now = 0.0
    for n, op in enumerate(ops):
        if op[0] == "admit":
            _, tenant, inp, out = op
            assert scheduler.admit(
                req(tenant, n, input_tokens=inp, max_tokens=out, arrival=now), now, store
            ).admitted
        elif op[0] == "complete" and running:
            request = running.pop(op[1] % len(running))
            scheduler.complete(request.tenant, request.id, Usage(request.input_tokens, 1, 0.0), now)
        elif op[0] == "wait":
            now += op[1]
        elif op[0] == "batch":
            _, seqs, tokens = op
            free = Capacity(seqs, tokens, 1e12)
            batch = scheduler.next_batch("ep", free, now, total)
            # The reserve in force for that batch: lifted, if it held anything back,
            # while it cannot matter (checked on the state the batch ended in).
            endpoint = scheduler.endpoints["ep"]
            flows = endpoint.flows.values()
            assert endpoint.present_flows == sum(1 for f in flows if len(f.queue) or f.running)
            assert endpoint.backlogged_flows == sum(1 for f in flows if len(f.queue))
            reserved = endpoint.reserve(total) if endpoint.reserve_can_matter(now) else NO_CAPACITY
            running += batch.requests
            room = free
            for request in batch.requests:
                room = room.minus(
                    Capacity(1, request.input_tokens + request.max_tokens, request.model_units)
                )
            if len(batch.requests) == 1 and room.sequences < 0:
                continue  # an oversized request sent alone
            assert room.sequences >= 0 and room.tokens >= 0
            for flow in endpoint.flows.values():
                head = flow.queue.peek()
                if head is None:
                    continue
                need = Capacity(1, head.input_tokens + head.max_tokens, head.model_units)
                usable = room if endpoint.below_fair_share(flow) else room.minus(reserved)
                assert not usable.fits(need), (
                    f"{flow.tenant}'s head {need} fits in the {usable} left idle"
                )


# (d) -------------------------------------------------------------------------------


@SETTINGS
@given(
    arrivals=st.lists(
        st.tuples(st.sampled_from(["g1", "g2", "s1", "b1"]), st.integers(1, 100)),
        min_size=1,
        max_size=80,
    )
)
def test_strict_tier_order(arrivals):
    tenants = {
        "g1": ("gold", 1.0),
        "g2": ("gold", 3.0),
        "s1": ("silver", 9.0),
        "b1": ("bronze", 1.0),
    }
    rank = {"g1": 0, "g2": 0, "s1": 1, "b1": 2}
    scheduler = Scheduler(make_config(tenants=tenants))
    store = MemoryLimiterStore()
    for n, (tenant, size) in enumerate(arrivals):
        scheduler.admit(req(tenant, n, input_tokens=size), 0.0, store)
    for _ in arrivals:
        request = pick_one(scheduler)
        waiting = [t for t, f in scheduler.endpoints["ep"].flows.items() if len(f.queue)]
        assert all(rank[request.tenant] <= rank[t] for t in waiting)


# (e) -------------------------------------------------------------------------------


@SETTINGS
@given(
    items=st.lists(
        st.tuples(
            st.integers(-2, 2), st.one_of(st.none(), st.integers(100, 105)), st.integers(0, 50)
        ),
        min_size=1,
        max_size=60,
    )
)
def test_priority_then_deadline_then_arrival(items):
    scheduler = Scheduler(make_config())
    store = MemoryLimiterStore()
    for n, (priority, deadline, arrival) in enumerate(items):
        scheduler.admit(
            req("a", n, arrival=float(arrival), priority=priority, deadline=deadline), 0.0, store
        )
    order = [int(pick_one(scheduler).id) for _ in items]

    def key(n):
        priority, deadline, arrival = items[n]
        return (-priority, math.inf if deadline is None else deadline, arrival, n)

    assert order == sorted(range(len(items)), key=key)


# (f) -------------------------------------------------------------------------------


@SETTINGS
@given(
    per_minute=st.integers(1, 600),
    burst=st.integers(1, 50),
    gaps=st.lists(st.floats(0.0, 2.0), min_size=1, max_size=300),
    window=st.floats(0.5, 120.0),
)
def test_gcra_never_admits_more_than_rate_times_window_plus_burst(per_minute, burst, gaps, window):
    store = MemoryLimiterStore()
    check = RateCheck("k", float(per_minute), float(burst), 1.0)
    now, admitted = 0.0, []
    for gap in gaps:
        now += gap
        if store.apply([check], now).admitted:
            admitted.append(now)
    limit = per_minute / 60.0 * window + burst
    for i, start in enumerate(admitted):
        inside = sum(1 for t in admitted[i:] if t <= start + window)
        assert inside <= limit + 1e-9


@SETTINGS
@given(per_minute=st.integers(1, 600), burst=st.integers(1, 50), window=st.floats(1.0, 120.0))
def test_gcra_admits_exactly_rate_times_window_plus_burst_under_pressure(per_minute, burst, window):
    store = MemoryLimiterStore()
    check = RateCheck("k", float(per_minute), float(burst), 1.0)
    interval = 60.0 / per_minute
    # Pressure: at every multiple of interval/4, retry until refused.
    step = interval / 4
    admitted = 0
    for i in range(int(window / step + 1e-9) + 1):
        while store.apply([check], i * step).admitted:
            admitted += 1
            assert admitted <= per_minute * window / 60.0 + burst + 1
    last = int(window / step + 1e-9) * step
    assert admitted == math.floor(last / interval + 1e-9) + burst


# (g) -------------------------------------------------------------------------------


class SkewedEstimator(OutputEstimator):
    """Estimates off by a fixed factor per tenant, and never learns: the worst case."""

    def __init__(self, truth: dict[str, int], factor: dict[str, float]) -> None:
        super().__init__()
        self.truth, self.factor = truth, factor

    def estimate(self, key, max_tokens):
        tenant = key[0]
        return max(1, min(max_tokens, round(self.truth[tenant] * self.factor[tenant])))

    def observe(self, key, output_tokens, max_tokens):
        return None


@SETTINGS
@given(
    weights=st.lists(st.integers(1, 4), min_size=2, max_size=3),
    factors=st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=3, max_size=3),
    outputs=st.lists(st.integers(5, 60), min_size=3, max_size=3),
    lag=st.integers(0, 8),
)
def test_completion_corrections_keep_actual_shares_fair(weights, factors, outputs, lag):
    tenants = {f"t{i}": ("gold", float(w)) for i, w in enumerate(weights)}
    truth = {t: outputs[i] for i, t in enumerate(tenants)}
    estimator = SkewedEstimator(truth, {t: factors[i] for i, t in enumerate(tenants)})
    scheduler = Scheduler(make_config(cost="model_units", tenants=tenants), estimator=estimator)
    profile = scheduler.endpoints["ep"].profile
    for tenant in tenants:
        backlog(scheduler, tenant, [20] * 3000)
    actual = dict.fromkeys(tenants, 0.0)
    in_flight = []
    for _ in range(3000):
        request = pick_one(scheduler)
        in_flight.append(request)
        if len(in_flight) > lag:  # complete with a lag, as a real engine would
            done = in_flight.pop(0)
            usage = Usage(done.input_tokens, truth[done.tenant], 0.0)
            scheduler.complete(done.tenant, done.id, usage, 0.0)
            actual[done.tenant] += profile.model_units(usage.input_tokens, usage.output_tokens)
    total = sum(actual.values())
    for tenant, (_, weight) in tenants.items():
        expected = weight / sum(weights)
        assert abs(actual[tenant] / total - expected) <= 0.05 * expected
