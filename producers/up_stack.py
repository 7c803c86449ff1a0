"""The parts `fairq up` runs (producers/up.py tells the whole story), started in this
order and left in reverse: the metrics server; the nats-server (or `--cluster`'s nodes)
and the dispatcher's connection; the limiter store; the dispatcher's tenures and the
reloads SIGHUP starts; the worker processes under their supervisor (and, with
`--autoscale`, the scale follower); once every worker serves, the OpenAI-compatible front.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import nats
from nats.aio.client import Client as NATS

from broker_config.auth import (
    DISPATCHER_USER,
    FRONT_USER,
    OPERATOR_USER,
    WORKER_USER,
    RenderedAuth,
    front_inbox_prefix,
    registered_tenants,
)
from broker_config.cluster import EmbeddedNatsCluster
from broker_config.config import Config
from broker_config.connection import server_urls
from broker_config.runtime import first_of
from broker_config.server import EmbeddedNatsServer
from dispatcher.admission.kv_store import open_limiter_store
from dispatcher.api.http import HttpApi
from dispatcher.ha.lease import Lease, holder_id
from dispatcher.ha.tenures import Tenures
from dispatcher.observe.metrics import DispatcherMetrics
from producers.client import Client
from producers.local_workers import (
    START_TIMEOUT_S,
    STOP_MARGIN_S,
    StartError,
    WorkerLauncher,
    replace_unhealthy,
    until_serving,
)
from producers.openai_front.app import Front
from producers.openai_front.keys import KeyRing
from producers.openai_front.server import FrontServer
from producers.reloads import Reloads
from producers.scaling import ScaleFollower
from producers.supervisor import Supervisor

DEV_TENANT = "acme"
CLUSTER_SIZE = 3  # nodes of --cluster: a majority survives the loss of one


@dataclass(frozen=True, slots=True)
class Plan:
    """What `fairq up` runs, checked (`producers.up.run_up`)."""

    args: argparse.Namespace  # its flags
    config: Config  # the config file's, with what the flags change
    dev_key: str  # the front's development API key, printed as OPENAI_API_KEY
    log_dir: Path
    auth: RenderedAuth | None  # the broker users, with --auth


async def run_stack(plan: Plan) -> int:
    """Run the parts until SIGINT or SIGTERM, then leave them in reverse order."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # Left in reverse: workers, dispatcher, limiter, connection, server, metrics.
    async with contextlib.AsyncExitStack() as stack:
        metrics = DispatcherMetrics(list(plan.config.endpoints))
        http = HttpApi(metrics)
        metrics_port = _serve_metrics(stack, http, plan.args.metrics_port)
        server, nc = await _open_broker(stack, plan)
        tenures = await _start_dispatcher(stack, plan, nc, server, metrics, http)
        dispatching = await stack.enter_async_context(_dispatching(tenures, stop))
        supervisor = await _start_workers(stack, plan, nc, server.url)
        await until_serving(nc, plan.config, supervisor, stop, plan.log_dir)
        if not stop.is_set():
            front = await _serve_front(
                stack, server.url, plan.config, plan.args.front_port, plan.auth
            )
            _announce(plan, server.url, metrics_port, front.base_url, len(supervisor.children))
            await _serve_until_stopped(tenures, supervisor, dispatching, stop)
        _say("draining...")
    _say("stopped")
    return 0


def _say(message: str) -> None:
    print(f"fairq: {message}", flush=True)


def _seed(auth: RenderedAuth | None, user: str) -> dict[str, str]:
    """nats.connect's credentials for `user` (none without --auth)."""
    return {} if auth is None else {"nkeys_seed": str(auth.seeds[user])}


def _serve_metrics(stack: contextlib.AsyncExitStack, http: HttpApi, port: int) -> int:
    """The dispatcher's HTTP server (metrics, health, dashboard); the port it listens on."""
    try:
        bound = http.serve(port)
    except OSError:  # the default port is taken: any free one, printed as METRICS_URL
        bound = http.serve(0)
    stack.callback(http.close)
    return bound


async def _open_broker(
    stack: contextlib.AsyncExitStack, plan: Plan
) -> tuple[EmbeddedNatsServer | EmbeddedNatsCluster, NATS]:
    """The nats-server (or the cluster's nodes), and the dispatcher's connection to it."""
    args, auth = plan.args, plan.auth
    server = await stack.enter_async_context(
        EmbeddedNatsCluster(CLUSTER_SIZE, store_root=plan.log_dir / "nats", sync="always")
        if args.cluster
        else EmbeddedNatsServer(port=args.port, config_file=auth.config if auth else None)
    )
    nc = await nats.connect(
        server_urls(server.url),
        name="fairq-up",
        max_reconnect_attempts=-1,
        **_seed(auth, DISPATCHER_USER),
    )
    stack.push_async_callback(nc.drain)
    return server, nc


async def _start_dispatcher(
    stack: contextlib.AsyncExitStack,
    plan: Plan,
    nc: NATS,
    server: EmbeddedNatsServer | EmbeddedNatsCluster,
    metrics: DispatcherMetrics,
    http: HttpApi,
) -> Tenures:
    """The limiter store and the dispatcher's tenures (not yet running), with SIGHUP
    reloading the config."""
    args, config = plan.args, plan.config
    limiter = await open_limiter_store(args.redis_url, nc, config)
    stack.push_async_callback(limiter.aclose)
    # With the lease, a `python -m dispatcher` started against this broker stands by.
    ttl_s = config.dispatcher.lease_ttl_s
    tenures = Tenures(
        nc,
        config,
        lease=Lease(holder_id(), ttl_s=ttl_s) if ttl_s else None,
        limiter=limiter,
        metrics=metrics,
        http=http,
        config_path=args.config,
    )
    reloads = Reloads(
        lambda: tenures.current,
        config,
        plan.auth,
        _say,
        reload_broker=None if args.cluster else server.reload,
    )
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reloads.trigger)
    stack.push_async_callback(reloads.close)
    return tenures


async def _start_workers(
    stack: contextlib.AsyncExitStack, plan: Plan, nc: NATS, nats_url: str
) -> Supervisor:
    """Each endpoint's worker processes under a supervisor that restarts them: `--workers`
    of them, or with --autoscale its policy's minimum and what the scale events ask."""
    args, config, auth = plan.args, plan.config, plan.auth
    supervisor = await stack.enter_async_context(Supervisor(on_event=_say))
    launcher = WorkerLauncher(
        nats_url,
        args.config.resolve(),
        args.time_scale,
        plan.log_dir,
        stop_timeout_s=config.workers.drain_timeout_s + STOP_MARGIN_S,
        credentials=("--nkey", str(auth.seeds[WORKER_USER])) if auth else (),
    )
    for endpoint, spec in config.endpoints.items():
        count = (
            spec.autoscale.min_replicas
            if args.autoscale
            else args.workers.get(endpoint, args.workers.get("", 1))
        )
        for n in range(1, count + 1):
            await supervisor.add(launcher.child(endpoint, n))
    if args.autoscale:
        await stack.enter_async_context(ScaleFollower(nc, config, supervisor, launcher.child, _say))
    return supervisor


def _announce(plan: Plan, nats_url: str, metrics_port: int, front_url: str, workers: int) -> None:
    """Where everything is, one `NAME=value` line each, and that fairq is up."""
    print(f"NATS_URL={nats_url}", flush=True)
    print(f"METRICS_URL=http://127.0.0.1:{metrics_port}/metrics", flush=True)
    print(f"DASHBOARD_URL=http://127.0.0.1:{metrics_port}/dashboard", flush=True)
    print(f"OPENAI_BASE_URL={front_url}", flush=True)
    print(f"OPENAI_API_KEY={plan.dev_key}", flush=True)
    print(f"LOG_DIR={plan.log_dir}", flush=True)
    auth = plan.auth
    if auth is not None:
        print(f"AUTH_DIR={auth.directory}", flush=True)
        tenants = registered_tenants(plan.config)
        example = DEV_TENANT if DEV_TENANT in tenants else tenants[0]
        _say(
            f"broker users on: tenants {', '.join(tenants)} connect with their "
            f"AUTH_DIR/<tenant>.nk, e.g. `fairq submit --nats {nats_url} --nkey "
            f"{auth.seeds[example]} --tenant {example} ...`; operators with "
            f"{auth.seeds[OPERATOR_USER]}"
        )
    print(
        f"fairq is up: {workers} simulated workers on "
        f"{', '.join(plan.config.endpoints)}; Ctrl-C stops",
        flush=True,
    )


async def _serve_until_stopped(
    tenures: Tenures, supervisor: Supervisor, dispatching: asyncio.Task[None], stop: asyncio.Event
) -> None:
    """Replace the workers the dispatcher holds unhealthy until `stop` is set; raises the
    dispatcher's error if it ends first."""
    replacing = asyncio.create_task(replace_unhealthy(tenures, supervisor))
    try:
        await first_of(stop.wait(), asyncio.shield(dispatching))
    finally:
        replacing.cancel()
    if dispatching.done():
        dispatching.result()  # its error (a config it could no longer read, a bug)


async def _serve_front(
    stack: contextlib.AsyncExitStack,
    nats_url: str,
    config: Config,
    port: int | None,
    auth: RenderedAuth | None,
) -> FrontServer:
    """The OpenAI-compatible front, on its own connection (as its own user with --auth);
    left before the workers stop, so that no new request arrives while they drain."""
    seed = None if auth is None else auth.seeds[FRONT_USER]
    client = await stack.enter_async_context(
        await Client.connect(
            nats_url,
            prefix=config.broker.prefix,
            nkey=seed,
            inbox_prefix=front_inbox_prefix(FRONT_USER) if seed else None,
        )
    )
    front = Front(client, config, KeyRing(config.front.keys))
    try:
        return await stack.enter_async_context(FrontServer(front, config.front, port))
    except OSError:
        if port is not None:
            raise StartError(f"the front cannot listen on port {port}") from None
        # The configured port is taken: any free one, printed as OPENAI_BASE_URL.
        return await stack.enter_async_context(FrontServer(front, config.front, 0))


@contextlib.asynccontextmanager
async def _dispatching(tenures: Tenures, stop: asyncio.Event) -> AsyncIterator[asyncio.Task[None]]:
    """The dispatcher's tenures in a task (yielded: it ends only by an error), entered
    once the first has taken the lease and started, or `stop` was set first; left (the
    last one drains) when the stack unwinds to here, after the workers stopped. A
    dispatcher that lost its lease (its renewals failed while a cluster elected a new
    leader) stands by and serves again, as `python -m dispatcher` does."""
    ended = asyncio.Event()
    running = asyncio.create_task(tenures.run(ended))
    waits = [
        running,
        asyncio.ensure_future(tenures.serving.wait()),
        asyncio.ensure_future(stop.wait()),
    ]
    try:
        done, _ = await asyncio.wait(
            waits, timeout=START_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
        )
        if running.done():
            running.result()  # its error at start, e.g. a tokenizer it could not load
        elif not done:
            raise StartError(
                f"the dispatcher did not start within {START_TIMEOUT_S:g}s "
                "(the broker failed it, or another dispatcher holds the lease)"
            )
        yield running
    finally:
        for wait in waits[1:]:
            wait.cancel()
        ended.set()
        if not running.done():
            await running
