"""Run a dispatcher: `python -m dispatcher --nats URL [--config C.toml] [--redis-url URL]`.

Settings come from the config file (`[dispatcher]`, `[broker]`); the flags below override
single fields of `[dispatcher]`. Credentials: `broker_config.connection` (`--nkey` with
`fairq auth`'s `fq-dispatcher.nk`, plus `--tenant-inboxes` on a broker with tenant users).
The dispatcher provisions the broker (idempotently) on start. SIGHUP (or `fairq reload`)
re-reads the config file's tenants, tiers and limits (dispatcher/api/reload.py). SIGTERM or
SIGINT drains it (see `dispatcher.service`) and exits 0; a bad config or flag exits 2; a
broker that cannot be reached exits 1.

Any number may run: each takes the deployment's lease before dispatching
(`[dispatcher] lease_ttl_s`, dispatcher/ha/lease.py) and stands by while another holds it.
One that loses its lease (it was paused past it) drains at once and stands by again.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

import msgspec
import nats
import nats.errors

from broker_config.config import (
    DEFAULT_NATS_URL,
    EXAMPLE_CONFIG,
    BrokerSettings,
    Config,
    ConfigError,
    DispatcherOptions,
    load_config,
)
from broker_config.connection import (
    ConnectionOptionsError,
    add_connection_args,
    connect_options,
    server_urls,
)
from broker_config.runtime import freeze_startup_heap
from dispatcher.admission.kv_store import open_limiter_store
from dispatcher.admission.redis_store import LimiterUnavailable
from dispatcher.api.http import HttpApi
from dispatcher.api.reload import install_reload_signal
from dispatcher.ha.lease import Lease, holder_id
from dispatcher.ha.tenures import Tenures
from dispatcher.observe.metrics import DispatcherMetrics
from dispatcher.service import Dispatcher

# Flag -> the `[dispatcher]` field it overrides.
OVERRIDES = {
    "ack_wait": "ack_wait_s",
    "grace": "grace_s",
    "tenant_window": "tenant_window",
    "max_held_per_tenant": "max_ack_pending",
    "max_held_per_shard": "max_held_per_shard",
    "tenant_inboxes": "tenant_inboxes",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dispatcher", description="Run a fairq dispatcher."
    )
    parser.add_argument("--nats", default=DEFAULT_NATS_URL, metavar="URL")
    add_connection_args(parser)
    parser.add_argument("--config", type=Path, default=EXAMPLE_CONFIG)
    parser.add_argument(
        "--redis-url",
        help="Redis for rate limits and quotas (default: in "
        "process, monthly usage kept in a NATS KV bucket)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus /metrics on PORT (0: a free port)",
    )
    parser.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address for /metrics (0.0.0.0 inside a container)",
    )
    _add_overrides(parser)
    return parser


def _add_overrides(parser: argparse.ArgumentParser) -> None:
    """The flags that override a field of `[dispatcher]` or `[broker]` (`with_flags`)."""
    defaults = DispatcherOptions()
    parser.add_argument(
        "--ack-wait",
        type=float,
        metavar="S",
        help="JetStream ack wait; held requests are extended every third "
        f"(default: [dispatcher] ack_wait_s, {defaults.ack_wait_s:g})",
    )
    parser.add_argument(
        "--grace",
        type=float,
        metavar="S",
        help="on SIGTERM, how long running requests may finish "
        f"(default: [dispatcher] grace_s, {defaults.grace_s:g})",
    )
    parser.add_argument(
        "--tenant-window",
        type=int,
        metavar="N",
        help="waiting requests per tenant held in memory; the rest stay in "
        f"the stream (default: [dispatcher] tenant_window, "
        f"{defaults.tenant_window})",
    )
    parser.add_argument(
        "--max-held-per-tenant",
        type=int,
        metavar="N",
        help="a parked tenant's requests held at all, waiting or running; "
        "must exceed what one tenant may run at once (default: "
        f"[dispatcher] max_ack_pending, {defaults.max_ack_pending})",
    )
    parser.add_argument(
        "--max-held-per-shard",
        type=int,
        metavar="N",
        help="requests of one shard of the requests stream held at all, "
        "waiting or running (default: [dispatcher] max_held_per_shard, "
        f"{defaults.max_held_per_shard})",
    )
    parser.add_argument(
        "--tenant-inboxes",
        action="store_const",
        const=True,
        help="a request's Fq-Reply must lie in its tenant's own inbox, else it "
        "is refused invalid_request: for brokers with per-tenant users "
        "(`fairq auth`) (default: [dispatcher] tenant_inboxes, "
        f"{str(defaults.tenant_inboxes).lower()})",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        metavar="N",
        help="copies of the requests stream and of every bucket, one per "
        "node of a NATS cluster (3 on three nodes; raised, never "
        "lowered, on streams that exist) (default: [broker] replicas, "
        f"{BrokerSettings().replicas})",
    )


def with_flags(config: Config, args: argparse.Namespace) -> Config:
    """`config` with the `[dispatcher]` and `[broker]` fields the flags set. Raises
    ConfigError."""
    fields = {
        field: getattr(args, flag)
        for flag, field in OVERRIDES.items()
        if getattr(args, flag) is not None
    }
    try:
        if fields:
            config = msgspec.structs.replace(
                config,
                dispatcher=msgspec.convert(
                    msgspec.to_builtins(config.dispatcher) | fields, DispatcherOptions
                ),
            )
        if args.replicas is not None:
            config = msgspec.structs.replace(
                config,
                broker=msgspec.convert(
                    msgspec.to_builtins(config.broker) | {"replicas": args.replicas}, BrokerSettings
                ),
            )
    except (msgspec.ValidationError, ValueError) as exc:
        raise ConfigError(f"command line: {exc}") from exc
    return config


async def serve(args: argparse.Namespace, config: Config) -> int:
    metrics = DispatcherMetrics(list(config.endpoints))
    http = HttpApi(metrics)
    if args.metrics_port is not None:
        port = http.serve(args.metrics_port, args.metrics_host)
        print(f"METRICS_URL=http://{args.metrics_host}:{port}/metrics", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        nc = await nats.connect(
            server_urls(args.nats),
            name="fairq-dispatcher",
            connect_timeout=5,
            max_reconnect_attempts=-1,
            **connect_options(args),
        )
    except (OSError, nats.errors.NoServersError) as exc:
        print(f"fairq dispatcher: cannot reach NATS at {args.nats}: {exc}", file=sys.stderr)
        return 1
    try:
        limiter = await open_limiter_store(args.redis_url, nc, config)
    except LimiterUnavailable as exc:
        print(f"fairq dispatcher: {exc}", file=sys.stderr)
        await nc.close()
        return 1
    lease_ttl_s = config.dispatcher.lease_ttl_s
    tenures = Tenures(
        nc,
        config,
        lease=Lease(holder_id(), ttl_s=lease_ttl_s) if lease_ttl_s else None,
        on_running=_running,
        limiter=limiter,
        metrics=metrics,
        http=http,
        config_path=args.config,
    )
    install_reload_signal(loop, lambda: tenures.current)
    try:
        await tenures.run(stop)
    except ConfigError as exc:  # found at start: an endpoint's tokenizer it cannot load
        print(f"fairq dispatcher: {args.config}: {exc}", file=sys.stderr)
        return 2
    finally:
        await limiter.aclose()
        await nc.drain()
        http.close()
    return 0


def _running(_: Dispatcher) -> None:
    freeze_startup_heap()
    print("fairq dispatcher: running", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = with_flags(load_config(args.config), args)
        connect_options(args)
    except (ConfigError, ConnectionOptionsError) as exc:
        print(f"fairq dispatcher: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    return asyncio.run(serve(args, config))


if __name__ == "__main__":
    sys.exit(main())
