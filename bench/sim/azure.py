"""Replay the Azure LLM conversation trace through the simulator: fairq vs fifo.

    python -m bench.sim.azure [--trace CSV] [--replicas 2] [--seed 1] [--noisy-share 0.25]
                              [--out-dir bench/results] [--plot-dir docs/img]

Prints a markdown table for docs/benchmarks.md; writes one RESULT.json per policy to
--out-dir and one PNG per policy to --plot-dir.

- Trace: the Azure LLM inference trace 2023, conversation service, one hour, 19,366
  requests (public, CC-BY: AzureLLMInferenceTrace_conv.csv of Azure/AzurePublicDataset;
  from Patel et al., "Splitwise: Efficient generative LLM inference using phase
  splitting", ISCA 2024), read from --trace or $FQ_AZURE_TRACE (`bench.harness.traces` says how
  to fetch it). The benchmark fails with that message if the file is absent.
- Tenants: `producers.loadgen.assign_azure_trace` with the seed: every row goes to one
  of 20 tenants t01..t20 by a seeded Zipf draw (s = 1.1, so t01 sends about 28% of
  the rows and t20 about 1%), and a synthetic tenant `noisy` adds --noisy-share x rows
  extra requests (sizes drawn from the trace's rows) arriving uniformly between 600 s
  and 900 s: a 5-minute flood at about three times the trace's own rate.
- Config: configs/example.toml with admission out of the way (`scheduling_only`: no
  rate limits or latency throttle, every tenant in one tier with weight 1), so both
  policies admit exactly the same requests and the comparison is dispatch order alone.
- Engine: the defaults of configs/engine.toml (a 7B-class model on one mid-range GPU).
- Replicas: 2. One replica saturates at about 4,600 tokens/s on this trace, and the
  trace alone needs about 7,500 tokens/s: with 2 replicas the real traffic runs at
  about 80% of capacity (busy, with short overloads at its peaks), and the flood pushes
  the fleet well past capacity for a while. 1 replica would be overloaded all hour;
  3 would leave the real traffic at about 55%.
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness.traces import add_trace_argument, azure_trace
from broker_config.config import EXAMPLE_CONFIG, load_config
from dispatcher.core.limits import scheduling_only
from dispatcher.sim.simulator import SimResult, simulate
from producers.loadgen import TraceError, assign_azure_trace
from producers.simulate import plot_result, write_result

POLICIES = ("fairq", "fifo")
PLOTTED = ("noisy", "t01", "t02", "t03", "t05", "t10", "t15", "t20")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.sim.azure", description=__doc__.split("\n\n")[0]
    )
    add_trace_argument(parser)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--noisy-share", type=float, default=0.25)
    parser.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    parser.add_argument("--plot-dir", type=Path, default=Path("docs/img"))
    args = parser.parse_args(argv)
    try:
        trace = assign_azure_trace(azure_trace(args.trace), args.seed, noisy_share=args.noisy_share)
    except TraceError as exc:
        print(f"sim_azure: {exc}", file=sys.stderr)
        return 2
    config = scheduling_only(load_config(EXAMPLE_CONFIG))
    results: dict[str, SimResult] = {}
    seconds: dict[str, float] = {}
    for policy in POLICIES:
        started = time.perf_counter()
        results[policy] = simulate(trace, config, replicas=args.replicas, policy=policy)
        seconds[policy] = time.perf_counter() - started
        write_result(results[policy], args.out_dir / f"sim_azure_{policy}.json")
        plot_result(
            results[policy].records,
            args.plot_dir / f"sim_azure_{policy}.png",
            title=f"Azure conv trace, {policy}, {args.replicas} replicas",
            tenants=PLOTTED,
        )
    print(report(results, seconds, args, len(trace)))
    return 0


def report(
    results: dict[str, SimResult],
    seconds: dict[str, float],
    args: argparse.Namespace,
    requests: int,
) -> str:
    lines = [
        f"Command: `python -m bench.sim.azure --replicas {args.replicas} --seed {args.seed} "
        f"--noisy-share {args.noisy_share}`",
        f"Date: {dt.date.today().isoformat()}; machine: {platform.machine()}, "
        f"{platform.processor() or platform.platform()}, Python {platform.python_version()}",
        f"Requests: {requests}; simulation wall time: "
        + ", ".join(f"{p} {seconds[p]:.1f} s" for p in POLICIES),
        "",
        "| policy | throughput (tokens/s) | service diff max | service diff avg "
        "| Jain (mean) | makespan (s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for policy in POLICIES:
        summary = results[policy].summary
        lines.append(
            f"| {policy} | {summary['throughput_tokens_per_s']:.0f} "
            f"| {summary['service_diff_max']:.0f} | {summary['service_diff_avg']:.0f} "
            f"| {_number(summary['jain_index_mean'], 3)} "
            f"| {summary['simulation']['makespan_s']:.0f} |"
        )
    lines += [
        "",
        "TTFT in seconds, p50 / p95 / p99:",
        "",
        "| tenant | requests | fairq | fifo |",
        "|---|---:|---:|---:|",
    ]
    tenants = results[POLICIES[0]].summary["tenants"]
    for tenant in sorted(tenants, key=lambda t: (t != "noisy", t)):
        cells = [_ttft(results[p].summary["tenants"][tenant]) for p in POLICIES]
        lines.append(f"| {tenant} | {tenants[tenant]['count']} | {' | '.join(cells)} |")
    return "\n".join(lines)


def _ttft(row: dict[str, Any]) -> str:
    ttft = row["ttft_s"]
    return " / ".join(_number(ttft[q], 2) for q in ("p50", "p95", "p99"))


def _number(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


if __name__ == "__main__":
    sys.exit(main())
