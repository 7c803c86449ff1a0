"""`fairq up`'s options, in groups: the system, the broker, the workers, the front."""

from __future__ import annotations

import argparse
from pathlib import Path

from broker_config.config import EXAMPLE_CONFIG

DEV_TENANT = "acme"
DISPATCHER_LOG = "dispatcher.log"  # in the log directory, beside the workers' logs


def add_options(parser: argparse.ArgumentParser) -> None:
    _add_system_options(parser.add_argument_group("system"))
    _add_broker_options(parser.add_argument_group("broker"))
    _add_worker_options(parser.add_argument_group("workers"))
    _add_front_options(parser.add_argument_group("OpenAI-compatible front"))


def _add_system_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--config",
        type=Path,
        default=EXAMPLE_CONFIG,
        metavar="FILE",
        help="the fairq config: endpoints, tiers, tenants, limits (default: configs/example.toml)",
    )
    group.add_argument(
        "--redis-url",
        help="use Redis for rate limits and quotas (default: "
        "in process, monthly usage kept in a NATS KV bucket)",
    )
    group.add_argument(
        "--metrics-port",
        type=int,
        default=9464,
        help="the dispatcher's /metrics and /dashboard port on 127.0.0.1 (default 9464, or "
        "a free one if that is taken; printed in METRICS_URL and DASHBOARD_URL)",
    )
    group.add_argument(
        "--log-dir",
        type=Path,
        help=f"the dispatcher's log ({DISPATCHER_LOG}) and each worker's output (<worker "
        "id>.log) (default: a new temporary directory, printed as LOG_DIR and kept)",
    )


def _add_broker_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--port",
        type=int,
        default=0,
        help="NATS port on 127.0.0.1 (default: a free one, printed as NATS_URL)",
    )
    group.add_argument(
        "--auth",
        action="store_true",
        help="run with broker users: one nkey user per tenant and per part, "
        "rendered into LOG_DIR/auth (printed as AUTH_DIR), and the "
        "dispatcher's tenant inbox check (docs/security.md)",
    )
    group.add_argument(
        "--cluster",
        action="store_true",
        help="run a 3-node NATS cluster on 127.0.0.1 instead of one server "
        "(free ports, stores in LOG_DIR/nats, every stream and bucket at "
        "3 replicas, fsync on every write); NATS_URL lists the nodes",
    )


def _add_worker_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--workers",
        type=worker_counts,
        default={"": 2},
        metavar="N | ENDPOINT=N,...",
        help="simulated worker processes per endpoint (default 2); a list "
        "sets endpoints apart, those not in it get 1 "
        "(chat=3,embed=0: embed gets none)",
    )
    group.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiplies simulated engine time (0.1 = ten times faster)",
    )
    group.add_argument(
        "--autoscale",
        action="store_true",
        help="start and stop worker processes as the dispatcher's autoscaler "
        "decides; endpoints without their own [endpoints.<name>.autoscale] "
        "get 1 to --max-workers workers, a 5 s cold start and a 60 s "
        "quiet window",
    )
    group.add_argument(
        "--max-workers",
        type=int,
        default=4,
        help="with --autoscale: the default most workers per endpoint (default 4)",
    )


def _add_front_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--front-port",
        type=int,
        help="the OpenAI-compatible front's port on [front] host (default: "
        "[front] port, or a free one if that is taken; printed in "
        "OPENAI_BASE_URL)",
    )
    group.add_argument(
        "--front-tenant",
        default=DEV_TENANT,
        help=f"the tenant of the development API key made at start and "
        f"printed as OPENAI_API_KEY (default {DEV_TENANT}, else the "
        "config's first tenant)",
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
