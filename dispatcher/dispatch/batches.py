"""Batches out: fill every worker's free capacity from the scheduler and send it.

One pass (`Dispatch.once`) visits each endpoint whose healthy workers have a free
sequence: `Scheduler.place` takes the next requests in fair order and places each on a
worker (`WorkerPool.placement`: session or prefix affinity with bounded load, else the
least utilised worker); each worker's requests are recorded in the pool's ledger (so
capacity is never double-booked between heartbeats) and published as one batch to its
subject. The loop runs a pass whenever something changed (`Parts.wake`): an intake
batch, a completion, a heartbeat, or the maintenance tick.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import nats.errors

from dispatcher.core.pool import Worker
from dispatcher.core.types import Request
from dispatcher.dispatch.convert import BATCH_HEADERS, encode_batches, to_batch_item
from dispatcher.dispatch.endings import Endings
from dispatcher.dispatch.held import Held
from dispatcher.parts import Parts

log = logging.getLogger("fairq.dispatcher")


class Dispatch:
    def __init__(
        self,
        parts: Parts,
        endings: Endings,
        top_up: Callable[[str], Awaitable[None]],
        on_the_way: Callable[[str], list[str]] = lambda endpoint: [],
    ) -> None:
        self.nc, self.subjects, self.scheduler = parts.nc, parts.subjects, parts.scheduler
        self.pool, self.metrics, self.wake = parts.pool, parts.metrics, parts.wake
        self.endings = endings
        self.top_up = top_up  # intake pulls more for a tenant whose window has room
        # endpoint -> tenants with requests to it still in the broker or being admitted:
        # the room is kept for them over lower tiers (`Scheduler.place`).
        self.on_the_way = on_the_way
        self.epoch = 0  # the lease epoch batches carry
        # Checked again before each endpoint's placement: a lease that lapsed ends a pass.
        self.may_send: Callable[[], bool] = lambda: True
        self.passing = asyncio.Lock()  # held through a pass (a drain waits for it)

    async def run(self, may_dispatch: Callable[[], bool]) -> None:
        """Pass after pass, whenever woken; `may_dispatch` says whether passes may send."""
        self.may_send = may_dispatch
        while True:
            await self.wake.wait()
            self.wake.clear()
            async with self.passing:
                if may_dispatch():
                    await self.once(time.time())

    async def once(self, now: float) -> None:
        for name, endpoint in self.scheduler.endpoints.items():
            if not self.may_send():
                return
            room = self.pool.placement(
                name, endpoint.spec.affinity_load_bound, affinity=endpoint.spec.affinity
            )
            if room is None:
                continue
            offered = {slot.worker_id: slot.sequences for slot in room.slots}
            selection = self.scheduler.place(name, room, now, self.on_the_way(name))
            # Taken before any await: the pool may change while batches go out.
            batches = [(self.pool.workers[slot.worker_id], slot.requests) for slot in room.placed()]
            await self.endings.drop_expired(selection.expired, now)
            fill = self.metrics.child(self.metrics.batch_fill, name)
            for worker, requests in batches:
                await self._send(worker, requests, now)
                fill.observe(len(requests) / offered[worker.worker_id])

    async def _send(self, worker: Worker, requests: list[Request], now: float) -> None:
        items = []
        for request in requests:
            held: Held = request.payload
            held.worker = worker.worker_id
            self.pool.assign(worker, request, now)
            items.append(to_batch_item(request, held.submission, now))
            waited = now - held.received_at
            self.metrics.child(self.metrics.queue_wait, request.endpoint).observe(waited)
            self.metrics.watch.waited(request.endpoint, request.tenant, waited, now)
        subject = self.subjects.work(worker.endpoint, worker.worker_id)
        for message in encode_batches(
            worker.worker_id, worker.endpoint, items, now, self.nc.max_payload, self.epoch
        ):
            try:
                await self.nc.publish(subject, message, headers=BATCH_HEADERS)
            except nats.errors.MaxPayloadError:
                # Admission refuses what cannot fit alone; only a server whose limit
                # dropped since gets here. The worker never lists these requests: they
                # come back as lost and are tried again.
                log.error(
                    "a batch for %s is over the broker's max_payload (%d bytes)",
                    worker.worker_id,
                    self.nc.max_payload,
                )
        for tenant in {request.tenant for request in requests}:
            await self.top_up(tenant)  # their windows have room again
