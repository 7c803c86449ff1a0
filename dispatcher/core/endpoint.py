"""One endpoint's scheduling state: its tenants' flows, what runs, the newcomer reserve.

Pure, like the rest of the core; `Scheduler` keeps one `EndpointQueues` per endpoint.
"""

from __future__ import annotations

import math

from broker_config.config import Endpoint
from costmodel.estimate import Ema
from costmodel.units import NO_CAPACITY, Capacity, ModelProfile, Usage
from dispatcher.core.flow import TenantFlow
from dispatcher.core.policies.contract import Selector
from dispatcher.core.types import Request

# An idle tenant's debt (a standing above its tier's floor) is forgotten after this long:
# the state of tenants that come once must not stay for ever. By pausing this long, a
# tenant could be let off the output its requests generated after its queue emptied.
DEBT_MEMORY_S = 600.0
# Weight of one busy worker's report (a heartbeat, a simulated step) in the endpoint's
# occupancy reading: over tens of reports, so one odd batch does not move prices.
OCCUPANCY_SMOOTHING = 0.05
# A worker with less than this share of its KV cache free is full, whatever its slots.
FULL_KV_SHARE = 0.1
# Weight of one completion in a tenant's share of cost charged at dispatch.
PAYMENT_SMOOTHING = 0.2
# A tenant charged at least this share of its requests' cost at dispatch is judged by its
# standing for the newcomer reserve, not by its sequences (`may_use_reserve`).
PAID_AT_DISPATCH = 0.7


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

    def __init__(
        self,
        name: str,
        spec: Endpoint,
        profile: ModelProfile,
        selector: Selector,
        reserve_fraction: float,
        tier_count: int,
    ) -> None:
        self.name = name
        self.spec = spec
        self.profile = profile
        self.selector = selector
        self.reserve_fraction = reserve_fraction
        self.newcomer_window_s = spec.newcomer_window_s
        # When a tenant last came or went (see `reserve_can_matter`), stamped with
        # `clock`: the time of the endpoint's last admission, dispatch or completion.
        self._presence_changed_at = -math.inf
        self.clock = 0.0
        self.flows: dict[str, TenantFlow] = {}
        self.default_total = Capacity(
            spec.batch.sequences, spec.batch.tokens, spec.batch.model_units
        )
        self.capacity_mu_per_s = 0.0  # unknown until workers report: no throttling
        # Sequences a full worker of the endpoint decodes at once: the batch work is
        # priced at (`occupancy`), read from the workers' reports.
        self._occupancy = Ema(OCCUPANCY_SMOOTHING)
        self.startup_wait_s = 0.0  # scaled to zero: the first replica's cold start
        # Since when no worker serves it and none is coming (no autoscaling); None while
        # one serves, or where nobody says (the simulator).
        self.unserved_since: float | None = None
        # Model units of every valid request offered so far, admitted or not (demand).
        self.offered_mu = 0.0
        # Model units of every completed request, priced by the profile from its real
        # usage (what the replicas really got through: the drift reading).
        self.completed_mu = 0.0
        self.running = 0
        # Flows with queued or running work, and the sum of their weights (overall and
        # per tier rank, for the throttle's fair-share estimate); those with work queued.
        self.present_flows = 0
        self.backlogged_flows = 0
        self.present_weight = 0.0
        self.present_weight_by_rank = [0.0] * tier_count

    def set_serving(self, serving: bool, now: float) -> None:
        """Whether a worker serves the endpoint (or autoscaling will start one)."""
        if serving:
            self.unserved_since = None
        elif self.unserved_since is None:
            self.unserved_since = now

    def unserved_for(self, now: float) -> float:
        """How long no worker has served it (0 while one does, or nobody says)."""
        return 0.0 if self.unserved_since is None else now - self.unserved_since

    @property
    def occupancy(self) -> float | None:
        """The batch the endpoint's full workers run at; None (the profile's operating
        batch) until a full worker said."""
        return self._occupancy.value

    def observe_occupancy(self, sequences: int, total: Capacity, free: Capacity) -> None:
        """A worker of capacity `total` with `free` room left runs `sequences` at once.
        Only a full one counts (no sequence slot free beyond the newcomer reserve, or
        under a tenth of its KV cache): the price of work is a full replica's, what
        capacity and the autoscaler's demand are measured in. A half-idle replica's
        small batch would price each token dearer, the autoscaler would ask for more
        replicas, and their smaller batches would raise the price again."""
        full = (
            free.sequences <= self.reserve(total).sequences
            or free.tokens < total.tokens * FULL_KV_SHARE
        )
        if sequences > 0 and full:
            self._occupancy.update(sequences)

    def model_units(
        self, input_tokens: float, output_tokens: float, other: float = 0.0, cached: float = 0.0
    ) -> float:
        """A request's engine time at the batch the endpoint runs at: what admission, the
        autoscaler, routing and drift price work with."""
        return self.profile.model_units(input_tokens, output_tokens, other, cached, self.occupancy)

    def cost(self, input_tokens: int, output_tokens: int, other: float) -> float:
        """A request's cost in the endpoint's DRR unit."""
        mode = self.spec.cost
        if mode == "request":
            return 1.0
        if mode == "token":
            return float(max(input_tokens, 1))
        return self.model_units(input_tokens, output_tokens, other)

    def output_cost(self, tokens: int, occupancy: float | None = None) -> float:
        """What `tokens` more output tokens of a running request add to its charge: their
        engine time at `occupancy` (the sequences its worker runs; the profile's operating
        batch if unknown) if the policy charges output as it is generated, else 0. Only
        model units price output (request and token modes charge at dispatch alone)."""
        if self.spec.cost == "model_units" and self.selector.charges_output_as_generated:
            return self.profile.decode_token_s(occupancy or self.occupancy) * tokens
        return 0.0

    def settled_cost(self, usage: Usage) -> float:
        """A finished request's cost in the DRR unit: in model units of a batched profile,
        the engine time its worker attributed to it, else (a flat profile, or a worker
        that does not measure) its real usage
        priced by the profile at the batch the endpoint runs at."""
        if self.spec.cost == "model_units":
            # A flat profile (no decode curve) prices in its own unit, not engine time.
            if usage.engine_s > 0 and self.profile.batched:
                return usage.engine_s
            return self.model_units(
                usage.input_tokens,
                usage.output_tokens,
                usage.other_units,
                usage.cached_input_tokens,
            )
        return self.cost(usage.input_tokens, usage.output_tokens, usage.other_units)

    def count_completed(self, usage: Usage) -> None:
        """Add a finished request's model units, priced from its real usage (also one
        adopted after a restart, which the scheduler does not track)."""
        self.completed_mu += self.model_units(
            usage.input_tokens, usage.output_tokens, usage.other_units, usage.cached_input_tokens
        )

    def reserve(self, total: Capacity) -> Capacity:
        return newcomer_reserve(total, self.reserve_fraction)

    def reserve_can_matter(self, now: float) -> bool:
        """Could a tenant below its share need the reserve soon? Yes while a present
        tenant has nothing queued (it runs below its share or may, and sends again) or
        while tenants came or went within the window (one may return). Otherwise every
        present tenant is backlogged, and one below its share takes a free slot without
        a reserve: held, the reserve would only sit idle."""
        return (
            self.backlogged_flows < self.present_flows
            or now - self._presence_changed_at <= self.newcomer_window_s
        )

    def expected_wait(self, flow: TenantFlow | None, weight: float, tier_rank: int) -> float:
        """The tenant's queued model units over its weighted share of capacity, after the
        cold start of a first replica if none serves."""
        if flow is None or not len(flow.queue) or self.capacity_mu_per_s <= 0:
            return self.startup_wait_s
        competing = sum(self.present_weight_by_rank[: tier_rank + 1])
        share = self.capacity_mu_per_s * weight / max(competing, weight)
        return self.startup_wait_s + flow.queue.queued_model_units / share

    def queued_model_units(self) -> float:
        """The backlog: model units of every request queued here."""
        return sum(flow.queue.queued_model_units for flow in self.flows.values())

    def waiting_that_fits(self, free: Capacity) -> int:
        """How many of `free`'s sequence slots queued work could fill now, whatever the
        reserve: flows whose next request fits the room, at most the free slots."""
        count = 0
        if free.sequences <= 0 or not self.backlogged_flows:
            return count
        for flow in self.flows.values():
            head = flow.queue.peek()
            if (
                head is not None
                and head.input_tokens + head.max_tokens <= free.tokens
                and head.model_units <= free.model_units
            ):
                count += 1
                if count == free.sequences:
                    break
        return count

    def below_fair_share(self, flow: TenantFlow) -> bool:
        """Runs fewer sequences than its weighted share of what the endpoint runs now
        (inlined in `Scheduler.next_batch`, the hot path)."""
        return flow.running * self.present_weight < flow.weight * max(self.running, 1)

    def may_use_reserve(self, flow: TenantFlow) -> bool:
        """May `flow`, below its share of sequences, take the newcomer reserve? Sequences
        tell a tenant's share only where its requests cost about what they hold a
        sequence for: a tenant of long prompts and short answers runs few sequences
        while taking more engine time than its share, and through the reserve it would
        take more still. Its charges come at dispatch, so its standing is current: it
        may only at the floor (no backlogged tenant charged less), as a newcomer is. A
        tenant paid for mostly as it generates has a standing that lags what it runs:
        its sequences tell. Before its first completion it is taken for the first kind
        (a newcomer is at the floor anyway).
        """
        paid = flow.paid_at_dispatch
        return (paid is not None and paid < PAID_AT_DISPATCH) or self.selector.at_floor(flow)

    def observe_payment(self, flow: TenantFlow, request: Request, settled: float) -> None:
        """A request of `flow` completed at cost `settled`: fold in the share of that
        cost charged at dispatch."""
        if settled <= 0:
            return
        share = min(self.cost(request.input_tokens, 0, request.other_units) / settled, 1.0)
        paid = flow.paid_at_dispatch
        flow.paid_at_dispatch = share if paid is None else paid + PAYMENT_SMOOTHING * (share - paid)

    def mark_present(self, flow: TenantFlow) -> None:
        """Call before queueing work for `flow`."""
        if len(flow.queue):
            return
        self.backlogged_flows += 1
        if not flow.running:
            self._presence_changed_at = self.clock
            self.present_weight += flow.weight
            self.present_weight_by_rank[flow.tier_rank] += flow.weight
            self.present_flows += 1

    def took_queued(self, flow: TenantFlow) -> None:
        """Call after taking a request out of `flow`'s queue."""
        if not len(flow.queue):
            self.backlogged_flows -= 1

    def mark_absent_if_idle(self, flow: TenantFlow) -> None:
        """Call after taking work from `flow`."""
        if not len(flow.queue) and not flow.running:
            flow.idle_since = self.clock
            self._presence_changed_at = self.clock
            self.present_flows -= 1
            self.present_weight -= flow.weight
            self.present_weight_by_rank[flow.tier_rank] -= flow.weight
            if not self.present_flows:  # so float error cannot build up over a long life
                self.present_weight = 0.0
                self.present_weight_by_rank = [0.0] * len(self.present_weight_by_rank)

    def recount(self, flows: list[TenantFlow], tier_count: int) -> None:
        """Sum again who is present and backlogged, over every flow of the endpoint
        (those still running for a removed tenant too), after a reload changed weights
        and tiers."""
        self.present_flows = self.backlogged_flows = 0
        self.present_weight = 0.0
        self.present_weight_by_rank = [0.0] * tier_count
        for flow in flows:
            self.backlogged_flows += bool(len(flow.queue))
            if len(flow.queue) or flow.running:
                self.present_flows += 1
                self.present_weight += flow.weight
                self.present_weight_by_rank[flow.tier_rank] += flow.weight

    def forget_idle(self, now: float) -> int:
        """Drop the flows of tenants with nothing queued or running whose state matters
        no more (the selector says which; a debt matters for `DEBT_MEMORY_S`), so that
        tenants that come once leave nothing behind. Returns how many were dropped."""
        idle = [
            flow
            for flow in self.flows.values()
            if not len(flow.queue) and not flow.running and not flow.in_ring
        ]
        forgive = {flow for flow in idle if now - flow.idle_since >= DEBT_MEMORY_S}
        gone = self.selector.forget(idle, forgive)
        for flow in gone:
            del self.flows[flow.tenant]
        return len(gone)
