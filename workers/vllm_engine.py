"""The vLLM engine behind the Engine protocol; the only module of fairq that imports vllm.

vllm is imported when an engine starts, not when this module is imported, so code that
only names `VLLMEngine` runs in environments without vllm. Prompts are rendered with
vLLM's own renderer (its tokenizer, and the model's chat template for messages), so
`count_tokens` is exactly what the engine sees.

Starting blocks the event loop for the engine's startup (about 20 s on a CPU with the
tiny model): vLLM wires its output handler to the running loop, so it is built on it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Annotated, Any

import msgspec

from broker_config.wire import ChatMessage
from costmodel.units import UNLIMITED_MODEL_UNITS, Capacity
from workers.engine import Delta, EngineError, EngineRequest

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.outputs import RequestOutput
    from vllm.v1.engine.async_llm import AsyncLLM

log = logging.getLogger(__name__)

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]

# On CPU this legacy variable overrides kv_cache_memory_bytes whenever it is set.
CPU_KV_ENV = "VLLM_CPU_KVCACHE_SPACE"


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
    seed: int = 0
    # Reported capacity in model units.
    model_units: Annotated[float, msgspec.Meta(gt=0)] = UNLIMITED_MODEL_UNITS


class VLLMEngine:
    """An Engine running a vLLM AsyncLLM in this process (its engine core in a child)."""

    def __init__(self, config: VLLMEngineConfig) -> None:
        self._config = config
        self._llm: AsyncLLM | None = None
        self._capacity: Capacity | None = None
        # Requests inside generate(), by id: True once an abort was asked for.
        self._aborting: dict[str, bool] = {}

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

    async def __aenter__(self) -> VLLMEngine:
        if self._llm is not None:
            raise RuntimeError("this VLLMEngine is already running")
        self._llm = _start(self._config)
        self._capacity = _capacity_of(self._llm.vllm_config, self._config.model_units)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        llm, self._llm, self._capacity = self._llm, None, None
        if llm is None:
            return
        if self._aborting and not llm.errored:
            # Lets every open generate() end with its abort delta instead of hanging.
            await llm.abort(list(self._aborting))
        llm.shutdown()

    def count_tokens(self, request: EngineRequest) -> int:
        renderer = self.llm.renderer
        try:
            if request.messages is not None:
                _, (prompt,) = renderer.render_chat([_chat(request)], _chat_params())
            else:
                (prompt,) = renderer.render_cmpl([_text_prompt(request)])
        except _client_errors() as exc:
            raise ValueError(f"request {request.id!r}: {exc}") from exc
        return len(prompt["prompt_token_ids"])

    async def generate(self, request: EngineRequest) -> AsyncIterator[Delta]:
        llm = self.llm
        if request.id in self._aborting:
            raise ValueError(f"request {request.id!r} is already running")
        self._aborting[request.id] = False
        try:
            async for delta in self._stream(llm, request):
                yield delta
        finally:
            del self._aborting[request.id]

    async def abort(self, request_id: str) -> None:
        if request_id not in self._aborting or self._llm is None:
            return
        self._aborting[request_id] = True
        await self._llm.abort(request_id)

    async def _prepare(self, llm: AsyncLLM, request: EngineRequest) -> tuple[Any, Any]:
        """The rendered prompt and sampling parameters; ValueError if the request is bad."""
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        try:
            params = SamplingParams(
                max_tokens=request.max_tokens,
                ignore_eos=self._config.ignore_eos,
                output_kind=RequestOutputKind.DELTA,
            )
            if request.messages is not None:
                _, (prompt,) = await llm.renderer.render_chat_async(
                    [_chat(request)], _chat_params()
                )
            else:
                (prompt,) = await llm.renderer.render_cmpl_async([_text_prompt(request)])
        except _client_errors() as exc:
            raise ValueError(f"request {request.id!r}: {exc}") from exc
        return prompt, params

    async def _stream(self, llm: AsyncLLM, request: EngineRequest) -> AsyncIterator[Delta]:
        from vllm.exceptions import VLLMClientError

        accepted = time.monotonic()
        prompt, params = await self._prepare(llm, request)
        usage = _Usage(request.id, len(prompt["prompt_token_ids"]), accepted)
        if self._aborting[request.id]:
            yield usage.final("", 0, "abort", None)
            return
        # vLLM runs the lowest priority value first; fairq serves the highest first.
        outputs = llm.generate(prompt, params, request.id, priority=-request.priority)
        try:
            async for out in outputs:
                completion = out.outputs[0]
                count = len(completion.token_ids)
                usage.add(count)
                # An abort that came before vLLM registered the request is seen here.
                if out.finished or self._aborting[request.id]:
                    reason = completion.finish_reason if out.finished else "abort"
                    yield usage.final(completion.text, count, reason, out)
                    return
                if count or completion.text:
                    yield Delta(completion.text, count)
        except VLLMClientError as exc:
            raise ValueError(f"request {request.id!r}: {exc}") from exc
        except EngineError:
            raise
        except Exception as exc:
            raise EngineError(f"vLLM failed request {request.id!r}: {exc!r}") from exc
        finally:
            # Leaving early (abort, or the consumer closed us) makes vLLM drop the request.
            await outputs.aclose()
        raise EngineError(f"vLLM ended request {request.id!r} without a final output")


class _Usage:
    """Token counts and time to first token of one request while it streams."""

    def __init__(self, request_id: str, input_tokens: int, accepted: float) -> None:
        self.request_id = request_id
        self.input_tokens = input_tokens
        self.output_tokens = 0
        self.accepted = accepted
        self.first_token_at: float | None = None

    def add(self, count: int) -> None:
        if count and self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self.output_tokens += count

    def final(
        self, text: str, count: int, reason: str | None, out: RequestOutput | None
    ) -> Delta:
        if reason == "error":
            raise EngineError(f"vLLM failed request {self.request_id!r} (finish reason error)")
        self._check_against_engine(out)
        return Delta(
            text,
            count,
            finished=True,
            input_tokens=self.input_tokens,
            output_tokens=self.output_tokens,
            ttft_s=None if self.first_token_at is None else self.first_token_at - self.accepted,
            finish_reason=reason,
        )

    def _check_against_engine(self, out: RequestOutput | None) -> None:
        """Warn when the streamed counts disagree with vLLM's own (stats enabled only)."""
        if out is None:
            return
        generated = getattr(out.metrics, "num_generation_tokens", None)
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


def _start(config: VLLMEngineConfig) -> AsyncLLM:
    if config.kv_cache_bytes is not None and os.environ.get(CPU_KV_ENV, ""):
        raise EngineError(
            f"{CPU_KV_ENV} is set and would override kv_cache_bytes on a CPU; "
            "unset one of them"
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
        seed=config.seed,
        scheduling_policy="priority",
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


def _text_prompt(request: EngineRequest) -> dict[str, str]:
    _check_text_only(request)
    if request.prompt is None:
        raise ValueError("it has neither a prompt nor messages")
    return {"prompt": request.prompt}


def _chat(request: EngineRequest) -> list[dict[str, str]]:
    _check_text_only(request)
    if request.prompt is not None:
        raise ValueError("it has both a prompt and messages")
    messages: list[ChatMessage] = request.messages or []
    if not messages:
        raise ValueError("its message list is empty")
    return [{"role": m.role, "content": m.content} for m in messages]


def _check_text_only(request: EngineRequest) -> None:
    if request.images:
        raise ValueError("it has images, and VLLMEngine takes text requests only")


def _chat_params() -> Any:
    from vllm.renderers.params import ChatParams

    # The template ends with the assistant's turn opened, as chat completion does.
    return ChatParams(chat_template_kwargs={"add_generation_prompt": True})


def _client_errors() -> tuple[type[Exception], ...]:
    """What vLLM raises for a bad request (too long, bad template input), not a failure."""
    from vllm.exceptions import VLLMClientError

    return (VLLMClientError, ValueError, TypeError)
