"""Is each endpoint's profile still right? The core's `DriftMeter` per endpoint, fed every
maintenance tick, exported as `fairq_model_unit_drift{endpoint}` (model units per
second the endpoint's workers complete while full, over what their profile predicts;
NaN while there is no reading), and a warning in the log when it stays outside the band.

A profile that is off misleads everything that counts model units: routing over unequal
workers, the early rejection's expected wait and the autoscaler's replica count. The
warning says so and how to measure a new one.
"""

from __future__ import annotations

import logging
import math

from broker_config.config import DispatcherOptions
from costmodel.capacity import DriftMeter
from dispatcher.core.endpoint import EndpointQueues
from dispatcher.core.scheduler import Scheduler
from dispatcher.core.workers import Worker, WorkerPool
from dispatcher.metrics import DispatcherMetrics

log = logging.getLogger(__name__)


class DriftWatch:
    def __init__(self, options: DispatcherOptions, scheduler: Scheduler, pool: WorkerPool,
                 metrics: DispatcherMetrics) -> None:
        self.scheduler = scheduler
        self.pool = pool
        self.metrics = metrics
        self.meters = {name: DriftMeter(options.drift) for name in scheduler.endpoints}

    def tick(self, now: float) -> None:
        serving: dict[str, list[Worker]] = {name: [] for name in self.meters}
        for worker in self.pool:
            if worker.healthy and worker.endpoint in serving:
                serving[worker.endpoint].append(worker)
        for name, meter in self.meters.items():
            queues = self.scheduler.endpoints[name]
            profile = queues.profile
            workers = serving[name]
            meter.observe(now, queues.completed_mu,
                          sum(w.mu_per_s or profile.capacity_mu_per_s for w in workers),
                          full=self._full(queues, workers))
            self.metrics.drift.labels(name).set(math.nan if meter.ratio is None
                                                else meter.ratio)
            if meter.warning_due(now):
                policy = meter.policy
                log.warning(
                    "endpoint %s: its workers complete %.2fx the model units per second "
                    "their profile %r predicts (capacity_mu_per_s %.4g per worker) while "
                    "full, outside [%.2f, %.2f] for %.0f s; routing, the early rejection "
                    "and autoscaling count with the wrong capacity: measure a profile on "
                    "this traffic (`fairq calibrate --out FILE`, then `profile_file = "
                    "FILE`)", name, meter.ratio, profile.name, profile.capacity_mu_per_s,
                    policy.low, policy.high, policy.warn_after_s)

    @staticmethod
    def _full(queues: EndpointQueues, workers: list[Worker]) -> bool:
        """Work waits and no serving worker has room for any of it: the workers run at
        their limits. (Work also waits while the newcomer reserve keeps room free.)"""
        return bool(queues.backlogged_flows and workers) and not any(
            queues.waiting_that_fits(worker.free()) for worker in workers)
