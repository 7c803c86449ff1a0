"""`fairq submit | status | cancel`: one request, by its tenant. Exit codes: see
`producers.cli_options`."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import sys
import time
from pathlib import Path

import msgspec

from broker_config.config import Config
from broker_config.wire import DoneEvent, Encoding, ErrorEvent, TokenEvent
from producers.cli_options import (
    EXIT_ERROR,
    EXIT_FAILED,
    Main,
    chat_messages,
    config_options,
    connect,
    connection_options,
    local_config,
    positive_float,
    runner,
    tenant_inbox,
    tenant_options,
    token,
    write,
)
from producers.client import Client
from producers.errors import FairqError, FairqTimeout, RequestFailed
from producers.submission import Submitted

EXIT_UNKNOWN = 3  # `fairq status`: no such request
EMBEDDING_HEAD = 8  # values of a vector shown by `fairq submit`


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register submit, status and cancel."""
    parents = [connection_options(), tenant_options()]
    _add_submit(subparsers, parents)
    _add_lookup(
        subparsers,
        parents,
        "status",
        _status,
        help="a request's state and, once finished, its result",
        description="Print a request's status as JSON (the final event under `result`). "
        f"Exit codes: 0 the request is known; {EXIT_UNKNOWN} no request with this id for "
        f"this tenant (the JSON says state unknown; a line on stderr); {EXIT_ERROR} no "
        "answer (no server or dispatcher, invalid input).",
    )
    _add_lookup(
        subparsers,
        parents,
        "cancel",
        _cancel,
        help="cancel a request",
        description="Cancel a request and print the answer as JSON (`cancelled` is false "
        "for a request unknown or already finished).",
    )


def _add_submit(
    subparsers: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]
) -> None:
    parser = subparsers.add_parser(
        "submit",
        parents=[*parents, config_options("to warn of a tenant it does not list")],
        help="submit a request and stream its answer",
        description="Submit a request. The answer's text streams to stdout as tokens arrive "
        "(an embedding endpoint's vector: its dimension and first values; `fairq status` "
        "prints it whole); a summary (usage, timings) goes to stderr.",
    )
    parser.add_argument(
        "--endpoint",
        type=token,
        required=True,
        help="where the request goes: a name under [endpoints] in the config (chat, embed)",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the input text")
    source.add_argument(
        "--messages",
        type=chat_messages,
        metavar="JSON",
        help='chat input: [{"role":"user","content":"..."}]',
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        metavar="N",
        help="most tokens to generate (default: the endpoint's max_tokens_cap, 1024 on chat "
        "in configs/example.toml)",
    )
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


def _add_lookup(
    subparsers: argparse._SubParsersAction,
    parents: list[argparse.ArgumentParser],
    name: str,
    main: Main,
    **texts: str,
) -> None:
    """status and cancel: a request named by its tenant and id."""
    parser = subparsers.add_parser(name, parents=parents, **texts)
    parser.add_argument("id", help="the request's id, as `fairq submit --no-wait` printed it")
    parser.set_defaults(run=runner(name, main))


# -- submit --------------------------------------------------------------------------------


async def _submit(args: argparse.Namespace) -> int:
    found = local_config(args)
    if found is not None and (warning := unlisted_tenant_warning(*found, args.tenant)):
        print(f"fairq submit: warning: {warning}", file=sys.stderr)
    deadline = None if args.deadline_in is None else time.time() + args.deadline_in
    async with connect(args, tenant=tenant_inbox(args)) as client:
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


def unlisted_tenant_warning(path: Path, config: Config, tenant: str) -> str | None:
    """What a dispatcher running `config` does with a tenant it does not list (a typo is
    admitted silently under the `admit` policy); None for a listed tenant."""
    if tenant in config.tenants:
        return None
    unlisted = config.unlisted_tenants
    fate = (
        f"the dispatcher admits it as an unlisted tenant, tier {unlisted.tier!r}"
        if unlisted.policy == "admit"
        else "the dispatcher rejects it (unknown_tenant)"
    )
    close = difflib.get_close_matches(tenant, config.tenants, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"tenant {tenant!r} is not listed in {path}: {fate}{hint}"


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
                    write(_rest_of_answer(event, printed) + "\n")
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


def _rest_of_answer(done: DoneEvent, printed: str) -> str:
    """What the token events did not print: the full text is authoritative; an embedding
    endpoint's answer is its vector, which has no token events."""
    if done.embedding is not None:
        return embedding_line(done.embedding)
    return done.text[len(printed) :] if done.text.startswith(printed) else ""


def embedding_line(vector: list[float]) -> str:
    """A vector as one readable line: its dimension and first values."""
    head = ", ".join(f"{value:.4g}" for value in vector[:EMBEDDING_HEAD])
    more = ", ..." if len(vector) > EMBEDDING_HEAD else ""
    return f"embedding of {len(vector)} dimensions: [{head}{more}]"


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
    async with connect(args, tenant=tenant_inbox(args)) as client:
        reply = await client.status(args.tenant, args.id)
    print(msgspec.json.encode(reply).decode())
    if reply.state == "unknown":
        print(
            f"fairq status: no request {args.id!r} of tenant {args.tenant!r}: never submitted "
            "under this tenant, or finished longer ago than the results are kept "
            "([broker] results_ttl_s)",
            file=sys.stderr,
        )
        return EXIT_UNKNOWN
    return 0


async def _cancel(args: argparse.Namespace) -> int:
    async with connect(args, tenant=tenant_inbox(args)) as client:
        print(msgspec.json.encode(await client.cancel(args.tenant, args.id)).decode())
    return 0
