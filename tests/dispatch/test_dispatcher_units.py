"""The dispatcher's own settings and message handling, without a broker (the worker pool:
test_core_workers)."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import pytest
from nats.aio.msg import Msg

from broker_config.config import BrokerSettings, ConfigError, DispatcherOptions, load_config
from broker_config.direct_get import DirectGetError
from broker_config.kv_writer import PutError
from broker_config.wire import (
    DoneEvent,
    Encoding,
    ErrorCode,
    Submission,
    SubmitRequest,
    Timings,
    encode,
)
from broker_config.wire_internal import Completion, Completions, StoredResult
from costmodel.units import NO_CAPACITY, Capacity, Usage
from dispatcher.__main__ import build_parser, with_flags
from dispatcher.admission.admit import Admission
from dispatcher.core.pool import Lost, Worker, WorkerPool
from dispatcher.core.scheduler import Scheduler
from dispatcher.dispatch.endings import HAND_BACK_S, Endings
from dispatcher.dispatch.held import Held, HeldRequests
from dispatcher.dispatch.reports import WorkerReports
from dispatcher.fleet.drift import advertised_mu_per_s, at_limits
from dispatcher.intake.park import HDR_PARKED_AT, HDR_PARKED_ID, restore, stored_at
from dispatcher.observe.metrics import DispatcherMetrics
from dispatcher.parts import Parts
from tests.core_support import make_config, req

SUBJECTS = BrokerSettings().subjects


def test_options_refuse_a_window_larger_than_what_may_be_held():
    with pytest.raises(ValueError, match="tenant_window"):
        DispatcherOptions(tenant_window=2000, max_ack_pending=1000)
    with pytest.raises(ValueError, match="tenant_window"):
        DispatcherOptions(tenant_window=1)


ACK = "$JS.ACK.FQ_{stream}.fq~{consumer}.1.17.5.1795997433664286007.2"  # stored at ...433.66


def delivered(subject: str, headers: dict[str, str], stream: str, consumer: str) -> Msg:
    return Msg(
        None, subject=subject, reply=ACK.format(stream=stream, consumer=consumer), headers=headers
    )


def test_only_a_parked_copy_keeps_the_original_store_time_and_id():
    forged = {"Nats-Msg-Id": "r1", HDR_PARKED_AT: "1", HDR_PARKED_ID: "other"}
    # A client sent the parking headers with its request: neither is believed.
    direct = delivered("fq.q.3.chat.acme", forged, "REQUESTS", "shard~3")
    assert stored_at(direct, SUBJECTS) == pytest.approx(1795997433.664286)
    # A parked copy: stored at its move, first stored at Fq-Parked-At, its id restored.
    parked = delivered(
        "fq.park.chat.acme",
        {"Nats-Msg-Id": "park-17", HDR_PARKED_ID: "r1", HDR_PARKED_AT: "1700000000000000000"},
        "PARKED",
        "parked~acme",
    )
    assert stored_at(parked, SUBJECTS) == 1700000000.0
    assert restore(parked).headers == {"Nats-Msg-Id": "r1", HDR_PARKED_AT: "1700000000000000000"}


class HandedBack:
    """A held message that records how it was settled."""

    def __init__(self) -> None:
        self.settled: list[tuple[str, float | None]] = []

    async def nak(self, delay: float | None = None) -> None:
        self.settled.append(("nak", delay))

    async def term(self) -> None:
        self.settled.append(("term", None))


class RefusingResults:
    """The results bucket while the broker is unreachable (a put), or while reading the
    result that stands fails (a create that found a value)."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    async def finish(self, msg, submission, event, now):
        raise self.error


def reports_holding_r1(
    msg,
    results,
    *,
    streamed: bool,
    reply: str | None = None,
    scheduler=None,
    probes=None,
    holds_lease=lambda: True,
) -> tuple[WorkerReports, HeldRequests, DispatcherMetrics]:
    """Worker reports whose dispatcher holds request r1 of acme, adopted on chat-w1."""
    config = load_config()
    metrics = DispatcherMetrics(list(config.endpoints))
    held = HeldRequests()
    submission = Submission("chat", "acme", "r1", SubmitRequest(prompt="hi"), reply, Encoding.JSON)
    held.adopted[("acme", "r1")] = Held(msg, submission, 0.0, worker="chat-w1", streamed=streamed)
    parts = Parts(
        nc=None,
        subjects=SUBJECTS,
        scheduler=scheduler or SimpleNamespace(endpoints={}, config=config),
        pool=WorkerPool(timeout_s=math.inf),
        held=held,
        results=results,
        metrics=metrics,
        limiter=None,
        wake=asyncio.Event(),
        backlog=dict,
    )
    endings = Endings(parts)
    reports = WorkerReports(parts, Admission(parts, endings), endings, probes, holds_lease)
    return reports, held, metrics


@pytest.mark.parametrize(
    "error", [PutError("results: no responders"), DirectGetError("batch direct get: timeout")]
)
async def test_a_streamed_request_whose_end_cannot_be_stored_is_handed_back_not_dropped(
    error: Exception,
):
    msg = HandedBack()
    reports, held, metrics = reports_holding_r1(msg, RefusingResults(error), streamed=True)
    worker = Worker("chat-w1", "chat", 1.0, NO_CAPACITY, 0.0)
    reports.evicted(worker, Lost(adopted=[("acme", "r1")]))
    await reports.take_back(0.0)
    # Naked, a little later than at once: redelivered, it runs again rather than vanish,
    # and a results bucket that keeps failing does not spin redeliveries.
    assert msg.settled == [("nak", HAND_BACK_S)]
    assert held.get(("acme", "r1")) is None
    assert metrics.child(metrics.failed_by_lost_worker, "chat")._value.get() == 0


async def test_work_lost_while_the_lease_is_not_valid_waits_for_it_to_be_valid_again():
    """A dispatcher whose lease lapsed (it was paused, its renewals failed) ends and moves
    nothing: those requests may be the next holder's. Valid again, it takes them back."""
    msg = HandedBack()
    lease_valid = False
    reports, held, _ = reports_holding_r1(
        msg,
        RefusingResults(PutError("results: no responders")),
        streamed=True,
        holds_lease=lambda: lease_valid,
    )
    worker = Worker("chat-w1", "chat", 1.0, NO_CAPACITY, 0.0)
    reports.evicted(worker, Lost(adopted=[("acme", "r1")]))
    await reports.take_back(1.0)
    assert msg.settled == [] and held.get(("acme", "r1")) is not None
    lease_valid = True
    await reports.take_back(2.0)
    assert msg.settled == [("nak", HAND_BACK_S)]  # its end could not be stored: handed back
    assert held.get(("acme", "r1")) is None


class Acked(HandedBack):
    async def ack(self) -> None:
        self.settled.append(("ack", None))


class StoredResults:
    """The results bucket holding `stored`, or failing every lookup (`error`)."""

    def __init__(self, stored: dict, error: Exception | None = None) -> None:
        self.stored, self.error = stored, error
        self.published: list[tuple[str | None, object]] = []

    async def lookup(self, keys):
        if self.error is not None:
            raise self.error
        return {key: self.stored[key] for key in keys if key in self.stored}

    async def publish(self, reply, encoding, event) -> None:
        self.published.append((reply, event))


def quiet_reports(
    results: StoredResults, probes=None, holds_lease=lambda: True
) -> tuple[WorkerReports, HeldRequests, Acked]:
    """Reports holding request r1 of acme, adopted on chat-w1, which streamed nothing."""
    msg = Acked()
    scheduler = SimpleNamespace(
        endpoints={},
        complete=lambda *_: None,
        cancel=lambda *_: None,
        requeue=lambda *_: None,
        config=load_config(),
    )  # r1 is adopted: not in the core
    reports, held, _ = reports_holding_r1(
        msg,
        results,
        streamed=False,
        reply="_INBOX.r1",
        scheduler=scheduler,
        probes=probes,
        holds_lease=holds_lease,
    )
    return reports, held, msg


async def test_a_quiet_request_gone_from_its_worker_is_answered_from_its_stored_result():
    """A short request finished between two heartbeats and its completion was lost (a
    broker node died under its worker): its stored result answers it, nothing runs it
    again."""
    event = DoneEvent(
        id="r1",
        seq=2,
        text="ok",
        usage=Usage(4, 8, 0.0),
        timings=Timings(queued_s=0.1, ttft_s=0.2, total_s=1.0),
    )
    results = StoredResults(
        {("acme", "r1"): StoredResult(tenant="acme", endpoint="chat", event=event, stored_at=1.0)}
    )
    reports, held, msg = quiet_reports(results)
    worker = Worker("chat-w1", "chat", 1.0, NO_CAPACITY, 0.0)
    reports.evicted(worker, Lost(adopted=[("acme", "r1")]))
    await reports.take_back(0.0)
    assert msg.settled == [("ack", None)]
    assert results.published == [("_INBOX.r1", event)]  # its final event, sent again
    assert held.get(("acme", "r1")) is None


async def test_a_quiet_request_whose_result_cannot_be_looked_up_goes_back_through_admission():
    results = StoredResults({}, error=DirectGetError("batch direct get: timeout"))
    reports, held, msg = quiet_reports(results)
    worker = Worker("chat-w1", "chat", 1.0, NO_CAPACITY, 0.0)
    reports.evicted(worker, Lost(adopted=[("acme", "r1")]))
    await reports.take_back(0.0)
    assert msg.settled == [("nak", None)]  # redelivered: admission looks again
    assert held.get(("acme", "r1")) is None and results.published == []


async def test_a_lease_that_lapses_during_the_lookup_leaves_the_work_for_when_it_is_valid():
    """The lookup is the long wait of a take-back: a pause there may hand the lease on,
    and what the lookup found is then the next holder's to act on."""
    event = DoneEvent(
        id="r1",
        seq=2,
        text="ok",
        usage=Usage(4, 8, 0.0),
        timings=Timings(queued_s=0.1, ttft_s=0.2, total_s=1.0),
    )
    lease = {"valid": True}

    class LapsingResults(StoredResults):
        """The lease lapses during the first lookup (a pause)."""

        lapsed = False

        async def lookup(self, keys):
            if not self.lapsed:
                self.lapsed, lease["valid"] = True, False
            return await super().lookup(keys)

    results = LapsingResults(
        {("acme", "r1"): StoredResult(tenant="acme", endpoint="chat", event=event, stored_at=1.0)}
    )
    reports, held, msg = quiet_reports(results, holds_lease=lambda: lease["valid"])
    reports.evicted(
        Worker("chat-w1", "chat", 1.0, NO_CAPACITY, 0.0), Lost(adopted=[("acme", "r1")])
    )
    await reports.take_back(0.0)
    assert msg.settled == [] and results.published == []
    assert held.get(("acme", "r1")) is not None
    lease["valid"] = True
    await reports.take_back(1.0)
    assert msg.settled == [("ack", None)] and results.published == [("_INBOX.r1", event)]


async def test_an_eviction_in_a_completions_message_is_taken_back_outside_its_lock():
    """A failed probe answer in a completions message evicts its worker; taking back a
    request answered from its stored result completes it under the completions lock,
    which the message's handler holds: it must not wait for itself."""
    event = DoneEvent(
        id="r1",
        seq=2,
        text="ok",
        usage=Usage(4, 8, 0.0),
        timings=Timings(queued_s=0.1, ttft_s=0.2, total_s=1.0),
    )
    results = StoredResults(
        {("acme", "r1"): StoredResult(tenant="acme", endpoint="chat", event=event, stored_at=1.0)}
    )
    worker = Worker("chat-w1", "chat", 1.0, NO_CAPACITY, 0.0)

    class FailedProbe:
        async def answered(self, done, now):
            return worker, Lost(adopted=[("acme", "r1")])

    reports, held, msg = quiet_reports(results, probes=FailedProbe())
    probe = Completion(
        id="probe-1",
        tenant="acme",
        endpoint="chat",
        worker_id="chat-w1",
        usage=Usage(1, 1, 0.0),
        code=ErrorCode.INTERNAL,
        stored=False,
        finished_at=1.0,
        probe=True,
    )
    message = SimpleNamespace(data=encode(Completions([probe])), headers=None)
    taking_back = asyncio.create_task(reports.take_back_loop(tick_s=0.05))
    try:
        await asyncio.wait_for(reports.on_completions(message), timeout=5)
        for _ in range(100):
            if msg.settled:
                break
            await asyncio.sleep(0.02)
    finally:
        reports.stop_taking_back()
        await asyncio.wait_for(taking_back, timeout=5)
    assert msg.settled == [("ack", None)] and results.published == [("_INBOX.r1", event)]


def test_an_endpoint_is_at_its_limits_only_without_room_outside_a_held_reserve():
    """The drift reading counts only while the workers run at their limits: work waits
    that no worker has room for, the newcomer reserve's room not counted while it may be
    needed, and no worker draining."""
    scheduler = Scheduler(make_config(reserve=0.5, sequences=2))
    pool = WorkerPool(timeout_s=math.inf)
    worker = pool.add("w1", "ep", Capacity(2, 10**9, 1e12), 0.0)
    queues = scheduler.endpoints["ep"]
    assert not at_limits(queues, [worker], 0.0)  # nothing waits
    for n in range(3):
        scheduler.enqueue(req("a", n), 0.0)
    assert not at_limits(queues, [], 0.0)  # no worker serves
    assert not at_limits(queues, [worker], 10.0)  # one slot free outside the reserve
    pool.assign(worker, req("a", "r1"), 10.0)
    # Only the reserved slot is free, and a newcomer may come within the window ...
    assert queues.reserve_can_matter(10.0) and at_limits(queues, [worker], 10.0)
    # ... after which the reserve is lent out: there is room.
    assert not queues.reserve_can_matter(100.0) and not at_limits(queues, [worker], 100.0)
    pool.assign(worker, req("a", "r2"), 100.0)
    assert at_limits(queues, [worker], 100.0)
    worker.capacity = Capacity(1, 10**9, 1e12)  # it drains: offers less than its size
    assert not at_limits(queues, [worker], 100.0)


def test_a_worker_without_a_sensible_capacity_counts_at_its_profiles():
    profile = load_config().profiles["llama-7b-sim"]
    worker = Worker("w1", "chat", 0.0, Capacity(1, 1, 1.0), 0.0)
    for said, counted in (
        (12.5, 12.5),
        (0.0, profile.capacity_mu_per_s),
        (math.nan, profile.capacity_mu_per_s),
        (math.inf, profile.capacity_mu_per_s),
    ):
        worker.mu_per_s = said
        assert advertised_mu_per_s(worker, profile) == counted


def test_flags_override_single_fields_and_a_bad_value_is_named():
    config = load_config()
    changed = with_flags(config, build_parser().parse_args(["--replicas", "3", "--grace", "5"]))
    assert changed.broker.replicas == 3 and changed.dispatcher.grace_s == 5.0
    assert changed.broker.prefix == config.broker.prefix
    assert changed.dispatcher.ack_wait_s == config.dispatcher.ack_wait_s
    with pytest.raises(ConfigError, match="replicas"):
        with_flags(config, build_parser().parse_args(["--replicas", "9"]))
