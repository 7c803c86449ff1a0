"""The data plane end to end: real nats-server, dispatcher, workers on the simulated
engine; clients are plain nats-py, exactly as the wire contract says."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import msgspec
import nats
import pytest

from broker_config.config import (
    EXAMPLE_ENGINE,
    BrokerSettings,
    DispatcherOptions,
    WorkerOptions,
    load_config,
    parse_config,
)
from broker_config.limits import InputLimits
from costmodel.engine_model import load_engine_params
from dispatcher.api.http import HttpApi
from tests.local_stack import LocalStack, StackOptions
from tests.wire_support import api, image_b64

pytestmark = pytest.mark.integration

FAST = DispatcherOptions(settle_s=0.2, tick_s=0.05, worker_timeout_s=3.0, grace_s=5.0)


def stack_options(**overrides) -> StackOptions:
    values = dict(
        workers=1,
        endpoints=("chat",),
        time_scale=0.02,
        workers_settings=WorkerOptions(heartbeat_interval_s=0.2),
        dispatcher=FAST,
    )
    values.update(overrides)
    return StackOptions(**values)


async def collect(sub, timeout: float = 10.0) -> list[dict]:
    """Events on one reply subscription until the final one, decoded per Content-Type."""
    events = []
    deadline = time.monotonic() + timeout
    while True:
        msg = await sub.next_msg(timeout=max(0.01, deadline - time.monotonic()))
        if (msg.headers or {}).get("Content-Type") == "application/msgpack":
            event = msgspec.msgpack.decode(msg.data)
        else:
            event = json.loads(msg.data)
        events.append(event)
        if event["type"] in ("done", "error"):
            return events


async def submit(
    nc,
    endpoint: str,
    tenant: str,
    body: dict | bytes,
    *,
    rid: str | None = None,
    reply: bool = True,
    msgpack: bool = False,
):
    rid = rid or uuid.uuid4().hex
    headers = {"Nats-Msg-Id": rid}
    sub = None
    if reply:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        headers["Fq-Reply"] = inbox
    if isinstance(body, dict):
        if msgpack:
            headers["Content-Type"] = "application/msgpack"
            data = msgspec.msgpack.encode(body)
        else:
            data = json.dumps(body).encode()
    else:
        data = body
    await nc.jetstream().publish(f"fq.req.{endpoint}.{tenant}", data, headers=headers)
    return rid, sub


@pytest.fixture
async def stack(nats_url):
    async with LocalStack(load_config(), stack_options(), nats_url=nats_url) as running:
        yield running


@pytest.fixture
async def client(nats_url):
    nc = await nats.connect(nats_url)
    yield nc
    await nc.drain()


@pytest.mark.parametrize("msgpack", [False, True], ids=["json", "msgpack"])
async def test_request_streams_ordered_tokens_and_a_done_event(stack, client, msgpack):
    rid, sub = await submit(
        client,
        "chat",
        "acme",
        {"prompt": "hello there", "max_tokens": 12, "metadata": {"trace": "t1"}},
        msgpack=msgpack,
    )
    events = await collect(sub)
    tokens, done = events[:-1], events[-1]
    assert done["type"] == "done", done
    assert [t["seq"] for t in tokens] == list(range(len(tokens)))
    assert all(t["type"] == "token" and t["id"] == rid for t in tokens)
    assert done["id"] == rid and done["seq"] == len(tokens)
    assert done["text"] == "".join(t["text"] for t in tokens)
    assert set(done["usage"]) == {"input_tokens", "output_tokens", "model_units", "engine_s"}
    assert done["usage"]["output_tokens"] == len(tokens) >= 1
    assert done["usage"]["input_tokens"] >= 1 and done["usage"]["model_units"] > 0
    assert set(done["timings"]) == {"queued_s", "ttft_s", "total_s"}
    assert (
        0 <= done["timings"]["queued_s"] <= done["timings"]["ttft_s"] <= done["timings"]["total_s"]
    )
    assert done["metadata"] == {"trace": "t1"}


async def test_a_request_without_reply_is_collected_with_status(stack, client):
    rid, _ = await submit(
        client, "chat", "globex", {"prompt": "later", "max_tokens": 5}, reply=False
    )
    deadline = time.monotonic() + 10
    while True:
        status = await api(client, "fq.api.status.globex", {"id": rid})
        if status["state"] == "done":
            break
        assert status["state"] in ("queued", "running", "unknown")
        assert time.monotonic() < deadline, status
        await asyncio.sleep(0.05)
    assert status["result"]["type"] == "done" and status["result"]["id"] == rid
    other = await api(client, "fq.api.status.acme", {"id": rid})  # ids are per tenant
    assert other["state"] == "unknown"
    depth = await api(client, "fq.api.depth", {})
    globex = [q for q in depth["queues"] if q["tenant"] == "globex"]
    assert globex == [
        {
            "endpoint": "chat",
            "tier": "standard",
            "tenant": "globex",
            "queued": 0,
            "running": 0,
            "oldest_wait_s": 0.0,
            "admitted": 1,
            "rejected": 0,
        }
    ]


async def test_cancel_a_running_and_a_queued_request(nats_url, client):
    # One sequence slot: the first request runs (slowly), the second waits in the queue.
    engine = load_engine_config_one_slot()
    options = stack_options(time_scale=1.0, engine=engine)
    async with LocalStack(load_config(), options, nats_url=nats_url):
        running_id, running_sub = await submit(
            client, "chat", "acme", {"prompt": "long", "max_tokens": 1000}
        )
        queued_id, queued_sub = await submit(
            client, "chat", "acme", {"prompt": "next", "max_tokens": 10}
        )
        await wait_for_state(client, "acme", running_id, "running")
        assert (await api(client, "fq.api.status.acme", {"id": queued_id}))["state"] == "queued"
        for rid in (queued_id, running_id):
            reply = await api(client, "fq.api.cancel.acme", {"id": rid})
            assert reply == {"id": rid, "cancelled": True}
        for sub in (queued_sub, running_sub):
            final = (await collect(sub))[-1]
            assert final["type"] == "error" and final["code"] == "cancelled"
        assert (await api(client, "fq.api.cancel.acme", {"id": "nope"}))["cancelled"] is False


def load_engine_config_one_slot():
    return msgspec.structs.replace(load_engine_params(EXAMPLE_ENGINE), max_sequences=1)


async def wait_for_state(client, tenant: str, rid: str, state: str, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        # Each call may take what is left of the wait: a starved machine answers late,
        # or `internal` (retryable) when the broker did not answer the dispatcher.
        reply = await api(
            client, f"fq.api.status.{tenant}", {"id": rid}, max(1.0, deadline - time.monotonic())
        )
        if reply.get("type") == "error":
            assert reply["code"] == "internal" and reply["retry_after_s"], reply
        elif reply["state"] == state:
            return
        assert time.monotonic() < deadline, f"{rid} never became {state}: {reply}"
        await asyncio.sleep(0.05)


ERROR_CONFIG = """
[profiles.p]
name = "p"
alpha = 0.000125
beta = 0.025
capacity_mu_per_s = 30.0
[endpoints.chat]
profile = "p"
cost = "model_units"
latency_target_s = 1.0
max_tokens_cap = 64
[[tiers]]
name = "gold"
limits = { rpm = 60, rpm_burst = 1 }
[[tiers]]
name = "quota"
limits = { monthly_quota_tokens = 100 }
[[tiers]]
name = "slow"
[tenants.limited]
tier = "gold"
[tenants.quota]
tier = "quota"
[tenants.busy]
tier = "slow"
[tenants.ok]
tier = "slow"
[unlisted_tenants]
policy = "reject"
"""


async def test_every_error_code_comes_from_its_bad_input(nats_url, client):
    config = parse_config(ERROR_CONFIG)
    # One sequence slot, so a burst queues in the dispatcher and the throttle sees it.
    options = stack_options(time_scale=0.05, engine=load_engine_config_one_slot())
    async with LocalStack(config, options, nats_url=nats_url):

        async def error_of(endpoint, tenant, body, **kw):
            _, sub = await submit(client, endpoint, tenant, body, **kw)
            final = (await collect(sub))[-1]
            assert final["type"] == "error", final
            return final

        ok = {"prompt": "x", "max_tokens": 4}
        assert (await error_of("chat", "ok", b"{not json"))["code"] == "invalid_request"
        unknown_field = await error_of("chat", "ok", {**ok, "colour": "red"})
        assert unknown_field["code"] == "invalid_request" and "colour" in unknown_field["message"]
        both = await error_of("chat", "ok", {**ok, "messages": [{"role": "user", "content": "y"}]})
        assert both["code"] == "invalid_request"
        mismatch = await error_of("chat", "ok", {**ok, "id": "other-id"}, rid="this-id")
        assert mismatch["code"] == "invalid_request"
        assert (await error_of("embed", "ok", ok))["code"] == "unknown_endpoint"
        assert (await error_of("chat", "stranger", ok))["code"] == "unknown_tenant"
        assert (await error_of("chat", "ok", {**ok, "deadline": time.time() - 5}))[
            "code"
        ] == "deadline_exceeded"
        _, first = await submit(client, "chat", "limited", ok)
        assert (await collect(first))[-1]["type"] == "done"
        limited = await error_of("chat", "limited", ok)
        assert limited["code"] == "rate_limited" and limited["retry_after_s"] > 0
        big = {"prompt": "x" * 200, "max_tokens": 64}
        assert (await error_of("chat", "quota", big))["code"] == "quota_exceeded"
        # Overloaded: latency target 1 s at 30 mu/s; each request is ~0.8 mu queued.
        subs = [
            (await submit(client, "chat", "busy", {"prompt": "x", "max_tokens": 64}))[1]
            for _ in range(80)
        ]
        finals = [(await collect(sub, timeout=60))[-1] for sub in subs]
        overloaded = [f for f in finals if f["type"] == "error"]
        assert overloaded and all(
            f["code"] == "overloaded" and f["retry_after_s"] > 0 for f in overloaded
        )
        # And it keeps serving.
        _, after = await submit(client, "chat", "ok", ok)
        assert (await collect(after))[-1]["type"] == "done"


@pytest.mark.parametrize("token", ["*", ">"])
async def test_a_wildcard_as_the_tenant_token_is_answered_and_leaves_nothing_behind(
    stack, client, token
):
    """The broker stores a request published on `fq.req.chat.*` (a literal wildcard as
    the tenant token); it must get its error like any bad input, not be taken for every
    tenant (a consumer filter, the depth listing) or stay in the stream."""
    _, sub = await submit(client, "chat", token, {"prompt": "x", "max_tokens": 4})
    final = (await collect(sub))[-1]
    assert final["type"] == "error" and final["code"] == "invalid_request", final
    assert "invalid tenant" in final["message"]
    _, valid = await submit(client, "chat", "acme", {"prompt": "x", "max_tokens": 4})
    assert (await collect(valid))[-1]["type"] == "done"
    js = client.jetstream()
    deadline = time.monotonic() + 10.0
    while True:  # the depth API reflects the stream as of its last listing
        depth = await api(client, "fq.api.depth", {})
        stored = (
            await js.stream_info(stack.config.subjects.requests_stream, subjects_filter=">")
        ).state
        if not stored.messages and all(q["tenant"] != token for q in depth["queues"]):
            break
        assert time.monotonic() < deadline, (depth, stored.subjects)
        await asyncio.sleep(0.1)


async def test_a_request_over_an_input_limit_is_answered_and_the_rest_still_run(nats_url, client):
    limits = InputLimits(max_images=1, max_prompt_chars=100, max_image_pixels=63)
    options = stack_options(dispatcher=msgspec.structs.replace(FAST, input=limits))
    image = image_b64()
    async with LocalStack(load_config(), options, nats_url=nats_url):
        for body, limit in (
            ({"prompt": "x", "images": [image, image]}, "max_images is 1"),
            ({"prompt": "x" * 101}, "max_prompt_chars is 100"),
            (
                {"prompt": "x", "images": [image_b64(size=(8, 8))]},
                "max_image_pixels is 63, image 0 has 8x8 = 64 pixels",
            ),
        ):
            _, sub = await submit(client, "chat", "acme", body)
            final = (await collect(sub))[-1]
            assert final["type"] == "error" and final["code"] == "invalid_request", final
            assert limit in final["message"]
        _, sub = await submit(client, "chat", "acme", {"prompt": "x" * 100, "images": [image]})
        final = (await collect(sub))[-1]
        assert final["type"] == "done", final


async def test_the_same_id_twice_runs_once(stack, client):
    rid, sub = await submit(client, "chat", "acme", {"prompt": "once", "max_tokens": 6})
    first = await collect(sub)
    _, again = await submit(client, "chat", "acme", {"prompt": "once", "max_tokens": 6}, rid=rid)
    replayed = await collect(again)
    assert replayed == [first[-1]]  # the stored final event, not a second run


async def test_a_full_backlog_fails_at_the_publisher_only(nats_url, client):
    settings = BrokerSettings(max_queued_per_subject=3)
    engine = load_engine_config_one_slot()
    options = stack_options(
        time_scale=1.0, engine=engine, settings=settings, dispatcher=DispatcherOptions(settle_s=60)
    )  # nothing dispatched
    async with LocalStack(load_config(), options, nats_url=nats_url):
        js = client.jetstream()
        for i in range(3):
            await js.publish(
                "fq.req.chat.initech", b'{"prompt":"x"}', headers={"Nats-Msg-Id": f"i{i}"}
            )
        with pytest.raises(nats.js.errors.APIError) as info:
            await js.publish(
                "fq.req.chat.initech", b'{"prompt":"x"}', headers={"Nats-Msg-Id": "i3"}
            )
        assert "maximum messages per subject" in str(info.value.description).lower()
        ack = await js.publish(
            "fq.req.chat.globex", b'{"prompt":"x"}', headers={"Nats-Msg-Id": "g0"}
        )
        assert ack.seq > 0


async def test_metrics_endpoint_reports_the_request_path(stack, client):
    import urllib.request

    _, sub = await submit(client, "chat", "acme", {"prompt": "measure me", "max_tokens": 8})
    assert (await collect(sub))[-1]["type"] == "done"
    await asyncio.sleep(1.2)  # the depth gauges are refreshed every second
    http = HttpApi(stack.metrics)
    port = http.serve(0)
    try:
        body = await asyncio.to_thread(
            lambda: (
                urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
                .read()
                .decode()
            )
        )
    finally:
        http.close()
    samples = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in body.splitlines()
        if line and not line.startswith("#")
    }
    assert samples['fairq_admissions_total{endpoint="chat",outcome="admitted"}'] >= 1
    assert samples['fairq_admissions_total{endpoint="chat",outcome="rate_limited"}'] == 0
    for histogram in (
        "fairq_queue_wait_seconds",
        "fairq_time_to_first_token_seconds",
        "fairq_output_tokens_per_second",
        "fairq_batch_fill_ratio",
    ):
        assert samples[f'{histogram}_count{{endpoint="chat"}}'] >= 1, histogram
    assert any(k.startswith("fairq_worker_model_unit_utilisation{") for k in samples)
    assert "# TYPE fairq_queue_depth gauge" in body


async def test_rate_limits_are_kept_in_redis_when_configured(nats_url, client, redis_url):
    import redis.asyncio as aioredis

    config = parse_config(ERROR_CONFIG)
    options = stack_options(time_scale=0.05, redis_url=redis_url)
    async with LocalStack(config, options, nats_url=nats_url):
        ok = {"prompt": "x", "max_tokens": 4}
        _, first = await submit(client, "chat", "limited", ok)
        assert (await collect(first))[-1]["type"] == "done"
        _, second = await submit(client, "chat", "limited", ok)
        limited = (await collect(second))[-1]
        assert limited["code"] == "rate_limited" and limited["retry_after_s"] > 0
    redis = aioredis.from_url(redis_url)
    try:
        keys = [key.decode() async for key in redis.scan_iter("fq:limits:*")]
    finally:
        await redis.aclose()
    assert any("rpm:chat:limited" in key for key in keys), keys
