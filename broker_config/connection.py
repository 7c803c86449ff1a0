"""NATS credentials on every fairq command line: one set of flags, one check.

    add_connection_args(parser)             # --user --password --creds --nkey
    nc = await nats.connect(server_urls(url), **connect_options(args))

A URL may name several servers, comma-separated (the nodes of a cluster): the client
connects to any and reconnects to another when one goes away.

A broker with users takes one of: a user and password, a `.creds` file (a user JWT and
its nkey seed, as `nsc` writes them: NATS operator mode), or an nkey seed file (what
`fairq auth` renders). Each flag defaults to an environment variable
(FAIRQ_NATS_USER, FAIRQ_NATS_PASSWORD, FAIRQ_NATS_CREDS, FAIRQ_NATS_NKEY), which keeps
secrets out of process listings.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

ENV = {
    "user": "FAIRQ_NATS_USER",
    "password": "FAIRQ_NATS_PASSWORD",
    "creds": "FAIRQ_NATS_CREDS",
    "nkey": "FAIRQ_NATS_NKEY",
}


def server_urls(url: str) -> list[str]:
    """`nats://a:4222,nats://b:4222` as nats-py takes it: one entry per server."""
    return [part.strip() for part in url.split(",") if part.strip()]


class ConnectionOptionsError(ValueError):
    """Credentials that cannot be used: conflicting, incomplete or unreadable."""


def add_connection_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--user",
        default=os.environ.get(ENV["user"]) or None,
        help=f"NATS user (default: ${ENV['user']})",
    )
    parser.add_argument(
        "--password",
        default=os.environ.get(ENV["password"]) or None,
        help=f"NATS password (default: ${ENV['password']}, which, unlike "
        "this flag, other users of the machine cannot see)",
    )
    parser.add_argument(
        "--creds",
        type=Path,
        metavar="FILE",
        default=os.environ.get(ENV["creds"]) or None,
        help=f"NATS .creds file: user JWT and seed (default: ${ENV['creds']})",
    )
    parser.add_argument(
        "--nkey",
        type=Path,
        metavar="FILE",
        default=os.environ.get(ENV["nkey"]) or None,
        help=f"nkey seed file, as `fairq auth` writes them (default: ${ENV['nkey']})",
    )


def credentials(
    *,
    user: str | None = None,
    password: str | None = None,
    creds: str | Path | None = None,
    nkey: str | Path | None = None,
) -> dict[str, Any]:
    """nats.connect's keyword arguments for these credentials (empty: none).

    Raises ConnectionOptionsError for more than one kind, a password without a user, or
    a file that cannot be read.
    """
    kinds = [
        name
        for name, given in (
            ("--user/--password", user or password),
            ("--creds", creds),
            ("--nkey", nkey),
        )
        if given
    ]
    if len(kinds) > 1:
        raise ConnectionOptionsError(
            f"{' and '.join(kinds)} conflict: give one kind of "
            "NATS credentials (check the FAIRQ_NATS_* variables)"
        )
    if password and not user:
        raise ConnectionOptionsError("--password needs --user")
    if creds:
        return {"user_credentials": _readable(creds, "--creds")}
    if nkey:
        return {"nkeys_seed": _readable(nkey, "--nkey")}
    return {"user": user, "password": password} if user else {}


def connect_options(args: argparse.Namespace) -> dict[str, Any]:
    """`credentials` from the flags `add_connection_args` added."""
    return credentials(user=args.user, password=args.password, creds=args.creds, nkey=args.nkey)


def has_credentials(args: argparse.Namespace) -> bool:
    return bool(args.user or args.creds or args.nkey)


def _readable(path: str | Path, flag: str) -> str:
    try:
        with open(path, "rb") as file:
            if not file.read(1):
                raise ConnectionOptionsError(f"{flag} {path}: the file is empty")
    except OSError as exc:
        raise ConnectionOptionsError(
            f"{flag} {path}: cannot read it: {exc.strerror or exc}"
        ) from None
    return str(path)
