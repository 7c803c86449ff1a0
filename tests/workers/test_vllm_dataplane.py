"""The data plane on real vLLM: nats-server, the dispatcher, and a worker whose engine is
vLLM on the CPU with the tiny model; clients are plain nats-py, as the wire contract says.

One engine serves the module (startup takes 20-45 s); each test gets its own nats-server,
dispatcher and worker service around it. The engine runs one sequence at a time, so the
dispatcher holds the queue and its order is observable, and it ignores EOS, so every
request generates exactly its max_tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client as NATS

from broker_config.config import DispatcherOptions, WorkerOptions, parse_config
from broker_config.subjects import Subjects
from dispatcher.observe.metrics import DispatcherMetrics
from dispatcher.service import Dispatcher
from tests.dispatch.test_dataplane_e2e import api, collect, submit, wait_for_state
from tests.wire_support import image_b64

# Importing the vLLM engine tests applies their policy (skipped where vllm is missing, a
# failure in CI with FQ_VLLM=1) and shares their offline environment, tiny model and spy
# on vLLM's own outputs.
from tests.workers.test_vllm_engine import (  # noqa: F401
    model_dir,
    until_unfinished,
    vllm_env,
    vllm_outputs,
)
from workers.engine import Delta, Engine, EngineRequest
from workers.service import WorkerService
from workers.vllm_engine import VLLMEngine, VLLMEngineConfig

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]

KV_CACHE_BYTES = 64 << 20
# max_tokens of a request that must still be running when the test acts (< 8192): 2000
# tokens ended before a test's steps did on a slow machine.
LONG = 8000
WAIT_S = 60.0
CONFIG = """
[profiles.tiny]
name = "tiny"
alpha = 0.00005
beta = 0.002
capacity_mu_per_s = 4.0

[endpoints.chat]
profile = "tiny"
cost = "model_units"
latency_target_s = 600.0
max_tokens_cap = 8000

[[tiers]]
name = "standard"

[tenants.acme]
tier = "standard"

[tenants.globex]
tier = "standard"
"""
# The module's engine runs one sequence, so no slot is kept for health probes and a probe
# would wait behind a long request: these tests are not about probes (no probe is sent).
# vLLM's threads starve this 2-core machine's event loops and nats-server now and then
# (API calls and heartbeats 5-10 s late, old code too): generous timeouts for both.
OPTIONS = DispatcherOptions(
    settle_s=0.2,
    tick_s=0.05,
    worker_timeout_s=30.0,
    grace_s=5.0,
    probe_stall_s=3600.0,
    probe_idle_s=3600.0,
)
API_S = 30.0


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(model_dir: Path) -> AsyncIterator[VLLMEngine]:  # noqa: F811
    config = VLLMEngineConfig(
        model=str(model_dir),
        max_num_seqs=1,
        max_model_len=8192,
        kv_cache_bytes=KV_CACHE_BYTES,
        ignore_eos=True,
    )
    async with VLLMEngine(config) as running:
        yield running


@contextlib.asynccontextmanager
async def serving(
    nats_url: str,
    engine: Engine,
    options: DispatcherOptions = OPTIONS,
    metrics: DispatcherMetrics | None = None,
    config: str = CONFIG,
) -> AsyncIterator[Dispatcher]:
    """A dispatcher and one worker on `engine`, on this test's nats-server."""
    async with contextlib.AsyncExitStack() as stack:
        nc = await nats.connect(nats_url, name="fairq-vllm-dataplane")
        stack.push_async_callback(nc.drain)
        running = await stack.enter_async_context(
            Dispatcher(
                nc,
                msgspec.structs.replace(parse_config(config), dispatcher=options),
                metrics=metrics,
            )
        )
        results = await nc.jetstream().key_value(running.subjects.results_bucket)
        await stack.enter_async_context(
            WorkerService(
                nc,
                engine,
                endpoint="chat",
                worker_id="vllm-1",
                subjects=running.subjects,
                results=results,
                profile=running.scheduler.endpoints["chat"].profile,
                settings=WorkerOptions(heartbeat_interval_s=0.2, drain_timeout_s=10.0),
            )
        )
        yield running


@pytest_asyncio.fixture(loop_scope="module")
async def dispatcher(nats_url: str, engine: VLLMEngine) -> AsyncIterator[Dispatcher]:
    async with serving(nats_url, engine) as running:
        yield running


@pytest_asyncio.fixture(loop_scope="module")
async def client(nats_url: str) -> AsyncIterator[NATS]:
    nc = await nats.connect(nats_url, name="fairq-vllm-client")
    yield nc
    await nc.drain()


def input_tokens(engine: VLLMEngine, prompt: str) -> int:
    return engine.count_tokens(EngineRequest(id="count", max_tokens=1, prompt=prompt))


async def test_concurrent_requests_of_two_tenants_stream_with_the_engines_usage(
    dispatcher: Dispatcher,
    client: NATS,
    engine: VLLMEngine,
    vllm_outputs: dict[str, list[Any]],  # noqa: F811
) -> None:
    """Token events carry text, not counts, and a byte-level token that ends inside a
    character streams no text: so each token event is matched to the vLLM output it
    came from, and usage to vLLM's own counts."""
    bodies = {
        (tenant, f"{tenant}-{i}"): {
            "prompt": f"def f{i}(x):\n    return x * {i}",
            "max_tokens": 8 + 2 * i,
        }
        for i in range(4)
        for tenant in ("acme", "globex")
    }
    submitted = await asyncio.gather(
        *(submit(client, "chat", tenant, body, rid=rid) for (tenant, rid), body in bodies.items())
    )
    streams = await asyncio.gather(*(collect(sub, timeout=WAIT_S) for _, sub in submitted))
    profile = dispatcher.scheduler.endpoints["chat"].profile
    for ((tenant, rid), body), events in zip(bodies.items(), streams, strict=True):
        *tokens, done = events
        assert done["type"] == "done", done
        assert [(t["type"], t["id"], t["seq"]) for t in tokens] == [
            ("token", rid, seq) for seq in range(len(tokens))
        ]
        assert done["id"] == rid and done["seq"] == len(tokens)
        outputs = vllm_outputs[Subjects.result_key(tenant, rid)]
        assert [t["text"] for t in tokens] == [
            o.outputs[0].text for o in outputs if o.outputs[0].text
        ]
        assert done["text"] == "".join(t["text"] for t in tokens)
        usage = done["usage"]
        assert (
            usage["output_tokens"]
            == sum(len(o.outputs[0].token_ids) for o in outputs)
            == body["max_tokens"]
        )
        assert (
            usage["input_tokens"]
            == input_tokens(engine, body["prompt"])
            == len(outputs[-1].prompt_token_ids)
        )
        assert usage["model_units"] == pytest.approx(
            profile.model_units(usage["input_tokens"], usage["output_tokens"])
        )


async def test_cancel_aborts_a_running_request_inside_vllm(
    dispatcher: Dispatcher,
    client: NATS,
    engine: VLLMEngine,
    vllm_outputs: dict[str, list[Any]],  # noqa: F811
) -> None:
    rid, sub = await submit(client, "chat", "acme", {"prompt": "while True:", "max_tokens": LONG})
    streamed = [json.loads((await sub.next_msg(timeout=WAIT_S)).data) for _ in range(3)]
    assert [e["type"] for e in streamed] == ["token"] * 3
    assert engine.llm.get_num_unfinished_requests() == 1

    reply = await api(client, "fq.api.cancel.acme", {"id": rid}, API_S)
    assert reply == {"id": rid, "cancelled": True}
    final = (await collect(sub, timeout=WAIT_S))[-1]
    assert final["type"] == "error" and final["code"] == "cancelled", final
    generated = sum(
        len(o.outputs[0].token_ids) for o in vllm_outputs[Subjects.result_key("acme", rid)]
    )
    assert 3 <= generated < 1_000, "the request ran on instead of being aborted"
    assert engine.llm.get_num_unfinished_requests() == 0
    # The client hears of the end before the dispatcher has the worker's completion.
    await wait_for_state(client, "acme", rid, "failed", timeout=API_S)
    stored = await api(client, "fq.api.status.acme", {"id": rid}, API_S)
    assert stored["state"] == "failed" and stored["result"]["code"] == "cancelled"


class StartOrder:
    """One reply subscription for many requests: the order in which they produced their
    first token, and their final events."""

    def __init__(self, client: NATS) -> None:
        self.client = client
        self.inbox = client.new_inbox()
        self.started: list[str] = []
        self.finals: dict[str, dict] = {}
        self._replies: Any = None

    async def __aenter__(self) -> StartOrder:
        self._replies = await self.client.subscribe(f"{self.inbox}.>")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._replies.unsubscribe()

    async def publish(self, tenant: str, rid: str, max_tokens: int, priority: int = 0) -> None:
        body = {"prompt": "class A:", "max_tokens": max_tokens, "priority": priority}
        await self.client.jetstream().publish(
            f"fq.req.chat.{tenant}",
            json.dumps(body).encode(),
            headers={"Nats-Msg-Id": rid, "Fq-Reply": f"{self.inbox}.{rid}"},
        )

    async def read_until(self, condition: Callable[[], bool]) -> None:
        deadline = time.monotonic() + WAIT_S
        while not condition():
            msg = await self._replies.next_msg(timeout=max(0.01, deadline - time.monotonic()))
            event = json.loads(msg.data)
            if event["type"] == "token" and event["id"] not in self.started:
                self.started.append(event["id"])
            elif event["type"] in ("done", "error"):
                self.finals[event["id"]] = event


async def test_queued_requests_start_in_priority_order(
    dispatcher: Dispatcher,
    client: NATS,
    engine: VLLMEngine,
) -> None:
    """With the only sequence slot taken, requests wait in the dispatcher's queue, whose
    per-tenant order (the client's priority, then arrival) decides which starts next: the
    client's priority never reaches vLLM, which holds one request at a time here. One reply
    subscription sees every request's events in the order the worker published them."""
    async with StartOrder(client) as order:
        await order.publish("acme", "blocker", LONG)
        await order.read_until(lambda: bool(order.started))
        priorities = {"low": 1, "mid": 3, "high": 9, "mid-later": 3}
        # All at once, so the queue forms well within the blocker's 2,000 tokens (one by
        # one with status polls was too slow on a loaded machine). Published in order, so
        # "mid" still arrives before "mid-later".
        for rid, priority in priorities.items():
            await order.publish("acme", rid, 4, priority)
        await asyncio.gather(
            *(wait_for_state(client, "acme", rid, "queued", timeout=WAIT_S) for rid in priorities)
        )
        assert engine.llm.get_num_unfinished_requests() == 1, "the queue formed inside vLLM"
        cancelled = await api(client, "fq.api.cancel.acme", {"id": "blocker"}, API_S)
        assert cancelled["cancelled"] is True

        await order.read_until(lambda: order.finals.keys() >= {"blocker", *priorities})
    assert order.started == ["blocker", "high", "mid", "mid-later", "low"]
    assert order.finals["blocker"]["code"] == "cancelled", (
        "the blocker ended before the queue formed"
    )
    assert all(order.finals[rid]["type"] == "done" for rid in priorities)


class Oversubscribed:
    """The module's engine (vLLM runs one sequence at a time) reporting more sequences in
    its capacity: the dispatcher then sends it several requests and they wait inside vLLM,
    where vLLM's priority scheduler orders them. Records each request's engine priority."""

    def __init__(self, engine: VLLMEngine, sequences: int) -> None:
        self._engine = engine
        self._sequences = sequences
        self.priorities: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    @property
    def capacity(self) -> Any:
        return msgspec.structs.replace(self._engine.capacity, sequences=self._sequences)

    def generate(self, request: EngineRequest) -> AsyncIterator[Delta]:
        self.priorities[request.id] = request.priority
        return self._engine.generate(request)


@pytest_asyncio.fixture(loop_scope="module")
async def oversubscribed(nats_url: str, engine: VLLMEngine) -> AsyncIterator[Oversubscribed]:
    """A dispatcher and one worker whose engine reports 8 sequences while vLLM runs 1."""
    worker_engine = Oversubscribed(engine, sequences=8)
    async with serving(nats_url, worker_engine):
        yield worker_engine


async def test_a_tenants_own_priority_never_jumps_another_tenant_inside_vllm(
    oversubscribed: Oversubscribed,
    client: NATS,
    engine: VLLMEngine,
) -> None:
    """acme asks for priority 1e9 on every request; globex, a newcomer below its fair share,
    is expedited by the dispatcher. With all of them waiting inside vLLM's priority
    scheduler (the worker takes 8, vLLM runs 1), globex's request starts first: engine
    priority is the dispatcher's `expedited` decision, never the client's `priority`."""
    greedy = 1_000_000_000
    async with StartOrder(client) as order:
        await order.publish("acme", "blocker", LONG, greedy)
        await order.read_until(lambda: bool(order.started))
        flood = ["acme-1", "acme-2", "acme-3"]
        for rid in flood:
            await order.publish("acme", rid, 4, greedy)
        await until_unfinished(engine, 1 + len(flood))  # all of acme's wait inside vLLM
        await order.publish("globex", "globex-1", 4, 0)
        await until_unfinished(engine, 2 + len(flood))
        cancelled = await api(client, "fq.api.cancel.acme", {"id": "blocker"}, API_S)
        assert cancelled["cancelled"] is True

        await order.read_until(lambda: order.finals.keys() >= {"blocker", "globex-1", *flood})
    assert order.finals["blocker"]["code"] == "cancelled"
    assert order.started[:2] == ["blocker", "globex-1"], order.started
    assert sorted(order.started[2:]) == flood
    engine_priority = oversubscribed.priorities
    assert engine_priority[Subjects.result_key("globex", "globex-1")] == 1  # expedited
    assert [engine_priority[Subjects.result_key("acme", rid)] for rid in flood] == [0, 0, 0]


async def test_a_request_with_images_on_a_text_model_is_refused_with_a_clear_error(
    dispatcher: Dispatcher,
    client: NATS,
    engine: VLLMEngine,
) -> None:
    assert not engine.accepts_images  # the tiny test model takes text only
    _, sub = await submit(
        client,
        "chat",
        "acme",
        {
            "messages": [{"role": "user", "content": "what is this?"}],
            "images": [image_b64()],
            "max_tokens": 4,
        },
    )
    (error,) = await collect(sub, timeout=WAIT_S)
    assert error["type"] == "error" and error["code"] == "invalid_request", error
    assert "this endpoint's model takes text only" in error["message"]
    _, sub = await submit(client, "chat", "acme", {"prompt": "still serving", "max_tokens": 2})
    assert (await collect(sub, timeout=WAIT_S))[-1]["type"] == "done"
