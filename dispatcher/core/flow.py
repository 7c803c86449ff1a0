"""A tenant's flow: its state on one endpoint, shared by the scheduler and the selector."""

from __future__ import annotations

from broker_config.registry import TenantPolicy
from dispatcher.core.queues import OrderKey, TenantQueue, priority_order


class TenantFlow:
    """One tenant's state on one endpoint: its queue, its running work, and the fields a
    selector keeps per flow (`dispatcher.core.policies.contract`).

    The scheduler writes `queue`, `running`, `served_cost`, `paid_at_dispatch` and
    `idle_since` (a reload
    also `policy`, `weight` and `tier_rank`). `in_ring` is the selector's: True while it
    holds the flow (it sits here because it is read on every pick).
    """

    __slots__ = (
        "policy",
        "weight",
        "tier_rank",
        "queue",
        "in_ring",
        "running",
        "served_cost",
        "paid_at_dispatch",
        "idle_since",
    )

    def __init__(self, policy: TenantPolicy, order: OrderKey = priority_order) -> None:
        self.policy = policy
        # Copied out of the policy: read on every pick.
        self.weight = policy.weight
        self.tier_rank = policy.tier_rank
        self.queue = TenantQueue(order)
        self.in_ring = False
        self.running = 0
        self.served_cost = 0.0  # what it was charged, in the endpoint's cost unit
        # The share of its requests' cost charged at dispatch (the rest as generated): an
        # average over its completions, None before the first.
        self.paid_at_dispatch: float | None = None
        self.idle_since = 0.0  # when it last had nothing queued or running (or was made)

    @property
    def tenant(self) -> str:
        return self.policy.name

    def __repr__(self) -> str:
        return f"TenantFlow({self.tenant!r}, queued={len(self.queue)}, running={self.running})"
