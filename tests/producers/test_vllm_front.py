"""The OpenAI-compatible front on real vLLM: OpenAI's Python package (sync and async,
streamed and not) against the front, a dispatcher, a vLLM worker generating with the
tiny model and another running it as an embedding model, over a real nats-server.

The front, the dispatcher and the workers share this test's event loop (as in
tests/workers/test_vllm_dataplane.py), so the sync client runs in a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import nats
import openai
import pytest
import pytest_asyncio

from broker_config.config import DispatcherOptions, WorkerOptions, parse_config
from broker_config.server import EmbeddedNatsServer
from dispatcher.service import Dispatcher
from producers.client import Client
from producers.openai_front.app import Front
from producers.openai_front.keys import KeyRing, with_dev_key
from producers.openai_front.server import FrontServer

# Importing the vLLM engine tests applies their policy (skipped where vllm is missing, a
# failure in CI with FQ_VLLM=1) and shares their offline environment and tiny model.
from tests.workers.test_vllm_engine import HIDDEN_SIZE, model_dir, vllm_env  # noqa: F401
from workers.service import WorkerService
from workers.vllm_engine import VLLMEngine, VLLMEngineConfig

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]

KV_CACHE_BYTES = 64 << 20
CONFIG = """
[endpoints.chat]
max_tokens_cap = 64

[endpoints.embed]
kind = "embed"
max_tokens_cap = 1

[[tiers]]
name = "standard"

[tenants.acme]
tier = "standard"
"""
# vLLM's threads starve this 2-core machine's event loop now and then (see
# tests/workers/test_vllm_dataplane.py): generous timeouts, no health probes.
OPTIONS = DispatcherOptions(
    settle_s=0.2,
    tick_s=0.05,
    worker_timeout_s=30.0,
    grace_s=5.0,
    probe_stall_s=3600.0,
    probe_idle_s=3600.0,
)
TIMEOUT_S = 120.0


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def front(model_dir: Path) -> AsyncIterator[tuple[str, str]]:  # noqa: F811
    """(base URL, API key) of a front over a dispatcher and two vLLM workers."""
    config, key = with_dev_key(parse_config(CONFIG), "acme")
    config = msgspec.structs.replace(config, dispatcher=OPTIONS)
    engines = {
        name: VLLMEngine(
            VLLMEngineConfig(
                model=str(model_dir),
                max_num_seqs=2,
                max_model_len=512,
                kv_cache_bytes=KV_CACHE_BYTES,
            ),
            embed=name == "embed",
        )
        for name in ("chat", "embed")
    }
    async with contextlib.AsyncExitStack() as stack:
        nats_url = (await stack.enter_async_context(EmbeddedNatsServer())).url
        nc = await nats.connect(nats_url, name="fairq-vllm-front")
        stack.push_async_callback(nc.drain)
        dispatcher = await stack.enter_async_context(Dispatcher(nc, config))
        results = await nc.jetstream().key_value(dispatcher.subjects.results_bucket)
        for name, engine in engines.items():
            await stack.enter_async_context(engine)
            await stack.enter_async_context(
                WorkerService(
                    nc,
                    engine,
                    endpoint=name,
                    worker_id=f"{name}-vllm",
                    embed=name == "embed",
                    subjects=dispatcher.subjects,
                    results=results,
                    settings=WorkerOptions(heartbeat_interval_s=0.2, drain_timeout_s=10.0),
                )
            )
        client = await stack.enter_async_context(await Client.connect(nats_url))
        server = await stack.enter_async_context(
            FrontServer(Front(client, config, KeyRing(config.front.keys)), config.front, 0)
        )
        yield server.base_url, key


def clients(front: tuple[str, str]) -> tuple[openai.OpenAI, openai.AsyncOpenAI]:
    base_url, key = front
    return (
        openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=TIMEOUT_S),
        openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=TIMEOUT_S),
    )


MESSAGES = [{"role": "user", "content": "Tell me a story"}]


async def test_chat_sync_and_streamed_async_give_the_same_seeded_text(
    front: tuple[str, str],
) -> None:
    sync, asynchronous = clients(front)
    answer = await asyncio.to_thread(
        sync.chat.completions.create,
        model="chat",
        messages=MESSAGES,
        max_tokens=16,
        seed=4,
        temperature=1.0,
    )
    text = answer.choices[0].message.content
    assert text and answer.usage.completion_tokens > 0
    assert answer.choices[0].finish_reason in ("stop", "length")
    stream = await asynchronous.chat.completions.create(
        model="chat",
        messages=MESSAGES,
        max_tokens=16,
        seed=4,
        temperature=1.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == answer.usage.completion_tokens
    await asynchronous.close()


async def test_completions_with_a_stop_string_and_logprobs(front: tuple[str, str]) -> None:
    sync, _ = clients(front)

    def complete(**fields: object) -> openai.types.Completion:
        return sync.completions.create(
            model="chat", prompt="Once upon a time", max_tokens=24, temperature=0.0, **fields
        )

    first = await asyncio.to_thread(complete, logprobs=2)
    text = first.choices[0].text
    logprobs = first.choices[0].logprobs
    assert len(logprobs.tokens) == first.usage.completion_tokens
    assert all(
        len(top) <= 2 and lp <= 0 for top, lp in zip(logprobs.top_logprobs, logprobs.token_logprobs)
    )
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    second = await asyncio.to_thread(complete, stop=[stop])
    assert second.choices[0].finish_reason == "stop"
    assert text.startswith(second.choices[0].text) and stop not in second.choices[0].text


async def test_embeddings_have_the_models_hidden_size(front: tuple[str, str]) -> None:
    _, asynchronous = clients(front)
    answer = await asynchronous.embeddings.create(model="embed", input=["a cat", "a dog", "a cat"])
    vectors = [item.embedding for item in answer.data]
    assert all(len(v) == HIDDEN_SIZE for v in vectors)
    assert vectors[0] == pytest.approx(vectors[2], abs=1e-5) and vectors[0] != vectors[1]
    assert answer.usage.prompt_tokens > 0
    await asynchronous.close()
