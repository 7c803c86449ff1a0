"""The dispatcher's autoscaling decisions, for the endpoints whose config asks for them.

Every maintenance tick, per autoscaled endpoint, the core's `Autoscaler` is fed the
model units offered since the last tick (the scheduler's running total of valid
requests, admitted or turned away) and decides from the healthy workers and the queued backlog. The
decision is exported as gauges (`fairq_desired_replicas`, `fairq_serving_replicas`,
`fairq_model_unit_demand`, `fairq_model_unit_utilisation`: what a KEDA or HPA scaler
reads) and published as a `ScaleEvent` on `<prefix>.int.scale.<endpoint>` whenever the
desired count changes, and every `REPUBLISH_S` besides, so a supervisor that starts
late, or missed one (core NATS is at most once), learns it. An endpoint that is not
autoscaled exports its healthy workers as both `fairq_serving_replicas` and
`fairq_desired_replicas`.
"""

from __future__ import annotations

import math

from broker_config import wire, wire_internal
from costmodel.capacity import Autoscaler
from dispatcher.parts import Parts

REPUBLISH_S = 5.0


class Autoscaling:
    def __init__(self, parts: Parts) -> None:
        self.nc, self.subjects, self.scheduler = parts.nc, parts.subjects, parts.scheduler
        self.pool, self.metrics = parts.pool, parts.metrics
        scheduler = parts.scheduler
        self.scalers = {
            name: Autoscaler(spec.autoscale, scheduler.endpoints[name].profile.capacity_mu_per_s)
            for name, spec in parts.config.endpoints.items()
            if spec.autoscale is not None
        }
        self._counted_mu = dict.fromkeys(self.scalers, 0.0)
        self._published: dict[str, tuple[int, float]] = {}  # endpoint -> (desired, at)
        for name, scaler in self.scalers.items():
            # Until a worker reports, a request waits for one to start.
            scheduler.set_capacity(name, 0.0, startup_wait_s=scaler.policy.cold_start_s)

    async def tick(self, now: float) -> None:
        for name in self.scheduler.endpoints.keys() - self.scalers.keys():
            # Not autoscaled: it wants the workers it has (an HPA reading it keeps them).
            serving = self.pool.healthy_count(name)
            self.metrics.serving_replicas.labels(name).set(serving)
            self.metrics.desired_replicas.labels(name).set(serving)
        for name, scaler in self.scalers.items():
            queues = self.scheduler.endpoints[name]
            scaler.arrived(queues.offered_mu - self._counted_mu[name], now)
            self._counted_mu[name] = queues.offered_mu
            serving = self.pool.healthy_count(name)
            decision = scaler.decide(now, serving, queues.queued_model_units())
            for gauge, value in (
                (self.metrics.desired_replicas, decision.desired),
                (self.metrics.serving_replicas, serving),
                (self.metrics.demand, decision.demand_mu_per_s),
                (self.metrics.utilisation, decision.utilisation),
            ):
                gauge.labels(name).set(value)
            last = self._published.get(name)
            if last is None or last[0] != decision.desired or now - last[1] >= REPUBLISH_S:
                self._published[name] = (decision.desired, now)
                event = wire_internal.ScaleEvent(
                    endpoint=name,
                    desired=decision.desired,
                    serving=serving,
                    demand_mu_per_s=decision.demand_mu_per_s,
                    sent_at=now,
                    utilisation=(
                        decision.utilisation if math.isfinite(decision.utilisation) else None
                    ),
                )
                await self.nc.publish(self.subjects.scale(name), wire.encode(event))
