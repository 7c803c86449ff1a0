"""Run a dispatcher: `python -m dispatcher --nats URL [--config C.toml] [--redis-url URL]`.

The dispatcher provisions the broker (idempotently) on start. SIGTERM or SIGINT drains
it (see `dispatcher.service`) and exits 0; a bad config exits 2; a broker that cannot be
reached exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

import nats
import nats.errors

from dispatcher.core.config import EXAMPLE_CONFIG, ConfigError, load_config
from dispatcher.metrics import DispatcherMetrics
from dispatcher.redis_limits import limiter_from_url
from dispatcher.service import Dispatcher, DispatcherOptions

log = logging.getLogger("fairq.dispatcher")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dispatcher",
                                     description="Run a fairq dispatcher.")
    parser.add_argument("--nats", default="nats://127.0.0.1:4222", metavar="URL")
    parser.add_argument("--config", type=Path, default=EXAMPLE_CONFIG)
    parser.add_argument("--redis-url", help="Redis for rate limits (default: in-process)")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus /metrics on PORT (0: a free port)")
    parser.add_argument("--metrics-host", default="127.0.0.1",
                        help="address for /metrics (0.0.0.0 inside a container)")
    parser.add_argument("--ack-wait", type=float, default=60.0, metavar="S",
                        help="JetStream ack wait; held requests are extended every third")
    parser.add_argument("--grace", type=float, default=30.0, metavar="S",
                        help="on SIGTERM, how long running requests may finish")
    defaults = DispatcherOptions()
    parser.add_argument("--tenant-window", type=int, default=defaults.tenant_window, metavar="N",
                        help="waiting requests per tenant held in memory; the rest stay in "
                             "the stream")
    parser.add_argument("--max-held-per-tenant", type=int, default=defaults.max_ack_pending,
                        metavar="N", help="requests per tenant held at all, waiting or running "
                                          "(must exceed what one tenant may run at once)")
    return parser


async def serve(args: argparse.Namespace, options: DispatcherOptions) -> int:
    config = load_config(args.config)
    metrics = DispatcherMetrics(list(config.endpoints))
    if args.metrics_port is not None:
        port = metrics.serve(args.metrics_port, args.metrics_host)
        print(f"METRICS_URL=http://{args.metrics_host}:{port}/metrics", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        nc = await nats.connect(args.nats, name="fairq-dispatcher", connect_timeout=5,
                                max_reconnect_attempts=-1)
    except (OSError, nats.errors.NoServersError) as exc:
        print(f"fairq dispatcher: cannot reach NATS at {args.nats}: {exc}", file=sys.stderr)
        return 1
    limiter = limiter_from_url(args.redis_url)
    try:
        async with Dispatcher(nc, config, limiter=limiter, options=options, metrics=metrics):
            print("fairq dispatcher: running", flush=True)
            await stop.wait()
            log.info("draining")
    finally:
        await limiter.aclose()
        await nc.drain()
        metrics.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        options = DispatcherOptions(ack_wait_s=args.ack_wait, grace_s=args.grace,
                                    tenant_window=args.tenant_window,
                                    max_ack_pending=args.max_held_per_tenant)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        return asyncio.run(serve(args, options))
    except ConfigError as exc:
        print(f"fairq dispatcher: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
