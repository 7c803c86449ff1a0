"""What the commands that talk to the dispatcher share (`fairq submit | status | cancel |
top | reload`): the connection options, argument types, the client they connect, and the
runner that turns a failure into one line on stderr and exit code 2.

Exit codes: 0 success; 1 the command ran and what it asked for failed (each command's
module says when); 2 the command could not do what was asked (no server, no dispatcher,
invalid input), reported as one line on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Awaitable, Callable

from broker_config.connection import ConnectionOptionsError, add_connection_args, connect_options
from broker_config.subjects import TOKEN_PATTERN, is_token
from producers.client import Client, Connecting
from producers.errors import FairqError

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
EXIT_FAILED = 1
EXIT_ERROR = 2

Main = Callable[[argparse.Namespace], Awaitable[int]]


def connection_options() -> argparse.ArgumentParser:
    """A parent parser with the options that reach the broker and the dispatcher."""
    parser = argparse.ArgumentParser(add_help=False)
    group = parser.add_argument_group("connection")
    group.add_argument(
        "--nats",
        metavar="URL",
        default=os.environ.get("NATS_URL", DEFAULT_NATS_URL),
        help="NATS server (default: $NATS_URL, else %(default)s)",
    )
    add_connection_args(group)
    group.add_argument(
        "--prefix", type=subject_token, default="fq", help="subject prefix (default fq)"
    )
    group.add_argument(
        "--timeout",
        type=positive_float,
        default=5.0,
        metavar="S",
        help="seconds to wait for the broker's or dispatcher's answer (default 5)",
    )
    return parser


def subject_token(text: str) -> str:
    """An argument that becomes one token of a subject (a tenant, an endpoint, a prefix)."""
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
        except FairqError as exc:
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


def write(text: str) -> None:
    """Text to stdout, at once (a streamed answer, a refreshed screen)."""
    sys.stdout.write(text)
    sys.stdout.flush()
