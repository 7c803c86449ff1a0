"""Prometheus metrics of a dispatcher, on a registry of its own (no global state), and the
dashboard's figures (`watch`); dispatcher/api/http.py serves both."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dispatcher.core.scheduler import DepthRow
from dispatcher.core.types import Outcome
from dispatcher.observe.dashboard import QueueWatch

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class DispatcherMetrics:
    def __init__(self, endpoints: list[str]) -> None:
        self.registry = CollectorRegistry()
        self.endpoints = list(endpoints)
        # Per-tenant figures for the dashboard page, kept apart from Prometheus's series.
        self.watch = QueueWatch(endpoints)
        self._request_metrics(self.registry)
        self._fleet_metrics(self.registry)
        # Children of the per-request metrics, which are never cleared: `labels()` hashes
        # and takes a lock on every call, a cost on the request path.
        self._children: dict[tuple[object, tuple[str, ...]], object] = {}
        for reply in ("sent", "none"):
            self.child(self.invalid_messages, reply)
        for endpoint in endpoints:  # export every outcome from the start, also at zero
            for outcome in Outcome:
                self.child(self.admissions, endpoint, outcome.value)
            for counter in (
                self.probes,
                self.probe_failures,
                self.evictions,
                self.replacements,
                self.redispatched,
                self.failed_by_lost_worker,
                self.input_tokens,
                self.cached_input_tokens,
            ):
                self.child(counter, endpoint)

    def _request_metrics(self, r: CollectorRegistry) -> None:
        """Queues, admissions and the request path."""
        self.queue_depth = Gauge(
            "fairq_queue_depth",
            "Requests queued in the dispatcher",
            ["endpoint", "tier", "tenant"],
            registry=r,
        )
        self.running = Gauge(
            "fairq_running",
            "Requests running on workers",
            ["endpoint", "tier", "tenant"],
            registry=r,
        )
        self.admissions = Counter(
            "fairq_admissions",
            "Admission decisions by outcome",
            ["endpoint", "outcome"],
            registry=r,
        )
        # Messages that break the contract, by whether an error event could be sent: one
        # with no usable `Fq-Reply` is answered only in the results bucket (status API).
        self.invalid_messages = Counter(
            "fairq_invalid_messages",
            "Submitted messages that break the wire contract",
            ["reply"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "fairq_queue_wait_seconds",
            "Time from intake to dispatch",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "fairq_time_to_first_token_seconds",
            "Time from intake to first token",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.output_tps = Histogram(
            "fairq_output_tokens_per_second",
            "Output tokens per second of a finished request",
            ["endpoint"],
            buckets=(1, 5, 10, 20, 40, 80, 160, 320, 640, 1280),
            registry=r,
        )
        self.input_tokens = Counter(
            "fairq_input_tokens", "Prompt tokens of finished requests", ["endpoint"], registry=r
        )
        self.cached_input_tokens = Counter(
            "fairq_cached_input_tokens",
            "Prompt tokens of finished requests found in the engine's prefix cache",
            ["endpoint"],
            registry=r,
        )

    def _fleet_metrics(self, r: CollectorRegistry) -> None:
        """Workers, probes, lost work, autoscaling and drift."""
        self.worker_utilisation = Gauge(
            "fairq_worker_model_unit_utilisation",
            "Model units in flight over the worker's capacity",
            ["endpoint", "worker"],
            registry=r,
        )
        self.batch_fill = Histogram(
            "fairq_batch_fill_ratio",
            "Sequences sent over the worker's free sequences",
            ["endpoint"],
            buckets=(0.1, 0.25, 0.5, 0.75, 0.9, 1.0),
            registry=r,
        )
        self.probes = Counter(
            "fairq_probes", "Health probes sent to workers", ["endpoint"], registry=r
        )
        self.probe_failures = Counter(
            "fairq_probe_failures",
            "Health probes unanswered in time or failed",
            ["endpoint"],
            registry=r,
        )
        self.evictions = Counter(
            "fairq_worker_evictions",
            "Workers taken out of rotation by failed probes",
            ["endpoint"],
            registry=r,
        )
        self.replacements = Counter(
            "fairq_worker_replacements",
            "New processes of known workers (a restart after a crash, an eviction or a stop)",
            ["endpoint"],
            registry=r,
        )
        self.redispatched = Counter(
            "fairq_redispatched",
            "Requests a lost worker had not streamed from, run again elsewhere",
            ["endpoint"],
            registry=r,
        )
        self.failed_by_lost_worker = Counter(
            "fairq_failed_by_lost_worker",
            "Requests a lost worker had streamed from, ended with a retryable error",
            ["endpoint"],
            registry=r,
        )
        self.desired_replicas = Gauge(
            "fairq_desired_replicas",
            "Workers the autoscaler wants for the endpoint (those serving, if not autoscaled)",
            ["endpoint"],
            registry=r,
        )
        self.serving_replicas = Gauge(
            "fairq_serving_replicas", "Healthy workers", ["endpoint"], registry=r
        )
        self.demand = Gauge(
            "fairq_model_unit_demand",
            "Model units per second arriving, plus the backlog to drain",
            ["endpoint"],
            registry=r,
        )
        self.utilisation = Gauge(
            "fairq_model_unit_utilisation",
            "Demand over the serving workers' model units per second (+Inf with none serving)",
            ["endpoint"],
            registry=r,
        )
        self.drift = Gauge(
            "fairq_model_unit_drift",
            "Model units completed per second while work waited that no "
            "worker had room for, over the serving workers' "
            "capacity_mu_per_s (NaN without a reading)",
            ["endpoint"],
            registry=r,
        )

    def export_depth(self, rows: list[DepthRow]) -> None:
        """Set the queue gauges to `rows`. An endpoint without any row has one sample of
        each at 0 (tier and tenant ""), so that an idle endpoint reads 0, not no data."""
        self.queue_depth.clear()
        self.running.clear()
        idle = set(self.endpoints)
        for row in rows:
            idle.discard(row.endpoint)
            self.queue_depth.labels(row.endpoint, row.tier, row.tenant).set(row.queued)
            self.running.labels(row.endpoint, row.tier, row.tenant).set(row.running)
        for endpoint in idle:
            self.queue_depth.labels(endpoint, "", "").set(0)
            self.running.labels(endpoint, "", "").set(0)

    def child(self, metric: Counter | Histogram, *labels: str):
        """`metric.labels(*labels)`, cached (for metrics whose labels are never cleared)."""
        key = (metric, labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child
