"""Routing: the consistent-hash ring, bounded-load affinity and the fleet-wide pass."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from costmodel.units import Capacity
from dispatcher.core.limits import MemoryLimiterStore
from dispatcher.core.placement import (
    BLOCKED,
    MISFIT,
    PLACED,
    Placement,
    Ring,
    Slot,
    affinity_key,
    fleet_sizes,
)
from dispatcher.core.pool import WorkerPool
from dispatcher.core.scheduler import Scheduler
from dispatcher.core.types import Request
from tests.core_support import make_config, req

SETTINGS = settings(max_examples=60, deadline=None)
ROOMY = Capacity(10**6, 10**12, 1e12)
KEYS = [f"session-{i}" for i in range(400)]


def keyed(key: str | None, units: float = 1.0, rid: str = "r") -> Request:
    request = Request(rid, "t", "ep", 0.0, 1, 1, affinity=key)
    request.model_units = units
    return request


def fleet(*sizes: float, free: Capacity = ROOMY) -> list[Slot]:
    return [Slot(f"w{i}", free, ROOMY, size=size) for i, size in enumerate(sizes)]


def owner(room: Placement, request: Request) -> str:
    assert room.place(request, respect_reserve=False) == PLACED
    return next(s.worker_id for s in room.slots if s.requests and s.requests[-1] is request)


# -- the ring ------------------------------------------------------------------------------


def test_the_ring_walks_every_member_once_and_does_not_depend_on_their_order() -> None:
    ring = Ring(["a", "b", "c", "d"])
    for key in KEYS[:50]:
        walk = list(ring.walk(key))
        assert sorted(walk) == ["a", "b", "c", "d"]
        assert walk == list(Ring(["d", "c", "b", "a"]).walk(key))
    assert list(Ring([]).walk("k")) == []


@SETTINGS
@given(
    members=st.sets(st.text("abcdefgh", min_size=1, max_size=4), min_size=1, max_size=8),
    newcomer=st.text("xyz", min_size=1, max_size=3),
)
def test_a_worker_joining_takes_keys_only_for_itself_and_leaving_moves_only_its_own(
    members: set[str], newcomer: str
) -> None:
    before = Ring(members)
    after = Ring(members | {newcomer})
    moved = 0
    for key in KEYS:
        first_before, first_after = next(before.walk(key)), next(after.walk(key))
        if first_before != first_after:
            assert first_after == newcomer  # joining: a key moves only to the newcomer
            moved += 1
        # Leaving is the same pair read backwards: only the newcomer's keys move.
        if first_after != newcomer:
            assert first_before == first_after
    assert moved < len(KEYS)  # the others stayed put


def test_keys_spread_evenly_over_the_ring() -> None:
    ring = Ring(["a", "b", "c", "d"])
    counts = {m: 0 for m in "abcd"}
    for i in range(4000):
        counts[next(ring.walk(f"k{i}"))] += 1
    assert all(600 <= count <= 1400 for count in counts.values()), counts


def test_keys_spread_in_proportion_to_the_members_weights() -> None:
    ring = Ring({"a": 64, "b": 64, "c": 128})
    counts = {m: 0 for m in "abc"}
    for i in range(8000):
        counts[next(ring.walk(f"k{i}"))] += 1
    assert 3200 <= counts["c"] <= 4800, counts  # half the keys, +-20%
    assert all(1400 <= counts[m] <= 2600 for m in "ab"), counts


@SETTINGS
@given(
    weights=st.dictionaries(
        st.text("abcdefgh", min_size=1, max_size=4),
        st.sampled_from([1.0, 2.0, 4.0]),
        min_size=1,
        max_size=6,
    ),
    newcomer=st.text("xyz", min_size=1, max_size=3),
    scale=st.sampled_from([1.0, 2.0, 8.0]),
)
def test_a_weighted_worker_joining_takes_keys_only_for_itself(
    weights: dict[str, float], newcomer: str, scale: float
) -> None:
    """As long as it is no smaller than the smallest member (else every other member's
    points are counted afresh)."""
    before = Ring(weights)
    after = Ring({**weights, newcomer: scale * min(weights.values())})
    for key in KEYS:
        first_before, first_after = next(before.walk(key)), next(after.walk(key))
        assert first_after in (first_before, newcomer)


def test_ring_weights_must_be_positive_and_finite() -> None:
    for weight in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="ring weights"):
            Ring({"a": 1.0, "b": weight})


# -- affinity keys -------------------------------------------------------------------------


def test_the_affinity_key_is_the_session_else_the_first_block_of_the_prompt() -> None:
    long_prompt = "You are a helpful assistant. " * 40
    assert affinity_key("chat-7", "short") == "s:chat-7"
    assert affinity_key(None, "short") is None  # shorter than a block: least loaded
    same_head = affinity_key(None, long_prompt + "question one", block_tokens=64)
    assert same_head is not None
    assert same_head == affinity_key(None, long_prompt + "another question", block_tokens=64)
    assert same_head != affinity_key(None, "x" + long_prompt, block_tokens=64)


# -- placement -----------------------------------------------------------------------------


def test_a_key_stays_on_its_worker_and_spills_along_the_ring_when_it_is_full() -> None:
    slots = fleet(1, 1, 1)
    ring = Ring(s.worker_id for s in slots)
    room = Placement(slots, ring, load_bound=10.0)
    home = owner(room, keyed("k", rid="1"))
    assert all(owner(room, keyed("k", rid=str(i))) == home for i in range(2, 6))
    # Its worker full: the next worker on the ring takes it.
    room = Placement(
        [
            Slot(s.worker_id, ROOMY if s.worker_id != home else Capacity(0, 0, 0), ROOMY)
            for s in slots
        ],
        ring,
        load_bound=10.0,
    )
    assert owner(room, keyed("k")) == list(ring.walk("k"))[1]


@SETTINGS
@given(
    keys=st.lists(st.sampled_from(KEYS[:6] + [None]), min_size=1, max_size=300),
    sizes=st.lists(st.sampled_from([1.0, 2.0, 4.0]), min_size=2, max_size=6),
    bound=st.sampled_from([1.1, 1.25, 2.0]),
)
def test_no_worker_goes_beyond_the_bound_times_its_share_plus_one_request(
    keys: list[str | None], sizes: list[float], bound: float
) -> None:
    slots = fleet(*sizes)
    room = Placement(slots, Ring(s.worker_id for s in slots), load_bound=bound)
    total_size = sum(sizes)
    for i, key in enumerate(keys):
        room.place(keyed(key, rid=str(i)), respect_reserve=False)
        fleet_load = sum(s.load for s in slots)
        for slot in slots:
            assert slot.load <= bound * slot.size / total_size * fleet_load + 1.0


def test_placement_is_deterministic() -> None:
    def run() -> list[str]:
        slots = fleet(1, 2, 1)
        room = Placement(slots, Ring(s.worker_id for s in slots))
        return [owner(room, keyed(KEYS[i % 7], rid=str(i))) for i in range(100)]

    assert run() == run()


def test_without_a_key_work_spreads_in_proportion_to_each_workers_size() -> None:
    slots = fleet(1, 2, 1)
    room = Placement(slots)
    for i in range(400):
        room.place(keyed(None, rid=str(i)), respect_reserve=False)
    assert [s.load for s in slots] == [100.0, 200.0, 100.0]


def test_a_request_larger_than_any_batch_runs_alone_on_an_idle_worker() -> None:
    small = Capacity(4, 100, 1e12)
    idle = Placement([Slot("busy", Capacity(3, 50, 1e12), small), Slot("idle", small, small)])
    big = Request("big", "t", "ep", 0.0, 150, 10)
    assert idle.place(big, respect_reserve=False) == PLACED
    assert [s.worker_id for s in idle.placed()] == ["idle"] and not idle.slots[1].sequences
    busy = Placement([Slot("busy", Capacity(3, 50, 1e12), small)])
    assert busy.place(big, respect_reserve=False) == BLOCKED
    assert busy.place(Request("r", "t", "ep", 0.0, 40, 20), respect_reserve=False) == MISFIT


def test_placing_on_a_fleet_keeps_the_fair_order_of_one_worker_of_the_same_room() -> None:
    def backlogged() -> Scheduler:
        scheduler = Scheduler(make_config(tenants={"a": ("gold", 1.0), "b": ("gold", 3.0)}))
        store = MemoryLimiterStore()
        for i in range(20):
            for tenant in "ab":
                assert scheduler.admit(req(tenant, i, input_tokens=10 + i), 0.0, store).admitted
        return scheduler

    room = Placement(
        [Slot(f"w{i}", Capacity(4, 10**9, 1e12), Capacity(4, 10**9, 1e12)) for i in range(3)]
    )
    spread = backlogged().place("ep", room, 0.0).requests
    alone = (
        backlogged()
        .next_batch("ep", Capacity(12, 10**9, 1e12), 0.0, Capacity(12, 10**9, 1e12))
        .requests
    )
    assert [(r.tenant, r.id) for r in spread] == [(r.tenant, r.id) for r in alone]
    assert sorted(len(s.requests) for s in room.slots) == [4, 4, 4]


def test_the_pools_placement_counts_busy_workers_in_the_fleet_and_rebuilds_its_ring() -> None:
    pool = WorkerPool(timeout_s=5.0)
    for worker_id in ("a", "b"):
        pool.add(worker_id, "ep", Capacity(2, 1000, 10.0), now=0.0)
    pool.add("other", "embed", Capacity(2, 1000, 10.0), now=0.0)
    room = pool.placement("ep", can_take=lambda w: w.worker_id == "a")
    assert room is not None and [s.worker_id for s in room.slots] == ["a", "b"]
    assert room.slots[1].sequences == 0 and room.ring.members == {"a", "b"}
    pool.get("b").healthy = False
    assert pool.placement("ep").ring.members == {"a"}
    assert pool.placement("ep", affinity=False).ring is None  # least utilised only
    assert pool.placement("ep", can_take=lambda w: False) is None


def test_sizes_are_model_units_per_second_when_every_worker_says_else_sequences() -> None:
    assert fleet_sizes([("a", 8, 3.0), ("b", 32, 1.0)]) == {"a": 3.0, "b": 1.0}
    assert fleet_sizes([("a", 8, 3.0), ("b", 32, 0.0)]) == {"a": 8, "b": 32}
    # A speed that is no speed (a broken or hostile heartbeat) is not believed.
    for bad in (math.inf, math.nan, -1.0):
        assert fleet_sizes([("a", 8, 3.0), ("b", 32, bad)]) == {"a": 8, "b": 32}
    # One profile for all (the usual case): speeds say nothing of size.
    assert fleet_sizes([("a", 8, 3.0), ("b", 32, 3.0)]) == {"a": 8, "b": 32}
    assert fleet_sizes([("a", 0, 0.0)]) == {"a": 1}


def test_a_draining_worker_keeps_its_size_and_every_key_stays_put() -> None:
    """Draining, a worker offers only what it uses; its points on the ring must not
    shrink with that, or the other workers' keys would move among them."""
    pool = WorkerPool(timeout_s=5.0)
    for worker_id, sequences in (("a", 8), ("b", 8), ("c", 16)):
        pool.heartbeat(worker_id, "ep", 1.0, Capacity(sequences, 1000, 10.0), (), True, 0.0)
    before = pool.placement("ep").ring
    for used in (5, 3, 1):
        pool.heartbeat("a", "ep", 1.0, Capacity(used, 1000, 10.0), (), True, 1.0)
        assert pool.placement("ep").ring is before
    # A restart is a new run: its size is what it offers now.
    pool.heartbeat("a", "ep", 2.0, Capacity(16, 1000, 10.0), (), True, 2.0)
    assert pool.placement("ep").ring.weights == {"a": 16, "b": 8, "c": 16}


def test_a_load_bound_of_one_or_less_is_refused() -> None:
    with pytest.raises(ValueError, match="load_bound"):
        Placement(fleet(1), load_bound=1.0)
