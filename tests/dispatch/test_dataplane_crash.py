"""kill -9 of the dispatcher with requests in flight, then a restart: nothing is lost and
no client sees two different results."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import msgspec
import nats
import nats.js.errors
import pytest

from broker_config.config import (
    EXAMPLE_ENGINE,
    BrokerSettings,
    DispatcherOptions,
    WorkerOptions,
    parse_config,
)
from broker_config.subjects import Subjects, shard_of
from broker_config.wire import ErrorCode, ErrorEvent
from broker_config.wire_internal import STORED_RESULT
from costmodel.engine_model import load_engine_params
from dispatcher.service import Dispatcher
from tests.local_stack import DELIVERY_CONFIG
from workers.service import WorkerService
from workers.sim_engine import SimEngine

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
REQUESTS = 500
FAST_HEARTBEATS = WorkerOptions(heartbeat_interval_s=0.2)


CONFIG = DELIVERY_CONFIG


def start_dispatcher(nats_url: str, config: Path, ack_wait_s: float = 2.0) -> subprocess.Popen:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dispatcher",
            "--nats",
            nats_url,
            "--config",
            str(config),
            "--ack-wait",
            str(ack_wait_s),
            "--grace",
            "1",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wait_for_line(process, "fairq dispatcher: running")  # provisioned, holds the lease
    return process


def wait_for_line(process: subprocess.Popen, wanted: str, lines: int = 50) -> list[str]:
    """Read the process's output until a line with `wanted` (log lines come first)."""
    seen = []
    for _ in range(lines):
        line = process.stdout.readline()
        seen.append(line)
        if wanted in line:
            return seen
        assert line, "".join(seen) + "(the process ended)"
    raise AssertionError("".join(seen))


async def test_kill_9_of_the_dispatcher_loses_nothing(nats_url, tmp_path):
    config = tmp_path / "fairq.toml"
    config.write_text(CONFIG)
    dispatcher = start_dispatcher(nats_url, config)
    try:
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        subjects = Subjects()
        results = await js.key_value(subjects.results_bucket)
        finals: dict[str, list[dict]] = defaultdict(list)

        async def on_event(msg):
            event = json.loads(msg.data)
            if event["type"] in ("done", "error"):
                finals[event["id"]].append(event)

        await nc.subscribe("_INBOX.crash.>", cb=on_event)
        params = load_engine_params(EXAMPLE_ENGINE)
        async with (
            SimEngine(params, time_scale=0.5, seed=1) as e1,
            SimEngine(params, time_scale=0.5, seed=2) as e2,
            WorkerService(
                nc,
                e1,
                endpoint="chat",
                worker_id="w1",
                subjects=subjects,
                results=results,
                settings=FAST_HEARTBEATS,
            ),
            WorkerService(
                nc,
                e2,
                endpoint="chat",
                worker_id="w2",
                subjects=subjects,
                results=results,
                settings=FAST_HEARTBEATS,
            ),
        ):
            for i in range(REQUESTS):
                tenant = ("acme", "globex", "initech")[i % 3]
                await js.publish(
                    f"fq.req.chat.{tenant}",
                    json.dumps({"prompt": f"request {i}", "max_tokens": 24}).encode(),
                    headers={"Nats-Msg-Id": f"c{i}", "Fq-Reply": f"_INBOX.crash.{i}"},
                )
            deadline = time.monotonic() + 20
            while len(finals) < 50:  # some done, most still queued or running
                assert time.monotonic() < deadline, "nothing finished before the kill"
                await asyncio.sleep(0.02)
            os.kill(dispatcher.pid, signal.SIGKILL)
            dispatcher.wait(timeout=10)
            assert len(finals) < REQUESTS, "everything finished before the kill"
            dispatcher = start_dispatcher(nats_url, config)
            deadline = time.monotonic() + 90
            while len(finals) < REQUESTS:
                assert time.monotonic() < deadline, f"only {len(finals)} of {REQUESTS} finished"
                await asyncio.sleep(0.1)
            await asyncio.sleep(3)  # anything running twice would answer within this
        assert set(finals) == {f"c{i}" for i in range(REQUESTS)}
        for rid, events in finals.items():
            distinct = {json.dumps(e, sort_keys=True) for e in events}
            assert len(distinct) == 1, (rid, events)  # one result, perhaps re-published
            assert events[0]["type"] == "done", events[0]
        stream = await js.stream_info(subjects.requests_stream)
        assert stream.state.messages == 0  # every request acked once finished
        await nc.drain()
    finally:
        dispatcher.send_signal(signal.SIGTERM)
        try:
            dispatcher.wait(timeout=15)
        except subprocess.TimeoutExpired:
            dispatcher.kill()


async def held_by_dispatcher(js, subjects: Subjects, tenant: str) -> int:
    """Messages delivered to the tenant's shard consumer and not yet acked (0 before the
    dispatcher has made it)."""
    shard = shard_of(tenant, BrokerSettings().intake_shards)
    try:
        info = await js.consumer_info(subjects.requests_stream, subjects.shard_consumer(shard))
    except nats.js.errors.NotFoundError:
        return 0
    return info.num_ack_pending


async def test_sigterm_drains_and_hands_queued_requests_back(nats_url, tmp_path):
    config = tmp_path / "fairq.toml"
    config.write_text(CONFIG)
    # A long ack wait: requests that come back quickly were handed back, not timed out.
    dispatcher = start_dispatcher(nats_url, config, ack_wait_s=60)  # no workers: all queue
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        subjects = Subjects()
        finals: dict[str, dict] = {}

        async def on_event(msg):
            event = json.loads(msg.data)
            if event["type"] in ("done", "error"):
                finals[event["id"]] = event

        await nc.subscribe("_INBOX.term.>", cb=on_event)
        for i in range(5):
            await js.publish(
                "fq.req.chat.acme",
                b'{"prompt":"wait","max_tokens":4}',
                headers={"Nats-Msg-Id": f"t{i}", "Fq-Reply": f"_INBOX.term.{i}"},
            )
        deadline = time.monotonic() + 10
        while await held_by_dispatcher(js, subjects, "acme") < 5:
            assert time.monotonic() < deadline, "the dispatcher never took the requests"
            await asyncio.sleep(0.05)
        dispatcher.send_signal(signal.SIGTERM)
        assert dispatcher.wait(timeout=15) == 0
        assert finals == {}  # nothing was answered: the requests were handed back
        dispatcher = start_dispatcher(nats_url, config, ack_wait_s=60)
        results = await js.key_value(subjects.results_bucket)
        engine = SimEngine(load_engine_params(EXAMPLE_ENGINE), time_scale=0.1)
        async with (
            engine,
            WorkerService(
                nc,
                engine,
                endpoint="chat",
                worker_id="w1",
                subjects=subjects,
                results=results,
                settings=FAST_HEARTBEATS,
            ),
        ):
            deadline = time.monotonic() + 20  # far below the 60 s ack wait
            while len(finals) < 5:
                assert time.monotonic() < deadline, f"only {sorted(finals)} came back"
                await asyncio.sleep(0.05)
        assert all(event["type"] == "done" for event in finals.values())
    finally:
        await nc.drain()
        dispatcher.send_signal(signal.SIGTERM)
        try:
            dispatcher.wait(timeout=15)
        except subprocess.TimeoutExpired:
            dispatcher.kill()


# A prompt of 32,000 tokens takes 4 s to prefill: its request streams nothing before then.
UNSTREAMED = b'{"prompt":"long","max_tokens":2000,"input_tokens":32000}'
STREAMING = b'{"prompt":"long","max_tokens":2000}'


async def stored(results, key: str, timeout: float = 5.0):
    """A result the dispatcher stores: the stores of a lost worker's streamed requests run
    concurrently, after the scheduler has let the requests go."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await results.get(key)
        except nats.js.errors.KeyNotFoundError:
            assert time.monotonic() < deadline, f"no result stored under {key}"
            await asyncio.sleep(0.05)


@pytest.mark.parametrize("streamed", [False, True], ids=["unstreamed", "streamed"])
async def test_requests_of_a_worker_that_drained_away_are_taken_back_at_once(nats_url, streamed):
    """A worker whose drain abandoned requests says so in its last heartbeat (unhealthy,
    nothing in flight): they are taken back at once, not after worker_timeout_s. Those
    that streamed nothing yet are queued again; those that streamed end with `internal`."""
    subjects = Subjects()
    options = DispatcherOptions(settle_s=0.2, tick_s=0.05, worker_timeout_s=30.0, grace_s=30.0)
    nc = await nats.connect(nats_url)
    ids = [f"d{i}" for i in range(3)]
    try:
        config = msgspec.structs.replace(parse_config(CONFIG), dispatcher=options)
        async with Dispatcher(nc, config) as dispatcher:
            scheduler = dispatcher.scheduler
            results = await nc.jetstream().key_value(subjects.results_bucket)
            engine = SimEngine(load_engine_params(EXAMPLE_ENGINE), time_scale=1.0)
            settings = WorkerOptions(heartbeat_interval_s=0.2, drain_timeout_s=0.1)
            async with (
                engine,
                WorkerService(
                    nc,
                    engine,
                    endpoint="chat",
                    worker_id="w1",
                    subjects=subjects,
                    results=results,
                    settings=settings,
                ),
            ):
                for rid in ids:
                    await nc.jetstream().publish(
                        "fq.req.chat.acme",
                        STREAMING if streamed else UNSTREAMED,
                        headers={"Nats-Msg-Id": rid},
                    )

                def started(rid: str) -> bool:
                    request = scheduler.running_request("acme", rid)
                    # Streamed: a heartbeat reported its output.
                    return request is not None and (request.output_charged > 0) == streamed

                deadline = time.monotonic() + 10
                while not all(started(rid) for rid in ids):
                    assert time.monotonic() < deadline, "the requests never started"
                    await asyncio.sleep(0.05)
            left = time.monotonic()  # the worker drained away, abandoning all three
            expected = None if streamed else "queued"
            while any((scheduler.state("acme", rid) or (None,))[0] != expected for rid in ids):
                assert time.monotonic() - left < 5.0, "not taken back within 5 s"
                await asyncio.sleep(0.05)
            if streamed:
                for rid in ids:
                    entry = await stored(results, subjects.result_key("acme", rid))
                    event = STORED_RESULT.decode(entry.value).event
                    assert isinstance(event, ErrorEvent), event
                    assert event.code is ErrorCode.INTERNAL
                    assert event.retry_after_s == options.lost_worker_retry_after_s
            stopping = time.monotonic()
        # Nothing runs any more, so the drain does not wait out its 30 s grace.
        assert time.monotonic() - stopping < 5.0
    finally:
        await nc.drain()
