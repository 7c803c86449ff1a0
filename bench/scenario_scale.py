"""Scenario 5, end to end: 10, 100 and 1,000 active tenants.

    python -m bench.scenario_scale [--quick] [--tenants 10 100 1000] [--repeats 3]

For each tenant count N, on fresh stacks (`bench.stack`, one simulated worker):

- dispatch rate: scenario 3's fairq run (`bench.scenario_rate`: an instant engine with
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

import argparse
import asyncio
import json
import multiprocessing
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import nats
from nats.aio.msg import Msg

from bench import scenario_rate
from bench.firehose import fire
from bench.machine import command_line, machine_facts, table, with_overrides
from bench.procstat import memory_kb, run_timed
from bench.recorder import Arrival, Replay, describe_outcomes
from bench.stack import Stack, StackSpec, benchmark_config
from broker_config import jetstream
from broker_config.config import BrokerSettings
from broker_config.streams import ConsumerLimits, ConsumerSpec, ensure_consumer
from dispatcher.sim.fairness import latency_summary
from producers.client import Client

TITLE = "End to end: 10, 100 and 1,000 active tenants"
RESULTS = Path(__file__).resolve().parent / "results" / "scale"
BACKLOG_MAX_TOKENS = 64
# Well over a DRR round of each backlogged tenant (the example config's quantum of 8
# model units is 5 requests of 64 tokens as estimated, about 10 once charges are
# corrected to the real output), so the backlog outlasts the first newcomer.
MIN_BACKLOG_PER_TENANT = 20
NEWCOMER_GAP_S = 0.2
SHARDS = BrokerSettings().intake_shards
# Bound on the raw shard consumers' run (also their pulls' expiry).
RAW_CONSUME_WITHIN_S = 120.0
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
    names = scenario_rate.tenant_names(tenants)
    idle = [f"idle{n}" for n in range(max(0, settings.registered - tenants))]
    spec = scenario_rate.instant_spec("fairq", 1, settings.max_sequences, names + idle)
    per_tenant = -(-settings.requests // tenants)
    arrivals = scenario_rate.burst(names, per_tenant * tenants)
    runs = []
    for repeat in range(settings.repeats):
        started = time.monotonic()
        raw = await scenario_rate.raw_rate(
            [replace(a, streamed=False) for a in arrivals],
            pool,
            shard_consumer_job,
            (len(arrivals),),
            raw_consumer_name(SHARDS - 1),
            settings.timeout_s,
        )
        run = await scenario_rate.stack_rate(
            spec, arrivals, out_dir / "logs" / f"rate-{tenants}-{repeat}", settings.timeout_s
        )
        run["raw_shards"] = raw
        runs.append(run)
        print(
            f"{tenants} tenants, round {repeat}: raw with a consumer per shard "
            f"{raw['rate_per_s']:,.0f}/s, fairq {run['rate_per_s']:,.0f} requests/s, "
            f"{describe_outcomes(run['outcomes'])}, dispatcher "
            f"{run['dispatcher_memory_kb']['rss_kb'] / 1024:.0f} MiB, server "
            f"{run['server_memory_kb']['rss_kb'] / 1024:.0f} MiB, {run['consumers']} "
            f"consumers ({time.monotonic() - started:.1f} s)",
            file=sys.stderr,
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


def raw_consumer_name(n: int) -> str:
    return f"bench~raw~{n}"


def shard_consumer_job(url: str, messages: int) -> tuple[float, float]:
    """In a fresh process: when the last ack was sent, and the CPU seconds it took."""
    return run_timed(_consume_shards, url, messages)


async def _consume_shards(url: str, messages: int) -> float:
    """fairq's consumer layout without fairq: one durable pull consumer per shard, each
    with one standing pull for all its messages, every reply to one wildcard inbox, each
    message acked at once. Unix time when the last ack reached the server."""
    subjects = BrokerSettings().subjects
    nc = await nats.connect(url, connect_timeout=5)
    try:
        js = nc.jetstream()
        remaining = messages
        consumed = asyncio.Event()

        async def on_message(msg: Msg) -> None:
            nonlocal remaining
            if jetstream.status_of(msg)[0] is not None:
                return  # the pull's end (a status message), not a request
            await msg.ack()
            remaining -= 1
            if not remaining:
                consumed.set()

        inbox = nc.new_inbox()
        await nc.subscribe(f"{inbox}.*", cb=on_message)
        pull = jetstream.pull_request(messages, RAW_CONSUME_WITHIN_S)
        for shard in range(SHARDS):
            name = raw_consumer_name(shard)
            await ensure_consumer(
                js,
                subjects.requests_stream,
                ConsumerSpec(
                    name, subjects.shard_filter(shard), ConsumerLimits(max_ack_pending=messages)
                ),
            )
            await nc.publish(
                jetstream.pull_subject(subjects.requests_stream, name),
                pull,
                reply=f"{inbox}.{shard}",
            )
        async with asyncio.timeout(RAW_CONSUME_WITHIN_S):
            await consumed.wait()
        await nc.flush()  # the acks have reached the server
        return time.time()
    finally:
        await nc.drain()


# -- a newcomer behind N-1 backlogged tenants ----------------------------------------------


def newcomer_names(count: int) -> list[tuple[str, bool]]:
    """(tenant, listed in the config), alternating listed and unlisted, a listed one first."""
    return [(f"new{'L' if n % 2 == 0 else 'U'}{n // 2}", n % 2 == 0) for n in range(count)]


async def newcomer_run(tenants: int, settings: Settings, out_dir: Path) -> dict[str, Any]:
    backlogged = scenario_rate.tenant_names(tenants - 1)
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
        Arrival(tenant, 0.0, scenario_rate.INPUT_TOKENS, BACKLOG_MAX_TOKENS, streamed=False)
        for _ in range(per_tenant)
        for tenant in backlogged
    ]
    async with Stack(spec, out_dir / "logs" / f"newcomer-{tenants}") as stack:
        published = await fire(
            stack.url,
            backlog,
            endpoint=spec.endpoint,
            settings=stack.settings,
            in_flight=scenario_rate.PUBLISH_IN_FLIGHT,
            timeout_s=settings.timeout_s,
            alive=stack.check_alive,
        )
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
    result = await fire(
        stack.url,
        [Arrival(tenant, 0.0, scenario_rate.INPUT_TOKENS, scenario_rate.MAX_TOKENS)],
        endpoint=stack.spec.endpoint,
        settings=stack.settings,
        in_flight=1,
        timeout_s=timeout_s,
        alive=stack.check_alive,
    )
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


# -- report --------------------------------------------------------------------------------


def render(summary: dict[str, Any]) -> str:
    rows = []
    rates = {count: row["rate"] for count, row in summary["tenants"].items() if row.get("rate")}
    fewest = rates[min(rates, key=int)]["median"] if rates else None
    for count, rate in rates.items():
        rows.append(
            [
                count,
                ", ".join(f"{r:,.0f}" for r in rate["rates"]),
                f"{rate['median']:,.0f}",
                f"{rate['median'] / fewest:.0%}",
                ", ".join(f"{r:,.0f}" for r in rate["raw_shards_rates"]),
                f"{rate['fairq_over_raw_median']:.0%}",
                " / ".join(
                    f"{rate['cpu_us_per_request'][p]:.0f}"
                    for p in ("nats-server", "dispatcher", "raw nats-server")
                ),
                _mib(rate["rss_at_start_kb"]),
                _mib(rate["rss_end_kb"]),
                _mib(rate["peak_rss_kb"]),
                _mib(rate["server_rss_end_kb"]),
                str(rate["consumers"]),
            ]
        )
    lines = [
        (
            "Dispatch rate, requests/s (instant engine, scenario 3's fairq run; "
            f"{summary['settings']['registered']:,} tenants registered in the config, "
            "the active ones among them), beside the raw path with fairq's consumer "
            "layout (one pull consumer per shard, fetch and ack, no processing), and "
            "memory:"
        ),
        "",
    ]
    lines += table(
        [
            "tenants",
            "fairq per run",
            "fairq median",
            "of the fewest tenants'",
            "raw, consumer per shard",
            "fairq / raw",
            "CPU us/request: server / dispatcher / raw's server",
            "dispatcher RSS when up, MiB",
            "after the run, MiB",
            "peak, MiB",
            "nats-server RSS after, MiB",
            "consumers",
        ],
        rows,
    )
    lines += [
        "",
        (
            "A newcomer's time to first token behind N-1 backlogged tenants, wall ms "
            f"(engine time x{summary['settings']['time_scale']:g}). The first newcomer "
            "arrives just after the N-1 became backlogged; the later ones (p50 / max) "
            "once the first was served:"
        ),
        "",
    ]
    rows = []
    for count, row in summary["tenants"].items():
        new = row["newcomer"]
        rows.append(
            [
                count,
                f"{new['backlogged_tenants']} x {new['backlog_per_tenant']}",
                (
                    f"{new['backlogged_at_first_newcomer']} / "
                    f"{new['backlogged_after_last_newcomer']}"
                ),
                f"{_num(new['first_ttft_ms'])} (queued {_num(new['first_queued_ms'])})",
                _pair(new["later_ttft_ms"]["listed"]),
                _pair(new["later_ttft_ms"]["unlisted"]),
                _mib(new["dispatcher_memory_kb"]["peak_rss_kb"]),
            ]
        )
    lines += table(
        [
            "N",
            "backlog (tenants x requests)",
            "backlogged at first / after last",
            "first newcomer TTFT",
            "later listed",
            "later unlisted",
            "dispatcher peak RSS, MiB",
        ],
        rows,
    )
    return "\n".join(lines)


def _mib(kb: float) -> str:
    return f"{kb / 1024:.0f}"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _pair(values: dict[str, float | None]) -> str:
    return f"{_num(values['p50'])} / {_num(values['max'])}"


async def run_all(settings: Settings, out_dir: Path, command: str) -> dict[str, Any]:
    facts = machine_facts(command)
    rows: dict[str, Any] = {str(count): {} for count in (1, *settings.tenant_counts)}
    # Fresh interpreters for the raw consumers (spawn, one job each).
    pool = ProcessPoolExecutor(
        max_workers=1, mp_context=multiprocessing.get_context("spawn"), max_tasks_per_child=1
    )
    with pool:
        for count in settings.tenant_counts:
            rows[str(count)]["rate"] = summarise_rates(
                await rate_runs(count, settings, out_dir, pool)
            )
    for count in (1, *settings.tenant_counts):
        row = rows[str(count)]
        started = time.monotonic()
        row["newcomer"] = await newcomer_run(count, settings, out_dir)
        new = row["newcomer"]
        print(
            f"{count} tenants, newcomers: first {_num(new['first_ttft_ms'])} ms, later "
            f"listed {_pair(new['later_ttft_ms']['listed'])} ms, unlisted "
            f"{_pair(new['later_ttft_ms']['unlisted'])} ms "
            f"({time.monotonic() - started:.1f} s)",
            file=sys.stderr,
        )
    summary = {
        "scenario": "scale",
        "machine": facts,
        "settings": asdict(settings),
        "tenants": rows,
        "plots": [],
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.scenario_scale", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="the few-second smoke variant")
    parser.add_argument(
        "--tenants", type=int, nargs="+", help="tenant counts (default 10 100 1000; quick 10 100)"
    )
    parser.add_argument("--repeats", type=int, help="rate runs per count (default 3)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = command_line("bench.scenario_scale", argv)
    settings = with_overrides(
        QUICK if args.quick else FULL,
        {
            "tenant_counts": tuple(args.tenants) if args.tenants else None,
            "repeats": args.repeats or None,
        },
    )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    summary = asyncio.run(run_all(settings, args.out_dir, command))
    print(render(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
