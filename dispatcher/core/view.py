"""The scheduler's read-only queries (status, cancel lookups, intake estimates, the
dashboard's), kept apart from the decisions in scheduler.py: `Scheduler` inherits them."""

from __future__ import annotations

from dataclasses import dataclass

from broker_config.config import Config
from broker_config.registry import Registry
from dispatcher.core.endpoint import EndpointQueues
from dispatcher.core.flow import TenantFlow
from dispatcher.core.types import Request

RequestKey = tuple[str, str]  # (tenant, request id): ids are unique per tenant only


@dataclass(slots=True, frozen=True)
class FlowRow:
    """A tenant's flow on one endpoint, as the dashboard's fairness figures read it."""

    endpoint: str
    tenant: str
    weight: float
    served_cost: float  # charged so far, in the endpoint's cost unit


class SchedulerView:
    """Reads the state `Scheduler` keeps: every queued request's flow, every running
    request with its flow, each endpoint's queues."""

    config: Config
    registry: Registry
    endpoints: dict[str, EndpointQueues]
    _queued: dict[RequestKey, TenantFlow]
    _running: dict[RequestKey, tuple[Request, TenantFlow]]

    def state(self, tenant: str, request_id: str) -> tuple[str, int | None] | None:
        """("queued", position in its tenant's queue), ("running", None), or None."""
        key = (tenant, request_id)
        if key in self._running:
            return "running", None
        flow = self._queued.get(key)
        if flow is None:
            return None
        return "queued", flow.queue.position(request_id)

    def running_request(self, tenant: str, request_id: str) -> Request | None:
        entry = self._running.get((tenant, request_id))
        return entry[0] if entry else None

    def queued_count(self, endpoint: str | None = None) -> int:
        return (
            len(self._queued)
            if endpoint is None
            else sum(len(f.queue) for f in self.endpoints[endpoint].flows.values())
        )

    def tenant_queued(self, tenant: str) -> int:
        """Requests of `tenant` waiting in its queues, over every endpoint."""
        return sum(
            len(endpoint.flows[tenant].queue)
            for endpoint in self.endpoints.values()
            if tenant in endpoint.flows
        )

    def flow(self, endpoint: str, tenant: str) -> TenantFlow | None:
        return self.endpoints[endpoint].flows.get(tenant)

    def flow_rows(self) -> list[FlowRow]:
        """Every flow the scheduler keeps, idle ones too (until forgotten)."""
        return [
            FlowRow(name, flow.tenant, flow.weight, flow.served_cost)
            for name, endpoint in self.endpoints.items()
            for flow in endpoint.flows.values()
        ]

    def cost_units(self) -> dict[str, str]:
        """Each endpoint's DRR cost unit: "request", "token" or "model_units"."""
        return {name: endpoint.spec.cost for name, endpoint in self.endpoints.items()}

    def tier_of(self, tenant: str) -> str | None:
        """The tenant's tier, None for one the registry turns away."""
        policy = self.registry.tenant(tenant)
        return policy.tier if policy is not None else None

    def tier_names(self) -> list[str]:
        """The tiers, highest first."""
        return [tier.name for tier in self.config.tiers]
