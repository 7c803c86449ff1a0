"""Soak: 1,000 tenants for ten minutes on the real stack, and what the run leaves behind.

    python -m bench.soak [--minutes 10] [--tenants 1000] [--seed 1] [--warmup-s 120]
                         [--churn-per-s 0] [--out DIR] [--plot PNG] [--smoke]

The stack of `bench.stack` (embedded nats-server, `python -m dispatcher`, two simulated
worker processes at engine time x0.5) with the benchmark config: admission out of the
way, so every well-formed request should end `done`. `listed_share` of the tenants are
listed in the config's tier; the others are admitted as unlisted tenants (the config's
`[unlisted_tenants]`, same tier and weight). A seeded mix of tenants, every request
published by `bench.firehose` (JetStream to `fq.req.chat.<tenant>`, `Nats-Msg-Id`, its
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
(`bench.procstat`), the consumers on the requests and parked streams (stream info), the
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
import json
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import nats

from bench.firehose import fire_measured
from bench.machine import command_line, machine_facts, table, with_overrides
from bench.plots import time_series
from bench.procstat import CpuMeter, cpu_seconds, memory_kb
from bench.recorder import (
    DONE,
    LOST,
    PUBLISH_IN_FLIGHT,
    REFUSED,
    Arrival,
    Measured,
    to_measure,
)
from bench.stack import Stack, StackSpec, benchmark_config
from broker_config.wire import ErrorCode
from dispatcher.intake.shards import PARKED_CONSUMER_IDLE_S
from dispatcher.sim.fairness import latency_summary

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "soak"
IMG = REPO / "docs" / "img"
KINDS = ("steady", "bursty", "flood", "idle", "garbage", "once")
# The kinds given a share of `tenants` (steady: the rest); `once` tenants come on top.
SHARED = KINDS[1:5]
INVALID = ErrorCode.INVALID_REQUEST.value
# Bodies that break the contract (docs/protocol.md), one drawn per garbage request.
GARBAGE = (
    b"\xff\xfe not json",
    b"",
    b"null",
    b"[1, 2, 3]",
    b'{"prompt": 42, "max_tokens": 8}',
    b'{"prompt": "hi", "max_tokens": "eight"}',
    b'{"prompt": "hi", "max_tokens": 8, "temperature": 0.7}',
    b'{"prompt": "hi", "max_tokens": 0}',
    b'{"max_tokens": 8}',
    b'{"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}',
    b'{"prompt": "hi", "id": "not-the-header-id"}',
)
# How long after the parked consumers' idle threshold the server has to remove them.
RETIRE_MARGIN_S = 10.0
MIB = 1024


@dataclass(frozen=True, slots=True)
class Settings:
    minutes: float = 10.0
    tenants: int = 1_000
    seed: int = 1
    warmup_s: float = 120.0
    listed_share: float = 0.8
    # Shares of the tenants by kind; the rest are steady.
    bursty_share: float = 0.25
    flood_share: float = 0.01
    idle_share: float = 0.25
    garbage_share: float = 0.04
    # New unlisted tenants per second on top of `tenants`, one request each and never
    # again (churn: what a dispatcher keeps per tenant it has seen shows as growth).
    churn_per_s: float = 0.0
    steady_rate_per_s: tuple[float, float] = (0.02, 0.2)  # uniform, per tenant
    burst_size: tuple[int, int] = (20, 80)
    burst_gap_s: tuple[float, float] = (60.0, 240.0)
    flood_size: int = 500
    flood_gap_s: tuple[float, float] = (180.0, 300.0)
    idle_within_s: float = 60.0
    garbage_gap_s: float = 20.0
    # Short prompts: the engine's prefill (8,000 tokens/s) leaves room for bursts.
    input_tokens: tuple[int, int] = (8, 96)
    max_tokens: tuple[int, int] = (1, 16)  # the simulated engine draws [1, max_tokens]
    workers: int = 2
    time_scale: float = 0.5
    sample_s: float = 5.0
    finish_timeout_s: float = 120.0
    settle_s: float = PARKED_CONSUMER_IDLE_S + 15.0
    rss_goal: float = 0.10

    @property
    def duration_s(self) -> float:
        return 60.0 * self.minutes

    def __post_init__(self) -> None:
        if not 0 < self.warmup_s < self.duration_s:
            raise ValueError(
                f"the warm-up ({self.warmup_s:g} s) must end within the load "
                f"({self.duration_s:g} s)"
            )
        if self.tenants < len(SHARED) + 1:
            raise ValueError(f"at least {len(SHARED) + 1} tenants, one of each kind")


# About 70 s in all with the stack's start and stop: a CI smoke test.
SMOKE = Settings(
    minutes=0.75,
    tenants=100,
    warmup_s=15.0,
    burst_gap_s=(10.0, 30.0),
    flood_size=300,
    flood_gap_s=(15.0, 30.0),
    idle_within_s=10.0,
    garbage_gap_s=5.0,
    sample_s=2.0,
    finish_timeout_s=30.0,
    settle_s=4.0,
)


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    kind: str
    listed: bool


# -- the load ------------------------------------------------------------------------------


def make_tenants(settings: Settings, rng: random.Random) -> list[Tenant]:
    """The kinds by share (at least one of each but steady, the rest steady), listed or
    not at random, then the churn's unlisted `once` tenants; names say the kind."""
    n = settings.tenants
    counts = {kind: max(1, round(n * getattr(settings, f"{kind}_share"))) for kind in SHARED}
    counts = {"steady": n - sum(counts.values())} | counts
    if counts["steady"] < 1:
        raise ValueError("the shares leave no steady tenant")
    kinds = [kind for kind, count in counts.items() for _ in range(count)]
    rng.shuffle(kinds)
    numbers: Counter[str] = Counter()
    tenants = []
    for kind in kinds:
        tenants.append(Tenant(f"{kind}{numbers[kind]}", kind, rng.random() < settings.listed_share))
        numbers[kind] += 1
    once = round(settings.churn_per_s * settings.duration_s)
    return tenants + [Tenant(f"once{n}", "once", False) for n in range(once)]


def schedule(tenants: list[Tenant], settings: Settings, rng: random.Random) -> list[Arrival]:
    """Every tenant's arrivals over the load's duration, by kind (see the module doc)."""
    end = settings.duration_s

    def request(tenant: Tenant, at: float) -> Arrival:
        return Arrival(
            tenant.name, at, rng.randint(*settings.input_tokens), rng.randint(*settings.max_tokens)
        )

    def poisson(rate: float) -> list[float]:
        times, at = [], rng.expovariate(rate)
        while at < end:
            times.append(at)
            at += rng.expovariate(rate)
        return times

    def bursts(gap_s: tuple[float, float]) -> list[float]:
        starts, at = [], rng.uniform(0.0, gap_s[1])  # tenants start spread out
        while at < end:
            starts.append(at)
            at += rng.uniform(*gap_s)
        return starts

    arrivals: list[Arrival] = []
    for tenant in tenants:
        if tenant.kind == "steady":
            times = poisson(rng.uniform(*settings.steady_rate_per_s))
        elif tenant.kind == "bursty":
            times = [
                start + rng.uniform(0.0, 1.0)
                for start in bursts(settings.burst_gap_s)
                for _ in range(rng.randint(*settings.burst_size))
            ]
        elif tenant.kind == "flood":
            times = [
                start for start in bursts(settings.flood_gap_s) for _ in range(settings.flood_size)
            ]
        elif tenant.kind == "idle":
            times = [rng.uniform(0.0, settings.idle_within_s) for _ in range(rng.randint(1, 2))]
        elif tenant.kind == "garbage":
            times = poisson(1.0 / settings.garbage_gap_s)
        else:
            times = [rng.uniform(0.0, end)]
        arrivals += [request(tenant, at) for at in sorted(times) if at < end]
    return arrivals


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
    async with Stack(spec, log_dir) as stack:
        nc = await nats.connect(stack.url, connect_timeout=5)
        try:
            meter = CpuMeter(stack.pids() | {"load generator": "self"})
            sampler = Sampler(stack, nc, measured, settings.sample_s)
            async with asyncio.TaskGroup() as group:  # a failed sample ends the load too
                sampling = group.create_task(sampler.run())
                meter.start()
                replay = await fire_measured(
                    stack.url,
                    measured,
                    endpoint=spec.endpoint,
                    settings=stack.settings,
                    in_flight=PUBLISH_IN_FLIGHT,
                    timeout_s=(settings.duration_s + settings.finish_timeout_s),
                    alive=stack.check_alive,
                    bodies=bodies,
                )
                cpu_s, answered_s = meter.stop(), sampler.elapsed()
                await asyncio.wait({sampling}, timeout=settings.settle_s)
                sampler.stop()
        finally:
            await nc.drain()
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


def _at(samples: list[dict[str, Any]], t: float) -> dict[str, Any]:
    """The first sample taken at or after `t` (else the last)."""
    return next((s for s in samples if s["t"] >= t), samples[-1])


def verdict(
    settings: Settings,
    tenants: list[Tenant],
    measured: list[Measured],
    samples: list[dict[str, Any]],
) -> dict[str, Any]:
    """The run's figures: outcomes (overall, by kind), memory and consumers over time."""
    kinds = {t.name: t.kind for t in tenants}
    by_kind: dict[str, Counter[str]] = {kind: Counter() for kind in KINDS}
    for m in measured:
        by_kind[kinds[m.tenant]][m.outcome] += 1
    garbage = by_kind["garbage"]
    well_formed = sum((by_kind[kind] for kind in KINDS if kind != "garbage"), Counter())
    warm, load_end, end = (
        _at(samples, settings.warmup_s),
        _at(samples, settings.duration_s),
        samples[-1],
    )
    after_warmup = [s for s in samples if s["t"] >= warm["t"]]

    def rss(sample: dict[str, Any], process: str) -> int:
        return sample["rss_kb"][process]

    def consumers(stream: str) -> dict[str, int]:
        counts = [s["consumers"][stream] for s in samples]
        return {"min": min(counts), "max": max(counts), "end": counts[-1]}

    done_s: dict[str, list[float]] = {kind: [] for kind in ("all", *KINDS)}
    for m in measured:
        if m.outcome == DONE and m.submitted is not None:
            done_s[kinds[m.tenant]].append(m.finished - m.submitted)
            done_s["all"].append(m.finished - m.submitted)
    return {
        "tenants": {
            kind: {
                "count": sum(t.kind == kind for t in tenants),
                "unlisted": sum(t.kind == kind and not t.listed for t in tenants),
            }
            for kind in KINDS
        },
        "requests": len(measured),
        "outcomes": dict(sorted(Counter(m.outcome for m in measured).items())),
        "outcomes_by_kind": {kind: dict(sorted(c.items())) for kind, c in by_kind.items()},
        "lost": sum(c[LOST] for c in by_kind.values()),
        "refused": sum(c[REFUSED] for c in by_kind.values()),
        "well_formed": sum(well_formed.values()),
        "well_formed_not_done": sum(well_formed.values()) - well_formed[DONE],
        "garbage": sum(garbage.values()),
        "garbage_answered": garbage[INVALID],
        # Submit to final event at the client, of the requests that ended done.
        "done_latency_s": {kind: latency_summary(v) for kind, v in done_s.items()},
        "samples": samples,
        "warmup_end_t": warm["t"],
        "dispatcher_rss_kb": {
            "warmup_end": rss(warm, "dispatcher"),
            "load_end": rss(load_end, "dispatcher"),
            "end": rss(end, "dispatcher"),
            "max_after_warmup": max(rss(s, "dispatcher") for s in after_warmup),
        },
        "dispatcher_rss_growth": rss(end, "dispatcher") / rss(warm, "dispatcher") - 1,
        "server_rss_kb": {
            "warmup_end": rss(warm, "nats-server"),
            "load_end": rss(load_end, "nats-server"),
            "end": rss(end, "nats-server"),
            "max": max(rss(s, "nats-server") for s in samples),
        },
        "consumers": {"requests": consumers("requests"), "parked": consumers("parked")},
    }


def failures(figures: dict[str, Any], settings: Settings) -> dict[str, str]:
    """Each goal missed: its name -> why, in a sentence."""
    failed, shards = {}, figures["shards"]
    for name, what in (
        ("lost", "requests without a final event"),
        ("refused", "requests the broker did not store"),
        ("well_formed_not_done", "well-formed requests that did not end done"),
    ):
        if figures[name]:
            failed[name] = f"{figures[name]} {what}"
    if figures["garbage_answered"] != figures["garbage"]:
        failed["garbage_unanswered"] = (
            f"{figures['garbage'] - figures['garbage_answered']} of {figures['garbage']} "
            f"garbage requests not answered {INVALID}"
        )
    if figures["dispatcher_rss_growth"] >= settings.rss_goal:
        rss = figures["dispatcher_rss_kb"]
        failed["rss_growth"] = (
            f"dispatcher RSS grew {figures['dispatcher_rss_growth']:.1%} after the warm-up "
            f"({rss['warmup_end'] / MIB:.1f} -> {rss['end'] / MIB:.1f} MiB), goal < "
            f"{settings.rss_goal:.0%}"
        )
    if figures["consumers"]["requests"]["max"] > shards:
        failed["requests_consumers"] = (
            f"{figures['consumers']['requests']['max']} consumers on the requests stream, "
            f"more than its {shards} shards"
        )
    parked_left = figures["consumers"]["parked"]["end"]
    if settings.settle_s >= PARKED_CONSUMER_IDLE_S + RETIRE_MARGIN_S and parked_left:
        failed["parked_consumers_left"] = (
            f"{parked_left} parked consumers left {settings.settle_s:g} s after the last request"
        )
    return failed


# -- report --------------------------------------------------------------------------------


def render(summary: dict[str, Any]) -> str:
    figures = summary["figures"]
    outcome_names = sorted(
        {o for c in figures["outcomes_by_kind"].values() for o in c},
        key=lambda o: (o != DONE, o != INVALID, o),
    )
    latency = figures["done_latency_s"]
    rows = []
    for kind, counts in figures["outcomes_by_kind"].items():
        tenants = figures["tenants"][kind]
        if not tenants["count"]:
            continue
        rows.append(
            [
                kind,
                f"{tenants['count']} ({tenants['unlisted']})",
                f"{sum(counts.values()):,}",
                *(f"{counts.get(o, 0):,}" for o in outcome_names),
                f"{_s(latency[kind]['p50'])} / {_s(latency[kind]['p99'])}",
            ]
        )
    rows.append(
        [
            "all",
            f"{sum(t['count'] for t in figures['tenants'].values())}",
            f"{figures['requests']:,}",
            *(f"{figures['outcomes'].get(o, 0):,}" for o in outcome_names),
            f"{_s(latency['all']['p50'])} / {_s(latency['all']['p99'])}",
        ]
    )
    lines = table(
        ["tenants", "count (unlisted)", "requests", *outcome_names, "done: p50 / p99 s"], rows
    )
    d, s = figures["dispatcher_rss_kb"], figures["server_rss_kb"]
    c = figures["consumers"]
    lines += [
        "",
        *table(
            ["", "end of warm-up", "end of load", "end", "growth after warm-up", "max"],
            [
                [
                    "dispatcher RSS, MiB",
                    _mib(d["warmup_end"]),
                    _mib(d["load_end"]),
                    _mib(d["end"]),
                    f"{figures['dispatcher_rss_growth']:+.1%}",
                    _mib(d["max_after_warmup"]),
                ],
                [
                    "nats-server RSS, MiB",
                    _mib(s["warmup_end"]),
                    _mib(s["load_end"]),
                    _mib(s["end"]),
                    f"{s['end'] / s['warmup_end'] - 1:+.1%}",
                    _mib(s["max"]),
                ],
            ],
        ),
    ]
    lines += [
        "",
        *table(
            ["consumers", "min", "max", "end"],
            [[stream, str(v["min"]), str(v["max"]), str(v["end"])] for stream, v in c.items()],
        ),
    ]
    lines += [
        "",
        (
            f"Garbage answered {INVALID}: {figures['garbage_answered']:,} of "
            f"{figures['garbage']:,}. The latest publish "
            f"{figures['max_submit_lateness_s']:.2f} s behind its schedule. "
            "Every request answered "
            f"{figures['answered_s']:.0f} s after the start; CPU seconds: "
            + ", ".join(f"{name} {v:.0f}" for name, v in figures["cpu_s"].items())
            + "."
        ),
    ]
    if summary["failed"]:
        lines += ["", "FAILED: " + "; ".join(summary["failed"].values())]
    return "\n".join(lines)


def _mib(kb: float) -> str:
    return f"{kb / MIB:.1f}"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def plot(figures: dict[str, Any], settings: Settings, path: Path) -> None:
    samples = figures["samples"]
    churn = figures["tenants"]["once"]["count"]
    once = f" (+{churn:,} sending once)" if churn else ""
    t = [s["t"] for s in samples]
    rates = {"published": [], "finished": []}
    for before, after in zip(samples, samples[1:]):
        span = after["t"] - before["t"]
        rates["published"].append((after["published"] - before["published"]) / span)
        rates["finished"].append(
            (sum(after["finished"].values()) - sum(before["finished"].values())) / span
        )
    time_series(
        {
            "Resident memory (VmRSS)": (
                "MiB",
                {
                    name: (t, [s["rss_kb"][name] / MIB for s in samples])
                    for name in ("dispatcher", "nats-server")
                },
            ),
            "Consumers": (
                "consumers",
                {
                    f"{stream} stream": (t, [s["consumers"][stream] for s in samples])
                    for stream in ("requests", "parked")
                },
            ),
            "Requests per second (between samples)": (
                "requests/s",
                {name: (t[1:], values) for name, values in rates.items()},
            ),
        },
        path,
        xlabel="seconds since the start of the load",
        title=(
            f"Soak: {settings.tenants:,} tenants{once}, {settings.minutes:g} min, "
            f"{figures['requests']:,} requests"
        ),
        marks={"end of warm-up": figures["warmup_end_t"], "end of load": settings.duration_s},
    )


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
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
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
        run_named(name, settings, args.out, plot_path, command_line("bench.soak", argv))
    )
    print(render(summary))
    for reason in summary["failed"].values():
        print(f"soak failed: {reason}", file=sys.stderr)
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
