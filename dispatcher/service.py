"""The dispatcher: the scheduling core on the wire.

    async with Dispatcher(nc, config, limiter=..., options=...):
        await until_sigterm()               # leaving the block drains (see below)

Intake (`dispatcher.intake.TenantIntake`): one durable pull consumer per tenant, all
long-polled at once through one inbox, with a window of waiting requests per tenant; a
tenant's deep backlog stays in the stream and never delays another tenant's requests.

Each message is parsed (`broker_config.wire.parse_submission`), de-duplicated by
(tenant, id) against what is held and the results bucket, admitted (core check ->
limiter store -> enqueue) or rejected (error event stored, sent to Fq-Reply, message
terminated). One dispatch task fills every worker's free capacity from
`Scheduler.next_batch`, least model-unit load first. Workers report completions; the
JetStream message is acked only after a completion says the final event is stored.

Drain order on exit (SIGTERM): stop intake (nak what it had not handed over); stop
dispatching; wait up to
`grace_s` for running requests to complete; nak everything still held so another
dispatcher gets it at once; unsubscribe and flush.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from broker_config import wire
from broker_config.direct_get import DirectBatchGet, DirectGetError
from broker_config.kv_writer import KeyValueWriter
from broker_config.streams import BrokerSettings, ConsumerLimits, provision, stream_delivery
from broker_config.subjects import HDR_CONTENT_TYPE, ApiKind, Subjects
from costmodel.units import approx_tokens
from dispatcher.core.config import Config
from dispatcher.core.scheduler import DepthRow, Scheduler
from dispatcher.core.types import Capacity, Decision, Outcome, Request, Usage
from dispatcher.intake import TenantIntake
from dispatcher.metrics import DispatcherMetrics
from dispatcher.redis_limits import AsyncLimiterStore, LimiterUnavailable, MemoryLimiterAsync

log = logging.getLogger("fairq.dispatcher")
Key = tuple[str, str]  # (tenant, request id)
# How often the queue-depth gauges are refreshed.
DEPTH_EXPORT_S = 1.0
# An unlisted tenant idle this long stops being pulled (its consumer is then removed by
# the server as long again later); much sooner when unlisted tenants are refused anyway.
UNLISTED_IDLE_S = 600.0
REFUSED_TENANT_IDLE_S = 10.0
# A request sent to a worker this recently may not be in its heartbeat yet.
HEARTBEAT_LAG_S = 1.0


class DispatcherOptions(msgspec.Struct, frozen=True, kw_only=True):
    # Arrived requests handed to admission at once (one results lookup round trip).
    intake_batch: int = 256
    # Per tenant: waiting requests held in the dispatcher (the rest stay in the stream).
    tenant_window: int = 64
    # Per tenant: requests held at all, waiting or running (the consumer's max_ack_pending).
    max_ack_pending: int = 1_000
    # How often the stream is listed for tenants the config does not name.
    discover_s: float = 0.25
    # JetStream redelivers what is not acked within this; held messages are marked in
    # progress every third of it.
    ack_wait_s: float = 60.0
    # A worker silent this long is out of rotation and its requests are requeued.
    worker_timeout_s: float = 5.0
    # After a (re)start, wait this long for heartbeats before dispatching, so requests
    # still running on workers are recognised instead of run twice.
    settle_s: float = 1.5
    grace_s: float = 30.0
    tick_s: float = 0.25
    tenant_inboxes: bool = False

    def __post_init__(self) -> None:
        if not 2 <= self.tenant_window <= self.max_ack_pending:
            raise ValueError(f"tenant_window ({self.tenant_window}) must be at least 2 and at "
                             f"most max_ack_pending ({self.max_ack_pending})")


@dataclass(slots=True)
class Held:
    """A request the dispatcher holds a JetStream message for."""

    msg: Msg
    submission: wire.Submission
    received_at: float
    worker: str | None = None


@dataclass(slots=True)
class WorkerState:
    worker_id: str
    endpoint: str
    started_at: float
    capacity: Capacity
    last_seen: float
    healthy: bool = True
    # What the dispatcher sent and has not seen complete: key -> (request, sent_at).
    assigned: dict[Key, tuple[Request, float]] = field(default_factory=dict)
    # Keys missing from consecutive heartbeats (a lost batch message).
    missing: dict[Key, int] = field(default_factory=dict)
    reported: set[str] = field(default_factory=set)
    # Totals over `assigned`, kept as it changes: read on every dispatch pass.
    assigned_tokens: int = 0
    assigned_units: float = 0.0

    def assign(self, request: Request, now: float) -> None:
        self.assigned[(request.tenant, request.id)] = (request, now)
        self.assigned_tokens += request.input_tokens + request.max_tokens
        self.assigned_units += request.model_units

    def release(self, key: Key) -> None:
        entry = self.assigned.pop(key, None)
        self.missing.pop(key, None)
        if entry is None:
            return
        request = entry[0]
        self.assigned_tokens -= request.input_tokens + request.max_tokens
        # Float sums drift: back to exactly zero when nothing is assigned.
        self.assigned_units = self.assigned_units - request.model_units if self.assigned else 0.0

    def used(self) -> Capacity:
        return Capacity(len(self.assigned), self.assigned_tokens, self.assigned_units)

    def free(self) -> Capacity:
        return self.capacity.minus(self.used())


class Dispatcher:
    def __init__(self, nc: NATS, config: Config, *, limiter: AsyncLimiterStore | None = None,
                 options: DispatcherOptions | None = None,
                 settings: BrokerSettings | None = None,
                 metrics: DispatcherMetrics | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.config = config
        self.options = options or DispatcherOptions()
        self.settings = settings or BrokerSettings(prefix=config.subject_prefix)
        self.subjects = self.settings.subjects
        self.limiter = limiter or MemoryLimiterAsync()
        self.metrics = metrics or DispatcherMetrics(list(config.endpoints))
        self.clock = clock
        self.scheduler = Scheduler(config)
        self.workers: dict[str, WorkerState] = {}
        self._held: dict[Key, Held] = {}
        # Requests a worker already runs (seen in its heartbeat) when their message is
        # redelivered after a dispatcher restart: acked on completion, never re-run.
        self._adopted: dict[Key, Held] = {}
        # (endpoint, tenant) -> [admitted, rejected] since start, for the depth API. Only
        # tenants the registry knows, so a flood of made-up names cannot grow it.
        self._admissions: dict[tuple[str, str], list[int]] = {}
        self._wake = asyncio.Event()
        self._worker_reports = asyncio.Lock()
        self._stop = asyncio.Event()
        self._started_at = 0.0
        self._stack = contextlib.AsyncExitStack()
        self.intake: TenantIntake | None = None
        self._dispatching = True
        self.kv: KeyValue | None = None
        self._results_reader: DirectBatchGet | None = None
        self._results_writer: KeyValueWriter | None = None

    # -- lifecycle -------------------------------------------------------------------

    async def __aenter__(self) -> Dispatcher:
        provisioned = await provision(self.js, self.settings)
        self.kv = provisioned.results
        self._started_at = self.clock()
        stack = self._stack
        try:
            for endpoint in self.config.endpoints:
                await self._subscribe(self.subjects.heartbeats(endpoint), self._on_heartbeat)
                await self._subscribe(self.subjects.completions(endpoint), self._on_completions)
            await self._subscribe(self.subjects.api_filter(ApiKind.STATUS), self._on_status)
            await self._subscribe(self.subjects.api_filter(ApiKind.CANCEL), self._on_cancel)
            await self._subscribe(self.subjects.depth, self._on_depth)
            self._results_reader = await stack.enter_async_context(
                DirectBatchGet(self.nc, f"KV_{self.subjects.results_bucket}"))
            self._results_writer = await stack.enter_async_context(
                KeyValueWriter(self.nc, self.subjects.results_bucket))
            # Each tenant's consumer covers all endpoints: requests for an endpoint this
            # config does not know are still answered (unknown_endpoint), not stranded.
            self.intake = TenantIntake(
                self.nc, self.subjects, handler=self._intake_batch,
                queued=self.scheduler.tenant_queued, listed=self.config.tenants,
                limits=ConsumerLimits(ack_wait_s=self.options.ack_wait_s,
                                      max_ack_pending=self.options.max_ack_pending),
                window=self.options.tenant_window, batch=self.options.intake_batch,
                discover_s=self.options.discover_s,
                # Tenants that will only ever be refused need their consumer only while
                # their requests are answered: made-up names must not pile up consumers.
                idle_s=(UNLISTED_IDLE_S if self.config.unlisted_tenants.policy == "admit"
                        else REFUSED_TENANT_IDLE_S))
            await self.intake.__aenter__()
            stack.push_async_callback(self.intake.close)
            # Unwound first: the drain runs while the subscriptions above still work.
            group = await stack.enter_async_context(asyncio.TaskGroup())
            stack.push_async_callback(self._stop_background)
            group.create_task(self._dispatch_loop(), name="dispatch")
            group.create_task(self._maintenance_loop(), name="maintenance")
        except BaseException:
            await stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._stack.aclose()

    async def _subscribe(self, subject: str, handler: Callable[[Msg], Any]) -> None:
        async def guarded(msg: Msg) -> None:
            # Every loop that reads from the network survives a malformed message.
            try:
                await handler(msg)
            except Exception:
                log.exception("handling a message on %s failed", msg.subject)

        subscription = await self.nc.subscribe(subject, cb=guarded)
        self._stack.push_async_callback(subscription.unsubscribe)

    async def _stop_background(self) -> None:
        """The drain: runs before the task group is awaited."""
        await self.intake.close()
        self._dispatching = False
        deadline = self.clock() + self.options.grace_s
        while any(h.worker for h in self._held.values()) and self.clock() < deadline:
            await asyncio.sleep(self.options.tick_s)
        self._stop.set()
        self._wake.set()
        for held in list(self._held.values()) + list(self._adopted.values()):
            with contextlib.suppress(nats.errors.Error):
                await held.msg.nak()
        self._held.clear()
        self._adopted.clear()
        await self.nc.flush()

    # -- intake ----------------------------------------------------------------------------

    async def _intake_batch(self, messages: list[Msg]) -> None:
        """Parse an arrived batch, look up stored results for all of it at once (one
        round trip per batch instead of one per message), then admit in arrival order."""
        parsed: list[tuple[Msg, wire.Submission]] = []
        for msg in messages:
            try:
                parsed.append((msg, wire.parse_submission(
                    msg.subject, msg.data, msg.headers, self.subjects,
                    tenant_inboxes=self.options.tenant_inboxes)))
            except wire.WireError as error:
                await self._guarded(self._refuse_unparsed(msg, error), msg)
        subjects = [self._result_subject(sub.tenant, sub.id) for _, sub in parsed]
        try:
            stored = await self._results_reader.last(subjects)
        except DirectGetError as exc:
            log.error("results lookup failed (%s); %d requests handed back", exc, len(parsed))
            for msg, _ in parsed:
                with contextlib.suppress(nats.errors.Error):
                    await msg.nak(delay=1.0)  # soon again, not after the whole ack wait
            return
        for (msg, submission), subject in zip(parsed, subjects):
            await self._guarded(self._intake(msg, submission, stored.get(subject)), msg)
        self._wake.set()

    @staticmethod
    async def _guarded(step: Any, msg: Msg) -> None:
        try:
            await step
        except Exception:
            log.exception("intake of %s failed; it will be redelivered", msg.subject)

    async def _intake(self, msg: Msg, submission: wire.Submission,
                      stored_value: bytes | None) -> None:
        now = self.clock()
        key = (submission.tenant, submission.id)
        held = self._held.get(key) or self._adopted.get(key)
        if held is not None:
            if held.msg.metadata.sequence.stream == msg.metadata.sequence.stream:
                held.msg = msg  # our own message, redelivered: keep its newest ack token
            else:
                await msg.term()  # the same id published again: the first one answers
            return
        if stored_value is not None:  # finished before a restart or a redelivery
            stored = wire.STORED_RESULT.decode(stored_value)
            await self._publish_event(submission.reply, submission.encoding, stored.event)
            await msg.ack()
            return
        stored_at, deliveries = stream_delivery(msg.reply)
        # Its queue wait and its place in line count from its publish, not from intake.
        held = Held(msg, submission, now - max(0.0, time.time() - stored_at))
        result_key = self.subjects.result_key(*key)
        for worker in self.workers.values():
            if result_key in worker.reported:
                held.worker = worker.worker_id
                self._adopted[key] = held
                return
        # The wait in the stream counts against the latency target on the first delivery
        # only: a redelivery (after a restart) was admitted once and has waited for us.
        await self._admit(held, now, now - held.received_at if deliveries == 1 else 0.0)

    async def _admit(self, held: Held, now: float, waited_s: float = 0.0) -> None:
        sub, body = held.submission, held.submission.request
        text = body.prompt if body.prompt is not None else "".join(
            m.content for m in body.messages or [])
        request = Request(
            sub.id, sub.tenant, sub.endpoint, held.received_at,
            body.input_tokens if body.input_tokens is not None else approx_tokens(text),
            body.max_tokens or self._max_tokens_cap(sub.endpoint),
            priority=body.priority, deadline=body.deadline, session=body.session,
            other_units=float(len(body.images or ())), payload=held)
        result = self.scheduler.check(
            request, now, self._waiting_in_stream(sub.endpoint, sub.tenant), waited_s)
        if isinstance(result, list):
            try:
                result = await self.limiter.apply(result, now)
            except LimiterUnavailable as exc:
                log.error("rate limiter unavailable: %s", exc)
                await self._finish(held, wire.ErrorEvent(
                    sub.id, wire.ErrorCode.INTERNAL, "rate limiter unavailable", 1.0))
                self.metrics.child(self.metrics.admissions, sub.endpoint, "internal").inc()
                return
        endpoint_label = sub.endpoint if sub.endpoint in self.config.endpoints else "unknown"
        self.metrics.child(self.metrics.admissions, endpoint_label, result.outcome.value).inc()
        if result.outcome not in (Outcome.UNKNOWN_ENDPOINT, Outcome.UNKNOWN_TENANT):
            counts = self._admissions.setdefault((sub.endpoint, sub.tenant), [0, 0])
            counts[0 if result.admitted else 1] += 1
        if not result.admitted:
            await self._reject(held, result)
            return
        self.scheduler.enqueue(request, now)
        self._held[(sub.tenant, sub.id)] = held

    def _waiting_in_stream(self, endpoint: str, tenant: str) -> int:
        """The tenant's requests to `endpoint` the stream holds beyond the one being
        admitted and those already queued or running here (as of the last listing)."""
        unfinished = self.intake.backlog.get((endpoint, tenant), 0)
        flow = self.scheduler.flow(endpoint, tenant) if endpoint in self.config.endpoints \
            else None
        here = len(flow.queue) + flow.running if flow is not None else 0
        return max(0, unfinished - here - 1)

    def _max_tokens_cap(self, endpoint: str) -> int:
        spec = self.config.endpoints.get(endpoint)
        return spec.max_tokens_cap if spec else 1

    async def _refuse_unparsed(self, msg: Msg, error: wire.WireError) -> None:
        """A message that is not a valid request: answer where we safely can, then drop."""
        log.info("invalid request on %s: %s", msg.subject, error)
        event = error.to_event()
        tenant = _tenant_of(self.subjects, msg.subject)
        if error.request_id and tenant:  # the id is spent: its result is this error
            await self._store(tenant, "", event)
        await self._publish_event(error.reply, error.encoding, event)
        await msg.term()

    async def _reject(self, held: Held, decision: Decision) -> None:
        await self._finish(held, wire.ErrorEvent(
            held.submission.id, wire.ErrorCode(decision.outcome.error_code), decision.message,
            decision.retry_after_s))

    async def _finish(self, held: Held, event: wire.ErrorEvent) -> None:
        """End a request here, without a worker: store, tell the client, drop the message."""
        sub = held.submission
        await self._store(sub.tenant, sub.endpoint, event)
        await self._publish_event(sub.reply, sub.encoding, event)
        await held.msg.term()

    # -- dispatch -------------------------------------------------------------------------

    async def _dispatch_loop(self) -> None:
        while not self._stop.is_set():
            await self._wake.wait()
            self._wake.clear()
            if self._dispatching and self.clock() >= self._started_at + self.options.settle_s:
                await self._dispatch_once()

    async def _dispatch_once(self) -> None:
        now = self.clock()
        by_load = sorted((w for w in self.workers.values() if w.healthy),
                         key=lambda w: w.used().model_units / max(w.capacity.model_units, 1e-9))
        for worker in by_load:
            free = worker.free()
            if free.sequences <= 0:
                continue
            batch = self.scheduler.next_batch(worker.endpoint, free, now, worker.capacity)
            for request in batch.expired:
                self._held.pop((request.tenant, request.id), None)
                await self._reject(request.payload, Decision(
                    Outcome.DEADLINE_EXCEEDED, "the deadline passed while queued"))
            if batch.requests:
                await self._send(worker, batch.requests, now)
                self.metrics.child(self.metrics.batch_fill, worker.endpoint).observe(
                    len(batch.requests) / free.sequences)

    async def _send(self, worker: WorkerState, requests: list[Request], now: float) -> None:
        items = []
        for request in requests:
            held: Held = request.payload
            held.worker = worker.worker_id
            worker.assign(request, now)
            body = held.submission.request
            items.append(wire.BatchItem(
                id=request.id, tenant=request.tenant, endpoint=request.endpoint,
                max_tokens=request.max_tokens, prompt=body.prompt, messages=body.messages,
                priority=body.priority, deadline=body.deadline, session=body.session,
                input_tokens=body.input_tokens, images=body.images or [],
                metadata=body.metadata or {}, reply=held.submission.reply,
                encoding=held.submission.encoding, enqueued_at=held.received_at,
                dispatched_at=now))
            self.metrics.child(self.metrics.queue_wait, request.endpoint).observe(
                now - held.received_at)
        batch = wire.Batch(worker_id=worker.worker_id, endpoint=worker.endpoint, items=items,
                           sent_at=now)
        await self.nc.publish(self.subjects.work(worker.endpoint, worker.worker_id),
                              wire.encode(batch, wire.Encoding.MSGPACK),
                              headers={HDR_CONTENT_TYPE: wire.Encoding.MSGPACK.content_type})
        for tenant in {request.tenant for request in requests}:
            await self.intake.top_up(tenant)  # their windows have room again

    # -- worker reports ------------------------------------------------------------------

    async def _on_heartbeat(self, msg: Msg) -> None:
        beat = wire.HEARTBEAT.decode(msg.data, _encoding(msg))
        now = self.clock()
        capacity = Capacity(beat.capacity.sequences, beat.capacity.tokens,
                            beat.capacity.model_units)
        worker = self.workers.get(beat.worker_id)
        if worker is None or worker.started_at != beat.started_at:
            if worker is not None:
                log.warning("worker %s restarted; requeueing its requests", beat.worker_id)
                await self._requeue_all(worker)
            worker = WorkerState(beat.worker_id, beat.endpoint, beat.started_at, capacity, now)
            self.workers[beat.worker_id] = worker
        worker.capacity, worker.last_seen, worker.healthy = capacity, now, beat.healthy
        worker.reported = set(beat.in_flight)
        if not beat.healthy and not beat.in_flight and not capacity.sequences:
            # A worker's last heartbeat: its drain is over and it runs nothing; whatever
            # it was sent and did not complete is abandoned.
            async with self._worker_reports:
                await self._requeue_all(worker)
        self._find_lost(worker, now)
        self.metrics.worker_utilisation.labels(worker.endpoint, worker.worker_id).set(
            worker.used().model_units / max(capacity.model_units, 1e-9))
        self._update_capacity(worker.endpoint)
        self._wake.set()

    def _find_lost(self, worker: WorkerState, now: float) -> None:
        """Requests sent to a worker that two heartbeats in a row do not list were lost
        on the way (core NATS is at most once): put them back in their queues."""
        for key, (_, sent_at) in list(worker.assigned.items()):
            if self.subjects.result_key(*key) in worker.reported or now - sent_at < HEARTBEAT_LAG_S:
                worker.missing.pop(key, None)
                continue
            worker.missing[key] = worker.missing.get(key, 0) + 1
            if worker.missing[key] >= 2:
                log.warning("request %s never reached worker %s; requeued", key, worker.worker_id)
                self._requeue(worker, key)

    def _requeue(self, worker: WorkerState, key: Key) -> None:
        worker.release(key)
        request = self.scheduler.requeue(*key)
        if request is not None:
            request.payload.worker = None

    async def _requeue_all(self, worker: WorkerState) -> None:
        """The worker lost its work (restart, silence): run it again elsewhere."""
        for key in list(worker.assigned):
            self._requeue(worker, key)
        for key, held in list(self._adopted.items()):
            if held.worker == worker.worker_id:
                del self._adopted[key]
                held.worker = None
                await self._admit(held, self.clock())

    def _update_capacity(self, endpoint: str) -> None:
        healthy = sum(1 for w in self.workers.values() if w.endpoint == endpoint and w.healthy)
        profile = self.scheduler.endpoints[endpoint].profile
        self.scheduler.set_capacity(endpoint, healthy * profile.capacity_mu_per_s)

    async def _on_completions(self, msg: Msg) -> None:
        # Held across the whole message: a worker's last heartbeat, which follows its last
        # completions, must not requeue requests whose completion is being handled.
        async with self._worker_reports:
            for done in wire.COMPLETIONS.decode(msg.data, _encoding(msg)).items:
                await self._complete(done)
        self._wake.set()

    async def _complete(self, done: wire.Completion) -> None:
        key = (done.tenant, done.id)
        worker = self.workers.get(done.worker_id)
        if worker is not None:
            worker.release(key)
        now = self.clock()
        completed = self.scheduler.complete(
            done.tenant, done.id, Usage(done.usage.input_tokens, done.usage.output_tokens),
            now)
        held = self._held.pop(key, None) if completed else self._adopted.pop(key, None)
        if held is not None:
            if done.stored:
                await held.msg.ack()
            else:
                await held.msg.nak()  # the final event is not stored: run it again
        if completed is not None:
            if completed.refund is not None:
                try:
                    await self.limiter.refund(completed.refund)
                except LimiterUnavailable as exc:
                    log.warning("quota refund lost: %s", exc)
            self._observe_completion(completed.request, done)

    def _observe_completion(self, request: Request, done: wire.Completion) -> None:
        if done.code is not None or done.first_token_at is None:
            return
        held: Held = request.payload
        self.metrics.child(self.metrics.ttft, request.endpoint).observe(
            max(0.0, done.first_token_at - held.received_at))
        decoding = done.finished_at - done.first_token_at
        if decoding > 0:
            self.metrics.child(self.metrics.output_tps, request.endpoint).observe(
                done.usage.output_tokens / decoding)

    # -- request/reply APIs ------------------------------------------------------------------

    async def _on_status(self, msg: Msg) -> None:
        tenant = _tenant_of_api(self.subjects, msg.subject)
        query = await self._api_request(msg, wire.STATUS_REQUEST)
        if query is None or tenant is None:
            return
        state = self.scheduler.state(tenant, query.id)
        if state is not None:
            reply = wire.StatusReply(query.id, state[0], position=state[1])
        elif (tenant, query.id) in self._adopted:
            reply = wire.StatusReply(query.id, "running")
        else:
            stored = await self._stored_result(tenant, query.id)
            if stored is None:
                reply = wire.StatusReply(query.id, "unknown")
            else:
                finished = "done" if isinstance(stored.event, wire.DoneEvent) else "failed"
                reply = wire.StatusReply(query.id, finished, result=stored.event)
        await msg.respond(wire.encode(reply))

    async def _on_cancel(self, msg: Msg) -> None:
        tenant = _tenant_of_api(self.subjects, msg.subject)
        query = await self._api_request(msg, wire.CANCEL_REQUEST)
        if query is None or tenant is None:
            return
        cancelled = False
        request = self.scheduler.cancel(tenant, query.id)
        if request is not None:
            held = self._held.pop((tenant, query.id))
            await self._reject(held, Decision(Outcome.CANCELLED, "cancelled by the client"))
            cancelled = True
        else:
            running = self.scheduler.running_request(tenant, query.id)
            adopted = self._adopted.get((tenant, query.id))
            if running is not None or adopted is not None:
                endpoint = running.endpoint if running else adopted.submission.endpoint
                await self.nc.publish(self.subjects.abort(endpoint), wire.encode(
                    wire.Abort(endpoint=endpoint, tenant=tenant, ids=[query.id])))
                cancelled = True
        await msg.respond(wire.encode(wire.CancelReply(query.id, cancelled)))

    async def _on_depth(self, msg: Msg) -> None:
        if await self._api_request(msg, wire.DEPTH_REQUEST) is None:
            return
        rows = {(r.endpoint, r.tenant): r for r in self._depth_rows(self.clock())}
        entries = []
        for key in rows.keys() | self._admissions.keys():
            row = rows.get(key)
            admitted, rejected = self._admissions.get(key, (0, 0))
            tier = row.tier if row else self.scheduler.registry.tenant(key[1]).tier
            entries.append(wire.DepthEntry(
                key[0], tier, key[1], row.queued if row else 0, row.running if row else 0,
                row.oldest_wait_s if row else 0.0, admitted, rejected))
        await msg.respond(wire.encode(wire.DepthReply(sorted(
            entries, key=lambda e: (e.endpoint, e.tier, e.tenant)))))

    def _depth_rows(self, now: float) -> list[DepthRow]:
        """The scheduler's queues, with what is still in the stream counted as queued.

        The stream holds every unfinished request (waiting in the stream, queued here or
        running), so queued = max(queued here, stream count - running).
        """
        backlog = dict(self.intake.backlog) if self.intake is not None else {}  # starting
        rows = []
        for row in self.scheduler.depth(now):
            in_stream = backlog.pop((row.endpoint, row.tenant), 0)
            rows.append(replace(
                row, queued=max(row.queued, in_stream - row.running)))
        for (endpoint, tenant), count in backlog.items():
            policy = self.scheduler.registry.tenant(tenant)
            if endpoint in self.config.endpoints and policy is not None:
                rows.append(DepthRow(endpoint, policy.tier, tenant, count, 0, 0.0))
        return rows

    async def _api_request(self, msg: Msg, codec: wire.Codec) -> Any:
        try:
            return codec.decode_or_invalid(msg.data or b"{}")
        except wire.WireError as error:
            if msg.reply:
                await msg.respond(wire.encode(error.to_event()))
            return None

    # -- maintenance --------------------------------------------------------------------------

    async def _maintenance_loop(self) -> None:
        last_extension = last_export = self.clock()
        while not self._stop.is_set():
            await asyncio.sleep(self.options.tick_s)
            now = self.clock()
            for request in self.scheduler.expire(now):
                held = self._held.pop((request.tenant, request.id))
                await self._reject(held, Decision(Outcome.DEADLINE_EXCEEDED,
                                                  "the deadline passed while queued"))
            for worker in list(self.workers.values()):
                silent = now - worker.last_seen > self.options.worker_timeout_s
                # Also a worker that said it is unhealthy and then went quiet (its drain
                # ended) may still hold requests sent just before its last heartbeat.
                if silent and (worker.healthy or worker.assigned):
                    log.warning("worker %s silent for %.1fs; out of rotation",
                                worker.worker_id, now - worker.last_seen)
                    worker.healthy = False
                    await self._requeue_all(worker)
                    self._update_capacity(worker.endpoint)
            if now - last_extension > self.options.ack_wait_s / 3:
                last_extension = now
                for held in list(self._held.values()) + list(self._adopted.values()):
                    with contextlib.suppress(nats.errors.Error):
                        await held.msg.in_progress()
            if now - last_export >= DEPTH_EXPORT_S:  # a scan of every queue: not every tick
                last_export = now
                self._export_depth(now)
            self._wake.set()

    def _export_depth(self, now: float) -> None:
        self.metrics.queue_depth.clear()
        self.metrics.running.clear()
        for row in self._depth_rows(now):
            self.metrics.queue_depth.labels(row.endpoint, row.tier, row.tenant).set(row.queued)
            self.metrics.running.labels(row.endpoint, row.tier, row.tenant).set(row.running)

    # -- results ---------------------------------------------------------------------------

    def _result_subject(self, tenant: str, request_id: str) -> str:
        return f"$KV.{self.subjects.results_bucket}.{self.subjects.result_key(tenant, request_id)}"

    async def _stored_result(self, tenant: str, request_id: str) -> wire.StoredResult | None:
        try:
            entry = await self.kv.get(self.subjects.result_key(tenant, request_id))
        except KeyNotFoundError:
            return None
        return wire.STORED_RESULT.decode(entry.value)

    async def _store(self, tenant: str, endpoint: str, event: wire.ErrorEvent) -> None:
        value = wire.StoredResult(tenant=tenant, endpoint=endpoint, event=event,
                                  stored_at=self.clock())
        await self._results_writer.put(self.subjects.result_key(tenant, event.id),
                                       wire.encode(value))

    async def _publish_event(self, reply: str | None, encoding: wire.Encoding,
                             event: Any) -> None:
        if reply:
            await self.nc.publish(reply, wire.encode(event, encoding),
                                  headers={HDR_CONTENT_TYPE: encoding.content_type})


def _encoding(msg: Msg) -> wire.Encoding:
    return wire.Encoding.from_content_type((msg.headers or {}).get(HDR_CONTENT_TYPE))


def _tenant_of(subjects: Subjects, subject: str) -> str | None:
    try:
        return subjects.parse_request(subject)[1]
    except ValueError:
        return None


def _tenant_of_api(subjects: Subjects, subject: str) -> str | None:
    try:
        return subjects.parse_api(subject)[1]
    except ValueError:
        return None
