"""Run one worker: `python -m workers --nats URL --endpoint chat --worker-id w1 [...]`.

The worker serves one endpoint with one engine: the simulated engine (`--engine sim`,
timing from `--engine-config`, an `EngineParams` TOML such as configs/engine.toml) or vLLM
(`--engine vllm`, `--engine-config` a `VLLMEngineConfig` TOML and/or `--model DIR`).
`--config` (the fairq config the dispatcher runs with) supplies the endpoint's cost profile,
so usage carries model units, and the subject prefix.

The broker must be provisioned already (the dispatcher does it): the worker only opens the
results bucket. SIGTERM or SIGINT drains the worker (see `WorkerService`) and exits 0;
bad arguments exit 2, runtime failures (NATS unreachable, no results bucket, the engine
failing to start, the connection lost) exit 1.

Fault injection, simulated engine only (for chaos runs: `python -m bench.chaos.run`):
SIGUSR1 switches the engine's hang fault on or off (steps stop, heartbeats go on);
SIGUSR2 switches its slow fault (every step `--slow-fault` times longer).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import nats
import nats.errors
from nats.js.errors import BucketNotFoundError

from broker_config.config import DEFAULT_NATS_URL, EndpointKind, WorkerOptions, load_config
from broker_config.config_errors import error_path
from broker_config.connection import (
    ConnectionOptionsError,
    add_connection_args,
    connect_options,
    server_urls,
)
from broker_config.health import HealthServer
from broker_config.kv_writer import KeyValueWriter
from broker_config.lease_key import EpochWatch
from broker_config.registry import Registry
from broker_config.runtime import freeze_startup_heap
from broker_config.subjects import SubjectError, Subjects, check_token
from costmodel.engine_model import EngineParams, load_engine_params
from costmodel.units import ModelProfile
from workers.engine import Engine, EngineError
from workers.service import WorkerService
from workers.sim_engine import SimEngine

log = logging.getLogger("workers")

CONNECT_TIMEOUT_S = 5.0  # one connection attempt


class UsageError(ValueError):
    """An argument, or a file it names, that cannot be used."""


@dataclass(frozen=True, slots=True)
class Options:
    nats_url: str
    connect_wait_s: float
    endpoint: str
    worker_id: str
    subjects: Subjects
    profile: ModelProfile | None
    settings: WorkerOptions
    engine: Engine
    health_port: int | None = None  # serve /healthz and /readyz there (0: a free port)
    health_host: str = "127.0.0.1"
    slow_fault: float = 10.0  # the step-time factor SIGUSR2 switches on (sim engine)
    embed: bool = False  # the endpoint's kind is "embed"
    credentials: dict[str, Any] = field(default_factory=dict)  # nats.connect's, if any


def build_parser(prog: str = "python -m workers") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Run a fairq worker: batches in, events out."
    )
    parser.add_argument(
        "--nats",
        default=DEFAULT_NATS_URL,
        metavar="URL",
        help=f"NATS server (default {DEFAULT_NATS_URL})",
    )
    add_connection_args(parser)
    parser.add_argument(
        "--connect-wait",
        type=float,
        default=60.0,
        metavar="S",
        help="how long to keep trying to reach NATS at start (default 60)",
    )
    parser.add_argument("--endpoint", required=True, help="the endpoint this worker serves")
    parser.add_argument(
        "--kind",
        choices=("generate", "embed"),
        help="what the endpoint does (default: its `kind` in --config, else generate)",
    )
    parser.add_argument("--worker-id", required=True, help="unique among the endpoint's workers")
    _add_engine_options(parser.add_argument_group("engine"))
    parser.add_argument(
        "--config",
        type=Path,
        metavar="TOML",
        help="fairq config: the endpoint's cost profile and the subject prefix",
    )
    parser.add_argument("--prefix", help="subject prefix (default: --config's, else fq)")
    defaults = WorkerOptions()
    parser.add_argument(
        "--heartbeat-interval",
        type=float,
        metavar="S",
        help=f"default: --config's [workers], else {defaults.heartbeat_interval_s:g}",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        metavar="S",
        help="on SIGTERM, how long in-flight requests may take to finish "
        f"(default: --config's [workers], else {defaults.drain_timeout_s:g})",
    )
    parser.add_argument(
        "--health-port",
        type=int,
        metavar="PORT",
        help="serve /healthz (liveness: heartbeats go out, not evicted) and "
        "/readyz (takes work) over HTTP on PORT (0: a free port, "
        "printed as HEALTH_URL)",
    )
    parser.add_argument(
        "--health-host",
        default="127.0.0.1",
        help="address for --health-port (0.0.0.0 inside a container)",
    )
    parser.add_argument(
        "--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR")
    )
    return parser


def _add_engine_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--engine", choices=("sim", "vllm"), default="sim")
    group.add_argument(
        "--engine-config",
        type=Path,
        metavar="TOML",
        help="sim: EngineParams (e.g. configs/engine.toml); vllm: VLLMEngineConfig fields",
    )
    group.add_argument(
        "--time-scale",
        type=float,
        metavar="X",
        help="sim only: multiplies simulated step times (default 1.0)",
    )
    group.add_argument("--seed", type=int, help="sim only: output text and lengths (default 0)")
    group.add_argument(
        "--slow-fault",
        type=float,
        metavar="X",
        help="sim only: SIGUSR2 makes every step X times longer, and "
        "SIGUSR2 again undoes it (default 10; SIGUSR1 toggles a hang)",
    )
    group.add_argument("--model", metavar="DIR", help="vllm only: the model directory")


def parse_options(args: argparse.Namespace) -> Options:
    """Everything the worker needs, checked before it connects; UsageError if unusable."""
    try:
        check_token(args.endpoint, "endpoint")
        check_token(args.worker_id, "worker id")
    except SubjectError as exc:
        raise UsageError(str(exc)) from exc
    try:
        credentials = connect_options(args)
    except ConnectionOptionsError as exc:
        raise UsageError(str(exc)) from exc
    if not (0 < args.connect_wait < math.inf):
        raise UsageError(f"--connect-wait must be > 0, got {args.connect_wait}")
    prefix, profile, settings, embed = args.prefix, None, WorkerOptions(), args.kind == "embed"
    if args.config is not None:
        prefix_from_config, profile, settings, kind = _from_fairq_config(args.config, args.endpoint)
        if args.kind is not None and args.kind != kind:
            raise UsageError(
                f"--kind {args.kind}: endpoint {args.endpoint!r} is of kind "
                f"{kind!r} in {args.config}"
            )
        prefix, embed = prefix or prefix_from_config, kind == "embed"
    overrides = {
        name: value
        for name, value in (
            ("heartbeat_interval_s", args.heartbeat_interval),
            ("drain_timeout_s", args.drain_timeout),
        )
        if value is not None
    }
    try:
        subjects = Subjects(prefix or "fq")
        settings = msgspec.convert(msgspec.to_builtins(settings) | overrides, WorkerOptions)
    except SubjectError as exc:
        raise UsageError(str(exc)) from exc
    except msgspec.ValidationError as exc:
        flag = error_path(exc) or ""
        raise UsageError(f"--{flag.removesuffix('_s').replace('_', '-')}: {exc}") from exc
    engine = _sim_engine(args) if args.engine == "sim" else _vllm_engine(args, embed)
    if args.health_port is not None and not 0 <= args.health_port <= 65535:
        raise UsageError(f"--health-port must be in 0..65535, got {args.health_port}")
    slow_fault = 10.0 if args.slow_fault is None else args.slow_fault
    if not 0 < slow_fault < math.inf:
        raise UsageError(f"--slow-fault must be a finite number > 0, got {args.slow_fault}")
    return Options(
        args.nats,
        args.connect_wait,
        args.endpoint,
        args.worker_id,
        subjects,
        profile,
        settings,
        engine,
        args.health_port,
        args.health_host,
        slow_fault,
        embed,
        credentials,
    )


def _from_fairq_config(
    path: Path, endpoint: str
) -> tuple[str, ModelProfile, WorkerOptions, EndpointKind]:
    try:
        config = load_config(path)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    if endpoint not in config.endpoints:
        known = ", ".join(sorted(config.endpoints)) or "none"
        raise UsageError(f"{path}: no endpoint {endpoint!r} (configured: {known})")
    return (
        config.broker.prefix,
        Registry(config).profile(endpoint),
        config.workers,
        config.endpoints[endpoint].kind,
    )


def _sim_engine(args: argparse.Namespace) -> Engine:
    if args.model is not None:
        raise UsageError("--model is for --engine vllm; the simulated engine has no model")
    try:
        params = (
            load_engine_params(args.engine_config)
            if args.engine_config is not None
            else EngineParams()
        )
        return SimEngine(
            params,
            time_scale=1.0 if args.time_scale is None else args.time_scale,
            seed=0 if args.seed is None else args.seed,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


def _vllm_engine(args: argparse.Namespace, embed: bool) -> Engine:
    for flag, value in (
        ("--time-scale", args.time_scale),
        ("--seed", args.seed),
        ("--slow-fault", args.slow_fault),
    ):
        if value is not None:
            raise UsageError(f"{flag} is for --engine sim (set vLLM's seed in --engine-config)")
    # Imported only here: its module is the one place fairq reaches vllm from.
    from workers.vllm_engine import VLLMEngine, VLLMEngineConfig

    fields: dict[str, Any] = {}
    if args.engine_config is not None:
        fields = _read_toml_table(args.engine_config)
    if args.model is not None:
        fields["model"] = args.model
    if "model" not in fields:
        raise UsageError("--engine vllm needs --model DIR (or `model` in --engine-config)")
    try:
        return VLLMEngine(msgspec.convert(fields, VLLMEngineConfig), embed=embed)
    except msgspec.ValidationError as exc:
        where = args.engine_config or "--model"
        raise UsageError(f"{where}: invalid vLLM engine config: {exc}") from exc


def _read_toml_table(path: Path) -> dict[str, Any]:
    try:
        data = msgspec.toml.decode(path.read_bytes())
    except OSError as exc:
        raise UsageError(f"{path}: cannot read: {exc.strerror}") from exc
    except msgspec.DecodeError as exc:
        raise UsageError(f"{path}: not valid TOML: {exc}") from exc
    if not isinstance(data, dict):
        raise UsageError(f"{path}: expected a table of settings")
    return data


class WorkerFailure(RuntimeError):
    """The worker could not start or lost its connection; the message says why."""


@contextlib.asynccontextmanager
async def serving(
    options: Options, stop: asyncio.Event
) -> AsyncIterator[tuple[nats.NATS, WorkerService]]:
    """A connected, serving worker: (connection, service) until the block is left, which
    drains the service, then closes the connection. `stop` is set when the connection is
    lost for good. Raises WorkerFailure."""
    lost = closed_by_us = False

    async def on_closed() -> None:
        nonlocal lost
        if not closed_by_us:  # nats-py gave up reconnecting
            lost = True
            stop.set()

    async def on_error(exc: Exception) -> None:
        log.warning("NATS: %r", exc)

    try:
        # nats-py retries a failed first connect; the wait bounds it (NATS may start later).
        async with asyncio.timeout(options.connect_wait_s):
            nc = await nats.connect(
                server_urls(options.nats_url),
                name=f"fairq-worker-{options.endpoint}-{options.worker_id}",
                connect_timeout=CONNECT_TIMEOUT_S,
                error_cb=on_error,
                closed_cb=on_closed,
                **options.credentials,
            )
    except (OSError, TimeoutError, nats.errors.Error) as exc:
        raise WorkerFailure(
            f"cannot connect to NATS at {options.nats_url} within "
            f"{options.connect_wait_s:g}s: {exc!r}"
        ) from exc
    try:
        async with _service(nc, options) as service:
            freeze_startup_heap()
            yield nc, service
    finally:
        if not nc.is_closed:
            closed_by_us = True
            await nc.close()
    if lost:
        raise WorkerFailure(f"lost the NATS connection to {options.nats_url}")


@contextlib.asynccontextmanager
async def _service(nc: nats.NATS, options: Options) -> AsyncIterator[WorkerService]:
    bucket = options.subjects.results_bucket
    try:
        await nc.jetstream().key_value(bucket)  # the bucket exists: the broker is provisioned
    except BucketNotFoundError as exc:
        raise WorkerFailure(
            f"results bucket {bucket} not found on {options.nats_url}: the "
            "dispatcher provisions the broker, start it first"
        ) from exc
    except nats.errors.Error as exc:
        raise WorkerFailure(f"cannot open results bucket {bucket}: {exc!r}") from exc
    async with contextlib.AsyncExitStack() as stack:
        # Entered first, left last: the service stores its final events while draining.
        writer = await stack.enter_async_context(KeyValueWriter(nc, bucket))
        fence = await stack.enter_async_context(EpochWatch(nc.jetstream(), options.subjects))
        try:
            engine = await stack.enter_async_context(options.engine)
        except (EngineError, ImportError) as exc:
            # ImportError: --engine vllm where vllm is not installed (see docs/vllm.md).
            raise WorkerFailure(f"the engine failed to start: {exc}") from exc
        service = await stack.enter_async_context(
            WorkerService(
                nc,
                engine,
                endpoint=options.endpoint,
                worker_id=options.worker_id,
                subjects=options.subjects,
                results=writer,
                profile=options.profile,
                settings=options.settings,
                embed=options.embed,
                fence=fence,
            )
        )
        log.info("worker %s serving endpoint %s", options.worker_id, options.endpoint)
        yield service
        log.info("worker %s draining", options.worker_id)


def stop_on_signals() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT (call inside the running loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


def faults_on_signals(engine: Engine, slow_fault: float) -> None:
    """SIGUSR1 toggles a simulated engine's hang fault, SIGUSR2 its slow fault (call
    inside the running loop; other engines have no faults to switch)."""
    if not isinstance(engine, SimEngine):
        return
    faults = engine.faults

    def toggle_hang() -> None:
        faults.hang = not faults.hang
        log.warning("fault injection: hang %s", "on" if faults.hang else "off")

    def toggle_slow() -> None:
        faults.slow_factor = slow_fault if faults.slow_factor == 1.0 else 1.0
        log.warning("fault injection: steps x%g", faults.slow_factor)

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, toggle_hang)
    loop.add_signal_handler(signal.SIGUSR2, toggle_slow)


async def run(options: Options) -> None:
    """Serve until SIGTERM/SIGINT, then drain. Raises WorkerFailure, also when the
    dispatcher evicted this worker (its supervisor then starts a fresh one)."""
    stop = stop_on_signals()
    faults_on_signals(options.engine, options.slow_fault)
    async with contextlib.AsyncExitStack() as stack:
        http = HealthServer()  # live, not ready, until the service runs; closed last
        if options.health_port is not None:
            port = http.serve(options.health_port, options.health_host)
            stack.callback(http.close)
            print(f"HEALTH_URL=http://{options.health_host}:{port}", flush=True)
        _, service = await stack.enter_async_context(serving(options, stop))
        http.live, http.ready = service.live, service.ready
        waits = [asyncio.create_task(stop.wait()), asyncio.create_task(service.evicted.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        was_evicted = service.evicted.is_set()
    if was_evicted:
        raise WorkerFailure("evicted by the dispatcher: the engine failed its health probes")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        options = parse_options(args)
    except UsageError as exc:
        parser.error(str(exc))
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        asyncio.run(run(options))
    except WorkerFailure as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
