"""The noisy-neighbour test's measurement at full length: the small tenants' p95 time to
first token, pooled over seeds, next to the flood against next to an equally busy engine.

    python -m bench.scenarios.noisy_seeds [--seeds 10] [--window 3]

`tests/dispatch/test_dataplane_noisy.py` asserts the bound (issue 10's decision: the
flood costs the small tenants no more than 1.2x what a well-behaved A on the same engine
costs them) over seeds 1-10; this runs the same settings over seeds 1..N (ten: about
1,200 small requests per kind of run, 9 minutes on two cores) and reports the pooled
ratio over all of them, each seed's own p95s, and the pooled ratio of every window of
`--window` consecutive seeds, so the spread a shorter test would see is on record
(docs/benchmarks.md).

Each run is a fresh stack (`bench.harness.stack`): nats-server, the dispatcher and one
simulated worker, each its own process. Writes bench/results/noisy_seeds/summary.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench.harness.cli import note_run, run_scenario, scenario_parser, write_summary
from bench.harness.machine import command_line, machine_facts, table
from bench.harness.paths import RESULTS_DIR
from bench.harness.recorder import Replay
from bench.scenarios.noisy import BOUND, NOISY, Run, Settings, run_one
from dispatcher.sim.fairness import percentile

RESULTS = RESULTS_DIR / "noisy_seeds"
# A stays backlogged through the small tenants' 30 s (it drains in about 37 engine
# seconds; checked per run). Time runs 2x faster than the engine model: what the two
# cores add in wall time (a scheduling delay, a pause) weighs 2x in engine seconds, not
# the 5x at which it made the ratio wander across the bound (docs/benchmarks.md).
SETTINGS = Settings(
    noisy_requests=300,
    small_rate=1.0,
    duration_s=30.0,
    workers=1,
    time_scale=0.5,
    timeout_s=120.0,
    small_delay_s=1.0,
)
BESIDE = Run("beside", "fairq", "well-behaved")
FLOOD = Run("fairq", "fairq", "flood")
NAIVE = Run("naive", "naive", "flood")
# The seeds the test pools. Three measured 1.39x in one run (docs/benchmarks.md,
# 2026-12-07): fewer than ten are not yet a measurement of the bound.
TEST_SEEDS = tuple(range(1, 11))


def small_ttfts(result: Replay, settings: Settings = SETTINGS) -> list[float]:
    """The small tenants' times to first token in engine-model seconds, sorted; every
    request of the run must have finished."""
    assert result.counts() == {"done": len(result.measured)}, result.counts()
    records = [m.request_record(settings.time_scale) for m in result.measured if m.tenant != NOISY]
    return sorted(r.first_token - r.arrival for r in records)


def a_outlasts_the_small_tenants(result: Replay, settings: Settings = SETTINGS) -> bool:
    """A had requests waiting until the small tenants' last one arrived: the engine was
    as busy in both kinds of run all along."""
    records = [m.request_record(settings.time_scale) for m in result.measured]
    return max(r.dispatched for r in records if r.tenant == NOISY) > max(
        r.arrival for r in records if r.tenant != NOISY
    )


def pooled_ratio(ttfts: dict[int, dict[str, list[float]]], seeds: list[int]) -> dict[str, float]:
    """The test's statistic over `seeds`: p95 of the pooled TTFTs, flood over beside."""
    beside, flood = (
        percentile(sorted(t for seed in seeds for t in ttfts[seed][run.name]), 95)
        for run in (BESIDE, FLOOD)
    )
    return {"beside_p95_s": beside, "flood_p95_s": flood, "ratio": flood / beside}


async def run_seeds(seeds: int, window: int, out_dir: Path, command: str) -> dict[str, Any]:
    facts = machine_facts(command)
    ttfts: dict[int, dict[str, list[float]]] = {}
    for seed in range(1, seeds + 1):
        settings = replace(SETTINGS, seed=seed)
        ttfts[seed] = {}
        for run in (BESIDE, FLOOD):
            started = time.monotonic()
            result = await run_one(run, settings, out_dir / str(seed))
            assert a_outlasts_the_small_tenants(result), (seed, run.name)
            ttfts[seed][run.name] = small_ttfts(result)
            note_run(f"seed {seed} {run.name}", started, str(result.counts()))
    all_seeds = sorted(ttfts)
    windows = [all_seeds[i : i + window] for i in range(len(all_seeds) - window + 1)]
    summary = {
        "scenario": "noisy_seeds",
        "machine": facts,
        "settings": asdict(SETTINGS),
        "bound": BOUND,
        "pooled": pooled_ratio(ttfts, all_seeds),
        "per_seed": {seed: pooled_ratio(ttfts, [seed]) for seed in all_seeds},
        "windows": [{"seeds": w, **pooled_ratio(ttfts, w)} for w in windows],
        "ttfts_s": ttfts,
    }
    return write_summary(out_dir, summary)


def render(summary: dict[str, Any]) -> str:
    def row(label: str, figures: dict[str, float]) -> list[str]:
        return [
            label,
            f"{figures['beside_p95_s']:.3f}",
            f"{figures['flood_p95_s']:.3f}",
            f"{figures['ratio']:.2f}x",
        ]

    header = ["seeds", "p95 beside A (s)", "p95 beside the flood (s)", "flood / beside"]
    pooled = summary["pooled"]
    rows = [row(f"all {len(summary['per_seed'])}", pooled)]
    rows += [row(" ".join(map(str, w["seeds"])), w) for w in summary["windows"]]
    rows += [row(f"{seed} alone", figures) for seed, figures in summary["per_seed"].items()]
    worst = max(w["ratio"] for w in summary["windows"])
    return "\n".join(
        [
            f"Small tenants' p95 TTFT, pooled (bound {summary['bound']}x):",
            "",
            *table(header, rows),
            "",
            f"Worst window of {len(summary['windows'][0]['seeds'])} seeds: {worst:.2f}x",
        ]
    )


def build_parser() -> argparse.ArgumentParser:
    parser = scenario_parser("bench.scenarios.noisy_seeds", __doc__, RESULTS, "two seeds")
    parser.add_argument("--seeds", type=int, default=10, help="seeds 1..N (default 10)")
    parser.add_argument("--window", type=int, default=3, help="seeds per window (default 3)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    seeds = 2 if args.quick else args.seeds
    window = min(args.window, seeds)
    command = command_line("bench.scenarios.noisy_seeds", argv)
    return run_scenario(args.out_dir, run_seeds(seeds, window, args.out_dir, command), render)


if __name__ == "__main__":
    sys.exit(main())
