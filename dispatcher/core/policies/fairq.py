"""fairq's policy: stage 2, strict tiers, over stage 3, fair sharing inside each tier.

Stage 3 is Deficit Round Robin in its virtual-time form (standing.py): in each tier the
backlogged tenant charged least per unit of weight sends next. Charges are in the
endpoint's cost unit, as the scheduler prices them: the request at dispatch, its output
as it is generated, the correction to what the worker measured at completion, and a
refund when a request goes back to its queue. A tenant that joins goes first on a tie,
so a sparse tenant's request leaves at once.

A lower tier is served only when no higher tier can dispatch: `TierLadder` asks each
tier's heap in order.
"""

from __future__ import annotations

from costmodel.units import Usage
from dispatcher.core.flow import TenantFlow
from dispatcher.core.policies.standing import StandingHeap
from dispatcher.core.types import Request


class TierLadder:
    """One standing heap per tier, asked in strict tier order."""

    strict_tiers = True
    blocks_on_misfit = False
    charges_output_as_generated = True

    def __init__(self, tier_count: int) -> None:
        self.tiers = [StandingHeap(newcomers_first=True) for _ in range(tier_count)]

    def standing(self, flow: TenantFlow) -> float:
        """What `flow` was charged per unit of weight, on its tier's scale."""
        return self.tiers[flow.tier_rank].standing.get(flow, 0.0)

    def at_floor(self, flow: TenantFlow) -> bool:
        return self.tiers[flow.tier_rank].at_floor(flow)

    def activate(self, flow: TenantFlow) -> None:
        self.tiers[flow.tier_rank].activate(flow)

    def select(self) -> TenantFlow | None:
        for tier in self.tiers:
            if tier:
                flow = tier.select()
                if flow is not None:
                    return flow
        return None

    def charge(self, flow: TenantFlow, request: Request) -> None:
        tier = self.tiers[flow.tier_rank]
        tier.add(flow, request.charged_cost)
        tier.leave_if_empty(flow)

    def progress(self, flow: TenantFlow, request: Request, tokens: int, cost: float) -> None:
        self.tiers[flow.tier_rank].add(flow, cost)

    def complete(self, flow: TenantFlow, request: Request, usage: Usage, correction: float) -> None:
        self.tiers[flow.tier_rank].add(flow, correction)

    def refund(self, flow: TenantFlow, request: Request) -> None:
        self.tiers[flow.tier_rank].add(flow, -request.charged_cost)

    def drop_if_empty(self, flow: TenantFlow) -> None:
        self.tiers[flow.tier_rank].leave_if_empty(flow)

    def set_aside(self, flow: TenantFlow) -> None:
        self.tiers[flow.tier_rank].set_aside(flow)

    def restore_set_aside(self) -> None:
        for tier in self.tiers:
            tier.restore_set_aside()

    def forget(self, idle: list[TenantFlow], forgive: set[TenantFlow]) -> list[TenantFlow]:
        by_tier: dict[int, list[TenantFlow]] = {}
        for flow in idle:
            by_tier.setdefault(flow.tier_rank, []).append(flow)
        return [
            flow
            for rank, flows in by_tier.items()
            for flow in self.tiers[rank].forget(flows, forgive)
        ]

    def retier(
        self, new_ranks: list[int | None], tier_count: int, moves: list[tuple[TenantFlow, int]]
    ) -> None:
        """The tiers changed (a reload). `moves`: the flows whose tenant changed tier or
        left, each with its new rank; they leave their tiers first, each with its debt
        (what it stood above its tier's floor). Then the heap of old rank r becomes the
        heap of rank `new_ranks[r]`, state and all (None: its tier is gone), a new tier
        gets an empty heap, and each moved flow joins its new tier at that tier's floor
        plus its debt, scheduled at once if it has work queued.
        """
        debts = [self.tiers[flow.tier_rank].withdraw(flow) for flow, _ in moves]
        tiers = [StandingHeap(newcomers_first=True) for _ in range(tier_count)]
        for heap, rank in zip(self.tiers, new_ranks):
            if rank is not None:
                tiers[rank] = heap
        self.tiers = tiers
        for (flow, rank), debt in zip(moves, debts):
            flow.tier_rank = rank
            tiers[rank].adopt(flow, debt)
