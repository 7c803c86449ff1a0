"""How the dispatcher ends a request it holds, whichever room decides to: a final event
stored and sent (a rejection, a deadline passed while queued, a cancel, a lost stream),
or the request handed back to JetStream to come again; and its token limits settled.

    endings = Endings(parts)
    await endings.reject(held, decision, now)   # admission, the API, a reload
    await endings.end(held, event, now)         # any final event
    await endings.drop_expired(requests, now)   # queued past their deadline
    await endings.hand_back(held, now)          # to be admitted again
    await endings.hand_back_queued(now)         # the drain (dispatcher/service.py)

A request the dispatcher ends never costs its tenant's token limits: what admission
charged is given back first. One that ran is settled at its real usage
(`Endings.settle`, from dispatcher/dispatch/reports.py).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable

import nats.errors

from broker_config import wire
from dispatcher.admission.redis_store import LimiterUnavailable
from dispatcher.core.limits import Settlement, settlement
from dispatcher.core.types import Decision, Outcome, Request
from dispatcher.dispatch.convert import to_error_event
from dispatcher.dispatch.held import Held
from dispatcher.dispatch.stored_results import BROKER_ERRORS
from dispatcher.parts import Parts

log = logging.getLogger("fairq.dispatcher")

# What the broker failed to look up or to end comes back this soon (not after the ack wait).
HAND_BACK_S = 1.0
CANCELLED = Decision(Outcome.CANCELLED, "cancelled by the client")
EXPIRED = Decision(Outcome.DEADLINE_EXCEEDED, "the deadline passed while queued")
# Limiter checks settled in one call of the store (one Redis script).
SETTLE_BATCH = 512


class Endings:
    def __init__(self, parts: Parts) -> None:
        self.parts = parts

    async def reject(self, held: Held, decision: Decision, now: float) -> None:
        """End a held request with `decision`'s error (it was never sent to a worker);
        the token limits it was charged are given back, since it used none."""
        charges, held.charges = held.charges, ()
        await self.settle(settlement(charges, 0), now)
        await self.end(held, to_error_event(held.submission.id, decision), now)

    async def end(self, held: Held, event: wire.FinalEvent, now: float) -> wire.FinalEvent | None:
        """End a held request with `event`: the result that stands, or None if the broker
        could not store it; then the message is handed back (naked), so the request comes
        back rather than vanish."""
        try:
            return await self.parts.results.finish(held.msg, held.submission, event, now)
        except BROKER_ERRORS as exc:
            log.error(
                "could not end request %s of %s: %r; handing it back",
                held.submission.id,
                held.submission.tenant,
                exc,
            )
            # Delayed: a results bucket that keeps failing must not spin redeliveries.
            with contextlib.suppress(nats.errors.Error):  # else after the ack wait
                await held.msg.nak(delay=HAND_BACK_S)
            return None

    async def drop_expired(self, requests: Iterable[Request], now: float) -> None:
        """Queued requests whose deadline passed before they were dispatched."""
        for request in requests:
            held = self.parts.held.admitted.pop((request.tenant, request.id))
            await self.reject(held, EXPIRED, now)

    async def hand_back(self, held: Held, now: float) -> None:
        """Hand one request, no longer held, back to JetStream at once, its token charges
        given back first: the admission that takes it again charges it again."""
        await self.settle(settlement(held.charges, 0), now)
        held.charges = ()
        with contextlib.suppress(nats.errors.Error):  # else after the ack wait
            await held.msg.nak()

    async def hand_back_queued(self, now: float) -> None:
        """A stop hands its queued requests back (nak), out of the scheduler, after giving
        back what they were charged, since the dispatcher that takes them next charges
        them at admission. (Running ones keep their charge: the next dispatcher adopts
        them, uncharged.)"""
        refunds = []
        for held in self.parts.held.admitted.values():
            if held.worker is None:
                self.parts.scheduler.cancel(*held.key)
                refunds.extend(settlement(held.charges, 0).refund)
                held.charges = ()
        for first in range(0, len(refunds), SETTLE_BATCH):
            await self.settle(Settlement(refund=tuple(refunds[first : first + SETTLE_BATCH])), now)
        await self.parts.held.hand_back(queued_only=True)

    async def settle(self, settled: Settlement, now: float) -> None:
        """Settle token limits at real usage; a store that fails loses only the
        correction (logged), never the request."""
        if settled:
            try:
                await self.parts.limiter.settle(settled, now)
            except LimiterUnavailable as exc:
                log.warning("token limits not settled at real usage: %s", exc)
