"""The Virtual Token Counter baseline (Sheng et al., "Fairness in Serving Large Language
Models", OSDI 2024), behind `dispatcher.core.policies.contract.Selector`.

Each tenant has a counter of the weighted tokens it was served, divided by its weight:
`INPUT_WEIGHT` per prompt token and `OUTPUT_WEIGHT` per generated token. The next
request comes from the backlogged tenant with the smallest counter; a tenant that
becomes backlogged has its counter lifted to the smallest counter of the backlogged
tenants (to the counter of the last one that left, when none is backlogged), so idle
time earns no credit: the standings of standing.py, in tokens. A head that does not fit
the batch is skipped (work conserving).

Counters are charged a request's prompt when it is dispatched and its output as it is
generated, as in the paper, as far as the caller reports it (`Scheduler.progress`: the
simulator once per engine step, the network dispatcher from each worker heartbeat); what
was not reported is charged on completion.
"""

from __future__ import annotations

from costmodel.units import Usage
from dispatcher.core.flow import TenantFlow
from dispatcher.core.policies.standing import StandingHeap
from dispatcher.core.types import Request

INPUT_WEIGHT = 1.0
OUTPUT_WEIGHT = 2.0


class VtcSelector:
    strict_tiers = False
    blocks_on_misfit = False
    charges_output_as_generated = True

    def __init__(self) -> None:
        self.heap = StandingHeap(newcomers_first=False)

    @property
    def counters(self) -> dict[TenantFlow, float]:
        return self.heap.standing

    def at_floor(self, flow: TenantFlow) -> bool:
        return self.heap.at_floor(flow)

    def activate(self, flow: TenantFlow) -> None:
        self.heap.activate(flow)

    def select(self) -> TenantFlow | None:
        return self.heap.select()

    def charge(self, flow: TenantFlow, request: Request) -> None:
        self.heap.add(flow, INPUT_WEIGHT * request.input_tokens)
        self.heap.leave_if_empty(flow)

    def progress(self, flow: TenantFlow, request: Request, tokens: int, cost: float) -> None:
        self.heap.add(flow, OUTPUT_WEIGHT * tokens)

    def complete(self, flow: TenantFlow, request: Request, usage: Usage, correction: float) -> None:
        unreported = usage.output_tokens - request.output_charged
        self.heap.add(flow, OUTPUT_WEIGHT * max(unreported, 0))

    def refund(self, flow: TenantFlow, request: Request) -> None:
        return None  # the counters keep what they counted: its prompt, its output so far

    def drop_if_empty(self, flow: TenantFlow) -> None:
        self.heap.leave_if_empty(flow)

    def set_aside(self, flow: TenantFlow) -> None:
        self.heap.set_aside(flow)

    def restore_set_aside(self) -> None:
        self.heap.restore_set_aside()

    def forget(self, idle: list[TenantFlow], forgive: set[TenantFlow]) -> list[TenantFlow]:
        return self.heap.forget(idle, forgive)
