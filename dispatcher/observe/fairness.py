"""The dashboard's fairness figures, inside one tier of one endpoint (tiers are strict, so
shares are compared only between tenants of the same tier).

Per tenant: its share of the cost served in the window, next to its weight's share among
the tier's active tenants (queued or running now, or served in the window). Per tier and
endpoint: Jain's index over the ratios (service share / weight share) of the tenants
backlogged for the whole window, both shares taken among those tenants: DRR promises
each of them service in proportion to its weight, so 1.0 is that promise kept and 1/n
is one tenant taking everything.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class Service:
    """A tenant's part in its tier's fairness figures."""

    weight: float
    served: float  # cost served in the window, in the endpoint's cost unit
    present: bool  # queued or running now
    backlogged: bool  # queued at every sample of the window, and now


def shares(tenants: Mapping[str, Service]) -> dict[str, tuple[float | None, float]]:
    """(service share, weight share) of each active tenant of a tier; the service share
    is None while nobody in the tier was served in the window."""
    active = {name: s for name, s in tenants.items() if s.present or s.served > 0}
    weights = sum(s.weight for s in active.values())
    served = sum(s.served for s in active.values())
    if weights <= 0:
        return {}
    return {
        name: (s.served / served if served > 0 else None, s.weight / weights)
        for name, s in active.items()
    }


def ratios(tenants: Iterable[Service]) -> list[float]:
    """Service share over weight share of each tenant backlogged for the whole window,
    among those tenants; none while none of them was served (a higher tier took it all:
    strict tiers, not unfairness inside this one)."""
    backlogged = [s for s in tenants if s.backlogged]
    served = sum(s.served for s in backlogged)
    weights = sum(s.weight for s in backlogged)
    if served <= 0 or weights <= 0:
        return []
    return [(s.served / served) / (s.weight / weights) for s in backlogged]


def jain(values: Sequence[float]) -> float | None:
    """Jain's fairness index: (sum x)^2 / (n * sum x^2), 1.0 when all are equal; None
    without any value above zero."""
    squares = sum(x * x for x in values)
    if not squares:
        return None
    return sum(values) ** 2 / (len(values) * squares)
