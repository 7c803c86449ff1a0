"""Batches out: fill every worker's free capacity from the scheduler and send it.

One pass (`Dispatch.once`) visits the healthy workers with a free sequence, least
model-unit load first (`WorkerPool.by_load`), asks `Scheduler.next_batch` for each
worker's free room, records what it sends in the pool's ledger (so capacity is never
double-booked between heartbeats), and publishes the batch to the worker's subject. The
loop runs a pass whenever something changed (`wake`): an intake batch, a completion, a
heartbeat, or the maintenance tick.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from nats.aio.client import Client as NATS

from broker_config import wire
from broker_config.subjects import HDR_CONTENT_TYPE, Subjects
from dispatcher.admit import Admission
from dispatcher.convert import to_batch_item
from dispatcher.core.scheduler import Scheduler
from dispatcher.core.types import Request
from dispatcher.core.workers import Worker, WorkerPool
from dispatcher.held import Held
from dispatcher.metrics import DispatcherMetrics

# Batches travel as msgpack: internal, and cheaper to encode and decode than JSON.
BATCH_ENCODING = wire.Encoding.MSGPACK


class Dispatch:
    def __init__(self, nc: NATS, subjects: Subjects, scheduler: Scheduler, pool: WorkerPool,
                 admission: Admission, metrics: DispatcherMetrics,
                 top_up: Callable[[str], Awaitable[None]]) -> None:
        self.nc = nc
        self.subjects = subjects
        self.scheduler = scheduler
        self.pool = pool
        self.admission = admission
        self.metrics = metrics
        self.top_up = top_up  # intake pulls more for a tenant whose window has room
        self.wake = asyncio.Event()

    async def run(self, may_dispatch: Callable[[], bool]) -> None:
        """Pass after pass, whenever woken; `may_dispatch` says whether passes may send."""
        while True:
            await self.wake.wait()
            self.wake.clear()
            if may_dispatch():
                await self.once(time.time())

    async def once(self, now: float) -> None:
        for worker in self.pool.by_load():
            free = worker.free()
            if free.sequences <= 0:
                continue
            selection = self.scheduler.next_batch(worker.endpoint, free, now, worker.capacity)
            await self.admission.drop_expired(selection.expired, now)
            if selection.requests:
                await self._send(worker, selection.requests, now)
                self.metrics.child(self.metrics.batch_fill, worker.endpoint).observe(
                    len(selection.requests) / free.sequences)

    async def _send(self, worker: Worker, requests: list[Request], now: float) -> None:
        items = []
        for request in requests:
            held: Held = request.payload
            held.worker = worker.worker_id
            self.pool.assign(worker, request, now)
            items.append(to_batch_item(request, held.submission, now))
            self.metrics.child(self.metrics.queue_wait, request.endpoint).observe(
                now - held.received_at)
        batch = wire.Batch(worker_id=worker.worker_id, endpoint=worker.endpoint, items=items,
                           sent_at=now)
        await self.nc.publish(self.subjects.work(worker.endpoint, worker.worker_id),
                              wire.encode(batch, BATCH_ENCODING),
                              headers={HDR_CONTENT_TYPE: BATCH_ENCODING.content_type})
        for tenant in {request.tenant for request in requests}:
            await self.top_up(tenant)  # their windows have room again
