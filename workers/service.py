"""The worker service: the NATS edge of one inference worker.

Batches come in on `Subjects.work(endpoint, worker_id)`, every item runs as one task in the
service's task group, its output streams to the item's reply subject as `token` events, and
its final event (`done` or `error`) is stored in the results bucket before anything else
learns that the request finished. Heartbeats advertise capacity and load; aborts for the
endpoint stop matching requests.

Per request, in this order (`workers.execution.Execution` runs it, `workers.outbox.Outbox`
sends what it produces):

1. token events to `item.reply` (seq from 0), in the request's encoding;
2. the final event stored under `Subjects.result_key(tenant, id)` (bounded retries),
   create-only: a request has one result (`workers.results`). If another run stored one
   first, that one stands and is what the reply subject gets;
3. the final event to `item.reply`, only once stored: if storing fails for good the
   dispatcher redelivers the request, and the client must not see two final events;
4. a `Completion` to `Subjects.completion(endpoint, worker_id)`, `stored` telling the
   dispatcher whether it may ack the request.

Internal messages (heartbeats, completions) are sent as JSON with a `Content-Type` header;
batches and aborts are read in whichever encoding their `Content-Type` names.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Self, TypeVar

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from broker_config.config import WorkerOptions
from broker_config.lease_key import EpochWatch
from broker_config.subjects import HDR_CONTENT_TYPE, SubjectError, Subjects, check_token
from broker_config.wire import (
    Encoding,
    ErrorCode,
    WireError,
    header,
)
from broker_config.wire_internal import (
    ABORT,
    BATCH,
    EVICT,
    BatchItem,
    Completion,
    Heartbeat,
)
from costmodel.units import NO_CAPACITY, Capacity, ModelProfile
from workers.engine import Engine, EngineError
from workers.execution import Execution
from workers.images import ImagePool
from workers.outbox import Outbox
from workers.probe import advertised, answer_probe
from workers.results import FinalResults, ResultStore
from workers.running import (
    Ending,
    Running,
)

log = logging.getLogger(__name__)

# Upper bound for the round trip that pushes the last messages out on shutdown.
FLUSH_TIMEOUT_S = 5.0

T = TypeVar("T")


class WorkerService:
    """Runs one worker's requests on an engine, between NATS and the engine.

    An async context manager; the engine must already be running (entered). Entering
    subscribes to the worker's work subject and the endpoint's abort subject and sends a
    heartbeat at once, then one every `heartbeat_interval_s`.

    Leaving drains, in this order:

    1. stop intake: the work subscription is drained (batches already delivered still
       start), and a heartbeat advertises no free capacity (capacity equal to what is
       in use, `healthy` unchanged) so the dispatcher sends nothing new and does not
       re-dispatch the work still running here;
    2. let in-flight requests finish, up to `drain_timeout_s`; aborts and deadlines still
       apply meanwhile;
    3. abandon the rest: cancel them and abort them in the engine WITHOUT storing or
       publishing a final event and without a Completion, so the dispatcher never acks
       them: it runs those that streamed nothing yet elsewhere and ends the others with
       a retryable `internal` error (a client has seen their text). Requests already
       storing their final event are not abandoned: they finish (bounded by the store
       retries);
    4. unsubscribe from aborts, stop heartbeats, send a final heartbeat with
       `healthy=False`, no capacity, nothing in flight, and flush the connection;
    5. stop the image pool's processes (nothing uses them any more).

    The dispatcher treats every request it sent to this worker that has no Completion
    when that final heartbeat arrives (or when heartbeats stop) as lost, and takes it back.
    """

    def __init__(
        self,
        nc: Client,
        engine: Engine,
        *,
        endpoint: str,
        worker_id: str,
        subjects: Subjects,
        results: ResultStore,
        profile: ModelProfile | None = None,
        settings: WorkerOptions = WorkerOptions(),
        embed: bool = False,
        fence: EpochWatch | None = None,
    ) -> None:
        """`fence`: the dispatchers' lease epoch; what carries an older one is refused."""
        check_token(endpoint, "endpoint")
        check_token(worker_id, "worker id")
        self.endpoint = endpoint
        self.worker_id = worker_id
        self.subjects = subjects
        # Constant for this service instance: a new value tells the dispatcher of a restart.
        self.started_at = time.time()
        self._nc = nc
        self._engine = engine
        self._profile = profile
        self._fence = fence
        self.fenced = 0  # messages refused for an older lease epoch
        self._heartbeat_interval_s = settings.heartbeat_interval_s
        self._drain_timeout_s = settings.drain_timeout_s
        # Started at the first image: a worker that sees only text runs no extra process.
        self.image_pool = ImagePool(settings.images)
        self._running: dict[str, Running] = {}
        self._heartbeat_seq = 0
        self._beat_at = time.time()  # when the last heartbeat went out
        self._outbox = Outbox(nc, subjects.completion(endpoint, worker_id))
        self._execution = Execution(
            engine,
            worker_id=worker_id,
            embed=embed,
            images=self.image_pool,
            profile=profile,
            results=FinalResults(nc, subjects, results),
            outbox=self._outbox,
            report=self._report,
            expire=self._expire,
        )
        self._draining = False
        self._tg: asyncio.TaskGroup | None = None
        self._work_sub: Subscription | None = None
        self._abort_sub: Subscription | None = None
        self._evict_sub: Subscription | None = None
        # Set when the dispatcher evicts this run (failed health probes): the process
        # should exit so that its supervisor starts a fresh one.
        self.evicted = asyncio.Event()
        self._heartbeat_task: asyncio.Task[None] | None = None

    def live(self) -> bool:
        """Heartbeats go out and the dispatcher has not evicted this run (for /healthz:
        a failure has the process restarted)."""
        return (
            not self.evicted.is_set()
            and time.time() - self._beat_at < 3 * self._heartbeat_interval_s + 5.0
        )

    def ready(self) -> bool:
        """Takes work: not draining, not evicted, its engine healthy (for /readyz)."""
        return not (self._draining or self.evicted.is_set()) and self._engine.healthy

    @property
    def in_flight(self) -> list[str]:
        """Result keys (`Subjects.result_key`) of the requests here, until their Completion."""
        return list(self._running)

    # -- lifecycle ----------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        if self._tg is not None:
            raise RuntimeError("this WorkerService is already running")
        tg = asyncio.TaskGroup()
        await tg.__aenter__()
        self._tg = tg
        try:
            self._work_sub = await self._nc.subscribe(
                self.subjects.work(self.endpoint, self.worker_id), cb=self._on_batch
            )
            self._abort_sub = await self._nc.subscribe(
                self.subjects.abort(self.endpoint), cb=self._on_abort
            )
            self._evict_sub = await self._nc.subscribe(
                self.subjects.evict(self.endpoint, self.worker_id), cb=self._on_evict
            )
            # Subscribed on the server before the heartbeat announces this worker.
            await self._nc.flush()
        except BaseException:
            await self._unsubscribe()
            self._tg = None
            await tg.__aexit__(None, None, None)
            raise
        await self._heartbeat()
        self._heartbeat_task = tg.create_task(self._heartbeat_loop(), name="worker-heartbeats")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        tg = self._tg
        if tg is None:
            return
        try:
            await self._drain()
        finally:
            self._tg = None
            await self.image_pool.__aexit__(None, None, None)
            # Every task has ended by now; this only surfaces a task that failed.
            await tg.__aexit__(None, None, None)

    async def _drain(self) -> None:
        self._draining = True
        if self._work_sub is not None:
            await self._nats_step("stop taking batches", self._work_sub.drain())
            self._work_sub = None
        await self._heartbeat()
        pending = [r.task for r in self._running.values() if r.task is not None]
        if pending:
            await asyncio.wait(pending, timeout=self._drain_timeout_s)
        await self._abandon_unfinished()
        # Before the final heartbeat: requests it no longer lists must have completed.
        await self._outbox.send_completions()
        await self._unsubscribe()
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            await asyncio.wait([self._heartbeat_task])
        await self._heartbeat(final=True)
        await self._nats_step("flush", self._nc.flush(timeout=FLUSH_TIMEOUT_S))

    async def _abandon_unfinished(self, why: str = "drain timeout") -> None:
        tasks = [r.task for r in self._running.values() if r.task is not None]
        abandoned = [r for r in self._running.values() if not r.finalizing]
        for running in abandoned:
            log.warning(
                "%s: abandoning request %s (no final event; the dispatcher runs or ends it)",
                why,
                running.key,
            )
            if running.task is not None:
                running.task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        for running in abandoned:
            await self._abort_in_engine(running.key)

    async def _unsubscribe(self) -> None:
        for sub in (self._work_sub, self._abort_sub, self._evict_sub):
            if sub is not None:
                await self._nats_step("unsubscribe", sub.unsubscribe())
        self._work_sub = self._abort_sub = self._evict_sub = None

    async def _nats_step(self, what: str, step: Awaitable[object]) -> None:
        """Await one NATS call of the shutdown path; a failure is logged, not fatal."""
        try:
            await step
        except nats.errors.Error as exc:
            log.warning("shutdown: %s failed: %r", what, exc)

    # -- intake -------------------------------------------------------------------------

    async def _on_batch(self, msg: Msg) -> None:
        batch = _decode_or_log(msg, "batch", BATCH.decode)
        if batch is None or not self._admits(batch.epoch, "a batch"):
            return
        if self.evicted.is_set():
            log.warning("evicted: skipping a batch of %d requests", len(batch.items))
            return
        if batch.endpoint != self.endpoint or batch.worker_id != self.worker_id:
            log.error(
                "skipping a batch for %s/%s sent to %s/%s",
                batch.endpoint,
                batch.worker_id,
                self.endpoint,
                self.worker_id,
            )
            return
        for item in batch.items:
            self._start(item)

    def _admits(self, epoch: int, what: str) -> bool:
        """A dispatcher that lost its lease (paused past it) is fenced off."""
        if self._fence is None or self._fence.admits(epoch):
            return True
        self.fenced += 1
        log.warning(
            "refusing %s from a dispatcher whose lease ended (epoch %d; the lease is at %d)",
            what,
            epoch,
            self._fence.epoch,
        )
        return False

    def _start(self, item: BatchItem) -> None:
        if item.probe:  # no result, no events, not in flight: only the engine's answer
            assert self._tg is not None
            self._tg.create_task(self._probe(item), name=f"probe-{item.id}")
            return
        if item.endpoint != self.endpoint:
            log.error(
                "skipping request %s: it is for endpoint %r, this worker serves %r",
                item.id,
                item.endpoint,
                self.endpoint,
            )
            return
        try:
            key = self.subjects.result_key(item.tenant, item.id)
        except SubjectError as exc:
            log.error("skipping a request whose result cannot be stored: %s", exc)
            return
        if key in self._running:
            log.warning(
                "skipping request %s of %s: it is already running here", item.id, item.tenant
            )
            return
        assert self._tg is not None
        input_tokens = item.request.input_tokens or 0  # counted when the request starts
        running = Running(
            key,
            item,
            input_tokens,
            self._execution.model_units(item, input_tokens, item.max_tokens),
        )
        self._running[key] = running
        running.task = self._tg.create_task(self._serve(running), name=f"request-{key}")

    async def _on_evict(self, msg: Msg) -> None:
        evict = _decode_or_log(msg, "eviction", EVICT.decode)
        if (
            evict is None
            or not self._admits(evict.epoch, "an eviction")
            or (self.evicted.is_set())
            or (evict.endpoint, evict.worker_id, evict.started_at)
            != (self.endpoint, self.worker_id, self.started_at)
        ):
            return
        log.error(
            "evicted by the dispatcher (failed health probes): abandoning %d requests and stopping",
            len(self._running),
        )
        self.evicted.set()
        await self._abandon_unfinished("evicted")

    async def _probe(self, item: BatchItem) -> None:
        completion = await answer_probe(self._engine, item, self.worker_id)
        if completion is not None:
            self._report(completion)

    async def _on_abort(self, msg: Msg) -> None:
        abort = _decode_or_log(msg, "abort", ABORT.decode)
        if (
            abort is None
            or not self._admits(abort.epoch, "an abort")
            or abort.endpoint != self.endpoint
        ):
            return
        message = (
            "cancelled"
            if abort.code is ErrorCode.CANCELLED
            else f"aborted by the dispatcher ({abort.code})"
        )
        for request_id in abort.ids:
            running = self._find(abort.tenant, request_id)
            if running is not None and self._stop(running, Ending(abort.code, message)):
                await self._abort_in_engine(running.key)

    def _find(self, tenant: str, request_id: str) -> Running | None:
        try:
            return self._running.get(self.subjects.result_key(tenant, request_id))
        except SubjectError:
            return None  # a malformed name cannot belong to a running request

    def _stop(self, running: Running, ending: Ending) -> bool:
        """Mark a request to end with `ending`; False if it is already ending."""
        if running.stop is not None or running.finalizing:
            return False
        running.stop = ending
        return True

    def _expire(self, running: Running) -> None:
        ending = Ending(ErrorCode.DEADLINE_EXCEEDED, "the deadline passed while running")
        if self._stop(running, ending) and self._tg is not None:
            self._tg.create_task(self._abort_in_engine(running.key))

    async def _abort_in_engine(self, key: str) -> None:
        try:
            await self._engine.abort(key)
        except EngineError as exc:
            log.warning("engine abort of %s failed: %s", key, exc)

    # -- one request --------------------------------------------------------------------

    async def _serve(self, running: Running) -> None:
        try:
            await self._execution.run(running)
        finally:
            del self._running[running.key]

    def _report(self, completion: Completion) -> None:
        tg = self._tg
        spawn = (
            (lambda send: tg.create_task(send, name="worker-completions"))
            if tg is not None
            else None
        )
        self._outbox.report(completion, spawn)

    # -- heartbeats ---------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_interval_s)
            await self._heartbeat()

    async def _heartbeat(self, *, final: bool = False) -> None:
        self._beat_at = time.time()
        await self._outbox.internal(
            self.subjects.heartbeat(self.endpoint, self.worker_id),
            self._heartbeat_message(final=final),
        )

    def _heartbeat_message(self, *, final: bool) -> Heartbeat:
        running = [] if final else list(self._running.values())
        used = Capacity(
            sequences=len(running),
            tokens=sum(r.input_tokens + r.item.max_tokens for r in running),
            model_units=sum(r.footprint_mu for r in running),
        )
        healthy = not final and self._engine.healthy and not self.evicted.is_set()
        if final:
            capacity = NO_CAPACITY
        elif self._draining:
            capacity = used  # no room: the dispatcher sends nothing new
        else:
            capacity, healthy = self._engine_capacity(healthy)
        seq, self._heartbeat_seq = self._heartbeat_seq, self._heartbeat_seq + 1
        return Heartbeat(
            worker_id=self.worker_id,
            endpoint=self.endpoint,
            capacity=capacity,
            used=used,
            in_flight=[r.key for r in running],
            healthy=healthy,
            started_at=self.started_at,
            sent_at=time.time(),
            seq=seq,
            output_tokens=[r.output_tokens for r in running],
            capacity_mu_per_s=(
                self._profile.capacity_mu_per_s if self._profile is not None else 0.0
            ),
        )

    def _engine_capacity(self, healthy: bool) -> tuple[Capacity, bool]:
        try:
            limits = self._engine.capacity
        except EngineError as exc:
            log.error("the engine reports no capacity: %s", exc)
            return NO_CAPACITY, False
        return advertised(limits), healthy


# -- helpers -------------------------------------------------------------------------------


def _decode_or_log(msg: Msg, what: str, decode: Callable[[bytes, Encoding], T]) -> T | None:
    """The message, or None after logging why it cannot be read."""
    try:
        return decode(msg.data, Encoding.from_content_type(header(msg.headers, HDR_CONTENT_TYPE)))
    except (msgspec.DecodeError, WireError) as exc:
        log.warning("skipping a malformed %s on %s: %s", what, msg.subject, exc)
        return None
