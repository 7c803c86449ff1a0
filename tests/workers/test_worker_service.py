"""workers.service and `python -m workers`: the worker's NATS edge on a real nats-server."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import nats
import nats.errors
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from broker_config.config import (
    BrokerSettings,
    ConfigError,
    WorkerOptions,
    parse_config,
)
from broker_config.streams import provision
from broker_config.subjects import HDR_CONTENT_TYPE, Subjects
from broker_config.wire import (
    EVENT,
    ChatMessage,
    DoneEvent,
    Encoding,
    ErrorCode,
    ErrorEvent,
    Event,
    SubmitRequest,
    TokenEvent,
    encode,
)
from broker_config.wire_internal import (
    COMPLETIONS,
    HEARTBEAT,
    STORED_RESULT,
    Abort,
    Batch,
    BatchItem,
    Completion,
    Evict,
    Heartbeat,
    StoredResult,
)
from costmodel.engine_model import EngineParams
from costmodel.units import UNLIMITED_MODEL_UNITS, Capacity, ModelProfile, Usage
from workers import __main__ as worker_main
from workers import results as results_module
from workers.engine import EXPEDITED, PROBE, Engine, EngineRequest
from workers.probe import PROBE_ROOM
from workers.service import WorkerService
from workers.sim_engine import Faults, SimEngine

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

S = Subjects()
ENDPOINT, WORKER, TENANT = "chat", "w1", "acme"
# A decode step takes 1.25 ms: short requests finish in tens of ms, long ones outlast a test.
SCALE = 0.05
LONG = 10_000  # max_tokens of a request that is interrupted long before it ends
PROFILE = ModelProfile(name="test", alpha=0.001, beta=0.01, gamma=0.5, capacity_mu_per_s=3.5)
PARAMS = EngineParams()
WAIT_S = 10.0
ENGINE_CAPACITY = Capacity(
    sequences=PARAMS.max_sequences, tokens=PARAMS.kv_cache_tokens, model_units=UNLIMITED_MODEL_UNITS
)
# What heartbeats advertise: one sequence (and a prompt's KV cache) is kept for probes.
CAPACITY = Capacity(
    PARAMS.max_sequences - 1, PARAMS.kv_cache_tokens - PROBE_ROOM.tokens, UNLIMITED_MODEL_UNITS
)
REPO = Path(__file__).resolve().parents[2]
T = TypeVar("T")


# -- harness -------------------------------------------------------------------------------


class Recorder:
    """Every message on a subject (wildcards allowed), in arrival order."""

    def __init__(self) -> None:
        self.msgs: list[Msg] = []
        self._arrived = asyncio.Event()

    async def start(self, nc: Client, subject: str) -> Recorder:
        await nc.subscribe(subject, cb=self._on_msg)
        await nc.flush()
        return self

    async def _on_msg(self, msg: Msg) -> None:
        self.msgs.append(msg)
        self._arrived.set()

    async def until(self, found: Callable[[list[Msg]], T | None], timeout: float = WAIT_S) -> T:
        """The first truthy `found(msgs)`, re-checked as messages arrive."""
        async with asyncio.timeout(timeout):
            while not (result := found(self.msgs)):
                self._arrived.clear()
                await self._arrived.wait()
        return result


def encoding_of(msg: Msg) -> Encoding:
    return Encoding.from_content_type((msg.headers or {}).get(HDR_CONTENT_TYPE))


def events(rec: Recorder, request_id: str | None = None) -> list[Event]:
    decoded = [EVENT.decode(m.data, encoding_of(m)) for m in rec.msgs]
    return [e for e in decoded if request_id is None or e.id == request_id]


def final_of(rec: Recorder, request_id: str) -> DoneEvent | ErrorEvent | None:
    return next((e for e in events(rec, request_id) if not isinstance(e, TokenEvent)), None)


def completions(rec: Recorder) -> list[Completion]:
    return [
        done
        for m in rec.msgs
        if m.subject == S.completion(ENDPOINT, WORKER)
        for done in COMPLETIONS.decode(m.data, encoding_of(m)).items
    ]


def heartbeats(rec: Recorder) -> list[Heartbeat]:
    return [
        HEARTBEAT.decode(m.data, encoding_of(m))
        for m in rec.msgs
        if m.subject == S.heartbeat(ENDPOINT, WORKER)
    ]


def completion_of(rec: Recorder, request_id: str) -> Completion | None:
    return next((c for c in completions(rec) if c.id == request_id), None)


# BatchItem fields that are the dispatcher's, not the submitted body's.
ITEM_FIELDS = {"tenant", "reply", "enqueued_at", "dispatched_at", "probe", "expedited"}


def item(
    request_id: str, *, max_tokens: int = 8, encoding: Encoding = Encoding.JSON, **fields: Any
) -> BatchItem:
    """A batch item; `fields` go to the item or, for the body's fields (prompt, messages,
    deadline, images, metadata, priority...), to its submitted request."""
    now = time.time()
    defaults: dict[str, Any] = {
        "tenant": TENANT,
        "prompt": "hello world",
        "enqueued_at": now - 0.5,
        "dispatched_at": now - 0.2,
        "reply": f"_INBOX.t.{request_id}",
    }
    values = defaults | fields
    own = {k: v for k, v in values.items() if k in ITEM_FIELDS}
    body = {k: v for k, v in values.items() if k not in ITEM_FIELDS}
    request = SubmitRequest(id=request_id, max_tokens=max_tokens, **body)
    return BatchItem(
        id=request_id,
        endpoint=ENDPOINT,
        request=request,
        max_tokens=max_tokens,
        encoding=encoding,
        **own,
    )


async def send_abort(
    nc: Client,
    *ids: str,
    tenant: str = TENANT,
    endpoint: str = ENDPOINT,
    encoding: Encoding = Encoding.JSON,
) -> None:
    message = Abort(endpoint=endpoint, tenant=tenant, ids=list(ids))
    await nc.publish(
        S.abort(ENDPOINT),
        encode(message, encoding),
        headers={HDR_CONTENT_TYPE: encoding.content_type},
    )


async def send_batch(
    nc: Client, items: list[BatchItem], encoding: Encoding = Encoding.JSON
) -> None:
    batch = Batch(worker_id=WORKER, endpoint=ENDPOINT, items=items, sent_at=time.time())
    await nc.publish(
        S.work(ENDPOINT, WORKER),
        encode(batch, encoding),
        headers={HDR_CONTENT_TYPE: encoding.content_type},
    )
    await nc.flush()


async def stored_event(results: KeyValue, request_id: str) -> DoneEvent | ErrorEvent:
    entry = await results.get(S.result_key(TENANT, request_id))
    stored = STORED_RESULT.decode(entry.value or b"")
    assert (stored.tenant, stored.endpoint) == (TENANT, ENDPOINT)
    return stored.event


def worker_service(
    nc: Client, engine: Engine, results: KeyValue | Any, **options: Any
) -> WorkerService:
    """The test worker on `engine`. `options`: `profile`, and the WorkerOptions fields
    (heartbeat_interval_s...)."""
    profile = options.pop("profile", PROFILE)
    settings = WorkerOptions(**({"heartbeat_interval_s": 10.0, "drain_timeout_s": 5.0} | options))
    return WorkerService(
        nc,
        engine,
        endpoint=ENDPOINT,
        worker_id=WORKER,
        subjects=S,
        results=results,
        profile=profile,
        settings=settings,
    )


@asynccontextmanager
async def running_worker(
    nc: Client, results: KeyValue | Any, *, faults: Faults | None = None, **options: Any
) -> AsyncIterator[tuple[WorkerService, SimEngine]]:
    """A worker on the simulated engine; `options` as `worker_service`'s."""
    async with (
        SimEngine(PARAMS, time_scale=SCALE, seed=1, faults=faults) as engine,
        worker_service(nc, engine, results, **options) as service,
    ):
        yield service, engine


def tokens_of(rec: Recorder, request_id: str) -> list[TokenEvent]:
    return [e for e in events(rec, request_id) if isinstance(e, TokenEvent)]


# -- requests ------------------------------------------------------------------------------


@pytest.mark.parametrize("batch_encoding", [Encoding.JSON, Encoding.MSGPACK])
async def test_batch_streams_ordered_tokens_then_a_done_event_per_item(
    nc: Client, results: KeyValue, inbox: Recorder, internal: Recorder, batch_encoding: Encoding
) -> None:
    chat = [ChatMessage(role="user", content="tell me a story")]
    items = [
        item("r-json", prompt="hello world", metadata={"job": "7"}),
        item("r-pack", prompt=None, messages=chat, input_tokens=50, encoding=Encoding.MSGPACK),
    ]
    async with running_worker(nc, results) as (_, engine):
        await send_batch(nc, items, batch_encoding)
        await internal.until(lambda _: len(completions(internal)) == 2)
    expected_input = {
        "r-json": engine.count_tokens(EngineRequest("r-json", 8, prompt="hello world")),
        "r-pack": 50,
    }
    for sent in items:
        received = [m for m in inbox.msgs if m.subject == sent.reply]
        assert {encoding_of(m) for m in received} == {sent.encoding}
        *tokens, done = events(inbox, sent.id)
        assert all(isinstance(t, TokenEvent) for t in tokens)
        assert [t.seq for t in tokens] == list(range(len(tokens)))  # type: ignore[union-attr]
        assert 1 <= len(tokens) <= sent.max_tokens
        assert isinstance(done, DoneEvent)
        assert done.seq == len(tokens)
        assert done.text == "".join(t.text for t in tokens)  # type: ignore[union-attr]
        assert done.usage.input_tokens == expected_input[sent.id]
        assert done.usage.output_tokens == len(tokens)
        assert done.usage.model_units == pytest.approx(
            PROFILE.model_units(expected_input[sent.id], len(tokens))
        )
        assert done.timings.queued_s == pytest.approx(sent.dispatched_at - sent.enqueued_at)
        assert done.timings.ttft_s is not None
        assert 0.5 <= done.timings.ttft_s <= done.timings.total_s < 0.5 + WAIT_S
        assert done.metadata == sent.request.metadata
        assert await stored_event(results, sent.id) == done
        completion = completion_of(internal, sent.id)
        assert completion is not None
        assert (completion.tenant, completion.endpoint, completion.worker_id) == (
            TENANT,
            ENDPOINT,
            WORKER,
        )
        assert completion.stored and completion.code is None and completion.usage == done.usage


async def test_done_event_has_exactly_the_contract_fields(
    nc: Client, results: KeyValue, inbox: Recorder
) -> None:
    async with running_worker(nc, results):
        await send_batch(nc, [item("r-1"), item("r-2", encoding=Encoding.MSGPACK)])
        await inbox.until(lambda _: final_of(inbox, "r-1") and final_of(inbox, "r-2"))
    decoders = {Encoding.JSON: json.loads, Encoding.MSGPACK: msgspec.msgpack.decode}
    for request_id in ("r-1", "r-2"):
        first, *_, msg = [m for m in inbox.msgs if m.subject == f"_INBOX.t.{request_id}"]
        raw = decoders[encoding_of(msg)](msg.data)
        assert set(raw) == {
            "type",
            "id",
            "seq",
            "text",
            "usage",
            "timings",
            "metadata",
            "finish_reason",
            "embedding",
        }
        assert raw["type"] == "done" and raw["id"] == request_id
        assert raw["finish_reason"] in ("stop", "length")
        assert raw["embedding"] is None
        # The simulated engine attributes engine time to every request it ran.
        assert set(raw["usage"]) == {"input_tokens", "output_tokens", "model_units", "engine_s"}
        assert set(raw["timings"]) == {"queued_s", "ttft_s", "total_s"}
        assert decoders[encoding_of(first)](first.data) == {
            "type": "token",
            "id": request_id,
            "seq": 0,
            "text": tokens_of(inbox, request_id)[0].text,
        }


class GatedResults:
    """A results bucket whose puts wait until the test opens the gate."""

    def __init__(self, results: KeyValue) -> None:
        self._results = results
        self.entered = asyncio.Event()
        self.gate = asyncio.Event()

    async def create(self, key: str, value: bytes) -> int:
        self.entered.set()
        await self.gate.wait()
        return await self._results.create(key, value)


async def test_final_event_is_stored_before_it_is_published_and_completed(
    nc: Client, results: KeyValue, inbox: Recorder, internal: Recorder
) -> None:
    """Nobody hears of a finished request before its result is in the bucket."""
    gated = GatedResults(results)
    async with running_worker(nc, results=gated):
        await send_batch(nc, [item("r-1")])
        try:
            async with asyncio.timeout(WAIT_S):
                await gated.entered.wait()
            # The worker shares `nc`: after this round trip, whatever it published before
            # storing has come back to the test's subscriptions.
            await nc.flush()
            await asyncio.sleep(0.05)
            assert tokens_of(inbox, "r-1")
            assert final_of(inbox, "r-1") is None and completions(internal) == []
        finally:
            gated.gate.set()  # the worker's drain waits for the store
        completion = await internal.until(lambda _: completion_of(internal, "r-1"))
        # Sent after the final event, on the same connection: both have arrived.
        assert final_of(inbox, "r-1") == await stored_event(results, "r-1")
    assert completion.stored


async def test_request_without_reply_subject_is_still_stored_and_completed(
    nc: Client, results: KeyValue, internal: Recorder
) -> None:
    async with running_worker(nc, results):
        await send_batch(nc, [item("r-quiet", reply=None)])
        completion = await internal.until(lambda _: completion_of(internal, "r-quiet"))
    assert completion.stored and completion.code is None
    assert isinstance(await stored_event(results, "r-quiet"), DoneEvent)


class PrioritySpy(SimEngine):
    """The simulated engine, recording the engine priority each request arrives with."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.priorities: dict[str, int] = {}

    def generate(self, request: EngineRequest) -> AsyncIterator[Any]:
        self.priorities[request.id] = request.priority
        return super().generate(request)


async def test_engine_priority_comes_from_expedited_never_from_the_body(
    nc: Client, results: KeyValue, internal: Recorder
) -> None:
    """The body's `priority` orders requests only inside their tenant's queue; the
    dispatcher's `expedited` alone decides the engine priority."""
    items = [
        item("r-plain", priority=9),
        item("r-fast", expedited=True, priority=-5),
        item("r-default"),
    ]
    async with (
        PrioritySpy(PARAMS, time_scale=SCALE, seed=1) as engine,
        worker_service(nc, engine, results),
    ):
        await send_batch(nc, items)
        await internal.until(lambda _: len(completions(internal)) == 3)
    assert EXPEDITED > 0  # engine priority: higher is served first
    assert engine.priorities == {
        S.result_key(TENANT, "r-plain"): 0,
        S.result_key(TENANT, "r-fast"): EXPEDITED,
        S.result_key(TENANT, "r-default"): 0,
    }
    assert all(c.code is None for c in completions(internal))


async def test_a_probe_runs_ahead_in_the_engine_and_answers_with_a_completion_only(
    nc: Client, results: KeyValue, inbox: Recorder, internal: Recorder
) -> None:
    engine_priorities: dict[str, int] = {}
    async with running_worker(nc, results, heartbeat_interval_s=0.05) as (_, engine):
        generate = engine.generate

        def spying(request: EngineRequest):  # type: ignore[no-untyped-def]
            engine_priorities[request.id] = request.priority
            return generate(request)

        engine.generate = spying  # type: ignore[method-assign]
        await send_batch(
            nc,
            [
                item("r-long", max_tokens=LONG),
                item("p-1", probe=True, max_tokens=1, deadline=time.time() + WAIT_S),
            ],
        )
        answer = await internal.until(lambda _: completion_of(internal, "p-1"))
        beat = await internal.until(
            lambda _: next((h for h in heartbeats(internal) if h.in_flight), None)
        )
        await send_abort(nc, "r-long")
    assert answer.probe and answer.code is None and not answer.stored
    assert answer.usage.output_tokens == 1
    assert engine_priorities["probe~p-1"] == PROBE > EXPEDITED
    assert events(inbox, "p-1") == []  # no events, nothing stored, never in flight
    with pytest.raises(KeyNotFoundError):
        await results.get(S.result_key(TENANT, "p-1"))
    assert beat.in_flight == [S.result_key(TENANT, "r-long")]


async def test_a_probe_the_engine_cannot_answer_by_its_deadline_gets_no_answer(
    nc: Client, results: KeyValue, internal: Recorder
) -> None:
    faults = Faults(hang=True)
    async with running_worker(nc, results, faults=faults) as (_, engine):
        await send_batch(nc, [item("p-hung", probe=True, max_tokens=1, deadline=time.time() + 0.3)])
        await asyncio.sleep(1.0)
        assert completion_of(internal, "p-hung") is None
        faults.hang = False
        await send_batch(
            nc, [item("p-ok", probe=True, max_tokens=1, deadline=time.time() + WAIT_S)]
        )
        answer = await internal.until(lambda _: completion_of(internal, "p-ok"))
    assert answer.probe and answer.code is None
    assert completion_of(internal, "p-hung") is None


async def test_first_heartbeat_is_sent_on_start(
    nc: Client, results: KeyValue, internal: Recorder
) -> None:
    async with running_worker(nc, results, heartbeat_interval_s=60.0) as (service, _):
        # Well before the first interval has passed.
        first = await internal.until(lambda _: heartbeats(internal), timeout=5.0)
    assert first[0].seq == 0 and first[0].healthy and first[0].in_flight == []
    assert first[0].capacity == CAPACITY
    assert first[0].started_at == service.started_at <= first[0].sent_at
    # Its routing size: the model units per second of its profile.
    assert first[0].capacity_mu_per_s == PROFILE.capacity_mu_per_s


async def test_heartbeats_report_capacity_load_and_in_flight_ids(
    nc: Client, results: KeyValue, internal: Recorder
) -> None:
    async with running_worker(nc, results, heartbeat_interval_s=0.05) as (service, _):
        await send_batch(nc, [item("r-long", max_tokens=LONG)])
        busy = await internal.until(
            lambda _: next((h for h in heartbeats(internal) if h.in_flight), None)
        )
        generating = await internal.until(
            lambda _: next(
                (h for h in heartbeats(internal) if h.output_tokens and h.output_tokens[0] > 0),
                None,
            )
        )
        await send_abort(nc, "r-long")
        await internal.until(lambda _: completion_of(internal, "r-long"))
        idle = await internal.until(
            lambda _: next(
                (h for h in heartbeats(internal) if h.seq > busy.seq and not h.in_flight), None
            )
        )
    input_tokens = 3  # "hello world" at 4 characters per token
    assert busy.capacity == CAPACITY and busy.healthy
    assert busy.in_flight == [S.result_key(TENANT, "r-long")]
    assert busy.used == Capacity(
        sequences=1, tokens=input_tokens + LONG, model_units=PROFILE.model_units(input_tokens, LONG)
    )
    assert idle.used == Capacity(sequences=0, tokens=0, model_units=0.0)
    # Each in-flight request's output so far, in the same order.
    assert generating.in_flight == busy.in_flight and generating.output_tokens[0] < LONG
    assert idle.output_tokens == []
    every = heartbeats(internal)
    assert [h.seq for h in every] == list(range(len(every)))
    assert {h.started_at for h in every} == {service.started_at}
    assert {(h.worker_id, h.endpoint) for h in every} == {(WORKER, ENDPOINT)}


async def test_abort_message_ends_a_running_request_as_cancelled(
    nc: Client, results: KeyValue, inbox: Recorder, internal: Recorder
) -> None:
    async with running_worker(nc, results) as (_, engine):
        await send_batch(nc, [item("r-abort", max_tokens=LONG), item("r-other")])
        await inbox.until(lambda _: len(tokens_of(inbox, "r-abort")) >= 3)
        await send_abort(nc, "r-abort", endpoint="other")
        await send_abort(nc, "r-abort", tenant="globex")  # same id, another tenant
        await nc.publish(S.abort(ENDPOINT), b"{not an abort")
        await nc.flush()
        # None of those stopped it: it keeps streaming.
        seen = len(tokens_of(inbox, "r-abort"))
        await inbox.until(lambda _: len(tokens_of(inbox, "r-abort")) >= seen + 10)
        assert final_of(inbox, "r-abort") is None
        await send_abort(nc, "r-abort", encoding=Encoding.MSGPACK)
        error = await inbox.until(lambda _: final_of(inbox, "r-abort"))
        completion = await internal.until(lambda _: completion_of(internal, "r-abort"))
        await internal.until(lambda _: completion_of(internal, "r-other"))
        assert engine.active_requests == 0
    assert isinstance(error, ErrorEvent) and error.code is ErrorCode.CANCELLED
    assert completion.code is ErrorCode.CANCELLED and completion.stored
    streamed = len(tokens_of(inbox, "r-abort"))
    assert 3 <= streamed < LONG
    assert completion.usage.output_tokens == streamed
    assert await stored_event(results, "r-abort") == error
    assert isinstance(final_of(inbox, "r-other"), DoneEvent)  # the abort touched only its id


async def test_deadline_passing_mid_run_ends_with_deadline_exceeded(
    nc: Client, results: KeyValue, inbox: Recorder, internal: Recorder
) -> None:
    async with running_worker(nc, results):
        await send_batch(nc, [item("r-late", max_tokens=LONG, deadline=time.time() + 0.3)])
        error = await inbox.until(lambda _: final_of(inbox, "r-late"))
        completion = await internal.until(lambda _: completion_of(internal, "r-late"))
    assert isinstance(error, ErrorEvent) and error.code is ErrorCode.DEADLINE_EXCEEDED
    assert tokens_of(inbox, "r-late")  # it was running when the deadline passed
    assert completion.code is ErrorCode.DEADLINE_EXCEEDED and completion.stored
    assert await stored_event(results, "r-late") == error


async def test_deadline_already_passed_never_reaches_the_engine(
    nc: Client, results: KeyValue, inbox: Recorder, internal: Recorder
) -> None:
    async with running_worker(nc, results):
        await send_batch(nc, [item("r-expired", deadline=time.time() - 1)])
        completion = await internal.until(lambda _: completion_of(internal, "r-expired"))
    error = final_of(inbox, "r-expired")
    assert isinstance(error, ErrorEvent) and error.code is ErrorCode.DEADLINE_EXCEEDED
    assert tokens_of(inbox, "r-expired") == []
    assert completion.usage == Usage(input_tokens=3, output_tokens=0, model_units=0.0)


async def test_engine_crash_ends_running_requests_with_internal(
    nc: Client, results: KeyValue, inbox: Recorder, internal: Recorder
) -> None:
    faults = Faults()
    async with running_worker(nc, results, faults=faults, heartbeat_interval_s=0.05):
        await send_batch(nc, [item("r-crash", max_tokens=LONG)])
        await inbox.until(lambda _: tokens_of(inbox, "r-crash"))
        faults.crash = True
        error = await inbox.until(lambda _: final_of(inbox, "r-crash"))
        completion = await internal.until(lambda _: completion_of(internal, "r-crash"))
        # The engine reports itself unhealthy once it crashed.
        await internal.until(
            lambda _: next(
                (h for h in heartbeats(internal) if not h.healthy and not h.in_flight), None
            )
        )
        faults.crash = False
    assert isinstance(error, ErrorEvent) and error.code is ErrorCode.INTERNAL
    assert "crash" in error.message
    assert completion.code is ErrorCode.INTERNAL and completion.stored


async def test_invalid_image_ends_with_invalid_request(
    nc: Client, results: KeyValue, inbox: Recorder
) -> None:
    async with running_worker(nc, results):
        await send_batch(nc, [item("r-img", images=["not base64!"])])
        error = await inbox.until(lambda _: final_of(inbox, "r-img"))
    assert isinstance(error, ErrorEvent) and error.code is ErrorCode.INVALID_REQUEST
    assert "image 0 is not valid base64" in error.message


async def test_malformed_batches_are_skipped_and_later_batches_still_run(
    nc: Client,
    results: KeyValue,
    inbox: Recorder,
    internal: Recorder,
    caplog: pytest.LogCaptureFixture,
) -> None:
    work = S.work(ENDPOINT, WORKER)
    wrong_worker = Batch(
        worker_id="w2", endpoint=ENDPOINT, items=[item("r-misrouted")], sent_at=time.time()
    )
    async with running_worker(nc, results):
        await nc.publish(work, b"not json at all")
        await nc.publish(work, b"\xc1", headers={HDR_CONTENT_TYPE: "application/msgpack"})
        await nc.publish(work, b'{"worker_id":"w1"}')
        await nc.publish(work, b"{}", headers={HDR_CONTENT_TYPE: "text/plain"})
        await nc.publish(work, encode(wrong_worker))
        await send_batch(nc, [item("r-after")])
        done = await inbox.until(lambda _: final_of(inbox, "r-after"))
    assert isinstance(done, DoneEvent)
    assert final_of(inbox, "r-misrouted") is None
    assert [c.id for c in completions(internal)] == ["r-after"]
    assert sum("skipping a malformed batch" in r.message for r in caplog.records) == 4


async def test_duplicate_item_for_a_running_id_is_not_run_twice(
    nc: Client, results: KeyValue, inbox: Recorder, internal: Recorder
) -> None:
    async with running_worker(nc, results) as (service, _):
        await send_batch(nc, [item("r-dup", max_tokens=LONG)])
        await inbox.until(lambda _: tokens_of(inbox, "r-dup"))
        await send_batch(nc, [item("r-dup", max_tokens=LONG), item("r-next")])
        await inbox.until(lambda _: final_of(inbox, "r-next"))
        assert service.in_flight == [S.result_key(TENANT, "r-dup")]
        await send_abort(nc, "r-dup")
        await internal.until(lambda _: completion_of(internal, "r-dup"))
    assert [c.id for c in completions(internal)].count("r-dup") == 1
    assert [t.seq for t in tokens_of(inbox, "r-dup")] == list(range(len(tokens_of(inbox, "r-dup"))))


async def test_same_id_from_two_tenants_runs_as_two_requests(
    nc: Client, results: KeyValue, inbox: Recorder, internal: Recorder
) -> None:
    async with running_worker(nc, results):
        await send_batch(
            nc,
            [
                item("r-same", max_tokens=LONG),
                item("r-same", tenant="globex", reply="_INBOX.t.globex"),
            ],
        )
        done = await inbox.until(
            lambda _: next(
                (
                    m
                    for m in inbox.msgs
                    if m.subject == "_INBOX.t.globex"
                    and isinstance(EVENT.decode(m.data), DoneEvent)
                ),
                None,
            )
        )
        await send_abort(nc, "r-same")
        await internal.until(lambda _: len(completions(internal)) == 2)
    by_tenant = {c.tenant: c.code for c in completions(internal)}
    assert by_tenant == {"globex": None, TENANT: ErrorCode.CANCELLED}
    acme_final = EVENT.decode([m for m in inbox.msgs if m.subject == "_INBOX.t.r-same"][-1].data)
    assert isinstance(acme_final, ErrorEvent)
    assert await stored_event(results, "r-same") == acme_final
    globex = STORED_RESULT.decode(
        (await results.get(S.result_key("globex", "r-same"))).value or b""
    )
    assert globex.event == EVENT.decode(done.data)


# -- storing -------------------------------------------------------------------------------


class FlakyResults:
    """A results bucket whose first `failures` puts time out."""

    def __init__(self, results: KeyValue, failures: int) -> None:
        self._results = results
        self.failures = failures
        self.attempts = 0

    async def create(self, key: str, value: bytes) -> int:
        self.attempts += 1
        if self.attempts <= self.failures:
            raise nats.errors.TimeoutError
        return await self._results.create(key, value)


async def test_store_failures_are_retried(
    nc: Client,
    results: KeyValue,
    inbox: Recorder,
    internal: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(results_module, "STORE_BACKOFF_S", 0.001)
    flaky = FlakyResults(results, failures=2)
    async with running_worker(nc, flaky):
        await send_batch(nc, [item("r-retry")])
        completion = await internal.until(lambda _: completion_of(internal, "r-retry"))
    assert flaky.attempts == 3
    assert completion.stored
    assert final_of(inbox, "r-retry") == await stored_event(results, "r-retry")


async def test_a_result_stored_by_another_run_stands_and_is_what_the_client_gets(
    nc: Client, results: KeyValue, inbox: Recorder, internal: Recorder
) -> None:
    """A request that ran again after its first worker was thought lost: whichever run
    stores first is its one result; the other run's reply carries that same result."""
    first = ErrorEvent(id="r-twice", code=ErrorCode.INTERNAL, message="the first run's")
    await results.create(
        S.result_key(TENANT, "r-twice"),
        encode(StoredResult(tenant=TENANT, endpoint=ENDPOINT, event=first, stored_at=time.time())),
    )
    async with running_worker(nc, results):
        await send_batch(nc, [item("r-twice")])
        completion = await internal.until(lambda _: completion_of(internal, "r-twice"))
    assert tokens_of(inbox, "r-twice")  # it ran here, to the end
    assert completion.code is None and completion.stored  # the request has its result
    assert final_of(inbox, "r-twice") == first == await stored_event(results, "r-twice")


async def test_unstorable_result_is_not_published_and_reported_unstored(
    nc: Client,
    results: KeyValue,
    inbox: Recorder,
    internal: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(results_module, "STORE_BACKOFF_S", 0.001)
    flaky = FlakyResults(results, failures=results_module.STORE_ATTEMPTS)
    async with running_worker(nc, flaky):
        await send_batch(nc, [item("r-lost")])
        completion = await internal.until(lambda _: completion_of(internal, "r-lost"))
    assert flaky.attempts == results_module.STORE_ATTEMPTS
    assert not completion.stored and completion.code is None
    # Published before the Completion, had it been sent: the redelivered run sends it.
    assert tokens_of(inbox, "r-lost") and final_of(inbox, "r-lost") is None
    with pytest.raises(KeyNotFoundError):
        await results.get(S.result_key(TENANT, "r-lost"))


# -- drain ---------------------------------------------------------------------------------


async def test_drain_finishes_in_flight_requests_then_reports_unhealthy(
    nc: Client, results: KeyValue, inbox: Recorder, internal: Recorder
) -> None:
    ids = ["r-a", "r-b"]
    async with running_worker(nc, results, drain_timeout_s=WAIT_S) as (service, engine):
        await send_batch(nc, [item(i, max_tokens=400) for i in ids])
        await inbox.until(lambda _: all(tokens_of(inbox, i) for i in ids))
        assert sorted(service.in_flight) == [S.result_key(TENANT, i) for i in ids]
    # The context has exited: everything below happened before it returned.
    await nc.flush()
    assert engine.active_requests == 0
    for request_id in ids:
        assert isinstance(final_of(inbox, request_id), DoneEvent)
        assert await stored_event(results, request_id) == final_of(inbox, request_id)
    hb_subject, done_subject = S.heartbeat(ENDPOINT, WORKER), S.completion(ENDPOINT, WORKER)
    order = [
        ("hb", HEARTBEAT.decode(m.data))
        if m.subject == hb_subject
        else ("done", COMPLETIONS.decode(m.data))
        for m in internal.msgs
        if m.subject in (hb_subject, done_subject)
    ]
    kinds = [kind for kind, _ in order]
    assert kinds[:2] == ["hb", "hb"] and kinds[-1] == "hb"
    completed = [done.id for kind, message in order if kind == "done" for done in message.items]  # type: ignore[union-attr]
    assert sorted(completed) == ids
    draining: Heartbeat = order[1][1]  # type: ignore[assignment]
    assert draining.healthy and draining.capacity == draining.used
    assert sorted(draining.in_flight) == [S.result_key(TENANT, i) for i in ids]
    final: Heartbeat = order[-1][1]  # type: ignore[assignment]
    assert not final.healthy and final.in_flight == []
    assert final.capacity == final.used == Capacity(sequences=0, tokens=0, model_units=0.0)


async def test_drain_timeout_abandons_unfinished_requests_without_a_final_event(
    nc: Client, results: KeyValue, inbox: Recorder, internal: Recorder
) -> None:
    async with running_worker(nc, results, drain_timeout_s=0.2) as (_, engine):
        await send_batch(nc, [item("r-stuck", max_tokens=LONG)])
        await inbox.until(lambda _: tokens_of(inbox, "r-stuck"))
    await nc.flush()
    assert engine.active_requests == 0
    assert final_of(inbox, "r-stuck") is None
    assert completions(internal) == []
    with pytest.raises(KeyNotFoundError):
        await results.get(S.result_key(TENANT, "r-stuck"))
    final = heartbeats(internal)[-1]
    assert not final.healthy and final.in_flight == []


async def test_service_rejects_bad_settings(nc: Client, results: KeyValue) -> None:
    engine = SimEngine(PARAMS)
    with pytest.raises(ValueError, match="worker id"):
        WorkerService(nc, engine, endpoint=ENDPOINT, worker_id="w 1", subjects=S, results=results)
    # The settings are validated where they are read: from the config or converted.
    with pytest.raises(msgspec.ValidationError, match="heartbeat_interval_s"):
        msgspec.convert({"heartbeat_interval_s": 0}, WorkerOptions)
    with pytest.raises(ConfigError, match="`workers.heartbeat_interval_s`"):
        parse_config('[endpoints.chat]\n[[tiers]]\nname = "a"\n[workers]\nheartbeat_interval_s = 0')


# -- python -m workers ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--endpoint", "chat two", "--worker-id", "w1"], "invalid endpoint"),
        (
            ["--endpoint", "chat", "--worker-id", "w1", "--model", "/m"],
            "--model is for --engine vllm",
        ),
        (["--endpoint", "chat", "--worker-id", "w1", "--time-scale", "-1"], "time_scale"),
        (["--endpoint", "chat", "--worker-id", "w1", "--engine", "vllm"], "needs --model"),
        (
            [
                "--endpoint",
                "chat",
                "--worker-id",
                "w1",
                "--engine",
                "vllm",
                "--model",
                "/m",
                "--time-scale",
                "0.1",
            ],
            "--time-scale is for --engine sim",
        ),
        (
            ["--endpoint", "chat", "--worker-id", "w1", "--engine-config", "/nonexistent.toml"],
            "cannot read",
        ),
        (
            [
                "--endpoint",
                "nope",
                "--worker-id",
                "w1",
                "--config",
                str(REPO / "configs/example.toml"),
            ],
            "no endpoint 'nope'",
        ),
        (["--endpoint", "chat", "--worker-id", "w1", "--drain-timeout", "-1"], "--drain-timeout"),
        (["--endpoint", "chat", "--worker-id", "w1", "--slow-fault", "0"], "--slow-fault must be"),
        (
            [
                "--endpoint",
                "chat",
                "--worker-id",
                "w1",
                "--engine",
                "vllm",
                "--model",
                "/m",
                "--slow-fault",
                "5",
            ],
            "--slow-fault is for --engine sim",
        ),
    ],
)
def test_main_rejects_bad_arguments(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        worker_main.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_main_takes_the_profile_and_prefix_from_the_fairq_config() -> None:
    args = worker_main.build_parser().parse_args(
        [
            "--endpoint",
            "chat",
            "--worker-id",
            "w1",
            "--config",
            str(REPO / "configs/example.toml"),
            "--engine-config",
            str(REPO / "configs/engine.toml"),
        ]
    )
    options = worker_main.parse_options(args)
    assert options.profile is not None and options.profile.name == "llama-7b-sim"
    assert options.subjects == Subjects("fq")
    assert isinstance(options.engine, SimEngine) and options.engine.params == EngineParams()


def test_main_reports_a_missing_results_bucket(
    nats_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = worker_main.main(["--nats", nats_url, "--endpoint", "chat", "--worker-id", "w1"])
    assert code == 1
    assert "results bucket FQ_RESULTS not found" in capsys.readouterr().err


def test_main_reports_an_engine_that_cannot_start(
    nats_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    async def provision_broker() -> None:
        client = await nats.connect(nats_url, connect_timeout=5, max_reconnect_attempts=0)
        await provision(client.jetstream(timeout=5), BrokerSettings(storage="memory"))
        await client.close()

    asyncio.run(provision_broker())
    code = worker_main.main(
        [
            "--nats",
            nats_url,
            "--endpoint",
            "chat",
            "--worker-id",
            "w1",
            "--engine",
            "vllm",
            "--model",
            "/nonexistent-model-dir",
        ]
    )
    assert code == 1
    assert "the engine failed to start" in capsys.readouterr().err


def test_main_reports_an_unreachable_server(capsys: pytest.CaptureFixture[str]) -> None:
    code = worker_main.main(
        [
            "--nats",
            "nats://127.0.0.1:1",
            "--connect-wait",
            "0.5",
            "--endpoint",
            "chat",
            "--worker-id",
            "w1",
        ]
    )
    assert code == 1
    assert "cannot connect to NATS at nats://127.0.0.1:1" in capsys.readouterr().err


@asynccontextmanager
async def worker_process(nats_url: str) -> AsyncIterator[asyncio.subprocess.Process]:
    """`python -m workers` on the sim engine, serving /healthz on a free port; killed on
    leaving if it still runs."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "workers",
        "--nats",
        nats_url,
        "--endpoint",
        ENDPOINT,
        "--worker-id",
        WORKER,
        "--time-scale",
        str(SCALE),
        "--heartbeat-interval",
        "0.1",
        "--config",
        str(REPO / "configs/example.toml"),
        "--health-port",
        "0",
        cwd=REPO,
        env=os.environ | {"PYTHONPATH": str(REPO)},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        yield process
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def health_url(process: asyncio.subprocess.Process) -> str:
    assert process.stdout is not None
    line = (await asyncio.wait_for(process.stdout.readline(), 30)).decode().strip()
    assert line.startswith("HEALTH_URL=http://127.0.0.1:"), line
    return line.removeprefix("HEALTH_URL=")


async def http_status(url: str) -> int:
    def get() -> int:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return response.status
        except urllib.error.HTTPError as exc:
            return exc.code

    return await asyncio.to_thread(get)


async def test_an_evicted_worker_process_abandons_its_work_fails_liveness_and_exits(
    nats_url: str, nc: Client, results: KeyValue, inbox: Recorder, internal: Recorder
) -> None:
    async with worker_process(nats_url) as process:
        health = await health_url(process)
        beat = await internal.until(lambda _: next(iter(heartbeats(internal)), None), timeout=30)
        await send_batch(nc, [item("r-evicted", max_tokens=LONG)])
        await inbox.until(lambda _: tokens_of(inbox, "r-evicted"))
        # Another run's eviction changes nothing.
        stale = Evict(endpoint=ENDPOINT, worker_id=WORKER, started_at=beat.started_at - 1)
        await nc.publish(S.evict(ENDPOINT, WORKER), encode(stale))
        await asyncio.sleep(0.3)
        assert process.returncode is None and await http_status(f"{health}/healthz") == 200
        evict = Evict(endpoint=ENDPOINT, worker_id=WORKER, started_at=beat.started_at)
        await nc.publish(S.evict(ENDPOINT, WORKER), encode(evict))
        async with asyncio.timeout(WAIT_S):
            assert await process.wait() == 1
        assert process.stderr is not None
        assert b"evicted by the dispatcher" in await process.stderr.read()
    # Abandoned: no final event, nothing stored, no completion; a heartbeat said so.
    assert final_of(inbox, "r-evicted") is None
    with pytest.raises(KeyNotFoundError):
        await results.get(S.result_key(TENANT, "r-evicted"))
    assert completion_of(internal, "r-evicted") is None
    assert any(not h.healthy for h in heartbeats(internal))


async def test_sigusr1_hangs_a_simulated_worker_process_and_sigusr2_slows_it(
    nats_url: str, nc: Client, results: KeyValue, inbox: Recorder, internal: Recorder
) -> None:
    """The chaos suite's faults: a hang stops output while heartbeats go on; lifting it
    lets the request finish; the slow fault makes steps ten times longer."""
    # Ids whose drawn output lengths (engine seed 0) are 59 and 55 tokens of at most 60.
    fast, slow = "r-fast-13", "r-slow-8"
    async with worker_process(nats_url) as process:
        await health_url(process)
        await internal.until(lambda _: heartbeats(internal), timeout=30)
        await send_batch(nc, [item(fast, max_tokens=60)])
        await inbox.until(lambda _: final_of(inbox, fast))
        process.send_signal(signal.SIGUSR1)
        await asyncio.sleep(0.3)  # the signal has been handled
        await send_batch(nc, [item("r-hung", max_tokens=20)])
        beats = len(heartbeats(internal))
        await internal.until(lambda _: len(heartbeats(internal)) >= beats + 5)
        assert tokens_of(inbox, "r-hung") == [] and heartbeats(internal)[-1].healthy
        process.send_signal(signal.SIGUSR1)
        await inbox.until(lambda _: final_of(inbox, "r-hung"))
        process.send_signal(signal.SIGUSR2)
        await asyncio.sleep(0.3)
        await send_batch(nc, [item(slow, max_tokens=60)])
        await inbox.until(lambda _: final_of(inbox, slow), timeout=30)
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(WAIT_S):
            assert await process.wait() == 0
        assert process.stderr is not None
        log = (await process.stderr.read()).decode()
    assert "fault injection: hang on" in log and "fault injection: hang off" in log
    assert "fault injection: steps x10" in log

    def per_token(request_id: str) -> float:
        done = final_of(inbox, request_id)
        assert done.usage.output_tokens > 50
        return (done.timings.total_s - done.timings.ttft_s) / (done.usage.output_tokens - 1)

    assert per_token(slow) > 3 * per_token(fast), (per_token(fast), per_token(slow))


async def test_worker_process_serves_and_drains_on_sigterm(
    nats_url: str, nc: Client, results: KeyValue, inbox: Recorder, internal: Recorder
) -> None:
    async with worker_process(nats_url) as process:
        health = await health_url(process)
        await internal.until(lambda _: heartbeats(internal), timeout=30)
        await send_batch(nc, [item("r-proc")])
        done = await inbox.until(lambda _: final_of(inbox, "r-proc"))
        assert await http_status(f"{health}/healthz") == 200
        assert await http_status(f"{health}/readyz") == 200
        assert await http_status(f"{health}/metrics") == 404  # a worker exports none
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(WAIT_S):
            assert await process.wait() == 0
    assert isinstance(done, DoneEvent) and done.usage.model_units > 0  # the chat profile
    await nc.flush()
    final = heartbeats(internal)[-1]
    assert not final.healthy and final.in_flight == []
