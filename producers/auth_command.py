"""`fairq auth --config C.toml --out DIR`: the broker's nkey users for a deployment.

Writes DIR/auth.conf (a nats-server config include: `accounts { ... }`, one account per
tenant and one for the front beside fairq's own, public keys only), DIR/users.json and one
seed file DIR/<user>.nk (mode 0600) per user: one per tenant of the config (`[tenants]`
and the front's keys), `fq-dispatcher`, `fq-worker`, `fq-operator` and `fq-front`
(broker_config.auth). Running it again keeps existing seeds and adds or removes tenants'
users; then reload nats-server twice and the dispatchers (docs/security.md).
Exit codes: 0 written, 2 a bad config, tenant name, seed file or a directory not its own.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from broker_config.auth import AUTH_CONF, registered_tenants, render_auth_dir
from broker_config.config import EXAMPLE_CONFIG, ConfigError, load_config
from broker_config.subjects import SubjectError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "auth",
        help="render the broker's users (nkeys) from the config's tenants",
        description="Write a nats-server config include with one nkey user per tenant and "
        "per fairq service, each tenant and the front in a NATS account of its "
        "own, and their seed files, into a directory. Existing seeds are kept; "
        "include the file in nats-server's config (or run it with "
        f"`-c DIR/{AUTH_CONF} -js`). After a re-render, reload nats-server twice "
        "(a new tenant's imports work after the second), then the dispatchers "
        "(`fairq reload`).",
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=EXAMPLE_CONFIG,
        metavar="FILE",
        help="the fairq config whose tenants get broker users (default: configs/example.toml)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        required=True,
        metavar="DIR",
        help="the directory to write (made mode 0700 if missing)",
    )
    parser.set_defaults(run=run_auth)


def run_auth(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
        rendered = render_auth_dir(args.out, config.subjects, registered_tenants(config))
    except (ConfigError, SubjectError, ValueError, OSError) as exc:
        print(f"fairq auth: {exc}", file=sys.stderr)
        return 2
    for name in rendered.added:
        print(f"fairq auth: new user {name}: {rendered.seeds[name]}", file=sys.stderr)
    for name in rendered.removed:
        print(f"fairq auth: removed user {name}", file=sys.stderr)
    print(f"AUTH_CONF={rendered.config}")
    print(f"AUTH_DIR={rendered.directory}")
    return 0
