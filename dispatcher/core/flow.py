"""A tenant's flow: its state on one endpoint, shared by the scheduler and the selector."""

from __future__ import annotations

from collections import deque

from broker_config.registry import TenantPolicy
from dispatcher.core.queues import OrderKey, TenantQueue, priority_order


class TenantFlow:
    """One tenant's state on one endpoint: its queue, its running work, and the fields a
    selector keeps per flow (`dispatcher.core.policies.contract`).

    The scheduler writes `queue`, `running`, `served_cost` and `idle_since` (a reload
    also `policy`, `weight`, `tier_rank` and `quantum`). `in_ring` is the selector's:
    True while it holds the flow. `deficit`, `granted`, `lane` and `left_at_round` are
    DRR's, written by `dispatcher.core.policies.drr` alone; they sit here rather than in
    the ring because they are read on every pick.
    """

    __slots__ = (
        "policy",
        "weight",
        "tier_rank",
        "queue",
        "quantum",
        "deficit",
        "granted",
        "in_ring",
        "lane",
        "running",
        "served_cost",
        "left_at_round",
        "idle_since",
    )

    def __init__(
        self, policy: TenantPolicy, endpoint_quantum: float, order: OrderKey = priority_order
    ) -> None:
        self.policy = policy
        # Copied out of the policy: read on every pick.
        self.weight = policy.weight
        self.tier_rank = policy.tier_rank
        self.queue = TenantQueue(order)
        self.quantum = endpoint_quantum * policy.weight
        self.deficit = 0.0
        self.granted = False  # has this visit's quantum been added?
        self.in_ring = False
        self.lane: deque[TenantFlow] | None = None  # the ring lane it waits in
        self.running = 0
        self.served_cost = 0.0  # what it was charged, in the endpoint's cost unit
        self.left_at_round = 0.0  # its ring's round when it last left the ring
        self.idle_since = 0.0  # when it last had nothing queued or running (or was made)

    @property
    def tenant(self) -> str:
        return self.policy.name

    def __repr__(self) -> str:
        return (
            f"TenantFlow({self.tenant!r}, queued={len(self.queue)}, "
            f"deficit={self.deficit:.3f}, running={self.running})"
        )
