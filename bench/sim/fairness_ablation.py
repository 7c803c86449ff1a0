"""Why fairq trails VTC on some traffic shapes: fairq rerun with one suspect removed at a
time, next to VTC and FIFO on the same requests (issue 18).

    python -m bench.sim.fairness_ablation [--seeds 1 2 3] [--shapes prefill-heavy mixed]
                                          [--trace CSV]   # for the azure-conversation shape

The shapes, engine and metrics are `bench.sim.fairness_matrix`'s (model units always those
of the unchanged profile). Each variant changes one
thing that a deployment can change too (the trace or the config), so every row can be
reproduced with `fairq sim`:

- as configured: configs/example.toml (`scheduling_only`);
- exact estimates: every request's max_tokens is its real output length, so the output
  estimate is right from the first completion (otherwise it starts at half the
  endpoint's max_tokens cap and learns from completions) and each request's KV
  reservation is tight (before issue 18 fairq charged that estimate at dispatch);
- no reserve: the newcomer reserve off;
- reserve never lifted: `newcomer_window_s` infinite, so the reserve is held even when
  every present tenant is backlogged (fairq before the adaptive reserve);
- VTC weights: beta = 2 x alpha, so a model unit weighs prompt and output tokens as
  VTC's service metric does (1 : 2) instead of the profile's engine time.

Writes bench/results/fairness_ablation/summary.json and prints markdown.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from bench.harness.cli import write_json
from bench.harness.machine import command_line, machine_facts, table
from bench.harness.paths import RESULTS_DIR
from bench.harness.traces import add_trace_argument, azure_trace
from bench.sim.fairness_matrix import (
    AZURE,
    DURATION_S,
    SERVICE_COLUMNS,
    SHAPES,
    model_unit_metric,
    run_cell,
    workload,
)
from broker_config.config import EXAMPLE_CONFIG, Config, load_config
from dispatcher.core.limits import scheduling_only
from dispatcher.sim.trace import TraceRecord
from producers.loadgen import TraceError

RESULTS = RESULTS_DIR / "fairness_ablation" / "summary.json"
DEFAULT_SHAPES = ("prefill-heavy", "decode-heavy", "mixed", "bursty")
Records = list[TraceRecord]
Variant = Callable[[Config, Records], tuple[Config, Records]]


def _endpoints(config: Config, **changes: Any) -> Config:
    return msgspec.structs.replace(
        config,
        endpoints={
            name: msgspec.structs.replace(spec, **changes)
            for name, spec in config.endpoints.items()
        },
    )


def exact_estimates(config: Config, records: Records) -> tuple[Config, Records]:
    return config, [dataclasses.replace(r, max_tokens=r.output_tokens) for r in records]


def no_reserve(config: Config, records: Records) -> tuple[Config, Records]:
    return _endpoints(config, newcomer_reserve=0.0), records


def reserve_never_lifted(config: Config, records: Records) -> tuple[Config, Records]:
    return _endpoints(config, newcomer_window_s=math.inf), records


def vtc_weights(config: Config, records: Records) -> tuple[Config, Records]:
    return msgspec.structs.replace(
        config,
        profiles={
            # A flat decode price (no curve) of two prompt tokens: VTC's weights.
            name: msgspec.structs.replace(
                profile, beta=2 * profile.alpha, decode_base_s=None, decode_per_seq_s=None
            )
            for name, profile in config.profiles.items()
        },
    ), records


VARIANTS: dict[str, Variant] = {
    "as configured": lambda config, records: (config, records),
    "exact estimates": exact_estimates,
    "no reserve": no_reserve,
    "reserve never lifted": reserve_never_lifted,
    "VTC weights": vtc_weights,
}
METRICS = (
    "service_diff_avg",
    "service_diff_max",
    "mu_service_diff_avg",
    "mu_service_diff_max",
    "engine_service_diff_avg",
    "engine_service_diff_max",
    "jain_index_mean",
    "throughput_tokens_per_s",
    "light_tenants_p95_ttft_s",
)


def run(
    shapes: tuple[str, ...], seeds: tuple[int, ...], command: str, trace: Path | None = None
) -> dict[str, Any]:
    base = scheduling_only(load_config(EXAMPLE_CONFIG))
    rows: dict[str, dict[str, dict[str, Any]]] = {}
    for shape in shapes:
        for seed in seeds:
            records, weights = workload(shape, seed, DURATION_S, trace)
            cells = {}
            for name, variant in VARIANTS.items():
                config, replayed = variant(base, records)
                policies = run_cell(replayed, weights, config, model_unit_metric(base))
                cells[name] = policies["fairq"]
                if name == "as configured":
                    cells["VTC"], cells["FIFO"] = policies["vtc"], policies["fifo"]
            rows.setdefault(shape, {})[str(seed)] = cells
            print(
                f"{shape}, seed {seed}: "
                + ", ".join(f"{n} {c['service_diff_avg']:,.0f}" for n, c in cells.items()),
                file=sys.stderr,
            )
    return {
        "scenario": "fairness_ablation",
        "machine": machine_facts(command),
        "settings": {"shapes": list(shapes), "seeds": list(seeds), "duration_s": DURATION_S},
        "shapes": rows,
    }


def render(summary: dict[str, Any]) -> str:
    rows = []
    for shape, by_seed in summary["shapes"].items():
        for variant in [*VARIANTS, "VTC", "FIFO"]:
            means = [
                statistics.fmean(seed[variant][m] for seed in by_seed.values()) for m in METRICS
            ]
            rows.append(
                [
                    shape,
                    variant if variant in VARIANTS else f"({variant})",
                    f"{means[0]:,.0f}",
                    f"{means[1]:,.0f}",
                    f"{means[2]:.2f}",
                    f"{means[3]:.2f}",
                    f"{means[4]:.3f}",
                    f"{means[5]:.3f}",
                    f"{means[6]:.3f}",
                    f"{means[7]:,.0f}",
                    f"{means[8]:.2f}",
                ]
            )
    seeds = ", ".join(map(str, summary["settings"]["seeds"]))
    return "\n".join(
        [
            f"fairq's variants, then VTC and FIFO as configured; means over seeds {seeds}:",
            "",
            *table(
                ["shape", "fairq variant", *SERVICE_COLUMNS, "light half p95 TTFT s"],
                rows,
            ),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.sim.fairness_ablation", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--shapes", nargs="+", choices=(*SHAPES, AZURE), default=DEFAULT_SHAPES)
    parser.add_argument("--out", type=Path, default=RESULTS)
    add_trace_argument(parser)
    args = parser.parse_args(argv)
    trace = None
    if AZURE in args.shapes:
        try:
            trace = azure_trace(args.trace)
        except TraceError as exc:
            parser.error(str(exc))
    summary = run(
        tuple(args.shapes),
        tuple(args.seeds),
        command_line("bench.sim.fairness_ablation", argv),
        trace,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, summary)
    print(render(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
