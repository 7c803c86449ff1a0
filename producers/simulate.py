"""`fairq sim`: run a trace (or a generated scenario) through the virtual-clock simulator.

    fairq sim --trace TRACE.csv --policy fairq|fifo|vtc [--config C.toml] [--engine E.toml]
              [--replicas N] [--seed N] [--service-unit vtc|engine|model_units]
              --out RESULT.json [--plot RESULT.png]
    fairq sim --scenario noisy-neighbour ...

RESULT.json is `{"records": [...], "summary": {...}}` (see dispatcher.sim.fairness for
every figure). The plot (matplotlib, imported only when asked for) shows per-tenant
service over time and per-tenant TTFT CDFs.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from broker_config.config import EXAMPLE_CONFIG, ConfigError, load_config
from costmodel.engine_model import EngineParams, load_engine_params
from costmodel.units import ModelProfile
from dispatcher.core.limits import scheduling_only
from dispatcher.core.policies import POLICIES
from dispatcher.sim.fairness import (
    DEFAULT_METRICS,
    SERVICE_UNITS,
    MetricOptions,
    RequestRecord,
    service_over_time,
    service_unit,
)
from dispatcher.sim.simulator import SimResult, simulate
from producers.loadgen import TraceError, noisy_neighbour, read_trace

SCENARIOS = {"noisy-neighbour": noisy_neighbour}
UNIT_LABELS = {
    "vtc": "input + 2 x output tokens / s",
    "engine": "engine-seconds / s",
    "model_units": "model units / s",
}
# Tenants drawn individually in the plot; beyond this, the ones with the most requests.
PLOT_TENANTS = 10


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "sim",
        help="simulate a trace through the scheduler on a virtual clock",
        description="Run a request trace through the real scheduling core and a "
        "continuous-batching engine model on a virtual clock.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--trace",
        type=Path,
        help="trace CSV (tenant,arrival_s,"
        "input_tokens,output_tokens[,priority,deadline_s,session,"
        "max_tokens,endpoint])",
    )
    source.add_argument(
        "--scenario",
        choices=sorted(SCENARIOS),
        help="generate the trace: noisy-neighbour = tenant A sends 10,000 "
        "requests at t=0, B-E send Poisson 0.5 req/s for 300 s",
    )
    parser.add_argument("--policy", choices=POLICIES, default="fairq")
    parser.add_argument(
        "--config",
        type=Path,
        default=EXAMPLE_CONFIG,
        help="fairq config TOML (default: configs/example.toml)",
    )
    parser.add_argument(
        "--scheduling-only",
        action="store_true",
        help="take admission out of the way (no rate limits, quotas, queue "
        "caps or latency throttle; every tenant in one tier, weight 1) "
        "to compare dispatch order alone",
    )
    parser.add_argument(
        "--engine",
        type=Path,
        help="engine model TOML (default: the built-in defaults, which "
        "configs/engine.toml spells out)",
    )
    parser.add_argument(
        "--replicas", type=_positive_int, default=1, help="engine replicas per endpoint (default 1)"
    )
    parser.add_argument(
        "--seed", type=int, default=1, help="seed of the generated scenario (default 1)"
    )
    parser.add_argument(
        "--service-unit",
        choices=SERVICE_UNITS,
        default="vtc",
        help="the unit service and fairness are measured in: vtc = input + 2 x output "
        "tokens (default), engine = the engine time attributed to each request, "
        "model_units = the first endpoint's profile price at its operating batch",
    )
    parser.add_argument("--out", type=Path, required=True, help="RESULT.json to write")
    parser.add_argument("--plot", type=Path, help="also write this PNG")
    parser.set_defaults(run=run)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
        if args.scheduling_only:
            config = scheduling_only(config)
        engine = load_engine_params(args.engine) if args.engine else EngineParams()
        trace = read_trace(args.trace) if args.trace else SCENARIOS[args.scenario](args.seed)
    except (ConfigError, TraceError, ValueError) as exc:
        print(f"fairq sim: {exc}", file=sys.stderr)
        return 2
    first_endpoint = next(iter(config.endpoints.values()))
    profile = config.profiles.get(first_endpoint.profile) or ModelProfile()
    metrics = service_unit(args.service_unit, profile)
    result = simulate(
        trace, config, engine, replicas=args.replicas, policy=args.policy, metrics=metrics
    )
    result.summary["simulation"].update(
        source=str(args.trace) if args.trace else f"scenario:{args.scenario}",
        seed=args.seed,
        scheduling_only=args.scheduling_only,
    )
    try:
        write_result(result, args.out)
        if args.plot:
            plot_result(
                result.records,
                args.plot,
                title=f"{args.policy}, {len(trace)} requests",
                metrics=metrics,
            )
    except OSError as exc:
        print(f"fairq sim: cannot write output: {exc}", file=sys.stderr)
        return 1
    print(format_summary(result.summary))
    return 0


def write_result(result: SimResult, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result.to_dict(), separators=(",", ":")) + "\n")


def format_summary(summary: dict[str, Any]) -> str:
    """A short human-readable digest of a result summary."""
    lines = [
        f"{'tenant':<12} {'count':>6} {'served':>6} {'ttft p50':>9} {'ttft p95':>9} "
        f"{'ttft p99':>9} {'service':>12}"
    ]
    for tenant, row in summary["tenants"].items():
        ttft = row["ttft_s"]
        lines.append(
            f"{tenant:<12} {row['count']:>6} {row['served']:>6} "
            f"{_seconds(ttft['p50'])} {_seconds(ttft['p95'])} "
            f"{_seconds(ttft['p99'])} {row['service']:>12.6g}"
        )
    jain = summary["jain_index_mean"]
    lines.append(
        f"throughput {summary['throughput_tokens_per_s']:.0f} tokens/s, "
        f"service difference max {summary['service_diff_max']:.4g} "
        f"avg {summary['service_diff_avg']:.4g} ({summary['service_unit']}/s), "
        f"Jain mean {'-' if jain is None else f'{jain:.3f}'}"
    )
    return "\n".join(lines)


def _seconds(value: float | None) -> str:
    return f"{'-':>9}" if value is None else f"{value:>8.2f}s"


def plot_result(
    records: Sequence[RequestRecord],
    path: Path,
    title: str = "",
    tenants: Sequence[str] | None = None,
    metrics: MetricOptions = DEFAULT_METRICS,
) -> None:
    """Per-tenant service rate over time and per-tenant TTFT CDFs, as one PNG.

    `tenants` are the ones drawn (default: the PLOT_TENANTS with the most requests).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    served = [r for r in records if r.served]
    counts: dict[str, int] = {}
    for record in records:
        counts[record.tenant] = counts.get(record.tenant, 0) + 1
    shown = (
        list(tenants)
        if tenants is not None
        else sorted(sorted(counts, key=lambda t: (-counts[t], t))[:PLOT_TENANTS])
    )
    end = max((r.finished for r in served), default=1.0)
    starts, rates = service_over_time(served, max(1.0, end / 60), end, metrics)
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(10, 8))
    for tenant in shown:
        top.plot(starts, rates.get(tenant, [0.0] * len(starts)), label=tenant, linewidth=1)
        ttfts = sorted(r.first_token - r.arrival for r in served if r.tenant == tenant)
        if ttfts:
            bottom.step(
                ttfts,
                [(i + 1) / len(ttfts) for i in range(len(ttfts))],
                where="post",
                label=tenant,
                linewidth=1,
            )
    top.set(
        xlabel="time (s)",
        ylabel=f"service ({UNIT_LABELS[metrics.unit]})",
        title=f"Service per tenant over time{' - ' + title if title else ''}",
    )
    bottom.set(
        xlabel="time to first token (s)",
        ylabel="fraction of requests",
        title="TTFT CDF per tenant",
        xscale="log",
    )
    legend_title = f"{len(shown)} of {len(counts)} tenants" if len(shown) < len(counts) else None
    for axes in (top, bottom):
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=7, ncol=2, title=legend_title, title_fontsize=7)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=80)
    plt.close(figure)
