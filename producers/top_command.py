"""`fairq top`: queued and running requests per endpoint, tier and tenant, from the
dispatcher's depth call, refreshed in place until Ctrl-C (`render_depth`; `DepthTrend`
turns the cumulative admitted and rejected counts into rates).

Exit codes: 0 after one table (`--once`) or Ctrl-C; 2 the command could not do what was
asked (no server; with `--once`, no dispatcher), reported as one line on stderr
(`producers.command_common`). Live, a missing dispatcher is shown and polled again.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass

from broker_config.wire import DepthEntry, DepthReply
from producers.command_common import connect, connection_options, positive_float, runner, write
from producers.errors import ApiError, FairqTimeout, NoDispatcher

CLEAR_SCREEN = "\x1b[H\x1b[2J"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "top",
        parents=[connection_options()],
        help="live per-tenant queue table",
        description="Show queued and running requests per endpoint, tier and tenant, "
        "refreshing in place until Ctrl-C.",
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


def render_depth(reply: DepthReply, changes: Mapping[QueueKey, Change], title: str) -> str:
    """The table `fairq top` shows: a title with totals, then one row per queue."""
    entries = sorted(reply.queues, key=_key)
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
    trend = DepthTrend()
    async with connect(args) as client:
        while True:
            title = f"fairq top  {_without_credentials(args.nats)}  {time.strftime('%H:%M:%S')}"
            try:
                reply = await client.depth()
                screen = render_depth(reply, trend.update(reply, time.monotonic()), title)
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
