"""The Engine protocol: what a worker needs from an inference engine.

Implementations: `workers.sim_engine.SimEngine` (simulated continuous batching) and
`workers.vllm_engine.VLLMEngine` (the only module that imports vllm).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from broker_config.wire import ChatMessage, Sampling, TokenLogprob
from costmodel.units import Capacity
from workers.images import PreparedImage

# Engine priorities the worker sets, higher served first.
EXPEDITED = 1  # a request of a tenant below its fair share (the dispatcher's decision)
PROBE = 2  # a health probe: ahead of every tenant's request


@dataclass(slots=True)
class EngineRequest:
    """One request as the engine sees it. Exactly one of `prompt` and `messages` is set."""

    id: str
    max_tokens: int
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # Engine priority, higher served first (engines that order the other way map it). Set
    # from the dispatcher's decision (`expedited`), never from a client's own priority,
    # which orders requests only inside that client's tenant.
    priority: int = 0
    # Known token counts, when the dispatcher or a trace already has them.
    input_tokens: int | None = None
    # What the engine should generate, for simulated engines replaying a trace.
    target_output_tokens: int | None = None
    images: list[PreparedImage] = field(default_factory=list)
    sampling: Sampling | None = None
    # An embedding endpoint's request: the engine pools the input into `Delta.embedding`
    # and generates nothing.
    embed: bool = False


@dataclass(slots=True, frozen=True)
class Delta:
    """A piece of output. The last delta of a request has `finished=True` and its usage."""

    text: str
    token_count: int
    finished: bool = False
    input_tokens: int = 0
    output_tokens: int = 0
    # Of `input_tokens`, those the engine found in its prefix cache (final delta only).
    cached_input_tokens: int = 0
    # Seconds from the engine accepting the request to its first token (final delta only).
    ttft_s: float | None = None
    finish_reason: str | None = None
    # One entry per token of this delta, when the request asked for logprobs.
    logprobs: list[TokenLogprob] | None = None
    embedding: list[float] | None = None  # final delta of an embedding request
    # Engine seconds the engine itself attributed to the request, unscaled (final delta
    # only); 0 when it does not know, and the worker measures instead (workers.engine_time).
    engine_s: float = 0.0


class EngineError(RuntimeError):
    """The engine failed a request (as opposed to the request being invalid)."""


@runtime_checkable
class Engine(Protocol):
    """An inference engine, used as an async context manager by the worker service."""

    @property
    def capacity(self) -> Capacity:
        """Limits the engine can run at once; reported in worker heartbeats."""
        ...

    @property
    def healthy(self) -> bool: ...

    @property
    def accepts_images(self) -> bool:
        """Its model takes images (a worker refuses requests with images otherwise)."""
        ...

    async def __aenter__(self) -> Engine: ...

    async def __aexit__(self, *exc_info: object) -> None: ...

    def count_tokens(self, request: EngineRequest) -> int:
        """Input tokens of a request, with the engine's own tokenizer or chat template."""
        ...

    def generate(self, request: EngineRequest) -> AsyncIterator[Delta]:
        """Stream deltas in order; ends with exactly one delta where finished is True.

        Raises EngineError if the engine fails the request; a request aborted with
        `abort` ends with a finished delta whose finish_reason is "abort".
        """
        ...

    async def abort(self, request_id: str) -> None:
        """Stop a running request; a no-op for an unknown or finished id."""
        ...
