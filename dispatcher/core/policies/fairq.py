"""fairq's policy: stage 2, strict tiers, over stage 3, a DRR ring per tier (drr.py).

A lower tier is served only when no higher tier can dispatch: `TierLadder` asks each
tier's ring in order and hands every charge of a flow to the DRR arithmetic of drr.py.
"""

from __future__ import annotations

from costmodel.units import Usage
from dispatcher.core.flow import TenantFlow
from dispatcher.core.policies.drr import DrrRing
from dispatcher.core.types import Request


class TierLadder:
    """One DRR ring per tier, asked in strict tier order."""

    strict_tiers = True
    blocks_on_misfit = False
    charges_output_as_generated = True

    def __init__(self, tier_count: int) -> None:
        self.rings = [DrrRing() for _ in range(tier_count)]
        self._set_aside: list[TenantFlow] = []

    def activate(self, flow: TenantFlow) -> None:
        self.rings[flow.tier_rank].activate(flow)

    def select(self) -> TenantFlow | None:
        for ring in self.rings:
            if ring:
                flow = ring.select()
                if flow is not None:
                    return flow
        return None

    def charge(self, flow: TenantFlow, request: Request) -> None:
        self.rings[flow.tier_rank].charge(flow, request)

    def progress(self, flow: TenantFlow, request: Request, tokens: int, cost: float) -> None:
        DrrRing.charge_output(flow, cost)

    def complete(self, flow: TenantFlow, request: Request, usage: Usage, correction: float) -> None:
        DrrRing.correct(flow, correction)

    def refund(self, flow: TenantFlow, request: Request) -> None:
        DrrRing.refund(flow, request.charged_cost)

    def drop_if_empty(self, flow: TenantFlow) -> None:
        self.rings[flow.tier_rank].drop_if_empty(flow)

    def set_aside(self, flow: TenantFlow) -> None:
        self._set_aside.append(self.rings[flow.tier_rank].set_aside())

    def restore_set_aside(self) -> None:
        while self._set_aside:
            flow = self._set_aside.pop()
            self.rings[flow.tier_rank].restore(flow)

    def forget(self, idle: list[TenantFlow], forgive: set[TenantFlow]) -> list[TenantFlow]:
        return [flow for flow in idle if flow in forgive or self.rings[flow.tier_rank].repaid(flow)]

    def retier(
        self, new_ranks: list[int | None], tier_count: int, moves: list[tuple[TenantFlow, int]]
    ) -> None:
        """The tiers changed (a reload). `moves`: the flows whose tenant changed tier or
        left, each with its new rank; they leave their rings first. Then the ring of old
        rank r becomes the ring of rank `new_ranks[r]`, state and all (None: its tier is
        gone), a new tier gets an empty ring, and each moved flow joins its new ring:
        its requests keep their order, its debt is repaid there from now on, and it is
        scheduled at once if it has work queued (a fresh quantum, as any flow that joins).
        """
        for flow, _ in moves:
            if flow.in_ring:
                self.rings[flow.tier_rank].withdraw(flow)
        rings = [DrrRing() for _ in range(tier_count)]
        for ring, rank in zip(self.rings, new_ranks):
            if rank is not None:
                rings[rank] = ring
        self.rings = rings
        for flow, rank in moves:
            flow.tier_rank = rank
            rings[rank].adopt(flow)
