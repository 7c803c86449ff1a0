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
import time

from costmodel.capacity import DriftMeter
from costmodel.units import ModelProfile
from dispatcher.core.endpoint import EndpointQueues
from dispatcher.core.pool import Worker
from dispatcher.parts import Parts

log = logging.getLogger(__name__)


class DriftWatch:
    def __init__(self, parts: Parts) -> None:
        self.scheduler, self.pool, self.metrics = parts.scheduler, parts.pool, parts.metrics
        # Set while a dispatch pass is due: the workers' room is about to change.
        self.dispatch_due = parts.wake
        self.meters = {name: DriftMeter(parts.options.drift) for name in parts.scheduler.endpoints}

    def tick(self, now: float) -> None:
        """One look at every endpoint at `now` (the scheduler's clock, wall time); the
        meters count on a monotonic clock, which a clock step does not move."""
        if self.dispatch_due.is_set():
            # A completion has just freed room that the pass will fill: an endpoint at
            # its limits would look otherwise. The next look covers this one's time.
            return
        serving: dict[str, list[Worker]] = {name: [] for name in self.meters}
        for worker in self.pool:
            if worker.healthy and worker.endpoint in serving:
                serving[worker.endpoint].append(worker)
        looked_at = time.monotonic()
        for name, meter in self.meters.items():
            queues = self.scheduler.endpoints[name]
            workers = serving[name]
            predicted = sum(advertised_mu_per_s(w, queues.profile) for w in workers)
            meter.observe(
                looked_at, queues.completed_mu, predicted, full=at_limits(queues, workers, now)
            )
            self.metrics.drift.labels(name).set(math.nan if meter.ratio is None else meter.ratio)
            if meter.warning_due(looked_at):
                policy = meter.policy
                log.warning(
                    "endpoint %s: its %d workers complete %.2fx the model units per second "
                    "they advertise (%.4g in all, from profile %r) while full, outside "
                    "[%.2f, %.2f] for %.0f s; routing, the early rejection and autoscaling "
                    "count with the wrong capacity: measure a profile on this traffic "
                    "(`fairq calibrate --out FILE`), point the endpoint's `profile_file` at "
                    "it and restart its workers, which advertise their profile's capacity",
                    name,
                    len(workers),
                    meter.ratio,
                    predicted,
                    queues.profile.name,
                    policy.low,
                    policy.high,
                    looked_at - meter.out_since,
                )


def at_limits(queues: EndpointQueues, workers: list[Worker], now: float) -> bool:
    """Work waits and no serving worker has room for any of it (outside the
    newcomer reserve while it is held): the workers run at their limits. Not while
    one offers less than its size (it drains, or its engine shrank)."""
    if not (queues.backlogged_flows and workers):
        return False
    if any(worker.capacity.sequences < worker.sequences for worker in workers):
        return False
    hold_reserve = queues.reserve_can_matter(now)
    for worker in workers:
        room = worker.free()
        if hold_reserve:
            room = room.minus(queues.reserve(worker.capacity))
        if queues.waiting_that_fits(room):
            return False
    return True


def advertised_mu_per_s(worker: Worker, profile: ModelProfile) -> float:
    """What a worker says it completes, else (unknown or nonsense) its profile's."""
    if 0 < worker.mu_per_s < math.inf:
        return worker.mu_per_s
    return profile.capacity_mu_per_s
