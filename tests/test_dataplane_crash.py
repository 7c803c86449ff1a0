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

import nats
import pytest

from broker_config.subjects import Subjects
from costmodel.engine_model import load_engine_params
from dispatcher.local import ENGINE_CONFIG
from workers.service import WorkerService
from workers.sim_engine import SimEngine

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
REQUESTS = 500


# The example's endpoint and tenants without rate limits: this test is about delivery.
CONFIG = """
[profiles.p]
name = "p"
alpha = 0.000125
beta = 0.025
capacity_mu_per_s = 30.0
[endpoints.chat]
profile = "p"
cost = "model_units"
quantum = 8.0
latency_target_s = 600.0
[[tiers]]
name = "all"
[unlisted_tenants]
policy = "admit"
tier = "all"
"""


def start_dispatcher(nats_url: str, config: Path) -> subprocess.Popen:
    process = subprocess.Popen(
        [sys.executable, "-m", "dispatcher", "--nats", nats_url, "--config", str(config),
         "--ack-wait", "2", "--grace", "1"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    line = process.stdout.readline()  # "running" once provisioned and subscribed
    assert "running" in line, line + process.stdout.read()
    return process


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
        params = load_engine_params(ENGINE_CONFIG)
        async with SimEngine(params, time_scale=0.5, seed=1) as e1, \
                SimEngine(params, time_scale=0.5, seed=2) as e2, \
                WorkerService(nc, e1, endpoint="chat", worker_id="w1", subjects=subjects,
                              results=results, heartbeat_interval_s=0.2), \
                WorkerService(nc, e2, endpoint="chat", worker_id="w2", subjects=subjects,
                              results=results, heartbeat_interval_s=0.2):
            for i in range(REQUESTS):
                tenant = ("acme", "globex", "initech")[i % 3]
                await js.publish(f"fq.req.chat.{tenant}",
                                 json.dumps({"prompt": f"request {i}", "max_tokens": 24}).encode(),
                                 headers={"Nats-Msg-Id": f"c{i}",
                                          "Fq-Reply": f"_INBOX.crash.{i}"})
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
