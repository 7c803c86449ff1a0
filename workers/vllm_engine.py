"""The vLLM engine behind the Engine protocol; the only module of fairq that imports vllm.

vllm is imported when an engine starts, not when this module is imported, so code that
only names `VLLMEngine` runs in environments without vllm. Prompts are rendered with
vLLM's own renderer (its tokenizer, and the model's chat template for messages), so
`count_tokens` is exactly what the engine sees.

An engine started with `embed=True` runs the model as an embedding model (vLLM's pooling
runner) and serves only embedding requests; otherwise it serves only generation requests.

Starting blocks the event loop for the engine's startup (about 20 s on a CPU with the
tiny model): vLLM wires its output handler to the running loop, so it is built on it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

import msgspec

from broker_config.wire import ChatMessage, Sampling, TokenLogprob, TopLogprob
from costmodel.units import UNLIMITED_MODEL_UNITS, Capacity
from workers.engine import Delta, EngineError, EngineRequest

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.outputs import CompletionOutput, PoolingRequestOutput, RequestOutput
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    Output = RequestOutput | PoolingRequestOutput

log = logging.getLogger(__name__)

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]

# On CPU this legacy variable overrides kv_cache_memory_bytes whenever it is set.
CPU_KV_ENV = "VLLM_CPU_KVCACHE_SPACE"
# Sampling fields passed to vLLM under the same name and meaning (top_k 0 is "off" in both),
# when the request sets them; `stop` and `n` are handled apart.
_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logprobs",
)


class VLLMEngineConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Knobs of a vLLM engine; the defaults suit a small model on a CPU.

    Build it with `msgspec.convert(mapping, VLLMEngineConfig)` to have the constraints checked.
    """

    model: str  # a local model directory (or a hub name where the hub is reachable)
    dtype: str = "bfloat16"
    max_num_seqs: PositiveInt = 8
    max_model_len: PositiveInt | None = None  # None: the model's own context length
    max_num_batched_tokens: PositiveInt | None = None  # None: vLLM's default for the platform
    # KV-cache size. None leaves it to vLLM: a share of GPU memory, but on a CPU 92% of RAM
    # (or VLLM_CPU_KVCACHE_SPACE GiB), so keep it set there.
    kv_cache_bytes: PositiveInt | None = 1 << 30
    enforce_eager: bool = True  # CUDA graphs / torch.compile cost startup time and memory
    # Generate exactly max_tokens, as calibration and load tests need.
    ignore_eos: bool = False
    # Reuse the KV cache of prompt prefixes computed before (what affinity routing buys).
    enable_prefix_caching: bool = True
    seed: int = 0
    # Reported capacity in model units.
    model_units: Annotated[float, msgspec.Meta(gt=0)] = UNLIMITED_MODEL_UNITS


class VLLMEngine:
    """An Engine running a vLLM AsyncLLM in this process (its engine core in a child)."""

    def __init__(self, config: VLLMEngineConfig, *, embed: bool = False) -> None:
        self._config = config
        self._embed = embed  # an embedding model, serving embedding requests only
        self._llm: AsyncLLM | None = None
        self._capacity: Capacity | None = None
        # Requests inside generate(), by id, until vLLM has let go of them.
        self._live: dict[str, _Live] = {}

    @property
    def llm(self) -> AsyncLLM:
        """The underlying vLLM engine, for metrics and diagnostics."""
        if self._llm is None:
            raise EngineError("the vLLM engine is not running")
        return self._llm

    @property
    def capacity(self) -> Capacity:
        if self._capacity is None:
            raise EngineError("the vLLM engine is not running")
        return self._capacity

    @property
    def healthy(self) -> bool:
        return self._llm is not None and not self._llm.errored

    @property
    def accepts_images(self) -> bool:
        """The model takes images (a vision-language model; the tiny test model does not)."""
        return self.llm.model_config.supports_multimodal_inputs

    async def __aenter__(self) -> VLLMEngine:
        if self._llm is not None:
            raise RuntimeError("this VLLMEngine is already running")
        self._llm = _start(self._config, self._embed)
        self._capacity = _capacity_of(self._llm.vllm_config, self._config.model_units)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        llm, self._llm, self._capacity = self._llm, None, None
        if llm is None:
            return
        registered = []
        for live in self._live.values():
            live.aborted = True
            if live.vllm_id is not None:
                registered.append(live.vllm_id)
        if registered and not llm.errored:
            # Lets every open generate() end with its abort delta instead of hanging.
            await llm.abort(registered, internal=True)
        llm.shutdown()

    def count_tokens(self, request: EngineRequest) -> int:
        renderer = self.llm.renderer
        try:
            if request.messages is not None:
                _, (prompt,) = renderer.render_chat([_chat(request)], self._chat_params())
            else:
                (prompt,) = renderer.render_cmpl([_text_prompt(request)])
        except _client_errors() as exc:
            raise ValueError(f"request {request.id!r}: {exc}") from exc
        return len(prompt["prompt_token_ids"])

    async def generate(self, request: EngineRequest) -> AsyncIterator[Delta]:
        """Stream one request (see the Engine protocol).

        The request is known to `abort` from the first iteration until vLLM has let go of
        it: an abort while the prompt is rendered ends it before vLLM sees it, one while
        vLLM registers it aborts it in vLLM as soon as registration returns, and closing
        the stream early (the consumer stops reading) drops it in vLLM before aclose()
        returns. Nothing is left to the garbage collector, and no abort is a no-op while
        vLLM still runs the request.

        An embedding request yields one delta, its final one, with the embedding.
        """
        from vllm.exceptions import VLLMClientError

        llm = self.llm
        if request.id in self._live:
            raise ValueError(f"request {request.id!r} is already running")
        if request.embed != self._embed:
            kind = "an embedding" if self._embed else "a generation"
            raise ValueError(f"request {request.id!r}: this is {kind} engine")
        live = self._live[request.id] = _Live()
        queue = None
        finished = False
        try:
            accepted = time.monotonic()
            prompt, params = await self._prepare(llm, request)
            usage = _Usage(
                request.id,
                len(prompt["prompt_token_ids"]),
                accepted,
                None if self._embed else params.logprobs,
            )
            if live.aborted:  # during rendering: vLLM never sees it
                finished = True
                yield usage.final("", 0, "abort", None)
                return
            try:
                try:
                    # vLLM runs the lowest priority value first; fairq serves the highest
                    # first.
                    queue = await llm.add_request(
                        request.id, prompt, params, priority=-request.priority
                    )
                except BaseException:
                    # Cancelled or failed while vLLM registered it: vLLM may hold it
                    # already. By its external id: no other request runs with that id.
                    if not llm.errored:
                        await llm.abort(request.id)
                    raise
                live.vllm_id = queue.request_id
                if live.aborted:
                    # Asked for while vLLM registered it, when vLLM's abort could not find
                    # it yet; its abort output follows at once.
                    await llm.abort(live.vllm_id, internal=True)
                while True:
                    out = queue.get_nowait() or await queue.get()
                    delta = usage.pooled(out) if self._embed else usage.generated(out)
                    finished = delta.finished
                    if finished or delta.token_count or delta.text:
                        yield delta
                    if finished:
                        return
            except VLLMClientError as exc:
                raise ValueError(f"request {request.id!r}: {exc}") from exc
            except EngineError:
                raise
            except Exception as exc:
                raise EngineError(f"vLLM failed request {request.id!r}: {exc!r}") from exc
        finally:
            try:
                if queue is not None and not finished and not llm.errored:
                    # Left early (the consumer closed the stream, or was cancelled): vLLM
                    # drops the request now, while `abort` can still find it.
                    await llm.abort(queue.request_id, internal=True)
            finally:
                # Even if that abort fails or is cancelled, the id may run again.
                if queue is not None:
                    queue.close()
                del self._live[request.id]

    async def abort(self, request_id: str) -> None:
        live = self._live.get(request_id)
        if live is None or live.aborted or self._llm is None:
            return
        live.aborted = True
        if live.vllm_id is not None:
            # vLLM ends the stream with an abort output. Before registration, generate()
            # sees the flag: after rendering, or as soon as vLLM has registered it.
            await self._llm.abort(live.vllm_id, internal=True)

    async def _prepare(self, llm: AsyncLLM, request: EngineRequest) -> tuple[Any, Any]:
        """The rendered prompt and vLLM's parameters; ValueError if the request is bad (some
        bad sampling values vLLM finds only when it registers the request)."""
        from vllm.pooling_params import PoolingParams

        params: PoolingParams | SamplingParams
        try:
            if self._embed:
                params = PoolingParams(task="embed")
            else:
                params = _sampling_params(request, self._config.ignore_eos)
            if request.messages is not None:
                _, (prompt,) = await llm.renderer.render_chat_async(
                    [_chat(request)], self._chat_params()
                )
            else:
                (prompt,) = await llm.renderer.render_cmpl_async([_text_prompt(request)])
        except _client_errors() as exc:
            raise ValueError(f"request {request.id!r}: {exc}") from exc
        return prompt, params

    def _chat_params(self) -> Any:
        from vllm.renderers.params import ChatParams

        # A generation's template ends with the assistant's turn opened, as chat completion
        # does; an embedding embeds the messages alone, as vLLM's embedding API does.
        return ChatParams(chat_template_kwargs={"add_generation_prompt": not self._embed})


@dataclass(slots=True, eq=False)
class _Live:
    """One request from the first iteration of generate() until vLLM let go of it."""

    aborted: bool = False
    # vLLM's internal id (the request id plus a random suffix), once vLLM registered it.
    vllm_id: str | None = None


class _Usage:
    """Token counts and time to first token of one request while it streams, and the deltas
    made of vLLM's outputs."""

    def __init__(
        self, request_id: str, input_tokens: int, accepted: float, top_logprobs: int | None
    ) -> None:
        self.request_id = request_id
        self.input_tokens = input_tokens
        self.output_tokens = 0
        self.accepted = accepted
        self.first_token_at: float | None = None
        self.top_logprobs = top_logprobs  # None: the request did not ask for logprobs

    def generated(self, out: RequestOutput) -> Delta:
        """The delta of one output of a generation (DELTA mode: only what is new)."""
        completion = out.outputs[0]
        count = len(completion.token_ids)
        if count and self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self.output_tokens += count
        logprobs = (
            None if self.top_logprobs is None else _token_logprobs(completion, self.top_logprobs)
        )
        if out.finished:
            return self.final(completion.text, count, completion.finish_reason, out, logprobs)
        return Delta(completion.text, count, logprobs=logprobs)

    def pooled(self, out: PoolingRequestOutput) -> Delta:
        """The final delta of an embedding: vLLM's only output of a pooling request."""
        if out.error is not None:
            raise EngineError(f"vLLM failed request {self.request_id!r}: {out.error.message}")
        data = out.outputs.data
        if not data.numel():  # vLLM's abort output carries an empty tensor
            return self.final("", 0, "abort", out)
        return self.final("", 0, "stop", out, embedding=data.tolist())

    def final(
        self,
        text: str,
        count: int,
        reason: str | None,
        out: Output | None,
        logprobs: list[TokenLogprob] | None = None,
        embedding: list[float] | None = None,
    ) -> Delta:
        if reason == "error":
            raise EngineError(f"vLLM failed request {self.request_id!r} (finish reason error)")
        self._check_against_engine(out)
        return Delta(
            text,
            count,
            finished=True,
            finish_reason=reason,
            input_tokens=self.input_tokens,
            output_tokens=self.output_tokens,
            # What vLLM's prefix cache held of the prompt (absent: prefix caching off).
            cached_input_tokens=getattr(out, "num_cached_tokens", None) or 0,
            ttft_s=None if self.first_token_at is None else self.first_token_at - self.accepted,
            # No engine_s: vLLM attributes no engine time per request, so the worker
            # measures it from its own occupancy (workers.engine_time).
            logprobs=logprobs,
            embedding=embedding,
        )

    def _check_against_engine(self, out: Output | None) -> None:
        """Warn when the streamed counts disagree with vLLM's own (stats enabled only)."""
        if out is None:
            return
        # A pooling output has no metrics.
        generated = getattr(getattr(out, "metrics", None), "num_generation_tokens", None)
        if generated is not None and generated != self.output_tokens:
            log.warning(
                "request %s: streamed %d output tokens but vLLM counted %d",
                self.request_id,
                self.output_tokens,
                generated,
            )
        if len(out.prompt_token_ids or ()) != self.input_tokens:
            log.warning(
                "request %s: rendered %d input tokens but vLLM ran %d",
                self.request_id,
                self.input_tokens,
                len(out.prompt_token_ids or ()),
            )


def _sampling_params(request: EngineRequest, ignore_eos: bool) -> SamplingParams:
    """vLLM's sampling parameters of a request; a field it does not set keeps vLLM's default.
    vLLM raises a VLLMValidationError for values it rejects."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    sampling = request.sampling or Sampling()
    chosen = {
        name: value for name in _SAMPLING_FIELDS if (value := getattr(sampling, name)) is not None
    }
    return SamplingParams(
        max_tokens=request.max_tokens,
        ignore_eos=ignore_eos,
        output_kind=RequestOutputKind.DELTA,
        # vLLM leaves the stop strings out of the text and finishes with reason "stop".
        stop=list(sampling.stop),
        **chosen,
    )


def _token_logprobs(completion: CompletionOutput, top: int) -> list[TokenLogprob]:
    """One entry per new token of a DELTA-mode output. vLLM gives a dict per token, by token
    id: the sampled token (with its rank in the vocabulary) and the `top` most likely (ranks
    1..top), overlapping when the sampled token is among them."""
    entries = []
    for token_id, position in zip(completion.token_ids, completion.logprobs or (), strict=True):
        sampled = position[token_id]
        ranked = sorted(position.values(), key=lambda logprob: logprob.rank)[:top]
        entries.append(
            TokenLogprob(
                sampled.decoded_token or "",
                sampled.logprob,
                [TopLogprob(alt.decoded_token or "", alt.logprob) for alt in ranked],
            )
        )
    return entries


def _start(config: VLLMEngineConfig, embed: bool) -> AsyncLLM:
    if config.kv_cache_bytes is not None and os.environ.get(CPU_KV_ENV, ""):
        raise EngineError(
            f"{CPU_KV_ENV} is set and would override kv_cache_bytes on a CPU; unset one of them"
        )
    # vLLM reports usage statistics to its servers unless told not to.
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(
        model=config.model,
        dtype=config.dtype,
        max_num_seqs=config.max_num_seqs,
        max_model_len=config.max_model_len,
        max_num_batched_tokens=config.max_num_batched_tokens,
        kv_cache_memory_bytes=config.kv_cache_bytes,
        enforce_eager=config.enforce_eager,
        enable_prefix_caching=config.enable_prefix_caching,
        seed=config.seed,
        scheduling_policy="priority",
        # vLLM adapts a generative model into an embedding model (last token, normalized).
        runner="pooling" if embed else "auto",
        convert="embed" if embed else "auto",
        # Keeps per-request stats (num_generation_tokens) that usage is checked against.
        disable_log_stats=False,
    )
    try:
        return AsyncLLM.from_engine_args(args)
    except Exception as exc:
        raise EngineError(f"vLLM failed to start model {config.model!r}: {exc!r}") from exc


def _capacity_of(vllm_config: VllmConfig, model_units: float) -> Capacity:
    """The engine's real limits, read after startup sized the KV cache."""
    scheduler = vllm_config.scheduler_config
    cache = vllm_config.cache_config
    if cache.num_gpu_blocks:
        kv_tokens = cache.num_gpu_blocks * cache.block_size
    else:
        kv_tokens = scheduler.max_num_seqs * vllm_config.model_config.max_model_len
    return Capacity(scheduler.max_num_seqs, kv_tokens, model_units)


def _text_prompt(request: EngineRequest) -> dict[str, Any]:
    if request.prompt is None:
        raise ValueError("it has neither a prompt nor messages")
    prompt: dict[str, Any] = {"prompt": request.prompt}
    if request.images:
        # The prompt holds the model's own image placeholders, as with vLLM's generate().
        prompt["multi_modal_data"] = {"image": _pil_images(request)}
    return prompt


def _chat(request: EngineRequest) -> list[dict[str, Any]]:
    if request.prompt is not None:
        raise ValueError("it has both a prompt and messages")
    messages: list[ChatMessage] = request.messages or []
    if not messages:
        raise ValueError("its message list is empty")
    chat: list[dict[str, Any]] = [{"role": m.role, "content": m.content} for m in messages]
    if request.images:
        # The wire carries a request's images apart from its messages: they go with the
        # last user message, before its text, where chat clients put them.
        users = [entry for entry in chat if entry["role"] == "user"]
        if not users:
            raise ValueError("it has images but no user message to put them in")
        users[-1]["content"] = [
            *({"type": "image_pil", "image_pil": image} for image in _pil_images(request)),
            {"type": "text", "text": users[-1]["content"]},
        ]
    return chat


def _pil_images(request: EngineRequest) -> list[Any]:
    from PIL import Image

    return [
        Image.frombuffer("RGB", (image.width, image.height), image.rgb) for image in request.images
    ]


def _client_errors() -> tuple[type[Exception], ...]:
    """What vLLM raises for a bad request (too long, bad template input), not a failure."""
    from vllm.exceptions import VLLMClientError

    return (VLLMClientError, ValueError, TypeError)
