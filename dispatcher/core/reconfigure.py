"""A new configuration applied to a running scheduler (a reload of the config file).

What a reload may change: `tenants`, `tiers` (weights, limits, new tiers, their order)
and `unlisted_tenants`. Every other section describes something the running services
built at start (endpoints and their profiles, the broker's streams, the dispatcher's,
workers' and front's settings): a change there needs a restart, and the reload is
refused whole, naming those sections, with the running configuration left in force.

Applied, nothing queued is lost or reordered: a tenant keeps its flow (its queue, its
running requests, its debt) and only the policy on it changes. A tenant moved to
another tier leaves its old tier and joins the new one, its debt carried across; a new
weight divides its charges from then on; limits are read from the new registry at the
next admission. The queued requests of a tenant the registry now rejects (removed, or
unlisted when unlisted tenants are now rejected) are taken out and returned for the
caller to end; its running ones finish, on a flow kept only for their accounting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from broker_config.config import Config
from broker_config.registry import Registry
from dispatcher.core.flow import TenantFlow
from dispatcher.core.policies.fairq import TierLadder
from dispatcher.core.types import Request

if TYPE_CHECKING:
    from dispatcher.core.scheduler import Scheduler

RELOADABLE = ("tenants", "tiers", "unlisted_tenants")
# How `TenantChanges` names the policy of unlisted tenants (no tenant name has brackets).
UNLISTED = "(unlisted)"


class ReloadError(ValueError):
    """A configuration that cannot replace the running one without a restart."""


def check_reloadable(old: Config, new: Config) -> None:
    """A ReloadError naming the sections of `new` that differ from `old` and that a
    reload cannot change, if any."""
    sections = [
        name
        for name in Config.__struct_fields__
        if name not in RELOADABLE and getattr(old, name) != getattr(new, name)
    ]
    if sections:
        raise ReloadError(
            f"section(s) {', '.join(sections)} changed: a reload may change "
            f"only {', '.join(RELOADABLE)}; restart the dispatchers to apply "
            "the rest (the running configuration stays in force)"
        )


@dataclass(frozen=True, slots=True)
class TenantChanges:
    """Listed tenants a reload adds, removes, or gives another tier, weight or limits
    (through their own entry or their tier's); UNLISTED among `changed` when the policy
    of unlisted tenants changed."""

    added: list[str]
    removed: list[str]
    changed: list[str]


def tenant_changes(old: Registry, new: Registry) -> TenantChanges:
    before, after = old.config.tenants, new.config.tenants
    changed = sorted(
        name for name in before.keys() & after.keys() if old.tenant(name) != new.tenant(name)
    )
    if old.tenant("") != new.tenant(""):  # "" is never listed: the unlisted policy
        changed.append(UNLISTED)
    return TenantChanges(
        sorted(after.keys() - before.keys()), sorted(before.keys() - after.keys()), changed
    )


def reconfigure(scheduler: Scheduler, config: Config, now: float) -> list[Request]:
    """Apply `config` to `scheduler` (see the module doc), or raise ReloadError and
    change nothing. Returns the queued requests of the tenants it no longer admits, in
    their queues' order."""
    check_reloadable(scheduler.config, config)
    registry = Registry(config)
    # Nothing below fails: the swap is whole.
    new_ranks = [registry.tier_rank.get(tier.name) for tier in scheduler.config.tiers]
    lowest = len(config.tiers) - 1
    running: dict[str, dict[TenantFlow, None]] = {}
    for request, flow in scheduler._running.values():
        running.setdefault(request.endpoint, {})[flow] = None
    scheduler.config, scheduler.registry = config, registry
    removed: list[Request] = []
    for endpoint in scheduler.endpoints.values():
        endpoint.clock = now
        moves: list[tuple[TenantFlow, int]] = []
        for tenant, flow in list(endpoint.flows.items()):
            policy = registry.tenant(tenant)
            if policy is None:
                while (request := flow.queue.peek()) is not None:
                    removed.append(scheduler.cancel(tenant, request.id))
                # Kept out of the flows, so no request joins it again (`Scheduler._flow`),
                # until its running requests end.
                del endpoint.flows[tenant]
                moves.append((flow, registry.tier_rank.get(flow.policy.tier, lowest)))
                continue
            if policy.tier != flow.policy.tier:
                moves.append((flow, policy.tier_rank))
            else:
                flow.tier_rank = policy.tier_rank
            flow.policy, flow.weight = policy, policy.weight
        kept = set(endpoint.flows.values())
        moved = {flow for flow, _ in moves}
        # Flows of tenants removed by an earlier reload, still running: nothing queued,
        # held by no selector; their rank only has to stay valid for their accounting.
        earlier = [
            flow
            for flow in running.get(endpoint.name, ())
            if flow not in kept and flow not in moved
        ]
        for flow in earlier:
            flow.tier_rank = registry.tier_rank.get(flow.policy.tier, lowest)
        if isinstance(endpoint.selector, TierLadder):
            endpoint.selector.retier(new_ranks, len(config.tiers), moves)
        else:  # arrival order and VTC read no tier; VTC reads the weight as it charges
            for flow, rank in moves:
                flow.tier_rank = rank
        endpoint.recount(
            [*endpoint.flows.values(), *(f for f, _ in moves if f not in kept), *earlier],
            len(config.tiers),
        )
    return removed
