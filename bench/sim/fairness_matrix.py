"""Fairness on many traffic shapes: fairq, the Virtual Token Counter and FIFO, in the
simulator, on the same engine, arrivals and metrics, in one run (issue 18).

    python -m bench.sim.fairness_matrix [--quick] [--seeds 1 2 3] [--shapes a b] [--trace CSV]
                                        [--plot-dir docs/img]

Every shape is replayed with each policy on one replica of the default engine model
(configs/engine.toml) with admission out of the way (`scheduling_only`: every request
admitted, one tier; only the weights shape sets weights), so the policies differ in
dispatch order alone. Shapes (`SHAPES`; each tenant draws arrivals and sizes from its
own seeded stream), 300 s of arrivals:

- prefill-heavy: 20 tenants at 0.5 requests/s with prompts of about 3,000 tokens and
  answers of about 40, and one at 4/s of the same: the fleet is overloaded;
- decode-heavy: the same tenants with prompts of about 100 tokens and answers of 500;
- mixed: 10 prefill-heavy and 10 decode-heavy tenants, and a flood of each kind;
- bursty: 10 steady tenants at 1 request/s and 10 on/off ones (2/s for 30 s, then
  silent for 30 s), chat sizes (median 250 in, 120 out);
- heavy-tailed: 200 tenants whose rates follow a Zipf law (s = 1.2), 20 requests/s in
  all, chat sizes;
- weights: three tenants with weights 1, 2 and 4, each sending 6 requests/s;
- azure-conversation: the Azure LLM conversation trace's first 300 s spread over 20
  Zipf tenants (`producers.loadgen.assign_azure_trace`), only with --trace or
  $FQ_AZURE_TRACE (the shape is skipped, and says so, otherwise).

Metrics (`dispatcher.sim.fairness`, VTC's definitions): the average and maximum
service difference over 60 s windows (service = input + 2 x output tokens, per unit of
weight), the same with service in the endpoint's model units (alpha x input + beta x
output, what fairq charges), Jain's index on weighted max-min shares, throughput
(tokens/s), the worst tenant's p95 time to first token, the median p95 time to first
token of the lighter half of the tenants (by requests sent), and the share of
sequence-slot time left empty while queued work would have fit (`idle_while_waiting`
of the simulator's summary). Writes bench/results/fairness_matrix/summary.json (and,
with --plot-dir, sim_fairness_matrix.png there); prints markdown.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from bench.harness.cli import write_json
from bench.harness.machine import command_line, machine_facts, table
from bench.harness.paths import RESULTS_DIR
from bench.harness.plots import grouped_bars
from bench.harness.traces import add_trace_argument, azure_trace
from broker_config.config import EXAMPLE_CONFIG, EXAMPLE_ENGINE, Config, Tenant, load_config
from costmodel.engine_model import engine_time_profile, load_engine_params
from dispatcher.core.limits import scheduling_only
from dispatcher.core.policies import POLICIES
from dispatcher.sim.fairness import MetricOptions, service_unit, summarize
from dispatcher.sim.simulator import simulate
from dispatcher.sim.trace import TraceRecord
from producers.loadgen import SizeModel, TraceError, assign_azure_trace, zipf_weights

RESULTS = RESULTS_DIR / "fairness_matrix" / "summary.json"
PLOT = "sim_fairness_matrix.png"
DURATION_S = 300.0
# The service columns of the tables here and in `bench.sim.fairness_ablation`.
SERVICE_COLUMNS = [
    "service diff avg",
    "service diff max",
    "MU diff avg",
    "MU diff max",
    "engine diff avg",
    "engine diff max",
    "Jain",
    "tokens/s",
]
PREFILL = SizeModel(
    input_median=3000.0,
    input_sigma=0.4,
    input_range=(256, 8000),
    output_median=40.0,
    output_sigma=0.5,
    output_range=(4, 256),
)
DECODE = SizeModel(
    input_median=100.0,
    input_sigma=0.5,
    input_range=(16, 1024),
    output_median=500.0,
    output_sigma=0.4,
    output_range=(32, 2048),
)
CHAT = SizeModel()


@dataclass(frozen=True, slots=True)
class Source:
    """One tenant's arrivals: Poisson at `rate`, or on/off (`rate` while on)."""

    tenant: str
    rate: float
    sizes: SizeModel
    weight: float = 1.0
    on_off_s: float = 0.0  # on for this long, then off as long (0: always on)


def arrivals(sources: list[Source], seed: int, duration_s: float) -> list[TraceRecord]:
    records = []
    for source in sources:
        rng = random.Random(f"{seed}:{source.tenant}")
        clock = rng.expovariate(source.rate)
        while clock < duration_s:
            if not source.on_off_s or int(clock // source.on_off_s) % 2 == 0:
                prompt, output = source.sizes.sample(rng)
                records.append(TraceRecord(source.tenant, round(clock, 6), prompt, output))
            clock += rng.expovariate(source.rate)
    return sorted(records, key=lambda r: (r.arrival_s, r.tenant))


def _named(prefix: str, count: int, rate: float, sizes: SizeModel, **kw: Any) -> list[Source]:
    return [Source(f"{prefix}{i:02d}", rate, sizes, **kw) for i in range(count)]


def _zipf(count: int, total_rate: float) -> list[Source]:
    return [
        Source(f"z{i:03d}", total_rate * share, CHAT)
        for i, share in enumerate(zipf_weights(count, 1.2))
    ]


SHAPES: dict[str, Callable[[], list[Source]]] = {
    "prefill-heavy": lambda: [*_named("p", 20, 0.5, PREFILL), Source("flood", 4.0, PREFILL)],
    "decode-heavy": lambda: [*_named("d", 20, 0.5, DECODE), Source("flood", 4.0, DECODE)],
    "mixed": lambda: [
        *_named("p", 10, 0.5, PREFILL),
        *_named("d", 10, 0.5, DECODE),
        Source("pflood", 2.0, PREFILL),
        Source("dflood", 2.0, DECODE),
    ],
    "bursty": lambda: [*_named("s", 10, 1.0, CHAT), *_named("b", 10, 2.0, CHAT, on_off_s=30.0)],
    "heavy-tailed": lambda: _zipf(200, 20.0),
    "weights": lambda: [
        Source("w1", 6.0, CHAT, 1.0),
        Source("w2", 6.0, CHAT, 2.0),
        Source("w4", 6.0, CHAT, 4.0),
    ],
}
AZURE = "azure-conversation"


@dataclass(frozen=True, slots=True)
class Settings:
    seeds: tuple[int, ...] = (1, 2, 3)
    shapes: tuple[str, ...] = (*SHAPES, AZURE)
    duration_s: float = DURATION_S


FULL = Settings()
QUICK = Settings(seeds=(1,), shapes=("prefill-heavy", "weights"), duration_s=120.0)


def workload(
    shape: str, seed: int, duration_s: float, trace: Path | None
) -> tuple[list[TraceRecord], dict[str, float]]:
    """The shape's requests and the weights of the tenants that have one."""
    if shape == AZURE:
        assert trace is not None
        records = [r for r in assign_azure_trace(trace, seed) if r.arrival_s < duration_s]
        return records, {}
    sources = SHAPES[shape]()
    return (
        arrivals(sources, seed, duration_s),
        {s.tenant: s.weight for s in sources if s.weight != 1.0},
    )


def model_unit_metric(config: Config) -> MetricOptions:
    """Service counted in the model units of the config's first endpoint's profile."""
    profile = config.profiles[next(iter(config.endpoints.values())).profile]
    return service_unit("model_units", profile)


def engine_time_metric() -> MetricOptions:
    """Service counted in engine time: what each request's replica attributed to it
    (the judge of issue 36), unserved demand priced by the engine's own curve."""
    return service_unit("engine", engine_time_profile(load_engine_params(EXAMPLE_ENGINE)))


def run_cell(
    records: list[TraceRecord],
    weights: dict[str, float],
    config: Config | None = None,
    in_units: MetricOptions | None = None,
) -> dict[str, Any]:
    """Every policy on `records`, on `config` (default: the example's, scheduling only);
    the model-unit figures count service with `in_units` (default: `config`'s)."""
    config = config or scheduling_only(load_config(EXAMPLE_CONFIG))
    in_units = in_units or model_unit_metric(config)
    if weights:
        config = msgspec.structs.replace(
            config,
            tenants={name: Tenant(tier="all", weight=weight) for name, weight in weights.items()},
        )
    engine = load_engine_params(EXAMPLE_ENGINE)
    cells = {}
    for policy in POLICIES:
        result = simulate(records, config, engine, policy=policy)
        summary = result.summary
        units = summarize(result.records, in_units, weights or None)
        engine_time = summarize(result.records, engine_time_metric(), weights or None)
        tenants = summary["tenants"]
        p95 = {
            name: row["ttft_s"]["p95"]
            for name, row in tenants.items()
            if row["ttft_s"]["p95"] is not None
        }
        # The lighter half by requests sent: the tenants a flood would push back.
        light = sorted(p95, key=lambda name: (tenants[name]["count"], name))[: len(p95) // 2]
        cells[policy] = {
            "service_diff_avg": summary["service_diff_avg"],
            "service_diff_max": summary["service_diff_max"],
            "mu_service_diff_avg": units["service_diff_avg"],
            "mu_service_diff_max": units["service_diff_max"],
            "engine_service_diff_avg": engine_time["service_diff_avg"],
            "engine_service_diff_max": engine_time["service_diff_max"],
            "jain_index_mean": summary["jain_index_mean"],
            "throughput_tokens_per_s": summary["throughput_tokens_per_s"],
            "worst_tenant_p95_ttft_s": max(p95.values(), default=None),
            "light_tenants_p95_ttft_s": (
                statistics.median(p95[name] for name in light) if light else None
            ),
            "idle_while_waiting": summary["simulation"]["idle_while_waiting"],
        }
    return cells


def run_all(settings: Settings, trace_flag: Path | None, command: str) -> dict[str, Any]:
    facts = machine_facts(command)
    trace, skipped = None, {}
    if AZURE in settings.shapes:
        try:
            trace = azure_trace(trace_flag)
        except TraceError as exc:
            skipped[AZURE] = str(exc)
    rows: dict[str, dict[str, Any]] = {}
    for shape in settings.shapes:
        if shape in skipped:
            continue
        for seed in settings.seeds:
            started = time.monotonic()
            records, weights = workload(shape, seed, settings.duration_s, trace)
            rows.setdefault(shape, {})[str(seed)] = cells = run_cell(records, weights)
            print(
                f"{shape}, seed {seed}: {len(records)} requests; service difference avg "
                + ", ".join(f"{p} {c['service_diff_avg']:,.0f}" for p, c in cells.items())
                + f" ({time.monotonic() - started:.1f} s)",
                file=sys.stderr,
            )
    return {
        "scenario": "fairness_matrix",
        "machine": facts,
        "settings": {
            "seeds": list(settings.seeds),
            "shapes": list(settings.shapes),
            "duration_s": settings.duration_s,
        },
        "skipped": skipped,
        "shapes": rows,
    }


def mean_over_seeds(cells: dict[str, Any], policy: str, metric: str) -> float | None:
    values = [seed[policy][metric] for seed in cells.values() if seed[policy][metric] is not None]
    return statistics.fmean(values) if values else None


def render(summary: dict[str, Any]) -> str:
    rows = []
    for shape, cells in summary["shapes"].items():
        for policy in POLICIES:
            rows.append(
                [
                    shape,
                    policy,
                    *(
                        _num(mean_over_seeds(cells, policy, metric), digits)
                        for metric, digits in (
                            ("service_diff_avg", 0),
                            ("service_diff_max", 0),
                            ("mu_service_diff_avg", 2),
                            ("mu_service_diff_max", 2),
                            ("engine_service_diff_avg", 3),
                            ("engine_service_diff_max", 3),
                            ("jain_index_mean", 3),
                            ("throughput_tokens_per_s", 0),
                            ("worst_tenant_p95_ttft_s", 1),
                            ("light_tenants_p95_ttft_s", 2),
                        )
                    ),
                ]
            )
            rows[-1].append(_num(100 * mean_over_seeds(cells, policy, "idle_while_waiting"), 2))
    seeds = ", ".join(map(str, summary["settings"]["seeds"]))
    lines = [f"Means over seeds {seeds} (per seed in the JSON):", ""]
    lines += table(
        [
            "shape",
            "policy",
            *SERVICE_COLUMNS,
            "worst p95 TTFT s",
            "light half p95 TTFT s",
            "idle while waiting %",
        ],
        rows,
    )
    for shape, reason in summary["skipped"].items():
        lines += ["", f"{shape}: skipped: {reason}"]
    lines += [
        "",
        "Seeds on which fairq's service difference is at most VTC's, and fairq's "
        "means over FIFO's:",
        "",
    ]
    metrics = (
        "service_diff_avg",
        "service_diff_max",
        "mu_service_diff_avg",
        "mu_service_diff_max",
        "engine_service_diff_avg",
        "engine_service_diff_max",
    )
    verdicts = []
    for shape, cells in summary["shapes"].items():
        verdicts.append(
            [
                shape,
                *(
                    f"{sum(c['fairq'][m] <= c['vtc'][m] for c in cells.values())} of {len(cells)}"
                    for m in metrics
                ),
                *(
                    f"{mean_over_seeds(cells, 'fairq', m) / mean_over_seeds(cells, 'fifo', m):.3f}"
                    for m in (
                        "mu_service_diff_avg",
                        "mu_service_diff_max",
                        "engine_service_diff_avg",
                        "engine_service_diff_max",
                        "throughput_tokens_per_s",
                    )
                ),
            ]
        )
    lines += table(
        [
            "shape",
            "avg",
            "max",
            "MU avg",
            "MU max",
            "engine avg",
            "engine max",
            "fairq / FIFO: MU avg",
            "MU max",
            "engine avg",
            "engine max",
            "tokens/s",
        ],
        verdicts,
    )
    return "\n".join(lines)


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:,.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.sim.fairness_matrix", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="two shapes, one seed, 120 s")
    parser.add_argument("--seeds", type=int, nargs="+")
    parser.add_argument("--shapes", nargs="+", choices=(*SHAPES, AZURE))
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--plot-dir", type=Path, help="also draw the service differences there (docs/img)"
    )
    add_trace_argument(parser)
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    if args.seeds:
        settings = Settings(tuple(args.seeds), settings.shapes, settings.duration_s)
    if args.shapes:
        settings = Settings(settings.seeds, tuple(args.shapes), settings.duration_s)
    summary = run_all(settings, args.trace, command_line("bench.sim.fairness_matrix", argv))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, summary)
    if args.plot_dir is not None:
        plot(summary, args.plot_dir / PLOT)
    print(render(summary))
    return 0


def plot(summary: dict[str, Any], path: Path) -> None:
    """The mean service differences per shape and policy, in both units."""
    panels = {
        f"{title} (mean over seeds, log scale)": {
            shape: {policy: mean_over_seeds(cells, policy, metric) or 0.0 for policy in POLICIES}
            for shape, cells in summary["shapes"].items()
        }
        for title, metric in (
            ("average service difference, VTC's unit", "service_diff_avg"),
            ("average service difference, model units", "mu_service_diff_avg"),
            ("average service difference, engine-seconds", "engine_service_diff_avg"),
        )
    }
    grouped_bars(panels, path, title="fairq, VTC and FIFO on seven traffic shapes")


if __name__ == "__main__":
    sys.exit(main())
