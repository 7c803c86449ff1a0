"""The Virtual Token Counter baseline (Sheng et al., "Fairness in Serving Large Language
Models", OSDI 2024), behind `dispatcher.core.policies.contract.Selector`.

Each tenant has a counter of the weighted tokens it was served, divided by its weight:
`INPUT_WEIGHT` per prompt token and `OUTPUT_WEIGHT` per generated token. The next
request comes from the backlogged tenant with the smallest counter; a tenant that
becomes backlogged has its counter lifted to the smallest counter of the backlogged
tenants (to the counter of the last one that left, when none is backlogged), so idle
time earns no credit. A head that does not fit the batch is skipped (work conserving).

Counters are charged a request's prompt when it is dispatched and its output as it is
generated, as in the paper, as far as the caller reports it (`Scheduler.progress`: the
simulator once per engine step, the network dispatcher from each worker heartbeat); what
was not reported is charged on completion.
"""

from __future__ import annotations

import heapq
import itertools

from costmodel.units import Usage
from dispatcher.core.flow import TenantFlow
from dispatcher.core.types import Request

INPUT_WEIGHT = 1.0
OUTPUT_WEIGHT = 2.0


class VtcSelector:
    strict_tiers = False
    blocks_on_misfit = False
    charges_output_as_generated = True

    def __init__(self) -> None:
        self.counters: dict[TenantFlow, float] = {}
        # Counters raised since their last entry, in order (a set's order would vary
        # from run to run and with it the ties).
        self._moved: dict[TenantFlow, None] = {}
        # (counter, tie-break, flow) of backlogged flows; an entry whose counter is no
        # longer the flow's is stale and skipped. `_entry`: each flow's newest entry
        # still in the heap, reused while its counter is the flow's, so a flow never has
        # two valid entries (one would survive `set_aside`).
        self._heap: list[tuple[float, int, TenantFlow]] = []
        self._entry: dict[TenantFlow, tuple[float, int]] = {}
        self._ties = itertools.count()
        self._last_left = 0.0
        self._backlogged: set[TenantFlow] = set()
        self._set_aside: list[TenantFlow] = []

    def activate(self, flow: TenantFlow) -> None:
        if flow.in_ring:
            return
        self.counters[flow] = max(self.counters.get(flow, 0.0), self._floor())
        flow.in_ring = True
        self._backlogged.add(flow)
        self._push(flow)

    def select(self) -> TenantFlow | None:
        for flow in self._moved:
            if flow.in_ring:
                self._push(flow)
        self._moved.clear()
        heap = self._heap
        while heap:
            counter, tie, flow = heap[0]
            if (
                not flow.in_ring
                or self.counters[flow] != counter
                or self._entry.get(flow) != (counter, tie)
            ):
                self._pop()  # stale: its counter moved on, or a newer entry took over
            elif flow.queue.peek() is None:  # emptied by cancels
                self._pop()
                self._leave(flow)
            else:
                return flow
        return None

    def charge(self, flow: TenantFlow, request: Request) -> None:
        self._add(flow, INPUT_WEIGHT * request.input_tokens)
        if flow.queue.peek() is None:
            self._leave(flow)

    def progress(self, flow: TenantFlow, request: Request, tokens: int, cost: float) -> None:
        self.counters[flow] += OUTPUT_WEIGHT * tokens / flow.weight
        self._moved[flow] = None  # pushed once by the next select, not once per token

    def complete(self, flow: TenantFlow, request: Request, usage: Usage, correction: float) -> None:
        unreported = usage.output_tokens - request.output_charged
        self._add(flow, OUTPUT_WEIGHT * max(unreported, 0))

    def refund(self, flow: TenantFlow, request: Request) -> None:
        return None  # the counters keep what they counted: its prompt, its output so far

    def drop_if_empty(self, flow: TenantFlow) -> None:
        if flow.queue.peek() is None:
            self._pop()
            self._leave(flow)

    def set_aside(self, flow: TenantFlow) -> None:
        self._pop()
        self._set_aside.append(flow)

    def restore_set_aside(self) -> None:
        while self._set_aside:
            flow = self._set_aside.pop()
            if flow.in_ring:
                self._push(flow)

    def forget(self, idle: list[TenantFlow], forgive: set[TenantFlow]) -> list[TenantFlow]:
        # The floor never falls, so a counter at or below it will be lifted to the floor
        # on return, as a new flow's would: forgetting it changes nothing.
        floor = self._floor()
        gone = [flow for flow in idle if flow in forgive or self.counters.get(flow, 0.0) <= floor]
        for flow in gone:
            self.counters.pop(flow, None)
            self._entry.pop(flow, None)
        return gone

    def _floor(self) -> float:
        """What a flow that becomes backlogged is lifted to."""
        return (
            min(self.counters[f] for f in self._backlogged) if self._backlogged else self._last_left
        )

    def _add(self, flow: TenantFlow, tokens: float) -> None:
        self.counters[flow] = self.counters.get(flow, 0.0) + tokens / flow.weight
        if flow.in_ring:
            self._push(flow)

    def _leave(self, flow: TenantFlow) -> None:
        flow.in_ring = False
        self._backlogged.discard(flow)
        self._last_left = self.counters[flow]

    def _push(self, flow: TenantFlow) -> None:
        counter = self.counters[flow]
        entry = self._entry.get(flow)
        if entry is not None and entry[0] == counter:
            return  # its entry in the heap is valid as it is
        self._entry[flow] = (counter, next(self._ties))
        heapq.heappush(self._heap, (*self._entry[flow], flow))

    def _pop(self) -> None:
        counter, tie, flow = heapq.heappop(self._heap)
        if self._entry.get(flow) == (counter, tie):
            del self._entry[flow]
