"""Autoscaling on model-unit utilisation.

utilisation = demand / (replicas * capacity per replica), both in model units per second.
Outside the band [scale_in_below, scale_out_above] the fleet is resized so that
utilisation lands on `target_utilisation`; inside the band it is left alone, so a
demand that hovers near a threshold does not flap the replica count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Guards ceil() against float noise: 2.0000000000000004 replicas means 2.
_CEIL_SLACK = 1e-9


@dataclass(frozen=True, slots=True)
class ScalingPolicy:
    target_utilisation: float = 0.7
    scale_out_above: float = 0.85
    scale_in_below: float = 0.4
    min_replicas: int = 1
    max_replicas: int = 64

    def __post_init__(self) -> None:
        if not 0 <= self.scale_in_below < self.target_utilisation < self.scale_out_above:
            raise ValueError(
                "scaling policy needs 0 <= scale_in_below < target_utilisation < "
                f"scale_out_above, got {self.scale_in_below!r}, "
                f"{self.target_utilisation!r}, {self.scale_out_above!r}")
        if not math.isfinite(self.scale_out_above):
            raise ValueError(f"scale_out_above must be finite, got {self.scale_out_above!r}")
        if self.min_replicas < 0:
            raise ValueError(f"min_replicas must be >= 0, got {self.min_replicas!r}")
        if self.max_replicas < max(self.min_replicas, 1):
            raise ValueError(f"max_replicas must be >= max(min_replicas, 1), got "
                             f"{self.max_replicas!r} with min_replicas {self.min_replicas!r}")


def utilisation(replicas: int, demand_mu_per_s: float,
                capacity_mu_per_s_per_replica: float) -> float:
    """Demand over fleet capacity; infinite when demand meets a fleet of zero replicas."""
    _check_inputs(replicas, demand_mu_per_s, capacity_mu_per_s_per_replica)
    if replicas == 0:
        return math.inf if demand_mu_per_s > 0 else 0.0
    return demand_mu_per_s / (replicas * capacity_mu_per_s_per_replica)


def desired_replicas(policy: ScalingPolicy, replicas: int, demand_mu_per_s: float,
                     capacity_mu_per_s_per_replica: float) -> int:
    """The replica count to run next, always within [min_replicas, max_replicas]."""
    load = utilisation(replicas, demand_mu_per_s, capacity_mu_per_s_per_replica)
    if policy.scale_in_below <= load <= policy.scale_out_above:
        wanted = replicas
    else:
        wanted = math.ceil(
            demand_mu_per_s / (capacity_mu_per_s_per_replica * policy.target_utilisation)
            - _CEIL_SLACK)
    return min(max(wanted, policy.min_replicas), policy.max_replicas)


def _check_inputs(replicas: int, demand: float, capacity: float) -> None:
    if replicas < 0:
        raise ValueError(f"replicas must be >= 0, got {replicas!r}")
    if not (demand >= 0 and math.isfinite(demand)):
        raise ValueError(f"demand_mu_per_s must be finite and >= 0, got {demand!r}")
    if not (capacity > 0 and math.isfinite(capacity)):
        raise ValueError(f"capacity_mu_per_s_per_replica must be finite and > 0, "
                         f"got {capacity!r}")
