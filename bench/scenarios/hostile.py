"""Hostile input through the live stack: thousands of generated attacks, and what they do.

    python -m bench.scenarios.hostile [--inputs 10000] [--seed 1] [--concurrency 64] [--out FILE]

A real stack (`bench.harness.stack`: an embedded nats-server, `python -m dispatcher` and two
simulated workers, each its own process) runs with the small `[dispatcher.input]` limits
of `bench.scenarios.hostile_inputs`. The probes it draws (random bytes, truncated and deeply
nested JSON and msgpack, wrong types, bodies over every limit and over the broker's
largest message, invalid UTF-8, bad images, forged and missing headers, odd subject
tokens, ids reused across tenants, floods of status and cancel calls for unknown ids,
and valid requests among them) go out `--concurrency` at a time, each message checked
against the outcome the contract promises for it. At the end:

- every message the broker stored was answered as promised: its error event (code and
  message), or for those without a usable `Fq-Reply` exactly one count each in
  `fairq_invalid_messages_total{reply="none"}`; every valid one finished `done`;
- every message the broker refused failed at the publisher with the promised error;
- the dispatcher is alive, answers the depth API, and the requests stream is empty;
  the streams fairq relies on still exist (a forged `Fq-Reply` aimed at the JetStream
  API did nothing);
- the dispatcher's RSS after the run, against after a first tenth of the probes (the
  baseline, once every code path has been touched), stays within `--max-rss-growth`.

Exit status 0 when all of that holds; the figures go to `--out` (JSON) and stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import msgspec
import nats
import nats.errors

from bench.harness.cli import bench_parser, write_json
from bench.harness.machine import command_line, machine_facts
from bench.harness.paths import RESULTS_DIR
from bench.harness.procstat import memory_kb
from bench.harness.stack import Stack, StackSpec, benchmark_config
from bench.scenarios.hostile_inputs import TENANTS, generate, suite_options
from bench.scenarios.hostile_runner import (
    PUBLISH_TIMEOUT_S,
    Report,
    Runner,
    flood,
    quantile,
)
from broker_config.config import Config, Tenant

RESULTS = RESULTS_DIR / "hostile"
# Bound on the requests stream emptying after the probes.
SETTLE_TIMEOUT_S = 30.0
BASELINE_FRACTION = 0.1
# The victim's status calls during the flood: a call that waited behind the flood's
# lookups would take seconds.
VICTIM_STATUS_MAX_S = 1.0


def hostile_config() -> Config:
    """The benchmark config (admission out of the way) with the suite's tenants listed,
    others refused, and the suite's input limits."""
    config = benchmark_config()
    tier = config.tiers[0].name
    return msgspec.structs.replace(
        config,
        tenants={name: Tenant(tier=tier, weight=1.0) for name in (*TENANTS, "warmup")},
        unlisted_tenants=msgspec.structs.replace(config.unlisted_tenants, policy="reject"),
        dispatcher=suite_options(config.dispatcher),
    )


def rss_mib(pid: int) -> float:
    return memory_kb(pid)["rss_kb"] / 1024


def metric(url: str, name: str, labels: str) -> float:
    """One sample of the dispatcher's /metrics."""
    with urllib.request.urlopen(url, timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(f"{name}{{{labels}}} "):
                return float(line.split()[-1])
    raise LookupError(f"{name}{{{labels}}} is not in {url}")


def metrics_url(log: Path) -> str:
    for line in log.read_text().splitlines():
        if line.startswith("METRICS_URL="):
            return line.split("=", 1)[1]
    raise LookupError(f"the dispatcher printed no METRICS_URL in {log}")


async def settled(stack: Stack, nc: nats.NATS) -> dict[str, object]:
    """The state after the run: the depth API's answer time and what the streams hold,
    once the requests stream is empty or `SETTLE_TIMEOUT_S` passed."""
    subjects = stack.spec.config.subjects
    js = nc.jetstream()
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        stack.check_alive()
        state = (await js.stream_info(subjects.requests_stream)).state
        if not state.messages or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    started = time.monotonic()
    depth = await nc.request(subjects.depth, b"{}", timeout=PUBLISH_TIMEOUT_S)
    answered_s = time.monotonic() - started
    await js.stream_info(subjects.parked_stream)  # raises if a forged reply deleted it
    return {
        "requests_left_in_stream": state.messages,
        "depth_api_answer_s": round(answered_s, 4),
        "depth_api_queues": len(json.loads(depth.data)["queues"]),
    }


async def run(
    inputs: int,
    seed: int,
    concurrency: int,
    log_dir: Path,
    *,
    flood_backlog: int = 0,
    flood_calls: int = 0,
) -> dict[str, object]:
    probes = generate(inputs, seed)
    spec = StackSpec(
        mode="fairq",
        workers=2,
        time_scale=0.02,
        config=hostile_config(),
        dispatcher_args=("--metrics-port", "0"),
    )
    report = Report()
    async with Stack(spec, log_dir) as stack:
        pid = stack.pids()["dispatcher"]
        url = metrics_url(log_dir / "dispatcher.log")
        rss_start = rss_mib(pid)
        async with stack.connect() as nc:
            runner = Runner(nc, stack.url, report)
            await runner.start()
            split = max(1, int(len(probes) * BASELINE_FRACTION))
            started = time.monotonic()

            async def watch() -> None:
                while True:
                    await asyncio.sleep(1.0)
                    stack.check_alive()

            watchdog = asyncio.create_task(watch())
            try:
                await runner.run(probes[:split], concurrency)
                rss_baseline = rss_mib(pid)
                await runner.run(probes[split:], concurrency)
            finally:
                watchdog.cancel()
            elapsed = time.monotonic() - started
            after = await settled(stack, nc)
            rss_end = rss_mib(pid)
            counted = metric(url, "fairq_invalid_messages_total", 'reply="none"')
            flooded = await flood(nc, flood_backlog, flood_calls) if flood_calls else None
            stack.check_alive()
    latency = sorted(report.valid_latency_s)
    return {
        "inputs": len(probes),
        "messages": report.sends,
        "concurrency": concurrency,
        "seed": seed,
        "elapsed_s": round(elapsed, 1),
        "by_kind": dict(report.by_kind.most_common()),
        "outcomes": dict(report.got.most_common()),
        "mismatches": report.mismatches,
        "leaks": runner.leaks,
        "unanswered_sent": report.unanswered,
        "unanswered_counted": counted,
        "valid_done": report.got["done"],
        "valid_latency_s": {
            "p50": quantile(latency, 0.5),
            "p99": quantile(latency, 0.99),
            "max": latency[-1] if latency else None,
        },
        "dispatcher_rss_mib": {
            "start": round(rss_start, 1),
            "baseline": round(rss_baseline, 1),
            "end": round(rss_end, 1),
            "growth_pct": round(100 * (rss_end / rss_baseline - 1), 1),
        },
        "dispatcher_crashes": 0,  # a crash raises StackError and ends the run before this
        **after,
        "flood": flooded,
    }


def failures(result: dict[str, object], max_rss_growth_pct: float) -> list[str]:
    """Why a run fails the suite; empty when it passes."""
    problems = (
        [f"{len(result['mismatches'])} messages were not answered as the contract promises"]
        if result["mismatches"]
        else []
    )
    problems += [str(leak) for leak in result["leaks"]]
    if result["unanswered_sent"] != result["unanswered_counted"]:
        problems.append(
            f"{result['unanswered_sent']} messages without a usable Fq-Reply, "
            f'but fairq_invalid_messages_total{{reply="none"}} is '
            f"{result['unanswered_counted']:g}"
        )
    if result["requests_left_in_stream"]:
        problems.append(f"{result['requests_left_in_stream']} requests left in the stream")
    flooded = result.get("flood")
    if flooded:
        if flooded["answers"].get("no answer"):
            problems.append(f"{flooded['answers']['no answer']} flood calls got no answer")
        slowest = flooded["victim_during"]["status_s"]["max"]
        if slowest > VICTIM_STATUS_MAX_S:
            problems.append(
                f"another tenant's status call took {slowest} s during the flood "
                f"(limit {VICTIM_STATUS_MAX_S} s)"
            )
    growth = result["dispatcher_rss_mib"]["growth_pct"]
    if growth > max_rss_growth_pct:
        problems.append(f"dispatcher RSS grew {growth}% (limit {max_rss_growth_pct}%)")
    return problems


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser("bench.scenarios.hostile", __doc__)
    parser.add_argument("--inputs", type=int, default=10_000, help="probes to send")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=64, help="probes in flight")
    parser.add_argument("--max-rss-growth", type=float, default=10.0, metavar="PCT")
    parser.add_argument(
        "--flood-backlog",
        type=int,
        default=5000,
        metavar="N",
        help="after the probes: the flooding tenant's waiting requests",
    )
    parser.add_argument(
        "--flood-calls",
        type=int,
        default=1000,
        metavar="N",
        help="status and cancel calls for unknown ids (0: no flood)",
    )
    parser.add_argument("--out", type=Path, help="result JSON (default: bench/results/hostile)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    facts = machine_facts(command_line("bench.scenarios.hostile", argv))
    with tempfile.TemporaryDirectory(prefix="fairq-hostile-") as log_dir:
        result = asyncio.run(
            run(
                args.inputs,
                args.seed,
                args.concurrency,
                Path(log_dir),
                flood_backlog=args.flood_backlog,
                flood_calls=args.flood_calls,
            )
        )
    problems = failures(result, args.max_rss_growth)
    out = args.out or RESULTS / f"hostile-{args.inputs}-seed{args.seed}.json"
    write_json(out, {"machine": facts, "result": result, "problems": problems}, 2)
    summary = {k: v for k, v in result.items() if k != "mismatches"}
    print(json.dumps(summary, indent=2))
    for mismatch in result["mismatches"][:20]:
        print("MISMATCH", mismatch)
    for problem in problems:
        print("FAIL:", problem)
    print(f"results in {out}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
