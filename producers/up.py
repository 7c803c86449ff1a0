"""`fairq up`: a whole fairq system on this machine, its parts run as a deployment runs
them (`producers.up_stack`), until Ctrl-C or SIGTERM.

Start: an embedded nats-server -> a connection -> the dispatcher, in this process (it
provisions the broker) -> `--workers` worker processes per endpoint of the config
(`python -m workers --engine sim`, worker ids `<endpoint>-w1`, `-w2`, ...), each in its
own session with its output in `<log dir>/<worker id>.log`. fairq is up once every
worker has sent a heartbeat; a worker that exits before that fails the start with the
end of its log, since restarting would not cure a bad argument or config.

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
OPENAI_API_KEY beside OPENAI_BASE_URL.

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
import sys
import tempfile
from pathlib import Path

import msgspec

from broker_config.auth import registered_tenants, render_auth_dir, with_tenant_inboxes
from broker_config.config import EXAMPLE_CONFIG, ConfigError, load_config
from broker_config.server import EmbeddedServerError
from costmodel.capacity import ScalingPolicy
from producers.local_workers import StartError
from producers.openai_front.keys import with_dev_key
from producers.scaling import with_autoscaling
from producers.supervisor import SupervisorError
from producers.up_stack import CLUSTER_SIZE, DEV_TENANT, Plan, run_stack

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


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "up",
        help="run nats-server, a dispatcher and simulated worker processes locally",
        description="Start an embedded nats-server, run a dispatcher on it and simulated "
        "workers, each in its own process and restarted if it dies, with the "
        "given config until Ctrl-C, which drains and stops them in order.",
    )
    _add_system_args(parser)
    _add_autoscale_args(parser)
    _add_front_args(parser)
    _add_broker_args(parser)
    parser.add_argument(
        "--log-dir",
        type=Path,
        help="workers' output, one <worker id>.log each (default: a new "
        "temporary directory, printed as LOG_DIR and kept)",
    )
    parser.set_defaults(run=run_up)


def _add_system_args(parser: argparse.ArgumentParser) -> None:
    """The broker's port, the config, the workers, the limiter store and the metrics."""
    parser.add_argument(
        "--port",
        type=int,
        default=0,
        help="NATS port on 127.0.0.1 (default: a free one, printed as NATS_URL)",
    )
    parser.add_argument("--config", type=Path, default=EXAMPLE_CONFIG)
    parser.add_argument(
        "--workers",
        type=worker_counts,
        default={"": 2},
        metavar="N | ENDPOINT=N,...",
        help="simulated worker processes per endpoint (default 2); a list "
        "sets endpoints apart, those not in it get 1 "
        "(chat=3,embed=0: embed gets none)",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiplies simulated engine time (0.1 = ten times faster)",
    )
    parser.add_argument(
        "--redis-url",
        help="use Redis for rate limits and quotas (default: "
        "in process, monthly usage kept in a NATS KV bucket)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=9464,
        help="Prometheus /metrics port on 127.0.0.1 (default 9464, or a free one if that is taken)",
    )


def _add_autoscale_args(parser: argparse.ArgumentParser) -> None:
    """Worker processes started and stopped as the dispatcher's autoscaler decides."""
    parser.add_argument(
        "--autoscale",
        action="store_true",
        help="start and stop worker processes as the dispatcher's autoscaler "
        "decides; endpoints without their own [endpoints.<name>.autoscale] "
        "get 1 to --max-workers workers, a 5 s cold start and a 60 s "
        "quiet window",
    )
    parser.add_argument(
        "--max-workers",
        type=int,
        default=4,
        help="with --autoscale: the default most workers per endpoint",
    )


def _add_front_args(parser: argparse.ArgumentParser) -> None:
    """The OpenAI-compatible front: its port and its development key's tenant."""
    parser.add_argument(
        "--front-port",
        type=int,
        help="the OpenAI-compatible front's port on [front] host (default: "
        "[front] port, or a free one if that is taken; printed in "
        "OPENAI_BASE_URL)",
    )
    parser.add_argument(
        "--front-tenant",
        default=DEV_TENANT,
        help=f"the tenant of the development API key made at start and "
        f"printed as OPENAI_API_KEY (default {DEV_TENANT}, else the "
        "config's first tenant)",
    )


def _add_broker_args(parser: argparse.ArgumentParser) -> None:
    """How the broker runs: with users (--auth), as a cluster (--cluster)."""
    parser.add_argument(
        "--auth",
        action="store_true",
        help="run with broker users: one nkey user per tenant and per part, "
        "rendered into LOG_DIR/auth (printed as AUTH_DIR), and the "
        "dispatcher's tenant inbox check (docs/security.md)",
    )
    parser.add_argument(
        "--cluster",
        action="store_true",
        help="run a 3-node NATS cluster on 127.0.0.1 instead of one server "
        "(free ports, stores in LOG_DIR/nats, every stream and bucket at "
        "3 replicas, fsync on every write); NATS_URL lists the nodes",
    )


def worker_counts(value: str) -> dict[str, int]:
    """`--workers`: N for every endpoint (key ""), or ENDPOINT=N,... for some."""
    try:
        if "=" not in value:
            counts = {"": int(value)}
        else:
            counts = {
                name.strip(): int(count)
                for name, count in (item.split("=", 1) for item in value.split(","))
            }
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or ENDPOINT=N,..., got {value!r}") from None
    if counts.get("", 1) < 1 or min(counts.values()) < 0:
        raise argparse.ArgumentTypeError(
            f"worker counts must be >= 0 (>= 1 for all endpoints at once), got {value!r}"
        )
    return counts


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
    auth = None
    if args.auth:
        config = with_tenant_inboxes(config)
        try:
            auth = render_auth_dir(log_dir / "auth", config.subjects, registered_tenants(config))
        except (ValueError, OSError) as exc:
            return _fail(f"--auth: {exc}", 2)
    try:
        return asyncio.run(run_stack(Plan(args, config, dev_key, log_dir, auth)))
    except (EmbeddedServerError, SupervisorError, StartError) as exc:
        return _fail(str(exc), 1)
    except ConfigError as exc:  # found at start: an endpoint's tokenizer it cannot load
        return _fail(f"{args.config}: {exc}", 2)


def _fail(message: str, code: int) -> int:
    print(f"fairq up: {message}", file=sys.stderr)
    return code


def _log_dir(path: Path | None) -> Path:
    if path is None:
        return Path(tempfile.mkdtemp(prefix="fairq-up-"))
    path = path.resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path
