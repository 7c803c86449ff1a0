"""Autoscaling on model-unit utilisation, in the simulator, on the Azure conversation trace.

    python -m bench.sim.autoscale [--trace CSV] [--seed 1] [--cold-start 60] [--quiet 300]
                                  [--fleet-min-replicas 0] [--warmup 600]
                                  [--unit engine|flat] [--out-dir bench/results/autoscale]
                                  [--smoke]

Two fleets, each run three ways:

- **one endpoint**: the trace's full hour (its own tenants, no synthetic flood);
- **eight endpoints**: each gets the trace from a different offset (wrapping around the
  hour), thinned or repeated to a different scale (0.25x to 3x), with idle periods
  (every third 10-minute block of endpoints 2, 5 and 8 has no traffic at all).

Ways: **autoscaled** (`costmodel.capacity.Autoscaler`, min --fleet-min-replicas for
each of the eight endpoints and 1 for the single one, max 16, target utilisation 0.8,
--cold-start s before a new replica serves, replicas given back after --quiet s of lower
demand; measured over the hour after a run-up of its last --warmup s, so the fleet has
been running when the hour starts, as a production one has);
**static for peak** (per endpoint, the replicas its busiest minute needs at the target
utilisation, all hour); and the **oracle**, computed rather than run: every minute
exactly the replicas that minute's demand needs at the target utilisation, with no
cold start (reported also at 100% utilisation). Demand is the model units of the
requests arriving in the minute, in the unit --unit names: `engine` (the default),
engine time at the batch a replica runs, priced by the simulated engine's own decode
curve (`costmodel.engine_model.engine_time_profile`); `flat`, the example profile's
batch-1 model units (the unit before issue 36), as a baseline.

Reported: GPU-seconds (replica lifetimes within the hour, cold starts included) and SLO
attainment, the share of requests whose time to first token is at most 2 s, for each
fleet and for each of the eight endpoints; and, where endpoints scale to zero, how many
requests arrive while a first replica starts (no policy without foresight serves them
in time). Goal: >= 99% attainment with GPU-seconds <= 1.25x the oracle's.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from bench.harness.cli import write_json
from bench.harness.machine import ran_on, table
from bench.harness.traces import add_trace_argument, azure_trace
from broker_config.config import EXAMPLE_CONFIG, EXAMPLE_ENGINE, Config, load_config
from costmodel.capacity import ScalingPolicy
from costmodel.engine_model import engine_time_profile, load_engine_params
from dispatcher.core.limits import scheduling_only
from dispatcher.sim.simulator import Simulation, simulate
from dispatcher.sim.trace import TraceRecord
from producers.loadgen import TraceError, assign_azure_trace

SLO_TTFT_S = 2.0
MINUTE_S = 60.0
HOUR_S = 3600.0
# Endpoint k of eight: traffic scale and whether it has idle blocks.
SCALES = (1.0, 0.5, 2.0, 0.25, 1.5, 3.0, 0.75, 1.0)
IDLE_ENDPOINTS = (1, 4, 7)  # 0-based: endpoints 2, 5 and 8
IDLE_BLOCK_S = 600.0
UNITS = ("engine", "flat")


def priced_in(config: Config, unit: str) -> Config:
    """`config` with its first endpoint's profile in `unit`: the engine's batched decode
    curve (`engine`) or the example's flat batch-1 price list as it is (`flat`)."""
    if unit == "flat":
        return config
    key = next(iter(config.endpoints.values())).profile
    curve = engine_time_profile(load_engine_params(EXAMPLE_ENGINE), name=key)
    return msgspec.structs.replace(config, profiles={**config.profiles, key: curve})


def fleet_config(base: Config, endpoints: Sequence[str]) -> Config:
    """`base` with its first endpoint's settings under each name of `endpoints`."""
    spec = next(iter(base.endpoints.values()))
    return scheduling_only(
        msgspec.structs.replace(base, endpoints={name: spec for name in endpoints})
    )


def shifted(
    rows: Sequence[TraceRecord],
    endpoint: str,
    offset_s: float,
    scale: float,
    idle: bool,
    rng: random.Random,
) -> list[TraceRecord]:
    """The trace for one endpoint: starting `offset_s` into the hour (wrapping), each row
    kept floor(scale) times plus once more with probability scale - floor(scale), none in
    every third 10-minute block if `idle`."""
    records = []
    for row in rows:
        at = (row.arrival_s + offset_s) % HOUR_S
        if idle and int(at // IDLE_BLOCK_S) % 3 == 2:
            continue
        copies = int(scale) + (rng.random() < scale - int(scale))
        records += [dataclasses.replace(row, arrival_s=at, endpoint=endpoint)] * copies
    return sorted(records, key=lambda r: r.arrival_s)


def calibrated(config: Config, rows: Sequence[TraceRecord]) -> Config:
    """`config` with each profile's `capacity_mu_per_s` measured on this traffic: what one
    replica completes kept full of 2,000 of its requests (the example profile's own
    figure comes from a different mix; `fairq calibrate` does the same on a real
    engine)."""
    engine = load_engine_params(EXAMPLE_ENGINE)
    name = next(iter(config.endpoints))
    key = config.endpoints[name].profile
    profile = config.profiles[key]
    sample = [dataclasses.replace(r, arrival_s=0.0, endpoint=name) for r in rows[:2_000]]
    run = simulate(
        sample,
        scheduling_only(msgspec.structs.replace(config, endpoints={name: config.endpoints[name]})),
        engine,
    )
    assert all(r.finished is not None for r in run.records)
    served = sum(profile.model_units(r.input_tokens, r.output_tokens) for r in run.records)
    measured = msgspec.structs.replace(
        profile, capacity_mu_per_s=served / run.summary["simulation"]["makespan_s"]
    )
    return msgspec.structs.replace(config, profiles={**config.profiles, key: measured})


def needed_per_minute(
    records: Sequence[TraceRecord], config: Config, utilisation: float
) -> dict[str, list[int]]:
    """Per endpoint, per minute of the hour: replicas that minute's demand needs."""
    demand: dict[str, list[float]] = {
        name: [0.0] * int(HOUR_S // MINUTE_S) for name in config.endpoints
    }
    for r in records:
        profile = config.profiles[config.endpoints[r.endpoint].profile]
        minute = min(int(r.arrival_s // MINUTE_S), len(demand[r.endpoint]) - 1)
        demand[r.endpoint][minute] += profile.model_units(r.input_tokens, r.output_tokens)
    needed = {}
    for name, minutes in demand.items():
        rate = config.profiles[config.endpoints[name].profile].capacity_mu_per_s
        needed[name] = [math.ceil(mu / MINUTE_S / (rate * utilisation) - 1e-9) for mu in minutes]
    return needed


def warmed_up(records: Sequence[TraceRecord], warmup_s: float) -> list[TraceRecord]:
    """The hour `warmup_s` later, after the hour's last `warmup_s` as a run-up: the
    autoscaler has been running when the measured hour starts, as in production."""
    run_up = [
        dataclasses.replace(r, arrival_s=r.arrival_s - HOUR_S + warmup_s)
        for r in records
        if r.arrival_s >= HOUR_S - warmup_s
    ]
    return run_up + [dataclasses.replace(r, arrival_s=r.arrival_s + warmup_s) for r in records]


def autoscaled(
    records: list[TraceRecord], config: Config, policy: ScalingPolicy, warmup_s: float
) -> dict[str, Any]:
    """The autoscaled fleet on the hour after a run-up: attainment of the hour's
    requests, GPU-seconds the fleet ran during the hour."""
    simulation = Simulation(
        warmed_up(records, warmup_s),
        config,
        load_engine_params(EXAMPLE_ENGINE),
        replicas=max(policy.min_replicas, 1),
        autoscale=policy,
    )
    hour = [r for r in simulation.run() if r.arrival >= warmup_s]
    end = warmup_s + HOUR_S
    gpu_seconds = {name: 0.0 for name in config.endpoints}
    for replica in simulation.replicas:
        retired = replica.retired_at if replica.retired_at is not None else end
        gpu_seconds[replica.worker.endpoint] += max(
            0.0, min(retired, end) - max(replica.started_at, warmup_s)
        )
    result = figures(hour, sum(gpu_seconds.values()))
    result["replica_changes"] = sum(
        1 for at, _, _ in simulation.scaling.decisions if warmup_s <= at < end
    )
    result["endpoints"] = {
        name: figures([r for r in hour if r.endpoint == name], gpu)
        for name, gpu in gpu_seconds.items()
    }
    return result


def missed_at_zero(records: Sequence[TraceRecord], policy: ScalingPolicy, warmup_s: float) -> int:
    """Requests of the measured hour that no policy without foresight serves within the
    SLO once it has scaled an endpoint to zero: those arriving less than cold start
    minus SLO after the first request that follows a silence long enough to reach zero
    (the rate window, then the quiet window). Their first replica cannot serve sooner."""
    silence_s = policy.rate_window_s + policy.scale_down_after_s
    last: dict[str, float] = {}
    woken: dict[str, float] = {}
    missed = 0
    for r in warmed_up(records, warmup_s):
        previous = last.get(r.endpoint, 0.0)  # silent since the fleet started
        last[r.endpoint] = r.arrival_s
        if r.arrival_s - previous >= silence_s:
            woken[r.endpoint] = r.arrival_s
        wake = woken.get(r.endpoint)
        missed += (
            r.arrival_s >= warmup_s
            and wake is not None
            and r.arrival_s - wake < policy.cold_start_s - SLO_TTFT_S
        )
    return missed


def run_fleet(
    records: list[TraceRecord],
    config: Config,
    policy: ScalingPolicy,
    target: float,
    warmup_s: float,
) -> dict[str, Any]:
    engine = load_engine_params(EXAMPLE_ENGINE)
    needed = needed_per_minute(records, config, target)
    results: dict[str, Any] = {}
    started = time.perf_counter()
    results["autoscaled"] = autoscaled(records, config, policy, warmup_s)
    if policy.min_replicas == 0:
        results["autoscaled"]["missed_at_zero"] = missed_at_zero(records, policy, warmup_s)
    # Static for peak: each endpoint its busiest minute's replicas, as separate runs.
    static_gpu_s, static_records = 0.0, []
    for name in config.endpoints:
        own = [r for r in records if r.endpoint == name]
        peak = max(1, max(needed[name]))
        only = msgspec.structs.replace(config, endpoints={name: config.endpoints[name]})
        run = simulate(own, only, engine, replicas=peak)
        static_gpu_s += run.summary["simulation"]["gpu_seconds"]
        static_records += run.records
    results["static for peak"] = figures(static_records, static_gpu_s)
    results["oracle"] = {
        "gpu_seconds": sum(sum(n) for n in needed.values()) * MINUTE_S,
        "endpoints": {name: {"gpu_seconds": sum(n) * MINUTE_S} for name, n in needed.items()},
    }
    results["oracle at 100%"] = {
        "gpu_seconds": sum(sum(n) for n in needed_per_minute(records, config, 1.0).values())
        * MINUTE_S
    }
    results["seconds"] = time.perf_counter() - started
    results["capacity_mu_per_s"] = {
        name: config.profiles[spec.profile].capacity_mu_per_s
        for name, spec in config.endpoints.items()
    }
    return results


def figures(records: Sequence, gpu_seconds: float) -> dict[str, float]:
    served = [r for r in records if r.first_token is not None]
    within = sum(1 for r in served if r.first_token - r.arrival <= SLO_TTFT_S)
    return {
        "requests": len(records),
        "served": len(served),
        "gpu_seconds": gpu_seconds,
        "within_slo": within,
        "slo_attainment": within / max(len(records), 1),
    }


def report(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    rows = []
    for fleet, ways in results.items():
        oracle = ways["oracle"]["gpu_seconds"]
        for way in ("autoscaled", "static for peak", "oracle", "oracle at 100%"):
            row = ways[way]
            attainment = f"{row['slo_attainment']:.2%}" if "slo_attainment" in row else "-"
            rows.append(
                [
                    fleet,
                    way,
                    f"{row['gpu_seconds']:,.0f}",
                    f"{row['gpu_seconds'] / oracle:.2f}",
                    attainment,
                ]
            )
        saving = 1 - ways["autoscaled"]["gpu_seconds"] / ways["static for peak"]["gpu_seconds"]
        rows.append(
            [
                fleet,
                "autoscaled against static for peak",
                "",
                f"{abs(saving):.0%} {'fewer' if saving >= 0 else 'more'} GPU-seconds",
                "",
            ]
        )
    command = (
        f"python -m bench.sim.autoscale --seed {args.seed} --cold-start {args.cold_start} "
        f"--quiet {args.quiet} --warmup {args.warmup} "
        f"--fleet-min-replicas {args.fleet_min_replicas} --unit {args.unit}"
        f"{' --smoke' if args.smoke else ''}"
    )
    scaled, oracle = results["eight endpoints"]["autoscaled"], results["eight endpoints"]["oracle"]
    per_endpoint = []
    for k, (name, row) in enumerate(scaled["endpoints"].items()):
        needs = oracle["endpoints"][name]["gpu_seconds"]
        per_endpoint.append(
            [
                name,
                f"{SCALES[k]}x",
                "yes" if k in IDLE_ENDPOINTS else "no",
                f"{row['gpu_seconds']:,.0f}",
                f"{row['gpu_seconds'] / needs:.2f}" if needs else "-",
                f"{row['slo_attainment']:.2%}",
                f"{row['requests'] - row['within_slo']:,}",
            ]
        )
    return "\n".join(
        [
            ran_on(command),
            "",
            *table(
                ["fleet", "way", "GPU-seconds", "x oracle", "SLO attainment (TTFT <= 2 s)"], rows
            ),
            "",
            "The eight endpoints, autoscaled:",
            "",
            *table(
                [
                    "endpoint",
                    "traffic",
                    "idle blocks",
                    "GPU-seconds",
                    "x oracle",
                    "SLO attainment",
                    "missed",
                ],
                per_endpoint,
            ),
            "",
            *(
                f"{fleet}: {row['missed_at_zero']:,} requests arrive while a scaled-to-zero "
                f"endpoint's first replica starts; with them missed, attainment is at most "
                f"{1 - row['missed_at_zero'] / row['requests']:.2%}"
                for fleet, row in ((f, w["autoscaled"]) for f, w in results.items())
                if "missed_at_zero" in row
            ),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.sim.autoscale", description=__doc__.split("\n\n")[0]
    )
    add_trace_argument(parser)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--cold-start", type=float, default=60.0)
    parser.add_argument("--quiet", type=float, default=300.0)
    parser.add_argument(
        "--fleet-min-replicas",
        type=int,
        default=0,
        help="min replicas of each of the eight endpoints (0: scale to zero)",
    )
    parser.add_argument(
        "--warmup",
        type=float,
        default=600.0,
        help="seconds of run-up (the hour's end) before the measured hour",
    )
    parser.add_argument(
        "--unit",
        choices=UNITS,
        default="engine",
        help="what demand and capacity are priced in (engine: engine time at the batch a "
        "replica runs; flat: batch-1 model units, the baseline)",
    )
    parser.add_argument("--out-dir", type=Path, default=Path("bench/results/autoscale"))
    parser.add_argument(
        "--smoke", action="store_true", help="the first 5 minutes of the trace, for CI"
    )
    args = parser.parse_args(argv)
    try:
        rows = assign_azure_trace(azure_trace(args.trace), args.seed, noisy_share=0.0)
    except TraceError as exc:
        print(f"autoscale: {exc}", file=sys.stderr)
        return 2
    if args.smoke:
        rows = [r for r in rows if r.arrival_s < 300.0]
    base = calibrated(priced_in(load_config(EXAMPLE_CONFIG), args.unit), rows)
    rng = random.Random(f"{args.seed}:fleet")
    names = [f"ep{k + 1}" for k in range(len(SCALES))]
    fleets = {
        "one endpoint": (
            [dataclasses.replace(r, endpoint="ep1") for r in rows],
            fleet_config(base, names[:1]),
            1,
        ),
        "eight endpoints": (
            sorted(
                (
                    r
                    for k, name in enumerate(names)
                    for r in shifted(
                        rows, name, k * HOUR_S / len(names), SCALES[k], k in IDLE_ENDPOINTS, rng
                    )
                ),
                key=lambda r: r.arrival_s,
            ),
            fleet_config(base, names),
            args.fleet_min_replicas,
        ),
    }
    results = {}
    for fleet, (records, config, min_replicas) in fleets.items():
        policy = ScalingPolicy(
            min_replicas=min_replicas,
            max_replicas=16,
            target_utilisation=0.8,
            cold_start_s=args.cold_start,
            scale_down_after_s=args.quiet,
        )
        results[fleet] = run_fleet(records, config, policy, policy.target_utilisation, args.warmup)
        print(
            f"{fleet}: {len(records):,} requests ({results[fleet]['seconds']:.0f} s)",
            file=sys.stderr,
        )
    name = "smoke" if args.smoke else "autoscale" if args.unit == "engine" else "autoscale-flat"
    write_json(args.out_dir / f"{name}.json", {**results, "unit": args.unit}, 2)
    print(report(results, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
