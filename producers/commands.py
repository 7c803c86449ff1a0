"""`fairq top | reload`: the operator's view of the queues, and config reloads. Exit codes:
see `producers.cli_options`."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from broker_config.subjects import Subjects
from broker_config.wire import DepthEntry, DepthReply
from producers.admin import reload_dispatchers, tenant_changes
from producers.cli_options import (
    EXIT_FAILED,
    config_options,
    connect,
    connection_options,
    local_config,
    positive_float,
    positive_int,
    runner,
    write,
)
from producers.errors import ApiError, FairqTimeout, NoDispatcher

CLEAR_SCREEN = "\x1b[H\x1b[2J"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register top and reload."""
    connection = connection_options()
    _add_top(subparsers, [connection, config_options("to list tiers in its order")])
    _add_reload(subparsers, [connection])


def _add_top(
    subparsers: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]
) -> None:
    parser = subparsers.add_parser(
        "top",
        parents=parents,
        help="live per-tenant queue table",
        description="Show queued and running requests per endpoint, tier and tenant "
        "(tiers in the config's order, highest first), refreshing in place until Ctrl-C.",
    )
    parser.add_argument(
        "--interval",
        type=positive_float,
        default=1.0,
        metavar="S",
        help="seconds between refreshes (default 1)",
    )
    parser.add_argument("--once", action="store_true", help="print one table and exit")
    parser.set_defaults(run=runner("top", _top, interrupted=0))


def _add_reload(
    subparsers: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]
) -> None:
    parser = subparsers.add_parser(
        "reload",
        parents=parents,
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
        type=positive_int,
        metavar="N",
        help="how many dispatchers run: stop waiting once N answered, and "
        "fail if fewer did (default: wait the whole --timeout)",
    )
    parser.set_defaults(run=runner("reload", _reload))


# -- top -----------------------------------------------------------------------------------

QueueKey = tuple[str, str, str]  # endpoint, tier, tenant


def _key(entry: DepthEntry) -> QueueKey:
    return entry.endpoint, entry.tier, entry.tenant


@dataclass(frozen=True, slots=True)
class Change:
    """Per-second rates of a queue since the last sample."""

    admitted_per_s: float
    rejected_per_s: float


class DepthTrend:
    """Remembers the previous depth sample to turn cumulative counts into rates.

    A queue missing from the earlier sample counted zero then.
    """

    def __init__(self) -> None:
        self._last: tuple[float, dict[QueueKey, DepthEntry]] | None = None

    def update(self, reply: DepthReply, now: float) -> dict[QueueKey, Change]:
        """Changes since the previous sample (none for the first one)."""
        current = {_key(entry): entry for entry in reply.queues}
        last, self._last = self._last, (now, current)
        if last is None or now <= last[0]:
            return {}
        elapsed = now - last[0]
        changes = {}
        for key, entry in current.items():
            before = last[1].get(key)
            admitted, rejected = (before.admitted, before.rejected) if before else (0, 0)
            changes[key] = Change(
                max(0, entry.admitted - admitted) / elapsed,
                max(0, entry.rejected - rejected) / elapsed,
            )
        return changes


_COLUMNS = (
    "ENDPOINT",
    "TIER",
    "TENANT",
    "QUEUED",
    "RUNNING",
    "OLDEST WAIT",
    "ADMITTED/S",
    "REJECTED/S",
)
_NUMERIC_FROM = 3  # columns from here on are right-aligned


def render_depth(
    reply: DepthReply,
    changes: Mapping[QueueKey, Change],
    title: str,
    tiers: Sequence[str] = (),
) -> str:
    """The table `fairq top` shows: a title with totals, then one row per queue. Tiers
    come in the order of `tiers` (the config's, highest first, as on the dashboard);
    tiers it does not name follow, by name."""
    rank = {name: n for n, name in enumerate(tiers)}
    entries = sorted(
        reply.queues, key=lambda e: (e.endpoint, rank.get(e.tier, len(rank)), e.tier, e.tenant)
    )
    queued = sum(e.queued for e in entries)
    running = sum(e.running for e in entries)
    lines = [f"{title}  queues={len(entries)} queued={queued} running={running}", ""]
    if not entries:
        return "\n".join([*lines, "(no traffic yet)"])
    rows = [_COLUMNS, *(_row(e, changes.get(_key(e))) for e in entries)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    for row in rows:
        cells = [
            cell.rjust(w) if i >= _NUMERIC_FROM else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _row(entry: DepthEntry, change: Change | None) -> tuple[str, ...]:
    rates = (
        (f"{change.admitted_per_s:.1f}", f"{change.rejected_per_s:.1f}") if change else ("-", "-")
    )
    return (
        entry.endpoint,
        entry.tier,
        entry.tenant,
        str(entry.queued),
        str(entry.running),
        f"{entry.oldest_wait_s:.1f}s",
        *rates,
    )


def _without_credentials(url: str) -> str:
    """The URL as shown on screen: `user:password@` removed."""
    parts = urllib.parse.urlsplit(url)
    if not (parts.username or parts.password):
        return url
    return urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


async def _top(args: argparse.Namespace) -> int:
    found = local_config(args)
    tiers = [tier.name for tier in found[1].tiers] if found else []
    trend = DepthTrend()
    async with connect(args) as client:
        while True:
            title = f"fairq top  {_without_credentials(args.nats)}  {time.strftime('%H:%M:%S')}"
            try:
                reply = await client.depth()
                changes = trend.update(reply, time.monotonic())
                screen = render_depth(reply, changes, title, tiers)
            except (NoDispatcher, FairqTimeout, ApiError) as exc:
                if args.once:
                    raise
                # Live: the dispatcher may come (back) any moment; keep polling.
                screen = f"{title}\n\n{exc}"
            if args.once:
                print(screen)
                return 0
            write(f"{CLEAR_SCREEN}{screen}\n")
            await asyncio.sleep(args.interval)


# -- reload --------------------------------------------------------------------------------


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
