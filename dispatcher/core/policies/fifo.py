"""The FIFO baseline: one shared queue in arrival order, whoever sent the request.

Used as the baseline in every comparison: it keeps no per-tenant state, charges nothing
and blocks on a head that does not fit, as a naive shared queue does.
"""

from __future__ import annotations

import heapq

from costmodel.units import Usage
from dispatcher.core.flow import TenantFlow
from dispatcher.core.types import Request


class FifoSelector:
    """Global arrival order across tenants: a k-way merge of the tenants' queues."""

    strict_tiers = False
    blocks_on_misfit = True
    charges_output_as_generated = False

    def __init__(self) -> None:
        # (arrival, counter, flow): the counter is unique, so flows are never compared.
        self._heads: list[tuple[float, int, TenantFlow]] = []

    def at_floor(self, flow: TenantFlow) -> bool:
        return True  # arrival order keeps no standing: no flow is ahead of another

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
        self.drop_if_empty(flow)

    def progress(self, flow: TenantFlow, request: Request, tokens: int, cost: float) -> None:
        return None

    def complete(self, flow: TenantFlow, request: Request, usage: Usage, correction: float) -> None:
        return None  # arrival order owes nothing to what was served

    def refund(self, flow: TenantFlow, request: Request) -> None:
        return None

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
