"""The worker pool (dispatcher/core/pool.py): ledgers, choice, liveness, lost
requests and adoption, driven by hand-made heartbeats on a virtual clock."""

from __future__ import annotations

from collections.abc import Collection

import pytest

from costmodel.units import NO_CAPACITY, Capacity
from dispatcher.core.pool import FORGET_AFTER_TIMEOUTS, Key, Lost, WorkerPool
from dispatcher.core.types import Request
from tests.core_support import req

CAP = Capacity(4, 1000, 10.0)
TIMEOUT_S = 5.0


def request(
    rid: str, *, units: float = 1.0, input_tokens: int = 10, max_tokens: int = 10, tenant: str = "a"
) -> Request:
    r = req(tenant, rid, input_tokens=input_tokens, max_tokens=max_tokens)
    r.model_units = units  # the scheduler's estimate, set on admission
    return r


def key(r: Request) -> Key:
    return (r.tenant, r.id)


def beat(
    pool: WorkerPool,
    worker_id: str,
    now: float,
    in_flight: Collection[Key] = (),
    *,
    started_at: float = 1.0,
    healthy: bool = True,
    capacity: Capacity = CAP,
    endpoint: str = "ep",
) -> Lost:
    return pool.heartbeat(worker_id, endpoint, started_at, capacity, set(in_flight), healthy, now)


def new_pool(*worker_ids: str) -> WorkerPool:
    """A pool (lag 1 s, 2 missing beats) whose workers each beat once at t=0."""
    pool = WorkerPool(timeout_s=TIMEOUT_S, heartbeat_lag_s=1.0, missing_beats=2)
    for worker_id in worker_ids:
        assert not beat(pool, worker_id, 0.0)
    return pool


# -- the ledger ---------------------------------------------------------------------------


def test_ledger_totals_follow_assign_and_complete_exactly() -> None:
    pool = new_pool("w")
    worker = pool.get("w")
    a = request("1", units=0.5, input_tokens=10, max_tokens=20)
    b = request("2", units=0.25, input_tokens=30, max_tokens=40)
    pool.assign(worker, a, 0.0)
    pool.assign(worker, b, 0.0)
    assert worker.used() == Capacity(2, 100, 0.75)
    assert worker.free() == Capacity(2, 900, 9.25)
    assert pool.complete("w", key(a), 0.0) is a
    assert worker.used() == Capacity(1, 70, 0.25)
    assert worker.free() == CAP.minus(worker.used())


def test_completing_twice_or_elsewhere_changes_nothing() -> None:
    pool = new_pool("w", "v")
    a = request("1")
    pool.assign(pool.get("w"), a, 0.0)
    assert pool.complete("v", key(a), 0.0) is None  # not sent there
    assert pool.complete("gone", key(a), 0.0) is None  # a worker the pool does not know
    assert pool.complete("w", key(a), 0.0) is a
    assert pool.complete("w", key(a), 0.0) is None  # e.g. after a requeue
    assert pool.get("w").used() == Capacity(0, 0, 0.0)


def test_model_units_return_to_exactly_zero_when_nothing_is_assigned() -> None:
    units = (0.1, 0.2, 0.3)
    assert sum(units) - units[0] - units[1] - units[2] != 0.0  # the drift to undo
    pool = new_pool("w")
    worker = pool.get("w")
    requests = [request(str(i), units=u) for i, u in enumerate(units)]
    for r in requests:
        pool.assign(worker, r, 0.0)
    for r in requests:
        pool.complete("w", key(r), 0.0)
    assert worker.assigned_units == 0.0 and worker.load == 0.0
    assert worker.free() == CAP


def test_free_follows_the_capacity_the_last_heartbeat_reported() -> None:
    pool = new_pool("w")
    pool.assign(pool.get("w"), request("1", units=2.0), 0.0)
    beat(pool, "w", 0.5, [("a", "1")], capacity=Capacity(2, 100, 4.0))
    assert pool.get("w").free() == Capacity(1, 80, 2.0)


# -- choice ---------------------------------------------------------------------------------


def with_room(pool: WorkerPool, endpoint: str = "ep") -> list[str]:
    """The workers a dispatch pass over `endpoint` may place work on."""
    room = pool.placement(endpoint)
    return [] if room is None else [s.worker_id for s in room.slots if s.sequences > 0]


def test_a_pass_skips_unhealthy_and_full_workers_and_covers_one_endpoint() -> None:
    pool = new_pool("ok", "sick", "full")
    beat(pool, "other", 0.0, endpoint="embed")
    beat(pool, "sick", 0.5, healthy=False)
    for i in range(CAP.sequences):
        pool.assign(pool.get("full"), request(str(i), units=0.0), 0.0)
    assert with_room(pool, "ep") == ["ok"]
    assert with_room(pool, "embed") == ["other"]
    assert pool.healthy_count("ep") == 2  # full is healthy, only busy
    pool.complete("full", ("a", "0"), 0.0)
    assert sorted(with_room(pool, "ep")) == ["full", "ok"]


# -- liveness -------------------------------------------------------------------------------


def test_a_restart_gives_back_everything_the_worker_had() -> None:
    pool = new_pool("w")
    a, b = request("1"), request("2")
    pool.assign(pool.get("w"), a, 0.0)
    pool.assign(pool.get("w"), b, 0.0)
    pool.adopt("w", ("x", "9"))
    # Sent a moment ago and in flight as far as the old run knew: lost all the same.
    lost = beat(pool, "w", 0.2, started_at=2.0)
    assert lost.requests == [a, b] and lost.adopted == [("x", "9")]
    worker = pool.get("w")
    assert worker.used() == Capacity(0, 0, 0.0) and not worker.adopted
    assert worker.started_at == 2.0 and worker.healthy
    assert not beat(pool, "w", 1.2, started_at=2.0)  # same run: nothing more to lose


def test_a_worker_held_across_a_restart_still_records_into_the_pool() -> None:
    pool = new_pool("w")
    chosen = pool.get("w")  # a dispatch pass picks the worker ...
    beat(pool, "w", 0.5, started_at=2.0)  # ... the worker restarts meanwhile ...
    r = request("1")
    pool.assign(chosen, r, 0.5)  # ... and the pass sends to it.
    assert pool.get("w").used() == Capacity(1, 20, 1.0)
    assert not beat(pool, "w", 2.0, started_at=2.0)
    assert beat(pool, "w", 3.0, started_at=2.0).requests == [r]  # never arrived: lost


def test_the_final_drained_heartbeat_gives_back_everything() -> None:
    pool = new_pool("w")
    r = request("1")
    pool.assign(pool.get("w"), r, 0.9)  # sent within the heartbeat lag: lost anyway
    pool.adopt("w", ("x", "9"))
    lost = beat(pool, "w", 1.0, healthy=False, capacity=NO_CAPACITY)
    assert lost.requests == [r] and lost.adopted == [("x", "9")]
    assert pool.get("w").used() == Capacity(0, 0, 0.0) and not with_room(pool)


@pytest.mark.parametrize(("healthy", "capacity"), [(False, CAP), (True, NO_CAPACITY)])
def test_a_heartbeat_short_of_the_drained_one_keeps_the_work(
    healthy: bool, capacity: Capacity
) -> None:
    pool = new_pool("w")
    pool.assign(pool.get("w"), request("1"), 0.9)
    assert not beat(pool, "w", 1.0, healthy=healthy, capacity=capacity)
    assert pool.get("w").used().sequences == 1


def test_a_silent_worker_leaves_rotation_with_its_work() -> None:
    pool = new_pool("quiet", "chatty")
    r = request("1")
    pool.assign(pool.get("quiet"), r, 0.0)
    beat(pool, "quiet", 0.0, [("x", "9")])
    pool.adopt("quiet", ("x", "9"))
    beat(pool, "chatty", 4.0)
    assert pool.silent(TIMEOUT_S) == []  # exactly timeout_s: not yet
    ((worker, lost),) = pool.silent(TIMEOUT_S + 0.1)
    assert worker.worker_id == "quiet" and not worker.healthy
    assert lost.requests == [r] and lost.adopted == [("x", "9")]
    assert pool.running_on(("x", "9")) is None
    assert with_room(pool) == ["chatty"]
    assert pool.silent(TIMEOUT_S + 0.2) == []  # reported once


def test_work_sent_to_a_silent_worker_afterwards_comes_back_on_the_next_check() -> None:
    pool = new_pool("w")
    chosen = pool.get("w")
    assert len(pool.silent(TIMEOUT_S + 1)) == 1
    r = request("1")
    pool.assign(chosen, r, TIMEOUT_S + 1)  # a pass that chose it before it went silent
    ((_, lost),) = pool.silent(TIMEOUT_S + 2)
    assert lost.requests == [r]


def test_a_healthy_worker_that_keeps_beating_is_never_silent() -> None:
    pool = new_pool("w")
    r = request("1")
    pool.assign(pool.get("w"), r, 0.0)
    for tick in range(1, 100):
        now = float(tick)
        assert not beat(pool, "w", now, [key(r)])
        assert pool.silent(now + TIMEOUT_S) == []
    assert pool.get("w").healthy and pool.get("w").used().sequences == 1


def test_pool_settings_are_checked() -> None:
    for settings in (
        {"timeout_s": 0.0},
        {"timeout_s": 1.0, "heartbeat_lag_s": -1.0},
        {"timeout_s": 1.0, "missing_beats": 0},
    ):
        with pytest.raises(ValueError):
            WorkerPool(**settings)


# -- lost requests --------------------------------------------------------------------------


def test_a_request_missing_from_two_heartbeats_in_a_row_is_lost() -> None:
    pool = new_pool("w")
    r = request("1")
    pool.assign(pool.get("w"), r, 0.0)
    assert not beat(pool, "w", 2.0)
    lost = beat(pool, "w", 3.0)
    assert lost.requests == [r] and not lost.adopted
    assert pool.get("w").used() == Capacity(0, 0, 0.0)
    assert not beat(pool, "w", 4.0)  # given back once


def test_a_heartbeat_within_the_lag_of_the_send_does_not_count() -> None:
    pool = new_pool("w")
    r = request("1")
    pool.assign(pool.get("w"), r, 0.0)
    assert not beat(pool, "w", 0.9)  # the batch may not have reached the worker yet
    assert not beat(pool, "w", 2.0)
    assert beat(pool, "w", 3.0).requests == [r]


def test_after_a_reconnect_what_was_sent_before_counts_from_the_reconnect() -> None:
    """A batch sent while the dispatcher's connection was down waits in its client's
    buffer: heartbeats before the reconnect (and its lag) must not take it back."""
    pool = new_pool("w")
    r = request("1")
    pool.assign(pool.get("w"), r, 0.0)
    assert not beat(pool, "w", 2.0)  # one miss counted
    pool.sent_again(5.0)  # the connection came back: the batch leaves only now
    assert not beat(pool, "w", 5.5)
    assert not beat(pool, "w", 6.5)  # the earlier miss no longer counts
    assert beat(pool, "w", 7.5).requests == [r]  # two misses after the lag: lost


def test_a_request_listed_again_starts_its_count_over() -> None:
    pool = new_pool("w")
    r = request("1")
    pool.assign(pool.get("w"), r, 0.0)
    assert not beat(pool, "w", 2.0)
    assert not beat(pool, "w", 3.0, [key(r)])
    assert not beat(pool, "w", 4.0)
    assert beat(pool, "w", 5.0).requests == [r]


# -- adoption -------------------------------------------------------------------------------


def test_running_on_names_the_worker_whose_last_heartbeat_lists_the_key() -> None:
    pool = new_pool("w", "v")
    k = ("x", "9")
    assert pool.running_on(k) is None
    beat(pool, "w", 1.0, [k])
    assert pool.running_on(k) == "w"
    beat(pool, "w", 2.0)  # no longer there
    assert pool.running_on(k) is None
    beat(pool, "v", 3.0, [k])
    assert pool.running_on(k) == "v"


def test_completing_an_adopted_request_forgets_it() -> None:
    pool = new_pool("w")
    k = ("x", "9")
    beat(pool, "w", 1.0, [k])
    pool.adopt("w", k)
    assert pool.complete("w", k, 0.0) is None  # it was not sent by this dispatcher
    assert pool.running_on(k) is None and not pool.get("w").adopted
    assert pool.get("w").used() == Capacity(0, 0, 0.0)  # adoption never held capacity
    assert not beat(pool, "w", 2.0) and not beat(pool, "w", 3.0)


def test_an_adopted_request_missing_from_two_heartbeats_comes_back() -> None:
    pool = new_pool("w")
    k = ("x", "9")
    beat(pool, "w", 1.0, [k])
    pool.adopt("w", k)
    assert not beat(pool, "w", 2.0)
    lost = beat(pool, "w", 3.0)
    assert lost.adopted == [k] and not lost.requests
    assert not pool.get("w").adopted


def test_missing_counts_do_not_outlive_the_work_a_worker_lost() -> None:
    pool = new_pool("w")
    k = ("x", "9")
    beat(pool, "w", 1.0, [k])
    pool.adopt("w", k)
    assert not beat(pool, "w", 2.0)  # missed once
    assert pool.silent(2.0 + TIMEOUT_S + 1)[0][1].adopted == [k]
    # Back after a partition (same run), running the request, adopted again.
    beat(pool, "w", 10.0, [k])
    pool.adopt("w", k)
    assert not beat(pool, "w", 11.0)  # its first miss in this stretch
    assert beat(pool, "w", 12.0).adopted == [k]


def test_a_restart_keeps_what_was_sent_after_the_new_run_started() -> None:
    """Sent after the new process started: it may be running there, so only the missing-
    heartbeat check may take it back (taking it at once could run it twice)."""
    pool = new_pool("w")
    worker = pool.get("w")
    early, late = request("early"), request("late")
    pool.assign(worker, early, 0.5)
    pool.assign(worker, late, 3.0)
    lost = beat(pool, "w", 3.5, [key(late)], started_at=2.0)  # restarted at t=2
    assert lost.requests == [early]
    assert key(late) in worker.assigned
    assert not beat(pool, "w", 5.0, started_at=2.0)  # missing once
    assert beat(pool, "w", 6.0, started_at=2.0).requests == [late]  # missing twice


def test_a_worker_gone_for_good_is_forgotten() -> None:
    pool = new_pool("w")
    pool.silent(TIMEOUT_S + 1.0)
    assert pool.get("w") is not None and not pool.get("w").healthy
    pool.silent(TIMEOUT_S * FORGET_AFTER_TIMEOUTS + 1.0)
    assert pool.get("w") is None


# -- probes and eviction ------------------------------------------------------------------


def test_probes_are_due_after_a_stall_with_work_or_a_longer_idle_spell() -> None:
    pool = new_pool("busy", "idle")
    pool.assign(pool.get("busy"), request("r1"), 1.0)
    assert pool.probes_due(10.9, stall_s=10.0, idle_s=30.0) == []  # busy since 1 s
    assert [w.worker_id for w in pool.probes_due(11.0, 10.0, 30.0)] == ["busy"]
    pool.complete("busy", ("a", "r1"), 11.0)  # progress: the clock starts again
    assert pool.probes_due(29.9, 10.0, 30.0) == []
    assert {w.worker_id for w in pool.probes_due(30.0, 10.0, 30.0)} == {"idle"}
    assert {w.worker_id for w in pool.probes_due(41.0, 10.0, 30.0)} == {"busy", "idle"}


def test_one_probe_at_a_time_and_an_answer_resets_the_clock() -> None:
    pool = new_pool("w")
    worker = pool.get("w")
    pool.probe_sent(worker, "p1", 30.0)
    assert pool.probes_due(31.0, 10.0, 30.0) == []  # p1 is still out
    assert pool.probe_answered("w", "p0", True, 31.0) is None  # not the awaited probe
    assert worker.probe_id == "p1"
    assert pool.probe_answered("w", "p1", True, 31.0) is None
    assert worker.probe_id is None and worker.progress_at == 31.0
    assert pool.probes_due(60.9, 10.0, 30.0) == []


def test_failed_probes_in_a_row_evict_the_worker_with_its_work() -> None:
    pool = new_pool("w", "v")
    worker = pool.get("w")
    r1 = request("r1")
    pool.assign(worker, r1, 1.0)
    pool.probe_sent(worker, "p1", 11.0)
    assert pool.probes_overdue(15.9, timeout_s=5.0) == []
    [(failed, lost)] = pool.probes_overdue(16.0, timeout_s=5.0)
    assert failed is worker and lost is None and worker.healthy  # one failure of two
    pool.probe_sent(worker, "p2", 26.0)
    assert pool.probe_answered("w", "p2", False, 27.0) == Lost([r1], [])  # an error answer
    assert worker.evicted and not worker.healthy and not worker.assigned
    assert with_room(pool) == ["v"]
    assert pool.probes_due(100.0, 10.0, 30.0) == [pool.get("v")]  # no probes for w


def test_a_success_between_failures_starts_the_count_again() -> None:
    pool = new_pool("w")
    worker = pool.get("w")
    for probe_id, ok in (("p1", False), ("p2", True), ("p3", False)):
        pool.probe_sent(worker, probe_id, 1.0)
        assert pool.probe_answered("w", probe_id, ok, 2.0) is None
    assert worker.healthy and worker.probe_failures == 1


def test_an_evicted_worker_is_ignored_until_it_restarts() -> None:
    pool = WorkerPool(timeout_s=TIMEOUT_S, evict_after=1)
    assert not beat(pool, "w", 0.0)
    worker = pool.get("w")
    pool.probe_sent(worker, "p1", 1.0)
    assert pool.probe_answered("w", "p1", False, 2.0) == Lost()
    # Its heartbeats still come (its event loop runs) but change nothing.
    assert not beat(pool, "w", 3.0, [("a", "x")])
    assert worker.evicted and not worker.healthy and pool.running_on(("a", "x")) is None
    # A new run is a new worker: back in rotation.
    assert not beat(pool, "w", 4.0, started_at=3.5)
    assert worker.healthy and not worker.evicted and with_room(pool) == ["w"]


def test_tokens_generated_since_the_last_heartbeat_count_as_progress() -> None:
    pool = new_pool("w")
    pool.assign(pool.get("w"), request("long"), 1.0)
    assert not pool.heartbeat("w", "ep", 1.0, CAP, {("a", "long")}, True, 5.0, output_tokens=40)
    assert pool.probes_due(14.9, stall_s=10.0, idle_s=30.0) == []  # tokens came at 5 s
    assert not pool.heartbeat("w", "ep", 1.0, CAP, {("a", "long")}, True, 6.0, output_tokens=40)
    assert pool.probes_due(15.0, 10.0, 30.0) == [pool.get("w")]  # none since
