"""A whole fairq system in the test's process: embedded nats-server, dispatcher,
simulated workers. The data-plane tests build on it: in one process they can reach into
every part (an engine's faults, the dispatcher's scheduler). `fairq up` runs the same
parts as a deployment does, each worker its own process (producers/up.py).

Start order: nats-server -> connection -> dispatcher (provisions the broker) -> workers.
Stop order is the reverse: workers drain first (their in-flight requests complete and
are acked by the still-running dispatcher), then the dispatcher drains, then the
connection and the server stop.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass

import msgspec
import nats
from nats.aio.client import Client as NATS

from broker_config.config import (
    EXAMPLE_ENGINE,
    BrokerSettings,
    Config,
    DispatcherOptions,
    WorkerOptions,
)
from broker_config.kv_writer import KeyValueWriter
from broker_config.server import EmbeddedNatsServer
from costmodel.engine_model import EngineParams, load_engine_params
from dispatcher.admission.kv_store import open_limiter_store
from dispatcher.observe.metrics import DispatcherMetrics
from dispatcher.service import Dispatcher
from workers.service import WorkerService
from workers.sim_engine import SimEngine

# One endpoint `chat`, every tenant admitted, no rate limits, a latency target far off:
# for the tests of delivery (crashes, failovers), where only what arrives counts.
DELIVERY_CONFIG = """
[profiles.p]
name = "p"
alpha = 0.000125
beta = 0.025
capacity_mu_per_s = 30.0
[endpoints.chat]
profile = "p"
cost = "model_units"
latency_target_s = 600.0
[[tiers]]
name = "all"
[unlisted_tenants]
policy = "admit"
tier = "all"
"""


class CountingEngine(SimEngine):
    """A simulated engine that counts, per request, the runs it finished (to tell a
    request run twice to completion from one whose result was delivered twice)."""

    def __init__(self, *args, finished: Counter[str], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.finished = finished

    async def generate(self, request):
        async for delta in super().generate(request):
            if delta.finished:
                self.finished[request.id] += 1
            yield delta


@dataclass(frozen=True, slots=True)
class StackOptions:
    workers: int = 2
    endpoints: tuple[str, ...] | None = None  # default: every endpoint of the config
    time_scale: float = 1.0
    engine: EngineParams | None = None
    redis_url: str | None = None
    # Each replaces the config's own table when given.
    workers_settings: WorkerOptions | None = None
    dispatcher: DispatcherOptions | None = None
    settings: BrokerSettings | None = None


class LocalStack:
    """Dispatcher plus simulated workers on a NATS server (embedded unless a URL is given)."""

    def __init__(
        self,
        config: Config,
        options: StackOptions = StackOptions(),
        *,
        nats_url: str | None = None,
        port: int = 0,
        metrics: DispatcherMetrics | None = None,
    ) -> None:
        replaced = {
            name: value
            for name, value in (
                ("workers", options.workers_settings),
                ("dispatcher", options.dispatcher),
                ("broker", options.settings),
            )
            if value is not None
        }
        self.config = msgspec.structs.replace(config, **replaced)
        self.options = options
        self.nats_url = nats_url
        self.port = port
        self.metrics = metrics or DispatcherMetrics(list(config.endpoints))
        self.dispatcher: Dispatcher | None = None
        self.workers: list[WorkerService] = []
        self.engines: list[SimEngine] = []
        self.server: EmbeddedNatsServer | None = None
        self.nc: NATS | None = None
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> LocalStack:
        stack = self._stack
        try:
            if self.nats_url is None:
                self.server = await stack.enter_async_context(EmbeddedNatsServer(port=self.port))
                self.nats_url = self.server.url
            self.nc = await nats.connect(self.nats_url, name="fairq-local")
            stack.push_async_callback(self.nc.drain)
            limiter = await open_limiter_store(self.options.redis_url, self.nc, self.config)
            stack.push_async_callback(limiter.aclose)
            self.dispatcher = await stack.enter_async_context(
                Dispatcher(self.nc, self.config, limiter=limiter, metrics=self.metrics)
            )
            await self._start_workers()
        except BaseException:
            await stack.aclose()
            raise
        return self

    async def _start_workers(self) -> None:
        endpoints = self.options.endpoints or tuple(self.config.endpoints)
        params = self.options.engine or load_engine_params(EXAMPLE_ENGINE)
        subjects = self.config.subjects
        # Entered before the workers, so it is left after they drain (and store).
        results = await self._stack.enter_async_context(
            KeyValueWriter(self.nc, subjects.results_bucket)
        )
        for endpoint in endpoints:
            profile = self.dispatcher.scheduler.endpoints[endpoint].profile
            for n in range(self.options.workers):
                engine = await self._stack.enter_async_context(
                    SimEngine(params, time_scale=self.options.time_scale, seed=n)
                )
                self.engines.append(engine)
                worker = await self._stack.enter_async_context(
                    WorkerService(
                        self.nc,
                        engine,
                        endpoint=endpoint,
                        worker_id=f"{endpoint}-w{n + 1}",
                        subjects=subjects,
                        results=results,
                        profile=profile,
                        settings=self.config.workers,
                    )
                )
                self.workers.append(worker)

    def counted(self, metric, endpoint: str = "chat") -> float:
        """A counter of the dispatcher's metrics, for one endpoint."""
        return self.metrics.child(metric, endpoint)._value.get()

    async def __aexit__(self, *exc_info: object) -> None:
        await self._stack.aclose()
