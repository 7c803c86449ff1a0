"""Two dispatcher processes on one lease (dispatcher/ha/lease.py): a standby takes over
from one killed with -9, one paused past its lease is fenced off, a SIGTERM hands the
lease over at once, and a rolling restart of every part under load loses nothing.

Workers run in the test's process (so the test can restart them), fenced by the lease's
epoch as `python -m workers` is. Every request must end with exactly one final event
(a re-published identical one counts once), none may be run to completion twice (the
engines count), and none may be dispatched under two epochs: a request the old holder
had sent is adopted from the workers' heartbeats, not run again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import nats
import pytest

from broker_config.config import EXAMPLE_ENGINE, WorkerOptions
from broker_config.lease_key import LEASE_KEY, EpochWatch, LeaseRecord
from broker_config.subjects import HDR_CONTENT_TYPE, Subjects
from broker_config.wire import Encoding, Sampling, SubmitRequest, encode
from broker_config.wire_internal import BATCH, Batch, BatchItem
from costmodel.engine_model import load_engine_params
from tests.local_stack import DELIVERY_CONFIG, CountingEngine
from workers.engine import EngineRequest
from workers.service import WorkerService
from workers.sim_engine import SimEngine

# Alone (`solo`): the lease's 2 s TTL and the takeovers it times are wall-clock promises,
# and a rolling restart under four workers' load took 240 s where it takes 7 alone.
pytestmark = [pytest.mark.integration, pytest.mark.solo]
ROOT = Path(__file__).resolve().parents[2]
SUBJECTS = Subjects()
FAST_HEARTBEATS = WorkerOptions(heartbeat_interval_s=0.2, drain_timeout_s=10.0)

CONFIG = DELIVERY_CONFIG


class DispatcherProcess:
    """`python -m dispatcher`, its output read as it comes (a full pipe would stall it)."""

    def __init__(self, nats_url: str, config: Path, name: str) -> None:
        self.name = name
        self.nats_url = nats_url
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dispatcher",
                "--nats",
                nats_url,
                "--config",
                str(config),
                "--ack-wait",
                "60",
                "--grace",
                "5",
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line)

    def count(self, text: str) -> int:
        return sum(text in line for line in list(self.lines))

    async def wait_for(self, text: str, times: int = 1, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while self.count(text) < times:
            assert self.process.poll() is None or self.count(text) >= times, self.output()
            assert time.monotonic() < deadline, f"{self.name}: no {text!r}\n{self.output()}"
            await asyncio.sleep(0.02)

    def output(self) -> str:
        return "".join(self.lines[-40:])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


RUNNING = "fairq dispatcher: running"
STANDING_BY = "standing by"


@dataclass
class Observed:
    """Final events by request id, and under which epochs each request was dispatched,
    counting only batches a fenced worker takes (none older than the newest epoch)."""

    finals: dict[str, list[dict]] = field(default_factory=lambda: defaultdict(list))
    first_token: dict[str, float] = field(default_factory=dict)
    epochs: dict[str, set[int]] = field(default_factory=lambda: defaultdict(set))
    batches: list[tuple[float, int]] = field(default_factory=list)  # (time, epoch)
    fenced: int = 0  # batches of an older epoch than the fence has seen
    fence: EpochWatch | None = None  # as a worker's

    async def on_event(self, msg) -> None:
        event = json.loads(msg.data)
        if event["type"] in ("done", "error"):
            self.finals[event["id"]].append(event)
        elif event["id"] not in self.first_token:
            self.first_token[event["id"]] = time.monotonic()

    async def on_batch(self, msg) -> None:
        batch = BATCH.decode(msg.data, Encoding.MSGPACK)
        if not self.fence.admits(batch.epoch):
            self.fenced += 1
            return
        self.batches.append((time.monotonic(), batch.epoch))
        for item in batch.items:
            if not item.probe:
                self.epochs[item.id].add(batch.epoch)

    def check_exactly_once(self, ids: set[str], finished: Counter[str]) -> None:
        assert set(self.finals) == ids, sorted(ids - set(self.finals))[:10]
        twice = {key: runs for key, runs in finished.items() if runs > 1}
        assert not twice, twice  # no request ran to completion twice
        for rid, events in self.finals.items():
            distinct = {json.dumps(e, sort_keys=True) for e in events}
            assert len(distinct) == 1, (rid, events)  # one result, perhaps re-published
            assert events[0]["type"] == "done", events[0]
        twice = {rid: epochs for rid, epochs in self.epochs.items() if len(epochs) > 1}
        assert not twice, twice  # nothing an old holder sent was sent again

    async def all_done(self, ids: set[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ids <= set(self.finals):
            assert time.monotonic() < deadline, (
                f"{len(ids - set(self.finals))} of {len(ids)} unfinished"
            )
            await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def system(nats_url: str, tmp_path: Path):
    """Two dispatchers (the first holds the lease), two fenced workers, an observer."""
    config = tmp_path / "fairq.toml"
    config.write_text(CONFIG)
    first = DispatcherProcess(nats_url, config, "first")
    started = [first]
    nc = await nats.connect(nats_url)
    try:
        await first.wait_for(RUNNING)
        second = DispatcherProcess(nats_url, config, "second")
        started.append(second)
        await second.wait_for(STANDING_BY)
        js = nc.jetstream()
        fence = EpochWatch(js, SUBJECTS)
        observed = Observed(fence=fence)
        await nc.subscribe("_INBOX.ha.>", cb=observed.on_event)
        await nc.subscribe("fq.int.work.chat.*", cb=observed.on_batch)
        async with fence, Workers(nc) as workers:
            yield Parts(nc, js, first, second, observed, workers, config, started)
    finally:
        for process in started:
            process.stop()
        await nc.drain()


class Workers:
    """Two simulated workers in this process, each fenced by the lease's epoch."""

    def __init__(self, nc) -> None:
        self.nc = nc
        self.stacks: dict[str, contextlib.AsyncExitStack] = {}
        self.services: dict[str, WorkerService] = {}
        self.finished: Counter[str] = Counter()  # runs finished, per request key

    async def __aenter__(self) -> Workers:
        for worker_id in ("w1", "w2"):
            await self.start(worker_id)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        for worker_id in list(self.stacks):
            await self.stop(worker_id)

    async def start(self, worker_id: str) -> None:
        stack = contextlib.AsyncExitStack()
        js = self.nc.jetstream()
        results = await js.key_value(SUBJECTS.results_bucket)
        fence = await stack.enter_async_context(EpochWatch(js, SUBJECTS))
        engine = await stack.enter_async_context(
            CountingEngine(
                load_engine_params(EXAMPLE_ENGINE),
                time_scale=0.5,
                seed=len(self.stacks),
                finished=self.finished,
            )
        )
        self.services[worker_id] = await stack.enter_async_context(
            WorkerService(
                self.nc,
                engine,
                endpoint="chat",
                worker_id=worker_id,
                subjects=SUBJECTS,
                results=results,
                settings=FAST_HEARTBEATS,
                fence=fence,
            )
        )
        self.stacks[worker_id] = stack

    async def stop(self, worker_id: str) -> None:
        """A drain, as SIGTERM gives a worker process."""
        await self.stacks.pop(worker_id).aclose()


@dataclass
class Parts:
    nc: object
    js: object
    first: DispatcherProcess
    second: DispatcherProcess
    observed: Observed
    workers: Workers
    config: Path
    started: list[DispatcherProcess]

    async def publish(
        self,
        prefix: str,
        count: int,
        max_tokens: int = 24,
        tenants: tuple[str, ...] = ("acme", "globex", "initech"),
        into: set[str] | None = None,
    ) -> set[str]:
        """Publish `count` requests; each id is in `into` (or the result) before its
        publish, so a publish cut off by a cancel still counts."""
        ids = into if into is not None else set()
        for i in range(count):
            rid = f"{prefix}{i}"
            ids.add(rid)
            body = json.dumps({"prompt": f"request {rid}", "max_tokens": max_tokens})
            await self.js.publish(
                f"fq.req.chat.{tenants[i % len(tenants)]}",
                body.encode(),
                headers={"Nats-Msg-Id": rid, "Fq-Reply": f"_INBOX.ha.{rid}"},
            )
        return ids

    async def until_finished(self, count: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.observed.finals) < count:
            assert time.monotonic() < deadline, "too little finished"
            await asyncio.sleep(0.02)

    async def holder(self) -> LeaseRecord | None:
        kv = await self.js.key_value(SUBJECTS.leases_bucket)
        try:
            entry = await kv.get(LEASE_KEY)
        except nats.js.errors.NotFoundError:
            return None
        return msgspec.json.decode(entry.value, type=LeaseRecord)


def pid_of(record: LeaseRecord | None) -> int | None:
    return None if record is None else int(record.holder.split(":")[1])


@pytest.mark.timeout(180)
async def test_a_standby_takes_over_from_a_dispatcher_killed_with_9(nats_url, tmp_path):
    async with system(nats_url, tmp_path) as parts:
        ids = await parts.publish("k", 400)
        await parts.until_finished(40)
        assert pid_of(await parts.holder()) == parts.first.process.pid
        old_epoch = max(epoch for _, epoch in parts.observed.batches)
        os.kill(parts.first.process.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        parts.first.process.wait(timeout=10)
        assert len(parts.observed.finals) < len(ids), "everything finished before the kill"
        late = await parts.publish("late", 1, tenants=("newcomer",))
        await parts.second.wait_for(RUNNING, timeout=10)
        # New requests flow within 5 s of the kill.
        deadline = killed_at + 5.0
        while "late0" not in parts.observed.first_token:
            assert time.monotonic() < deadline, "no new request dispatched within 5 s"
            await asyncio.sleep(0.02)
        # What the dead one held comes back at once, not after the 60 s ack wait: all of
        # it is dispatched, and done, within 10 s (the workers have room for it).
        taken_over = [at for at, epoch in parts.observed.batches if epoch > old_epoch]
        assert taken_over and taken_over[0] - killed_at < 5.0
        unfinished = len(ids - set(parts.observed.finals))
        await parts.observed.all_done(ids | late, timeout=killed_at + 10.0 - time.monotonic())
        print(
            f"after the kill: first batch {taken_over[0] - killed_at:.2f} s, the new "
            f"request's first token {parts.observed.first_token['late0'] - killed_at:.2f} "
            f"s, {unfinished} unfinished then, all done "
            f"{time.monotonic() - killed_at:.2f} s"
        )
        await asyncio.sleep(2)  # anything run twice would answer within this
        parts.observed.check_exactly_once(ids | late, parts.workers.finished)
        assert pid_of(await parts.holder()) == parts.second.process.pid


async def long_output_seeds(tokens: int, count: int) -> list[int]:
    """Seeds for which LONG_PROMPT gives at least `tokens` output tokens on either test
    worker's engine (engine seeds 0 and 1): a seeded output is drawn from the prompt."""
    found = []
    async with SimEngine(time_scale=0, seed=0) as first, SimEngine(time_scale=0, seed=1) as second:
        for seed in range(400):
            lengths = []
            for engine in (first, second):
                request = EngineRequest(
                    f"probe-{seed}",
                    LONG_MAX_TOKENS,
                    prompt=LONG_PROMPT,
                    sampling=Sampling(seed=seed),
                )
                *_, final = [delta async for delta in engine.generate(request)]
                lengths.append(final.output_tokens)
            if min(lengths) >= tokens:
                found.append(seed)
                if len(found) == count:
                    return found
    raise AssertionError(f"fewer than {count} seeds below 400 give {tokens} tokens")


LONG_PROMPT = "a long story"
LONG_MAX_TOKENS = 2000


@pytest.mark.timeout(180)
async def test_a_dispatcher_paused_past_its_lease_is_fenced_off(nats_url, tmp_path):
    async with system(nats_url, tmp_path) as parts:
        # Still streaming when the paused dispatcher wakes (1,200 tokens take over 14 s
        # here): it must not end them as if their workers were lost; they are the new
        # holder's now.
        ids = set()
        for seed in await long_output_seeds(1200, 4):
            rid = f"long{seed}"
            ids.add(rid)
            body = {
                "prompt": LONG_PROMPT,
                "max_tokens": LONG_MAX_TOKENS,
                "sampling": {"seed": seed},
            }
            await parts.js.publish(
                "fq.req.chat.acme",
                json.dumps(body).encode(),
                headers={"Nats-Msg-Id": rid, "Fq-Reply": f"_INBOX.ha.{rid}"},
            )
        ids |= await parts.publish("p", 300)
        await parts.until_finished(30)
        longs = {rid for rid in ids if rid.startswith("long")}
        await until(lambda: longs <= set(parts.observed.first_token), timeout=30)
        await asyncio.sleep(1.0)  # heartbeats tell the dispatcher they streamed output
        old_epoch = max(epoch for _, epoch in parts.observed.batches)
        parts.first.process.send_signal(signal.SIGSTOP)
        paused_at = time.monotonic()
        await parts.second.wait_for(RUNNING, timeout=10)
        ids |= await parts.publish("q", 100)
        # A batch the paused process had in its socket's buffer, delivered as it wakes:
        # the workers refuse it, having seen the new epoch.
        await until(lambda: parts.workers.services["w1"]._fence.epoch > old_epoch)
        stale = Batch(
            worker_id="w1",
            endpoint="chat",
            sent_at=time.time(),
            epoch=old_epoch,
            items=[
                BatchItem(
                    id="stale",
                    tenant="acme",
                    endpoint="chat",
                    request=SubmitRequest(prompt="x", max_tokens=4),
                    max_tokens=4,
                    enqueued_at=time.time(),
                    dispatched_at=time.time(),
                )
            ],
        )
        await parts.nc.publish(
            SUBJECTS.work("chat", "w1"),
            encode(stale, Encoding.MSGPACK),
            headers={HDR_CONTENT_TYPE: Encoding.MSGPACK.content_type},
        )
        # Paused past the dispatcher's worker timeout (5 s): on waking, it has heard no
        # worker for longer than that.
        await asyncio.sleep(max(0.0, paused_at + 6.5 - time.monotonic()))
        parts.first.process.send_signal(signal.SIGCONT)
        await parts.first.wait_for("lost the lease", timeout=10)
        await parts.first.wait_for(STANDING_BY, timeout=20)  # and stands by again
        await parts.observed.all_done(ids, timeout=60)
        await asyncio.sleep(2)
        stale_key = SUBJECTS.result_key("acme", "stale")
        assert stale_key not in parts.workers.services["w1"].in_flight
        results = await parts.js.key_value(SUBJECTS.results_bucket)
        with pytest.raises(nats.js.errors.NotFoundError):
            await results.get(stale_key)  # it never ran
        assert parts.workers.services["w1"].fenced >= 1  # the worker refused the stale one
        assert max(epoch for _, epoch in parts.observed.batches) > old_epoch
        parts.observed.check_exactly_once(ids, parts.workers.finished)


@pytest.mark.timeout(180)
async def test_sigterm_hands_the_lease_over_within_a_second_and_loses_nothing(nats_url, tmp_path):
    async with system(nats_url, tmp_path) as parts:
        ids = await parts.publish("t", 300)
        await parts.until_finished(30)
        parts.first.process.send_signal(signal.SIGTERM)
        signalled_at = time.monotonic()
        while pid_of(await parts.holder()) != parts.second.process.pid:
            assert time.monotonic() - signalled_at < 1.0, "the lease was not handed over"
            await asyncio.sleep(0.01)
        assert await asyncio.to_thread(parts.first.process.wait, 20) == 0
        await parts.observed.all_done(ids, timeout=60)
        await asyncio.sleep(2)
        parts.observed.check_exactly_once(ids, parts.workers.finished)


@pytest.mark.timeout(240)
async def test_a_rolling_restart_of_every_part_under_load_loses_nothing(nats_url, tmp_path):
    async with system(nats_url, tmp_path) as parts:
        ids = await parts.publish("r", 200)
        load = asyncio.create_task(steady_load(parts, ids))
        try:
            await parts.until_finished(20)
            # Dispatchers: the holder hands over, comes back as a standby; then the other.
            for _ in range(2):
                old, standby = parts.first, parts.second
                took_over = standby.count(RUNNING) + 1
                old.process.send_signal(signal.SIGTERM)
                await standby.wait_for(RUNNING, times=took_over, timeout=10)
                assert await asyncio.to_thread(old.process.wait, 30) == 0
                fresh = DispatcherProcess(old.nats_url, parts.config, old.name)
                parts.started.append(fresh)
                await fresh.wait_for(STANDING_BY)
                parts.first, parts.second = standby, fresh
            # Workers, one at a time: each drains, then a fresh run takes its place.
            for worker_id in ("w1", "w2"):
                await parts.workers.stop(worker_id)
                await parts.workers.start(worker_id)
        finally:
            load.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await load
        await parts.observed.all_done(ids, timeout=90)
        await asyncio.sleep(2)
        parts.observed.check_exactly_once(ids, parts.workers.finished)


async def steady_load(parts: Parts, ids: set[str]) -> None:
    """Ten requests every 0.2 s until cancelled (their ids added to `ids`)."""
    for wave in range(10_000):
        await parts.publish(f"s{wave}-", 10, into=ids)
        await asyncio.sleep(0.2)


async def until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
