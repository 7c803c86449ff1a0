"""Throughput and head-of-line cost of the dispatcher's intake (a pull consumer per tenant).
Archived: a one-off study of the intake before the shard consumers (issue 10); its figures
are docs/benchmarks.md's "Dispatcher intake", and it still runs.

    python -m bench.archive.intake [--messages 20000] [--tenants 10 100 1000] [--no-profile]

Every measurement gets its own fresh embedded nats-server. The backlog is published from
this process; each consumer (raw or dispatcher) runs in a fresh spawned process, so one
row's leftover heap cannot hide the next row's RSS growth. Rows:

- raw JetStream: one durable pull consumer on the requests stream, batches of 256, with
  and without acking each message. The dispatcher holds messages unacked until their
  request finishes, so the unacked row is its like-for-like ceiling.
- dispatcher intake: `Dispatcher` started over a pre-published backlog spread round-robin
  over T tenants, timed until its scheduler holds every request. Nothing is dispatched (no
  workers, settle_s=3600); no rate limits; unlisted tenants are admitted (so the time
  includes finding the T tenants and making their consumers). The per-tenant window is
  opened to the whole backlog, so intake is not waiting for dispatch to make room.
- head of line: tenant B's one request published behind tenant A's backlog. The
  dispatcher (default window) is timed until it has queued B's request; the baseline is a
  raw shared consumer in stream order, timed until it has fetched B's request.
- profile: cProfile over one dispatcher intake, top functions by own time and the
  cumulative time of each intake stage.

Markdown on stdout; the same numbers as JSON in bench/results/intake.json.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import pstats
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import msgspec

from bench.harness.cli import write_json
from bench.harness.machine import command_line, machine_facts, table
from bench.harness.paths import RESULTS_DIR
from bench.harness.procstat import memory_kb
from bench.harness.raw import FETCH_BATCH, raw_fetch_job, spawn_pool
from bench.harness.stack import connected
from broker_config.config import BrokerSettings, DispatcherOptions, parse_config
from broker_config.server import EmbeddedNatsServer
from broker_config.streams import provision
from broker_config.subjects import HDR_MSG_ID
from dispatcher.service import Dispatcher

ENDPOINT = "chat"
BODY = b'{"prompt":"hello","max_tokens":16}'
PUBLISH_IN_FLIGHT = 1000
POLL_S = 0.01
RAW_TENANTS = 100
# Bound on any one measurement, so a stuck run fails with a message instead of hanging.
PHASE_TIMEOUT_S = 60.0
TOP_FUNCTIONS = 5
RESULTS_PATH = RESULTS_DIR / "intake.json"
SETTINGS = BrokerSettings()

# No rate limits, a latency target the throttle never reaches, every tenant admitted:
# the run measures intake, not admission refusals.
CONFIG_TOML = f"""
[endpoints.{ENDPOINT}]
cost = "request"
latency_target_s = 1e9

[[tiers]]
name = "standard"

[unlisted_tenants]
policy = "admit"
tier = "standard"
"""

# Intake stages in the profile: label -> (path suffix of the file, function name).
STAGES: dict[str, tuple[str, str]] = {
    "arrivals from the per-tenant pulls (TenantIntake._on_message)": (
        "dispatcher/intake/shards.py",
        "_on_message",
    ),
    "parse: subject, headers, body (wire.parse_submission)": (
        "broker_config/wire.py",
        "parse_submission",
    ),
    "  of which JSON decode + msgspec validation (wire.decode_request)": (
        "broker_config/wire.py",
        "decode_request",
    ),
    "result-bucket lookup, one batch direct get per batch (DirectBatchGet.last)": (
        "broker_config/direct_get.py",
        "last",
    ),
    "admission + enqueue (Admission.admit)": ("dispatcher/admission/admit.py", "admit"),
    "  of which Scheduler.check": ("dispatcher/core/scheduler.py", "check"),
    "  of which limiter store (MemoryLimiterAsync.apply)": (
        "dispatcher/admission/redis_store.py",
        "apply",
    ),
    "  of which Scheduler.enqueue": ("dispatcher/core/scheduler.py", "enqueue"),
    "whole per-message intake (Admission._take)": ("dispatcher/admission/admit.py", "_take"),
    # Other tasks: the KV get's socket send and its reply's parsing happen here.
    "nats-py flusher task (socket sends)": ("nats/aio/client.py", "_flusher"),
    "nats-py read loop (parse and route replies)": ("nats/aio/client.py", "_read_loop"),
    "dispatcher maintenance loop (expiry, depth gauges)": (
        "dispatcher/service.py",
        "_maintenance_loop",
    ),
}
IDLE_FUNCTION = "<method 'poll' of 'select.epoll' objects>"


class BenchError(RuntimeError):
    """A measurement that did not complete: timed out, or requests were refused."""


def request_id(serial: int) -> str:
    return f"r{serial}"


def round_robin(messages: int, tenants: int) -> list[str]:
    """The tenant of each message, `t0, t1, ..., t<T-1>, t0, ...`."""
    return [f"t{i % tenants}" for i in range(messages)]


# -- publisher (this process) ------------------------------------------------------------


async def publish(url: str, phases: list[list[str]]) -> float:
    """Publish one request per tenant name, each phase acked before the next; seconds.

    Ids run `r0, r1, ...` across all phases.
    """
    subjects = SETTINGS.subjects
    async with connected(url) as nc:
        js = nc.jetstream()
        await provision(js, SETTINGS)
        serial = 0
        start = time.perf_counter()
        for tenants in phases:
            for first in range(0, len(tenants), PUBLISH_IN_FLIGHT):
                chunk = tenants[first : first + PUBLISH_IN_FLIGHT]
                await asyncio.gather(
                    *(
                        js.publish(
                            subjects.request(ENDPOINT, tenant),
                            BODY,
                            headers={HDR_MSG_ID: request_id(serial + offset)},
                        )
                        for offset, tenant in enumerate(chunk)
                    )
                )
                serial += len(chunk)
        return time.perf_counter() - start


# -- consumers (each in a fresh process) -------------------------------------------------


async def dispatcher_intake(
    url: str, expected: int, watch: tuple[str, str] | None, profile: bool, window: int
) -> dict[str, Any]:
    """Start a dispatcher over the backlog; time until it has queued `expected` requests
    (or, with `watch` (tenant, id), that one), with `window` waiting requests per tenant.

    Also when the watched request was queued, and how many others were queued by then.
    Times count from just before the dispatcher starts.
    """
    options = DispatcherOptions(
        settle_s=3600.0,  # hold everything: no dispatching
        tenant_window=window,
        max_ack_pending=max(window, DispatcherOptions().max_ack_pending),
    )
    config = msgspec.structs.replace(
        parse_config(CONFIG_TOML, source="bench_intake"), dispatcher=options
    )
    result: dict[str, Any] = {"watch_s": None, "queued_before_watch": None}
    async with connected(url) as nc:
        gc.collect()
        result["rss_before_kb"] = memory_kb()["rss_kb"]
        profiler = cProfile.Profile() if profile else None
        start = time.perf_counter()
        if profiler:
            profiler.enable()
        async with Dispatcher(nc, config) as dispatcher:
            scheduler = dispatcher.scheduler
            while True:
                queued = scheduler.queued_count()
                now = time.perf_counter() - start
                if watch and result["watch_s"] is None and scheduler.state(*watch) is not None:
                    result["watch_s"], result["queued_before_watch"] = now, queued - 1
                if queued >= expected or result["watch_s"] is not None:
                    break
                if now > PHASE_TIMEOUT_S:
                    admissions = {
                        s.labels["outcome"]: s.value
                        for m in dispatcher.observe.metrics.admissions.collect()
                        for s in m.samples
                        if s.name.endswith("_total")
                    }
                    raise BenchError(
                        f"dispatcher: {queued} of {expected} queued after "
                        f"{PHASE_TIMEOUT_S}s; admissions {admissions}"
                    )
                await asyncio.sleep(POLL_S)
            result["elapsed_s"] = time.perf_counter() - start
            if profiler:
                profiler.disable()
                result["profile"] = summarise_profile(profiler, result["elapsed_s"])
            gc.collect()
            result["rss_after_kb"] = memory_kb()["rss_kb"]
    return result


def summarise_profile(profiler: cProfile.Profile, wall_s: float) -> dict[str, Any]:
    """Top functions by own time (idle epoll apart), and cumulative time per stage."""
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    rows = [
        {
            "function": _describe(file, line, name),
            "file": file,
            "name": name,
            "calls": calls,
            "own_s": own,
            "cumulative_s": cumulative,
        }
        for (file, line, name), (_, calls, own, cumulative, _) in stats.items()
    ]
    idle = sum(r["own_s"] for r in rows if r["name"] == IDLE_FUNCTION)
    busy = sorted(
        (r for r in rows if r["name"] != IDLE_FUNCTION), key=lambda r: r["own_s"], reverse=True
    )
    stages = {}
    for label, (suffix, name) in STAGES.items():
        matches = [r for r in rows if r["name"] == name and r["file"].endswith(suffix)]
        stages[label] = sum(r["cumulative_s"] for r in matches)
    stages["idle, waiting on the network (epoll)"] = idle
    keep = ("function", "calls", "own_s", "cumulative_s")
    return {
        "wall_s": wall_s,
        "top": [{k: r[k] for k in keep} for r in busy[:TOP_FUNCTIONS]],
        "stages": stages,
    }


def _describe(file: str, line: int, name: str) -> str:
    if file == "~":  # a builtin
        return name
    parts = Path(file).parts
    return f"{'/'.join(parts[-2:])}:{line}({name})"


# Spawned-process entry points: plain functions returning plain data.


def intake_job(
    url: str, expected: int, watch: tuple[str, str] | None, profile: bool, window: int
) -> dict[str, Any]:
    return asyncio.run(dispatcher_intake(url, expected, watch, profile, window))


# -- scenarios (this process) ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Row:
    scenario: str
    tenants: int
    messages: int
    publish_msgs_per_s: float
    consume_s: float
    rss_kb_per_1k: float | None = None

    @property
    def msgs_per_s(self) -> float:
        return self.messages / self.consume_s


class Runner:
    """Runs each consumer job in a fresh process and each scenario on a fresh server."""

    def __init__(self, pool: ProcessPoolExecutor) -> None:
        self.pool = pool

    def job(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self.pool.submit(fn, *args).result(timeout=2 * PHASE_TIMEOUT_S)

    def on_fresh_server(
        self, phases: list[list[str]], fn: Callable[..., Any], *args: Any
    ) -> tuple[float, Any]:
        """`phases` published into a fresh server, then `fn(url, *args)` as a job: the
        publish's seconds and the job's result."""
        with EmbeddedNatsServer() as server:
            published = asyncio.run(publish(server.url, phases))
            return published, self.job(fn, server.url, *args)

    def raw(self, messages: int, ack: bool) -> Row:
        phases = [round_robin(messages, RAW_TENANTS)]
        published, fetched = self.on_fresh_server(phases, raw_fetch_job, messages, ack)
        elapsed = fetched.elapsed_s
        name = "raw JetStream: fetch 256 + ack each" if ack else "raw JetStream: fetch 256, no ack"
        return Row(name, RAW_TENANTS, messages, messages / published, elapsed)

    def intake(self, messages: int, tenants: int) -> Row:
        phases = [round_robin(messages, tenants)]
        published, result = self.on_fresh_server(
            phases, intake_job, messages, None, False, messages
        )
        growth = (result["rss_after_kb"] - result["rss_before_kb"]) / (messages / 1000)
        return Row(
            "dispatcher intake",
            tenants,
            messages,
            messages / published,
            result["elapsed_s"],
            growth,
        )

    def head_of_line(self, backlog: int) -> dict[str, Any]:
        watched = ("B", request_id(backlog))  # the message published after A's backlog
        phases = [["A"] * backlog, [watched[0]]]
        window = DispatcherOptions().tenant_window
        _, result = self.on_fresh_server(phases, intake_job, backlog + 1, watched, False, window)
        watch = SETTINGS.subjects.request(ENDPOINT, watched[0])
        _, fetched = self.on_fresh_server(phases, raw_fetch_job, backlog + 1, False, watch)
        raw_watch_s = fetched.watch_s
        return {
            "backlog_of_A": backlog,
            "B_queued_after_s": result["watch_s"],
            "A_queued_before_B": result["queued_before_watch"],
            "shared_consumer_reaches_B_after_s": raw_watch_s,
        }

    def profile(self, messages: int, tenants: int) -> dict[str, Any]:
        phases = [round_robin(messages, tenants)]
        _, result = self.on_fresh_server(phases, intake_job, messages, None, True, messages)
        return {"messages": messages, "tenants": tenants, **result["profile"]}


# -- report ------------------------------------------------------------------------------


def render(
    facts: dict[str, Any], rows: list[Row], hol: dict[str, Any], prof: dict[str, Any] | None
) -> str:
    out = ["# dispatcher intake benchmark", "", f"`{facts['command']}`", ""]
    out += [f"- {key}: {value}" for key, value in facts.items() if key != "command"]
    setup = (
        f"Batches of {FETCH_BATCH}, bodies `{BODY.decode()}` with Nats-Msg-Id, "
        f"publishes {PUBLISH_IN_FLIGHT} in flight; fresh nats-server per row."
    )
    out += ["", setup, ""]
    out += table(
        [
            "scenario",
            "tenants",
            "messages",
            "publish msg/s",
            "intake msg/s",
            "us/msg",
            "RSS growth KB per 1k queued",
        ],
        [
            [
                r.scenario,
                str(r.tenants),
                str(r.messages),
                f"{r.publish_msgs_per_s:,.0f}",
                f"{r.msgs_per_s:,.0f}",
                f"{1e6 / r.msgs_per_s:.1f}",
                "" if r.rss_kb_per_1k is None else f"{r.rss_kb_per_1k:.0f}",
            ]
            for r in rows
        ],
    )
    out += ["", "Head of line: A's backlog, then 1 request of B, then the consumer starts.", ""]
    out += table(
        [
            "A backlog",
            "dispatcher: B queued after s",
            "A requests queued before B",
            "baseline, shared consumer in stream order: B fetched after s",
        ],
        [
            [
                str(hol["backlog_of_A"]),
                f"{hol['B_queued_after_s']:.3f}",
                str(hol["A_queued_before_B"]),
                f"{hol['shared_consumer_reaches_B_after_s']:.3f}",
            ]
        ],
    )
    if prof is not None:
        out += render_profile(prof)
    return "\n".join(out)


def render_profile(prof: dict[str, Any]) -> list[str]:
    """The cProfile run: top own-time functions and each intake stage's time."""
    out: list[str] = []
    wall, messages = prof["wall_s"], prof["messages"]
    title = (
        f"Profile (cProfile, {messages} messages over {prof['tenants']} tenants, "
        f"{wall:.2f} s wall under the profiler):"
    )
    out += ["", title, ""]
    out += table(
        ["top own-time functions", "calls", "own s", "% of wall"],
        [
            [
                f"`{t['function']}`",
                str(t["calls"]),
                f"{t['own_s']:.3f}",
                f"{100 * t['own_s'] / wall:.0f}",
            ]
            for t in prof["top"]
        ],
    )
    out.append("")
    out += table(
        ["intake stage", "cumulative s", "% of wall", "us/msg"],
        [
            [
                label,
                f"{seconds:.3f}",
                f"{100 * seconds / wall:.0f}",
                f"{1e6 * seconds / messages:.1f}",
            ]
            for label, seconds in prof["stages"].items()
        ],
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.archive.intake", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--messages",
        type=int,
        default=20_000,
        help="backlog size per row (at most the per-subject cap, 20000)",
    )
    parser.add_argument("--tenants", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--no-profile", action="store_true", help="skip the cProfile run")
    parser.add_argument("--json", type=Path, default=RESULTS_PATH)
    args = parser.parse_args()
    if not 1 <= args.messages <= SETTINGS.max_queued_per_subject:
        parser.error(
            f"--messages must be 1..{SETTINGS.max_queued_per_subject} "
            "(A's backlog in the head-of-line row is one subject)"
        )
    if any(t < 1 for t in args.tenants):
        parser.error("--tenants must be >= 1")
    facts = machine_facts(command_line("bench.archive.intake"))
    # A fresh interpreter per job (spawn, one task per child): clean heap for RSS.
    with spawn_pool() as pool:
        runner = Runner(pool)
        rows = [runner.raw(args.messages, ack=True), runner.raw(args.messages, ack=False)]
        rows += [runner.intake(args.messages, tenants) for tenants in args.tenants]
        hol = runner.head_of_line(args.messages)
        prof = None if args.no_profile else runner.profile(args.messages, RAW_TENANTS)
    print(render(facts, rows, hol, prof))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "machine": facts,
        "rows": [asdict(r) | {"msgs_per_s": r.msgs_per_s} for r in rows],
        "head_of_line": hol,
        "profile": prof,
    }
    write_json(args.json, report, 2)


if __name__ == "__main__":
    main()
