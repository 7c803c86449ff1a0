"""Chaos for the dispatchers and the broker: the active dispatcher killed, paused and
stopped, and a broker node killed, under load (`python -m bench.chaos.run --ha`).

The stack is a deployment's: a 3-node NATS cluster (`EmbeddedNatsCluster`, every stream
and bucket at 3 replicas), two `python -m dispatcher` processes on one lease and
`--workers` simulated worker processes, all under a `Supervisor` that restarts what
exits (as Kubernetes or systemd would). The load and the observer are
`bench.chaos.load`'s and `bench.chaos.watch`'s. The faults, each at a random moment after
the one before has been undone and the backlog it left has drained:

- `dispatcher-kill`: SIGKILL of the lease holder (restarted: it stands by);
- `dispatcher-stop`: SIGSTOP of the lease holder for `STOPPED_FOR_S` (several lease
  TTLs), then SIGCONT: it wakes up without its lease, and workers refuse what it sends;
- `handover`: SIGTERM of the lease holder (a planned restart: it hands the lease over);
- `node-kill`: SIGKILL of the node that leads the requests stream, started again
  `NODE_DOWN_S` later.

Per fault: seconds to the first batch of a new lease holder, to the first dispatch of a
request submitted after the fault, and to the dispatch of every request that was
waiting (submitted, not yet dispatched) when it struck; how many requests were running
then, and how many of those were sent to a worker again (the goal: none).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from bench.chaos.watch import Watch
from bench.harness.paths import REPO
from bench.harness.stack import ENDPOINT, benchmark_config
from broker_config.cluster import EmbeddedNatsCluster
from broker_config.config import Config
from broker_config.connection import server_urls
from broker_config.lease_key import LEASE_KEY, LeaseRecord, epoch_of
from broker_config.subjects import Subjects
from dispatcher.core.pool import Key
from producers.local_workers import WorkerLauncher
from producers.supervisor import Backoff, Child, Supervisor

HA_FAULTS = ("dispatcher-kill", "dispatcher-stop", "handover", "node-kill")
DISPATCHERS = 2
DISPATCHER_RESTART = Backoff(first_s=0.5, max_s=5.0, stable_s=10.0)
STOPPED_FOR_S = 6.0  # three lease TTLs (2 s by default)
NODE_DOWN_S = 15.0
BURST_SETTLE_S = 0.5  # the dispatcher has pulled the burst, and sent what fits
# Before each burst the backlog an earlier fault left drains to about a second of load:
# each fault then strikes with its own burst waiting, not with every earlier one's, so
# what its waiting requests take measures the recovery, not a backlog compounding.
DRAINED_TO = 10
DRAIN_TIMEOUT_S = 120.0
START_TIMEOUT_S = 90.0
# A request's first dispatch after the fault within this many seconds, per the issue.
NEW_REQUESTS_GOAL_S = 5.0
# What waited when the holder died is dispatched within half the 60 s ack wait: the
# failure this catches is waiting it out. Not the 10 s: under a backlog those
# requests wait for room on the workers as every other does (the 10 s with room is
# tests/ha/test_dataplane_ha.py's); the figures say how long they took.
WAITING_GOAL_S = 30.0
STANDING_BY = "standing by: another dispatcher holds the lease"
# The faults after which a new lease holder must serve (a node kill may keep the holder).
HOLDER_FAULTS = frozenset({"dispatcher-kill", "dispatcher-stop", "handover"})


@dataclass(slots=True)
class HaFault:
    kind: str
    target: str  # the dispatcher's lease holder id, or the node's server name
    at: float
    epoch: int  # the lease's epoch when it struck
    waiting: set[Key]  # submitted, neither dispatched nor ended
    running: set[Key]  # dispatched, not ended


@dataclass(slots=True)
class HaStack:
    cluster: EmbeddedNatsCluster
    supervisor: Supervisor
    config: Config

    @property
    def nats_url(self) -> str:
        return self.cluster.url


def cluster_config() -> Config:
    config = benchmark_config()
    return msgspec.structs.replace(
        config, broker=msgspec.structs.replace(config.broker, replicas=3)
    )


@contextlib.asynccontextmanager
async def ha_stack(workers: int, time_scale: float, work_dir: Path) -> AsyncIterator[HaStack]:
    """The cluster, the dispatchers (the first holding the lease before the second
    starts, so which is active is known) and the workers, each serving."""
    config = cluster_config()
    config_path = work_dir / "fairq.toml"
    config_path.write_bytes(msgspec.toml.encode(config))
    log_dir = work_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work_dir / "nats", ignore_errors=True)  # an earlier run's requests
    async with (
        EmbeddedNatsCluster(3, store_root=work_dir / "nats") as cluster,
        Supervisor(on_event=lambda line: print(f"chaos: {line}", flush=True)) as supervisor,
    ):
        nc = await nats.connect(server_urls(cluster.url), max_reconnect_attempts=-1)
        try:
            for n in range(1, DISPATCHERS + 1):
                name = f"dispatcher-{n}"
                await supervisor.add(
                    Child(
                        name,
                        [
                            sys.executable,
                            "-m",
                            "dispatcher",
                            "--nats",
                            cluster.url,
                            "--config",
                            str(config_path),
                        ],
                        log_dir / f"{name}.log",
                        cwd=REPO,
                        restart=DISPATCHER_RESTART,
                    )
                )
                await _until(
                    lambda: _ready(nc.jetstream(), config.subjects, [supervisor.children[name]]),  # noqa: B023 - awaited here
                    f"{name} holding the lease" if n == 1 else f"{name} standing by",
                    supervisor,
                )
            launcher = WorkerLauncher(
                cluster.url,
                config_path,
                time_scale,
                log_dir,
                stop_timeout_s=config.workers.drain_timeout_s + 5,
            )
            for n in range(1, workers + 1):
                await supervisor.add(launcher.child(ENDPOINT, n))
            beating: set[str] = set()

            async def on_heartbeat(msg: Msg) -> None:
                beating.add(msg.subject.rsplit(".", 1)[1])

            subscription = await nc.subscribe(config.subjects.heartbeats(ENDPOINT), cb=on_heartbeat)

            async def all_beating() -> bool:
                return len(beating) == workers

            await _until(all_beating, "every worker heartbeating", supervisor)
            await subscription.unsubscribe()
        finally:
            await nc.close()
        yield HaStack(cluster, supervisor, config)


async def _until(check: Any, what: str, supervisor: Supervisor) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not await check():
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {c.name}\n{c.log_tail()}" for c in supervisor.children.values())
            raise RuntimeError(f"no {what} within {START_TIMEOUT_S:g}s\n{logs}")
        await asyncio.sleep(0.1)


async def _ready(js: JetStreamContext, subjects: Subjects, dispatchers: list[Child]) -> bool:
    """Whether each of `dispatchers` runs and holds the lease, or stands by while another
    does (none is still draining after a handover, or restarting): a fault then has a
    standby to hand over to."""
    try:
        record, _ = await lease_holder(js, subjects)
    except (TimeoutError, nats.errors.Error):
        return False
    return record is not None and all(
        c.running and (c.pid == holder_pid(record) or _last_lease_line(c).endswith(STANDING_BY))
        for c in dispatchers
    )


async def _all_ready(js: JetStreamContext, stack: HaStack) -> bool:
    return await _ready(
        js,
        stack.config.subjects,
        [c for name, c in stack.supervisor.children.items() if name.startswith("dispatcher-")],
    )


def _last_lease_line(dispatcher: Child) -> str:
    """The last thing its log says about the lease (an earlier process's, if this one
    said nothing yet)."""
    lines = [line for line in dispatcher.log_tail(200).splitlines() if " fairq.lease " in line]
    return lines[-1] if lines else ""


async def lease_holder(js: JetStreamContext, subjects: Subjects) -> tuple[LeaseRecord | None, int]:
    """The lease record and its epoch; (None, 0) while nobody holds it."""
    try:
        kv = await js.key_value(subjects.leases_bucket)
        entry = await kv.get(LEASE_KEY)
    except nats.js.errors.NotFoundError:
        return None, 0
    if not entry.value:
        return None, 0
    return msgspec.json.decode(entry.value, type=LeaseRecord), epoch_of(entry.value, entry.revision)


def holder_pid(record: LeaseRecord) -> int:
    return int(record.holder.split(":")[1])  # dispatcher.ha.lease.holder_id: host:pid:nonce


async def inject(
    stack: HaStack,
    nc: NATS,
    watch: Watch,
    kinds: list[str],
    first_s: float,
    gap_s: float,
    rng: random.Random,
    faults: list[HaFault],
    burst: Callable[[], Awaitable[None]],
) -> None:
    """The faults in a random order, the next `gap_s` x U(0.5, 1.5) after the last was
    undone, once its backlog drained, each just after `burst()` has filled the workers
    and left requests waiting in the dispatcher. `nc` is the observer's connection: its
    node is not killed."""
    js = nc.jetstream()
    kinds = list(kinds)
    rng.shuffle(kinds)
    await asyncio.sleep(first_s)
    for index, kind in enumerate(kinds):
        if index:
            await asyncio.sleep(gap_s * rng.uniform(0.5, 1.5))
        await _until(lambda: _all_ready(js, stack), "every dispatcher back", stack.supervisor)
        await _drained(watch)
        await burst()
        await asyncio.sleep(BURST_SETTLE_S)
        record, epoch = await _retrying(lambda: lease_holder(js, stack.config.subjects))
        at = time.time()
        waiting, running = watch.waiting(at), watch.running(at)
        if kind == "node-kill":
            leader = await _stream_leader_away_from(
                nc, stack.cluster, stack.config.subjects.requests_stream
            )
            target = leader
            node = stack.cluster.node(leader)
            await asyncio.to_thread(node.kill)
        else:
            if record is None:
                print(f"chaos: {kind} skipped, nobody holds the lease", flush=True)
                continue
            target = record.holder
            os.kill(
                holder_pid(record),
                {
                    "dispatcher-kill": signal.SIGKILL,
                    "dispatcher-stop": signal.SIGSTOP,
                    "handover": signal.SIGTERM,
                }[kind],
            )
        faults.append(HaFault(kind, target, at, epoch, waiting, running))
        print(
            f"chaos: {kind} {target} (epoch {epoch}): {len(waiting)} waiting, "
            f"{len(running)} running",
            flush=True,
        )
        if kind == "dispatcher-stop":
            await asyncio.sleep(STOPPED_FOR_S)
            with contextlib.suppress(ProcessLookupError):
                os.kill(holder_pid(record), signal.SIGCONT)
        elif kind == "node-kill":
            await asyncio.sleep(NODE_DOWN_S)
            await asyncio.to_thread(node.start)


async def _drained(watch: Watch) -> None:
    """Until at most `DRAINED_TO` requests wait; past `DRAIN_TIMEOUT_S` the fault strikes
    anyway (its row then counts the backlog it met among its waiting requests)."""
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while len(watch.waiting(time.time())) > DRAINED_TO and time.monotonic() < deadline:
        await asyncio.sleep(0.5)


async def _retrying(call: Any, timeout_s: float = 30.0) -> Any:
    """`call()` until the broker answers (a leader election makes it fail for a while)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await call()
        except (TimeoutError, nats.errors.Error):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def _stream_leader_away_from(nc: NATS, cluster: EmbeddedNatsCluster, stream: str) -> str:
    """The node leading `stream`, moved off the node `nc` is connected to first: the
    observer would miss what is said while it reconnects."""
    js = nc.jetstream()
    for _ in range(10):
        info = await _retrying(lambda: js.stream_info(stream))
        leader = info.cluster.leader if info.cluster else None
        if leader and cluster.node(leader).port != nc.connected_url.port:
            return leader
        if leader:
            with contextlib.suppress(nats.errors.Error):
                await nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", b"", timeout=5)
        await asyncio.sleep(1.0)
    raise RuntimeError(f"stream {stream} has no leader away from the observer's node")


def ha_figures(watch: Watch, faults: list[HaFault]) -> list[dict[str, Any]]:
    """Per fault: seconds to a new holder's first batch, to the first request submitted
    after it being dispatched, to every waiting request dispatched; running requests
    sent to a worker again."""
    rows = []
    for fault, until in zip(faults, [f.at for f in faults[1:]] + [float("inf")]):
        # What happened before the next fault.
        new_epochs = [
            at
            for epoch, at in watch.epoch_first_batch.items()
            if epoch > fault.epoch and fault.at < at < until
        ]
        later = [
            first - fault.at
            for key, sent in watch.submitted_at.items()
            if fault.at < sent < until
            for first in [_first_dispatch(watch, key, fault.at)]
            if first is not None
        ]
        waited = [_waited(watch, key, fault.at) for key in fault.waiting]
        rows.append(
            {
                "kind": fault.kind,
                "target": fault.target,
                "at_s": fault.at,
                "epoch": fault.epoch,
                "new_holder_s": min(new_epochs) - fault.at if new_epochs else None,
                "new_request_dispatched_s": min(later) if later else None,
                "waiting": len(fault.waiting),
                "waiting_dispatched_s": max(waited) if waited else None,
                "running": len(fault.running),
                "running_sent_again": sum(
                    1 for key in fault.running if _first_dispatch(watch, key, fault.at) is not None
                ),
            }
        )
    return rows


def _first_dispatch(watch: Watch, key: Key, after: float) -> float | None:
    return min((d.at for d in watch.dispatches.get(key, ()) if d.at > after), default=None)


def _waited(watch: Watch, key: Key, at: float) -> float:
    """Seconds from `at` to the request's dispatch, or to its end without one."""
    first = _first_dispatch(watch, key, at)
    if first is None:
        first = watch.final_at.get(key, float("inf"))
    return first - at


def ha_failures(rows: list[dict[str, Any]]) -> list[str]:
    """The goals a fault missed: new requests flowing within 5 s of a dispatcher fault,
    waiting ones within 30 s, nothing running started again."""
    failed = []
    for row in rows:
        kind = row["kind"]
        if kind in HOLDER_FAULTS and not _within(
            row["new_request_dispatched_s"], NEW_REQUESTS_GOAL_S
        ):
            failed.append(f"{kind}: new requests")
        if (
            kind in HOLDER_FAULTS
            and row["waiting"]
            and not _within(row["waiting_dispatched_s"], WAITING_GOAL_S)
        ):
            failed.append(f"{kind}: waiting requests")
        if row["running_sent_again"]:
            failed.append(f"{kind}: running requests sent again")
    return failed


def _within(value: float | None, bound: float) -> bool:
    return value is not None and value <= bound
