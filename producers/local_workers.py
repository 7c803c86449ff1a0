"""`fairq up`'s simulated worker processes: how each is started (`WorkerLauncher`), the
wait for their first heartbeats, and the replacement of those the dispatcher holds
unhealthy (a stopped or wedged process never exits by itself)."""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from broker_config.config import EXAMPLE_ENGINE, Config
from dispatcher.ha.tenures import Tenures
from producers.supervisor import Backoff, Child, Supervisor, describe_exit

# Where `python -m workers` resolves to the same code as this process.
PACKAGE_ROOT = Path(__file__).resolve().parents[1]
WORKER_RESTART = Backoff(first_s=0.5, max_s=30.0, stable_s=10.0)
# A worker gets its drain timeout plus this to exit on SIGTERM before it is killed.
STOP_MARGIN_S = 5.0
# Bound on the workers' start: interpreter, imports, connection, first heartbeat.
START_TIMEOUT_S = 60.0
_POLL_S = 0.1
# A worker process gets this long after its start before being held unhealthy kills it
# (a new run is unhealthy in the pool until its first heartbeat).
REPLACE_GRACE_S = 15.0
REPLACE_CHECK_S = 1.0


class StartError(RuntimeError):
    """The system did not come up; the message says which part and why."""


@dataclass(frozen=True, slots=True)
class WorkerLauncher:
    """How `fairq up` runs a simulated worker: all but its endpoint and number. Adding,
    draining or replacing one is `Supervisor.add(launcher.child(ep, n))`, `.stop(id)`,
    `.replace(id)`."""

    nats_url: str
    config_path: Path
    time_scale: float
    log_dir: Path
    stop_timeout_s: float
    credentials: tuple[str, ...] = ()  # e.g. ("--nkey", seed file)

    def child(self, endpoint: str, n: int) -> Child:
        """Worker `<endpoint>-w<n>` (n from 1); engine seed n - 1, as in the test stack."""
        worker_id = f"{endpoint}-w{n}"
        argv = [
            sys.executable,
            "-m",
            "workers",
            "--nats",
            self.nats_url,
            "--endpoint",
            endpoint,
            "--worker-id",
            worker_id,
            "--config",
            str(self.config_path),
            "--engine",
            "sim",
            "--engine-config",
            str(EXAMPLE_ENGINE),
            "--time-scale",
            repr(self.time_scale),
            "--seed",
            str(n - 1),
            *self.credentials,
        ]
        return Child(
            worker_id,
            argv,
            self.log_dir / f"{worker_id}.log",
            cwd=PACKAGE_ROOT,
            stop_timeout_s=self.stop_timeout_s,
            restart=WORKER_RESTART,
        )


async def replace_unhealthy(tenures: Tenures, supervisor: Supervisor) -> None:
    """Kill the worker processes the dispatcher holds unhealthy, for their restart: a
    stopped or wedged process never exits by itself. Only while one dispatches: a
    standby's pool has heard no worker lately."""
    while True:
        await asyncio.sleep(REPLACE_CHECK_S)
        if not tenures.serving.is_set():
            continue
        for worker in list(tenures.current.pool):
            child = supervisor.children.get(worker.worker_id)
            if (
                child is None
                or worker.healthy
                or not child.running
                or time.monotonic() - child.started_at < REPLACE_GRACE_S
            ):
                continue
            why = (
                "evicted after failed health probes"
                if worker.evicted
                else "silent or unhealthy in its heartbeats"
            )
            supervisor.kill(worker.worker_id, f"the dispatcher holds it {why}")


async def until_serving(
    nc: NATS, config: Config, supervisor: Supervisor, stop: asyncio.Event, log_dir: Path
) -> None:
    """Until every worker has sent a heartbeat (connected, serving), or `stop` is set.
    Raises StartError if a worker exits first or the start takes too long."""
    waiting = set(supervisor.children)

    async def on_heartbeat(msg: Msg) -> None:
        waiting.discard(msg.subject.rsplit(".", 1)[1])  # <prefix>.int.hb.<endpoint>.<worker>

    subscriptions = [
        await nc.subscribe(config.subjects.heartbeats(endpoint), cb=on_heartbeat)
        for endpoint in config.endpoints
    ]
    try:
        async with asyncio.timeout(START_TIMEOUT_S):
            while waiting and not stop.is_set():
                for name in sorted(waiting):
                    child = supervisor.children[name]
                    if child.last_crash is not None:
                        raise StartError(
                            f"worker {name} {describe_exit(child.last_crash)} before it "
                            f"served; the end of {child.log_path}:\n{child.log_tail()}"
                        )
                await asyncio.sleep(_POLL_S)
    except TimeoutError:
        raise StartError(
            f"no heartbeat within {START_TIMEOUT_S:g}s from "
            f"{', '.join(sorted(waiting))}; their logs are in {log_dir}"
        ) from None
    finally:
        for subscription in subscriptions:
            await subscription.unsubscribe()
