"""The simulator's replicas over their lives: started, ready after a cold start, drained,
retired; and the autoscaler that decides how many each endpoint runs.

A replica costs GPU time from the moment it is started (its cold start included) until
it is retired: at once if it was still starting, else once a drain leaves it idle. The
simulator asks `FleetScaling.decide` once per `tick_s` and carries out what it says.
"""

from __future__ import annotations

from dataclasses import dataclass

from costmodel.capacity import Autoscaler, ScaleDecision, ScalingPolicy
from costmodel.engine_model import BatchingEngineModel, StepResult
from costmodel.prefix_cache import PrefixCache
from dispatcher.core.endpoint import EndpointQueues
from dispatcher.core.pool import Worker


@dataclass(slots=True, eq=False)
class Replica:
    worker: Worker  # its entry in the pool: capacity, and what was sent and not finished
    engine: BatchingEngineModel
    cache: PrefixCache
    started_at: float = 0.0
    ready: bool = True  # false while it starts (out of the pool's rotation meanwhile)
    draining: bool = False  # takes no new work; retired once idle
    retired_at: float | None = None
    step: StepResult | None = None  # the step under way, applied when it ends

    @property
    def alive(self) -> bool:
        return self.retired_at is None and not self.draining

    @property
    def idle(self) -> bool:
        return self.engine.idle and not self.worker.assigned

    def drain(self, now: float) -> None:
        """No new work; retired at once if still starting or idle, else once idle."""
        self.draining, self.worker.healthy = True, False
        if not self.ready:
            self.retire(now)
        self.retire_if_drained(now)

    def retire_if_drained(self, now: float) -> None:
        if self.draining and self.retired_at is None and self.idle:
            self.retire(now)

    def retire(self, now: float) -> None:
        self.retired_at = now
        self.worker.healthy = False

    def gpu_seconds(self, end: float) -> float:
        return (self.retired_at if self.retired_at is not None else end) - self.started_at


@dataclass(frozen=True, slots=True)
class Resize:
    """What one endpoint's decision asks for: replicas to start, and ones to stop."""

    decision: ScaleDecision
    start: int
    stop: list[Replica]


class FleetScaling:
    """An `Autoscaler` per endpoint, on the replicas' model units per second."""

    def __init__(
        self, policy: ScalingPolicy, mu_per_s: dict[str, float], tick_s: float = 1.0
    ) -> None:
        if not tick_s > 0:
            raise ValueError(f"tick_s must be > 0, got {tick_s!r}")
        self.policy = policy
        self.tick_s = tick_s
        self.scalers = {name: Autoscaler(policy, rate) for name, rate in mu_per_s.items()}
        # (time, endpoint, desired) at every change of an endpoint's count.
        self.decisions: list[tuple[float, str, int]] = []
        self._last: dict[str, int] = {}
        self._counted_mu: dict[str, float] = {}

    def decide(
        self, endpoint: str, replicas: list[Replica], queues: EndpointQueues, now: float
    ) -> Resize:
        """`replicas`: the endpoint's alive ones (serving or starting). As the dispatcher
        does, the autoscaler is fed the model units offered since the last decision."""
        scaler = self.scalers[endpoint]
        scaler.arrived(queues.offered_mu - self._counted_mu.get(endpoint, 0.0), now)
        self._counted_mu[endpoint] = queues.offered_mu
        serving = [r for r in replicas if r.ready]
        decision = scaler.decide(now, len(serving), queues.queued_model_units())
        if self._last.get(endpoint) != decision.desired:
            self._last[endpoint] = decision.desired
            self.decisions.append((now, endpoint, decision.desired))
        extra = len(replicas) - decision.desired
        if extra <= 0:
            return Resize(decision, -extra, [])
        # Starting ones first (newest first: the least GPU time spent), then the least
        # loaded of those serving.
        starting = [r for r in reversed(replicas) if not r.ready]
        by_load = sorted(serving, key=lambda r: len(r.worker.assigned))
        return Resize(decision, 0, (starting + by_load)[:extra])
