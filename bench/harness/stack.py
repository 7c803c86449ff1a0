"""The scenario harness: a complete system for one benchmark run, every part in its own
process, and what a scenario does with it.

    spec = StackSpec(mode="fairq", workers=2, time_scale=0.1)
    async with Stack(spec, log_dir) as stack:
        result = await stack.replay(arrivals, timeout_s=600)  # or stack.fire(...)
        async with stack.connect() as nc:
            ...  # anything else on the wire contract, on a connection drained at exit

Start: an embedded nats-server (own store directory, a free port), then either

- `fairq`: a dispatcher (`python -m dispatcher`) and N simulated workers
  (`python -m workers --engine sim`; N = 0: the dispatcher alone, for a benchmark that
  runs its worker in its own process), or
- `naive`: no dispatcher; the broker is provisioned here and N naive workers
  (`python -m bench.harness.naive_worker`, the real worker service fed from one shared FIFO
  pull consumer) run the same engine with the same settings.

The stack is ready once every worker has sent a heartbeat and one warm-up request has
come back through the whole path (without workers: once the dispatcher answers).
Separate processes matter: the load generator in this process must not share an
interpreter (and its GIL) with the dispatcher or the workers.

Stop: workers first (SIGTERM: they drain), then the dispatcher, then the server. Each
process writes its output to `<log_dir>/<name>.log`; a process that dies early fails
the run with the end of its log.

Runs without a dispatcher or workers (the raw JetStream path) use `connected` and
`provisioned`: a client that drains at exit, and fairq's streams on a fresh server.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Self

import msgspec
import nats
import nats.errors
from nats.aio.client import Client as NATS

from bench.harness.firehose import fire_measured
from bench.harness.measured import Arrival, Measured, Replay, to_measure
from bench.harness.paths import REPO
from bench.harness.recorder import WellBehaved, replay
from broker_config.config import EXAMPLE_CONFIG, BrokerSettings, Config, Tenant, load_config
from broker_config.server import EmbeddedNatsServer
from broker_config.streams import provision
from broker_config.wire_internal import HEARTBEAT
from costmodel.engine_model import EngineParams
from dispatcher.core.endpoint import sequences_outside_reserve
from dispatcher.core.limits import scheduling_only
from producers.client import Client
from producers.errors import FairqTimeout, NoDispatcher
from producers.supervisor import Child, ChildExited

ENDPOINT = "chat"
WARMUP_TENANT = "warmup"

Mode = Literal["fairq", "naive"]

# Bounds on bring-up and tear-down, so a broken stack fails with a message, never hangs.
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
_POLL_S = 0.1
# Publishes awaiting their ack at a time, for `Stack.fire`: the firehose's rate scenarios.
FIRE_IN_FLIGHT = 512


class StackError(RuntimeError):
    """A stack that could not start, or a process of it that died."""


@contextlib.asynccontextmanager
async def connected(url: str | list[str], **options: Any) -> AsyncIterator[NATS]:
    """A client that drains on exit (nats-py's own context manager closes without it);
    `options` go to `nats.connect`."""
    nc = await nats.connect(url, **({"connect_timeout": 5} | options))
    try:
        yield nc
    finally:
        await nc.drain()


@contextlib.asynccontextmanager
async def provisioned(
    settings: BrokerSettings | None = None,
) -> AsyncIterator[tuple[EmbeddedNatsServer, NATS]]:
    """A fresh nats-server with fairq's streams and buckets, as the dispatcher provisions
    them, and a client on it: the broker of a run without fairq (the raw path)."""
    async with EmbeddedNatsServer() as server, connected(server.url) as nc:
        await provision(nc.jetstream(), settings or BrokerSettings())
        yield server, nc


def benchmark_config(weights: Mapping[str, float] | None = None) -> Config:
    """configs/example.toml with admission out of the way (`scheduling_only`: no rate
    limits, quotas or latency throttle; one tier, weight 1), so fairq and the naive queue
    run exactly the same requests and only the order differs. `weights` lists tenants
    explicitly in that tier with their weights (others are admitted with weight 1)."""
    config = scheduling_only(load_config(EXAMPLE_CONFIG))
    if not weights:
        return config
    tier = config.tiers[0].name
    tenants = {name: Tenant(tier=tier, weight=weight) for name, weight in weights.items()}
    return msgspec.structs.replace(config, tenants=tenants)


@dataclass(frozen=True, slots=True)
class StackSpec:
    """What one run brings up. Every worker's engine gets the same seed, so a request's
    simulated output length depends on its id only, not on the worker or the mode."""

    mode: Mode
    workers: int = 2
    # Multiplies simulated engine time: 0.1 runs ten times faster than the engine model;
    # 0 is an engine with no compute time.
    time_scale: float = 0.1
    engine: EngineParams = field(default_factory=EngineParams)
    config: Config = field(default_factory=benchmark_config)
    endpoint: str = ENDPOINT
    heartbeat_interval_s: float = 0.5
    # Extra flags for `python -m dispatcher` (fairq mode), e.g. ("--tenant-window", "64").
    dispatcher_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.workers < (1 if self.mode == "naive" else 0):
            raise ValueError(f"workers must be >= 1 (fairq: >= 0), got {self.workers!r}")
        if not self.time_scale >= 0:
            raise ValueError(f"time_scale must be >= 0, got {self.time_scale!r}")
        if self.endpoint not in self.config.endpoints:
            raise ValueError(f"endpoint {self.endpoint!r} is not in the config")

    def slots_outside_reserve(self) -> int:
        """Sequence slots of every worker outside the endpoint's newcomer reserve: what a
        well-behaved tenant may keep busy without taking the newcomers' room."""
        fraction = self.config.endpoints[self.endpoint].newcomer_reserve
        return self.workers * sequences_outside_reserve(self.engine.max_sequences, fraction)

    def describe(self) -> dict[str, object]:
        """The spec as plain data, for result files."""
        return {
            "mode": self.mode,
            "workers": self.workers,
            "time_scale": self.time_scale,
            "engine": msgspec.to_builtins(self.engine),
            "endpoint": self.endpoint,
            "heartbeat_interval_s": self.heartbeat_interval_s,
            "dispatcher_args": list(self.dispatcher_args),
        }


class Stack:
    """nats-server plus the dispatcher and workers of `spec.mode`, for one run."""

    def __init__(self, spec: StackSpec, log_dir: Path) -> None:
        self.spec = spec
        self.log_dir = log_dir
        # The config's own [broker]: the naive mode provisions with what the dispatcher would.
        self.settings = spec.config.broker
        self.server: EmbeddedNatsServer | None = None
        self.children: list[Child] = []
        self._exit = contextlib.AsyncExitStack()

    @property
    def url(self) -> str:
        if self.server is None:
            raise StackError("the stack is not running")
        return self.server.url

    @property
    def worker_ids(self) -> list[str]:
        return [f"{self.spec.endpoint}-w{n + 1}" for n in range(self.spec.workers)]

    @property
    def config_path(self) -> Path:
        """The config file every process of the stack reads."""
        return self.log_dir / "fairq.toml"

    def connect(self) -> contextlib.AbstractAsyncContextManager[NATS]:
        """A client of the stack's server, drained at exit."""
        return connected(self.url)

    async def replay(
        self,
        arrivals: Sequence[Arrival],
        *,
        timeout_s: float,
        well_behaved: WellBehaved | None = None,
    ) -> Replay:
        """`arrivals` on schedule through the SDK (`bench.harness.recorder.replay`)."""
        return await replay(
            self.url,
            arrivals,
            endpoint=self.spec.endpoint,
            settings=self.settings,
            timeout_s=timeout_s,
            alive=self.check_alive,
            well_behaved=well_behaved,
        )

    async def fire(
        self, arrivals: Sequence[Arrival], *, timeout_s: float, in_flight: int = FIRE_IN_FLIGHT
    ) -> Replay:
        """`arrivals` from the load generator of the rate scenarios (`bench.harness.firehose`),
        each request id `<tenant>-<n>` for the tenant's n-th arrival."""
        return await self.fire_measured(
            to_measure(arrivals), timeout_s=timeout_s, in_flight=in_flight
        )

    async def fire_measured(
        self,
        measured: list[Measured],
        *,
        timeout_s: float,
        in_flight: int,
        bodies: Mapping[str, bytes] | None = None,
    ) -> Replay:
        """`fire` on records the caller watches, with `bodies` in place of some requests'."""
        return await fire_measured(
            self.url,
            measured,
            endpoint=self.spec.endpoint,
            settings=self.settings,
            in_flight=in_flight,
            timeout_s=timeout_s,
            alive=self.check_alive,
            bodies=bodies,
        )

    async def __aenter__(self) -> Self:
        try:
            await self._start()
        except BaseException:
            await self._exit.aclose()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._exit.aclose()

    def pids(self) -> dict[str, int]:
        """Process id of each running part: `nats-server`, `dispatcher`, the worker ids."""
        pids = (
            {}
            if self.server is None or self.server.pid is None
            else {"nats-server": self.server.pid}
        )
        pids |= {child.name: child.pid for child in self.children if child.pid is not None}
        return pids

    def check_alive(self) -> None:
        """Raise StackError if a process of the stack has died."""
        if self.server is not None and not self.server.running:
            raise StackError(f"nats-server exited:\n{self.server.log_tail()}")
        for child in self.children:
            try:
                child.check_alive()
            except ChildExited as exc:
                raise StackError(str(exc)) from exc

    async def _start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.server = await self._exit.enter_async_context(EmbeddedNatsServer())
        paths = self._write_files()
        nc = await self._exit.enter_async_context(connected(self.url))
        if self.spec.mode == "fairq":
            dispatcher = self._child(
                "dispatcher",
                "dispatcher",
                ["--nats", self.url, "--config", str(paths["config"]), *self.spec.dispatcher_args],
            )
            await dispatcher.start()
            self._exit.push_async_callback(dispatcher.stop)  # stops after the workers
            await self._until_dispatcher_answers(nc)
        else:
            await provision(nc.jetstream(), self.settings)
        if self.worker_ids:
            await self._start_workers(nc, paths)
            await self._warm_up(nc)

    async def _start_workers(self, nc: NATS, paths: dict[str, Path]) -> None:
        module = "workers" if self.spec.mode == "fairq" else "bench.harness.naive_worker"
        heartbeats = await nc.subscribe(self.settings.subjects.heartbeats(self.spec.endpoint))
        workers = [
            self._child(worker_id, module, self._worker_args(worker_id, paths))
            for worker_id in self.worker_ids
        ]
        for worker in workers:
            await worker.start()
            self._exit.push_async_callback(worker.stop)
        await self._until_heartbeats(heartbeats)
        await heartbeats.unsubscribe()

    def _write_files(self) -> dict[str, Path]:
        paths = {"config": self.config_path, "engine": self.log_dir / "engine.toml"}
        paths["config"].write_bytes(msgspec.toml.encode(self.spec.config))
        paths["engine"].write_bytes(msgspec.toml.encode(self.spec.engine))
        return paths

    def _child(self, name: str, module: str, args: list[str]) -> Child:
        # No restart policy: a process of the stack that dies fails the run.
        child = Child(
            name,
            [sys.executable, "-m", module, *args],
            self.log_dir / f"{name}.log",
            cwd=REPO,
            stop_timeout_s=STOP_TIMEOUT_S,
        )
        self.children.append(child)
        return child

    def _worker_args(self, worker_id: str, paths: dict[str, Path]) -> list[str]:
        flags = {
            "--nats": self.url,
            "--endpoint": self.spec.endpoint,
            "--worker-id": worker_id,
            "--engine": "sim",
            "--engine-config": str(paths["engine"]),
            "--time-scale": repr(self.spec.time_scale),
            "--seed": "0",
            "--config": str(paths["config"]),
            "--heartbeat-interval": repr(self.spec.heartbeat_interval_s),
            "--log-level": "WARNING",
        }
        return [part for flag, value in flags.items() for part in (flag, value)]

    async def _until_dispatcher_answers(self, nc: NATS) -> None:
        """The depth API answers once the dispatcher has provisioned the broker."""
        client = Client(nc, prefix=self.settings.prefix, api_timeout_s=1.0)
        async with asyncio.timeout(START_TIMEOUT_S):
            while True:
                self.check_alive()
                with contextlib.suppress(NoDispatcher, FairqTimeout):
                    await client.depth()
                    return
                await asyncio.sleep(_POLL_S)

    async def _until_heartbeats(self, heartbeats: nats.aio.subscription.Subscription) -> None:
        waiting = set(self.worker_ids)
        async with asyncio.timeout(START_TIMEOUT_S):
            while waiting:
                self.check_alive()
                with contextlib.suppress(nats.errors.TimeoutError):
                    msg = await heartbeats.next_msg(timeout=_POLL_S)
                    waiting.discard(HEARTBEAT.decode(msg.data).worker_id)

    async def _warm_up(self, nc: NATS) -> None:
        """One request through the whole path: the stack serves before the clock starts."""
        client = Client(nc, prefix=self.settings.prefix)
        try:
            await client.run(
                self.spec.endpoint,
                WARMUP_TENANT,
                prompt="warm up",
                max_tokens=1,
                id="warmup-0",
                timeout_s=START_TIMEOUT_S,
            )
        except Exception as exc:
            self.check_alive()
            raise StackError(f"the warm-up request failed: {exc}") from exc
