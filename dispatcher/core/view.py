"""The scheduler's read-only queries (status, cancel lookups, intake estimates), kept
apart from the decisions in scheduler.py: `Scheduler` inherits them."""

from __future__ import annotations

from dispatcher.core.endpoint import EndpointQueues
from dispatcher.core.flow import TenantFlow
from dispatcher.core.types import Request

RequestKey = tuple[str, str]  # (tenant, request id): ids are unique per tenant only


class SchedulerView:
    """Reads the state `Scheduler` keeps: every queued request's flow, every running
    request with its flow, each endpoint's queues."""

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
