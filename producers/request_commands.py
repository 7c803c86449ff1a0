"""`fairq submit | status | cancel`: one tenant's requests from the command line.

Exit codes: 0 success; 1 the request ended with an error event; 2 the command could not
do what was asked (no server, no dispatcher, invalid input), reported as one line on
stderr (`producers.command_common`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

import msgspec

from broker_config.connection import has_credentials
from broker_config.wire import DoneEvent, Encoding, ErrorEvent, TokenEvent
from producers.client import Client
from producers.command_common import (
    EXIT_FAILED,
    connect,
    connection_options,
    positive_float,
    runner,
    subject_token,
    write,
)
from producers.errors import FairqError, FairqTimeout, RequestFailed
from producers.submission import Submitted


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register submit, status and cancel (one module, three commands)."""
    parents = [connection_options(), _tenant_options()]
    _add_submit(subparsers, parents)
    _add_status(subparsers, parents)
    _add_cancel(subparsers, parents)


# -- arguments -----------------------------------------------------------------------------


def _tenant_options() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--tenant", type=subject_token, required=True)
    parser.add_argument(
        "--tenant-inbox",
        action="store_true",
        help="use the tenant's own inbox prefix (brokers with per-tenant "
        "users; implied by any credentials)",
    )
    return parser


def _tenant_inbox(args: argparse.Namespace) -> str | None:
    """The tenant, when replies must use its inbox: a tenant's own broker user may read
    nothing else, and a dispatcher with `--tenant-inboxes` takes nothing else. Any
    credentials imply it, since a full-access user may read a tenant's inbox too."""
    return args.tenant if args.tenant_inbox or has_credentials(args) else None


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
    parser.add_argument("--endpoint", type=subject_token, required=True)
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
        type=positive_float,
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
        type=positive_float,
        default=300.0,
        metavar="S",
        help="give up when no event arrives for S seconds (default 300)",
    )
    parser.set_defaults(run=runner("submit", _submit))


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
    parser.set_defaults(run=runner("status", _status))


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
    parser.set_defaults(run=runner("cancel", _cancel))


# -- submit --------------------------------------------------------------------------------


async def _submit(args: argparse.Namespace) -> int:
    deadline = None if args.deadline_in is None else time.time() + args.deadline_in
    async with connect(args, tenant=_tenant_inbox(args)) as client:
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
                    write(event.text)
                    printed += event.text
                elif isinstance(event, DoneEvent):
                    # The full text is authoritative: print what the tokens did not cover.
                    write(event.text[len(printed) :] if event.text.startswith(printed) else "")
                    write("\n")
                    print(_summary(event), file=sys.stderr)
                    return 0
                elif isinstance(event, ErrorEvent):
                    if printed:
                        write("\n")
                    print(f"fairq submit: {RequestFailed(event)}", file=sys.stderr)
                    return EXIT_FAILED
        except FairqTimeout as exc:
            raise FairqTimeout(
                f"{exc}; the request is kept: collect its result later with "
                f"`fairq status --tenant {submitted.tenant} {submitted.id}`"
            ) from exc
    raise FairqError(f"the events of request {submitted.id} ended without a final event")


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
    async with connect(args, tenant=_tenant_inbox(args)) as client:
        print(msgspec.json.encode(await client.status(args.tenant, args.id)).decode())
    return 0


async def _cancel(args: argparse.Namespace) -> int:
    async with connect(args, tenant=_tenant_inbox(args)) as client:
        print(msgspec.json.encode(await client.cancel(args.tenant, args.id)).decode())
    return 0
