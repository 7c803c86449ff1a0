"""Chaos: worker processes killed, stopped, hung and slowed under load, and what it costs.

    python -m bench.chaos [--smoke] [--requests 5000] [--tenants 20] [--workers 4] [--seed 1]
    python -m bench.chaos --saturate 300 [--workers 2]
    python -m bench.chaos --ha [--smoke] [--no-faults]

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

An observer (`bench.chaos_watch`) records batches, completions, heartbeats, evictions and
every final event. Reported: requests lost, with two different final results, with an
identical final event delivered again, run twice to completion; per fault the seconds
to detection, to all its requests re-dispatched (or ended with the retryable error), and
to a replacement process serving; evictions of workers that had no hang or stop.

`--saturate S` is the false-kill run instead: no faults, every worker kept full for S
seconds by closed-loop tenants with long prompts and long generations; any eviction
there is a false one. `--smoke`: 500 requests and one fault of each kind (CI).

`--ha` strikes the dispatchers and the broker instead (`bench.chaos_ha`: a 3-node
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
import contextlib
import json
import os
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import msgspec
import nats
import nats.errors

from bench.chaos_ha import HA_FAULTS, HaFault, ha_failures, ha_figures, ha_stack, inject
from bench.chaos_watch import Fault, Watch, render, verdict
from bench.machine import command_line, machine_facts, with_overrides
from bench.procstat import worker_pid
from bench.stack import ENDPOINT, benchmark_config
from broker_config import jetstream, wire
from broker_config.connection import server_urls
from broker_config.direct_get import DirectBatchGet
from broker_config.subjects import HDR_MSG_ID, HDR_REPLY, Subjects
from dispatcher.core.pool import Key
from producers.loadgen import tenant_names, zipf_weights

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "chaos"
FAULTS = ("kill", "stop", "hang", "slow")
SIGNALS = {
    "kill": signal.SIGKILL,
    "stop": signal.SIGSTOP,
    "hang": signal.SIGUSR1,
    "slow": signal.SIGUSR2,
}
UP_START_S = 90.0
UP_STOP_S = 90.0
SUBMIT_TRY_S = 2.0
SUBMIT_TIMEOUT_S = 60.0
LOOKUP_BATCH = 200
SUBJECTS = Subjects()  # the benchmark config's prefix
# After a fault, how long the observer gets to hear of batches sent just before it.
HELD_LAG_S = 0.5


@dataclass(frozen=True, slots=True)
class Settings:
    requests: int = 5_000
    tenants: int = 20
    workers: int = 4
    faults: tuple[str, ...] = FAULTS * 2
    rate_per_s: float = 25.0
    time_scale: float = 1.0
    max_tokens: int = 256  # the simulated engine draws a length in [1, max_tokens]
    first_fault_s: float = 8.0
    fault_gap_s: float = 20.0
    slow_for_s: float = 10.0
    finish_timeout_s: float = 180.0
    seed: int = 1
    # > 0: the false-kill run (no faults, every worker full for this many seconds).
    saturate_s: float = 0.0
    prompt_tokens: tuple[int, int] = (16, 512)  # uniform; the saturated run: long prefills
    # The dispatcher's probe_stall_s and probe_idle_s (None: the defaults); a tiny value
    # probes a worker at every heartbeat that reports no new token.
    probe_stall_s: float | None = None
    # The dispatchers' and the broker's faults (HA_FAULTS) run on `bench.chaos_ha`'s
    # stack: a 3-node cluster, two dispatchers, the workers.
    cluster: bool = False
    # Requests submitted at once just before each of those faults: they fill the
    # workers, so some wait in the dispatcher when it strikes.
    burst_before_fault: int = 0


SMOKE = Settings(requests=500, faults=FAULTS, rate_per_s=10.0, fault_gap_s=10.0)
HA = Settings(
    requests=3_000,
    workers=2,
    faults=HA_FAULTS * 2,
    rate_per_s=10.0,
    cluster=True,
    burst_before_fault=100,
)
HA_SMOKE = Settings(
    requests=1_000,
    workers=2,
    faults=HA_FAULTS,
    rate_per_s=10.0,
    fault_gap_s=8.0,
    cluster=True,
    burst_before_fault=100,
)
SATURATED = Settings(
    workers=2, faults=(), saturate_s=300.0, max_tokens=2048, prompt_tokens=(2_000, 8_000)
)


@dataclass(slots=True)
class Up:
    """A running `fairq up`: its process and what it printed."""

    process: asyncio.subprocess.Process
    nats_url: str
    log_dir: Path


@contextlib.asynccontextmanager
async def fairq_up(settings: Settings, work_dir: Path):
    config_path = work_dir / "fairq.toml"
    config = benchmark_config()
    if settings.probe_stall_s is not None:
        config = msgspec.structs.replace(
            config,
            dispatcher=msgspec.structs.replace(
                config.dispatcher,
                probe_stall_s=settings.probe_stall_s,
                probe_idle_s=settings.probe_stall_s,
            ),
        )
    config_path.write_bytes(msgspec.toml.encode(config))
    log_dir = work_dir / "logs"
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "producers.cli",
        "up",
        "--config",
        str(config_path),
        "--workers",
        str(settings.workers),
        "--time-scale",
        repr(settings.time_scale),
        "--metrics-port",
        "0",
        "--log-dir",
        str(log_dir),
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
    )
    output: list[str] = []
    drain = None
    try:
        nats_url = await _until_up(process, output)
        drain = asyncio.create_task(_drain_output(process, output))
        yield Up(process, nats_url, log_dir)
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGINT)
            try:
                await asyncio.wait_for(process.wait(), UP_STOP_S)
            except TimeoutError:
                os.killpg(process.pid, signal.SIGKILL)
                await process.wait()
        if drain is not None:
            drain.cancel()
        (work_dir / "fairq-up.log").write_text("\n".join(output))


async def _until_up(process: asyncio.subprocess.Process, output: list[str]) -> str:
    url = None
    async with asyncio.timeout(UP_START_S):
        while True:
            line = (await process.stdout.readline()).decode(errors="replace")
            if not line:
                raise RuntimeError("fairq up exited:\n" + "\n".join(output))
            output.append(line.rstrip())
            if line.startswith("NATS_URL="):
                url = line.strip().split("=", 1)[1]
            if line.startswith("fairq is up") and url:
                return url


async def _drain_output(process: asyncio.subprocess.Process, output: list[str]) -> None:
    async for line in process.stdout:
        output.append(line.decode(errors="replace").rstrip())


# -- load --------------------------------------------------------------------------------


def _body(rng: random.Random, settings: Settings) -> bytes:
    low, high = settings.prompt_tokens
    return json.dumps(
        {
            "prompt": "chaos",
            "input_tokens": rng.randint(low, high),
            "max_tokens": settings.max_tokens,
        }
    ).encode()


async def _submit(js, watch: Watch, key: Key, n: int, body: bytes) -> None:
    """Until the broker acknowledges it, as a client does while a cluster elects a new
    stream leader: the same message id, so a copy it stored already is not stored twice."""
    tenant, request_id = key
    headers = {HDR_MSG_ID: request_id, HDR_REPLY: watch.reply_for(key, n)}
    deadline = time.monotonic() + SUBMIT_TIMEOUT_S
    while True:
        try:
            await js.publish(
                SUBJECTS.request(ENDPOINT, tenant), body, headers=headers, timeout=SUBMIT_TRY_S
            )
            return
        except (nats.errors.Error, TimeoutError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def open_loop(js, watch: Watch, settings: Settings, rng: random.Random) -> list[Key]:
    """Poisson arrivals at `rate_per_s`, tenants by Zipf shares; every request submitted."""
    tenants = tenant_names(settings.tenants)
    weights = zipf_weights(settings.tenants, 1.1)
    keys, tasks = [], []
    start = time.monotonic()
    due = 0.0
    for n in range(settings.requests):
        due += rng.expovariate(settings.rate_per_s)
        await asyncio.sleep(max(0.0, start + due - time.monotonic()))
        key = (rng.choices(tenants, weights)[0], f"c{n}")
        keys.append(key)
        tasks.append(asyncio.create_task(_submit(js, watch, key, n, _body(rng, settings))))
    await asyncio.gather(*tasks)
    return keys


async def burst(js, watch: Watch, settings: Settings, rng: random.Random, keys: list[Key]) -> None:
    """`burst_before_fault` requests at once, from tenants by Zipf shares, added to
    `keys` (numbered after the open loop's)."""
    tenants = tenant_names(settings.tenants)
    weights = zipf_weights(settings.tenants, 1.1)
    sent = []
    for _ in range(settings.burst_before_fault):
        n = settings.requests + len(keys)
        keys.append((rng.choices(tenants, weights)[0], f"b{n}"))
        sent.append(_submit(js, watch, keys[-1], n, _body(rng, settings)))
    await asyncio.gather(*sent)


async def closed_loop(
    js, watch: Watch, settings: Settings, rng: random.Random, per_tenant: int
) -> list[Key]:
    """Each tenant keeps `per_tenant` requests in flight until `saturate_s` has passed."""
    keys: list[Key] = []
    counter = iter(range(10**9))
    stop_at = time.monotonic() + settings.saturate_s

    async def tenant(name: str) -> None:
        while time.monotonic() < stop_at:
            n = next(counter)
            key = (name, f"s{n}")
            keys.append(key)
            await _submit(js, watch, key, n, _body(rng, settings))
            given_up = time.monotonic() + settings.finish_timeout_s
            while key not in watch.finals and time.monotonic() < given_up:
                await asyncio.sleep(0.05)  # a request never answered counts as lost

    await asyncio.gather(
        *(tenant(name) for name in tenant_names(settings.tenants) for _ in range(per_tenant))
    )
    return keys


# -- faults ------------------------------------------------------------------------------


async def inject_faults(
    up: Up, watch: Watch, settings: Settings, rng: random.Random, faults: list[Fault]
) -> None:
    """The faults in a random order at random moments, each on a serving worker."""
    kinds = list(settings.faults)
    rng.shuffle(kinds)
    worker_ids = [f"{ENDPOINT}-w{n}" for n in range(1, settings.workers + 1)]
    await asyncio.sleep(settings.first_fault_s)
    for index, kind in enumerate(kinds):
        if index:
            await asyncio.sleep(settings.fault_gap_s * rng.uniform(0.5, 1.5))
        busy = {f.worker_id for f in faults if watch.current_run(f.worker_id) == f.started_at}
        candidates = [
            w
            for w in worker_ids
            if w not in busy
            and worker_pid(up.process.pid, w) is not None
            and watch.current_run(w) is not None
        ]
        if not candidates:
            print(f"chaos: {kind} skipped, no worker serving without a fault", flush=True)
            continue
        worker_id = rng.choice(candidates)
        pid = worker_pid(up.process.pid, worker_id)
        at = time.time()
        try:
            os.kill(pid, SIGNALS[kind])
        except (ProcessLookupError, TypeError):  # it exited since it was chosen
            print(f"chaos: {kind} skipped, {worker_id} exited meanwhile", flush=True)
            continue
        run = watch.current_run(worker_id)
        await asyncio.sleep(HELD_LAG_S)  # batches sent before `at` have been heard of
        fault = Fault(kind, worker_id, pid, run, at, watch.held_by(worker_id, at))
        faults.append(fault)
        print(f"chaos: {kind} {worker_id} (pid {pid}) holding {len(fault.held)}", flush=True)
        if kind == "slow":
            asyncio.get_running_loop().call_later(settings.slow_for_s, _unslow, pid)


def _unslow(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # replaced meanwhile: nothing to undo
        os.kill(pid, signal.SIGUSR2)


# -- the run -----------------------------------------------------------------------------


async def run(settings: Settings, work_dir: Path) -> dict[str, Any]:
    work_dir.mkdir(parents=True, exist_ok=True)
    # One generator each: the faults' timing (and the bursts sent before them, drawn with
    # the faults) must not shift the open loop's arrivals of a seed.
    rng, fault_rng = random.Random(settings.seed), random.Random(-settings.seed)
    faults: list[Fault] = []
    ha_faults: list[HaFault] = []
    stack = (
        ha_stack(settings.workers, settings.time_scale, work_dir)
        if settings.cluster
        else fairq_up(settings, work_dir)
    )
    async with stack as up:
        nc = await nats.connect(
            server_urls(up.nats_url),
            name="chaos",
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.2,
        )
        try:
            watch = Watch(nc, SUBJECTS, ENDPOINT, nc.new_inbox())
            await watch.start()
            js = nc.jetstream()
            began = time.monotonic()
            if settings.saturate_s > 0:
                keys = await closed_loop(
                    js,
                    watch,
                    settings,
                    rng,
                    per_tenant=max(1, -(-settings.workers * 80 // settings.tenants)),
                )
            else:
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
                keys += burst_keys
            load_s = time.monotonic() - began
            await _until_answered(watch, keys, settings.finish_timeout_s)
            stored = await _stored(nc, keys)
            figures = verdict(watch, faults, keys, stored)
            if settings.cluster:
                figures["ha_faults"] = ha_figures(watch, ha_faults)
                figures["stale_batches"] = watch.stale_batches
        finally:
            await nc.drain()
    figures["load_s"] = load_s
    return figures


async def _until_answered(watch: Watch, keys: list[Key], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(k not in watch.finals for k in keys):
        await asyncio.sleep(0.5)


async def _stored(nc, keys: list[Key]) -> dict[Key, wire.StoredResult]:
    subjects = SUBJECTS
    bucket = subjects.results_bucket
    found: dict[Key, wire.StoredResult] = {}
    async with DirectBatchGet(nc, jetstream.kv_stream(bucket)) as reader:
        for start in range(0, len(keys), LOOKUP_BATCH):
            chunk = {
                jetstream.kv_subject(bucket, subjects.result_key(*k)): k
                for k in keys[start : start + LOOKUP_BATCH]
            }
            for subject, data in (await reader.last(list(chunk))).items():
                found[chunk[subject]] = wire.STORED_RESULT.decode(data)
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
    parser = argparse.ArgumentParser(
        prog="python -m bench.chaos",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
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
        "dispatchers (bench.chaos_ha)",
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
    (out_dir / f"{name}.json").write_text(json.dumps(summary, indent=2, default=str))
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
        run_named(name, settings, args.out_dir, command_line("bench.chaos", argv))
    )
    print(render(summary))
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
