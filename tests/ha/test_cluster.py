"""A 3-node NATS cluster (broker_config/cluster.py) with every stream and bucket at 3
replicas: kill -9 of one node, the requests stream's leader, under load costs no
request, runs none twice to completion, and every part reconnects on its own."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import nats
import nats.errors
import pytest

from broker_config.cluster import EmbeddedNatsCluster
from broker_config.config import EXAMPLE_ENGINE, BrokerSettings, WorkerOptions
from broker_config.connection import server_urls
from broker_config.jetstream import kv_stream
from broker_config.lease_key import EpochWatch, ensure_leases_bucket
from broker_config.streams import (
    apply_key_value,
    apply_stream,
    requests_stream_config,
    results_bucket_config,
)
from broker_config.subjects import Subjects
from costmodel.engine_model import load_engine_params
from tests.local_stack import DELIVERY_CONFIG, CountingEngine
from workers.service import WorkerService

# Alone (`solo`): elections and reconnections are timed by the wall clock.
pytestmark = [pytest.mark.integration, pytest.mark.solo]
ROOT = Path(__file__).resolve().parents[2]
SUBJECTS = Subjects()
# An ack sent while the stream's leader is being elected is lost; its request is then
# redelivered after the ack wait and answered from its stored result (not run again).
ACK_WAIT_S = 10.0

CONFIG = "[broker]\nreplicas = 3\n" + DELIVERY_CONFIG


def start_dispatcher(url: str, config: Path) -> tuple[subprocess.Popen, list[str]]:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dispatcher",
            "--nats",
            url,
            "--config",
            str(config),
            "--grace",
            "5",
            "--ack-wait",
            str(ACK_WAIT_S),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True).start()
    return process, lines


async def publish(js, rid: str, tenant: str, timeout: float = 60.0) -> None:
    """Until the cluster acknowledges it (a leader election makes publishes fail for a
    while): the same message id, so a retry the stream stored already is not stored
    again within its window, and the dispatcher de-duplicates by id beyond it."""
    body = json.dumps({"prompt": f"request {rid}", "max_tokens": 16}).encode()
    deadline = time.monotonic() + timeout
    while True:
        try:
            await js.publish(f"fq.req.chat.{tenant}", body, timeout=2, headers={"Nats-Msg-Id": rid})
            return
        except (TimeoutError, nats.errors.Error):
            assert time.monotonic() < deadline, f"{rid} was never acknowledged"
            await asyncio.sleep(0.2)


@pytest.mark.timeout(300)
async def test_killing_the_stream_leaders_node_under_load_costs_no_request(tmp_path):
    config = tmp_path / "fairq.toml"
    config.write_text(CONFIG)
    async with EmbeddedNatsCluster(3) as cluster:
        dispatcher, output = start_dispatcher(cluster.url, config)
        nc = await nats.connect(
            server_urls(cluster.url), max_reconnect_attempts=-1, reconnect_time_wait=0.2
        )
        finished: Counter = Counter()
        try:
            deadline = time.monotonic() + 30
            while not any("fairq dispatcher: running" in line for line in output):
                assert dispatcher.poll() is None and time.monotonic() < deadline, output
                await asyncio.sleep(0.05)
            js = nc.jetstream()
            results = await js.key_value(SUBJECTS.results_bucket)
            params = load_engine_params(EXAMPLE_ENGINE)
            async with (
                EpochWatch(js, SUBJECTS) as fence,
                CountingEngine(params, time_scale=0.5, seed=1, finished=finished) as e1,
                CountingEngine(params, time_scale=0.5, seed=2, finished=finished) as e2,
                WorkerService(
                    nc,
                    e1,
                    endpoint="chat",
                    worker_id="w1",
                    subjects=SUBJECTS,
                    results=results,
                    fence=fence,
                    settings=WorkerOptions(heartbeat_interval_s=0.2),
                ),
                WorkerService(
                    nc,
                    e2,
                    endpoint="chat",
                    worker_id="w2",
                    subjects=SUBJECTS,
                    results=results,
                    fence=fence,
                    settings=WorkerOptions(heartbeat_interval_s=0.2),
                ),
            ):
                ids = []
                for i in range(600):
                    rid = f"c{i}"
                    await publish(js, rid, ("acme", "globex", "initech")[i % 3])
                    ids.append(rid)
                    if i == 200:
                        info = await js.stream_info(SUBJECTS.requests_stream)
                        assert info.config.num_replicas == 3
                        leader = info.cluster.leader
                        await asyncio.to_thread(cluster.node(leader).kill)
                        killed_at = time.monotonic()
                    await asyncio.sleep(0.005)
                deadline = time.monotonic() + 120
                missing = set(ids)
                while missing:
                    assert time.monotonic() < deadline, (
                        f"{len(missing)} have no result\n" + "".join(output[-60:])
                    )
                    for rid in list(missing):
                        key = SUBJECTS.result_key(
                            ("acme", "globex", "initech")[int(rid[1:]) % 3], rid
                        )
                        try:
                            entry = await results.get(key)
                        except nats.js.errors.NotFoundError:
                            continue
                        event = json.loads(entry.value)["event"]
                        assert event["type"] == "done", event
                        missing.discard(rid)
                    await asyncio.sleep(0.2)
            results_at = time.monotonic()
            assert dispatcher.poll() is None, "".join(output[-30:])
            twice = {rid: n for rid, n in finished.items() if n > 1}
            assert not twice, (twice, "".join(output[-80:]))
            # Every request acked once finished (none stranded in the stream).
            deadline = time.monotonic() + 3 * ACK_WAIT_S
            while left := (await js.stream_info(SUBJECTS.requests_stream)).state.messages:
                assert time.monotonic() < deadline, f"{left} requests left in the stream"
                await asyncio.sleep(0.2)
            print(
                f"every result stored {results_at - killed_at:.1f} s after the kill, "
                f"the stream empty {time.monotonic() - killed_at:.1f} s after it"
            )
        finally:
            dispatcher.terminate()
            try:
                await asyncio.to_thread(dispatcher.wait, 20)
            finally:
                (tmp_path / "dispatcher.log").write_text("".join(output))
                dispatcher.kill()
                await nc.close()


async def test_a_part_given_a_one_replica_config_does_not_thin_out_the_cluster(tmp_path):
    """A standby started with the default file (1 replica) provisions the requests stream
    and the buckets too: their copies stay at 3; fewer is an operator's decision."""
    async with EmbeddedNatsCluster(3, store_root=tmp_path / "nats") as cluster:
        nc = await nats.connect(server_urls(cluster.url))
        try:
            js = nc.jetstream()
            await apply_stream(js, requests_stream_config(BrokerSettings(replicas=3)))
            info = await apply_stream(js, requests_stream_config(BrokerSettings()))
            assert info.config.num_replicas == 3
            assert (await js.stream_info(SUBJECTS.requests_stream)).config.num_replicas == 3
            # A bucket made with one copy gets three once a part's config says so.
            await apply_key_value(js, results_bucket_config(BrokerSettings()))
            await apply_key_value(js, results_bucket_config(BrokerSettings(replicas=3)))
            info = await js.stream_info(kv_stream(SUBJECTS.results_bucket))
            assert info.config.num_replicas == 3
            await apply_key_value(js, results_bucket_config(BrokerSettings()))
            info = await js.stream_info(kv_stream(SUBJECTS.results_bucket))
            assert info.config.num_replicas == 3
            # The leases bucket too, keeping its TTL.
            await ensure_leases_bucket(js, BrokerSettings(), 4.0)
            _, ttl_s = await ensure_leases_bucket(js, BrokerSettings(replicas=3), 2.0)
            info = await js.stream_info(kv_stream(SUBJECTS.leases_bucket))
            assert info.config.num_replicas == 3 and ttl_s == info.config.max_age == 4.0
        finally:
            await nc.close()
