"""Intake layouts compared on one machine in one run: how the requests stream could be
read at 10, 100 and 1,000 tenants (issue 10, "The wall: active tenants"). Archived: the
study behind the shard consumers; its figures are docs/benchmarks.md's "Intake layouts",
and it still runs.

    python -m bench.archive.intake_layouts [--quick] [--tenants 10,100,1000] [--layouts a,b]

Raw nats-py against a fresh nats-server process (free loopback port, its own store dir)
for every row, the requests stream exactly as fairq provisions it (work-queue retention:
an acked or deleted message is gone). Layouts (`LAYOUTS`):

- pull-per-tenant: one durable pull consumer per tenant, standing pulls into one inbox,
  `tenant_window` credits topped up at half (the intake before issue 10);
- push-per-tenant: one durable push consumer per tenant with flow control, idle
  heartbeats and `max_ack_pending` = `tenant_window` as the per-tenant window, each
  delivering to its own inbox subject;
- pull-shards-S: S pull consumers, each with the filters of the tenants hashed to it
  (FilterSubjects, nats-server >= 2.10); a pull asks for the window of all its tenants,
  at most `max_ack_pending`;
- pull-partitioned-16: 16 pull consumers over the shards the stream's subject transform
  stores tenants in (`<prefix>.q.<shard>.*.*`, one filter each: today's intake,
  dispatcher.intake.shards, without the moves that keep a shard's tenants apart);
- pull-shared: one pull consumer over every stored request subject;
- pull-mix: a dedicated consumer for each backlogged tenant (every tenth tenant in the
  rate run; the backlogged tenant in the head-of-line run, already moved out) and one
  shared consumer listing the others' filters (a subject filter cannot say "all but").
- direct-get-delete / direct-get-keep: no consumer. Every tenant's subject is read with
  batch direct gets (`next_by_subj`, broker_config.direct_get) from a read position the
  intake keeps itself, all tenants each round, a pause when a round found nothing (there
  is no long poll). Nothing is removed by reading: on the work-queue stream the intake
  must delete each message itself (`$JS.API.STREAM.MSG.DELETE`, one request each, as
  the dispatcher would on finishing a request); the keep variant leaves them, so the
  difference is the cost of deleting.

Every consumed message is acked (or deleted) at once; the consumer does nothing else.
Two measurements per layout and tenant count, each on a fresh server, the consumer in a
fresh process that makes its consumers before the clock starts:

- rate: `messages` messages of about 200 bytes (with Nats-Msg-Id, as producers send
  them) published round-robin over the tenants' subjects while being consumed: messages
  per second from the first publish to the last ack; CPU microseconds per message of
  nats-server (publishing included, the same for every layout) and of the consumer
  process (bench.harness.procstat); the server's RSS at the end;
- head of line: tenant A's `backlog` messages, then one of newcomer B, stored before
  the consumer starts: seconds from its start until B's message is delivered, and how
  many messages came before it. B is a tenant that shares A's consumer wherever the
  layout has one. A dispatcher holds what it took until the request finishes, so a
  shared consumer that must deliver more of A than its `max_ack_pending` before B would
  block B until A's requests finish; here everything is acked at once, the best case.

Writes bench/results/intake_layouts/summary.json (`--quick`: quick.json) and prints a
markdown table with the machine's load before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import sys
import time
from collections.abc import AsyncIterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import nats
import nats.errors
from nats.aio.client import Client as NATS

from bench.archive.intake_layouts_consumers import (
    BROKER,
    GO_SUBJECT,
    LAYOUTS,
    READY_SUBJECT,
    STREAM,
    SUBJECTS,
    WINDOW,
    BenchError,
    Job,
    Layout,
    consume_job,
    shard_of,
)
from bench.harness.cli import write_json
from bench.harness.machine import command_line, machine_facts, table, with_overrides
from bench.harness.paths import RESULTS_DIR
from bench.harness.procstat import CpuMeter, memory_kb
from bench.harness.raw import spawn_pool
from bench.scenarios.rate import tenant_names
from broker_config.server import EmbeddedNatsServer
from broker_config.streams import (
    apply_stream,
    requests_stream_config,
)
from broker_config.subjects import HDR_MSG_ID
from broker_config.subjects import shard_of as broker_shard_of

RESULTS = RESULTS_DIR / "intake_layouts"
# What its test takes from here: the layouts' parts are `intake_layouts_consumers`'s.
__all__ = ["QUICK", "WINDOW", "main", "shard_of", "tenant_names"]

ENDPOINT = "chat"
# About 200 bytes, the size of a short chat request.
BODY = b'{"prompt":"' + b"x" * 170 + b'","max_tokens":16}'
PUBLISH_IN_FLIGHT = 512
# In the mix, every DEDICATED_EVERY-th tenant counts as backlogged in the rate run.
DEDICATED_EVERY = 10
STREAM_EMPTY_WITHIN_S = 5.0
# The consumer process ends within its own bound; this covers its start and exit.
JOB_MARGIN_S = 30.0
POLL_S = 0.02
BACKLOGGED, NEWCOMER = "A", "B"


@dataclass(frozen=True, slots=True)
class Settings:
    tenant_counts: tuple[int, ...] = (10, 100, 1000)
    layouts: tuple[str, ...] = tuple(LAYOUTS)
    messages: int = 10_000
    backlog: int = 5_000
    # Bound on each measurement's consuming, and on each consumer process.
    timeout_s: float = 120.0


FULL = Settings()


QUICK = Settings(tenant_counts=(10,), messages=1_000, backlog=1_000, timeout_s=30.0)


def head_of_line_tenants(layout: Layout, tenants: int) -> tuple[list[str], bool]:
    """Tenant names with A first and newcomer B second, and whether B shares A's consumer
    (B is chosen to share it where the layout makes that possible)."""
    others = tenant_names(tenants - 1)
    if layout.shards or layout.partitioned:
        # The first tenant name that hashes to A's shard stands in for B.
        shard = (
            functools.partial(broker_shard_of, shards=BROKER.intake_shards)
            if layout.partitioned
            else functools.partial(shard_of, shards=layout.shards)
        )
        mates = [t for t in others if shard(t) == shard(BACKLOGGED)]
        if mates:
            others.remove(mates[0])
            return [BACKLOGGED, mates[0], *others], True
        return [BACKLOGGED, *others], False
    names = [BACKLOGGED, NEWCOMER, *others[1:]]
    return names, layout.shared


async def publish(nc: NATS, subjects: list[str]) -> None:
    """One message on each subject, in order, `PUBLISH_IN_FLIGHT` unacked at most."""
    js = nc.jetstream()
    slots = asyncio.Semaphore(PUBLISH_IN_FLIGHT)

    async def one(subject: str, msg_id: str) -> None:
        try:
            await js.publish(subject, BODY, headers={HDR_MSG_ID: msg_id})
        finally:
            slots.release()

    async with asyncio.TaskGroup() as group:
        for n, subject in enumerate(subjects):
            await slots.acquire()
            group.create_task(one(subject, f"m{n}"))


async def until_ready(ready: Any, job: asyncio.Future[Any], timeout_s: float) -> None:
    """Wait for the consumer process's ready, failing early with its error if it died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if job.done():
            job.result()  # raises what the consumer process raised
            raise BenchError("the consumer process ended before it was ready")
        try:
            await ready.next_msg(timeout=POLL_S)
            return
        except nats.errors.TimeoutError:
            continue
    raise BenchError(f"the consumer process was not ready after {timeout_s}s")


async def stream_messages(nc: NATS, expect: int) -> int:
    """Messages left in the stream, once the acks have been applied (or after a bound)."""
    js = nc.jetstream()
    deadline = time.monotonic() + STREAM_EMPTY_WITHIN_S
    while True:
        left = (await js.stream_info(STREAM)).state.messages
        if left == expect or time.monotonic() > deadline:
            return left
        await asyncio.sleep(POLL_S)


async def measure(
    pool: ProcessPoolExecutor, layout: Layout, tenants: int, settings: Settings
) -> dict[str, Any]:
    """The rate run on a fresh server."""
    names = tenant_names(tenants)
    subjects = [SUBJECTS.request(ENDPOINT, names[n % tenants]) for n in range(settings.messages)]
    job = Job(
        layout.name, names, names[::DEDICATED_EVERY], settings.messages, None, settings.timeout_s
    )
    async with started_consumer(pool, job) as (server, nc, consuming):
        assert server.pid is not None
        meter = CpuMeter({"nats-server": server.pid, "publisher": "self"})
        meter.start()
        await nc.publish(GO_SUBJECT, b"")
        first_publish = time.time()
        await publish(nc, subjects)
        publish_s = time.time() - first_publish
        result = await asyncio.wait_for(consuming, settings.timeout_s + JOB_MARGIN_S)
        cpu = meter.stop()
        server_rss_kb = memory_kb(server.pid)["rss_kb"]
        kept = layout.kind == "direct" and not layout.delete
        left = await stream_messages(nc, settings.messages if kept else 0)
    messages = settings.messages
    return {
        "tenants": tenants,
        "consumers": result["consumers"],
        "published": messages,
        "consumed": result["consumed"],
        "deliveries": result["deliveries"],
        "left_in_stream": left,
        "statuses": result["statuses"],
        "publish_msgs_per_s": messages / publish_s,
        "msgs_per_s": messages / (result["finished_at"] - first_publish),
        "server_cpu_us_per_msg": 1e6 * cpu["nats-server"] / messages,
        "consumer_cpu_us_per_msg": 1e6 * result["cpu_s"] / messages,
        "publisher_cpu_us_per_msg": 1e6 * cpu["publisher"] / messages,
        "server_rss_kb": server_rss_kb,
        "setup_s": result["setup_s"],
        "requests_per_msg": {k: v / messages for k, v in result["requests"].items()},
    }


async def measure_head_of_line(
    pool: ProcessPoolExecutor, layout: Layout, tenants: int, settings: Settings
) -> dict[str, Any]:
    """The head-of-line run on a fresh server: A's backlog and B's one message are stored
    before the consumer starts."""
    names, shares = head_of_line_tenants(layout, tenants)
    subjects = [SUBJECTS.request(ENDPOINT, names[0])] * settings.backlog
    subjects.append(SUBJECTS.request(ENDPOINT, names[1]))
    job = Job(layout.name, names, names[:1], None, f"m{settings.backlog}", settings.timeout_s)
    async with started_consumer(pool, job) as (_, nc, consuming):
        await publish(nc, subjects)
        await nc.publish(GO_SUBJECT, b"")
        result = await asyncio.wait_for(consuming, settings.timeout_s + JOB_MARGIN_S)
    return {
        "backlog": settings.backlog,
        "newcomer": names[1],
        "newcomer_shares_consumer": shares,
        "newcomer_after_s": result["elapsed_s"],
        "delivered_before_newcomer": result["before_watch"],
    }


@contextlib.asynccontextmanager
async def started_consumer(
    pool: ProcessPoolExecutor, job: Job
) -> AsyncIterator[tuple[EmbeddedNatsServer, NATS, Any]]:
    """A fresh nats-server with the requests stream, a connection to it, and the consumer
    process (`consume`, as a future) once it has made its consumers and waits for go."""
    async with EmbeddedNatsServer() as server:
        nc = await nats.connect(server.url, connect_timeout=5)
        try:
            await apply_stream(nc.jetstream(), requests_stream_config(BROKER))
            ready = await nc.subscribe(READY_SUBJECT, max_msgs=1)
            consuming = asyncio.get_running_loop().run_in_executor(
                pool, consume_job, server.url, job
            )
            # Should this run fail, the consumer process ends within its own bounds.
            await until_ready(ready, consuming, job.timeout_s)
            yield server, nc, consuming
        finally:
            await nc.close()


async def run_all(settings: Settings, command: str) -> dict[str, Any]:
    facts = machine_facts(command)
    rows = []
    # A fresh interpreter per consumer (spawn, one task per child): no heap carried over.
    with spawn_pool() as pool:
        for tenants in settings.tenant_counts:
            for name in settings.layouts:
                started = time.monotonic()
                layout = LAYOUTS[name]
                row = {"layout": name, **await measure(pool, layout, tenants, settings)}
                row["head_of_line"] = await measure_head_of_line(pool, layout, tenants, settings)
                rows.append(row)
                print(
                    f"{name} at {tenants} tenants: {row['msgs_per_s']:,.0f} msg/s, newcomer "
                    f"after {1e3 * row['head_of_line']['newcomer_after_s']:.0f} ms "
                    f"({time.monotonic() - started:.1f} s)",
                    file=sys.stderr,
                )
    facts["loadavg_at_end"] = os.getloadavg()
    return {"machine": facts, "settings": asdict(settings), "rows": rows}


def render(summary: dict[str, Any]) -> str:
    facts, settings = summary["machine"], summary["settings"]
    load = " / ".join(f"{a:.2f}" for a in facts["loadavg_at_start"])
    load_end = " / ".join(f"{a:.2f}" for a in facts["loadavg_at_end"])
    machine = (
        f"{facts['date']}, {facts['nproc']} cores ({facts['cpu']}), "
        f"{facts['nats_server']}, nats-py {facts['nats_py']}; load average (1/5/15 min) "
        f"{load} at the start, {load_end} at the end."
    )
    setup = (
        f"Rate: {settings['messages']:,} messages of {len(BODY)} bytes published "
        "round-robin while being consumed. Newcomer: its first message is delivered this "
        f"long after the consumer starts on {settings['backlog']:,} of A's stored before "
        'it ("A before": how many came first; * = B shares A\'s consumer).'
    )
    out = ["# Intake layouts", "", f"`{facts['command']}`", "", machine, "", setup, ""]
    cells = []
    for r in summary["rows"]:
        hol = r["head_of_line"]
        requests = ", ".join(f"{k} {v:.2f}" for k, v in r["requests_per_msg"].items())
        cells.append(
            [
                r["layout"],
                str(r["tenants"]),
                str(r["consumers"]),
                f"{r['msgs_per_s']:,.0f}",
                f"{r['server_cpu_us_per_msg']:.0f}",
                f"{r['consumer_cpu_us_per_msg']:.0f}",
                f"{r['server_rss_kb'] / 1024:.0f}",
                f"{1e3 * hol['newcomer_after_s']:.1f}",
                f"{hol['delivered_before_newcomer']:,}"
                + ("*" if hol["newcomer_shares_consumer"] else ""),
                requests,
            ]
        )
    out += table(
        [
            "layout",
            "tenants",
            "consumers",
            "msg/s",
            "server us/msg",
            "consumer us/msg",
            "server RSS MiB",
            "newcomer ms",
            "A before",
            "API requests per msg",
        ],
        cells,
    )
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.archive.intake_layouts", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--quick", action="store_true", help="the few-second variant: 10 tenants, 1,000 messages"
    )
    parser.add_argument("--tenants", type=_counts, help="tenant counts, e.g. 10,100,1000")
    parser.add_argument(
        "--layouts", type=_layouts, help=f"comma-separated, of {', '.join(LAYOUTS)} (default: all)"
    )
    parser.add_argument("--messages", type=int, help="messages per rate run (default 10000)")
    parser.add_argument("--backlog", type=int, help="A's backlog (default 5000)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    return parser


def _counts(text: str) -> tuple[int, ...]:
    counts = tuple(int(part) for part in text.split(","))
    if any(count < 2 for count in counts):
        raise argparse.ArgumentTypeError("each tenant count must be at least 2 (A and B)")
    return counts


def _layouts(text: str) -> tuple[str, ...]:
    names = tuple(text.split(","))
    unknown = [name for name in names if name not in LAYOUTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown layouts {unknown}; known: {list(LAYOUTS)}")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    settings = with_overrides(
        QUICK if args.quick else FULL,
        {
            "tenant_counts": args.tenants,
            "layouts": args.layouts,
            "messages": args.messages,
            "backlog": args.backlog,
        },
    )
    if not 1 <= settings.backlog < BROKER.max_queued_per_subject:
        parser.error(
            f"--backlog must be 1..{BROKER.max_queued_per_subject - 1} (A's backlog is one subject)"
        )
    if settings.messages < 1:
        parser.error("--messages must be at least 1")
    summary = asyncio.run(run_all(settings, command_line("bench.archive.intake_layouts", argv)))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / ("quick.json" if args.quick else "summary.json")
    write_json(path, summary)
    print(render(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
