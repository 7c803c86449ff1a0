"""The request/reply APIs of the wire contract: status, cancel and depth.

Every request between its publish acknowledgement and its final event answers `queued`
(with its position in its tenant's line) or `running`, and can be cancelled, wherever it
is: queued in the scheduler, running on a worker, or still waiting in the streams beyond
its tenant's intake window. The last are found by reading the tenant's messages
(dispatcher/api/lookup.py, which batches a tenant's lookups). Cancelling one of those
stores its `cancelled` final event first, then deletes its message: intake consults
stored results before admitting anything, so the cancel holds even if this
dispatcher dies in between, and admission refuses a request cancelled while it was
being admitted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Any

from nats.aio.msg import Msg
from nats.js.errors import NotFoundError

from broker_config import wire
from broker_config.direct_get import DirectBatchGet, StoredMessage
from dispatcher.admission.admit import Admission
from dispatcher.api.lookup import StreamLookup
from dispatcher.core.pool import Key
from dispatcher.core.scheduler import DepthRow
from dispatcher.dispatch.convert import to_error_event
from dispatcher.dispatch.endings import CANCELLED, Endings
from dispatcher.dispatch.stored_results import BROKER_ERRORS
from dispatcher.parts import Parts

log = logging.getLogger("fairq.dispatcher")

# A status or cancel whose broker lookup failed (a timeout on a starved machine) is
# answered `internal` with this retry hint.
LOOKUP_RETRY_AFTER_S = 0.5


class Api:
    def __init__(
        self,
        parts: Parts,
        admission: Admission,
        endings: Endings,
        parked: DirectBatchGet,
        stored: DirectBatchGet,
    ) -> None:
        """`parked`, `stored`: readers of the parked and the requests stream."""
        self.parts = parts
        self.nc, self.subjects, self.scheduler = parts.nc, parts.subjects, parts.scheduler
        self.held, self.results = parts.held, parts.results
        self.admission = admission  # its cancels in flight, its decision counts
        self.endings = endings
        subjects = parts.subjects
        # Where a tenant's requests not taken in yet are, oldest first.
        self.lookup = StreamLookup(
            ((parked, subjects.parked_tenant_filter), (stored, subjects.stored_tenant_filter)),
            subjects,
            parts.held,
            self._parse,
        )
        self._cancels: dict[Key, asyncio.Future[bool]] = {}

    async def close(self) -> None:
        """Stop the cancels and the lookups in the streams still running (after the
        subscriptions ended, before the stream readers close)."""
        attempts = list(self._cancels.values())
        for attempt in attempts:
            attempt.cancel()
        await asyncio.gather(*attempts, return_exceptions=True)
        await self.lookup.close()

    async def refuse(self, msg: Msg, message: str, retry_after_s: float) -> None:
        """Answer a status or cancel call `rate_limited` without handling it."""
        try:
            request_id = wire.STATUS_REQUEST.decode(msg.data or b"{}").id
        except (ValueError, wire.WireError):
            request_id = ""
        await self._respond(
            msg, wire.ErrorEvent(request_id, wire.ErrorCode.RATE_LIMITED, message, retry_after_s)
        )

    # -- status ----------------------------------------------------------------------------

    async def on_status(self, msg: Msg) -> None:
        tenant, query = await self._query(msg, wire.STATUS_REQUEST)
        if query is None:
            return
        try:
            reply = await self.status((tenant, query.id))
        except BROKER_ERRORS as exc:
            reply = _unavailable(query.id, exc)
        await self._respond(msg, reply)

    async def status(self, key: Key) -> wire.StatusReply:
        request_id = key[1]
        state = self.scheduler.state(*key)
        if state is not None:
            return wire.StatusReply(request_id, state[0], position=state[1])
        if key in self.held.adopted:
            return wire.StatusReply(request_id, "running")
        stored = await self.results.get(key)
        if stored is not None:
            finished = "done" if isinstance(stored.event, wire.DoneEvent) else "failed"
            return wire.StatusReply(request_id, finished, result=stored.event)
        found = await self.lookup.find(key)
        if found is None:
            return wire.StatusReply(request_id, "unknown")
        position = found.waiting_before
        if found.submission is not None:
            flow = (
                self.scheduler.flow(found.submission.endpoint, key[0])
                if found.submission.endpoint in self.scheduler.endpoints
                else None
            )
            position += len(flow.queue) if flow is not None else 0
        return wire.StatusReply(request_id, "queued", position=position)

    # -- cancel ----------------------------------------------------------------------------

    async def on_cancel(self, msg: Msg) -> None:
        tenant, query = await self._query(msg, wire.CANCEL_REQUEST)
        if query is None:
            return
        try:
            reply = wire.CancelReply(query.id, await self.cancel((tenant, query.id)))
        except BROKER_ERRORS as exc:
            reply = _unavailable(query.id, exc)
        await self._respond(msg, reply)

    async def cancel(self, key: Key) -> bool:
        """Calls are handled side by side: concurrent cancels of one request share one
        attempt, so its `cancelled` event is sent once."""
        attempt = self._cancels.get(key)
        if attempt is None:
            attempt = self._cancels[key] = asyncio.ensure_future(self._cancel(key))
            attempt.add_done_callback(lambda _: self._cancels.pop(key, None))
        return await asyncio.shield(attempt)

    async def _cancel(self, key: Key) -> bool:
        if await self._cancel_taken(key):
            return True
        found = await self.lookup.find(key)
        if found is None or found.submission is None:
            return False
        # Taken in while the lookup waited: cancel it there (no await from this check
        # to marking it cancelled, so admission cannot take it in between).
        if await self._cancel_taken(key):
            return True
        now = time.time()
        self.admission.cancelled[key] = now
        submission = found.submission
        event = to_error_event(submission.id, CANCELLED)
        if await self.results.store(submission.tenant, submission.endpoint, event, now) != event:
            # A re-submission of a request that finished: nothing to cancel; intake
            # answers it with the stored result.
            del self.admission.cancelled[key]
            return False
        await self.results.publish(submission.reply, submission.encoding, event)
        try:
            await self.nc.jetstream().delete_msg(found.stream, found.seq)
        except NotFoundError:
            pass  # taken in meanwhile: its stored event answers it there
        await self._cancel_taken(key)  # taken in while the event was being stored
        return True

    async def _cancel_taken(self, key: Key) -> bool:
        """Cancel a request the dispatcher holds: drop it if queued, abort it if running."""
        request = self.scheduler.cancel(*key)
        if request is not None:
            await self.endings.reject(self.held.admitted.pop(key), CANCELLED, time.time())
            return True
        running = self.scheduler.running_request(*key)
        adopted = self.held.adopted.get(key)
        if running is None and adopted is None:
            return False
        endpoint = running.endpoint if running else adopted.submission.endpoint
        await self.results.abort(endpoint, key, wire.ErrorCode.CANCELLED)
        return True

    # -- the stream --------------------------------------------------------------------------

    def _parse(self, message: StoredMessage) -> wire.Submission | None:
        try:
            return wire.parse_submission(
                message.subject,
                message.data,
                message.headers,
                self.subjects,
                tenant_inboxes=self.parts.options.tenant_inboxes,
            )
        except wire.WireError:
            return None

    # -- depth -------------------------------------------------------------------------------

    async def on_depth(self, msg: Msg) -> None:
        if await self._decode(msg, wire.DEPTH_REQUEST) is None:
            return
        rows = {(r.endpoint, r.tenant): r for r in self.depth_rows(time.time())}
        counts = self.admission.counts
        entries = []
        for key in rows.keys() | counts.keys():
            row = rows.get(key)
            decisions = counts.get(key)
            admitted, rejected = (decisions.admitted, decisions.rejected) if decisions else (0, 0)
            if row is None and (policy := self.scheduler.registry.tenant(key[1])) is None:
                continue  # a tenant a reload removed, with nothing left here
            tier = row.tier if row else policy.tier
            entries.append(
                wire.DepthEntry(
                    key[0],
                    tier,
                    key[1],
                    row.queued if row else 0,
                    row.running if row else 0,
                    row.oldest_wait_s if row else 0.0,
                    admitted,
                    rejected,
                )
            )
        await self._respond(
            msg, wire.DepthReply(sorted(entries, key=lambda e: (e.endpoint, e.tier, e.tenant)))
        )

    def depth_rows(self, now: float) -> list[DepthRow]:
        """The scheduler's queues, with what is still in the stream counted as queued.

        The stream holds every unfinished request (waiting in the stream, queued here or
        running), so queued = max(queued here, stream count - running).
        """
        backlog = dict(self.parts.backlog())
        rows = []
        for row in self.scheduler.depth(now):
            in_stream = backlog.pop((row.endpoint, row.tenant), 0)
            rows.append(replace(row, queued=max(row.queued, in_stream - row.running)))
        for (endpoint, tenant), count in backlog.items():
            policy = self.scheduler.registry.tenant(tenant)
            if endpoint in self.parts.config.endpoints and policy is not None:
                rows.append(DepthRow(endpoint, policy.tier, tenant, count, 0, 0.0))
        return rows

    # -- requests ----------------------------------------------------------------------------

    async def _query(self, msg: Msg, codec: wire.Codec) -> tuple[str, Any]:
        """(tenant, query) of a status or cancel request; query None once answered."""
        query = await self._decode(msg, codec)
        tenant = self.subjects.tenant_of(msg.subject)
        if query is not None and tenant is None:
            await self._respond(
                msg,
                wire.ErrorEvent(
                    query.id,
                    wire.ErrorCode.INVALID_REQUEST,
                    f"invalid tenant in subject {msg.subject[:200]!r}",
                ),
            )
            return "", None
        return tenant or "", query

    async def _decode(self, msg: Msg, codec: wire.Codec) -> Any:
        """The query, or None once answered `invalid_request`."""
        try:
            return codec.decode_or_invalid(msg.data or b"{}")
        except wire.WireError as error:
            await self._respond(msg, error.to_event())
            return None

    async def _respond(self, msg: Msg, reply: Any) -> None:
        """Answer on the caller's reply subject, unless it names fairq's own subjects or the
        server's (`$JS`, `$KV`): a caller picks its reply subject freely, and the broker
        checks it against nobody's permissions, so it must not make the dispatcher publish
        there (docs/security.md)."""
        if not msg.reply:  # a cancel may be published without waiting for the answer
            return
        if msg.reply.startswith(("$", f"{self.subjects.prefix}.")):
            log.warning(
                "an API call on %s asked for its answer on %s; not answered", msg.subject, msg.reply
            )
            return
        await msg.respond(wire.encode(reply))


def _unavailable(request_id: str, exc: Exception) -> wire.ErrorEvent:
    """The answer when the broker did not answer a lookup: retryable, not silence (the
    caller would otherwise wait out its own timeout)."""
    log.warning("an API lookup of %s failed: %r", request_id, exc)
    return wire.ErrorEvent(
        request_id,
        wire.ErrorCode.INTERNAL,
        f"the broker did not answer a lookup ({exc}); try again",
        LOOKUP_RETRY_AFTER_S,
    )
