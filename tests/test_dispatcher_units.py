"""The dispatcher's own settings and message handling, without a broker (the worker pool:
test_core_workers)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from nats.aio.msg import Msg

from broker_config.config import BrokerSettings, DispatcherOptions, load_config
from broker_config.direct_get import DirectGetError
from broker_config.kv_writer import PutError
from broker_config.wire import Encoding, SubmitRequest, Submission
from costmodel.units import NO_CAPACITY
from dispatcher.admit import HAND_BACK_S, Admission
from dispatcher.core.workers import Lost, Worker
from dispatcher.held import Held, HeldRequests
from dispatcher.metrics import DispatcherMetrics
from dispatcher.park import HDR_PARKED_AT, HDR_PARKED_ID, restore, stored_at
from dispatcher.reports import WorkerReports

SUBJECTS = BrokerSettings().subjects


def test_options_refuse_a_window_larger_than_what_may_be_held():
    with pytest.raises(ValueError, match="tenant_window"):
        DispatcherOptions(tenant_window=2000, max_ack_pending=1000)
    with pytest.raises(ValueError, match="tenant_window"):
        DispatcherOptions(tenant_window=1)


ACK = "$JS.ACK.FQ_{stream}.fq~{consumer}.1.17.5.1795997433664286007.2"  # stored at ...433.66


def delivered(subject: str, headers: dict[str, str], stream: str, consumer: str) -> Msg:
    return Msg(None, subject=subject, reply=ACK.format(stream=stream, consumer=consumer),
               headers=headers)


def test_only_a_parked_copy_keeps_the_original_store_time_and_id():
    forged = {"Nats-Msg-Id": "r1", HDR_PARKED_AT: "1", HDR_PARKED_ID: "other"}
    # A client sent the parking headers with its request: neither is believed.
    direct = delivered("fq.q.3.chat.acme", forged, "REQUESTS", "shard~3")
    assert stored_at(direct, SUBJECTS) == pytest.approx(1795997433.664286)
    # A parked copy: stored at its move, first stored at Fq-Parked-At, its id restored.
    parked = delivered("fq.park.chat.acme", {"Nats-Msg-Id": "park-17", HDR_PARKED_ID: "r1",
                                             HDR_PARKED_AT: "1700000000000000000"},
                       "PARKED", "parked~acme")
    assert stored_at(parked, SUBJECTS) == 1700000000.0
    assert restore(parked).headers == {"Nats-Msg-Id": "r1",
                                       HDR_PARKED_AT: "1700000000000000000"}


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


@pytest.mark.parametrize("error", [PutError("results: no responders"),
                                   DirectGetError("batch direct get: timeout")])
async def test_a_streamed_request_whose_end_cannot_be_stored_is_handed_back_not_dropped(
        error: Exception):
    config = load_config()
    metrics = DispatcherMetrics(list(config.endpoints))
    held = HeldRequests()
    submission = Submission("chat", "acme", "r1", SubmitRequest(prompt="hi"), None,
                            Encoding.JSON)
    msg = HandedBack()
    held.adopted[("acme", "r1")] = Held(msg, submission, 0.0, worker="chat-w1", streamed=True)
    admission = Admission(config, config.dispatcher, SUBJECTS, None, None, None, held,
                          RefusingResults(error), metrics, dict)
    reports = WorkerReports(config, SUBJECTS, SimpleNamespace(endpoints={}), None, held,
                            admission, None, metrics, asyncio.Event(), None)
    worker = Worker("chat-w1", "chat", 1.0, NO_CAPACITY, 0.0)
    await reports.evicted(worker, Lost(adopted=[("acme", "r1")]))
    # Naked, a little later than at once: redelivered, it runs again rather than vanish,
    # and a results bucket that keeps failing does not spin redeliveries.
    assert msg.settled == [("nak", HAND_BACK_S)]
    assert held.get(("acme", "r1")) is None
    assert metrics.child(metrics.failed_by_lost_worker, "chat")._value.get() == 0
