"""The dashboard and the queue and replica gauges of a dispatcher on a real nats-server,
read over HTTP as a browser or Prometheus does: figures as they are now, even after
nobody looked for a while; samples for idle endpoints and for replicas without
autoscaling."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
import nats
import pytest
from prometheus_client.parser import text_string_to_metric_families

from broker_config.config import DispatcherOptions, WorkerOptions, load_config
from broker_config.subjects import Subjects
from dispatcher.api.http import HttpApi
from dispatcher.observe.dashboard import FRESH_S, Snapshot
from dispatcher.observe.metrics import DispatcherMetrics
from tests.local_stack import LocalStack, StackOptions
from tests.wire_support import eventually
from workers.sim_engine import SimEngine

pytestmark = pytest.mark.integration

S = Subjects()
WAIT_S = 15.0
# Nobody reads for this long (longer than WATCHED_S plus FRESH_S; issue 44's figure).
UNWATCHED_S = 15.0


@dataclass
class Running:
    stack: LocalStack
    port: int

    def get(self, path: str) -> bytes:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as answer:
            return answer.read()

    async def dashboard(self) -> Snapshot:
        """A read from another thread, as the HTTP server's are: the loop stays free."""
        return msgspec.json.decode(
            await asyncio.to_thread(self.get, "/dashboard.json"), type=Snapshot
        )

    async def samples(self) -> dict[tuple[str, tuple], float]:
        text = (await asyncio.to_thread(self.get, "/metrics")).decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    async def submit(self, tenant: str, count: int) -> None:
        nc = await nats.connect(self.stack.nats_url)
        js = nc.jetstream()
        for n in range(count):
            await js.publish(
                S.request("chat", tenant),
                json.dumps({"prompt": "hello", "max_tokens": 4}).encode(),
                headers={"Nats-Msg-Id": f"{tenant}-{n}"},
            )
        await nc.drain()


@pytest.fixture
async def running(nats_url: str) -> AsyncIterator[Running]:
    """One chat worker whose engine hangs, so what starts keeps running and the rest stays
    queued: five sequence slots, one kept for probes and one held back as the newcomer
    reserve, three for acme. No worker for embed."""
    engine = msgspec.structs.replace(SimEngine().params, max_sequences=5)
    metrics = DispatcherMetrics(["chat", "embed"])
    http = HttpApi(metrics)
    port = http.serve(0)
    options = StackOptions(
        workers=1,
        endpoints=("chat",),
        engine=engine,
        dispatcher=DispatcherOptions(
            settle_s=0.2, tick_s=0.05, grace_s=0.0, probe_stall_s=3600.0, probe_idle_s=3600.0
        ),
        workers_settings=WorkerOptions(heartbeat_interval_s=0.2, drain_timeout_s=0.0),
    )
    try:
        async with LocalStack(load_config(), options, nats_url=nats_url, metrics=metrics) as stack:
            stack.engines[0].faults.hang = True
            yield Running(stack, port)
            stack.engines[0].faults.hang = False
    finally:
        http.close()


async def test_a_read_after_nobody_watched_shows_the_queues_as_they_are_now(
    running: Running,
) -> None:
    """The snapshot used to be built only while someone had read it lately: the first
    read showed the zero snapshot made at start, and the first after a pause the figures
    of before it."""
    first = await running.dashboard()
    assert abs(first.at - time.time()) <= FRESH_S
    assert first.endpoints[0].figures.queued == 0
    submitted = time.time()
    await running.submit("acme", 10)
    await asyncio.sleep(UNWATCHED_S)
    view = await running.dashboard()
    assert abs(view.at - time.time()) <= FRESH_S
    chat = view.endpoints[0]
    assert (chat.figures.name, chat.figures.queued, chat.figures.running) == ("chat", 7, 3)
    (enterprise,) = chat.tiers
    (acme,) = enterprise.tenants
    assert acme.oldest_wait_s is not None
    assert UNWATCHED_S - 1.0 <= acme.oldest_wait_s <= time.time() - submitted
    assert acme.admitted_per_s == 0.0  # the burst is older than the rate window


async def test_idle_endpoints_and_replicas_without_autoscaling_have_samples(
    running: Running,
) -> None:
    chat, embed = (("endpoint", "chat"),), (("endpoint", "embed"),)
    idle = (("tenant", ""), ("tier", ""))

    async def exported():
        values = await running.samples()
        wanted = [("fairq_serving_replicas", chat), ("fairq_queue_depth", embed + idle)]
        return values if all(key in values for key in wanted) else None

    values = await eventually(exported, timeout=WAIT_S, what="the gauges")
    # Not autoscaled: the healthy workers it has are the ones it wants.
    assert values[("fairq_serving_replicas", chat)] == 1
    assert values[("fairq_desired_replicas", chat)] == 1
    assert values[("fairq_serving_replicas", embed)] == 0
    assert values[("fairq_desired_replicas", embed)] == 0
    for endpoint in (chat, embed):
        assert values[("fairq_queue_depth", endpoint + idle)] == 0
        assert values[("fairq_running", endpoint + idle)] == 0
    await running.submit("acme", 5)
    acme = chat + (("tenant", "acme"), ("tier", "enterprise"))

    async def busy():
        values = await running.samples()
        return values if values.get(("fairq_running", acme)) == 3 else None

    values = await eventually(busy, timeout=WAIT_S, what="acme running")
    assert values[("fairq_queue_depth", acme)] == 2
    # The idle sample is the idle endpoint's alone.
    assert ("fairq_queue_depth", chat + idle) not in values
    assert values[("fairq_queue_depth", embed + idle)] == 0
