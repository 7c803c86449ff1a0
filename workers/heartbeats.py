"""A worker's heartbeats: what it can take (capacity), what it runs (used, in flight, the
output so far) and whether it is healthy, numbered and sent as JSON (`workers.outbox`).

The worker service sends one on start, every heartbeat interval, when it stops taking
batches (capacity equal to what is in use: no room) and a final one on shutdown (not
healthy, no capacity, nothing in flight).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from broker_config.wire_internal import Heartbeat
from costmodel.units import NO_CAPACITY, Capacity
from workers.engine import Engine, EngineError
from workers.outbox import Outbox
from workers.probe import advertised
from workers.running import Running

# The worker service's logger: its records keep one name, whichever module they come from.
log = logging.getLogger("workers.service")


class Heartbeats:
    """One worker run's heartbeats to `subject` (the worker's `Subjects.heartbeat`)."""

    def __init__(
        self,
        outbox: Outbox,
        engine: Engine,
        subject: str,
        *,
        endpoint: str,
        worker_id: str,
        started_at: float,
        capacity_mu_per_s: float,
    ) -> None:
        self._outbox = outbox
        self._engine = engine
        self._subject = subject
        self._endpoint = endpoint
        self._worker_id = worker_id
        self._started_at = started_at
        self._capacity_mu_per_s = capacity_mu_per_s
        self._seq = 0
        self.sent_at = time.time()  # when the last heartbeat went out

    async def send(
        self, requests: Iterable[Running], *, draining: bool, evicted: bool, final: bool = False
    ) -> None:
        """A heartbeat for the `requests` running; `draining`: the worker takes no more."""
        self.sent_at = time.time()
        await self._outbox.publish_internal(
            self._subject, self._message(requests, draining=draining, evicted=evicted, final=final)
        )

    def _message(
        self, requests: Iterable[Running], *, draining: bool, evicted: bool, final: bool
    ) -> Heartbeat:
        running = [] if final else list(requests)
        used = Capacity(
            sequences=len(running),
            tokens=sum(r.input_tokens + r.item.max_tokens for r in running),
            model_units=sum(r.footprint_mu for r in running),
        )
        healthy = not final and self._engine.healthy and not evicted
        if final:
            capacity = NO_CAPACITY
        elif draining:
            capacity = used  # no room: the dispatcher sends nothing new
        else:
            capacity, healthy = self._engine_capacity(healthy)
        seq, self._seq = self._seq, self._seq + 1
        return Heartbeat(
            worker_id=self._worker_id,
            endpoint=self._endpoint,
            capacity=capacity,
            used=used,
            in_flight=[r.key for r in running],
            healthy=healthy,
            started_at=self._started_at,
            sent_at=time.time(),
            seq=seq,
            output_tokens=[r.output_tokens for r in running],
            capacity_mu_per_s=self._capacity_mu_per_s,
        )

    def _engine_capacity(self, healthy: bool) -> tuple[Capacity, bool]:
        try:
            limits = self._engine.capacity
        except EngineError as exc:
            log.error("the engine reports no capacity: %s", exc)
            return NO_CAPACITY, False
        return advertised(limits), healthy
