"""Scenario 3, end to end: the sustained request rate through fairq against the raw
JetStream path, measured in the same run on the same machine.

    python -m bench.scenarios.rate [--quick] [--requests 20000] [--tenants 10]
                                   [--repeats 3] [--workers 1] [--profile]

Workload: `requests` requests of max_tokens 1 (8 input tokens), round-robin over
`tenants` tenants, all due at once: the load generator (`bench.harness.firehose`, in this
process, apart from every process of the system) publishes them with 512 unacknowledged
at a time and receives every request's events on one wildcard subscription.

Runs, in rounds (each round one of each, so drift of the shared machine hits all alike),
each on a fresh nats-server:

- `raw`: the physical limit of the broker path: this process publishes the same
  requests (no `Fq-Reply`) while a consumer in a fresh process pull-fetches batches of
  256 on one durable consumer and acks each message, no processing
  (`bench.harness.raw`);
- `fairq`: the dispatcher and `workers` simulated workers (`bench.harness.stack`) with an
  instant engine (time scale 0) of max_sequences 1024: with the default 64 the rate is
  bounded by capacity x round trip, not by the dispatcher. The tenants are listed in the
  config, as a registry would list them, so their consumers exist from the start;
- `naive`: the naive shared work queue on the same workers and engine.

Rate = requests / (first submit -> last final event at the client); for `raw`, first
publish -> last ack sent (and flushed) by the consumer. Beside each run: the CPU seconds
each process used during it (/proc/<pid>/stat), because on 2 cores every process of
the run competes for the same CPU. The headline is fairq's median rate over raw's
(target >= 40%).

`--profile` adds one fairq run, not counted in the rates, with py-spy sampling the
dispatcher and the first worker (`bench.harness.pyspy`); their top functions go into the
summary.

Writes bench/results/rate/summary.json and rate_cpu.png (CPU per request by process and
mode); prints a markdown digest. `--quick` is a few-second variant (3,000 requests, one
round).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.harness import pyspy
from bench.harness.cli import note_run, run_scenario, scenario_parser, write_summary
from bench.harness.machine import command_line, machine_facts, table, with_overrides
from bench.harness.measured import Arrival, Replay, describe_outcomes
from bench.harness.paths import RESULTS_DIR
from bench.harness.procstat import CpuMeter, memory_kb
from bench.harness.raw import (
    LOAD_GENERATOR,
    RAW_CONSUMER,
    RawRun,
    raw_consumer_job,
    raw_run,
    spawn_pool,
)
from bench.harness.stack import Mode, Stack, StackSpec, benchmark_config
from costmodel.engine_model import EngineParams

TITLE = "End to end: dispatch rate, fairq vs the raw JetStream path"
RESULTS = RESULTS_DIR / "rate"
TARGET_SHARE = 0.4
INPUT_TOKENS = 8
MAX_TOKENS = 1


@dataclass(frozen=True, slots=True)
class Settings:
    requests: int = 20_000
    tenants: int = 10
    repeats: int = 3
    workers: int = 1
    max_sequences: int = 1024
    naive: bool = True
    # Bound on one run, in wall seconds.
    timeout_s: float = 120.0


FULL = Settings()
QUICK = Settings(requests=3_000, repeats=1, timeout_s=60.0)


def tenant_names(count: int, prefix: str = "t") -> list[str]:
    return [f"{prefix}{n}" for n in range(count)]


def instant_spec(mode: Mode, workers: int, max_sequences: int, tenants: Sequence[str]) -> StackSpec:
    """An engine that answers at once, with room for `max_sequences` requests per worker.

    `tenants` are listed in the config (weight 1), as a deployment's registry would list
    them: their consumers exist from the start, so the run measures the steady state, not
    the discovery of unlisted tenants."""
    return StackSpec(
        mode=mode,
        workers=workers,
        time_scale=0.0,
        engine=EngineParams(max_sequences=max_sequences),
        config=benchmark_config(dict.fromkeys(tenants, 1.0)),
    )


def burst(tenants: Sequence[str], requests: int, streamed: bool = True) -> list[Arrival]:
    """`requests` requests due at once, round-robin over `tenants`."""
    return [
        Arrival(tenants[n % len(tenants)], 0.0, INPUT_TOKENS, MAX_TOKENS, streamed)
        for n in range(requests)
    ]


def rate_of(result: Replay) -> float:
    """Finished requests per second, from the first submit to the last final event."""
    submits = [m.submitted for m in result.measured if m.submitted is not None]
    ends = [m.finished for m in result.measured if m.finished is not None]
    if not ends:
        return 0.0
    return len(ends) / (max(ends) - min(submits))


async def stack_rate(
    spec: StackSpec, arrivals: Sequence[Arrival], log_dir: Path, timeout_s: float
) -> dict[str, Any]:
    """One run of `arrivals` on a fresh stack: rate, outcomes, CPU seconds per process,
    the consumers on the requests stream at the end, the server's memory at the end, and
    (fairq) the dispatcher's memory (`bench.harness.procstat.memory_kb`) before and after."""
    async with Stack(spec, log_dir) as stack:
        pids = stack.pids()
        at_start = memory_kb(pids["dispatcher"]) if "dispatcher" in pids else None
        meter = CpuMeter(pids | {LOAD_GENERATOR: "self"})
        meter.start()
        result = await stack.fire(arrivals, timeout_s=timeout_s)
        cpu = meter.stop()
        memory = memory_kb(pids["dispatcher"]) if "dispatcher" in pids else None
        server_memory = memory_kb(pids["nats-server"])
        async with stack.connect() as nc:
            stream = stack.settings.subjects.requests_stream
            consumers = len(await nc.jetstream().consumers_info(stream))
    run = _run_summary(spec.mode, result, cpu)
    run["server_memory_kb"], run["consumers"] = server_memory, consumers
    if at_start is not None:
        run["dispatcher_memory_kb_at_start"], run["dispatcher_memory_kb"] = at_start, memory
    return run


def _run_summary(mode: str, result: Replay, cpu: dict[str, float]) -> dict[str, Any]:
    acked = [m.acked for m in result.measured if m.acked is not None]
    return {
        "mode": mode,
        "requests": len(result.measured),
        "outcomes": result.counts(),
        "rate_per_s": rate_of(result),
        "wall_s": result.wall_s,
        "publish_s": max(acked, default=0.0),
        "cpu_s": cpu,
    }


def raw_summary(raw: RawRun) -> dict[str, Any]:
    """A run of the raw path (`bench.harness.raw.raw_run`) summarised as a stack's, its
    rate from the first publish to the consumer's last ack."""
    result = raw.replay
    run = _run_summary("raw", result, raw.cpu_s)
    first = min(m.submitted for m in result.measured if m.submitted is not None)
    run["rate_per_s"] = len(result.measured) / (raw.finished_at - result.started_at - first)
    run["wall_s"] = raw.finished_at - result.started_at
    return run


async def profiled_run(settings: Settings, out_dir: Path) -> dict[str, Any]:
    """One fairq run with py-spy sampling the dispatcher and the first worker."""
    tenants = tenant_names(settings.tenants)
    spec = instant_spec("fairq", settings.workers, settings.max_sequences, tenants)
    log_dir = out_dir / "logs" / "profile"
    async with Stack(spec, log_dir) as stack:
        pids = stack.pids()
        targets = {"dispatcher": pids["dispatcher"], "worker": pids[stack.worker_ids[0]]}
        async with pyspy.recording(targets, log_dir) as profile:
            arrivals = burst(tenants, settings.requests)
            result = await stack.fire(arrivals, timeout_s=settings.timeout_s)
    return {"rate_per_s_under_profiler": rate_of(result), **profile}


# -- summary and report --------------------------------------------------------------------


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarise(runs: list[dict[str, Any]], requests: int, cores: int) -> dict[str, Any]:
    modes: dict[str, Any] = {}
    for mode in dict.fromkeys(run["mode"] for run in runs):
        mine = [run for run in runs if run["mode"] == mode]
        processes = dict.fromkeys(p for run in mine for p in run["cpu_s"])
        modes[mode] = {
            "rate_per_s": spread([run["rate_per_s"] for run in mine]),
            "rates": [run["rate_per_s"] for run in mine],
            # Median CPU microseconds per request, per process and in all.
            "cpu_us_per_request": {
                p: statistics.median(1e6 * run["cpu_s"][p] / requests for run in mine)
                for p in processes
            },
            "cpu_us_per_request_total": statistics.median(
                1e6 * sum(run["cpu_s"].values()) / requests for run in mine
            ),
            # Share of the machine's CPU (all cores) busy with these processes.
            "cpu_busy_share": statistics.median(
                sum(run["cpu_s"].values()) / (run["wall_s"] * cores) for run in mine
            ),
        }
    ratios = [
        fairq["rate_per_s"] / raw["rate_per_s"]
        for fairq, raw in zip(
            (r for r in runs if r["mode"] == "fairq"), (r for r in runs if r["mode"] == "raw")
        )
    ]
    return {"modes": modes, "fairq_over_raw": spread(ratios) | {"per_round": ratios}}


def plot(summary: dict[str, Any], out_dir: Path) -> list[str]:
    """Stacked bars: CPU microseconds per request of each process, per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = summary["modes"]
    processes = list(
        dict.fromkeys(p for mode in modes.values() for p in mode["cpu_us_per_request"])
    )
    figure, axes = plt.subplots(figsize=(8, 5))
    bottoms = [0.0] * len(modes)
    for process in processes:
        heights = [mode["cpu_us_per_request"].get(process, 0.0) for mode in modes.values()]
        axes.bar(list(modes), heights, bottom=bottoms, label=process)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    for n, mode in enumerate(modes.values()):
        axes.annotate(
            f"{mode['rate_per_s']['median']:,.0f} req/s",
            (n, bottoms[n]),
            ha="center",
            va="bottom",
            fontsize=9,
        )
    axes.set(
        ylabel="CPU microseconds per request (median run)",
        title="Where the CPU goes: instant engine, all requests due at once",
    )
    axes.legend(fontsize=8)
    figure.tight_layout()
    path = out_dir / "rate_cpu.png"
    figure.savefig(path, dpi=80)
    plt.close(figure)
    return [path.name]


def render(summary: dict[str, Any]) -> str:
    modes, share = summary["modes"], summary["fairq_over_raw"]
    verdict = "meets" if share["median"] >= TARGET_SHARE else "misses"
    lines = table(
        ["path", "requests/s per run", "median", "min - max"],
        [
            [
                mode,
                ", ".join(f"{r:,.0f}" for r in row["rates"]),
                f"{row['rate_per_s']['median']:,.0f}",
                f"{row['rate_per_s']['min']:,.0f} - {row['rate_per_s']['max']:,.0f}",
            ]
            for mode, row in modes.items()
        ],
    )
    lines += [
        "",
        (
            f"fairq / raw per round: {', '.join(f'{r:.0%}' for r in share['per_round'])}; "
            f"median {share['median']:.0%}: {verdict} the {TARGET_SHARE:.0%} target."
        ),
        "",
        (
            "CPU microseconds per request by process (median run), and the share of all "
            "cores busy with them during the run:"
        ),
        "",
    ]
    processes = list(dict.fromkeys(p for row in modes.values() for p in row["cpu_us_per_request"]))
    lines += table(
        ["path", *processes, "all", "cores busy"],
        [
            [
                mode,
                *(_us(row["cpu_us_per_request"].get(p)) for p in processes),
                _us(row["cpu_us_per_request_total"]),
                f"{row['cpu_busy_share']:.0%}",
            ]
            for mode, row in modes.items()
        ],
    )
    profile = summary.get("profile")
    if profile:
        lines += [
            "",
            (
                f"py-spy ({pyspy.PROFILE_RATE} samples/s) during one more fairq run "
                f"({profile['rate_per_s_under_profiler']:,.0f} requests/s under the "
                "profiler); shares of each process's samples (busy time only):"
            ),
            *pyspy.render_processes(profile["processes"]),
        ]
    lines += [
        "",
        "Runs: "
        + "; ".join(
            f"{run['mode']} {run['rate_per_s']:,.0f}/s ({describe_outcomes(run['outcomes'])})"
            for run in summary["runs"]
        ),
    ]
    return "\n".join(lines)


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


# -- driver --------------------------------------------------------------------------------


async def run_all(
    settings: Settings, out_dir: Path, command: str, profile: bool = False
) -> dict[str, Any]:
    facts = machine_facts(command)
    stack_modes: tuple[Mode, ...] = ("fairq", "naive") if settings.naive else ("fairq",)
    runs: list[dict[str, Any]] = []
    with spawn_pool() as pool:
        for round_ in range(settings.repeats):
            for mode in ("raw", *stack_modes):
                started = time.monotonic()
                run = await one_run(mode, round_, settings, out_dir, pool)
                runs.append(run | {"round": round_})
                note_run(
                    f"round {round_} {mode}",
                    started,
                    f"{run['rate_per_s']:,.0f} requests/s, {describe_outcomes(run['outcomes'])}",
                )
    tenants = tenant_names(settings.tenants)
    spec = instant_spec("fairq", settings.workers, settings.max_sequences, tenants)
    summary = {
        "scenario": "rate",
        "machine": facts,
        "settings": asdict(settings),
        "stack": spec.describe(),
        "runs": runs,
        **summarise(runs, settings.requests, facts["nproc"]),
    }
    if profile:
        summary["profile"] = await profiled_run(settings, out_dir)
    summary["plots"] = plot(summary, out_dir)
    return write_summary(out_dir, summary)


async def one_run(
    mode: str, round_: int, settings: Settings, out_dir: Path, pool: ProcessPoolExecutor
) -> dict[str, Any]:
    """One run of a round: the raw path, or a fresh stack of `mode`."""
    tenants = tenant_names(settings.tenants)
    if mode == "raw":
        raw = await raw_run(
            burst(tenants, settings.requests, streamed=False),
            pool,
            raw_consumer_job,
            (settings.requests,),
            RAW_CONSUMER,
            settings.timeout_s,
        )
        return raw_summary(raw)
    return await stack_rate(
        instant_spec(mode, settings.workers, settings.max_sequences, tenants),
        burst(tenants, settings.requests),
        out_dir / "logs" / f"{mode}-{round_}",
        settings.timeout_s,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = scenario_parser("bench.scenarios.rate", __doc__, RESULTS)
    parser.add_argument("--requests", type=int, help="requests per run (default 20000)")
    parser.add_argument("--tenants", type=int, help="tenants (default 10)")
    parser.add_argument("--repeats", type=int, help="rounds (default 3; quick 1)")
    parser.add_argument("--workers", type=int, help="simulated workers (default 1)")
    parser.add_argument("--no-naive", action="store_true", help="skip the naive queue")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="one more fairq run under py-spy (dispatcher and a worker)",
    )
    return parser


def settings_from(args: argparse.Namespace) -> Settings:
    settings = QUICK if args.quick else FULL
    overrides = {
        "requests": args.requests,
        "tenants": args.tenants,
        "repeats": args.repeats,
        "workers": args.workers,
        "naive": False if args.no_naive else None,
    }
    return with_overrides(settings, overrides)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = command_line("bench.scenarios.rate", argv)
    work = run_all(settings_from(args), args.out_dir, command, args.profile)
    return run_scenario(args.out_dir, work, render)


if __name__ == "__main__":
    sys.exit(main())
