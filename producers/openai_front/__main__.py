"""`python -m producers.openai_front`: the OpenAI-compatible front alone, beside a running
fairq (its dispatcher provisions the broker; the front only publishes and listens).
On a broker with users it connects as its own front user (`broker_config.connection`'s
flags or FAIRQ_NATS_* variables: `--nkey` with `fairq auth`'s `fq-front.nk`, or a user and
password of `broker_config.auth.build_users`), allowed the tenants it serves; its
requests' events then go to their tenants' own inboxes (as `--tenant-inboxes` on the
dispatcher requires). Its own inbox prefix is `_INBOX_<user>`, `_INBOX_fq-front` with an
nkey or .creds file.

Prints OPENAI_BASE_URL (and OPENAI_API_KEY with `--dev-key-for`) once it serves; SIGINT
or SIGTERM stops it: open requests get DRAIN_S to finish, then the NATS connection
drains. Exit codes: 0 after a stop, 2 for a bad argument or config, 1 when NATS cannot
be reached.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

import msgspec

from broker_config.auth import FRONT_USER, front_inbox_prefix, with_tenant_inboxes
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
from broker_config.subjects import SubjectError
from producers.client import Client
from producers.errors import ConnectionFailed
from producers.openai_front.app import Front
from producers.openai_front.keys import KeyRing, with_dev_key
from producers.openai_front.server import FrontServer


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m producers.openai_front",
        description="Serve fairq's endpoints over an OpenAI-compatible HTTP API.",
    )
    parser.add_argument("--config", type=Path, default=EXAMPLE_CONFIG)
    parser.add_argument("--nats", default=DEFAULT_NATS_URL, metavar="URL")
    add_connection_args(parser)
    parser.add_argument("--host", help="listen address (default: [front] host)")
    parser.add_argument(
        "--port", type=int, help="listen port, 0 for a free one (default: [front] port)"
    )
    parser.add_argument(
        "--dev-key-for",
        metavar="TENANT",
        help="also accept a key made now for TENANT, printed as "
        "OPENAI_API_KEY (for local use; production keys go in [front])",
    )
    return parser


async def serve(config: Config, args: argparse.Namespace, dev_key: str | None) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    user = (args.user or FRONT_USER) if has_credentials(args) else None
    try:
        # A broker user's own inbox: the only one outside its tenants' it may read.
        client = await Client.connect(
            args.nats,
            prefix=config.broker.prefix,
            user=args.user,
            password=args.password,
            creds=args.creds,
            nkey=args.nkey,
            inbox_prefix=front_inbox_prefix(user) if user else None,
        )
    except (ConnectionFailed, SubjectError) as exc:
        print(f"openai front: {exc}", file=sys.stderr)
        return 1
    async with (
        client,
        FrontServer(
            Front(client, config, KeyRing(config.front.keys)), config.front, args.port
        ) as server,
    ):
        print(f"OPENAI_BASE_URL={server.base_url}", flush=True)
        if dev_key is not None:
            print(f"OPENAI_API_KEY={dev_key}", flush=True)
        await stop.wait()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = load_config(args.config)
        if args.host is not None:
            config = msgspec.structs.replace(
                config, front=msgspec.structs.replace(config.front, host=args.host)
            )
        dev_key = None
        if args.dev_key_for is not None:
            config, dev_key = with_dev_key(config, args.dev_key_for)
        connect_options(args)
        if has_credentials(args):
            config = with_tenant_inboxes(config)
    except (ConfigError, ConnectionOptionsError) as exc:
        print(f"openai front: {exc}", file=sys.stderr)
        return 2
    if args.port is not None and not 0 <= args.port <= 65535:
        print(f"openai front: --port must be in 0..65535, got {args.port}", file=sys.stderr)
        return 2
    return asyncio.run(serve(config, args, dev_key))


if __name__ == "__main__":
    sys.exit(main())
