"""The OpenAI-compatible front as OpenAI's own Python package uses it, against `fairq up`
(a real nats-server, the dispatcher and simulated worker processes): chat, completions
and embeddings, sync and async, streamed and not, every error status, the HTTP limits,
and a client that leaves mid-stream cancelling its request."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from bench.harness.procstat import worker_pid
from bench.harness.up import fairq_up as harness_up
from broker_config.config import EXAMPLE_CONFIG, load_config
from broker_config.wire import ChatMessage, Sampling
from producers.client import Client
from producers.openai_front.app import Front
from producers.openai_front.keys import KeyRing
from producers.openai_front.server import FrontServer
from workers.engine import EngineRequest
from workers.sim_engine import SimEngine

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
GRACE_S = 1.0  # [dispatcher] no_worker_grace_s: the `lonely` endpoint has no worker
IDLE_S = 1.0  # [front] idle_timeout_s
MAX_BODY = 65536
KEYS = {"tiny": "fq-test-tiny-key", "broke": "fq-test-broke-key"}

EXTRA_CONFIG = f"""
[endpoints.lonely]
profile = "llama-7b-sim"
cost = "model_units"

[dispatcher]
no_worker_grace_s = {GRACE_S}

[tenants.tiny]
tier = "free"
limits.chat = {{ rpm = 1, rpm_burst = 1 }}

[tenants.broke]
tier = "free"
limits.chat = {{ monthly_quota_tokens = 5 }}

[front]
idle_timeout_s = {IDLE_S}
max_body_bytes = {MAX_BODY}
keys = [
{
    "".join(
        f'  {{ tenant = "{t}", sha256 = "{hashlib.sha256(k.encode()).hexdigest()}" }},{chr(10)}'
        for t, k in KEYS.items()
    )
}]
"""


class Up:
    def __init__(self, process: subprocess.Popen[str], values: dict[str, str]) -> None:
        self.process = process
        self.values = values  # every NAME=value line it printed
        self.base_url = values["OPENAI_BASE_URL"]
        self.key = values["OPENAI_API_KEY"]
        self.nats_url = values["NATS_URL"]

    def client(self, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.base_url, api_key=key or self.key, max_retries=0, timeout=30.0
        )

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=self.base_url, api_key=self.key, max_retries=0, timeout=30.0
        )


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory, nats_binary: Path) -> Iterator[Up]:
    with fairq_up(tmp_path_factory.mktemp("front"), time_scale=0.05) as running:
        yield running


@contextlib.contextmanager
def fairq_up(directory: Path, time_scale: float) -> Iterator[Up]:
    """`fairq up` on the example config plus EXTRA_CONFIG, one chat and one embed worker;
    stopped with Ctrl-C on leaving."""
    config = directory / "fairq.toml"
    config.write_text(EXAMPLE_CONFIG.read_text() + EXTRA_CONFIG)
    flags = ["--config", str(config), "--workers", "chat=1,embed=1,lonely=0"]
    with harness_up(directory / "logs", *flags, "--time-scale", str(time_scale)) as running:
        yield Up(running.process, running.values)


def chat(**fields: object) -> dict[str, object]:
    return {
        "model": "chat",
        "messages": [{"role": "user", "content": "Hello there"}],
        "max_tokens": 24,
        **fields,
    }


def test_models_and_a_chat_completion(up: Up) -> None:
    client = up.client()
    assert {m.id for m in client.models.list()} == {"chat", "embed", "lonely"}
    answer = client.chat.completions.create(**chat(seed=7))
    choice = answer.choices[0]
    assert answer.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.message.content and choice.finish_reason in ("stop", "length")
    usage = answer.usage
    assert usage is not None and usage.prompt_tokens > 0 and usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # The same seed and prompt: the same text.
    again = client.chat.completions.create(**chat(seed=7))
    assert again.choices[0].message.content == choice.message.content


async def test_an_async_stream_has_the_text_a_finish_reason_usage_and_done(up: Up) -> None:
    client = up.async_client()
    whole = (await client.chat.completions.create(**chat(seed=11))).choices[0]
    stream = await client.chat.completions.create(
        **chat(seed=11), stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.finish_reason and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens > 0
    await client.close()


def test_completions_honour_a_stop_string_and_stream(up: Up) -> None:
    client = up.client()
    first = client.completions.create(model="chat", prompt="Once", max_tokens=32, seed=3)
    words = first.choices[0].text.split(" ")
    assert first.object == "text_completion" and len(words) > 4, first
    stop = " " + words[3]
    second = client.completions.create(
        model="chat", prompt="Once", max_tokens=32, seed=3, stop=[stop]
    )
    text = second.choices[0].text
    assert second.choices[0].finish_reason == "stop"
    assert stop not in text and first.choices[0].text.startswith(text + stop)
    streamed = "".join(
        chunk.choices[0].text
        for chunk in client.completions.create(
            model="chat", prompt="Once", max_tokens=32, seed=3, stop=[stop], stream=True
        )
    )
    assert streamed == text


def test_logprobs_come_back_when_asked(up: Up) -> None:
    client = up.client()
    answer = client.chat.completions.create(**chat(logprobs=True, top_logprobs=2))
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert "".join(t.token for t in content) == answer.choices[0].message.content
    plain = client.chat.completions.create(**chat())
    assert plain.choices[0].logprobs is None


def test_embeddings_are_vectors_equal_for_equal_inputs(up: Up) -> None:
    client = up.client()
    answer = client.embeddings.create(model="embed", input=["alpha", "beta", "alpha"])
    vectors = [item.embedding for item in answer.data]
    assert [item.index for item in answer.data] == [0, 1, 2]
    assert len(vectors[0]) == 32 and vectors[0] == vectors[2] != vectors[1]
    assert abs(sum(v * v for v in vectors[0]) - 1.0) < 1e-6
    assert answer.usage.prompt_tokens > 0
    request = urllib.request.Request(
        f"{up.base_url}/embeddings",
        headers={"Authorization": f"Bearer {up.key}"},
        data=json.dumps({"model": "embed", "input": "alpha", "encoding_format": "base64"}).encode(),
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        packed = base64.b64decode(json.load(response)["data"][0]["embedding"])
    assert struct.unpack(f"<{len(packed) // 4}f", packed) == pytest.approx(vectors[0], rel=1e-6)


def error_of(call: object) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as caught:
        call()  # type: ignore[operator]
    return caught.value


def test_every_error_has_the_status_an_openai_client_expects(up: Up) -> None:
    client = up.client()
    bad = error_of(lambda: client.chat.completions.create(**chat(temperature=5)))
    assert bad.status_code == 400 and bad.param == "temperature" and "temperature" in bad.message
    # Over a [dispatcher.input] limit (256 characters): refused by the dispatcher.
    long = error_of(
        lambda: client.chat.completions.create(**chat(extra_body={"fairq": {"session": "s" * 300}}))
    )
    assert long.status_code == 400 and long.param == "fairq.session"
    tools = error_of(
        lambda: client.chat.completions.create(
            **chat(tools=[{"type": "function", "function": {"name": "f"}}])
        )
    )
    assert tools.status_code == 400 and isinstance(tools, openai.BadRequestError)
    assert isinstance(
        error_of(lambda: up.client("fq-nobody").models.list()), openai.AuthenticationError
    )
    missing = error_of(lambda: client.chat.completions.create(**chat(model="gpt-9")))
    assert isinstance(missing, openai.NotFoundError) and missing.code == "model_not_found"

    tiny = up.client(KEYS["tiny"])
    tiny.chat.completions.create(**chat())
    limited = error_of(lambda: tiny.chat.completions.create(**chat()))
    assert isinstance(limited, openai.RateLimitError) and limited.code == "rate_limited"
    assert int(limited.response.headers["retry-after"]) >= 1
    broke = error_of(lambda: up.client(KEYS["broke"]).chat.completions.create(**chat()))
    assert broke.status_code == 429 and broke.code == "quota_exceeded"

    late = error_of(
        lambda: client.chat.completions.create(
            **chat(extra_body={"fairq": {"deadline": time.time() - 5}})
        )
    )
    assert late.status_code == 504 and late.code == "deadline_exceeded"
    time.sleep(GRACE_S)  # since the dispatcher's start: long past already, but be sure
    nobody = error_of(lambda: client.chat.completions.create(**chat(model="lonely")))
    assert nobody.status_code == 503 and nobody.code == "unavailable"

    wrong = error_of(lambda: client.chat.completions.create(**chat(model="embed")))
    assert wrong.status_code == 400 and wrong.code == "wrong_model_kind"
    assert "is an embed endpoint: use /v1/embeddings" in wrong.message
    wrong = error_of(lambda: client.embeddings.create(model="chat", input="x"))
    assert wrong.status_code == 400 and wrong.param == "model"
    assert "is a generate endpoint: use /v1/chat/completions" in wrong.message
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(f"{up.base_url}/nowhere", timeout=30)
    assert caught.value.code == 404
    assert json.load(caught.value)["error"]["message"] == "Not Found"


def test_max_tokens_over_the_models_cap_is_a_400_naming_it(up: Up) -> None:
    """Not lowered to the cap without a word: refused, as OpenAI and vLLM refuse it."""
    client = up.client()
    over = error_of(lambda: client.chat.completions.create(**chat(max_tokens=100_000)))
    assert over.status_code == 400 and over.param == "max_tokens" and "1024" in over.message
    over = error_of(lambda: client.completions.create(model="chat", prompt="x", max_tokens=1025))
    assert over.status_code == 400 and over.param == "max_tokens"


def test_a_model_is_retrieved_by_name(up: Up) -> None:
    client = up.client()
    model = client.models.retrieve("chat")
    assert (model.id, model.object, model.owned_by) == ("chat", "model", "fairq")
    for unknown in ("gpt-9", "org/gpt-9"):
        missing = error_of(lambda name=unknown: client.models.retrieve(name))
        assert isinstance(missing, openai.NotFoundError) and missing.code == "model_not_found"
        assert missing.param == "model"
    nobody = error_of(lambda: up.client("fq-nobody").models.retrieve("chat"))
    assert isinstance(nobody, openai.AuthenticationError)


def get(url: str) -> tuple[int, str, dict[str, object]]:
    """Status, reason phrase and JSON body of a GET, an error status too."""
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, response.reason, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, error.reason, json.load(error)


async def test_health_says_whether_the_front_reaches_nats_in_standard_status_lines(
    up: Up,
) -> None:
    root = up.base_url.removesuffix("/v1")
    assert get(f"{root}/health") == (200, "OK", {"status": "ok", "nats": "connected"})
    assert get(f"{up.base_url}/nowhere")[:2] == (404, "Not Found")
    client = await Client.connect(up.nats_url)
    config = load_config()
    async with FrontServer(Front(client, config, KeyRing([])), config.front, 0) as front:
        health = f"{front.base_url.removesuffix('/v1')}/health"
        assert (await asyncio.to_thread(get, health))[0] == 200
        await client.close()
        assert await asyncio.to_thread(get, health) == (
            503,
            "Service Unavailable",
            {"status": "unavailable", "nats": "closed"},
        )


def test_http_limits_answer_413_and_close_idle_connections(up: Up) -> None:
    big = error_of(
        lambda: up.client().chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "x" * MAX_BODY}]
        )
    )
    assert big.status_code == 413
    host, port = up.base_url.removeprefix("http://").split("/")[0].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as idle:
        started = time.monotonic()
        idle.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # never ends
        assert idle.recv(1024) == b""  # closed by the server
        assert time.monotonic() - started < IDLE_S + 5


async def test_a_client_that_leaves_mid_stream_cancels_its_request(up: Up) -> None:
    """The output is drawn to be 1,000 tokens or more (1.2 s at this time scale): an
    unseeded draw from the id can be a few tokens, done before the client leaves."""
    client = up.async_client()
    stream = await client.chat.completions.create(
        **chat(max_tokens=1024, seed=await long_output_seed(1000)),
        stream=True,
        extra_body={"fairq": {"metadata": {"test": "leave"}}},
    )
    first = await anext(aiter(stream))
    request_id = first.id.removeprefix("chatcmpl-")
    await stream.close()
    async with Client.connect(up.nats_url) as fq:
        deadline = time.monotonic() + 10
        while (status := await fq.status("acme", request_id)).state != "failed":
            assert time.monotonic() < deadline, status
            await asyncio.sleep(0.1)
    assert status.result is not None and status.result.code == "cancelled"
    await client.close()


def test_the_front_runs_alone_and_prints_where_it_serves(up: Up, tmp_path: Path) -> None:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "producers.openai_front",
            "--nats",
            up.nats_url,
            "--port",
            "0",
            "--dev-key-for",
            "globex",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert process.stdout is not None
        base = process.stdout.readline().strip().removeprefix("OPENAI_BASE_URL=")
        key = process.stdout.readline().strip().removeprefix("OPENAI_API_KEY=")
        answer = openai.OpenAI(base_url=base, api_key=key, max_retries=0).chat.completions.create(
            **chat()
        )
        assert answer.choices[0].message.content
        assert json.loads(answer.model_dump_json())["model"] == "chat"
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0


async def long_output_seed(tokens: int) -> int:
    """A seed for which `chat()`'s prompt gives at least `tokens` output tokens on the
    simulated engine of worker chat-w1 (engine seed 0): a seeded output is drawn from the
    prompt and the seed."""
    message = ChatMessage(**chat()["messages"][0])  # type: ignore[index]
    async with SimEngine(time_scale=0) as engine:
        for seed in range(100):
            request = EngineRequest(
                f"probe-{seed}", 1024, messages=[message], sampling=Sampling(seed=seed)
            )
            *_, final = [delta async for delta in engine.generate(request)]
            if final.output_tokens >= tokens:
                return seed
    raise AssertionError(f"no seed below 100 gives {tokens} tokens")


async def test_a_lost_worker_is_a_500_or_an_error_in_the_stream(
    tmp_path: Path, nats_binary: Path
) -> None:
    """The chat worker is killed while two long requests stream on it (engine time at
    scale 1: 1,024 tokens take 25 s): once the dispatcher knows both had streamed output,
    they end with `internal`, which the front answers with 500 before any output and as
    an `error` object in a stream already under way."""
    with fairq_up(tmp_path, time_scale=1.0) as running:
        client = running.async_client()
        long = chat(max_tokens=1024, seed=await long_output_seed(500))
        whole = asyncio.create_task(client.chat.completions.create(**long))
        stream = await client.chat.completions.create(**long, stream=True)
        chunks = aiter(stream)
        while not (await anext(chunks)).choices[0].delta.content:
            pass
        await asyncio.sleep(2.0)  # both have streamed, and heartbeats have said so
        pid = worker_pid(running.process.pid, "chat-w1")
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(openai.APIError, match="internal|worker running it was lost"):
            async for _ in chunks:
                pass
        with pytest.raises(openai.InternalServerError) as caught:
            await whole
        assert caught.value.status_code == 500 and caught.value.code == "internal"
        await client.close()
