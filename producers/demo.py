"""`fairq demo`: what fairq is for, in about a minute, against a running `fairq up`.

    fairq up                  # one terminal: prints NATS_URL
    fairq demo                # another, with NATS_URL exported

Three tenants of the example config's free tier share the chat endpoint. First the small
tenants (hooli, umbrella) each send a steady trickle alone: their p95 time to first
token alone. Then the flood tenant (initech) publishes hundreds of requests at once and
the small tenants send the same trickle beside it. The flood stays within its tier's
limits, so it queues rather than being rate limited, and Deficit Round Robin with the
newcomer reserve keeps the small tenants' first tokens close to their solo figure while
the flood gets every slot they leave. What is left of the flood is cancelled at the end.

Printed: each small tenant's p95 TTFT beside the flood against alone, every answer by
outcome, and the flood's share of the service while the small tenants sent (model units,
the endpoint's cost unit) against its weight's share. Exit code 0 when each small tenant
stayed within `TTFT_BOUND` of its solo figure and nothing was rate limited, else 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from broker_config.config import Config
from broker_config.registry import Registry
from broker_config.wire import ErrorEvent
from costmodel.units import ModelProfile
from producers.cli_options import (
    EXIT_FAILED,
    config_options,
    connect,
    connection_options,
    local_config,
    runner,
)
from producers.client import Client
from producers.errors import FairqError

TTFT_BOUND = 2.0  # beside the flood, at most this many times the solo p95
# The small tenants chat with about 500 tokens of context (a system prompt, a document);
# the flood is a batch job of short prompts and long answers.
CHAT_PROMPT = "You are a helpful assistant for a platform team. " * 40 + "What is fair queueing?"
BATCH_PROMPT = "Summarise fair queueing."
Say = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class DemoSettings:
    endpoint: str = "chat"
    flood_tenant: str = "initech"
    small_tenants: tuple[str, ...] = ("hooli", "umbrella")
    flood_requests: int = 600
    flood_max_tokens: int = 192
    small_rate: float = 2.0  # requests per second, each small tenant
    small_max_tokens: int = 32
    solo_s: float = 10.0
    beside_s: float = 25.0


QUICK = DemoSettings(flood_requests=250, flood_max_tokens=128, solo_s=5.0, beside_s=8.0)


@dataclass(frozen=True, slots=True)
class Answer:
    """One request as its final event told it (times in seconds, wall clock). Its
    timings count from its broker timestamp, which lies between `submitted_at` (the
    publish began) and `sent_at` (the broker's ack came back); `started_at` and
    `ended_at` count from `submitted_at`, so they may be early by that much."""

    tenant: str
    submitted_at: float
    outcome: str  # "done" or the error code (then `ended_at` is when it came)
    sent_at: float | None = None
    ttft_s: float | None = None
    started_at: float | None = None
    ended_at: float | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    message: str = ""  # an error's


async def ask(
    client: Client, endpoint: str, tenant: str, max_tokens: int, request_id: str, prompt: str
) -> Answer:
    """Send one request and wait for its end."""
    at = time.time()
    try:
        submitted = await client.submit(
            endpoint, tenant, prompt=prompt, max_tokens=max_tokens, id=request_id
        )
        sent_at = time.time()
        async with contextlib.aclosing(client.stream(submitted, timeout_s=120)) as events:
            final = [event async for event in events][-1]
    except FairqError as exc:  # not sent (a full backlog, a broken connection)
        code = getattr(exc, "code", type(exc).__name__)
        return Answer(tenant, at, code, ended_at=time.time(), message=str(exc))
    if isinstance(final, ErrorEvent):
        return Answer(tenant, at, final.code, sent_at, ended_at=time.time(), message=final.message)
    timings, usage = final.timings, final.usage
    return Answer(
        tenant,
        at,
        "done",
        sent_at,
        timings.ttft_s,
        at + timings.queued_s,
        at + timings.total_s,
        usage.input_tokens,
        usage.output_tokens,
    )


async def trickle(
    client: Client, settings: DemoSettings, tenant: str, duration_s: float, run: str
) -> list[Answer]:
    """`tenant` sends `small_rate` requests per second for `duration_s`."""
    tasks = []
    for n in range(max(1, round(duration_s * settings.small_rate))):
        request_id = f"demo-{run}-{tenant}-{n}"
        ask_once = ask(
            client, settings.endpoint, tenant, settings.small_max_tokens, request_id, CHAT_PROMPT
        )
        tasks.append(asyncio.create_task(ask_once))
        await asyncio.sleep(1 / settings.small_rate)
    return list(await asyncio.gather(*tasks))


def p95(answers: Sequence[Answer]) -> float | None:
    ttfts = sorted(a.ttft_s for a in answers if a.ttft_s is not None)
    return ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))] if ttfts else None


def service_in(
    answers: Sequence[Answer], start: float, end: float, profile: ModelProfile
) -> Counter:
    """Model units each tenant was served within [start, end]: each request's, spread
    evenly over the time it ran."""
    served: Counter[str] = Counter()
    for a in answers:
        if a.started_at is None or a.ended_at is None or a.ended_at <= a.started_at:
            continue
        overlap = min(end, a.ended_at) - max(start, a.started_at)
        if overlap > 0:
            units = profile.model_units(a.input_tokens, a.output_tokens, 0.0)
            served[a.tenant] += units * overlap / (a.ended_at - a.started_at)
    return served


@dataclass
class DemoReport:
    settings: DemoSettings
    alone: dict[str, list[Answer]] = field(default_factory=dict)
    beside: dict[str, list[Answer]] = field(default_factory=dict)
    flood: list[Answer] = field(default_factory=list)
    window: tuple[float, float] = (0.0, 0.0)  # when the small tenants sent beside it

    def ratios(self) -> dict[str, float | None]:
        """Each small tenant's p95 TTFT beside the flood over its p95 alone."""
        ratios = {}
        for tenant in self.settings.small_tenants:
            alone, beside = p95(self.alone[tenant]), p95(self.beside[tenant])
            ratios[tenant] = beside / alone if alone and beside is not None else None
        return ratios

    def answers(self) -> list[Answer]:
        small = [a for phase in (self.alone, self.beside) for got in phase.values() for a in got]
        return small + self.flood

    def outcomes(self) -> Counter[tuple[str, str]]:
        return Counter((a.tenant, a.outcome) for a in self.answers())

    def fair(self) -> bool:
        rate_limited = any(outcome == "rate_limited" for _, outcome in self.outcomes())
        within = all(r is not None and r <= TTFT_BOUND for r in self.ratios().values())
        return within and not rate_limited


async def run_demo(client: Client, settings: DemoSettings, say: Say) -> DemoReport:
    """Both phases (the module doc); the flood's leftovers are cancelled on the way out."""
    report = DemoReport(settings)
    tenants = ", ".join(settings.small_tenants)
    run = f"{time.time():.0f}"  # request ids are idempotency keys: new ones every run
    rate, solo_s = settings.small_rate, settings.solo_s
    # One request each first, not counted: a tenant's very first request waits for the
    # intake to list its subject, which says nothing about scheduling.
    await asyncio.gather(
        *(
            ask(client, settings.endpoint, t, 1, f"demo-warm-{run}-{t}", BATCH_PROMPT)
            for t in (settings.flood_tenant, *settings.small_tenants)
        )
    )
    say(f"1/2 alone: {tenants} send {rate:g} requests/s each for {solo_s:g} s")
    report.alone = await each_small(client, settings, solo_s, "alone-" + run)
    for tenant in settings.small_tenants:
        say(f"    {tenant:<10} p95 TTFT alone {_seconds(p95(report.alone[tenant]))}")
    say(
        f"2/2 beside a flood: {settings.flood_tenant} publishes {settings.flood_requests} "
        f"requests at once; {tenants} send as before for {settings.beside_s:g} s"
    )
    flood_ids = [f"demo-{run}-flood-{n}" for n in range(settings.flood_requests)]
    flood = [
        asyncio.create_task(
            ask(
                client,
                settings.endpoint,
                settings.flood_tenant,
                settings.flood_max_tokens,
                rid,
                BATCH_PROMPT,
            )
        )
        for rid in flood_ids
    ]
    try:
        await asyncio.sleep(1.0)  # the flood is in before the small tenants send
        start = time.time()
        watching = asyncio.create_task(_watch_queues(client, settings, say))
        report.beside = await each_small(client, settings, settings.beside_s, "beside-" + run)
        report.window = (start, time.time())
        watching.cancel()
    finally:
        await _cancel_left(client, settings.flood_tenant, flood_ids, flood)
        report.flood = list(await asyncio.gather(*flood))
    return report


async def each_small(
    client: Client, settings: DemoSettings, duration_s: float, run: str
) -> dict[str, list[Answer]]:
    answers = await asyncio.gather(
        *(trickle(client, settings, t, duration_s, run) for t in settings.small_tenants)
    )
    return dict(zip(settings.small_tenants, answers, strict=True))


async def _watch_queues(client: Client, settings: DemoSettings, say: Say) -> None:
    """A line every 5 s: what each demo tenant has queued and running."""
    started = time.monotonic()
    tenants = {settings.flood_tenant, *settings.small_tenants}
    while True:
        await asyncio.sleep(5.0)
        with contextlib.suppress(FairqError):
            rows = (await client.depth()).queues
            shown = [
                f"{row.tenant} {row.queued} queued, {row.running} running"
                for row in rows
                if row.endpoint == settings.endpoint and row.tenant in tenants
            ]
            say(f"    t+{time.monotonic() - started:.0f}s: " + "; ".join(shown))


async def _cancel_left(
    client: Client, tenant: str, ids: list[str], tasks: list[asyncio.Task]
) -> None:
    """Cancel the flood's requests that have not ended (the demo ends on time)."""
    for request_id, task in zip(ids, tasks, strict=True):
        if not task.done():
            with contextlib.suppress(FairqError):
                await client.cancel(tenant, request_id)


def render(report: DemoReport, config: Config | None) -> list[str]:
    settings = report.settings
    lines = [f"{'tenant':<10} {'alone p95 TTFT':>15} {'beside flood':>13} {'ratio':>6}  answers"]
    outcomes = report.outcomes()
    for tenant in [*settings.small_tenants, settings.flood_tenant]:
        answered = ", ".join(f"{n} {o}" for (t, o), n in sorted(outcomes.items()) if t == tenant)
        if tenant == settings.flood_tenant:
            lines.append(f"{tenant:<10} {'(the flood)':>15} {'':>13} {'':>6}  {answered}")
            continue
        ratio = report.ratios()[tenant]
        lines.append(
            f"{tenant:<10} {_seconds(p95(report.alone[tenant])):>15} "
            f"{_seconds(p95(report.beside[tenant])):>13} "
            f"{'-' if ratio is None else f'{ratio:.1f}x':>6}  {answered}"
        )
    if config is not None:
        lines.append(_share_line(report, config))
    verdict = "fair" if report.fair() else "NOT fair"
    lines.append(
        f"{verdict}: each small tenant within {TTFT_BOUND:g}x its p95 alone, none rate limited"
        if report.fair()
        else f"{verdict}: a small tenant beyond {TTFT_BOUND:g}x its p95 alone, or rate limited"
    )
    return lines


def _share_line(report: DemoReport, config: Config) -> str:
    settings = report.settings
    registry = Registry(config)
    served = service_in(report.answers(), *report.window, registry.profile(settings.endpoint))
    weights = {
        t: policy.weight
        for t in [settings.flood_tenant, *settings.small_tenants]
        if (policy := registry.tenant(t)) is not None
    }
    total = sum(served.values())
    if not total or settings.flood_tenant not in weights:
        return "(no service measured while the small tenants sent)"
    share = served[settings.flood_tenant] / total
    weight_share = weights[settings.flood_tenant] / sum(weights.values())
    return (
        f"{settings.flood_tenant} got {share:.0%} of the service (model units) while the "
        f"small tenants sent; its weight's share is {weight_share:.0%}: the small tenants "
        "asked for less than theirs, and what they left went to the flood"
    )


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        parents=[connection_options(), config_options("for weights and the cost unit")],
        help="show fairness in a minute against a running `fairq up`",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick", action="store_true", help="a short variant (about 15 s, a smaller flood)"
    )
    parser.add_argument(
        "--flood",
        type=int,
        metavar="N",
        help=f"the flood's requests (default {DemoSettings.flood_requests})",
    )
    parser.set_defaults(run=runner("demo", _main, interrupted=130))


async def _main(args: argparse.Namespace) -> int:
    settings = QUICK if args.quick else DemoSettings()
    if args.flood:
        settings = replace(settings, flood_requests=args.flood)
    found = local_config(args)
    config = found[1] if found else None
    say: Say = lambda line: print(line, flush=True)  # noqa: E731
    say(f"fairq demo on {args.nats}, endpoint {settings.endpoint}")
    async with connect(args) as client:
        report = await run_demo(client, settings, say)
    for line in render(report, config):
        say(line)
    return 0 if report.fair() else EXIT_FAILED
