"""Chaos: worker processes killed, stopped, hung and slowed under load, and what it costs.

    python -m bench.chaos.run [--smoke] [--requests 5000] [--tenants 20] [--workers 4] [--seed 1]
    python -m bench.chaos.run --saturate 300 [--workers 2]
    python -m bench.chaos.run --ha [--smoke] [--no-faults]

The real stack as a user runs it: `fairq up` (embedded nats-server, the dispatcher, and
simulated worker processes under its supervisor) with the benchmark config (admission out
of the way, so every request should end `done`). Requests from `--tenants` tenants (Zipf
shares) arrive as a Poisson stream, each with its own reply subject. Meanwhile, at random
moments (a gap of `fault_gap_s` x U(0.5, 1.5) between two), one of the faults is injected
into a random serving worker process:

- `kill`: SIGKILL; `stop`: SIGSTOP (the process freezes: no heartbeats, no output);
- `hang`: SIGUSR1, the simulated engine's hang (steps stop; heartbeats go on, so only
  a health probe can tell); `slow`: SIGUSR2, every step 10x longer for `slow_for_s`,
  then back (a slow worker still serves: it should not be evicted).

An observer (`bench.chaos.watch`) records batches, completions, heartbeats, evictions and
every final event. Reported: requests lost, with two different final results, with an
identical final event delivered again, run twice to completion; per fault the seconds
to detection, to all its requests re-dispatched (or ended with the retryable error), and
to a replacement process serving; evictions of workers that had no hang or stop.

`--saturate S` is the false-kill run instead: no faults, every worker kept full for S
seconds by closed-loop tenants with long prompts and long generations; any eviction
there is a false one. `--smoke`: 500 requests and one fault of each kind (CI).

`--ha` strikes the dispatchers and the broker instead (`bench.chaos.ha`: a 3-node
cluster, two dispatchers on one lease): kill -9, SIGSTOP and SIGTERM of the lease holder,
kill -9 of the requests stream's leader node; reported per fault besides the above:
seconds to the new holder's first batch, to the first new request dispatched, to every
waiting request dispatched, and running requests sent to a worker again.

Writes bench/results/chaos/<name>.json and prints a markdown digest; exits 1 if a
request was lost, got two different results or ran twice to completion, or (saturated)
a worker was evicted.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS

from bench.chaos.ha import HaFault, ha_failures, ha_figures, ha_stack, inject
from bench.chaos.load import SUBJECTS, burst, closed_loop, open_loop
from bench.chaos.settings import FAULTS, HA, HA_SMOKE, SATURATED, SMOKE, Settings
from bench.chaos.watch import Fault, Watch, render, verdict
from bench.chaos.workers import fairq_up, inject_faults
from bench.harness.cli import bench_parser, write_json
from bench.harness.machine import command_line, machine_facts, with_overrides
from bench.harness.paths import RESULTS_DIR
from bench.harness.stack import ENDPOINT, connected
from broker_config import jetstream, wire_internal
from broker_config.connection import server_urls
from broker_config.direct_get import DirectBatchGet
from dispatcher.core.pool import Key

RESULTS = RESULTS_DIR / "chaos"
LOOKUP_BATCH = 200
# What tests take from here: the settings' presets are `bench.chaos.settings`'s.
__all__ = ["FAULTS", "HA_SMOKE", "SATURATED", "SMOKE", "failures", "render", "run_named"]


# -- the run -----------------------------------------------------------------------------


async def run(settings: Settings, work_dir: Path) -> dict[str, Any]:
    work_dir.mkdir(parents=True, exist_ok=True)
    faults: list[Fault] = []
    ha_faults: list[HaFault] = []
    stack = (
        ha_stack(settings.workers, settings.time_scale, work_dir)
        if settings.cluster
        else fairq_up(settings, work_dir)
    )
    async with (
        stack as up,
        connected(
            server_urls(up.nats_url),
            name="chaos",
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.2,
        ) as nc,
    ):
        watch = Watch(nc, SUBJECTS, ENDPOINT, nc.new_inbox())
        await watch.start()
        began = time.monotonic()
        keys = await load(up, nc, watch, settings, faults, ha_faults)
        load_s = time.monotonic() - began
        await _until_answered(watch, keys, settings.finish_timeout_s)
        stored = await _stored(nc, keys)
        figures = verdict(watch, faults, keys, stored)
        if settings.cluster:
            figures["ha_faults"] = ha_figures(watch, ha_faults)
            figures["stale_batches"] = watch.stale_batches
    figures["load_s"] = load_s
    return figures


async def load(
    up: Any,
    nc: NATS,
    watch: Watch,
    settings: Settings,
    faults: list[Fault],
    ha_faults: list[HaFault],
) -> list[Key]:
    """The run's load, with the faults struck meanwhile (added to `faults` or, on the
    cluster, `ha_faults`); the keys of every request submitted."""
    # One generator each: the faults' timing (and the bursts sent before them, drawn with
    # the faults) must not shift the open loop's arrivals of a seed.
    rng, fault_rng = random.Random(settings.seed), random.Random(-settings.seed)
    js = nc.jetstream()
    if settings.saturate_s > 0:
        per_tenant = max(1, -(-settings.workers * 80 // settings.tenants))
        return await closed_loop(js, watch, settings, rng, per_tenant=per_tenant)
    burst_keys: list[Key] = []
    injector = asyncio.create_task(
        inject(
            up,
            nc,
            watch,
            list(settings.faults),
            settings.first_fault_s,
            settings.fault_gap_s,
            fault_rng,
            ha_faults,
            lambda: burst(js, watch, settings, fault_rng, burst_keys),
        )
        if settings.cluster
        else inject_faults(up, watch, settings, fault_rng, faults)
    )
    keys = await open_loop(js, watch, settings, rng)
    await injector
    return keys + burst_keys


async def _until_answered(watch: Watch, keys: list[Key], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(k not in watch.finals for k in keys):
        await asyncio.sleep(0.5)


async def _stored(nc, keys: list[Key]) -> dict[Key, wire_internal.StoredResult]:
    subjects = SUBJECTS
    bucket = subjects.results_bucket
    found: dict[Key, wire_internal.StoredResult] = {}
    async with DirectBatchGet(nc, jetstream.kv_stream(bucket)) as reader:
        for start in range(0, len(keys), LOOKUP_BATCH):
            chunk = {
                jetstream.kv_subject(bucket, subjects.result_key(*k)): k
                for k in keys[start : start + LOOKUP_BATCH]
            }
            for subject, data in (await reader.last(list(chunk))).items():
                found[chunk[subject]] = wire_internal.STORED_RESULT.decode(data)
    return found


def failures(figures: dict[str, Any], saturated: bool) -> list[str]:
    """The goals that failed: delivery always; no eviction at all when saturated."""
    failed = [
        name
        for name in (
            "lost",
            "two_different_results",
            "ran_twice_to_completion",
            "internal_elsewhere",
        )
        if figures[name]
    ]
    if figures["healthy_evictions"] or (saturated and figures["evictions"]):
        failed.append("evictions")
    if saturated and figures["redispatched"]:
        failed.append("redispatched")  # a healthy worker was thought lost
    return failed + ha_failures(figures.get("ha_faults", []))


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser("bench.chaos.run", __doc__)
    parser.add_argument("--smoke", action="store_true", help="500 requests, one fault of each kind")
    parser.add_argument(
        "--saturate",
        type=float,
        metavar="S",
        help="the false-kill run: no faults, every worker full for S seconds",
    )
    parser.add_argument(
        "--ha",
        action="store_true",
        help="the dispatchers' and the broker's faults (dispatcher kill -9, "
        "SIGSTOP, handover, node kill -9) on a 3-node cluster with two "
        "dispatchers (bench.chaos.ha)",
    )
    parser.add_argument(
        "--no-faults",
        action="store_true",
        help="the same load without faults: the baseline for the figures",
    )
    parser.add_argument(
        "--probe-stall",
        type=float,
        metavar="S",
        help="the dispatcher's probe_stall_s and probe_idle_s (default: its "
        "own); 0.05 probes a worker whenever a heartbeat shows no new "
        "token",
    )
    parser.add_argument("--requests", type=int)
    parser.add_argument("--tenants", type=int)
    parser.add_argument("--workers", type=int)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    return parser


def settings_from(args: argparse.Namespace) -> tuple[str, Settings]:
    if args.saturate is not None:
        name, settings = "saturated", replace(SATURATED, saturate_s=args.saturate)
        if args.probe_stall is not None:
            name = "saturated-probed"
    else:
        name, settings = ("smoke", SMOKE) if args.smoke else ("full", Settings())
        if args.ha:
            name, settings = f"ha-{name}", HA_SMOKE if args.smoke else HA
        if args.no_faults:
            name, settings = f"{name}-no-faults", replace(settings, faults=())
    return name, with_overrides(
        settings,
        {
            "requests": args.requests,
            "tenants": args.tenants,
            "workers": args.workers,
            "seed": args.seed,
            "probe_stall_s": args.probe_stall,
        },
    )


async def run_named(name: str, settings: Settings, out_dir: Path, command: str) -> dict[str, Any]:
    figures = await run(settings, out_dir / name)
    summary = {
        "name": name,
        "machine": machine_facts(command),
        "settings": asdict(settings),
        "figures": figures,
        "failed": failures(figures, saturated=settings.saturate_s > 0),
    }
    write_json(out_dir / f"{name}.json", summary, indent=2)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.ha and (args.saturate is not None or args.probe_stall is not None):
        parser.error(
            "--ha runs its own faults on a cluster; --saturate and --probe-stall "
            "are for the workers' runs"
        )
    name, settings = settings_from(args)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    summary = asyncio.run(
        run_named(name, settings, args.out_dir, command_line("bench.chaos.run", argv))
    )
    print(render(summary))
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
