"""What the producer commands share (`fairq submit | status | cancel | top | reload`):
their connection, tenant and config options, argument types, the local config, and the
runner that turns errors into one line on stderr.

Exit codes of every one of them: 0 success; 1 the request ended with an error event (for
reload: a dispatcher refused the file, or too few answered); 2 the command could not do
what was asked (no server, no dispatcher, invalid input, an unreadable config), reported
as one line on stderr. `fairq status` adds 3: no such request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

from broker_config.config import (
    DEFAULT_NATS_URL,
    EXAMPLE_CONFIG,
    Config,
    ConfigError,
    load_config,
)
from broker_config.connection import (
    ConnectionOptionsError,
    add_connection_args,
    connect_options,
    has_credentials,
)
from broker_config.subjects import TOKEN_PATTERN, is_token
from producers.client import Client, Connecting
from producers.errors import FairqError

EXIT_FAILED = 1
EXIT_ERROR = 2

Main = Callable[[argparse.Namespace], Awaitable[int]]


# -- option groups -------------------------------------------------------------------------


def connection_options() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    group = parser.add_argument_group("connection")
    group.add_argument(
        "--nats",
        metavar="URL",
        default=os.environ.get("NATS_URL", DEFAULT_NATS_URL),
        # Never %(default)s: $NATS_URL may hold a user and password.
        help=f"NATS server (default: $NATS_URL, else {DEFAULT_NATS_URL})",
    )
    add_connection_args(group)
    group.add_argument("--prefix", type=token, default="fq", help="subject prefix (default fq)")
    group.add_argument(
        "--timeout",
        type=positive_float,
        default=5.0,
        metavar="S",
        help="seconds to wait for the broker's or dispatcher's answer (default 5)",
    )
    return parser


def tenant_options() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument(
        "--tenant",
        type=token,
        required=True,
        help="the tenant the request is for (a name under [tenants] in the dispatcher's "
        "config; it picks the tier, weight and limits)",
    )
    parser.add_argument(
        "--tenant-inbox",
        action="store_true",
        help="use the tenant's own inbox prefix (brokers with per-tenant "
        "users; implied by any credentials)",
    )
    return parser


def config_options(use: str) -> argparse.ArgumentParser:
    """--config; `use` says what the command reads from it."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help=f"the fairq config the dispatcher runs, {use} (default: "
        "configs/example.toml, what `fairq up` runs, when present)",
    )
    return parser


# -- argument types ------------------------------------------------------------------------


def token(text: str) -> str:
    if not is_token(text):
        raise argparse.ArgumentTypeError(f"{text!r} must match {TOKEN_PATTERN}")
    return text


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def chat_messages(text: str) -> list[object]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, list):
        raise argparse.ArgumentTypeError(
            'must be a JSON list like [{"role":"user","content":"Hi"}]'
        )
    return value


# -- running -------------------------------------------------------------------------------


def runner(
    name: str, main: Main, *, interrupted: int | None = None
) -> Callable[[argparse.Namespace], int]:
    """The command's entry: errors become one line on stderr and exit code 2.

    `interrupted`: the exit code for Ctrl-C, for commands that run until interrupted.
    """

    def run(args: argparse.Namespace) -> int:
        try:
            connect_options(args)  # conflicting or unreadable credentials: a usage error
        except ConnectionOptionsError as exc:
            print(f"fairq {name}: {exc}", file=sys.stderr)
            return EXIT_ERROR
        try:
            return asyncio.run(main(args))
        except (FairqError, ConfigError) as exc:
            print(f"fairq {name}: {exc}", file=sys.stderr)
            return EXIT_ERROR
        except KeyboardInterrupt:
            if interrupted is None:
                raise
            return interrupted

    return run


def connect(args: argparse.Namespace, *, tenant: str | None = None) -> Connecting:
    """The client for a command; fails at once when the server is unreachable."""
    return Client.connect(
        args.nats,
        prefix=args.prefix,
        user=args.user,
        password=args.password,
        creds=args.creds,
        nkey=args.nkey,
        tenant_inboxes=tenant,
        allow_reconnect=False,
        connect_timeout_s=args.timeout,
        publish_timeout_s=args.timeout,
        api_timeout_s=args.timeout,
    )


def tenant_inbox(args: argparse.Namespace) -> str | None:
    """The tenant, when replies must use its inbox: a tenant's own broker user may read
    nothing else, and a dispatcher with `--tenant-inboxes` takes nothing else. Any
    credentials imply it, since a full-access user may read a tenant's inbox too."""
    return args.tenant if args.tenant_inbox or has_credentials(args) else None


def local_config(args: argparse.Namespace) -> tuple[Path, Config] | None:
    """--config, else the example config when this is a checkout (None without one).
    Raises ConfigError for a file that cannot be read or is not a valid config."""
    path = args.config
    if path is None:
        if not EXAMPLE_CONFIG.is_file():  # an install without the repository's configs/
            return None
        path = EXAMPLE_CONFIG
    return path, load_config(path)


def write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
