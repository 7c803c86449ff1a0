"""The admission step: what intake hands over becomes queued requests or final errors.

For a batch of arrived messages (`Admission.batch`, the intake's handler):

1. parse each against the wire contract; a message that breaks it is answered
   `invalid_request` where that is safe and terminated;
2. look up stored results for the whole batch at once (one round trip);
3. per (tenant, id): a request already held is not admitted twice (a redelivery of the
   held message refreshes its ack token; a second publish of the same id is terminated,
   the first answers); a request with a stored final event (it finished before a restart,
   or was cancelled while in the stream) gets that event again and is acked; a request a
   worker reports running is adopted (acked when it completes, never run twice);
4. everything else goes through admission: `Scheduler.rejection`, the limiter store
   (`Scheduler.limit_checks`), `Scheduler.enqueue`; a rejection (one path, `_refuse`:
   its `Outcome` is its metric label) ends the request (dispatcher/dispatch/endings.py).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass

import nats.errors
from nats.aio.msg import Msg

from broker_config import jetstream, wire, wire_internal
from broker_config.direct_get import DirectGetError
from broker_config.limits import over_limits
from dispatcher.admission.redis_store import LimiterUnavailable
from dispatcher.admission.tokens import InputCounter
from dispatcher.core.limits import charged
from dispatcher.core.pool import Key
from dispatcher.core.types import ADMITTED, Decision, Outcome, Request
from dispatcher.dispatch.convert import to_request, too_large_to_dispatch
from dispatcher.dispatch.endings import CANCELLED, HAND_BACK_S, Endings
from dispatcher.dispatch.held import Held
from dispatcher.intake.park import stored_at
from dispatcher.parts import Parts

log = logging.getLogger("fairq.dispatcher")

# A request cancelled while still in the stream is refused at admission for this long
# (its stored `cancelled` event covers it after that, and across restarts).
CANCEL_MEMORY_S = 300.0
# An unlisted tenant without a flow keeps its depth-API counts this long after its last
# decision.
COUNTS_MEMORY_S = 600.0
LIMITER_UNAVAILABLE = Decision(Outcome.INTERNAL, "rate limiter unavailable", 1.0)


@dataclass(slots=True)
class Decisions:
    """A tenant's admission decisions on one endpoint, for the depth API."""

    admitted: int = 0
    rejected: int = 0
    last_at: float = 0.0

    def count(self, admitted: bool, now: float) -> None:
        if admitted:
            self.admitted += 1
        else:
            self.rejected += 1
        self.last_at = now


class Admission:
    def __init__(self, parts: Parts, endings: Endings) -> None:
        self.parts = parts
        self.endings = endings
        self.subjects, self.scheduler, self.pool = parts.subjects, parts.scheduler, parts.pool
        self.held, self.results, self.metrics = parts.held, parts.results, parts.metrics
        self.input_counter = InputCounter(parts.config.endpoints)
        # (endpoint, tenant) -> its decisions since start, for the depth API. Only tenants
        # the registry knows; an unlisted one's are forgotten (`forget_counts`).
        self.counts: dict[tuple[str, str], Decisions] = {}
        # Requests cancelled while in the stream -> when: admission may already be
        # looking at one of them (see `Api.cancel`).
        self.cancelled: dict[Key, float] = {}

    async def batch(self, messages: list[Msg]) -> None:
        """Parse an arrived batch, look up stored results for all of it at once, then
        admit in arrival order."""
        parsed: list[tuple[Msg, wire.Submission]] = []
        for msg in messages:
            try:
                parsed.append(
                    (
                        msg,
                        wire.parse_submission(
                            msg.subject,
                            msg.data,
                            msg.headers,
                            self.subjects,
                            tenant_inboxes=self.parts.options.tenant_inboxes,
                        ),
                    )
                )
            except wire.WireError as error:
                await _guarded(self._refuse_unparsed(msg, error), msg)
        try:
            stored = await self.results.lookup([(sub.tenant, sub.id) for _, sub in parsed])
        except DirectGetError as exc:
            log.error("results lookup failed (%s); %d requests handed back", exc, len(parsed))
            for msg, _ in parsed:
                with contextlib.suppress(nats.errors.Error):
                    await msg.nak(delay=HAND_BACK_S)
            return
        for msg, submission in parsed:
            await _guarded(
                self._take(msg, submission, stored.get((submission.tenant, submission.id))), msg
            )

    async def _take(
        self, msg: Msg, submission: wire.Submission, stored: wire_internal.StoredResult | None
    ) -> None:
        now = time.time()
        key = (submission.tenant, submission.id)
        held = self.held.get(key)
        if held is not None:
            if (held.msg.metadata.stream, held.msg.metadata.sequence.stream) == (
                msg.metadata.stream,
                msg.metadata.sequence.stream,
            ):
                held.msg = msg  # our own message, redelivered: keep its newest ack token
            else:
                await msg.term()  # the same id published again: the first one answers
            return
        if stored is not None:  # finished before a restart or a redelivery, or cancelled
            await self.results.publish(submission.reply, submission.encoding, stored.event)
            await msg.ack()
            return
        _, deliveries = jetstream.delivery_of(msg.reply)
        published_at = stored_at(msg, self.subjects)
        # Its queue wait and its place in line count from its publish, not from intake.
        held = Held(msg, submission, min(now, published_at))
        worker = self.pool.running_on(key)
        if worker is not None:
            held.worker = worker
            # Charged when a dispatcher before this one admitted it: settled on completion.
            held.charges = charged(self.scheduler.limit_checks(await self._request(held), now))
            self.held.adopted[key] = held
            self.pool.adopt(worker, key)
            return
        if await self._over_limits(held, len(msg.data), now):
            return
        # The wait in the stream counts against the latency target on the first delivery
        # only: a redelivery (after a restart) was admitted once and has waited for us.
        # The limiter is asked every time: a dispatcher that hands a request back gives
        # its charge back first (`hand_back_queued`), one that crashed cannot (the request
        # is then charged twice, never not at all).
        await self.admit(held, now, now - held.received_at if deliveries == 1 else 0.0)

    async def _over_limits(self, held: Held, body_bytes: int, now: float) -> bool:
        """End a request over `[dispatcher.input]` before its tokens are counted. Held,
        finished and adopted requests never get here: limits lowered across a restart
        do not end those (a redelivered request whose worker has not reported it yet
        is judged like a new one)."""
        sub = held.submission
        violation = over_limits(sub.request, body_bytes, self.parts.options.input)
        if violation is not None:
            violation = f"over a limit of [dispatcher.input]: {violation}"
        else:  # the broker's own limit
            violation = too_large_to_dispatch(
                sub, held.received_at, body_bytes, self.parts.nc.max_payload
            )
        if violation is None:
            return False
        await self._refuse(held, Decision(Outcome.INVALID, violation), now)
        return True

    async def admit(
        self, held: Held, now: float, waited_s: float = 0.0, *, charged_before: bool = False
    ) -> None:
        """Admission proper: checks, the limiter store, then the scheduler's queue.

        `charged_before`: an adopted request whose worker was lost, admitted and charged
        by a dispatcher before this one: the limiter is not asked again, and what it was
        charged (as recorded at its adoption) is settled on completion or given back on a
        rejection.
        """
        sub = held.submission
        if await self._cancelled_meanwhile(held, now):
            return
        request = await self._request(held)
        rejection = self.scheduler.rejection(
            request, now, self._waiting_in_stream(sub.endpoint, sub.tenant), waited_s
        )
        if charged_before:
            if not held.charges:
                held.charges = charged(self.scheduler.limit_checks(request, now))
            decision = rejection if rejection is not None else ADMITTED
        elif rejection is not None:
            decision = rejection
        else:
            checks = self.scheduler.limit_checks(request, now)
            try:
                decision = await self.parts.limiter.apply(checks, now)
            except LimiterUnavailable as exc:
                log.error("rate limiter unavailable: %s", exc)
                await self._refuse(held, LIMITER_UNAVAILABLE, now)
                return
            if decision.admitted:
                held.charges = charged(checks)
        request.charges = held.charges
        if await self._cancelled_meanwhile(held, now):  # while the limiter answered
            return
        if decision.outcome not in (Outcome.UNKNOWN_ENDPOINT, Outcome.UNKNOWN_TENANT):
            counts = self.counts.setdefault((sub.endpoint, sub.tenant), Decisions())
            counts.count(decision.admitted, now)
        if not decision.admitted:
            await self._refuse(held, decision, now)
            return
        self._count_outcome(sub, Outcome.ADMITTED)
        self.scheduler.enqueue(request, now)
        self.held.admitted[held.key] = held

    async def _refuse(self, held: Held, decision: Decision, now: float) -> None:
        """The one way admission turns a request away: its outcome counted, then the
        request ended with the outcome's error."""
        self._count_outcome(held.submission, decision.outcome)
        await self.endings.reject(held, decision, now)

    def _count_outcome(self, sub: wire.Submission, outcome: Outcome) -> None:
        """The admissions metric, labelled by the core's `Outcome` (its only label for
        outcomes)."""
        endpoint = sub.endpoint if sub.endpoint in self.parts.config.endpoints else "unknown"
        self.metrics.child(self.metrics.admissions, endpoint, outcome.value).inc()

    async def _request(self, held: Held) -> Request:
        """The core's view of a held request, its input counted by the endpoint's
        tokenizer if it has one."""
        sub = held.submission
        spec = self.parts.config.endpoints.get(sub.endpoint)
        if spec is None:
            return to_request(sub, held.received_at, 1, held)
        return to_request(
            sub,
            held.received_at,
            spec.max_tokens_cap,
            held,
            spec.affinity_block_tokens,
            await self.input_counter.count(sub.endpoint, sub.request),
        )

    def adopt_running(self) -> None:
        """Adopt the queued requests a worker's heartbeat says it runs: after a restart,
        redelivered requests can be taken in before the first heartbeats arrive. Called
        once the dispatcher has settled, before its first dispatch, so none runs twice."""
        for key, held in list(self.held.admitted.items()):
            worker = self.pool.running_on(key)
            if worker is not None and self.scheduler.cancel(*key) is not None:
                del self.held.admitted[key]
                held.worker = worker
                self.held.adopted[key] = held
                self.pool.adopt(worker, key)

    async def _cancelled_meanwhile(self, held: Held, now: float) -> bool:
        """A request cancelled while it was in the stream is never admitted."""
        if held.key not in self.cancelled:
            return False
        await self.endings.reject(held, CANCELLED, now)
        return True

    def _waiting_in_stream(self, endpoint: str, tenant: str) -> int:
        """The tenant's requests to `endpoint` the stream holds beyond the one being
        admitted and those already queued or running here (as of the last listing)."""
        unfinished = self.parts.backlog().get((endpoint, tenant), 0)
        known = endpoint in self.parts.config.endpoints
        flow = self.scheduler.flow(endpoint, tenant) if known else None
        here = len(flow.queue) + flow.running if flow is not None else 0
        return max(0, unfinished - here - 1)

    async def _refuse_unparsed(self, msg: Msg, error: wire.WireError) -> None:
        """A message that is not a valid request: answer where we safely can, then drop."""
        log.info("invalid request on %s: %s", msg.subject, error)
        event = error.to_event()
        tenant = self.subjects.tenant_of(msg.subject)
        if error.request_id and tenant:  # the id is spent: its result is this error
            await self.results.store(tenant, "", event, time.time())
        await self.results.publish(error.reply, error.encoding, event)
        await msg.term()
        self.metrics.child(self.metrics.invalid_messages, "sent" if error.reply else "none").inc()

    def forget_counts(self, now: float) -> None:
        """Drop the counts of unlisted tenants the scheduler has forgotten (no flow) and
        that had no decision for `COUNTS_MEMORY_S` (a tenant whose every request is
        rejected never gets a flow, and stays in view while it keeps trying)."""
        self.counts = {
            key: counts
            for key, counts in self.counts.items()
            if key[1] in self.parts.config.tenants
            or self.scheduler.flow(*key) is not None
            or now - counts.last_at < COUNTS_MEMORY_S
        }

    def forget_old_cancels(self, now: float) -> None:
        self.cancelled = {k: at for k, at in self.cancelled.items() if now - at < CANCEL_MEMORY_S}


async def _guarded(step: Awaitable[None], msg: Msg) -> None:
    try:
        await step
    except Exception:
        log.exception("intake of %s failed; it will be redelivered", msg.subject)
