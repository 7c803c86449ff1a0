"""The JetStream messages the dispatcher holds, one per request it has taken in and not
finished: queued in the scheduler, running on a worker it sent it to, or *adopted*
(running on a worker since before this dispatcher started, found in a heartbeat).

A held message is acked only once its request's final event is stored, terminated when
the dispatcher itself ends the request (a rejection), and nak'd on shutdown so another
dispatcher takes it at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import nats.errors
from nats.aio.msg import Msg

from broker_config import wire
from dispatcher.core.limits import Check
from dispatcher.core.pool import Key


@dataclass(slots=True)
class Held:
    msg: Msg
    submission: wire.Submission
    # When it was published (its place in line and queue wait count from there).
    received_at: float
    worker: str | None = None  # the worker running it
    # An adopted request's worker reported output: it cannot run again from scratch.
    streamed: bool = False
    # The limiter checks its admission charged (dispatcher.core.limits.charged):
    # given back if it ends without running, else settled on completion.
    charges: tuple[Check, ...] = ()

    @property
    def key(self) -> Key:
        return self.submission.tenant, self.submission.id


class HeldRequests:
    def __init__(self) -> None:
        self.admitted: dict[Key, Held] = {}
        self.adopted: dict[Key, Held] = {}

    def get(self, key: Key) -> Held | None:
        return self.admitted.get(key) or self.adopted.get(key)

    def __iter__(self) -> Iterator[Held]:
        yield from list(self.admitted.values())
        yield from list(self.adopted.values())

    def running(self) -> bool:
        """True while a worker runs any of them."""
        return any(held.worker for held in self)

    async def in_progress(self) -> None:
        """Tell JetStream every held message is still being worked on (resets its ack wait)."""
        for held in self:
            with contextlib.suppress(nats.errors.Error):  # the next extension retries
                await held.msg.in_progress()

    async def hand_back(self, *, queued_only: bool = False) -> None:
        """Nak everything (shutdown), or what no worker runs: another dispatcher gets it
        without waiting."""
        for held in self:
            if queued_only and held.worker is not None:
                continue
            with contextlib.suppress(nats.errors.Error):  # else redelivered after the ack wait
                await held.msg.nak()
            # Popped, not deleted: a completion may have taken it while the nak waited.
            self.adopted.pop(held.key, None)
            self.admitted.pop(held.key, None)
