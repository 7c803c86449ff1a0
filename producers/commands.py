"""`fairq submit | status | cancel | top | reload`: the producer side of the command line.

Exit codes: 0 success; 1 the request ended with an error event (for reload: a dispatcher
refused the file, or too few answered); 2 the command could not do
what was asked (no server, no dispatcher, invalid input), reported as one line on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import msgspec

from broker_config.connection import (
    ConnectionOptionsError,
    add_connection_args,
    connect_options,
    has_credentials,
)
from broker_config.subjects import TOKEN_PATTERN, Subjects, is_token
from broker_config.wire import (
    DepthEntry,
    DepthReply,
    DoneEvent,
    Encoding,
    ErrorEvent,
    TokenEvent,
)
from producers.admin import reload_dispatchers, tenant_changes
from producers.client import Client, Connecting
from producers.errors import ApiError, FairqError, FairqTimeout, NoDispatcher, RequestFailed
from producers.submission import Submitted

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
EXIT_FAILED = 1
EXIT_ERROR = 2
CLEAR_SCREEN = "\x1b[H\x1b[2J"

Main = Callable[[argparse.Namespace], Awaitable[int]]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register submit, status, cancel, top and reload (one module, five commands)."""
    connection = _connection_options()
    tenant = _tenant_options()
    _add_submit(subparsers, [connection, tenant])
    _add_status(subparsers, [connection, tenant])
    _add_cancel(subparsers, [connection, tenant])
    _add_top(subparsers, [connection])
    _add_reload(subparsers, [connection])


# -- arguments -----------------------------------------------------------------------------


def _connection_options() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    group = parser.add_argument_group("connection")
    group.add_argument(
        "--nats",
        metavar="URL",
        default=os.environ.get("NATS_URL", DEFAULT_NATS_URL),
        help="NATS server (default: $NATS_URL, else %(default)s)",
    )
    add_connection_args(group)
    group.add_argument("--prefix", type=_token, default="fq", help="subject prefix (default fq)")
    group.add_argument(
        "--timeout",
        type=_positive_float,
        default=5.0,
        metavar="S",
        help="seconds to wait for the broker's or dispatcher's answer (default 5)",
    )
    return parser


def _tenant_options() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--tenant", type=_token, required=True)
    parser.add_argument(
        "--tenant-inbox",
        action="store_true",
        help="use the tenant's own inbox prefix (brokers with per-tenant "
        "users; implied by any credentials)",
    )
    return parser


def _token(text: str) -> str:
    if not is_token(text):
        raise argparse.ArgumentTypeError(f"{text!r} must match {TOKEN_PATTERN}")
    return text


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _messages(text: str) -> list[object]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, list):
        raise argparse.ArgumentTypeError(
            'must be a JSON list like [{"role":"user","content":"Hi"}]'
        )
    return value


def _add_submit(
    subparsers: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]
) -> None:
    parser = subparsers.add_parser(
        "submit",
        parents=parents,
        help="submit a request and stream its answer",
        description="Submit a request. The answer's text streams to stdout as tokens arrive; "
        "a summary (usage, timings) goes to stderr.",
    )
    parser.add_argument("--endpoint", type=_token, required=True)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the input text")
    source.add_argument(
        "--messages",
        type=_messages,
        metavar="JSON",
        help='chat input: [{"role":"user","content":"..."}]',
    )
    parser.add_argument("--max-tokens", type=int, metavar="N")
    parser.add_argument(
        "--priority",
        type=int,
        default=0,
        metavar="N",
        help="higher is served first, inside the tenant's share (default 0)",
    )
    parser.add_argument(
        "--deadline-in",
        type=_positive_float,
        metavar="S",
        help="drop the request if it has not started within S seconds",
    )
    parser.add_argument("--session", help="affinity key for sticky routing")
    parser.add_argument("--id", help="request id (default: a random one)")
    parser.add_argument("--msgpack", action="store_true", help="send and receive msgpack")
    parser.add_argument(
        "--no-wait",
        action="store_true",
        help="print the request id and exit; collect it later with `fairq status`",
    )
    parser.add_argument(
        "--idle-timeout",
        type=_positive_float,
        default=300.0,
        metavar="S",
        help="give up when no event arrives for S seconds (default 300)",
    )
    parser.set_defaults(run=_runner("submit", _submit))


def _add_status(
    subparsers: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]
) -> None:
    parser = subparsers.add_parser(
        "status",
        parents=parents,
        help="a request's state and, once finished, its result",
        description="Print a request's status as JSON (the final event under `result`).",
    )
    parser.add_argument("id")
    parser.set_defaults(run=_runner("status", _status))


def _add_cancel(
    subparsers: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]
) -> None:
    parser = subparsers.add_parser(
        "cancel",
        parents=parents,
        help="cancel a request",
        description="Cancel a request and print the answer as JSON.",
    )
    parser.add_argument("id")
    parser.set_defaults(run=_runner("cancel", _cancel))


def _add_top(
    subparsers: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]
) -> None:
    parser = subparsers.add_parser(
        "top",
        parents=parents,
        help="live per-tenant queue table",
        description="Show queued and running requests per endpoint, tier and tenant, "
        "refreshing in place until Ctrl-C.",
    )
    parser.add_argument(
        "--interval",
        type=_positive_float,
        default=1.0,
        metavar="S",
        help="seconds between refreshes (default 1)",
    )
    parser.add_argument("--once", action="store_true", help="print one table and exit")
    parser.set_defaults(run=_runner("top", _top, interrupted=0))


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
        type=_positive_int,
        metavar="N",
        help="how many dispatchers run: stop waiting once N answered, and "
        "fail if fewer did (default: wait the whole --timeout)",
    )
    parser.set_defaults(run=_runner("reload", _reload))


# -- running -------------------------------------------------------------------------------


def _runner(
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


def _connect(args: argparse.Namespace, *, tenant: str | None = None) -> Connecting:
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


def _tenant_inbox(args: argparse.Namespace) -> str | None:
    """The tenant, when replies must use its inbox: a tenant's own broker user may read
    nothing else, and a dispatcher with `--tenant-inboxes` takes nothing else. Any
    credentials imply it, since a full-access user may read a tenant's inbox too."""
    return args.tenant if args.tenant_inbox or has_credentials(args) else None


# -- submit --------------------------------------------------------------------------------


async def _submit(args: argparse.Namespace) -> int:
    deadline = None if args.deadline_in is None else time.time() + args.deadline_in
    async with _connect(args, tenant=_tenant_inbox(args)) as client:
        submitted = await client.submit(
            args.endpoint,
            args.tenant,
            prompt=args.prompt,
            messages=args.messages,
            max_tokens=args.max_tokens,
            priority=args.priority,
            deadline=deadline,
            session=args.session,
            id=args.id,
            reply=not args.no_wait,
            encoding=Encoding.MSGPACK if args.msgpack else Encoding.JSON,
        )
        if submitted.duplicate:
            print(
                f"fairq submit: request {submitted.id} was already submitted (deduplicated)",
                file=sys.stderr,
            )
        if args.no_wait:
            print(submitted.id)
            return 0
        return await _print_answer(client, submitted, args.idle_timeout)


async def _print_answer(client: Client, submitted: Submitted, idle_timeout_s: float) -> int:
    """Stream the text to stdout; the summary or the error to stderr."""
    printed = ""
    events = client.stream(submitted, timeout_s=idle_timeout_s)
    async with contextlib.aclosing(events):
        try:
            async for event in events:
                if isinstance(event, TokenEvent):
                    _write(event.text)
                    printed += event.text
                elif isinstance(event, DoneEvent):
                    # The full text is authoritative: print what the tokens did not cover.
                    _write(event.text[len(printed) :] if event.text.startswith(printed) else "")
                    _write("\n")
                    print(_summary(event), file=sys.stderr)
                    return 0
                elif isinstance(event, ErrorEvent):
                    if printed:
                        _write("\n")
                    print(f"fairq submit: {RequestFailed(event)}", file=sys.stderr)
                    return EXIT_FAILED
        except FairqTimeout as exc:
            raise FairqTimeout(
                f"{exc}; the request is kept: collect its result later with "
                f"`fairq status --tenant {submitted.tenant} {submitted.id}`"
            ) from exc
    raise FairqError(f"the events of request {submitted.id} ended without a final event")


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _summary(done: DoneEvent) -> str:
    usage, timings = done.usage, done.timings
    ttft = "-" if timings.ttft_s is None else f"{timings.ttft_s:.3f}s"
    return (
        f"done id={done.id} input_tokens={usage.input_tokens} "
        f"output_tokens={usage.output_tokens} model_units={usage.model_units:g} "
        f"queued={timings.queued_s:.3f}s ttft={ttft} total={timings.total_s:.3f}s"
    )


# -- status, cancel ------------------------------------------------------------------------


async def _status(args: argparse.Namespace) -> int:
    async with _connect(args, tenant=_tenant_inbox(args)) as client:
        print(msgspec.json.encode(await client.status(args.tenant, args.id)).decode())
    return 0


async def _cancel(args: argparse.Namespace) -> int:
    async with _connect(args, tenant=_tenant_inbox(args)) as client:
        print(msgspec.json.encode(await client.cancel(args.tenant, args.id)).decode())
    return 0


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
    async with _connect(args) as client:
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
            _write(f"{CLEAR_SCREEN}{screen}\n")
            await asyncio.sleep(args.interval)


# -- reload --------------------------------------------------------------------------------


async def _reload(args: argparse.Namespace) -> int:
    async with _connect(args) as client:
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
