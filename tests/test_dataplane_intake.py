"""Intake through per-tenant consumers, against a real nats-server: a deep backlog stays
in the stream and never delays another tenant; memory per tenant is bounded; a lone
tenant still fills the workers; odd subjects and deleted consumers strand nothing."""

from __future__ import annotations

import asyncio
import json
import time

import msgspec
import nats
import nats.js.errors
import pytest

from broker_config.config import (
    EXAMPLE_ENGINE,
    BrokerSettings,
    DispatcherOptions,
    WorkerOptions,
    load_config,
    parse_config,
)
from broker_config.streams import provision
from costmodel.engine_model import load_engine_params
from dispatcher.intake import TenantIntake
from dispatcher.service import Dispatcher
from tests.local_stack import LocalStack, StackOptions
from tests.wire_support import api, eventually

pytestmark = pytest.mark.integration

SUBJECTS = BrokerSettings().subjects
HOLD = DispatcherOptions(settle_s=3600.0, tick_s=0.05, tenant_window=16)  # never dispatches
FAST_HEARTBEATS = WorkerOptions(heartbeat_interval_s=0.2)
BODY = b'{"prompt":"hello","max_tokens":4}'


@pytest.fixture
async def client(nats_url):
    nc = await nats.connect(nats_url)
    yield nc
    await nc.drain()


async def publish_backlog(js, tenant: str, count: int, *, reply: str | None = None) -> None:
    for first in range(0, count, 500):
        await asyncio.gather(*(
            js.publish(SUBJECTS.request("chat", tenant), BODY,
                       headers={"Nats-Msg-Id": f"{tenant}-{i}",
                                **({"Fq-Reply": reply} if reply else {})})
            for i in range(first, min(count, first + 500))))


async def test_a_deep_backlog_does_not_delay_another_tenant(client):
    js = client.jetstream()
    await provision(js, BrokerSettings())
    await publish_backlog(js, "acme", 5_000)  # acme is listed in the example config
    await js.publish(SUBJECTS.request("chat", "newcomer"), BODY, headers={"Nats-Msg-Id": "n1"})
    started = time.monotonic()
    async with Dispatcher(client, msgspec.structs.replace(load_config(), dispatcher=HOLD)):
        async def newcomer_queued():
            reply = await api(client, SUBJECTS.status("newcomer"), {"id": "n1"})
            return reply["state"] == "queued"

        await eventually(newcomer_queued, what="the newcomer's request queued")
        waited = time.monotonic() - started
        # Behind 5,000 of acme's requests in the stream, yet found at once (the shared
        # consumer this replaced took 0.7 s to reach it, see docs/benchmarks.md).
        assert waited < 2.0, waited
        acme = await js.consumer_info(SUBJECTS.requests_stream, SUBJECTS.tenant_consumer("acme"))
        assert acme.num_ack_pending == HOLD.tenant_window  # the rest waits in the stream
        assert acme.num_pending == 5_000 - HOLD.tenant_window

        async def depth_counts_the_stream():
            rows = (await api(client, SUBJECTS.depth, {}))["queues"]
            return [r for r in rows if r["tenant"] == "acme" and r["queued"] == 5_000]

        await eventually(depth_counts_the_stream, what="depth reporting acme's whole backlog")


async def test_a_lone_tenant_runs_more_than_its_window(nats_url, client):
    engine = msgspec.structs.replace(load_engine_params(EXAMPLE_ENGINE), max_sequences=32)
    options = StackOptions(workers=1, endpoints=("chat",), time_scale=5.0, engine=engine,
                           workers_settings=FAST_HEARTBEATS,
                           dispatcher=DispatcherOptions(settle_s=0.2, tick_s=0.05,
                                                        tenant_window=4))
    async with LocalStack(load_config(), options, nats_url=nats_url):
        await publish_backlog(client.jetstream(), "acme", 40)

        async def running_of_acme():
            rows = (await api(client, SUBJECTS.depth, {}))["queues"]
            return sum(r["running"] for r in rows if r["tenant"] == "acme") > 4

        # Running requests do not count against the window: the worker's 32 slots fill.
        await eventually(running_of_acme, what="more of acme running than its window")


async def test_an_invalid_tenant_name_in_the_subject_is_answered(nats_url, client):
    async with LocalStack(load_config(), StackOptions(workers=0), nats_url=nats_url):
        inbox = client.new_inbox()
        sub = await client.subscribe(inbox)
        # A valid subject token, but not a valid tenant name (the contract allows
        # [A-Za-z0-9_-]): it still gets a consumer, so it is answered, not stranded.
        await client.jetstream().publish("fq.req.chat.bad$name", BODY,
                                         headers={"Nats-Msg-Id": "x1", "Fq-Reply": inbox})
        event = json.loads((await sub.next_msg(timeout=10)).data)
        assert (event["type"], event["code"]) == ("error", "invalid_request")
        assert (await client.jetstream().stream_info(SUBJECTS.requests_stream)
                ).state.messages == 0


async def test_a_deleted_consumer_is_made_again(nats_url, client):
    config = parse_config("""
[endpoints.chat]
cost = "request"
[[tiers]]
name = "all"
[unlisted_tenants]
policy = "admit"
tier = "all"
""")
    options = StackOptions(workers=1, endpoints=("chat",), time_scale=0.02,
                           workers_settings=FAST_HEARTBEATS,
                           dispatcher=DispatcherOptions(settle_s=0.2, tick_s=0.05))
    async with LocalStack(config, options, nats_url=nats_url):
        js = client.jetstream()
        inbox = client.new_inbox()
        sub = await client.subscribe(f"{inbox}.*")

        async def run_one(rid: str) -> dict:
            await js.publish(SUBJECTS.request("chat", "walker"), BODY,
                             headers={"Nats-Msg-Id": rid, "Fq-Reply": f"{inbox}.{rid}"})
            while True:
                event = json.loads((await sub.next_msg(timeout=15)).data)
                if event["type"] in ("done", "error"):
                    return event

        assert (await run_one("w1"))["type"] == "done"
        await js.delete_consumer(SUBJECTS.requests_stream, SUBJECTS.tenant_consumer("walker"))
        assert (await run_one("w2"))["type"] == "done"


async def test_an_idle_unlisted_tenant_is_retired_then_found_again(client):
    js = client.jetstream()
    await provision(js, BrokerSettings())
    handled: list[str] = []

    async def handler(batch):
        for msg in batch:
            handled.append(msg.headers["Nats-Msg-Id"])
            await msg.ack()

    async def publish(rid: str) -> None:
        await js.publish(SUBJECTS.request("chat", "walker"), BODY, headers={"Nats-Msg-Id": rid})

    async def consumer_gone() -> bool:
        try:
            await js.consumer_info(SUBJECTS.requests_stream, SUBJECTS.tenant_consumer("walker"))
        except nats.js.errors.NotFoundError:
            return True
        return False

    async with TenantIntake(client, SUBJECTS, handler=handler, queued=lambda tenant: 0,
                            listed=[], expires_s=0.5, discover_s=0.1, idle_s=1.0) as intake:
        await publish("w1")
        await eventually(lambda: asyncio.sleep(0, handled == ["w1"]), what="w1 handled")
        # Idle for idle_s: no more pulls, and the server drops the consumer on its own.
        await eventually(lambda: asyncio.sleep(0, "walker" not in intake.pulls),
                         what="walker retired")
        await eventually(consumer_gone, what="walker's consumer removed by the server")
        await publish("w2")
        await eventually(lambda: asyncio.sleep(0, handled == ["w1", "w2"]), what="w2 handled")


async def test_a_tenant_beyond_the_consumer_limit_waits_and_intake_keeps_going(client, caplog):
    js = client.jetstream()
    await provision(js, BrokerSettings(max_consumers=1))
    handled: list[str] = []

    async def handler(batch):
        for msg in batch:
            handled.append(msg.headers["Nats-Msg-Id"])
            await msg.ack()

    async def publish(tenant: str, rid: str) -> None:
        await js.publish(SUBJECTS.request("chat", tenant), BODY, headers={"Nats-Msg-Id": rid})

    async with TenantIntake(client, SUBJECTS, handler=handler, queued=lambda tenant: 0,
                            listed=["acme"], discover_s=0.05) as intake:
        await publish("stranger", "s1")  # no room for a second consumer
        await eventually(lambda: asyncio.sleep(0, "stranger" in intake._refused),
                         what="the stranger's consumer refused")
        assert "stranger" not in intake.pulls
        # Intake goes on: acme is served, and the refusal is logged once, not per listing.
        await publish("acme", "a1")
        await eventually(lambda: asyncio.sleep(0, handled == ["a1"]), what="a1 handled")
        await asyncio.sleep(0.5)  # ten more listings
        refusals = [r for r in caplog.records if "cannot make a consumer" in r.getMessage()]
        assert len(refusals) == 1
