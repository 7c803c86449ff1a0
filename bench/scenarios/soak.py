"""Soak: 1,000 tenants for ten minutes on the real stack, and what the run leaves behind.

    python -m bench.scenarios.soak [--minutes 10] [--tenants 1000] [--seed 1] [--warmup-s 120]
                                   [--churn-per-s 0] [--out DIR] [--plot PNG] [--smoke]

The stack of `bench.harness.stack` (embedded nats-server, `python -m dispatcher`, two simulated
worker processes at engine time x0.5) with the benchmark config: admission out of the
way, so every well-formed request should end `done`. `listed_share` of the tenants are
listed in the config's tier; the others are admitted as unlisted tenants (the config's
`[unlisted_tenants]`, same tier and weight). A seeded mix of tenants, every request
published by `bench.harness.firehose` (JetStream to `fq.req.chat.<tenant>`, `Nats-Msg-Id`, its
own `Fq-Reply`):

- steady: Poisson arrivals at a rate of their own, U(0.02, 0.2) per second;
- bursty: U(20, 80) requests within a second, then U(60, 240) s of silence, again;
- flood: `flood_size` requests at once every U(180, 300) s: more than twice a tenant's
  window while the workers are full, so part of it is moved to the parked stream and the
  tenant gets a consumer there, which the server removes a minute after its last pull;
- idle: one or two requests in the first `idle_within_s`, then silence: whatever was
  made for them must go;
- garbage: Poisson at one per `garbage_gap_s`, bodies that break the contract (not JSON,
  wrong types, unknown fields, ...; `GARBAGE`); each must be answered `invalid_request`;
- once (`--churn-per-s`, none by default): on top of those, new unlisted tenants that
  send one request each and never come back, as an open population of tenants would.

Every `sample_s`: VmRSS and CPU seconds of the dispatcher and nats-server
(`bench.harness.procstat`), the consumers on the requests and parked streams (stream info), the
requests published and finished by outcome so far. After the load, the run waits
(bounded by `finish_timeout_s`) for every request's final event, then samples on for
`settle_s`, longer than the parked consumers' idle threshold, so that the last sample
shows what stays once everyone has gone quiet.

Writes <out>/<name>.json (`soak`; `churn` with `--churn-per-s`; `smoke`) and the plot
(RSS, consumers and request rates over time; docs/img/e2e_<name>.png), prints a markdown
digest, and exits 1, saying why, if a request was lost or refused by the broker, a
well-formed one did not end `done`, a garbage one was not answered `invalid_request`,
the dispatcher's RSS at the end is `rss_goal` (10%) or more above its RSS at the end of
the warm-up, the requests stream ever held more consumers than it has shards, or (a
settle longer than the idle threshold) a parked consumer was left at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

import nats

from bench.harness.cli import bench_parser, write_json
from bench.harness.machine import command_line, machine_facts, with_overrides
from bench.harness.measured import REFUSED, Measured, to_measure
from bench.harness.paths import DOCS_DIR, RESULTS_DIR
from bench.harness.procstat import CpuMeter, cpu_seconds, memory_kb
from bench.harness.recorder import PUBLISH_IN_FLIGHT
from bench.harness.stack import Stack, StackSpec, benchmark_config
from bench.scenarios.soak_load import (
    GARBAGE,
    KINDS,
    SHARED,
    SMOKE,
    Settings,
    Tenant,
    make_tenants,
    schedule,
)
from bench.scenarios.soak_report import failures, plot, render, verdict

RESULTS = RESULTS_DIR / "soak"
IMG = DOCS_DIR / "img"
# What tests and other benchmarks take from here: the load's parts are `soak_load`'s.
__all__ = [
    "GARBAGE",
    "KINDS",
    "SHARED",
    "SMOKE",
    "Settings",
    "Tenant",
    "make_tenants",
    "render",
    "run_named",
    "schedule",
]


# -- sampling ------------------------------------------------------------------------------


class Sampler:
    """Takes a sample every `every` seconds until stopped, and one more at the stop."""

    def __init__(self, stack: Stack, nc: nats.NATS, measured: list[Measured], every: float) -> None:
        self.stack = stack
        self.js = nc.jetstream()
        self.measured = measured
        self.every = every
        self.pids = stack.pids()
        self.samples: list[dict[str, Any]] = []
        self.started = time.monotonic()
        self._stop = asyncio.Event()

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        while True:
            await self.sample()
            try:
                await asyncio.wait_for(self._stop.wait(), self.every)
            except TimeoutError:
                continue
            await self.sample()
            return

    async def sample(self) -> None:
        self.stack.check_alive()  # a process that died fails the run now
        subjects = self.stack.settings.subjects
        consumers = {}
        for stream in (subjects.requests_stream, subjects.parked_stream):
            consumers[stream] = (await self.js.stream_info(stream)).state.consumer_count
        outcomes = Counter(
            m.outcome for m in self.measured if m.finished is not None or m.outcome == REFUSED
        )
        processes = {name: self.pids[name] for name in ("dispatcher", "nats-server")}
        self.samples.append(
            {
                "t": self.elapsed(),
                "rss_kb": {name: memory_kb(pid)["rss_kb"] for name, pid in processes.items()},
                "cpu_s": {name: cpu_seconds(pid) for name, pid in processes.items()},
                "consumers": {
                    "requests": consumers[subjects.requests_stream],
                    "parked": consumers[subjects.parked_stream],
                },
                "published": sum(m.acked is not None for m in self.measured),
                "finished": dict(sorted(outcomes.items())),
            }
        )


# -- the run -------------------------------------------------------------------------------


async def run(settings: Settings, log_dir: Path) -> dict[str, Any]:
    rng = random.Random(settings.seed)
    tenants = make_tenants(settings, rng)
    measured = to_measure(schedule(tenants, settings, rng))
    kinds = {t.name: t.kind for t in tenants}
    bodies = {m.id: rng.choice(GARBAGE) for m in measured if kinds[m.tenant] == "garbage"}
    spec = StackSpec(
        mode="fairq",
        workers=settings.workers,
        time_scale=settings.time_scale,
        config=benchmark_config({t.name: 1.0 for t in tenants if t.listed}),
    )
    async with Stack(spec, log_dir) as stack, stack.connect() as nc:
        meter = CpuMeter(stack.pids() | {"load generator": "self"})
        sampler = Sampler(stack, nc, measured, settings.sample_s)
        async with asyncio.TaskGroup() as group:  # a failed sample ends the load too
            sampling = group.create_task(sampler.run())
            meter.start()
            replay = await stack.fire_measured(
                measured,
                in_flight=PUBLISH_IN_FLIGHT,
                timeout_s=(settings.duration_s + settings.finish_timeout_s),
                bodies=bodies,
            )
            cpu_s, answered_s = meter.stop(), sampler.elapsed()
            await asyncio.wait({sampling}, timeout=settings.settle_s)
            sampler.stop()
    figures = verdict(settings, tenants, measured, sampler.samples)
    figures |= {
        "answered_s": answered_s,
        "cpu_s": cpu_s,
        "stack": spec.describe(),
        "shards": spec.config.broker.intake_shards,
        # How late the load generator's worst publish was against its schedule.
        "max_submit_lateness_s": max(replay.max_lateness_s.values(), default=0.0),
    }
    return figures


async def run_named(
    name: str, settings: Settings, out_dir: Path, plot_path: Path, command: str
) -> dict[str, Any]:
    facts = machine_facts(command)
    figures = await run(settings, out_dir / "logs" / name)
    summary = {
        "name": name,
        "machine": facts,
        "settings": asdict(settings),
        "figures": figures,
        "failed": failures(figures, settings),
        "plot": str(plot_path),
    }
    plot(figures, settings, plot_path)
    write_json(out_dir / f"{name}.json", summary)
    return summary


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser("bench.scenarios.soak", __doc__)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="45 s, 100 tenants (CI; RSS growth is not meaningful so short)",
    )
    parser.add_argument("--minutes", type=float)
    parser.add_argument("--tenants", type=int)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--warmup-s", type=float)
    parser.add_argument(
        "--churn-per-s",
        type=float,
        help="new unlisted tenants per second, one request each (default 0)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the JSON goes")
    parser.add_argument(
        "--plot",
        type=Path,
        help="the PNG (default docs/img/e2e_<soak or churn>.png; smoke: in --out)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings = with_overrides(
        SMOKE if args.smoke else Settings(),
        {
            "minutes": args.minutes,
            "tenants": args.tenants,
            "seed": args.seed,
            "warmup_s": args.warmup_s,
            "churn_per_s": args.churn_per_s,
        },
    )
    name = "smoke" if args.smoke else "churn" if settings.churn_per_s else "soak"
    plot_path = args.plot or (args.out / "smoke.png" if args.smoke else IMG / f"e2e_{name}.png")
    summary = asyncio.run(
        run_named(name, settings, args.out, plot_path, command_line("bench.scenarios.soak", argv))
    )
    print(render(summary))
    for reason in summary["failed"].values():
        print(f"soak failed: {reason}", file=sys.stderr)
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
