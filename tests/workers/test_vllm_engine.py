"""The real vLLM engine on a CPU, with the tiny model built offline into a temp dir.

Runs only in the venv that `.ci/vllm-env.sh` makes; elsewhere the module is skipped, except
in CI with FQ_VLLM=1, where a missing vllm is a failure. One engine serves the whole module
(startup takes ~20 s); it runs one sequence at a time, which makes queueing observable.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from collections import defaultdict
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from broker_config.wire import ChatMessage, Sampling
from workers.engine import Delta, EngineError, EngineRequest
from workers.images import PreparedImage

if importlib.util.find_spec("vllm") is None:
    _WHY = "vllm is not installed here: run these tests with the python of .ci/vllm-env.sh"
    if os.environ.get("CI") == "true" and os.environ.get("FQ_VLLM") == "1":
        pytest.fail(_WHY, pytrace=False)
    pytest.skip(_WHY, allow_module_level=True)

from workers.tiny_model import build_tiny_model  # noqa: E402
from workers.vllm_engine import VLLMEngine, VLLMEngineConfig  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]

KV_CACHE_BYTES = 64 << 20
# Tiny model: 2 layers x (K and V) x 2 KV heads x head_dim 64 x 2 bytes (bf16).
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 64 * 2
HIDDEN_SIZE = 256  # of the tiny model: the length of its embeddings
LONG = 8000  # max_tokens of a request that must still be running when we act on it (< 8192)
WAIT_S = 60.0


@pytest.fixture(scope="module")
def vllm_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Offline, loopback only, scratch files in a temp dir; inherited by vLLM's processes."""
    scratch = tmp_path_factory.mktemp("vllm-scratch")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        mp.setenv("VLLM_NO_USAGE_STATS", "1")
        mp.setenv("VLLM_HOST_IP", "127.0.0.1")
        mp.setenv("TMPDIR", str(scratch))
        mp.setenv("VLLM_CACHE_ROOT", str(scratch / "cache"))
        mp.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
        yield


@pytest.fixture(scope="module")
def model_dir(vllm_env: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(model_dir: Path) -> AsyncIterator[VLLMEngine]:
    config = VLLMEngineConfig(
        model=str(model_dir),
        max_num_seqs=1,
        max_model_len=8192,
        kv_cache_bytes=KV_CACHE_BYTES,
        ignore_eos=True,
    )
    async with VLLMEngine(config) as running:
        yield running


@pytest.fixture
def vllm_outputs(engine: VLLMEngine, monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    """Every RequestOutput the engine takes from vLLM, by request id: vLLM's own counts.

    Spies on the output collector `AsyncLLM.add_request` returns, the queue both vLLM's
    own `generate` and the engine read.
    """
    seen: dict[str, list[Any]] = defaultdict(list)
    add_request = engine.llm.add_request

    async def spy(request_id: str, *args: Any, **kwargs: Any) -> Any:
        queue = await add_request(request_id, *args, **kwargs)
        get, get_nowait = queue.get, queue.get_nowait

        async def spied_get() -> Any:
            out = await get()
            seen[request_id].append(out)
            return out

        def spied_get_nowait() -> Any:
            out = get_nowait()
            if out is not None:
                seen[request_id].append(out)
            return out

        queue.get, queue.get_nowait = spied_get, spied_get_nowait
        return queue

    monkeypatch.setattr(engine.llm, "add_request", spy)
    return seen


class Gate:
    """Holds an engine step (rendering, vLLM registering a request) until opened: an
    abort can then land exactly inside it, without timing."""

    def __init__(self, step: Any) -> None:
        self._step = step
        self.reached = asyncio.Event()
        self._open = asyncio.Event()

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.reached.set()
        await self._open.wait()
        return await self._step(*args, **kwargs)

    async def wait_reached(self) -> None:
        await asyncio.wait_for(self.reached.wait(), WAIT_S)

    def open(self) -> None:
        self._open.set()


async def until_unfinished(engine: VLLMEngine, n: int) -> None:
    """Wait until vLLM itself holds `n` unfinished requests (so they are queued in it)."""
    async with asyncio.timeout(WAIT_S):
        while engine.llm.get_num_unfinished_requests() != n:
            await asyncio.sleep(0.01)


async def collect(engine: VLLMEngine, request: EngineRequest) -> list[Delta]:
    async def run() -> list[Delta]:
        return [delta async for delta in engine.generate(request)]

    return await asyncio.wait_for(run(), WAIT_S)


class Streaming:
    """A request generating in a background task, its deltas collected as they arrive."""

    def __init__(self, engine: VLLMEngine, request: EngineRequest, order: list[str]) -> None:
        self.request = request
        self.deltas: list[Delta] = []
        self._order = order
        self.task = asyncio.create_task(self._run(engine))

    async def _run(self, engine: VLLMEngine) -> None:
        async for delta in engine.generate(self.request):
            if delta.token_count and not any(d.token_count for d in self.deltas):
                self._order.append(self.request.id)
            self.deltas.append(delta)

    @property
    def tokens(self) -> int:
        return sum(d.token_count for d in self.deltas)

    async def wait_tokens(self, n: int) -> None:
        async with asyncio.timeout(WAIT_S):
            while self.tokens < n:
                await asyncio.sleep(0.01)

    async def done(self) -> Delta:
        await asyncio.wait_for(self.task, WAIT_S)
        return self.deltas[-1]


def assert_usage(deltas: list[Delta], outputs: list[Any]) -> Delta:
    """One final delta, whose usage is the sum of the stream and vLLM's own counts."""
    final = deltas[-1]
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert final.output_tokens == sum(d.token_count for d in deltas)
    assert final.output_tokens == sum(len(o.outputs[0].token_ids) for o in outputs)
    assert final.output_tokens == outputs[-1].metrics.num_generation_tokens
    assert final.input_tokens == len(outputs[-1].prompt_token_ids)
    assert "".join(d.text for d in deltas) == "".join(o.outputs[0].text for o in outputs)
    return final


async def test_engine_not_running_refuses_work() -> None:
    idle = VLLMEngine(VLLMEngineConfig(model="never-started"))
    assert not idle.healthy
    with pytest.raises(EngineError, match="not running"):
        idle.capacity  # noqa: B018 - the property raises
    with pytest.raises(EngineError, match="not running"):
        idle.count_tokens(EngineRequest(id="r", max_tokens=1, prompt="hi"))


async def test_capacity_is_the_engines_real_limits(engine: VLLMEngine) -> None:
    assert engine.healthy
    assert engine.capacity.sequences == 1
    assert engine.capacity.tokens == KV_CACHE_BYTES // KV_BYTES_PER_TOKEN


async def test_concurrent_requests_stream_with_the_engines_usage(
    engine: VLLMEngine, vllm_outputs: dict[str, list[Any]]
) -> None:
    requests = [
        EngineRequest(id=f"c{i}", max_tokens=8 + 2 * i, prompt=f"def f{i}(x):\n    return x * {i}")
        for i in range(8)
    ]
    results = await asyncio.gather(*(collect(engine, r) for r in requests))
    for request, deltas in zip(requests, results, strict=True):
        final = assert_usage(deltas, vllm_outputs[request.id])
        assert len(deltas) > 1, "output came in one piece instead of streaming"
        assert final.finish_reason == "length"
        assert final.output_tokens == request.max_tokens
        assert final.input_tokens == engine.count_tokens(request)
        assert final.ttft_s is not None and 0 < final.ttft_s < WAIT_S


async def test_a_repeated_prompt_prefix_is_reported_as_cached_input(engine: VLLMEngine) -> None:
    """vLLM's prefix cache (on by default here): a second request sharing a long prefix
    with the first reports the shared whole blocks as cached; the first reports none."""
    shared = "".join(f"def helper_{i}(x):\n    return x + {i}\n" for i in range(40))
    first = (
        await collect(engine, EngineRequest(id="prefix-1", max_tokens=4, prompt=shared + "# first"))
    )[-1]
    second = (
        await collect(
            engine, EngineRequest(id="prefix-2", max_tokens=4, prompt=shared + "# second question")
        )
    )[-1]
    assert first.input_tokens > 200 and first.cached_input_tokens == 0
    # Whole 16-token blocks of the shared prefix, never the whole prompt.
    assert first.input_tokens // 2 < second.cached_input_tokens < second.input_tokens
    assert second.cached_input_tokens % 16 == 0


async def test_count_tokens_uses_the_models_tokenizer(engine: VLLMEngine, tokenizer: Any) -> None:
    prompt = "import os\nprint(os.getcwd())"
    request = EngineRequest(id="count", max_tokens=1, prompt=prompt)
    assert engine.count_tokens(request) == len(tokenizer(prompt)["input_ids"])


async def test_messages_go_through_the_chat_template(
    engine: VLLMEngine, tokenizer: Any, vllm_outputs: dict[str, list[Any]]
) -> None:
    messages = [ChatMessage("system", "Be brief."), ChatMessage("user", "What is 2 + 2?")]
    request = EngineRequest(id="chat", max_tokens=4, messages=messages)
    text = tokenizer.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in messages],
        tokenize=False,
        add_generation_prompt=True,
    )
    expected = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert text.endswith("<|im_start|>assistant\n")

    assert engine.count_tokens(request) == len(expected)
    deltas = await collect(engine, request)
    assert_usage(deltas, vllm_outputs["chat"])
    assert list(vllm_outputs["chat"][0].prompt_token_ids) == expected


@pytest.mark.parametrize(
    "request_, match",
    [
        (EngineRequest(id="none", max_tokens=4), "neither a prompt nor messages"),
        (
            EngineRequest(id="both", max_tokens=4, prompt="a", messages=[ChatMessage("user", "b")]),
            "both a prompt and messages",
        ),
        (EngineRequest(id="long", max_tokens=4, prompt="x = 1\n" * 3000), "context length"),
    ],
)
async def test_bad_requests_are_value_errors(
    engine: VLLMEngine, request_: EngineRequest, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        engine.count_tokens(request_)
    with pytest.raises(ValueError, match=match):
        await collect(engine, request_)


async def test_a_text_model_takes_no_images(engine: VLLMEngine) -> None:
    """The worker refuses such requests before preparing their images
    (tests/workers/test_vllm_dataplane.py); the engine itself says so too, as vLLM words it."""
    assert not engine.accepts_images
    request = EngineRequest(
        id="img", max_tokens=4, prompt="a", images=[PreparedImage(1, 1, bytes(3))]
    )
    with pytest.raises(ValueError, match="request 'img'"):
        await collect(engine, request)


async def test_zero_max_tokens_is_a_value_error(engine: VLLMEngine) -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        await collect(engine, EngineRequest(id="zero", max_tokens=0, prompt="a"))


async def test_abort_ends_a_running_request_early(
    engine: VLLMEngine, vllm_outputs: dict[str, list[Any]]
) -> None:
    running = Streaming(engine, EngineRequest(id="long", max_tokens=LONG, prompt="while"), [])
    await running.wait_tokens(3)
    with pytest.raises(ValueError, match="already running"):
        await collect(engine, EngineRequest(id="long", max_tokens=4, prompt="again"))
    await engine.abort("long")
    final = await running.done()
    assert final.finish_reason == "abort"
    assert 3 <= final.output_tokens < 2_000
    assert_usage(running.deltas, vllm_outputs["long"])
    # Unknown and finished ids are no-ops.
    await engine.abort("long")
    await engine.abort("never-seen")
    assert engine.healthy


async def test_abort_ends_a_queued_request(engine: VLLMEngine) -> None:
    blocker = Streaming(engine, EngineRequest(id="blocker", max_tokens=LONG, prompt="for"), [])
    await blocker.wait_tokens(1)
    queued = Streaming(engine, EngineRequest(id="queued", max_tokens=8, prompt="if"), [])
    await until_unfinished(engine, 2)
    await engine.abort("queued")
    final = await queued.done()
    assert not blocker.task.done(), "the queued request only ended when the blocker did"
    assert (final.finish_reason, final.output_tokens) == ("abort", 0)
    await engine.abort("blocker")
    assert (await blocker.done()).finish_reason == "abort"


async def test_closing_a_stream_releases_the_request_in_vllm(engine: VLLMEngine) -> None:
    """What the worker does when a request is stopped between outputs: it leaves the stream
    and closes it. vLLM must have dropped the request when aclose() returns, not whenever
    the garbage collector finalizes what the engine left open."""
    stream = engine.generate(EngineRequest(id="closed", max_tokens=LONG, prompt="while"))
    tokens = 0
    async for delta in stream:
        tokens += delta.token_count
        if tokens >= 3:
            break
    await stream.aclose()
    assert engine.llm.get_num_unfinished_requests() == 0
    await engine.abort("closed")  # a no-op now


@pytest.mark.parametrize("step", ["rendering", "registering"])
async def test_an_abort_before_vllm_knows_the_request_ends_it_at_once(
    engine: VLLMEngine, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    """The abort lands while the prompt is rendered, or while vLLM registers the request
    (vLLM's own abort cannot find it yet). The request waits behind a running one, so it
    would produce its first output only when that one ends: the abort must not wait for it."""
    blocker = Streaming(engine, EngineRequest(id="blocker", max_tokens=LONG, prompt="for"), [])
    await blocker.wait_tokens(1)
    if step == "rendering":
        gate = Gate(engine.llm.renderer.render_cmpl_async)
        monkeypatch.setattr(engine.llm.renderer, "render_cmpl_async", gate)
    else:
        gate = Gate(engine.llm.add_request)
        monkeypatch.setattr(engine.llm, "add_request", gate)
    early = Streaming(engine, EngineRequest(id="early", max_tokens=8, prompt="if"), [])
    await gate.wait_reached()
    await engine.abort("early")
    gate.open()
    final = await early.done()
    assert (final.finish_reason, final.output_tokens) == ("abort", 0)
    assert not blocker.task.done(), "the abort waited for the request's first output"
    assert engine.llm.get_num_unfinished_requests() == 1  # the blocker only
    await engine.abort("blocker")
    assert (await blocker.done()).finish_reason == "abort"


async def test_cancelling_while_vllm_registers_the_request_leaves_nothing_in_vllm(
    engine: VLLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM records a request before it hands it to its engine core; a consumer cancelled
    in between (the worker does so at its drain timeout) must not leave it there."""
    gate = Gate(engine.llm.engine_core.add_request_async)
    monkeypatch.setattr(engine.llm.engine_core, "add_request_async", gate)
    cancelled = Streaming(engine, EngineRequest(id="cancelled", max_tokens=8, prompt="if"), [])
    await gate.wait_reached()
    cancelled.task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled.task
    assert engine.llm.get_num_unfinished_requests() == 0
    monkeypatch.undo()
    again = Streaming(engine, EngineRequest(id="cancelled", max_tokens=4, prompt="if"), [])
    assert (await again.done()).finish_reason == "length"  # the id is free again


async def test_higher_fairq_priority_is_served_first(engine: VLLMEngine) -> None:
    order: list[str] = []
    blocker = Streaming(engine, EngineRequest(id="blocker", max_tokens=LONG, prompt="try"), order)
    await blocker.wait_tokens(1)
    # Queued one by one, in this order, while the only sequence slot is taken.
    priorities = {"low": 1, "mid": 3, "high": 9, "mid-later": 3}
    waiting = []
    for rid, priority in priorities.items():
        request = EngineRequest(id=rid, max_tokens=4, prompt="class", priority=priority)
        waiting.append(Streaming(engine, request, order))
        await until_unfinished(engine, 1 + len(waiting))
    await engine.abort("blocker")
    for streaming in [blocker, *waiting]:
        await streaming.done()
    assert order == ["blocker", "high", "mid", "mid-later", "low"]


async def test_a_dead_engine_fails_requests_and_reports_unhealthy(model_dir: Path) -> None:
    """Its own engine: the module's one must survive. Kills only the engine core it started."""
    import psutil

    config = VLLMEngineConfig(model=str(model_dir), kv_cache_bytes=KV_CACHE_BYTES, ignore_eos=True)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    async with VLLMEngine(config) as doomed:
        running = Streaming(doomed, EngineRequest(id="doomed", max_tokens=LONG, prompt="x"), [])
        await running.wait_tokens(1)
        [core] = [
            p
            for p in psutil.Process().children(recursive=True)
            if p.pid not in before and p.name() == "VLLM::EngineCore"
        ]
        core.kill()
        with pytest.raises(EngineError):
            await running.done()
        assert not doomed.healthy
        with pytest.raises(EngineError):
            await collect(doomed, EngineRequest(id="after", max_tokens=4, prompt="x"))


async def test_a_busy_worker_answers_a_probe_in_the_slot_it_keeps_free(model_dir: Path) -> None:
    """Its own engine of two sequences: the worker advertises one (`advertised`), which a
    long request fills, as the dispatcher would; a probe then runs in the other slot at
    the top priority and is answered well within the dispatcher's default timeout."""
    import time

    from broker_config.config import DispatcherOptions
    from broker_config.wire import SubmitRequest
    from broker_config.wire_internal import BatchItem
    from workers.probe import advertised, answer_probe

    config = VLLMEngineConfig(
        model=str(model_dir),
        max_num_seqs=2,
        max_model_len=8192,
        kv_cache_bytes=KV_CACHE_BYTES,
        ignore_eos=True,
    )
    async with VLLMEngine(config) as busy:
        assert advertised(busy.capacity).sequences == 1
        running = Streaming(busy, EngineRequest(id="long", max_tokens=LONG, prompt="x"), [])
        await running.wait_tokens(1)
        timeout_s = DispatcherOptions().probe_timeout_s
        sent = time.time()
        probe = BatchItem(
            id="p-1",
            tenant="fairq-probe",
            endpoint="chat",
            request=SubmitRequest(id="p-1", prompt="ping", max_tokens=1, deadline=sent + timeout_s),
            max_tokens=1,
            enqueued_at=sent,
            dispatched_at=sent,
            probe=True,
        )
        answer = await answer_probe(busy, probe, "vllm-1")
        took_s = time.time() - sent
        assert answer is not None and answer.probe and answer.code is None, answer
        assert answer.usage.output_tokens == 1
        assert took_s < timeout_s / 2, took_s
        assert not running.task.done()  # the long request kept running beside it
        await busy.abort("long")
        await running.done()


# -- sampling, logprobs, embeddings -----------------------------------------------------------


def sampled(rid: str, max_tokens: int = 16, **sampling: Any) -> EngineRequest:
    # A prompt shorter than one KV block: no run finds it in the prefix cache.
    return EngineRequest(
        id=rid, max_tokens=max_tokens, prompt="def main():", sampling=Sampling(**sampling)
    )


async def text_of(engine: VLLMEngine, request: EngineRequest) -> tuple[str, Delta]:
    deltas = await collect(engine, request)
    return "".join(d.text for d in deltas), deltas[-1]


async def test_the_same_seed_gives_the_same_text(engine: VLLMEngine) -> None:
    first, _ = await text_of(engine, sampled("seed-1", temperature=1.0, seed=7))
    again, _ = await text_of(engine, sampled("seed-2", temperature=1.0, seed=7))
    other, _ = await text_of(engine, sampled("seed-3", temperature=1.0, seed=8))
    assert first and again == first
    assert other != first  # the seed is what makes it repeat: it is sampled


async def test_temperature_zero_is_deterministic(engine: VLLMEngine) -> None:
    first, _ = await text_of(engine, sampled("greedy-1", temperature=0.0))
    again, _ = await text_of(engine, sampled("greedy-2", temperature=0.0))
    assert first and again == first


async def test_top_k_reaches_vllm(engine: VLLMEngine) -> None:
    """top_k 1 samples greedily; 0 (off) and one beyond the vocabulary (vLLM caps it) let
    every token be sampled, the same way with the same seed."""
    greedy, _ = await text_of(engine, sampled("k-greedy", temperature=0.0))
    top_1, _ = await text_of(engine, sampled("k-1", temperature=1.0, seed=7, top_k=1))
    off, _ = await text_of(engine, sampled("k-0", temperature=1.0, seed=7, top_k=0))
    huge, _ = await text_of(engine, sampled("k-huge", temperature=1.0, seed=7, top_k=2**31 - 1))
    assert top_1 == greedy
    assert huge == off != greedy


async def test_a_stop_string_ends_the_output_right_before_it(engine: VLLMEngine) -> None:
    text, final = await text_of(engine, sampled("unstopped", 24, temperature=1.0, seed=11))
    assert final.finish_reason == "length"
    middle = len(text) // 2
    stop = text[middle : middle + 3]
    stopped, final = await text_of(
        engine, sampled("stopped", 24, temperature=1.0, seed=11, stop=[stop])
    )
    assert stopped == text[: text.index(stop)]
    assert stop not in stopped
    assert final.finish_reason == "stop"
    assert final.output_tokens < 24


async def test_logprobs_come_with_every_token_when_asked(engine: VLLMEngine) -> None:
    deltas = await collect(engine, sampled("logprobs", 6, temperature=0.0, logprobs=2))
    entries = []
    for delta in deltas:
        assert delta.logprobs is not None and len(delta.logprobs) == delta.token_count
        entries += delta.logprobs
    assert len(entries) == deltas[-1].output_tokens == 6
    # Each token's text as vLLM decoded it (this output has no token splitting a character).
    assert "".join(entry.token for entry in entries) == "".join(d.text for d in deltas)
    for entry in entries:
        assert entry.logprob <= 0
        assert len(entry.top) == 2 and entry.top[0].logprob >= entry.top[1].logprob
        assert entry.logprob == entry.top[0].logprob  # greedy: the most likely token

    plain = await collect(engine, sampled("no-logprobs", 6, temperature=0.0))
    assert all(delta.logprobs is None for delta in plain)
    only_own = await collect(engine, sampled("own-logprob", 2, logprobs=0))
    assert [len(e.top) for d in only_own for e in d.logprobs or ()] == [0, 0]


@pytest.mark.parametrize(
    "sampling, match",
    [
        (Sampling(top_p=0.0), "top_p"),  # rejected when vLLM's parameters are made
        (Sampling(logprobs=21), "logprobs"),  # rejected when vLLM registers the request
    ],
)
async def test_sampling_values_vllm_rejects_are_value_errors(
    engine: VLLMEngine, sampling: Sampling, match: str
) -> None:
    """The wire schema keeps such values out (no value it allows is rejected by vLLM 0.32:
    it caps top_k at the vocabulary); built past the schema, they must still be a bad
    request, not an engine failure."""
    with pytest.raises(ValueError, match=match):
        await collect(engine, EngineRequest(id="bad", max_tokens=2, prompt="a", sampling=sampling))
    assert engine.healthy and engine.llm.get_num_unfinished_requests() == 0


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def embedder(model_dir: Path) -> AsyncIterator[VLLMEngine]:
    config = VLLMEngineConfig(
        model=str(model_dir), max_num_seqs=1, max_model_len=8192, kv_cache_bytes=KV_CACHE_BYTES
    )
    async with VLLMEngine(config, embed=True) as running:
        yield running


def embed(rid: str, prompt: str) -> EngineRequest:
    return EngineRequest(id=rid, max_tokens=1, prompt=prompt, embed=True)


async def test_an_embedding_engine_returns_the_inputs_vector(
    embedder: VLLMEngine, tokenizer: Any
) -> None:
    # Its limits are read as a generation engine's are.
    assert embedder.capacity.sequences == 1
    assert embedder.capacity.tokens == KV_CACHE_BYTES // KV_BYTES_PER_TOKEN
    finals = {}
    for rid, prompt in [("e1", "import os"), ("e2", "import os"), ("e3", "class A: pass")]:
        [final] = await collect(embedder, embed(rid, prompt))
        assert (final.finished, final.finish_reason, final.output_tokens) == (True, "stop", 0)
        assert final.ttft_s is None  # no token
        assert final.input_tokens == embedder.count_tokens(embed(rid, prompt))
        assert final.embedding is not None and len(final.embedding) == HIDDEN_SIZE
        finals[rid] = final.embedding
    assert finals["e1"] == finals["e2"] != finals["e3"]
    chat = EngineRequest(
        id="e-chat", max_tokens=1, messages=[ChatMessage("user", "hi")], embed=True
    )
    [final] = await collect(embedder, chat)
    # The messages alone, without the assistant's turn a generation would open.
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=False
    )
    assert final.input_tokens == embedder.count_tokens(chat)
    assert final.input_tokens == len(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert final.embedding is not None and len(final.embedding) == HIDDEN_SIZE


async def test_an_engine_serves_only_its_own_kind_of_request(
    engine: VLLMEngine, embedder: VLLMEngine
) -> None:
    with pytest.raises(ValueError, match="embedding engine"):
        await collect(embedder, EngineRequest(id="gen", max_tokens=2, prompt="a"))
    with pytest.raises(ValueError, match="generation engine"):
        await collect(engine, embed("emb", "a"))


async def test_an_abort_while_vllm_registers_an_embedding_ends_it(
    embedder: VLLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's abort output of a pooling request (an empty tensor) ends it as aborted."""
    gate = Gate(embedder.llm.add_request)
    monkeypatch.setattr(embedder.llm, "add_request", gate)
    early = Streaming(embedder, embed("early", "import sys"), [])
    await gate.wait_reached()
    await embedder.abort("early")
    gate.open()
    final = await early.done()
    assert (final.finish_reason, final.output_tokens, final.embedding) == ("abort", 0, None)
    assert embedder.llm.get_num_unfinished_requests() == 0
