"""Scenario 5, end to end: 10, 100 and 1,000 active tenants.

    python -m bench.scenarios.scale [--quick] [--tenants 10 100 1000] [--repeats 3]

For each tenant count N, on fresh stacks (`bench.harness.stack`, one simulated worker):

- dispatch rate: scenario 3's fairq run (`bench.scenarios.rate`: an instant engine with
  max_sequences 1024, `requests` requests of max_tokens 1 due at once) spread
  round-robin over N tenants, `repeats` times, with `registered` tenants listed in the
  config (the N active ones among them); in each round beside it the raw path with
  fairq's consumer layout: one durable pull consumer per shard of the requests stream,
  each with a standing pull into one inbox (as the dispatcher's intake does), every
  message acked at once, no processing, in a fresh process. The goal: at 1,000 tenants
  at least 70% of the rate at 10, in the same run;
- memory: VmRSS of the dispatcher process (/proc/<pid>/status) once the stack is up and
  at the end of each rate run, and its high-water mark VmHWM; nats-server's VmRSS and
  the consumers on the requests stream at the end;
- a newcomer behind N-1 backlogged tenants: on a time-scaled engine (default engine
  model, 64 sequences, time x0.1, so the backlog lasts while newcomers are measured),
  N-1 listed tenants publish a backlog of about `backlog` requests in all (max_tokens 64,
  at least `MIN_BACKLOG_PER_TENANT` each; no `Fq-Reply`), then, once the depth API shows
  every one of them queued or running, `newcomers` new tenants send one request each
  (max_tokens 1) one after the other: a tenant the config lists (idle until now) first,
  then alternately one it does not (admitted as an unlisted tenant; neither needs
  anything made for it: its shard's pull delivers its request) and a listed one. Each
  newcomer's time to first token is measured at the client, in wall milliseconds, with
  its queue time in the dispatcher (the done event's `queued_s`). The
  first arrives while the N-1 are still new flows themselves; the later ones once the
  first was served. The row N = 1 is the same newcomers with no backlog, the floor of
  the path on this engine (whose steps last 2.5-4.4 ms wall).

Writes bench/results/scale/summary.json; prints a markdown digest. `--quick` runs 10 and
100 tenants with smaller runs, once.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench.harness.cli import note_run, run_scenario, scenario_parser, write_summary
from bench.harness.machine import command_line, machine_facts, with_overrides
from bench.harness.measured import Arrival, Replay, describe_outcomes
from bench.harness.paths import RESULTS_DIR
from bench.harness.procstat import memory_kb
from bench.harness.raw import SETTINGS as RAW_SETTINGS
from bench.harness.raw import raw_consumer_name, raw_run, shard_consumer_job, spawn_pool
from bench.harness.stack import Stack, StackSpec, benchmark_config
from bench.scenarios.rate import (
    INPUT_TOKENS,
    MAX_TOKENS,
    burst,
    instant_spec,
    raw_summary,
    stack_rate,
    tenant_names,
)
from bench.scenarios.scale_report import describe_newcomers, render
from dispatcher.sim.fairness import latency_summary
from producers.client import Client

TITLE = "End to end: 10, 100 and 1,000 active tenants"
RESULTS = RESULTS_DIR / "scale"
BACKLOG_MAX_TOKENS = 64
# Enough that each backlogged tenant stays backlogged while the newcomers arrive, so the
# backlog outlasts the first newcomer.
MIN_BACKLOG_PER_TENANT = 20
NEWCOMER_GAP_S = 0.2
SHARDS = RAW_SETTINGS.intake_shards
# Bound on waiting for the dispatcher to hold every backlogged tenant.
BACKLOGGED_WITHIN_S = 60.0


@dataclass(frozen=True, slots=True)
class Settings:
    tenant_counts: tuple[int, ...] = (10, 100, 1000)
    requests: int = 10_000
    repeats: int = 3
    registered: int = 10_000
    max_sequences: int = 1024
    backlog: int = 5_000
    newcomers: int = 10
    time_scale: float = 0.1
    timeout_s: float = 120.0


FULL = Settings()
QUICK = Settings(
    tenant_counts=(10, 100),
    requests=3_000,
    repeats=1,
    registered=1_000,
    backlog=1_000,
    newcomers=4,
    timeout_s=60.0,
)


# -- dispatch rate and memory --------------------------------------------------------------


async def rate_runs(
    tenants: int, settings: Settings, out_dir: Path, pool: ProcessPoolExecutor
) -> list[dict[str, Any]]:
    """Rounds of the raw path with one consumer per shard, then fairq."""
    names = tenant_names(tenants)
    idle = [f"idle{n}" for n in range(max(0, settings.registered - tenants))]
    spec = instant_spec("fairq", 1, settings.max_sequences, names + idle)
    per_tenant = -(-settings.requests // tenants)
    arrivals = burst(names, per_tenant * tenants)
    runs = []
    for repeat in range(settings.repeats):
        started = time.monotonic()
        raw = raw_summary(
            await raw_run(
                [replace(a, streamed=False) for a in arrivals],
                pool,
                shard_consumer_job,
                (len(arrivals),),
                raw_consumer_name(SHARDS - 1),
                settings.timeout_s,
            )
        )
        run = await stack_rate(
            spec, arrivals, out_dir / "logs" / f"rate-{tenants}-{repeat}", settings.timeout_s
        )
        run["raw_shards"] = raw
        runs.append(run)
        note_run(
            f"{tenants} tenants, round {repeat}",
            started,
            f"raw with a consumer per shard {raw['rate_per_s']:,.0f}/s, fairq "
            f"{run['rate_per_s']:,.0f} requests/s, {describe_outcomes(run['outcomes'])}, "
            f"dispatcher {run['dispatcher_memory_kb']['rss_kb'] / 1024:.0f} MiB, server "
            f"{run['server_memory_kb']['rss_kb'] / 1024:.0f} MiB, {run['consumers']} consumers",
        )
    return runs


def summarise_rates(runs: list[dict[str, Any]]) -> dict[str, Any]:
    rates = [run["rate_per_s"] for run in runs]
    raw = [run["raw_shards"]["rate_per_s"] for run in runs]
    memory = [run["dispatcher_memory_kb"] for run in runs]

    def cpu_us(process: str, path: str | None = None) -> float:
        """Median CPU microseconds per request of `process` in fairq's runs (or `path`'s)."""
        return statistics.median(
            1e6 * (run[path] if path else run)["cpu_s"][process] / run["requests"] for run in runs
        )

    return {
        "rates": rates,
        "median": statistics.median(rates),
        "raw_shards_rates": raw,
        "raw_shards_median": statistics.median(raw),
        "fairq_over_raw_median": statistics.median(f / r for f, r in zip(rates, raw)),
        "cpu_us_per_request": {
            "nats-server": cpu_us("nats-server"),
            "dispatcher": cpu_us("dispatcher"),
            "raw nats-server": cpu_us("nats-server", "raw_shards"),
        },
        "rss_at_start_kb": statistics.median(
            run["dispatcher_memory_kb_at_start"]["rss_kb"] for run in runs
        ),
        "rss_end_kb": statistics.median(m["rss_kb"] for m in memory),
        "peak_rss_kb": max(m["peak_rss_kb"] for m in memory),
        "server_rss_end_kb": statistics.median(run["server_memory_kb"]["rss_kb"] for run in runs),
        "consumers": max(run["consumers"] for run in runs),
        "runs": runs,
    }


# -- a newcomer behind N-1 backlogged tenants ----------------------------------------------


def newcomer_names(count: int) -> list[tuple[str, bool]]:
    """(tenant, listed in the config), alternating listed and unlisted, a listed one first."""
    return [(f"new{'L' if n % 2 == 0 else 'U'}{n // 2}", n % 2 == 0) for n in range(count)]


async def newcomer_run(tenants: int, settings: Settings, out_dir: Path) -> dict[str, Any]:
    backlogged = tenant_names(tenants - 1)
    newcomers = newcomer_names(settings.newcomers)
    listed = backlogged + [name for name, is_listed in newcomers if is_listed]
    # The backlog is abandoned at the end: the dispatcher need not wait for it to finish.
    spec = StackSpec(
        mode="fairq",
        workers=1,
        time_scale=settings.time_scale,
        config=benchmark_config(dict.fromkeys(listed, 1.0)),
        dispatcher_args=("--grace", "1"),
    )
    per_tenant = (
        max(MIN_BACKLOG_PER_TENANT, -(-settings.backlog // len(backlogged))) if backlogged else 0
    )
    backlog = [
        Arrival(tenant, 0.0, INPUT_TOKENS, BACKLOG_MAX_TOKENS, streamed=False)
        for _ in range(per_tenant)
        for tenant in backlogged
    ]
    async with Stack(spec, out_dir / "logs" / f"newcomer-{tenants}") as stack:
        published = await stack.fire(backlog, timeout_s=settings.timeout_s)
        backlog_end = published.started_at + published.wall_s
        async with Client.connect(stack.url, prefix=stack.settings.prefix) as client:
            held_before = await _until_backlogged(client, set(backlogged), published)
            samples = []
            for tenant, is_listed in newcomers:
                samples.append(
                    await _newcomer(stack, tenant, is_listed, backlog_end, settings.timeout_s)
                )
                await asyncio.sleep(NEWCOMER_GAP_S)
            held_after = await _backlogged(client, set(backlogged))
        memory = memory_kb(stack.pids()["dispatcher"])
    later = samples[1:]
    return {
        "backlogged_tenants": len(backlogged),
        "backlog_per_tenant": per_tenant,
        "backlog_outcomes": published.counts(),
        "backlogged_at_first_newcomer": held_before,
        "backlogged_after_last_newcomer": held_after,
        "newcomers": samples,
        "dispatcher_memory_kb": memory,
        "first_ttft_ms": _ms(samples[0]["ttft_s"]),
        "first_queued_ms": _ms(samples[0]["queued_s"]),
        "later_ttft_ms": {
            "listed": _summary_ms(later, True),
            "unlisted": _summary_ms(later, False),
        },
    }


async def _newcomer(
    stack: Stack, tenant: str, listed: bool, backlog_end: float, timeout_s: float
) -> dict[str, Any]:
    """One request of a new tenant, streamed: its TTFT at the client and its queue time
    in the dispatcher (the done event's `queued_s`), seconds."""
    since_backlog_s = time.time() - backlog_end
    arrival = Arrival(tenant, 0.0, INPUT_TOKENS, MAX_TOKENS)
    result = await stack.fire([arrival], timeout_s=timeout_s, in_flight=1)
    m = result.measured[0]
    ttft = None if m.first_token is None or m.submitted is None else m.first_token - m.submitted
    return {
        "tenant": tenant,
        "listed": listed,
        "outcome": m.outcome,
        "since_backlog_s": since_backlog_s,
        "ttft_s": ttft,
        "queued_s": m.queued_s,
    }


async def _backlogged(client: Client, tenants: set[str]) -> int:
    """How many of `tenants` the dispatcher holds requests of (queued or running)."""
    depth = await client.depth()
    return len({q.tenant for q in depth.queues if q.tenant in tenants and (q.queued or q.running)})


async def _until_backlogged(client: Client, tenants: set[str], published: Replay) -> int:
    held = 0
    try:
        async with asyncio.timeout(BACKLOGGED_WITHIN_S):
            while (held := await _backlogged(client, tenants)) < len(tenants):
                await asyncio.sleep(0.1)
    except TimeoutError:
        raise RuntimeError(
            f"the dispatcher held requests of only {held} of the "
            f"{len(tenants)} backlogged tenants after {BACKLOGGED_WITHIN_S} s "
            f"(backlog: {describe_outcomes(published.counts())})"
        ) from None
    return held


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds


def _summary_ms(samples: list[dict[str, Any]], listed: bool) -> dict[str, float | None]:
    """p50/p95/p99 and max TTFT of the listed (or unlisted) newcomers, milliseconds."""
    values = [
        1e3 * s["ttft_s"] for s in samples if s["listed"] == listed and s["ttft_s"] is not None
    ]
    return latency_summary(values) | {"max": max(values, default=None)}


async def run_all(settings: Settings, out_dir: Path, command: str) -> dict[str, Any]:
    facts = machine_facts(command)
    rows: dict[str, Any] = {str(count): {} for count in (1, *settings.tenant_counts)}
    with spawn_pool() as pool:
        for count in settings.tenant_counts:
            rows[str(count)]["rate"] = summarise_rates(
                await rate_runs(count, settings, out_dir, pool)
            )
    for count in (1, *settings.tenant_counts):
        row = rows[str(count)]
        started = time.monotonic()
        row["newcomer"] = await newcomer_run(count, settings, out_dir)
        note_run(f"{count} tenants, newcomers", started, describe_newcomers(row["newcomer"]))
    summary = {
        "scenario": "scale",
        "machine": facts,
        "settings": asdict(settings),
        "tenants": rows,
        "plots": [],
    }
    return write_summary(out_dir, summary)


def main(argv: list[str] | None = None) -> int:
    parser = scenario_parser("bench.scenarios.scale", __doc__, RESULTS)
    parser.add_argument(
        "--tenants", type=int, nargs="+", help="tenant counts (default 10 100 1000; quick 10 100)"
    )
    parser.add_argument("--repeats", type=int, help="rate runs per count (default 3)")
    args = parser.parse_args(argv)
    command = command_line("bench.scenarios.scale", argv)
    settings = with_overrides(
        QUICK if args.quick else FULL,
        {
            "tenant_counts": tuple(args.tenants) if args.tenants else None,
            "repeats": args.repeats or None,
        },
    )
    return run_scenario(args.out_dir, run_all(settings, args.out_dir, command), render)


if __name__ == "__main__":
    sys.exit(main())
