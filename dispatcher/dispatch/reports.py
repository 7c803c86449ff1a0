"""Worker reports in: heartbeats and completions, and what follows from their absence.

- A heartbeat updates the worker in the pool; whatever the pool decides the worker no
  longer has (it restarted, drained away, or a batch never reached it) is *taken back*.
- A completion releases the request from its worker, settles it in the scheduler (the
  tenant's DRR charge and token limits settled at the real usage) and acks its
  JetStream message, or naks it when the worker could not store the final event.
- `take_back_loop` (a task of the dispatcher's): workers silent for the pool's timeout
  leave rotation; what a heartbeat or an eviction said a worker lost, and what the silent
  ones had, is taken back there, never in a message handler (a results lookup may wait
  on the broker, and a handler that waits holds up every heartbeat behind it).
- `evicted`: a worker that failed its health probes (`dispatcher.fleet.probes`) leaves
  rotation too, and its work is taken back.

Taking work back is the same whichever way a worker was lost: a request that streamed
no token yet (as far as the worker's heartbeats said) runs again elsewhere, keeping its
place by arrival (an adopted one is admitted again), unless its stored result shows it
finished with its completion lost; one that streamed ends here with `internal` and a
retry hint, since a stream cannot take back text a client has seen.

Only a dispatcher that answers for its work (a valid lease, or one it released for a
planned stop) takes work back: one that wakes from a pause finds every worker "silent"
for as long as it slept, and the requests it would end are the new holder's, still
streaming. What a worker lost waits in `_lost` meanwhile: taken back once the lease is
valid again, or handed back with everything else held if the lease is lost (the drain).
The lease is checked again after the lookup, the one long wait of a take-back, and
nothing is taken out of `held` before that.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from nats.aio.msg import Msg

from broker_config import wire, wire_internal
from broker_config.direct_get import DirectGetError
from broker_config.subjects import HDR_CONTENT_TYPE, SubjectError
from costmodel.units import Usage
from dispatcher.admission.admit import Admission
from dispatcher.core.limits import Settlement, request_tokens, settlement
from dispatcher.core.pool import Key, Lost, Worker
from dispatcher.core.types import Request
from dispatcher.dispatch.endings import Endings
from dispatcher.dispatch.held import Held
from dispatcher.fleet.probes import Probes
from dispatcher.parts import Parts

log = logging.getLogger("fairq.dispatcher")


class WorkerReports:
    def __init__(
        self,
        parts: Parts,
        admission: Admission,
        endings: Endings,
        probes: Probes,
        holds_lease: Callable[[], bool] = lambda: True,
    ) -> None:
        self.parts = parts
        self.subjects, self.scheduler, self.pool = parts.subjects, parts.scheduler, parts.pool
        self.held, self.results, self.metrics = parts.held, parts.results, parts.metrics
        self.wake = parts.wake
        self.admission = admission  # takes a lost worker's adopted requests in again
        self.endings = endings
        self.probes = probes
        self.holds_lease = holds_lease
        # (worker id, what it lost), for `take_back` (with a valid lease).
        self._lost: list[tuple[str, Lost]] = []
        self._lost_added = asyncio.Event()
        self._stopping = False
        # Worker id -> when its last heartbeat came (unix seconds); may outlive this
        # dispatcher, for the next one in the process to settle on (dispatcher/service.py).
        self.heard: dict[str, float] = {}
        # Held across a whole completions message: a worker's last heartbeat, which
        # follows its last completions, must not take back requests being completed.
        self._lock = asyncio.Lock()
        for endpoint in self.scheduler.endpoints:  # none serves until its heartbeats come
            self._update_serving(endpoint, healthy=0)

    async def on_heartbeat(self, msg: Msg) -> None:
        beat = wire_internal.HEARTBEAT.decode(msg.data, _encoding(msg))
        counts = beat.output_tokens
        if len(counts) != len(beat.in_flight):
            if counts:
                log.warning(
                    "worker %s reports output for %d of %d requests; ignored",
                    beat.worker_id,
                    len(counts),
                    len(beat.in_flight),
                )
            counts = [0] * len(beat.in_flight)
        in_flight = set()
        generated = []
        for key, count in zip(beat.in_flight, counts):
            try:
                parsed = self.subjects.parse_result_key(key)
            except SubjectError:
                log.warning("worker %s lists a malformed request key %r", beat.worker_id, key)
                continue
            in_flight.add(parsed)
            generated.append((parsed, count))
        self.heard[beat.worker_id] = time.time()
        known = self.pool.get(beat.worker_id)
        if known is not None and known.started_at != beat.started_at:
            self.metrics.child(self.metrics.replacements, beat.endpoint).inc()
        async with self._lock:
            lost = self.pool.heartbeat(
                beat.worker_id,
                beat.endpoint,
                beat.started_at,
                beat.capacity,
                in_flight,
                beat.healthy,
                time.time(),
                sum(count for _, count in generated),
                beat.capacity_mu_per_s,
            )
            if lost:
                log.warning(
                    "worker %s no longer has %d requests; taking them back",
                    beat.worker_id,
                    len(lost.requests) + len(lost.adopted),
                )
                self._lose(beat.worker_id, lost)
            # Its output so far, priced at the batch it runs: its in-flight requests.
            self.scheduler.observe_occupancy(
                beat.endpoint, len(in_flight), beat.capacity, beat.capacity.minus(beat.used)
            )
            self.scheduler.progress(generated, occupancy=len(in_flight))
            # The scheduler does not track adopted requests' output: marked here. Only
            # after a dispatcher restart are there any, so most heartbeats skip the loop.
            for key, count in generated if self.held.adopted else ():
                if count and (held := self.held.adopted.get(key)) is not None:
                    held.streamed = True
        worker = self.pool.get(beat.worker_id)
        self.metrics.worker_utilisation.labels(worker.endpoint, worker.worker_id).set(worker.load)
        self._update_capacity(worker.endpoint)
        self.wake.set()

    def evicted(self, worker: Worker, lost: Lost) -> None:
        self._lose(worker.worker_id, lost)
        self._update_capacity(worker.endpoint)
        self.wake.set()

    def _lose(self, worker_id: str, lost: Lost) -> None:
        self._lost.append((worker_id, lost))
        self._lost_added.set()

    async def take_back_loop(self, tick_s: float) -> None:
        """Take back lost work as it is reported, and silent workers' every `tick_s`,
        until `stop_taking_back`: a take-back is never cut halfway by the drain."""
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._lost_added.wait(), tick_s)
            self._lost_added.clear()
            if self._stopping:
                return
            try:
                await self.take_back(time.time())
            except Exception:  # a bug in one take-back must not stop the next
                log.exception("taking work back failed")

    def stop_taking_back(self) -> None:
        """`take_back_loop` returns after the take-back under way (the drain awaits it)."""
        self._stopping = True
        self._lost_added.set()

    async def take_back(self, now: float) -> None:
        """Silent workers out of rotation; what they and the lost reports had, taken back
        with a valid lease (see the module doc), stored results looked up in one call."""
        if not self.holds_lease():
            return
        for worker, lost in self.pool.silent(now):
            log.warning(
                "worker %s silent for %.1fs; out of rotation",
                worker.worker_id,
                now - worker.last_seen,
            )
            self._lose(worker.worker_id, lost)
            self._update_capacity(worker.endpoint)
        taking, self._lost = self._lost, []
        if not taking:
            return
        quiet = {key: worker_id for worker_id, lost in taking for key in self._quiet(lost)}
        stored = await self._lookup(list(quiet))
        if not self.holds_lease():  # lapsed during the lookup: wait for it again
            self._lost = taking + self._lost
            return
        streamed = [held for _, lost in taking for held in await self._streamed(lost, now)]
        try:
            for key, worker_id in quiet.items():
                try:
                    await self._run_again(key, worker_id, stored, now)
                except Exception:
                    log.exception("taking back request %s of %s failed", key[1], key[0])
        finally:
            await self._fail_all(streamed)
        self.wake.set()

    def _quiet(self, lost: Lost) -> list[Key]:
        """Of what a worker lost, the requests that streamed nothing (to run again)."""
        keys = [
            (request.tenant, request.id) for request in lost.requests if request.output_charged <= 0
        ]
        return keys + [
            key
            for key in lost.adopted
            if (held := self.held.adopted.get(key)) is not None and not held.streamed
        ]

    async def _streamed(self, lost: Lost, now: float) -> list[Held]:
        """Of what a worker lost, the requests that streamed, settled at what they
        generated and out of `held`: their messages, to end."""
        ended = []
        for request in lost.requests:
            if request.output_charged > 0:
                if (held := await self._settle_streamed(request, now)) is not None:
                    ended.append(held)
        for key in lost.adopted:
            held = self.held.adopted.get(key)
            if held is not None and held.streamed:
                ended.append(self.held.adopted.pop(key))
        return ended

    async def _lookup(self, keys: list[Key]) -> dict[Key, wire_internal.StoredResult] | None:
        """The stored results among `keys`; None if the lookup failed."""
        if not keys:
            return {}
        try:
            return await self.results.lookup(keys)
        except DirectGetError as exc:
            log.error("results lookup failed (%s); %d requests handed back", exc, len(keys))
            return None

    async def _run_again(
        self,
        key: Key,
        worker_id: str,
        stored: dict[Key, wire_internal.StoredResult] | None,
        now: float,
    ) -> None:
        """A request that streamed nothing (as far as the heartbeats said) runs again,
        keeping its place by arrival; but it may have finished between two heartbeats
        with its completion lost (a broker node died under its worker's connection): its
        stored result answers it instead. If the lookup failed it goes back through
        admission, which looks again."""
        held = self.held.get(key)
        if held is None:  # completed (or ended) meanwhile
            return
        endpoint = held.submission.endpoint
        if stored is not None and (found := stored.get(key)) is not None:
            await self._answer_stored(worker_id, held, found)
            return
        self.metrics.child(self.metrics.redispatched, endpoint).inc()
        if stored is None:  # out of the core and of `held`: admitted again on redelivery
            if self.held.admitted.pop(key, None) is not None:
                self.scheduler.requeue(*key)
                self.scheduler.cancel(*key)
            else:
                self.held.adopted.pop(key)
            await self.endings.hand_back(held, now)
        elif (request := self.scheduler.requeue(*key)) is not None:
            request.payload.worker = None
        elif self.held.adopted.pop(key, None) is not None:  # adopted: not in the core
            held.worker = None
            await self.admission.admit(held, now, charged_before=True)

    async def _answer_stored(
        self, worker_id: str, held: Held, found: wire_internal.StoredResult
    ) -> None:
        """Complete a request from its stored result, as its lost completion would have,
        and send the client its final event (the worker's may have been lost too)."""
        event = found.event
        done = wire_internal.Completion(
            id=held.submission.id,
            tenant=held.submission.tenant,
            endpoint=held.submission.endpoint,
            worker_id=worker_id,
            usage=event.usage if isinstance(event, wire.DoneEvent) else Usage(0, 0, 0.0),
            code=None if isinstance(event, wire.DoneEvent) else event.code,
            stored=True,
            finished_at=found.stored_at,
        )
        log.info(
            "request %s of %s finished on %s, its completion lost; answered from its stored result",
            done.id,
            done.tenant,
            worker_id,
        )
        async with self._lock:  # as completions are
            settled = await self._complete(done)
        await self.endings.settle(settled, time.time())
        await self.results.publish(held.submission.reply, held.submission.encoding, event)

    async def _settle_streamed(self, request: Request, now: float) -> Held | None:
        """Settle a streamed request of a lost worker at what it generated; its held
        message, to end."""
        queues = self.scheduler.endpoints[request.endpoint]
        usage = Usage(
            request.input_tokens,
            request.output_charged,
            queues.model_units(request.input_tokens, request.output_charged, request.other_units),
        )
        completed = self.scheduler.complete(request.tenant, request.id, usage, now)
        if completed is not None:
            await self.endings.settle(completed.settlement, now)
        return self.held.admitted.pop((request.tenant, request.id), None)

    async def _fail_all(self, streamed: list[Held]) -> None:
        """End streamed requests with `internal` and a retry hint, their stores at once.
        A result a worker stored first stands and is what the client is sent; one the
        broker cannot store is handed back (it runs again: a second stream)."""
        now = time.time()
        await asyncio.gather(*(self._fail(held, now) for held in streamed))

    async def _fail(self, held: Held, now: float) -> None:
        event = wire.ErrorEvent(
            held.submission.id,
            wire.ErrorCode.INTERNAL,
            "the worker running it was lost (evicted, silent, restarted, or it dropped "
            "the request) after the request had streamed output; resubmit it with a new id",
            self.parts.options.lost_worker_retry_after_s,
        )
        if await self.endings.end(held, event, now) == event:
            self.metrics.child(self.metrics.failed_by_lost_worker, held.submission.endpoint).inc()

    def _update_capacity(self, endpoint: str) -> None:
        """The throttle's view of the endpoint's throughput: healthy workers x profile,
        and with none, the cold start an autoscaled endpoint's first worker needs."""
        if endpoint not in self.scheduler.endpoints:
            return
        profile = self.scheduler.endpoints[endpoint].profile
        healthy = self.pool.healthy_count(endpoint)
        autoscale = self.parts.config.endpoints[endpoint].autoscale
        self.scheduler.set_capacity(
            endpoint,
            healthy * profile.capacity_mu_per_s,
            startup_wait_s=autoscale.cold_start_s if autoscale and not healthy else 0.0,
        )
        self._update_serving(endpoint, healthy)

    def _update_serving(self, endpoint: str, healthy: int) -> None:
        """For `unavailable`: served while a worker is healthy or autoscaling may start one."""
        serving = bool(healthy) or self.parts.config.endpoints[endpoint].autoscale is not None
        self.scheduler.endpoints[endpoint].set_serving(serving, time.time())

    async def on_completions(self, msg: Msg) -> None:
        settlements = []
        async with self._lock:
            for done in wire_internal.COMPLETIONS.decode(msg.data, _encoding(msg)).items:
                if not done.probe:
                    settlements.append(await self._complete(done))
                elif (eviction := await self.probes.answered(done, time.time())) is not None:
                    self.evicted(*eviction)
        self.wake.set()
        # Outside the lock, in one call: a slow limiter store must not hold up heartbeats.
        await self.endings.settle(
            Settlement(
                tuple(check for settled in settlements for check in settled.charge),
                tuple(check for settled in settlements for check in settled.refund),
            ),
            time.time(),
        )

    async def _complete(self, done: wire_internal.Completion) -> Settlement:
        """Release a finished request; the settlement of its token limits, for the
        caller to apply (every way it was held has one)."""
        key = (done.tenant, done.id)
        self.pool.complete(done.worker_id, key, time.time())
        completed = self.scheduler.complete(done.tenant, done.id, done.usage, time.time())
        used = request_tokens(done.usage.input_tokens, done.usage.output_tokens)
        settled = Settlement()
        if completed is not None:
            held = self.held.admitted.pop(key, None)
            settled = completed.settlement
        elif (queued := self.scheduler.cancel(*key)) is not None:
            # It finished on a worker while queued here again (taken back from a worker
            # thought lost, or redelivered after a restart before that worker's first
            # heartbeat): the result stands, the queued copy must not run.
            held = self.held.admitted.pop(key, None)
            settled = settlement(queued.charges, used)
        else:
            held = self.held.adopted.pop(key, None)
            if held is not None:
                settled = settlement(held.charges, used)
                if done.endpoint in self.scheduler.endpoints:
                    self.scheduler.endpoints[done.endpoint].count_completed(done.usage)
        if held is not None:
            if done.stored:
                await held.msg.ack()
                if held.worker not in (None, done.worker_id):
                    await self._abort_rerun(held.worker, done)
            else:
                await held.msg.nak()  # the final event is not stored: run it again
        if completed is not None and done.code is None and done.first_token_at is not None:
            self._observe(completed.request.endpoint, completed.request.arrival, done)
        return settled

    async def _abort_rerun(self, worker_id: str, done: wire_internal.Completion) -> None:
        """It finished on a worker thought lost while it runs again on `worker_id`: stop
        that run (its result could not be stored anyway, the first one stands)."""
        log.info(
            "request %s of %s finished on %s while running again on %s; aborting the second run",
            done.id,
            done.tenant,
            done.worker_id,
            worker_id,
        )
        await self.results.abort(done.endpoint, (done.tenant, done.id), wire.ErrorCode.INTERNAL)

    def _observe(self, endpoint: str, received_at: float, done: wire_internal.Completion) -> None:
        self.metrics.child(self.metrics.input_tokens, endpoint).inc(done.usage.input_tokens)
        self.metrics.child(self.metrics.cached_input_tokens, endpoint).inc(
            done.usage.cached_input_tokens
        )
        ttft = max(0.0, done.first_token_at - received_at)
        self.metrics.child(self.metrics.ttft, endpoint).observe(ttft)
        # Stamped with this clock, as the other samples: the worker's may differ.
        self.metrics.watch.first_token(endpoint, done.tenant, ttft, time.time())
        decoding = done.finished_at - done.first_token_at
        if decoding > 0:
            self.metrics.child(self.metrics.output_tps, endpoint).observe(
                done.usage.output_tokens / decoding
            )


def _encoding(msg: Msg) -> wire.Encoding:
    return wire.Encoding.from_content_type((msg.headers or {}).get(HDR_CONTENT_TYPE))
