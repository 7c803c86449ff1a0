"""Arrived messages handed to a handler in batches, one tenant at a time round-robin.

    hand_over = HandOver(handler, batch=256, after=top_up)
    hand_over.arrive(tenant, msg)       # tenant: an Arrivals record
    await hand_over.run()               # until stop(); finishes the batch it is handing over

Round-robin, so even the pushes that follow a restart over many backlogs interleave in
each batch. `after(name)` runs once the handler is done with a batch, for each tenant it
held (to pull more for it).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from nats.aio.msg import Msg

log = logging.getLogger("fairq.intake")


@dataclass(slots=True)
class Arrivals:
    """One tenant's messages waiting to be handed over."""

    name: str
    arrived: deque[Msg] = field(default_factory=deque)
    handing_over: int = 0  # arrived messages the handler is working on
    ready: bool = False  # in the ring


class HandOver:
    def __init__(
        self,
        handler: Callable[[list[Msg]], Awaitable[None]],
        *,
        batch: int,
        after: Callable[[str], Awaitable[None]],
    ) -> None:
        self.handler = handler
        self.batch = batch
        self.after = after
        self.ring: deque[Arrivals] = deque()
        self._arrivals = asyncio.Event()
        self._open = True

    def arrive(self, owner: Arrivals, msg: Msg) -> None:
        owner.arrived.append(msg)
        if not owner.ready:
            owner.ready = True
            self.ring.append(owner)
        self._arrivals.set()

    def stop(self) -> None:
        self._open = False
        self._arrivals.set()

    def _take(self) -> tuple[list[Msg], list[Arrivals]]:
        taken: list[Msg] = []
        owners: dict[str, Arrivals] = {}
        while self.ring and len(taken) < self.batch:
            owner = self.ring.popleft()
            taken.append(owner.arrived.popleft())
            owner.handing_over += 1
            owners[owner.name] = owner
            if owner.arrived:
                self.ring.append(owner)
            else:
                owner.ready = False
        return taken, list(owners.values())

    async def run(self) -> None:
        while self._open:
            await self._arrivals.wait()
            self._arrivals.clear()
            while self.ring and self._open:
                batch, owners = self._take()
                try:
                    await self.handler(batch)
                except Exception:
                    log.exception("intake handler failed; its messages will be redelivered")
                for owner in owners:
                    owner.handing_over = 0
                    await self.after(owner.name)
