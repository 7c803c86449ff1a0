"""Scenario 1, end to end: a noisy neighbour, fairq against the naive shared work queue.

    python -m bench.scenarios.noisy [--quick] [--workers 2] [--time-scale 0.1] [--seed 1]

Workload (`producers.loadgen.noisy_neighbour`): tenant A sends 10,000 requests at t=0;
B-E send Poisson arrivals at 0.5 requests/s each for 300 s; sizes are short chat turns
(log-normal, median 250 input and 120 output tokens). Every request asks for
max_tokens = its drawn output length; the simulated engine produces a length drawn
uniformly in [1, max_tokens] from the request id (the same in every mode). Arrivals are
compressed by the engine's time scale, so the load relative to capacity is the
scenario's, only faster.

Five runs, each on a fresh stack (`bench.harness.stack`) with the same workers and engine:
`solo-fairq` and `solo-naive` (B-E alone), `beside` (B-E next to a well-behaved A that
sends the same 10,000 requests closed loop, keeping every sequence slot outside the
newcomer reserve busy and never building a backlog: `bench.harness.recorder.WellBehaved`, on
fairq), `fairq` and `naive` (B-E next to A's flood). A's requests are collected from the
results bucket (submitted without Fq-Reply, as a batch job would); B-E stream their
events to the recorder. Per tenant and run: p50/p95/p99 queue wait and time to first
token, in the engine model's seconds (wall seconds / time scale), measured from the
client's submit.

The headline (issue 10's decision) is each small tenant's p95 TTFT next to the flood
divided by its p95 next to the well-behaved A, the same engine as busy (bound 1.2x for
fairq; the naive queue is expected >= 50x). Each tenant's ratio to its p95 alone on the
same stack is reported too: what sharing a full engine costs by itself.

Writes bench/results/noisy/summary.json (figures, settings, machine), records-<run>.json
(every request, wall seconds) and PNGs (per-run service over time and TTFT CDFs, and the
small tenants' TTFT CDFs across runs); prints a markdown digest. `--quick` is a
few-second variant (a smaller flood over 30 s) for smoke tests.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

from bench.harness.cli import (
    note_run,
    run_scenario,
    scenario_parser,
    write_records,
    write_summary,
)
from bench.harness.machine import command_line, machine_facts, table, with_overrides
from bench.harness.paths import RESULTS_DIR
from bench.harness.plots import cdf_plot
from bench.harness.recorder import Replay, WellBehaved, arrivals_from_trace, describe_outcomes
from bench.harness.stack import Mode, Stack, StackSpec, benchmark_config
from dispatcher.sim.fairness import DEFAULT_METRICS, tenant_summary
from producers.loadgen import noisy_neighbour, tenant_names
from producers.simulate import plot_result

TITLE = "End to end: noisy neighbour, fairq vs the naive shared queue"
RESULTS = RESULTS_DIR / "noisy"
# noisy_neighbour's tenants with its default four small ones: A floods, B-E are small.
TENANTS = tenant_names(5)
NOISY = TENANTS[0]
BOUND = 1.2  # fairq next to the flood / next to the well-behaved A


@dataclass(frozen=True, slots=True)
class Settings:
    noisy_requests: int = 10_000
    small_rate: float = 0.5
    duration_s: float = 300.0
    workers: int = 2
    time_scale: float = 0.1
    seed: int = 1
    # Bound on one run's replay, in wall seconds.
    timeout_s: float = 600.0
    # Engine seconds after A's first request before B-E start: A's first batch is then
    # on the engine in every run, however long the flood took to ingest.
    small_delay_s: float = 0.0


FULL = Settings()
QUICK = Settings(
    noisy_requests=600, small_rate=1.0, duration_s=30.0, workers=1, time_scale=0.05, timeout_s=60.0
)


# What tenant A does in a run.
Neighbour = Literal["none", "flood", "well-behaved"]


@dataclass(frozen=True, slots=True)
class Run:
    name: str
    mode: Mode
    neighbour: Neighbour


RUNS = (
    Run("solo-fairq", "fairq", "none"),
    Run("solo-naive", "naive", "none"),
    Run("beside", "fairq", "well-behaved"),
    Run("fairq", "fairq", "flood"),
    Run("naive", "naive", "flood"),
)


def stack_spec(mode: Mode, settings: Settings) -> StackSpec:
    """Every tenant listed with weight 1, as a deployment's registry would have them."""
    return StackSpec(
        mode=mode,
        workers=settings.workers,
        time_scale=settings.time_scale,
        config=benchmark_config(dict.fromkeys(TENANTS, 1.0)),
    )


async def run_one(run: Run, settings: Settings, out_dir: Path) -> Replay:
    trace = noisy_neighbour(
        settings.seed,
        noisy_requests=settings.noisy_requests,
        small_rate=settings.small_rate,
        duration_s=settings.duration_s,
    )
    delay = settings.small_delay_s * settings.time_scale
    arrivals = [
        a if a.tenant == NOISY else replace(a, offset_s=a.offset_s + delay)
        for a in arrivals_from_trace(trace, settings.time_scale, collected={NOISY})
    ]
    spec = stack_spec(run.mode, settings)
    small = [a for a in arrivals if a.tenant != NOISY]
    flood = [a for a in arrivals if a.tenant == NOISY]
    well_behaved = None
    if run.neighbour == "flood":
        small = arrivals
    elif run.neighbour == "well-behaved":
        well_behaved = WellBehaved(flood, spec.slots_outside_reserve())
    async with Stack(spec, out_dir / "logs" / run.name) as stack:
        return await stack.replay(small, timeout_s=settings.timeout_s, well_behaved=well_behaved)


def summarise(result: Replay, settings: Settings) -> dict[str, Any]:
    records = [m.request_record(settings.time_scale) for m in result.measured]
    return {
        "wall_s": result.wall_s,
        "outcomes": result.counts(),
        "max_submit_lateness_s": result.max_lateness_s,
        "tenants": tenant_summary(records, DEFAULT_METRICS),
    }


def small_tenant_ratios(runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Each small tenant's p95 TTFT next to the flood over its p95 next to the
    well-behaved A (`fairq`, `naive`), and over its p95 alone on the same stack
    (`fairq / solo`, `naive / solo`)."""

    def p95(run: str, tenant: str) -> float | None:
        return runs[run]["tenants"][tenant]["ttft_s"]["p95"]

    def ratio(over: float | None, under: float | None) -> float | None:
        return None if not under or over is None else over / under

    small = [t for t in runs["beside"]["tenants"] if t != NOISY]
    return {
        "fairq": {t: ratio(p95("fairq", t), p95("beside", t)) for t in small},
        "naive": {t: ratio(p95("naive", t), p95("beside", t)) for t in small},
        "fairq / solo": {t: ratio(p95("fairq", t), p95("solo-fairq", t)) for t in small},
        "naive / solo": {t: ratio(p95("naive", t), p95("solo-naive", t)) for t in small},
    }


def verdict(ratio: float | None) -> str:
    if ratio is None:
        return "no data"
    return f"meets the {BOUND}x bound" if ratio <= BOUND else f"misses the {BOUND}x bound"


def plot(results: dict[str, Replay], settings: Settings, out_dir: Path) -> list[str]:
    scale = settings.time_scale
    paths = []
    for name in ("fairq", "naive"):
        path = out_dir / f"noisy_{name}.png"
        plot_result(
            [m.request_record(scale) for m in results[name].measured],
            path,
            title=f"noisy neighbour end to end, {name}",
        )
        paths.append(path.name)
    small = {
        name: [
            r.first_token - r.arrival
            for r in (m.request_record(scale) for m in result.measured)
            if r.tenant != NOISY and r.served
        ]
        for name, result in results.items()
    }
    path = out_dir / "noisy_small_ttft.png"
    cdf_plot(
        small,
        path,
        title="Small tenants' TTFT (B-E pooled)",
        xlabel="time to first token (engine model s)",
    )
    paths.append(path.name)
    return paths


def render(summary: dict[str, Any]) -> str:
    """The markdown tables of a summary (also what bench.scenarios.report writes into the docs)."""
    runs, ratios = summary["runs"], summary["ratios"]
    lines = ["Per tenant, engine model seconds (wall / time scale): p50 / p95 / p99.", ""]
    rows = []
    for name, run in runs.items():
        for tenant, row in run["tenants"].items():
            wait, ttft = row["queue_wait_s"], row["ttft_s"]
            rows.append(
                [
                    name,
                    tenant,
                    str(row["count"]),
                    str(row["served"]),
                    " / ".join(_seconds(wait[q]) for q in ("p50", "p95", "p99")),
                    " / ".join(_seconds(ttft[q]) for q in ("p50", "p95", "p99")),
                ]
            )
    lines += table(["run", "tenant", "requests", "served", "queue wait", "TTFT"], rows)
    lines += [
        "",
        "Small tenants' p95 TTFT next to the flood, over their p95 next to the "
        "well-behaved A (the `beside` run) and over their p95 alone on the same "
        "stack:",
        "",
    ]
    columns = ("fairq", "naive", "fairq / solo", "naive / solo")
    rows = [[tenant, *(_ratio(ratios[c][tenant]) for c in columns)] for tenant in ratios["fairq"]]
    worst = {
        c: max((r for r in ratios[c].values() if r is not None), default=None) for c in columns
    }
    rows.append(
        [
            "worst",
            f"{_ratio(worst['fairq'])} ({verdict(worst['fairq'])})",
            *(_ratio(worst[c]) for c in columns[1:]),
        ]
    )
    lines += table(
        [
            "tenant",
            "fairq / well-behaved A",
            "naive / well-behaved A",
            "fairq / solo",
            "naive / solo",
        ],
        rows,
    )
    lines += [
        "",
        "Runs: "
        + "; ".join(
            f"{name} {run['wall_s']:.1f} s wall, {describe_outcomes(run['outcomes'])}"
            for name, run in runs.items()
        ),
    ]
    return "\n".join(lines)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


async def run_all(settings: Settings, out_dir: Path, command: str) -> dict[str, Any]:
    facts = machine_facts(command)
    results: dict[str, Replay] = {}
    for run in RUNS:
        started = time.monotonic()
        results[run.name] = await run_one(run, settings, out_dir)
        note_run(run.name, started, str(results[run.name].counts()))
    for name, result in results.items():
        write_records(out_dir / f"records-{name}.json", result.measured)
    runs = {name: summarise(result, settings) for name, result in results.items()}
    summary = {
        "scenario": "noisy",
        "machine": facts,
        "settings": asdict(settings),
        "stack": stack_spec("fairq", settings).describe(),
        "runs": runs,
        "ratios": small_tenant_ratios(runs),
        "plots": plot(results, settings, out_dir),
    }
    return write_summary(out_dir, summary)


def build_parser() -> argparse.ArgumentParser:
    parser = scenario_parser("bench.scenarios.noisy", __doc__, RESULTS)
    parser.add_argument("--workers", type=int, help="simulated workers (default 2; quick 1)")
    parser.add_argument(
        "--time-scale", type=float, help="engine and arrival time scale (default 0.1; quick 0.05)"
    )
    parser.add_argument("--seed", type=int, help="workload seed (default 1)")
    return parser


def settings_from(args: argparse.Namespace) -> Settings:
    settings = QUICK if args.quick else FULL
    overrides = {"workers": args.workers, "time_scale": args.time_scale, "seed": args.seed}
    return with_overrides(settings, overrides)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = command_line("bench.scenarios.noisy", argv)
    return run_scenario(args.out_dir, run_all(settings_from(args), args.out_dir, command), render)


if __name__ == "__main__":
    sys.exit(main())
