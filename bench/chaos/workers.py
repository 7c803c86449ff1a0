"""The worker processes' faults of a chaos run: the stack a user runs (`fairq up`:
embedded nats-server, the dispatcher, simulated worker processes under its supervisor)
and the faults struck on its workers: SIGKILL, SIGSTOP, the simulated engine's hang
(SIGUSR1) and slow steps (SIGUSR2)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec

from bench.chaos.settings import Settings
from bench.chaos.watch import Fault, Watch
from bench.harness.paths import REPO
from bench.harness.procstat import worker_pid
from bench.harness.stack import ENDPOINT, benchmark_config

SIGNALS = {
    "kill": signal.SIGKILL,
    "stop": signal.SIGSTOP,
    "hang": signal.SIGUSR1,
    "slow": signal.SIGUSR2,
}
UP_START_S = 90.0
UP_STOP_S = 90.0
# After a fault, how long the observer gets to hear of batches sent just before it.
HELD_LAG_S = 0.5


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
