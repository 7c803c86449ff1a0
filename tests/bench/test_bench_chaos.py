"""The chaos benchmark's arithmetic (bench/chaos/watch.py) on recorded data made up here:
what counts as lost, as two results, as run twice, and each fault's times. The run
itself, against real processes, is tests/bench/test_bench_smoke.py::test_chaos_smoke."""

from __future__ import annotations

from bench.chaos.ha import HaFault, ha_failures, ha_figures
from bench.chaos.run import failures
from bench.chaos.watch import Fault, Watch, _Dispatch, verdict
from broker_config import wire, wire_internal
from broker_config.subjects import Subjects
from costmodel.units import Usage

USAGE = Usage(4, 8, 0.0)


def done(rid: str, text: str = "ok") -> wire.DoneEvent:
    return wire.DoneEvent(
        id=rid,
        seq=1,
        text=text,
        usage=USAGE,
        timings=wire.Timings(queued_s=0.1, ttft_s=0.2, total_s=1.0),
    )


def completion(
    rid: str, worker: str, at: float, code: wire.ErrorCode | None = None
) -> tuple[float, wire_internal.Completion]:
    return at, wire_internal.Completion(
        id=rid,
        tenant="A",
        endpoint="chat",
        worker_id=worker,
        usage=USAGE,
        code=code,
        stored=True,
        finished_at=at,
    )


def stored(event: wire.FinalEvent) -> wire_internal.StoredResult:
    return wire_internal.StoredResult(tenant="A", endpoint="chat", event=event, stored_at=0.0)


def test_verdict_counts_lost_two_results_repeats_and_runs_to_completion() -> None:
    watch = Watch(None, Subjects(), "chat", "_INBOX.x")
    keys = [("A", f"r{n}") for n in range(5)]
    # r0: fine. r1: never answered nor stored. r2: a final differing from the stored one.
    # r3: the same final twice. r4: two runs completed it.
    watch.finals[keys[0]] = [done("r0")]
    watch.finals[keys[2]] = [done("r2", "one")]
    watch.finals[keys[3]] = [done("r3"), done("r3")]
    watch.finals[keys[4]] = [done("r4")]
    watch.completions[keys[4]] = [completion("r4", "w1", 1.0), completion("r4", "w2", 2.0)]
    results = {
        keys[0]: stored(done("r0")),
        keys[2]: stored(done("r2", "other")),
        keys[3]: stored(done("r3")),
        keys[4]: stored(done("r4")),
    }
    figures = verdict(watch, [], keys, results)
    assert (
        figures["lost"],
        figures["two_different_results"],
        figures["final_repeated_identical"],
        figures["ran_twice_to_completion"],
    ) == (1, 1, 1, 1)
    assert figures["outcomes"] == {"done": 4, "none": 1}


def test_fault_figures_time_detection_redispatch_and_replacement() -> None:
    watch = Watch(None, Subjects(), "chat", "_INBOX.x")
    moved, streamed, stayed = ("A", "moved"), ("A", "streamed"), ("A", "stayed")
    for key in (moved, streamed, stayed):
        watch.dispatches[key].append(_Dispatch(5.0, "w1"))
    watch.dispatches[moved].append(_Dispatch(17.0, "w2"))  # sent elsewhere 7 s after
    watch.final_at[streamed] = 16.0  # ended by the dispatcher 6 s after
    watch.completions[stayed] = [completion("stayed", "w1", 11.0)]
    watch.runs["w1"] = [(0.0, 100.0), (19.5, 200.0)]  # a new process 9.5 s after
    watch.evictions.append(
        (16.0, wire_internal.Evict(endpoint="chat", worker_id="w1", started_at=100.0))
    )
    watch.evictions.append(
        (30.0, wire_internal.Evict(endpoint="chat", worker_id="w3", started_at=300.0))
    )
    assert watch.held_by("w1", 10.0) == {moved, streamed, stayed}
    assert watch.held_by("w1", 12.0) == {moved, streamed}  # `stayed` finished at 11
    fault = Fault("hang", "w1", 42, 100.0, 10.0, watch.held_by("w1", 10.0))
    figures = verdict(watch, [fault], [moved, streamed, stayed], {})
    (row,) = figures["faults"]
    assert row["held"] == 3 and row["finished_where_they_were"] == 1
    assert row["evicted_s"] == 6.0 and row["detected_s"] == 6.0
    assert row["redispatched_s"] == 7.0 and row["replacement_serving_s"] == 9.5
    # w1's eviction was its hang; w3 had no fault: a healthy worker evicted.
    assert figures["healthy_evictions"] == 1 and figures["healthy_evicted"] == ["w3"]


def test_only_requests_sent_to_a_lost_worker_may_end_with_internal() -> None:
    watch = Watch(None, Subjects(), "chat", "_INBOX.x")
    on_hung, on_slowed, on_healthy = ("A", "on-hung"), ("A", "on-slowed"), ("A", "on-ok")
    watch.dispatches[on_hung].append(_Dispatch(5.0, "w1"))
    watch.dispatches[on_slowed].append(_Dispatch(5.0, "w2"))
    watch.dispatches[on_healthy].append(_Dispatch(5.0, "w3"))
    ended = {
        key: stored(
            wire.ErrorEvent(
                id=key[1], code=wire.ErrorCode.INTERNAL, message="lost", retry_after_s=1.0
            )
        )
        for key in (on_hung, on_slowed, on_healthy)
    }
    faults = [
        Fault("hang", "w1", 1, 100.0, 10.0, {on_hung}),
        Fault("slow", "w2", 2, 200.0, 10.0, {on_slowed}),
    ]
    figures = verdict(watch, faults, list(ended), ended)
    # A slowed worker keeps its work, so its requests have no reason to end so either.
    assert figures["internal_elsewhere"] == 2
    assert sorted(figures["internal_elsewhere_ids"]) == [list(on_healthy), list(on_slowed)]
    assert "internal_elsewhere" in failures(figures, saturated=False)


def test_a_saturated_run_fails_on_any_sign_of_a_healthy_worker_thought_lost() -> None:
    clean = {
        "lost": 0,
        "two_different_results": 0,
        "ran_twice_to_completion": 0,
        "internal_elsewhere": 0,
        "healthy_evictions": 0,
        "evictions": 0,
        "redispatched": 0,
    }
    assert failures(clean, saturated=True) == []
    assert failures(clean | {"redispatched": 2}, saturated=True) == ["redispatched"]
    assert failures(clean | {"redispatched": 2}, saturated=False) == []  # faults do that
    assert failures(clean | {"evictions": 1}, saturated=True) == ["evictions"]
    assert failures(clean | {"evictions": 1}, saturated=False) == []  # a hang's
    assert failures(clean | {"internal_elsewhere": 1}, saturated=False) == ["internal_elsewhere"]
    assert failures(clean | {"lost": 1}, saturated=False) == ["lost"]


def test_ha_figures_time_the_new_holder_new_and_waiting_requests_and_count_resends() -> None:
    watch = Watch(None, Subjects(), "chat", "_INBOX.x")
    waiting, running, resent, new = ("A", "w"), ("A", "r"), ("A", "r2"), ("A", "n")
    watch.submitted_at.update({waiting: 9.0, running: 5.0, resent: 5.0, new: 11.0})
    watch.dispatches[running].append(_Dispatch(6.0, "w1"))
    watch.dispatches[resent].append(_Dispatch(6.0, "w1"))
    watch.dispatches[resent].append(_Dispatch(13.5, "w2"))  # sent again: a defect
    watch.dispatches[waiting].append(_Dispatch(14.0, "w2"))
    watch.dispatches[new].append(_Dispatch(13.0, "w1"))
    watch.epoch_first_batch.update({1: 1.0, 2: 12.5})
    assert watch.waiting(10.0) == {waiting}
    assert watch.running(10.0) == {running, resent}
    fault = HaFault("dispatcher-kill", "vm:1:x", 10.0, 1, watch.waiting(10.0), watch.running(10.0))
    (row,) = ha_figures(watch, [fault])
    assert row["new_holder_s"] == 2.5 and row["new_request_dispatched_s"] == 3.0
    assert row["waiting"] == 1 and row["waiting_dispatched_s"] == 4.0
    assert row["running"] == 2 and row["running_sent_again"] == 1
    assert ha_failures([row]) == ["dispatcher-kill: running requests sent again"]
    # Past the goals (5 s for new requests, 30 s for waiting ones): failed, as is a
    # dispatcher fault after which no new request was dispatched at all.
    late = row | {
        "new_request_dispatched_s": 5.5,
        "waiting_dispatched_s": 30.5,
        "running_sent_again": 0,
    }
    assert ha_failures(
        [late, row | {"new_request_dispatched_s": None, "running_sent_again": 0}]
    ) == [
        "dispatcher-kill: new requests",
        "dispatcher-kill: waiting requests",
        "dispatcher-kill: new requests",
    ]
    # A node kill keeps its holder: only what it cost the requests counts.
    assert ha_failures([late | {"kind": "node-kill"}]) == []
