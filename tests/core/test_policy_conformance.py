"""Every policy of `dispatcher.core.policies.POLICIES` through the clauses of the `Selector`
contract (dispatcher/core/policies/contract.py): work conservation and holding, charges,
reset, set-aside and forget. A new policy in the registry is picked up here without a
change.

`World` drives a selector as `Scheduler` does, on flows of its own: costs are in a unit
of 1 per prompt token and `OUTPUT_COST` per output token, VTC's weights, so that a charge
is larger in every policy's measure at once.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import get_args

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from broker_config.registry import Registry
from costmodel.units import Usage
from dispatcher.core.flow import TenantFlow
from dispatcher.core.policies import POLICIES, Policy, selector_for
from dispatcher.core.policies.contract import Selector
from dispatcher.core.types import Request
from tests.core_support import make_config, req

OUTPUT_COST = 2.0
# Two tiers, unequal weights: the ladder and the weights are exercised too.
TENANTS = {"a": ("gold", 1.0), "b": ("gold", 2.0), "c": ("silver", 0.5), "d": ("gold", 1.0)}
PAIR = {"a": ("gold", 1.0), "b": ("gold", 1.0)}
SETTINGS = settings(max_examples=80, deadline=None)

policies = pytest.mark.parametrize("policy", POLICIES)
costs = st.integers(0, 30)


class World:
    """One policy's selector, called as the scheduler calls it, and the flows it serves."""

    def __init__(self, policy: Policy, tenants: dict) -> None:
        config = make_config(tenants=tenants)
        self.registry = Registry(config)
        self.selector: Selector = selector_for(policy, len(config.tiers))
        self.flows: dict[str, TenantFlow] = {}
        self.running: list[tuple[TenantFlow, Request]] = []
        self.aside: set[TenantFlow] = set()
        self.clock = 0.0
        self.served: list[str] = []

    def flow(self, tenant: str) -> TenantFlow:
        if tenant not in self.flows:
            self.flows[tenant] = TenantFlow(self.registry.tenant(tenant))
        return self.flows[tenant]

    def enqueue(self, tenant: str, cost: int) -> None:
        self.clock += 1.0
        request = req(tenant, self.clock, arrival=self.clock, input_tokens=cost)
        request.charged_cost = float(cost)
        flow = self.flow(tenant)
        flow.queue.push(request)
        self.selector.activate(flow)
        assert flow.in_ring, "clause 2: activate holds the flow"

    def dispatch(self) -> TenantFlow | None:
        flow = self.selector.select()
        if flow is not None:
            self._charge(flow)
        return flow

    def serve_all(self) -> list[str]:
        start = len(self.served)
        while self.dispatch() is not None:
            pass
        return self.served[start:]

    def place(self, actions: list[str]) -> None:
        """One `Scheduler.place`: each action on the selected flow, then restore."""
        for action in actions:
            flow = self.selector.select()
            if flow is None:
                break
            if action == "aside":
                if self.selector.blocks_on_misfit:
                    break  # the scheduler stops the batch instead
                self.selector.set_aside(flow)
                self.aside.add(flow)
            elif action == "expire":
                flow.queue.pop()
                self.selector.drop_if_empty(flow)
                assert len(flow.queue) or not flow.in_ring, "clause 2: an empty flow is let go"
            else:
                self._charge(flow)
            self.check_conservation()
        self.selector.restore_set_aside()
        self.aside.clear()

    def progress(self, index: int, tokens: int) -> None:
        flow, request = self.running[index % len(self.running)]
        cost = OUTPUT_COST * tokens if self.selector.charges_output_as_generated else 0.0
        request.output_charged += tokens
        request.charged_cost += cost
        self.selector.progress(flow, request, tokens, cost)

    def complete(self, index: int, extra_output: int = 0, input_delta: int = 0) -> None:
        """Finish a running request with `extra_output` tokens beyond those reported and
        `input_delta` prompt tokens beyond those charged (negative: overcharged)."""
        flow, request = self.running.pop(index % len(self.running))
        flow.running -= 1
        output = request.output_charged + extra_output
        usage = Usage(max(request.input_tokens + input_delta, 0), output, 0.0)
        real = usage.input_tokens + OUTPUT_COST * usage.output_tokens
        self.selector.complete(flow, request, usage, real - request.charged_cost)

    def requeue(self, index: int) -> None:
        flow, request = self.running.pop(index % len(self.running))
        flow.running -= 1
        self.selector.refund(flow, request)
        request.output_charged, request.charged_cost = 0, float(request.input_tokens)
        flow.queue.push(request)
        self.selector.activate(flow)

    def cancel(self, tenant: str) -> None:
        flow = self.flows.get(tenant)
        if flow is not None and (head := flow.queue.peek()) is not None:
            flow.queue.remove(head.id)

    def forget(self, forgive_mask: int = 0) -> list[TenantFlow]:
        idle = [f for f in self.flows.values() if not (len(f.queue) or f.running or f.in_ring)]
        forgive = {flow for i, flow in enumerate(idle) if forgive_mask >> i & 1}
        gone = self.selector.forget(idle, forgive)
        assert forgive <= set(gone) <= set(idle), "clause 6: forgiven <= forgotten <= idle"
        for flow in gone:
            del self.flows[flow.tenant]
        return gone

    def drain(self, extra_outputs: Sequence[int] = ()) -> None:
        """Serve and finish everything, the first requests with `extra_outputs` tokens
        beyond those reported: every flow is then idle."""
        self.serve_all()
        for extra in extra_outputs:
            if self.running:
                self.complete(0, extra)
        while self.running:
            self.complete(0)

    def check_conservation(self) -> None:
        """Clauses 1 and 2, as things stand."""
        flow = self.selector.select()
        waiting = {f for f in self.flows.values() if len(f.queue) and f not in self.aside}
        if flow is None:
            assert not waiting, "clause 1: a flow can send, none was selected"
            held = [f for f in self.flows.values() if f.in_ring and f not in self.aside]
            assert not held, "clause 2: a flow with nothing queued is still held"
        else:
            assert flow in waiting and flow.in_ring, "clause 1: selected a flow that cannot send"

    def apply(self, op: tuple) -> None:
        name, *args = op
        if name in ("progress", "complete", "requeue") and not self.running:
            return
        getattr(self, name)(*args)

    def _charge(self, flow: TenantFlow) -> None:
        request = flow.queue.pop()
        self.selector.charge(flow, request)
        assert len(flow.queue) or not flow.in_ring, "clause 2: an empty flow is let go"
        flow.running += 1
        self.running.append((flow, request))
        self.served.append(flow.tenant)


tenant_names = st.sampled_from(sorted(TENANTS))
# What the scheduler may do between two selections; enqueue twice as likely as the rest,
# so that there is work to act on.
operations = st.one_of(
    st.tuples(st.just("enqueue"), tenant_names, costs),
    st.tuples(st.just("enqueue"), tenant_names, costs),
    st.tuples(st.just("place"), st.lists(st.sampled_from(["charge", "expire", "aside"]))),
    st.tuples(st.just("cancel"), tenant_names),
    st.tuples(st.just("progress"), st.integers(0, 99), st.integers(1, 8)),
    st.tuples(st.just("complete"), st.integers(0, 99), st.integers(0, 9), st.integers(-9, 3)),
    st.tuples(st.just("requeue"), st.integers(0, 99)),
    st.tuples(st.just("forget"), st.integers(0, 15)),
)


def lead(order: list[str], baseline: list[str], tenant: str) -> int:
    """The most requests of `tenant` that `order` served before `baseline` did, over
    their common prefixes (0: never sooner)."""
    most = ahead = 0
    for mine, theirs in zip(order, baseline, strict=True):
        ahead += (mine == tenant) - (theirs == tenant)
        most = max(most, ahead)
    return most


# -- the registry and the shape of the contract --------------------------------------------


def test_every_named_policy_has_a_selector_with_the_whole_contract() -> None:
    assert set(get_args(Policy)) == set(POLICIES)
    methods = {
        name: inspect.signature(member)
        for name, member in vars(Selector).items()
        if inspect.isfunction(member) and not name.startswith("_")
    }
    for policy in POLICIES:
        selector = selector_for(policy, 3)
        for attribute in Selector.__annotations__:
            assert isinstance(getattr(selector, attribute), bool), (policy, attribute)
        for name, signature in methods.items():
            own = inspect.signature(getattr(type(selector), name))
            assert list(own.parameters) == list(signature.parameters), (policy, name)


# -- 1 and 2: work conservation and holding ------------------------------------------------


@policies
@SETTINGS
@given(ops=st.lists(operations, max_size=40))
def test_work_conservation_whatever_the_calls(policy: Policy, ops) -> None:
    world = World(policy, TENANTS)
    for op in ops:
        world.apply(op)
        world.check_conservation()
    world.drain()
    world.check_conservation()
    assert not any(len(flow.queue) or flow.in_ring for flow in world.flows.values())


# -- 3: charges ----------------------------------------------------------------------------


@policies
@SETTINGS
@given(
    a_costs=st.lists(costs, min_size=2, max_size=6),
    b_costs=st.lists(costs, min_size=1, max_size=6),
    outputs=st.lists(st.integers(0, 30), min_size=2, max_size=2).map(sorted),
)
def test_a_charge_never_favours_the_charged_flow(policy: Policy, a_costs, b_costs, outputs) -> None:
    def order_after(output: int) -> list[str]:
        world = World(policy, PAIR)
        for tenant, queued in (("a", a_costs), ("b", b_costs)):
            for cost in queued:
                world.enqueue(tenant, cost)
        world.dispatch()
        world.complete(0, extra_output=output)
        return world.served[:1] + world.serve_all()

    less, more = order_after(outputs[0]), order_after(outputs[1])
    charged = less[0]
    assert more[0] == charged
    assert lead(more, less, charged) == 0, (less, more)


@policies
@SETTINGS
@given(
    a_costs=st.lists(costs, min_size=1, max_size=5),
    b_costs=st.lists(costs, min_size=1, max_size=5),
    dispatched=st.integers(1, 4),
    reported=st.integers(0, 20),
    unreported=st.integers(0, 20),
    input_delta=st.integers(-9, 9),
)
def test_output_weighs_the_same_reported_as_generated_or_at_completion(
    policy: Policy, a_costs, b_costs, dispatched, reported, unreported, input_delta
) -> None:
    def order(report: bool) -> list[str]:
        world = World(policy, PAIR)
        for tenant, queued in (("a", a_costs), ("b", b_costs)):
            for cost in queued:
                world.enqueue(tenant, cost)
        for _ in range(dispatched):
            world.dispatch()
        if report:
            world.progress(0, reported)
        world.complete(0, unreported if report else reported + unreported, input_delta)
        return world.serve_all()

    assert order(True) == order(False)


# -- 4: reset ------------------------------------------------------------------------------


@policies
@settings(max_examples=200, deadline=None)
@given(
    a_cost=st.integers(0, 30),
    others=st.lists(st.integers(1, 32), min_size=3, max_size=8),
    away=st.integers(0, 12),
    input_delta=st.none() | st.integers(-30, 3),
    returning=st.lists(costs, min_size=2, max_size=5),
)
# Credit a kept on leaving (9) or was given back while away (20) would send its second
# request at once.
@example(a_cost=1, others=[4] * 4, away=0, input_delta=None, returning=[10, 0])
@example(a_cost=9, others=[4] * 4, away=0, input_delta=-20, returning=[10, 0])
def test_a_flow_that_leaves_keeps_no_credit(
    policy: Policy, a_cost, others, away, input_delta, returning
) -> None:
    """a leaves, is perhaps overcharged while away, and comes back: served no sooner
    than on a new flow, ties included."""

    def world_after_a_left() -> World:
        world = World(policy, {**PAIR, "c": ("gold", 2.0)})
        for cost in others:
            world.enqueue("b", cost)
            world.enqueue("c", cost)
        world.enqueue("a", a_cost)
        while len(world.flows["a"].queue):
            world.dispatch()
        for _ in range(away):
            world.dispatch()
        if input_delta is not None:  # its request finishes while it is away
            (index,) = [i for i, (flow, _) in enumerate(world.running) if flow.tenant == "a"]
            world.complete(index, 0, input_delta)
        return world

    kept, fresh = world_after_a_left(), world_after_a_left()
    assert not kept.flows["a"].in_ring
    del fresh.flows["a"]  # the tenant comes back on a flow the selector never saw
    for world in (kept, fresh):
        for cost in returning:
            world.enqueue("a", cost)
    after_kept, after_fresh = kept.serve_all(), fresh.serve_all()
    assert lead(after_kept, after_fresh, "a") == 0, (after_kept, after_fresh)


@policies
@SETTINGS
@given(
    b_cost=st.sampled_from([1, 10, 40]),
    served_before=st.lists(st.integers(2, 12), min_size=2, max_size=2),
    joining=st.lists(costs, min_size=1, max_size=6),
)
def test_idle_time_earns_no_credit(policy: Policy, b_cost: int, served_before, joining) -> None:
    """However long b was served before a joined, a is served the same from then on.
    All of b's requests cost the same, so b's standing, against the floor a is lifted
    to, is the same after any number of them."""

    def order_after(dispatched: int) -> list[str]:
        world = World(policy, PAIR)
        for _ in range(max(served_before) + 2 * len(joining) + 2):
            world.enqueue("b", b_cost)
        for _ in range(dispatched):
            world.dispatch()
        for cost in joining:
            world.enqueue("a", cost)
        return [world.dispatch().tenant for _ in range(2 * len(joining) + 2)]

    assert order_after(served_before[0]) == order_after(served_before[1])


# -- 7: the floor -------------------------------------------------------------------------


@policies
@SETTINGS
@given(b_costs=st.lists(st.integers(1, 30), min_size=2, max_size=8), a_cost=st.integers(1, 30))
def test_a_flow_that_joins_stands_at_the_floor_until_charged_above_it(
    policy: Policy, b_costs, a_cost
) -> None:
    world = World(policy, PAIR)
    for cost in b_costs * 4:  # b stays backlogged throughout
        world.enqueue("b", cost)
    world.dispatch()
    for _ in range(2):
        world.enqueue("a", a_cost)
    a, b = world.flows["a"], world.flows["b"]
    assert world.selector.at_floor(a)
    for _ in range(len(b_costs) * 4 + 1):  # b's whole backlog at most, then a's request
        if world.dispatch() is a:
            break
    else:
        pytest.fail("clause 1: a's request was never dispatched")
    # a was charged its prompt; charged output far beyond b's whole backlog, it is above.
    (index,) = [i for i, (flow, _) in enumerate(world.running) if flow is a]
    world.complete(index, extra_output=1000)
    if policy == "fifo":
        assert world.selector.at_floor(a)  # arrival order keeps no standing
    else:
        assert a.in_ring and b.in_ring
        assert not world.selector.at_floor(a) and world.selector.at_floor(b)


# -- 5: set aside --------------------------------------------------------------------------


@policies
@SETTINGS
@given(queued=st.lists(st.tuples(tenant_names, costs), min_size=1, max_size=12))
def test_restoring_with_nothing_set_aside_changes_nothing(policy: Policy, queued) -> None:
    world = World(policy, TENANTS)
    for tenant, cost in queued:
        world.enqueue(tenant, cost)
    before = world.selector.select()
    world.selector.restore_set_aside()
    assert world.selector.select() is before


@policies
@SETTINGS
@given(queued=st.lists(st.tuples(tenant_names, costs), min_size=1, max_size=12))
def test_a_flow_set_aside_waits_for_restore_then_is_back(policy: Policy, queued) -> None:
    world = World(policy, TENANTS)
    if world.selector.blocks_on_misfit:
        pytest.skip(f"{policy} blocks on a misfit: the scheduler never sets a flow aside")
    for tenant, cost in queued:
        world.enqueue(tenant, cost)
    waiting = {flow.tenant: len(flow.queue) for flow in world.flows.values()}

    def sweep() -> list[str]:
        seen = []
        while (flow := world.selector.select()) is not None and len(seen) <= len(waiting):
            world.selector.set_aside(flow)
            seen.append(flow.tenant)
        return seen

    first = sweep()
    assert sorted(first) == sorted(waiting), "each flow that can send, once, then None"
    world.selector.restore_set_aside()
    assert sorted(sweep()) == sorted(waiting), "restore puts back every flow set aside"
    world.selector.restore_set_aside()
    served = world.serve_all()
    assert {tenant: served.count(tenant) for tenant in waiting} == waiting


# -- 6: forget -----------------------------------------------------------------------------


@policies
@SETTINGS
@given(
    queued=st.lists(st.tuples(tenant_names, costs), max_size=12),
    ops=st.lists(operations, max_size=20),
    outputs=st.lists(st.integers(0, 20), max_size=12),
    returning=st.lists(st.tuples(tenant_names, costs), min_size=1, max_size=10),
)
# A charge of 0 leaves VTC's counter as it was: its heap entry must not stay valid
# beside the new one, or `set_aside` leaves the flow selectable.
@example(
    queued=[("a", 0), ("a", 0)],
    ops=[("place", ["charge", "aside"])],
    outputs=[],
    returning=[("a", 0)],
)
def test_forget_drops_only_flows_a_new_one_would_replace(
    policy: Policy, queued, ops, outputs, returning
) -> None:
    def idle_world() -> World:
        world = World(policy, TENANTS)
        for tenant, cost in queued:
            world.enqueue(tenant, cost)
        for op in ops:
            if op[0] != "forget":
                world.apply(op)
        world.drain(outputs)
        return world

    kept, forgetting = idle_world(), idle_world()
    forgetting.forget()
    for world in (kept, forgetting):
        for tenant, cost in returning:
            world.enqueue(tenant, cost)
    assert kept.serve_all() == forgetting.serve_all()


@policies
def test_a_tenant_that_came_once_owing_nothing_is_forgotten(policy: Policy) -> None:
    world = World(policy, PAIR)
    world.enqueue("a", 5)
    world.drain()
    assert [flow.tenant for flow in world.forget()] == ["a"] and not world.flows


@policies
def test_a_forgiven_tenant_is_forgotten_whatever_it_owes(policy: Policy) -> None:
    world = World(policy, PAIR)
    world.enqueue("a", 5)
    world.drain([40])  # 40 output tokens charged after it left: a debt in DRR and VTC
    assert [flow.tenant for flow in world.forget(forgive_mask=1)] == ["a"]
