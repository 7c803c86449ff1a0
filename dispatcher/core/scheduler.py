"""The scheduling core: admission, then tier -> DRR -> priority, repeated per batch.

Synchronous and clock-free: every method takes `now`. The network service and the
simulator drive the same object:

    rejection = scheduler.rejection(request, now)  # validation + throttle, or None
    checks = scheduler.limit_checks(request, now)  # if None: what the limiter checks
    decision = store.apply(checks, now)            # rate limits and quota (any store)
    scheduler.enqueue(request, now)                # if admitted
    batch = scheduler.place(endpoint, room, now)   # room: core.placement.Placement
    scheduler.complete(tenant, request_id, usage, now)

`Scheduler.check` is the first two in one answer; `Scheduler.admit` does the first four
with a synchronous store.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from dataclasses import dataclass

from broker_config.config import Config
from broker_config.registry import Registry
from costmodel.estimate import OutputEstimator
from costmodel.units import Capacity, Usage
from dispatcher.core.endpoint import EndpointQueues
from dispatcher.core.flow import TenantFlow
from dispatcher.core.limits import (
    Check,
    LimiterStore,
    Settlement,
    charged,
    limit_checks,
    request_tokens,
    settlement,
    throttle,
)
from dispatcher.core.placement import BLOCKED, HELD, PLACED, Placement
from dispatcher.core.policies import POLICIES, Policy, selector_for
from dispatcher.core.queues import arrival_order, priority_order
from dispatcher.core.reconfigure import reconfigure
from dispatcher.core.types import Decision, Outcome, Request, Selection
from dispatcher.core.view import RequestKey, SchedulerView

# Flows set aside per worker in one pass before giving up on filling it: bounds the work
# of one `place` when many heads are too large for the room left.
MAX_SET_ASIDE = 64


@dataclass(slots=True, frozen=True)
class DepthRow:
    endpoint: str
    tier: str
    tenant: str
    queued: int
    running: int
    oldest_wait_s: float


@dataclass(slots=True, frozen=True)
class Completed:
    """A finished request, and its token limits settled at its real usage."""

    request: Request
    settlement: Settlement


class Scheduler(SchedulerView):
    def __init__(
        self, config: Config, *, policy: Policy = "fairq", estimator: OutputEstimator | None = None
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; expected one of {POLICIES}")
        self.config = config
        self.policy = policy
        self.registry = Registry(config)
        self.estimator = estimator or OutputEstimator()
        self._order = priority_order if policy == "fairq" else arrival_order
        self.endpoints = {
            name: EndpointQueues(
                name,
                spec,
                self.registry.profile(name),
                selector_for(policy, len(config.tiers)),
                spec.newcomer_reserve if policy == "fairq" else 0.0,
                len(config.tiers),
            )
            for name, spec in config.endpoints.items()
        }
        self._queued: dict[RequestKey, TenantFlow] = {}
        self._running: dict[RequestKey, tuple[Request, TenantFlow]] = {}
        self._deadlines: list[tuple[float, str, str]] = []
        # Requests of tenants a reload removed that came to a queue after it (admitted
        # across it, or put back from a lost worker): the caller ends them.
        self.removed: list[Request] = []

    # -- admission ---------------------------------------------------------------

    def check(
        self, request: Request, now: float, waiting_elsewhere: int = 0, waited_s: float = 0.0
    ) -> Decision | list[Check]:
        """`rejection`, or if there is none the rate-limit and quota checks the store must
        pass for the request to enter (`limit_checks`)."""
        rejection = self.rejection(request, now, waiting_elsewhere, waited_s)
        return rejection if rejection is not None else self.limit_checks(request, now)

    def rejection(
        self, request: Request, now: float, waiting_elsewhere: int = 0, waited_s: float = 0.0
    ) -> Decision | None:
        """Everything admission decides without the limiter store: the rejection, or None
        if the request may enter once the store passes its `limit_checks`.

        `waiting_elsewhere`: the tenant's requests to this endpoint that wait outside the
        scheduler (in the broker), counted against `max_queued`. `waited_s`: how long this
        request already waited in the broker, counted against the latency target.
        """
        endpoint = self.endpoints.get(request.endpoint)
        if endpoint is None:
            return Decision(Outcome.UNKNOWN_ENDPOINT, f"unknown endpoint {request.endpoint!r}")
        policy = self.registry.tenant(request.tenant)
        if policy is None:
            return Decision(Outcome.UNKNOWN_TENANT, f"unknown tenant {request.tenant!r}")
        if request.input_tokens < 0 or request.max_tokens < 1:
            return Decision(Outcome.INVALID, "input_tokens must be >= 0 and max_tokens >= 1")
        if (key := (request.tenant, request.id)) in self._queued or key in self._running:
            return Decision(Outcome.INVALID, f"request {request.id!r} is already queued or running")
        if request.deadline is not None and request.deadline <= now:
            return Decision(Outcome.DEADLINE_EXCEEDED, "the deadline has already passed")
        if (grace := self.config.dispatcher.no_worker_grace_s) is not None and (
            unserved := endpoint.unserved_for(now)
        ) >= grace:
            return Decision(
                Outcome.UNAVAILABLE,
                f"no worker serves endpoint {request.endpoint!r} (none for {unserved:.0f}s)",
                grace,
            )
        request.max_tokens = min(request.max_tokens, endpoint.spec.max_tokens_cap)
        # Offered load, even if turned away below (it scales an idle endpoint back up).
        self._estimate(endpoint, request)
        endpoint.offered_mu += request.model_units
        limits = policy.limits_for(request.endpoint)
        flow = endpoint.flows.get(request.tenant)
        queued = (len(flow.queue) if flow is not None else 0) + waiting_elsewhere
        if limits.max_queued is not None and queued >= limits.max_queued:
            return Decision(
                Outcome.QUEUE_FULL, f"tenant queue is full ({limits.max_queued} requests)", 1.0
            )
        decision = throttle(
            endpoint.expected_wait(flow, policy.weight, policy.tier_rank),
            now,
            endpoint.spec.latency_target_s,
            request.deadline,
            waited_s,
        )
        return None if decision.admitted else decision

    def limit_checks(self, request: Request, now: float) -> list[Check]:
        """The limiter checks `request` must pass at `now` (none for an unknown endpoint
        or a tenant the registry turns away); nothing else is decided or recorded."""
        endpoint = self.endpoints.get(request.endpoint)
        policy = self.registry.tenant(request.tenant)
        if endpoint is None or policy is None:
            return []
        tokens = request_tokens(
            request.input_tokens, min(request.max_tokens, endpoint.spec.max_tokens_cap)
        )
        return limit_checks(
            request.tenant,
            request.endpoint,
            policy.limits_for(request.endpoint),
            tokens,
            now,
            policy.monthly_quota_tokens,
        )

    def admit(
        self, request: Request, now: float, store: LimiterStore, waited_s: float = 0.0
    ) -> Decision:
        """check -> store.apply -> enqueue, for callers with a synchronous store."""
        result = self.check(request, now, waited_s=waited_s)
        if isinstance(result, Decision):
            return result
        decision = store.apply(result, now)
        if decision.admitted:
            request.charges = charged(result)
            self.enqueue(request, now)
        return decision

    def enqueue(self, request: Request, now: float) -> None:
        """Queue a request that passed `check` and the limiter store."""
        endpoint = self.endpoints[request.endpoint]
        flow = self._flow(endpoint, request.tenant)
        if flow is None:  # its tenant was removed by a reload since `check`
            self.removed.append(request)
            return
        self._estimate(endpoint, request)
        endpoint.clock = now
        endpoint.mark_present(flow)
        flow.queue.push(request)
        self._queued[(request.tenant, request.id)] = flow
        endpoint.selector.activate(flow)
        if request.deadline is not None:
            heapq.heappush(self._deadlines, (request.deadline, request.tenant, request.id))
            if len(self._deadlines) > 2 * len(self._queued) + 1024:
                self._deadlines = [d for d in self._deadlines if d[1:] in self._queued]
                heapq.heapify(self._deadlines)

    # -- dispatch ----------------------------------------------------------------

    def next_batch(
        self,
        endpoint_name: str,
        free: Capacity,
        now: float,
        total: Capacity | None = None,
        reserve_in_use: int = 0,
    ) -> Selection:
        """Fill one worker's `free` room with the next requests (`place` on a single
        worker). `total` is the worker's whole capacity (default: the endpoint's batch
        setting); `reserve_in_use`, its reserve's sequences running requests hold."""
        total = total or self.endpoints[endpoint_name].default_total
        return self.place(endpoint_name, Placement.single(free, total, reserve_in_use), now)

    def place(
        self, endpoint_name: str, room: Placement, now: float, on_the_way: Iterable[str] = ()
    ) -> Selection:
        """Place the next requests, in tier -> DRR -> priority order, on the workers of
        `room`, until none has room; `room` records which went where.

        Each worker's whole capacity sizes its newcomer reserve and recognises a request
        larger than a whole batch, which is sent alone once a worker is idle rather than
        starved. `on_the_way`: tenants with requests to this endpoint not queued here yet
        (in the broker, being read or admitted).

        Tiers are strict wherever work waits: once a tier has work the room must be kept
        for (queued here or on its way, and not placed in this pass), lower tiers may
        use only the newcomer reserve (docs/architecture.md, "Strict tiers").
        """
        endpoint = self.endpoints[endpoint_name]
        selector = endpoint.selector
        endpoint.clock = now
        room.set_reserves(endpoint.reserve)
        batch = Selection()
        set_aside, set_aside_limit = 0, MAX_SET_ASIDE * len(room.slots)
        kept_for = self._rank_on_the_way(on_the_way) if selector.strict_tiers else math.inf
        # A flow held back by the reserve (at or above its share) can fall below its
        # share when another flow starts a request: it gets another look.
        held_by_reserve = recheck = lifted = False
        while room.has_room():
            flow = selector.select()
            if flow is None:
                # Only the reserve holds work back and no newcomer is likely: lift it.
                lift = not (recheck or lifted) and held_by_reserve
                lift = lift and not endpoint.reserve_can_matter(now)
                if not (recheck or lift):
                    break
                if lift:
                    room.lift_reserves()
                    set_aside, lifted = 0, True
                selector.restore_set_aside()
                held_by_reserve = recheck = False
                continue
            request = flow.queue.peek()
            if request.deadline is not None and request.deadline <= now:
                flow.queue.pop()
                selector.drop_if_empty(flow)
                self._forget_queued(endpoint, flow, request)
                batch.expired.append(request)
                continue
            below_share = flow.running * endpoint.present_weight < flow.weight * max(
                endpoint.running, 1
            )
            confined = flow.tier_rank > kept_for
            may_use_reserve = below_share and endpoint.may_use_reserve(flow)
            outcome = room.place(request, respect_reserve=not may_use_reserve, confined=confined)
            if outcome == BLOCKED:
                break  # hold the workers until one is idle for an oversized head
            if outcome != PLACED:
                held_by_reserve = held_by_reserve or (outcome == HELD and not confined)
                if selector.blocks_on_misfit:
                    break
                if selector.strict_tiers:  # what frees is its, not a lower tier's
                    kept_for = min(kept_for, flow.tier_rank)
                selector.set_aside(flow)
                set_aside += 1
                if set_aside >= set_aside_limit:
                    break
                continue
            flow.queue.pop()
            endpoint.took_queued(flow)
            flow.served_cost += request.charged_cost
            selector.charge(flow, request)
            request.expedited = below_share
            self._start(endpoint, flow, request, now)
            batch.requests.append(request)
            recheck = recheck or held_by_reserve
        selector.restore_set_aside()
        return batch

    # -- completion, cancellation, expiry -----------------------------------------

    def complete(self, tenant: str, request_id: str, usage: Usage, now: float) -> Completed | None:
        """Settle a finished request: correct its tenant's charge with real usage."""
        entry = self._running.pop((tenant, request_id), None)
        if entry is None:
            return None
        request, flow = entry
        endpoint = self.endpoints[request.endpoint]
        endpoint.clock = now
        endpoint.count_completed(usage)
        settled = endpoint.settled_cost(usage)
        correction = settled - request.charged_cost
        endpoint.observe_payment(flow, request, settled)
        flow.served_cost += correction
        endpoint.selector.complete(flow, request, usage, correction)
        self._stop(endpoint, flow, request)
        self.estimator.observe((tenant, request.endpoint), usage.output_tokens, request.max_tokens)
        return Completed(
            request,
            settlement(request.charges, request_tokens(usage.input_tokens, usage.output_tokens)),
        )

    def progress(
        self, reports: Iterable[tuple[RequestKey, int]], occupancy: float | None = None
    ) -> None:
        """Running requests' output so far, (key, output tokens), from one worker's
        heartbeat or one simulated step: a tenant pays for output as it is served, not
        for an estimate up front, at the engine time of a decode token at `occupancy`
        (the sequences that worker runs). A count at or below the last changes nothing."""
        for key, generated in reports:
            entry = self._running.get(key)
            if entry is None or generated <= entry[0].output_charged:
                continue
            request, flow = entry
            endpoint = self.endpoints[request.endpoint]
            tokens = generated - request.output_charged
            request.output_charged = generated
            cost = endpoint.output_cost(tokens, occupancy)
            request.charged_cost += cost
            flow.served_cost += cost
            endpoint.selector.progress(flow, request, tokens, cost)

    def requeue(self, tenant: str, request_id: str) -> Request | None:
        """Put a running request back in its queue (its worker failed); it keeps its
        place by arrival and its tenant's policy gives back what it charged for it
        (`Selector.refund`)."""
        entry = self._running.pop((tenant, request_id), None)
        if entry is None:
            return None
        request, flow = entry
        endpoint = self.endpoints[request.endpoint]
        endpoint.selector.refund(flow, request)
        flow.served_cost -= request.charged_cost
        self._stop(endpoint, flow, request)
        request.dispatched_at, request.output_charged = None, 0
        if endpoint.flows.get(tenant) is not flow:  # a reload removed its tenant (and may
            flow = self._flow(endpoint, tenant)  # have added it back: a new flow)
            if flow is None:
                self.removed.append(request)
                return request
        self._estimate(endpoint, request)
        endpoint.mark_present(flow)
        flow.queue.push(request)
        self._queued[(tenant, request_id)] = flow
        endpoint.selector.activate(flow)
        return request

    def cancel(self, tenant: str, request_id: str) -> Request | None:
        """Remove a queued request. A running one is the service's to abort."""
        flow = self._queued.get((tenant, request_id))
        if flow is None:
            return None
        request = flow.queue.remove(request_id)
        self._forget_queued(self.endpoints[request.endpoint], flow, request)
        return request

    def expire(self, now: float) -> list[Request]:
        """Drop queued requests whose deadline has passed (they get deadline_exceeded).
        Called every tick: it also keeps each endpoint's clock, which stamps when a
        tenant comes or goes (cancels included), within a tick of `now`."""
        for endpoint in self.endpoints.values():
            endpoint.clock = now
        expired = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, tenant, request_id = heapq.heappop(self._deadlines)
            request = self.cancel(tenant, request_id)
            if request is not None:
                expired.append(request)
        return expired

    # -- observation ---------------------------------------------------------------

    def depth(self, now: float) -> list[DepthRow]:
        rows = []
        for endpoint in self.endpoints.values():
            for flow in endpoint.flows.values():
                if not len(flow.queue) and not flow.running:
                    continue
                oldest = flow.queue.oldest_arrival()
                rows.append(
                    DepthRow(
                        endpoint.name,
                        flow.policy.tier,
                        flow.tenant,
                        len(flow.queue),
                        flow.running,
                        0.0 if oldest is None else max(0.0, now - oldest),
                    )
                )
        return rows

    def observe_occupancy(
        self, endpoint: str, sequences: int, total: Capacity, free: Capacity
    ) -> None:
        """One worker of `endpoint` (capacity `total`, `free` left) runs `sequences` at
        once (a heartbeat, a simulated step): the batch work is priced at, if full."""
        self.endpoints[endpoint].observe_occupancy(sequences, total, free)

    def set_capacity(self, endpoint: str, mu_per_s: float, startup_wait_s: float = 0.0) -> None:
        """Model units per second the endpoint's workers complete, and how long a request
        waits for the first of them to start (scaled to zero), for the throttle."""
        queues = self.endpoints[endpoint]
        queues.capacity_mu_per_s, queues.startup_wait_s = mu_per_s, startup_wait_s

    def reconfigure(self, config: Config, now: float) -> list[Request]:
        """Swap the configuration at run time (dispatcher/core/reconfigure.py); returns
        the queued requests of the tenants it removed, for the caller to end."""
        return reconfigure(self, config, now)

    # -- internals -------------------------------------------------------------------

    def _rank_on_the_way(self, tenants: Iterable[str]) -> float:
        """The highest tier (lowest rank) of `tenants`, inf if none is known."""
        ranks = [
            policy.tier_rank
            for tenant in tenants
            if (policy := self.registry.tenant(tenant)) is not None
        ]
        return min(ranks, default=math.inf)

    def _flow(self, endpoint: EndpointQueues, tenant: str) -> TenantFlow | None:
        """The tenant's flow, made if need be; None for a tenant the registry rejects."""
        flow = endpoint.flows.get(tenant)
        if flow is None:
            policy = self.registry.tenant(tenant)
            if policy is None:
                return None
            flow = TenantFlow(policy, self._order)
            flow.idle_since = endpoint.clock
            endpoint.flows[tenant] = flow
        return flow

    def _estimate(self, endpoint: EndpointQueues, request: Request) -> None:
        output = self.estimator.estimate((request.tenant, request.endpoint), request.max_tokens)
        request.model_units = endpoint.model_units(
            request.input_tokens, output, request.other_units
        )
        # fairq charges output as it is generated (`progress`): an estimate charged up
        # front and corrected minutes later on a busy engine skews every turn meanwhile.
        charged_output = 0 if endpoint.selector.charges_output_as_generated else output
        request.charged_cost = endpoint.cost(
            request.input_tokens, charged_output, request.other_units
        )

    def _start(
        self, endpoint: EndpointQueues, flow: TenantFlow, request: Request, now: float
    ) -> None:
        del self._queued[(request.tenant, request.id)]
        request.dispatched_at = now
        self._running[(request.tenant, request.id)] = (request, flow)
        flow.running += 1
        endpoint.running += 1

    def _stop(self, endpoint: EndpointQueues, flow: TenantFlow, request: Request) -> None:
        flow.running -= 1
        endpoint.running -= 1
        endpoint.mark_absent_if_idle(flow)

    def _forget_queued(self, endpoint: EndpointQueues, flow: TenantFlow, request: Request) -> None:
        del self._queued[(request.tenant, request.id)]
        endpoint.took_queued(flow)
        endpoint.mark_absent_if_idle(flow)
