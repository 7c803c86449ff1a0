"""One endpoint's scheduling state: its tenants' flows, what runs, the newcomer reserve.

Pure, like the rest of the core; `Scheduler` keeps one `EndpointQueues` per endpoint.
"""

from __future__ import annotations

from broker_config.config import Endpoint
from costmodel.units import NO_CAPACITY, Capacity, ModelProfile
from dispatcher.core.drr import TenantFlow
from dispatcher.core.tiers import Selector
from dispatcher.core.types import Request


def newcomer_reserve(total: Capacity, fraction: float) -> Capacity:
    """The part of a worker's `total` capacity that only tenants below their fair share
    may use (at least one sequence when `fraction` > 0)."""
    if fraction <= 0:
        return NO_CAPACITY
    reserved = total.scaled(fraction)
    return Capacity(max(1, reserved.sequences), reserved.tokens, reserved.model_units)


def sequences_outside_reserve(sequences: int, fraction: float) -> int:
    """Sequence slots of a worker with `sequences` outside the newcomer reserve: what a
    well-behaved tenant may keep busy without taking the newcomers' room."""
    return sequences - newcomer_reserve(Capacity(sequences, 0, 0.0), fraction).sequences


class EndpointQueues:
    """Everything the scheduler keeps for one endpoint."""

    def __init__(self, name: str, spec: Endpoint, profile: ModelProfile,
                 selector: Selector, reserve_fraction: float, tier_count: int) -> None:
        self.name = name
        self.spec = spec
        self.profile = profile
        self.selector = selector
        self.reserve_fraction = reserve_fraction
        self.flows: dict[str, TenantFlow] = {}
        self.default_total = Capacity(spec.batch.sequences, spec.batch.tokens,
                                      spec.batch.model_units)
        self.capacity_mu_per_s = 0.0  # unknown until workers report: no throttling
        self.running = 0
        # Flows with queued or running work, and the sum of their weights (overall and
        # per tier rank, for the throttle's fair-share estimate).
        self.present_flows = 0
        self.present_weight = 0.0
        self.present_weight_by_rank = [0.0] * tier_count

    def cost(self, input_tokens: int, output_tokens: int, other: float) -> float:
        """A request's cost in the endpoint's DRR unit."""
        mode = self.spec.cost
        if mode == "request":
            return 1.0
        if mode == "token":
            return float(max(input_tokens, 1))
        return self.profile.model_units(input_tokens, output_tokens, other)

    def charge_output(self, flow: TenantFlow, request: Request, tokens: int) -> None:
        """Charge `flow` for `tokens` more output tokens of its running `request`, if the
        policy charges output as it is generated. Only model units price output (request
        and token modes charge at dispatch alone)."""
        if self.spec.cost == "model_units" and self.selector.charges_output_as_generated:
            cost = self.profile.beta * tokens
            flow.deficit -= cost
            flow.served_cost += cost
            request.charged_cost += cost

    def reserve(self, total: Capacity) -> Capacity:
        return newcomer_reserve(total, self.reserve_fraction)

    def below_fair_share(self, flow: TenantFlow) -> bool:
        """Runs fewer sequences than its weighted share of what the endpoint runs now
        (inlined in `Scheduler.next_batch`, the hot path)."""
        return flow.running * self.present_weight < flow.weight * max(self.running, 1)

    def mark_present(self, flow: TenantFlow) -> None:
        """Call before adding work to `flow`."""
        if not len(flow.queue) and not flow.running:
            self.present_weight += flow.weight
            self.present_weight_by_rank[flow.tier_rank] += flow.weight
            self.present_flows += 1

    def mark_absent_if_idle(self, flow: TenantFlow) -> None:
        """Call after taking work from `flow`."""
        if not len(flow.queue) and not flow.running:
            self.present_flows -= 1
            self.present_weight -= flow.weight
            self.present_weight_by_rank[flow.tier_rank] -= flow.weight
            if not self.present_flows:  # so float error cannot build up over a long life
                self.present_weight = 0.0
                self.present_weight_by_rank = [0.0] * len(self.present_weight_by_rank)
