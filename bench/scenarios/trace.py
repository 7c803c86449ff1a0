"""Scenario 2, end to end: the Azure conversation trace, fairq against the naive shared
work queue, with the simulator's figures for the same requests beside them.

    python -m bench.scenarios.trace [--trace CSV] [--quick] [--slice 540 960] [--time-scale 0.1]

- Trace: the public Azure LLM inference trace (conversation service, 2023; see
  `bench.sim.azure`), read from --trace or $FQ_AZURE_TRACE (`bench.harness.traces` says how to
  fetch it), with tenants assigned exactly as `bench.sim.azure` does
  (`producers.loadgen.assign_azure_trace`, seed 1: a seeded Zipf draw over t01..t20 with
  s = 1.1, plus a synthetic tenant `noisy` adding 25% of the trace's rows as a flood
  between 600 s and 900 s).
- Slice: only the requests arriving in [--slice START END) of the trace's clock
  (default 540-960 s: a minute before the flood, the flood, a minute after), shifted to
  start at 0. Replaying the whole hour would take most of an hour of wall time per mode.
- Time compression: the simulated engine runs --time-scale times the engine model's
  time (default 0.1) and the arrivals are compressed by the same factor, so the load
  relative to capacity is the trace's. Figures are in the trace's seconds (wall / scale).
- Stack: 2 simulated workers (the simulator benchmark's 2 replicas), the example config
  with admission out of the way (`bench.harness.stack.benchmark_config`, all 21 tenants listed
  with weight 1). The trace tenants stream their events to the recorder; `noisy` is
  collected from the results bucket (`bench.harness.recorder`).
- Output lengths: the wire contract has no way to ask for an exact length, so each
  request asks for max_tokens = the trace's output length and the simulated engine
  draws a length in [1, max_tokens] from the request id (the same in both modes): on
  average about half the trace's. The simulator gets the lengths the real engine
  produced, and the same max_tokens, so both run the same work.
- Metrics (`dispatcher.sim.fairness`, the simulator's own definitions): per-tenant
  queue wait and TTFT percentiles from the client's submit, Jain's index and the VTC
  service difference over 60 s windows, service over time.
- Simulator: `dispatcher.sim.simulator.simulate` on the same requests, policy fairq against
  the real fairq and fifo against the real naive queue; the table gives each tenant's p95
  TTFT in both and their difference.

Writes bench/results/trace/summary.json, records-<mode>.json and PNGs (per mode: service
over time and TTFT CDFs; and the trace tenants' TTFT CDF real against simulated);
prints a markdown digest. `--quick` replays one minute around the flood's start.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

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
from bench.harness.recorder import Measured, Replay, arrivals_from_trace, describe_outcomes
from bench.harness.stack import Mode, Stack, StackSpec, benchmark_config
from bench.harness.traces import add_trace_argument, azure_trace
from bench.sim.azure import PLOTTED
from dispatcher.core.policies import Policy
from dispatcher.sim.fairness import RequestRecord, summarize
from dispatcher.sim.simulator import SimResult, simulate
from dispatcher.sim.trace import TraceRecord
from producers.loadgen import TraceError, assign_azure_trace
from producers.simulate import plot_result

TITLE = "End to end: Azure conversation trace, fairq vs the naive queue and the simulator"
RESULTS = RESULTS_DIR / "trace"
NOISY = "noisy"
TRACE_TENANTS = 20
# The real stack's mode and the simulator policy it is compared with.
SIM_POLICY: dict[Mode, Policy] = {"fairq": "fairq", "naive": "fifo"}


@dataclass(frozen=True, slots=True)
class Settings:
    slice_start_s: float = 540.0
    slice_end_s: float = 960.0
    time_scale: float = 0.1
    workers: int = 2
    seed: int = 1
    noisy_share: float = 0.25
    timeout_s: float = 900.0


FULL = Settings()
QUICK = Settings(slice_start_s=590.0, slice_end_s=650.0, time_scale=0.05, timeout_s=120.0)


def trace_slice(settings: Settings, path: Path) -> list[TraceRecord]:
    """The assigned trace's requests (from the Azure trace at `path`) arriving in the
    slice, shifted to start at 0."""
    trace = assign_azure_trace(
        path,
        settings.seed,
        tenants=TRACE_TENANTS,
        noisy_share=settings.noisy_share,
        noisy_tenant=NOISY,
    )
    return [
        replace(r, arrival_s=round(r.arrival_s - settings.slice_start_s, 6))
        for r in trace
        if settings.slice_start_s <= r.arrival_s < settings.slice_end_s
    ]


def tenants_of(trace: list[TraceRecord]) -> list[str]:
    return sorted({r.tenant for r in trace})


def stack_spec(mode: Mode, trace: list[TraceRecord], settings: Settings) -> StackSpec:
    """Every tenant of the slice listed with weight 1, as a registry would have them."""
    return StackSpec(
        mode=mode,
        workers=settings.workers,
        time_scale=settings.time_scale,
        config=benchmark_config(dict.fromkeys(tenants_of(trace), 1.0)),
    )


async def run_mode(
    mode: Mode, trace: list[TraceRecord], settings: Settings, out_dir: Path
) -> Replay:
    arrivals = arrivals_from_trace(trace, settings.time_scale, collected={NOISY})
    spec = stack_spec(mode, trace, settings)
    async with Stack(spec, out_dir / "logs" / mode) as stack:
        return await stack.replay(arrivals, timeout_s=settings.timeout_s)


def simulated(
    trace: list[TraceRecord], measured: list[Measured], settings: Settings, mode: Mode
) -> SimResult:
    """The slice through the simulator, each request with the output length the real
    engine produced (ids are `<tenant>-<index in the trace>` in every mode)."""
    produced = {m.id: m.output_tokens for m in measured}
    same_work = []
    for index, record in enumerate(trace):
        output = produced.get(f"{record.tenant}-{index}")
        if output:  # a request that produced nothing did no work the simulator can model
            same_work.append(
                replace(
                    record,
                    output_tokens=output,
                    max_tokens=record.max_tokens or record.output_tokens,
                )
            )
    spec = stack_spec(mode, trace, settings)
    return simulate(
        same_work, spec.config, spec.engine, replicas=spec.workers, policy=SIM_POLICY[mode]
    )


def summarise_real(
    result: Replay, settings: Settings, weights: dict[str, float]
) -> tuple[list[RequestRecord], dict[str, Any]]:
    records = [m.request_record(settings.time_scale) for m in result.measured]
    summary = summarize(records, weights=weights)
    summary.update(
        wall_s=result.wall_s, outcomes=result.counts(), max_submit_lateness_s=result.max_lateness_s
    )
    return records, summary


def fidelity(real: dict[str, Any], sim: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """Per tenant: real and simulated p95 TTFT and their difference (real - sim)."""
    rows = {}
    for tenant, row in real["tenants"].items():
        real_p95 = row["ttft_s"]["p95"]
        sim_p95 = sim["tenants"].get(tenant, {}).get("ttft_s", {}).get("p95")
        rows[tenant] = {
            "real_p95": real_p95,
            "sim_p95": sim_p95,
            "diff": None if real_p95 is None or sim_p95 is None else real_p95 - sim_p95,
        }
    return rows


def plot(
    records: dict[str, list[RequestRecord]], sims: dict[str, SimResult], out_dir: Path
) -> list[str]:
    paths = []
    for mode, mine in records.items():
        path = out_dir / f"trace_{mode}.png"
        plot_result(mine, path, title=f"Azure conv trace end to end, {mode}", tenants=PLOTTED)
        paths.append(path.name)
    series = {}
    for mode, mine in records.items():
        series[f"real {mode}"] = _trace_ttfts(mine)
        series[f"sim {SIM_POLICY[mode]}"] = _trace_ttfts(sims[mode].records)
    path = out_dir / "trace_ttft_real_vs_sim.png"
    cdf_plot(
        series,
        path,
        title="Trace tenants' TTFT (t01-t20 pooled): real stack and simulator",
        xlabel="time to first token (trace s)",
    )
    paths.append(path.name)
    return paths


def _trace_ttfts(records: list[RequestRecord]) -> list[float]:
    return [r.first_token - r.arrival for r in records if r.tenant != NOISY and r.served]


def render(summary: dict[str, Any]) -> str:
    """The markdown tables of a summary (also what bench.scenarios.report writes into the docs)."""
    real, sim, fid = summary["real"], summary["sim"], summary["fidelity"]
    modes = list(real)
    lines = table(
        [
            "run",
            "throughput (tokens/s)",
            "service diff max",
            "service diff avg",
            "Jain (mean)",
            "wall s",
            "outcomes",
        ],
        [
            [
                f"real {mode}",
                f"{real[mode]['throughput_tokens_per_s']:.0f}",
                f"{real[mode]['service_diff_max']:.0f}",
                f"{real[mode]['service_diff_avg']:.0f}",
                _number(real[mode]["jain_index_mean"], 3),
                f"{real[mode]['wall_s']:.0f}",
                describe_outcomes(real[mode]["outcomes"]),
            ]
            for mode in modes
        ]
        + [
            [
                f"sim {SIM_POLICY[mode]}",
                f"{sim[mode]['throughput_tokens_per_s']:.0f}",
                f"{sim[mode]['service_diff_max']:.0f}",
                f"{sim[mode]['service_diff_avg']:.0f}",
                _number(sim[mode]["jain_index_mean"], 3),
                "",
                "",
            ]
            for mode in modes
        ],
    )
    lines += [
        "",
        "TTFT in trace seconds, p50 / p95 / p99, real stack; then p95 in the "
        "simulator and real - sim:",
        "",
    ]
    header = ["tenant", "requests"]
    for mode in modes:
        header += [f"real {mode}", f"sim {SIM_POLICY[mode]} p95", "real - sim"]
    rows = []
    tenants = real[modes[0]]["tenants"]
    for tenant in sorted(tenants, key=lambda t: (t != NOISY, t)):
        row = [tenant, str(tenants[tenant]["count"])]
        for mode in modes:
            ttft = real[mode]["tenants"][tenant]["ttft_s"]
            row += [
                " / ".join(_number(ttft[q], 2) for q in ("p50", "p95", "p99")),
                _number(fid[mode][tenant]["sim_p95"], 2),
                _number(fid[mode][tenant]["diff"], 2),
            ]
        rows.append(row)
    lines += table(header, rows)
    return "\n".join(lines)


def _number(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


async def run_all(
    settings: Settings, trace: list[TraceRecord], out_dir: Path, command: str
) -> dict[str, Any]:
    """Both modes on `trace` (a `trace_slice`), then the simulator on the same requests."""
    facts = machine_facts(command)
    results: dict[Mode, Replay] = {}
    for mode in SIM_POLICY:
        started = time.monotonic()
        results[mode] = await run_mode(mode, trace, settings, out_dir)
        note_run(mode, started, str(results[mode].counts()))
    for mode, result in results.items():
        write_records(out_dir / f"records-{mode}.json", result.measured)
    records: dict[str, list[RequestRecord]] = {}
    real: dict[str, dict[str, Any]] = {}
    sims: dict[str, SimResult] = {}
    weights = dict.fromkeys(tenants_of(trace), 1.0)
    for mode, result in results.items():
        records[mode], real[mode] = summarise_real(result, settings, weights)
        sims[mode] = simulated(trace, result.measured, settings, mode)
    summary = {
        "scenario": "trace",
        "machine": facts,
        "settings": asdict(settings),
        "requests": len(trace),
        "stack": stack_spec("fairq", trace, settings).describe(),
        "real": real,
        "sim": {mode: sim.summary for mode, sim in sims.items()},
        "fidelity": {mode: fidelity(real[mode], sims[mode].summary) for mode in real},
        "plots": plot(records, sims, out_dir),
    }
    return write_summary(out_dir, summary)


def build_parser() -> argparse.ArgumentParser:
    parser = scenario_parser(
        "bench.scenarios.trace",
        __doc__,
        RESULTS,
        "one minute of the trace around the flood's start",
    )
    add_trace_argument(parser)
    parser.add_argument(
        "--slice",
        type=float,
        nargs=2,
        metavar=("START", "END"),
        help="trace seconds to replay (default 540 960; quick 590 650)",
    )
    parser.add_argument(
        "--time-scale", type=float, help="engine and arrival time scale (default 0.1; quick 0.05)"
    )
    parser.add_argument("--workers", type=int, help="simulated workers (default 2)")
    return parser


def settings_from(args: argparse.Namespace) -> Settings:
    settings = QUICK if args.quick else FULL
    overrides: dict[str, Any] = {"time_scale": args.time_scale, "workers": args.workers}
    if args.slice is not None:
        overrides |= {"slice_start_s": args.slice[0], "slice_end_s": args.slice[1]}
    return with_overrides(settings, overrides)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = command_line("bench.scenarios.trace", argv)
    settings = settings_from(args)
    try:
        trace = trace_slice(settings, azure_trace(args.trace))
    except TraceError as exc:
        print(f"scenario_trace: {exc}", file=sys.stderr)
        return 2
    return run_scenario(args.out_dir, run_all(settings, trace, args.out_dir, command), render)


if __name__ == "__main__":
    sys.exit(main())
