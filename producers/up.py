"""`fairq up`: a whole fairq system on this machine, its parts run as a deployment runs
them, until Ctrl-C or SIGTERM.

Start: an embedded nats-server -> a connection -> the dispatcher, in this process (it
provisions the broker) -> `--workers` worker processes per endpoint of the config
(`python -m workers --engine sim`, worker ids `<endpoint>-w1`, `-w2`, ...), each in its
own session with its output in `<log dir>/<worker id>.log` (the dispatcher's log, this
process's, is `<log dir>/dispatcher.log`). The workers are up once each has sent a
heartbeat; a worker that exits before that fails the start with the end of its log,
since restarting would not cure a bad argument or config.

Supervision (`producers.supervisor`): a worker that exits without being asked to is
restarted under the same worker id after 0.5 s, doubling per further crash up to 30 s,
back to 0.5 s after a run of 10 s; every exit and restart is printed. The dispatcher
sees the new `started_at` in the new process's heartbeats and takes back what the dead
one was running (docs/protocol.md: what a client sees). A worker process the dispatcher
holds unhealthy (silent, e.g. stopped with SIGSTOP; evicted by its health probes and not
exiting; its engine failed) is killed once it has run 15 s (`producers.local_workers`),
so that it is restarted the same way.

Autoscaling (`--autoscale`, `producers.scaling`): each endpoint starts with its policy's
`min_replicas` workers, and the dispatcher's scale events start more (lowest free
numbers) or drain the highest-numbered ones; endpoints without their own
`[endpoints.<name>.autoscale]` table get `LOCAL_SCALING` up to `--max-workers`.

The OpenAI-compatible front (`producers.openai_front`) serves in this process once the
workers are up, with a development API key for `--front-tenant` printed as
OPENAI_API_KEY beside OPENAI_BASE_URL. Once it answers HTTP, the URLs of everything are
printed (the ports actually bound), and "fairq is up" is the start's last line.

Auth (`--auth`, docs/security.md): the broker's nkey users are rendered into
`<log dir>/auth` (as `fairq auth` does; kept, so a later run with the same `--log-dir`
keeps the credentials), nats-server runs with them, the dispatcher (with tenant inboxes),
the workers and the front connect as their own users, and AUTH_DIR is printed: a tenant
connects with `<AUTH_DIR>/<tenant>.nk`.

Cluster (`--cluster`, docs/operations.md): three nats-server nodes on 127.0.0.1
(`EmbeddedNatsCluster`, stores in `<log dir>/nats`, `sync_interval: always`) instead of
one, the requests stream and every bucket at 3 replicas; NATS_URL lists every node, and
every part reconnects to another node when one dies. The dispatcher runs in tenures
(`dispatcher.ha.tenures`): one whose lease renewals failed while the cluster elected new
leaders stands by and serves again, fairq up keeps running.

Reload (SIGHUP to this process; `fairq reload` reaches the dispatcher alone): the config
file's tenants, tiers, weights and limits apply without a restart, and with `--auth` the
broker users follow (`producers.reloads`). So closing the terminal does not stop it;
Ctrl-C or SIGTERM do.

Stop order: the front first (no new requests; open ones get its drain time), then the
workers (SIGTERM, all at once: each finishes its running requests
within `[workers] drain_timeout_s`, and the still-running dispatcher acks them; SIGKILL
5 s past that); then the dispatcher drains (hands back what it still holds); then the
connection; then the nats-server, which runs in its own session too so the terminal's
Ctrl-C cannot stop it before its clients have drained. The log directory is kept.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import nats

from broker_config.auth import (
    DISPATCHER_USER,
    FRONT_USER,
    OPERATOR_USER,
    WORKER_USER,
    RenderedAuth,
    front_inbox_prefix,
    registered_tenants,
    render_auth_dir,
    with_tenant_inboxes,
)
from broker_config.cluster import EmbeddedNatsCluster
from broker_config.config import Config, ConfigError, load_config
from broker_config.connection import server_urls
from broker_config.runtime import first_of
from broker_config.server import EmbeddedNatsServer, EmbeddedServerError
from costmodel.capacity import ScalingPolicy
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
from producers.openai_front.keys import KeyRing, with_dev_key
from producers.openai_front.server import FrontServer
from producers.reloads import Reloads
from producers.scaling import ScaleFollower, with_autoscaling
from producers.supervisor import Supervisor, SupervisorError
from producers.up_options import DEV_TENANT, DISPATCHER_LOG, add_options

# `--autoscale` for endpoints without their own policy: local processes start in a few
# seconds, and a demo should see a lull give workers back within a minute.
LOCAL_SCALING = ScalingPolicy(
    min_replicas=1,
    max_replicas=4,
    cold_start_s=5.0,
    scale_down_after_s=60.0,
    rate_window_s=10.0,
    drain_s=10.0,
)
CLUSTER_SIZE = 3  # nodes of --cluster: a majority survives the loss of one
# Where to reach a front that listens on every address.
LOOPBACK_OF = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "up",
        help="run nats-server, a dispatcher and simulated worker processes locally",
        description="Start an embedded nats-server, run a dispatcher on it and simulated "
        "workers, each in its own process and restarted if it dies, with the "
        "given config until Ctrl-C, which drains and stops them in order.",
    )
    add_options(parser)
    parser.set_defaults(run=run_up)


def run_up(args: argparse.Namespace) -> int:
    if args.max_workers < 1:
        return _fail("--max-workers must be at least 1", 2)
    if not args.time_scale >= 0:
        return _fail(f"--time-scale must be >= 0, got {args.time_scale}", 2)
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        return _fail(str(exc), 2)
    unknown = set(args.workers) - {""} - set(config.endpoints)
    if unknown:
        return _fail(f"--workers: no endpoint {', '.join(sorted(unknown))} in the config", 2)
    if args.autoscale:
        config = with_autoscaling(
            config, msgspec.structs.replace(LOCAL_SCALING, max_replicas=args.max_workers)
        )
    if args.front_port is not None and not 0 <= args.front_port <= 65535:
        return _fail(f"--front-port must be in 0..65535, got {args.front_port}", 2)
    tenant = args.front_tenant
    if tenant == DEV_TENANT and tenant not in config.tenants and config.tenants:
        tenant = next(iter(config.tenants))
    try:
        config, dev_key = with_dev_key(config, tenant)
    except ConfigError as exc:
        return _fail(str(exc), 2)
    if args.cluster and args.auth:
        return _fail(
            "--cluster and --auth cannot be combined yet: the broker users are "
            "rendered for one server; run the cluster with `fairq auth` by hand "
            "(docs/operations.md)",
            2,
        )
    if args.cluster and args.port:
        return _fail("--cluster picks a free port for each node; leave out --port", 2)
    if args.cluster:
        config = msgspec.structs.replace(
            config, broker=msgspec.structs.replace(config.broker, replicas=CLUSTER_SIZE)
        )
    log_dir = _log_dir(args.log_dir)
    _log_to(log_dir / DISPATCHER_LOG)
    auth = None
    if args.auth:
        config = with_tenant_inboxes(config)
        try:
            auth = render_auth_dir(log_dir / "auth", config.subjects, registered_tenants(config))
        except (ValueError, OSError) as exc:
            return _fail(f"--auth: {exc}", 2)
    try:
        return asyncio.run(_up(args, config, dev_key, log_dir, auth))
    except (EmbeddedServerError, SupervisorError, StartError) as exc:
        return _fail(str(exc), 1)
    except ConfigError as exc:  # found at start: an endpoint's tokenizer it cannot load
        return _fail(f"{args.config}: {exc}", 2)


def _fail(message: str, code: int) -> int:
    print(f"fairq up: {message}", file=sys.stderr)
    return code


def _say(message: str) -> None:
    print(f"fairq: {message}", flush=True)


def _log_dir(path: Path | None) -> Path:
    if path is None:
        return Path(tempfile.mkdtemp(prefix="fairq-up-"))
    path = path.resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def _log_to(path: Path) -> None:
    """This process's log (the dispatcher's, with the front's few lines) into `path`, as
    `python -m dispatcher` writes it; warnings also to stderr, as without a handler."""
    log_file = logging.FileHandler(path)
    log_file.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    console = logging.StreamHandler()
    console.setLevel(logging.WARNING)
    logging.basicConfig(level=logging.INFO, format="%(message)s", handlers=[log_file, console])


def _seed(auth: RenderedAuth | None, user: str) -> dict[str, str]:
    """nats.connect's credentials for `user` (none without --auth)."""
    return {} if auth is None else {"nkeys_seed": str(auth.seeds[user])}


async def _up(
    args: argparse.Namespace, config: Config, dev_key: str, log_dir: Path, auth: RenderedAuth | None
) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # Left in reverse: front, workers, dispatcher, limiter, connection, server, metrics.
    async with contextlib.AsyncExitStack() as stack:
        metrics = DispatcherMetrics(list(config.endpoints))
        http = HttpApi(metrics)
        try:
            metrics_port = http.serve(args.metrics_port)
        except OSError:  # the default port is taken: any free one, printed below
            metrics_port = http.serve(0)
        stack.callback(http.close)
        server = await stack.enter_async_context(
            EmbeddedNatsCluster(CLUSTER_SIZE, store_root=log_dir / "nats", sync="always")
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
            auth,
            _say,
            reload_broker=None if args.cluster else server.reload,
        )
        loop.add_signal_handler(signal.SIGHUP, reloads.trigger)
        stack.push_async_callback(reloads.close)
        dispatching = await stack.enter_async_context(_dispatching(tenures, stop))
        supervisor = await stack.enter_async_context(Supervisor(on_event=_say))
        await _start_workers(stack, args, config, nc, supervisor, server.url, log_dir, auth)
        await until_serving(nc, config, supervisor, stop, log_dir)
        if not stop.is_set():
            front = await _serve_front(stack, server.url, config, args.front_port, auth)
            where = Announcement(server.url, metrics_port, front.base_url, dev_key, log_dir)
            _announce(where, config, auth, len(supervisor.children))
            await _serve_until_stopped(tenures, supervisor, stop, dispatching)
        _say("draining...")
    _say("stopped")
    return 0


async def _start_workers(
    stack: contextlib.AsyncExitStack,
    args: argparse.Namespace,
    config: Config,
    nc: nats.NATS,
    supervisor: Supervisor,
    nats_url: str,
    log_dir: Path,
    auth: RenderedAuth | None,
) -> None:
    """Each endpoint's first workers (its policy's minimum with --autoscale, else
    --workers), and with --autoscale the follower of the dispatcher's scale events."""
    launcher = WorkerLauncher(
        nats_url,
        args.config.resolve(),
        args.time_scale,
        log_dir,
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


@dataclass(frozen=True, slots=True)
class Announcement:
    """Where everything is, as `fairq up` prints it once all of it serves."""

    nats_url: str
    metrics_port: int
    openai_base_url: str
    openai_api_key: str
    log_dir: Path

    def lines(self) -> list[str]:
        metrics = f"http://127.0.0.1:{self.metrics_port}"
        return [
            f"NATS_URL={self.nats_url}",
            f"METRICS_URL={metrics}/metrics",
            f"DASHBOARD_URL={metrics}/dashboard",
            f"OPENAI_BASE_URL={self.openai_base_url}",
            f"OPENAI_API_KEY={self.openai_api_key}",
            f"LOG_DIR={self.log_dir}",
        ]


def _announce(where: Announcement, config: Config, auth: RenderedAuth | None, workers: int) -> None:
    """The variables to export, then "fairq is up", the last line of the start."""
    for line in where.lines():
        print(line, flush=True)
    if auth is not None:
        print(f"AUTH_DIR={auth.directory}", flush=True)
        tenants = registered_tenants(config)
        example = DEV_TENANT if DEV_TENANT in tenants else tenants[0]
        _say(
            f"broker users on: tenants {', '.join(tenants)} connect with their "
            f"AUTH_DIR/<tenant>.nk, e.g. `fairq submit --nats {where.nats_url} --nkey "
            f"{auth.seeds[example]} --tenant {example} ...`; operators with "
            f"{auth.seeds[OPERATOR_USER]}"
        )
    print(
        f"fairq is up: {workers} simulated workers on {', '.join(config.endpoints)}; Ctrl-C stops",
        flush=True,
    )


async def _serve_until_stopped(
    tenures: Tenures, supervisor: Supervisor, stop: asyncio.Event, dispatching: asyncio.Task
) -> None:
    """Until Ctrl-C or SIGTERM, replacing workers the dispatcher holds unhealthy; raises
    the dispatcher's error if it ends first (a config it could no longer read, a bug)."""
    replacing = asyncio.create_task(replace_unhealthy(tenures, supervisor))
    try:
        await first_of(stop.wait(), asyncio.shield(dispatching))
    finally:
        replacing.cancel()
    if dispatching.done():
        dispatching.result()


async def _serve_front(
    stack: contextlib.AsyncExitStack,
    nats_url: str,
    config: Config,
    port: int | None,
    auth: RenderedAuth | None,
) -> FrontServer:
    """The OpenAI-compatible front, on its own connection (as its own user with --auth),
    once it answers HTTP; left before the workers stop, so that no new request arrives
    while they drain."""
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
        server = await stack.enter_async_context(FrontServer(front, config.front, port))
    except OSError:
        if port is not None:
            raise StartError(f"the front cannot listen on port {port}") from None
        # The configured port is taken: any free one, printed as OPENAI_BASE_URL.
        server = await stack.enter_async_context(FrontServer(front, config.front, 0))
    await _until_answering(config.front.host, server.port)
    return server


async def _until_answering(host: str, port: int) -> None:
    """Until an HTTP server answers on host:port. The front's socket listens at once, but
    hypercorn serves (and says so) from a task of its own: "fairq is up" comes after."""
    host = LOOPBACK_OF.get(host, host)
    try:
        async with asyncio.timeout(START_TIMEOUT_S):
            reader, writer = await asyncio.open_connection(host, port)
            try:
                writer.write(b"GET /v1/models HTTP/1.1\r\nHost: fairq\r\nConnection: close\r\n\r\n")
                status = await reader.readline()
            finally:
                writer.close()
    except (TimeoutError, OSError) as exc:
        raise StartError(f"the front on port {port} does not answer: {exc!r}") from None
    if not status.startswith(b"HTTP/"):
        raise StartError(f"the front on port {port} closed the connection without an answer")


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
