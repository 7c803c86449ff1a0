"""`fairq reload`: every dispatcher re-reads its config file (`producers.admin`), and
prints what each one that answered changed or why it refused.

Exit codes: 0 every dispatcher that answered reloaded, and enough answered; 1 one refused
the file, or too few answered; 2 the command could not do what was asked (no server,
invalid input), reported as one line on stderr (`producers.command_common`).
"""

from __future__ import annotations

import argparse
import sys

from broker_config.subjects import Subjects
from producers.admin import reload_dispatchers, tenant_changes
from producers.command_common import EXIT_FAILED, connect, connection_options, runner


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "reload",
        parents=[connection_options()],
        help="have every dispatcher re-read its config file",
        description="Ask every dispatcher to re-read its config file: tenants, tiers, "
        "weights and limits change without a restart (docs/configuration.md, "
        "Reloading). Prints the answer of every dispatcher that answers within "
        "--timeout; exits 1 if one refused, none answered, or fewer than "
        "--expect. Broker users are separate: re-render them with `fairq auth` "
        "and reload nats-server first.",
    )
    parser.add_argument(
        "--expect",
        type=_positive_int,
        metavar="N",
        help="how many dispatchers run: stop waiting once N answered, and "
        "fail if fewer did (default: wait the whole --timeout)",
    )
    parser.set_defaults(run=runner("reload", _reload))


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


async def _reload(args: argparse.Namespace) -> int:
    async with connect(args) as client:
        replies = await reload_dispatchers(
            client.nc, Subjects(args.prefix), args.timeout, expected=args.expect
        )
    for reply in replies:
        if reply.ok:
            print(f"{reply.dispatcher}: reloaded; {tenant_changes(reply)}")
        else:
            print(
                f"{reply.dispatcher}: refused, its configuration stays: {reply.error}",
                file=sys.stderr,
            )
    if len(replies) < (args.expect or 1):
        print(
            f"fairq reload: {len(replies)} of {args.expect or 'at least 1'} dispatchers "
            f"answered within {args.timeout:g}s",
            file=sys.stderr,
        )
        return EXIT_FAILED
    return EXIT_FAILED if any(not reply.ok for reply in replies) else 0
