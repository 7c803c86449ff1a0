"""Stage 2, the tier selector, and the FIFO baseline behind the same interface.

A selector answers one question for batch assembly: which tenant's head request goes
next. `TierLadder` (fairq) asks each tier's DRR ring in strict order, so a lower tier is
served only when no higher tier can dispatch. `FifoSelector` is the naive shared queue:
oldest request first, whoever sent it, used as the baseline in every comparison;
`dispatcher.core.policies.vtc.VtcSelector` is the Virtual Token Counter baseline.
"""

from __future__ import annotations

import heapq
from typing import Protocol

from costmodel.units import Usage
from dispatcher.core.policies.drr import DrrRing, TenantFlow
from dispatcher.core.policies.vtc import VtcSelector
from dispatcher.core.types import Request


class Selector(Protocol):
    # True for the naive queue: a head request that does not fit stops the batch.
    blocks_on_misfit: bool
    # True if the policy charges output as it is generated (`Scheduler.progress`)
    # instead of an estimate at dispatch; the caller may skip reporting it otherwise.
    charges_output_as_generated: bool

    def activate(self, flow: TenantFlow) -> None:
        """`flow` got a request while not scheduled."""

    def select(self) -> TenantFlow | None:
        """The flow whose head request is next, or None when nothing is queued."""

    def charge(self, flow: TenantFlow, request: Request) -> None:
        """`request` was just popped from the selected flow and dispatched."""

    def progress(self, flow: TenantFlow, request: Request, tokens: int) -> None:
        """`request` of `flow` generated `tokens` more output tokens."""

    def complete(self, flow: TenantFlow, request: Request, usage: Usage) -> None:
        """`request` of `flow` finished having used `usage` (after the scheduler's own
        correction of the flow's charge)."""

    def drop_if_empty(self, flow: TenantFlow) -> None:
        """The selected flow lost its head without dispatch (expiry)."""

    def set_aside(self, flow: TenantFlow) -> None:
        """Skip the selected flow until `restore_set_aside` (its head does not fit)."""

    def restore_set_aside(self) -> None: ...

    def forget(self, idle: list[TenantFlow], forgive: set[TenantFlow]) -> list[TenantFlow]:
        """Of flows with nothing queued or running and out of the ring, those that may be
        dropped (a tenant that comes back gets a new flow): the ones whose state would
        change no decision, and those in `forgive` whatever they owe. The selector's
        own state for them is dropped."""


class TierLadder:
    """One DRR ring per tier, asked in strict tier order."""

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

    def drop_if_empty(self, flow: TenantFlow) -> None:
        self.rings[flow.tier_rank].drop_if_empty(flow)

    def progress(self, flow: TenantFlow, request: Request, tokens: int) -> None:
        return None  # the scheduler charges the deficit (it owns it)

    def complete(self, flow: TenantFlow, request: Request, usage: Usage) -> None:
        return None  # DRR's correction is the scheduler's (it owns the deficit)

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
            flow.left_at_round = rings[rank].round
            if len(flow.queue):
                rings[rank].activate(flow)


class FifoSelector:
    """Global arrival order across tenants: a k-way merge of the tenants' queues."""

    blocks_on_misfit = True
    charges_output_as_generated = False

    def __init__(self) -> None:
        # (arrival, counter, flow): the counter is unique, so flows are never compared.
        self._heads: list[tuple[float, int, TenantFlow]] = []

    def activate(self, flow: TenantFlow) -> None:
        if not flow.in_ring:
            flow.in_ring = True
            self._push(flow)

    def select(self) -> TenantFlow | None:
        heads = self._heads
        while heads:
            arrival, rank, flow = heads[0]
            if flow.queue.peek() is None:
                heapq.heappop(heads)
                flow.in_ring = False
            elif flow.queue.head_rank() != (arrival, rank):  # head was cancelled
                heapq.heappop(heads)
                self._push(flow)
            else:
                return flow
        return None

    def charge(self, flow: TenantFlow, request: Request) -> None:
        flow.served_cost += request.charged_cost
        self.drop_if_empty(flow)

    def progress(self, flow: TenantFlow, request: Request, tokens: int) -> None:
        return None

    def complete(self, flow: TenantFlow, request: Request, usage: Usage) -> None:
        return None  # arrival order owes nothing to what was served

    def drop_if_empty(self, flow: TenantFlow) -> None:
        heapq.heappop(self._heads)
        if flow.queue.peek() is None:
            flow.in_ring = False
        else:
            self._push(flow)

    def set_aside(self, flow: TenantFlow) -> None:
        raise AssertionError("the FIFO baseline blocks on a misfit instead")

    def restore_set_aside(self) -> None:
        return None

    def forget(self, idle: list[TenantFlow], forgive: set[TenantFlow]) -> list[TenantFlow]:
        return idle  # arrival order keeps nothing per tenant

    def _push(self, flow: TenantFlow) -> None:
        arrival, rank = flow.queue.head_rank()
        heapq.heappush(self._heads, (arrival, rank, flow))


def selector_for(policy: str, tier_count: int) -> Selector:
    """fairq's tier ladder, or a baseline: "fifo" or "vtc"."""
    if policy == "fairq":
        return TierLadder(tier_count)
    return VtcSelector() if policy == "vtc" else FifoSelector()
