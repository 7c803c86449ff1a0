"""The noisy neighbour through the real stack: NATS, dispatcher, simulated workers.

The naive baseline (a shared JetStream work queue pulled in FIFO order, which this
scenario defeats) runs in tests/test_bench_smoke.py, with each part in its own process."""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid

import nats
import pytest

from broker_config.config import DispatcherOptions, WorkerOptions, load_config
from dispatcher.core.fairness import percentile
from dispatcher.core.sim import scheduling_only
from tests.local_stack import LocalStack, StackOptions

pytestmark = pytest.mark.integration

TIME_SCALE = 0.1  # simulated engine time runs ten times faster than a real GPU's
SMALL = ("B", "C", "D", "E")
SMALL_RATE = 2.0  # requests per second per small tenant: "a few per second"
SMALL_REQUESTS = 20


async def run(nats_url: str, *, noisy: bool) -> list[float]:
    """B's times to first token (seconds, client view) in one scenario."""
    # Short drains: what is still running when B is measured need not finish.
    options = StackOptions(workers=1, endpoints=("chat",), time_scale=TIME_SCALE,
                           workers_settings=WorkerOptions(heartbeat_interval_s=0.2,
                                                          drain_timeout_s=0.5),
                           dispatcher=DispatcherOptions(settle_s=0.3, tick_s=0.05,
                                                        grace_s=0.5))
    run_id = uuid.uuid4().hex[:8]  # results of earlier runs stay stored under their ids
    config = scheduling_only(load_config())  # rate limits and throttle out of the way
    async with LocalStack(config, options, nats_url=nats_url):
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        published: dict[str, float] = {}
        first_token: dict[str, float] = {}
        finished = asyncio.Event()

        async def on_event(msg):
            event = json.loads(msg.data)
            if event["id"] not in first_token and event["type"] in ("token", "done"):
                first_token[event["id"]] = time.monotonic()
            if event["type"] == "error":
                raise AssertionError(event)
            b_done = sum(1 for rid in first_token if rid.startswith(f"B-{run_id}-"))
            if b_done == SMALL_REQUESTS:
                finished.set()

        await nc.subscribe("_INBOX.noisy.>", cb=on_event)

        async def publish(tenant: str, rid: str, max_tokens: int, reply: bool = True) -> None:
            body = json.dumps({"prompt": "tell me a story " * 8, "max_tokens": max_tokens})
            headers = {"Nats-Msg-Id": rid}
            if reply:
                headers["Fq-Reply"] = f"_INBOX.noisy.{rid}"
            published[rid] = time.monotonic()
            await js.publish(f"fq.req.chat.{tenant}", body.encode(), headers=headers)

        if noisy:
            # A's answers are stored for later collection (no Fq-Reply): this test process
            # plays every part on 2 cores and need not also receive A's token stream.
            await asyncio.gather(*(publish("A", f"A-{run_id}-{i}", 200, reply=False)
                                   for i in range(2000)))

        async def small_tenant(tenant: str, seed: int) -> None:
            rng = random.Random(seed)
            for i in range(SMALL_REQUESTS):
                await asyncio.sleep(rng.expovariate(SMALL_RATE))
                await publish(tenant, f"{tenant}-{run_id}-{i}", 64)

        tenants = SMALL if noisy else ("B",)
        await asyncio.gather(*(small_tenant(t, n) for n, t in enumerate(tenants)))
        await asyncio.wait_for(finished.wait(), timeout=120)
        await nc.drain()
    return [first_token[f"B-{run_id}-{i}"] - published[f"B-{run_id}-{i}"]
            for i in range(SMALL_REQUESTS)]


async def test_small_tenant_keeps_its_latency_next_to_a_flood(nats_url):
    alone = percentile(await run(nats_url, noisy=False), 95)
    fairq = percentile(await run(nats_url, noisy=True), 95)
    print(f"B p95 TTFT: alone {alone * 1000:.1f} ms, with a 2,000-request flood "
          f"{fairq * 1000:.1f} ms")
    assert fairq <= 1.5 * alone + 0.050
