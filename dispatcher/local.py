"""A whole fairq system in one process: embedded nats-server, dispatcher, simulated
workers. `fairq up` runs it; the end-to-end tests and benchmarks build on it.

Start order: nats-server -> connection -> dispatcher (provisions the broker) -> workers.
Stop order is the reverse: workers drain first (their in-flight requests complete and
are acked by the still-running dispatcher), then the dispatcher drains, then the
connection and the server stop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from dataclasses import dataclass
from pathlib import Path

import nats
from nats.aio.client import Client as NATS

from broker_config.kv_writer import KeyValueWriter
from broker_config.server import EmbeddedNatsServer
from broker_config.streams import BrokerSettings
from costmodel.engine_model import EngineParams, load_engine_params
from dispatcher.core.config import EXAMPLE_CONFIG, Config, load_config
from dispatcher.metrics import DispatcherMetrics
from dispatcher.redis_limits import limiter_from_url
from dispatcher.service import Dispatcher, DispatcherOptions
from workers.service import WorkerService
from workers.sim_engine import SimEngine

ENGINE_CONFIG = EXAMPLE_CONFIG.parent / "engine.toml"


@dataclass(frozen=True, slots=True)
class StackOptions:
    workers: int = 2
    endpoints: tuple[str, ...] | None = None  # default: every endpoint of the config
    time_scale: float = 1.0
    engine: EngineParams | None = None
    redis_url: str | None = None
    heartbeat_interval_s: float = 0.5
    drain_timeout_s: float = 30.0  # how long workers let running requests finish on exit
    dispatcher: DispatcherOptions = DispatcherOptions()
    settings: BrokerSettings | None = None


class LocalStack:
    """Dispatcher plus simulated workers on a NATS server (embedded unless a URL is given)."""

    def __init__(self, config: Config, options: StackOptions = StackOptions(), *,
                 nats_url: str | None = None, port: int = 0,
                 metrics: DispatcherMetrics | None = None) -> None:
        self.config = config
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
            settings = self.options.settings or BrokerSettings(prefix=self.config.subject_prefix)
            limiter = limiter_from_url(self.options.redis_url)
            stack.push_async_callback(limiter.aclose)
            self.dispatcher = await stack.enter_async_context(Dispatcher(
                self.nc, self.config, limiter=limiter, options=self.options.dispatcher,
                settings=settings, metrics=self.metrics))
            await self._start_workers(settings)
        except BaseException:
            await stack.aclose()
            raise
        return self

    async def _start_workers(self, settings: BrokerSettings) -> None:
        endpoints = self.options.endpoints or tuple(self.config.endpoints)
        params = self.options.engine or load_engine_params(ENGINE_CONFIG)
        # Entered before the workers, so it is left after they drain (and store).
        results = await self._stack.enter_async_context(
            KeyValueWriter(self.nc, settings.subjects.results_bucket))
        for endpoint in endpoints:
            profile = self.dispatcher.scheduler.endpoints[endpoint].profile
            for n in range(self.options.workers):
                engine = await self._stack.enter_async_context(
                    SimEngine(params, time_scale=self.options.time_scale, seed=n))
                self.engines.append(engine)
                worker = await self._stack.enter_async_context(WorkerService(
                    self.nc, engine, endpoint=endpoint, worker_id=f"{endpoint}-w{n + 1}",
                    subjects=settings.subjects, results=results, profile=profile,
                    heartbeat_interval_s=self.options.heartbeat_interval_s,
                    drain_timeout_s=self.options.drain_timeout_s))
                self.workers.append(worker)

    async def __aexit__(self, *exc_info: object) -> None:
        await self._stack.aclose()


# -- `fairq up` ------------------------------------------------------------------------------


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "up", help="run nats-server, a dispatcher and simulated workers locally",
        description="Start an embedded nats-server, provision it, and run a dispatcher and "
                    "simulated workers with the given config until Ctrl-C.")
    parser.add_argument("--port", type=int, default=0,
                        help="NATS port on 127.0.0.1 (default: a free one, printed as NATS_URL)")
    parser.add_argument("--config", type=Path, default=EXAMPLE_CONFIG)
    parser.add_argument("--workers", type=int, default=2, help="simulated workers per endpoint")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="multiplies simulated engine time (0.1 = ten times faster)")
    parser.add_argument("--redis-url", help="use Redis for rate limits (default: in-process)")
    parser.add_argument("--metrics-port", type=int, default=9464,
                        help="Prometheus /metrics port on 127.0.0.1 (default 9464, or a free "
                             "one if that is taken)")
    parser.set_defaults(run=run_up)


def run_up(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise SystemExit("fairq up: --workers must be at least 1")
    config = load_config(args.config)
    options = StackOptions(workers=args.workers, time_scale=args.time_scale,
                           redis_url=args.redis_url)
    return asyncio.run(_up(config, options, args.port, args.metrics_port))


async def _up(config: Config, options: StackOptions, port: int, metrics_port: int) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    metrics = DispatcherMetrics(list(config.endpoints))
    try:
        bound = metrics.serve(metrics_port)
    except OSError:  # the default port is taken: any free one, printed below
        bound = metrics.serve(0)
    try:
        async with LocalStack(config, options, port=port, metrics=metrics) as stack:
            print(f"NATS_URL={stack.nats_url}", flush=True)
            print(f"METRICS_URL=http://127.0.0.1:{bound}/metrics", flush=True)
            print(f"fairq is up: {len(stack.workers)} simulated workers on "
                  f"{', '.join(config.endpoints)}; Ctrl-C stops", flush=True)
            await stop.wait()
            print("fairq: draining...", flush=True)
    finally:
        metrics.close()
    print("fairq: stopped", flush=True)
    return 0
