"""Black-box health probes of the workers, and what a failed one leads to.

Heartbeats say a worker's event loop runs, not that its engine does: an engine that
hangs keeps its worker beating. Each maintenance tick, the pool names the workers due a
probe (holding work with no completion and no new token for `probe_stall_s`, or idle for
`probe_idle_s`); each gets one short generation (`BatchItem.probe`), published straight
to its work subject, outside the scheduler and the pool's capacity ledger, with a
deadline `probe_timeout_s` ahead. The worker runs it at the top engine priority in a
slot it keeps free for probes (`workers.probe`) and answers with a Completion. A probe
unanswered by then, or answered with an error, fails; `probe_failures` in a row evict
the worker, whose work the caller takes back (`WorkerReports.evicted`).
"""

from __future__ import annotations

import itertools
import logging
import time

from broker_config import wire, wire_internal
from broker_config.subjects import HDR_CONTENT_TYPE
from dispatcher.core.pool import Lost, Worker
from dispatcher.parts import Parts

log = logging.getLogger("fairq.dispatcher")

PROBE_TENANT = "fairq-probe"  # never a tenant's queue: probes bypass the scheduler
PROBE_ENCODING = wire.Encoding.MSGPACK


class Probes:
    def __init__(self, parts: Parts) -> None:
        self.nc, self.subjects, self.pool = parts.nc, parts.subjects, parts.pool
        self.options, self.metrics = parts.options, parts.metrics
        self.epoch = 0  # the lease epoch probes and evictions carry
        # Unique over this dispatcher's life; a restarted dispatcher's start time makes
        # them unique across runs, so no worker's late answer is taken for a new probe.
        self._ids = (f"probe-{int(time.time() * 1000)}-{n}" for n in itertools.count())

    async def tick(self, now: float) -> list[tuple[Worker, Lost]]:
        """Fail overdue probes and send those due; the workers evicted, with their work."""
        evicted = []
        for worker, lost in self.pool.probes_overdue(now, self.options.probe_timeout_s):
            log.warning(
                "worker %s did not answer a probe within %.1fs",
                worker.worker_id,
                self.options.probe_timeout_s,
            )
            if await self._failed(worker, lost):
                evicted.append((worker, lost))
        for worker in self.pool.probes_due(
            now, self.options.probe_stall_s, self.options.probe_idle_s
        ):
            await self._send(worker, now)
        return evicted

    async def answered(
        self, done: wire_internal.Completion, now: float
    ) -> tuple[Worker, Lost] | None:
        """A worker's answer to a probe; the worker and its work if it is evicted."""
        worker = self.pool.get(done.worker_id)
        if worker is None or worker.probe_id != done.id:
            return None  # late: that probe already failed
        lost = self.pool.probe_answered(done.worker_id, done.id, done.code is None, now)
        if done.code is None:
            return None
        log.warning("worker %s failed a probe: %s", done.worker_id, done.code)
        return (worker, lost) if await self._failed(worker, lost) else None

    async def _failed(self, worker: Worker, lost: Lost | None) -> bool:
        """Count a failed probe; True if it evicted the worker, which is then told to
        abandon its work and make way for a fresh run (`wire_internal.Evict`)."""
        self.metrics.child(self.metrics.probe_failures, worker.endpoint).inc()
        if lost is None:
            return False
        log.error(
            "worker %s failed %d probes in a row; evicted with %d requests",
            worker.worker_id,
            worker.probe_failures,
            len(lost.requests) + len(lost.adopted),
        )
        self.metrics.child(self.metrics.evictions, worker.endpoint).inc()
        evict = wire_internal.Evict(
            endpoint=worker.endpoint,
            worker_id=worker.worker_id,
            started_at=worker.started_at,
            epoch=self.epoch,
        )
        await self.nc.publish(
            self.subjects.evict(worker.endpoint, worker.worker_id),
            wire.encode(evict, PROBE_ENCODING),
            headers={HDR_CONTENT_TYPE: PROBE_ENCODING.content_type},
        )
        return True

    async def _send(self, worker: Worker, now: float) -> None:
        probe_id = next(self._ids)
        body = wire.SubmitRequest(
            id=probe_id, prompt="ping", max_tokens=1, deadline=now + self.options.probe_timeout_s
        )
        item = wire_internal.BatchItem(
            id=probe_id,
            tenant=PROBE_TENANT,
            endpoint=worker.endpoint,
            request=body,
            max_tokens=1,
            enqueued_at=now,
            dispatched_at=now,
            probe=True,
        )
        batch = wire_internal.Batch(
            worker_id=worker.worker_id,
            endpoint=worker.endpoint,
            items=[item],
            sent_at=now,
            epoch=self.epoch,
        )
        self.pool.probe_sent(worker, probe_id, now)
        self.metrics.child(self.metrics.probes, worker.endpoint).inc()
        await self.nc.publish(
            self.subjects.work(worker.endpoint, worker.worker_id),
            wire.encode(batch, PROBE_ENCODING),
            headers={HDR_CONTENT_TYPE: PROBE_ENCODING.content_type},
        )
