"""One request on a worker, from its batch item to how it ended: the record the worker
service keeps while it runs (`Running`), the engine's view of it, and the reading of the
engine's last output (`conclude`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import get_args

from broker_config.wire import (
    DoneEvent,
    ErrorCode,
    ErrorEvent,
    FinalEvent,
    FinishReason,
    Timings,
    TokenLogprob,
)
from broker_config.wire_internal import BatchItem
from costmodel.units import Usage
from workers.engine import EXPEDITED, Delta, EngineRequest
from workers.images import ImagePool

# The finish reasons a done event may carry; an engine's others ("abort") never end in one.
FINISH_REASONS: frozenset[str] = frozenset(get_args(FinishReason))


@dataclass(frozen=True, slots=True)
class Ending:
    """How a request ended: `code` None for done, else the error it ends with."""

    code: ErrorCode | None
    message: str = ""


@dataclass(slots=True, eq=False)
class Running:
    """One request on this worker, from its batch to its Completion.

    `key` (`Subjects.result_key(tenant, id)`) names it everywhere on the worker: ids are
    unique per tenant only. It is also the request's id inside the engine.
    """

    key: str
    item: BatchItem
    input_tokens: int
    footprint_mu: float
    task: asyncio.Task[None] | None = None
    # Set once, by an Abort message or the deadline; the request then ends with it.
    stop: Ending | None = None
    # Handed to the engine; a request that never was costs no model units.
    in_engine: bool = False
    # From here on the request is storing/publishing its final event; drain waits for it.
    finalizing: bool = False
    seq: int = 0
    parts: list[str] = field(default_factory=list)
    output_tokens: int = 0
    cached_input_tokens: int = 0  # of input_tokens, those in the engine's prefix cache
    # Engine seconds: the engine's own attribution (its final delta; 0 if it gives none),
    # and the worker's measure of the decode part (workers.engine_time).
    engine_s: float = 0.0
    decode_s: float = 0.0
    first_token_at: float | None = None  # unix time of the first token event
    # What the final delta says: why the output ended and, for embeddings, the vector.
    finish_reason: str | None = None
    embedding: list[float] | None = None
    # Logprobs of the tokens whose text no token event carried yet (None: not asked for).
    pending_logprobs: list[TokenLogprob] | None = None


async def engine_request(
    engine_id: str, item: BatchItem, *, embed: bool, images: ImagePool, wanted: Callable[[], bool]
) -> EngineRequest | None:
    """The engine's view of an item, its images prepared in `images`' processes (text
    alone never waits for them); ValueError for a bad image; None if `wanted()` turned
    false while its images waited for their turn."""
    body = item.request
    prepared = await images.prepare(body.images, item.tenant, wanted) if body.images else []
    if prepared is None:
        return None
    # Engine priority is the dispatcher's decision, never the client's own `priority`,
    # which orders requests only inside the client's tenant.
    return EngineRequest(
        id=engine_id,
        max_tokens=item.max_tokens,
        prompt=body.prompt,
        messages=body.messages,
        priority=EXPEDITED if item.expedited else 0,
        input_tokens=body.input_tokens,
        images=prepared,
        sampling=body.sampling,
        embed=embed,
    )


async def close_stream(deltas: AsyncIterator[Delta]) -> None:
    """Close an engine stream left early, so the engine frees the request at once."""
    aclose = getattr(deltas, "aclose", None)  # async generators; plain iterators have none
    if aclose is not None:
        await aclose()


def conclude(running: Running, final: Delta | None) -> Ending:
    """How a request ended, from the engine's final delta (None: stopped before it)."""
    if final is not None:
        # The engine's own count is the usage, also for an aborted request.
        running.input_tokens = final.input_tokens
        running.output_tokens = final.output_tokens
        running.cached_input_tokens = final.cached_input_tokens
        running.engine_s = final.engine_s
        running.finish_reason = final.finish_reason
        running.embedding = final.embedding
        if final.finish_reason != "abort":
            return Ending(None)
    if running.stop is not None:
        return running.stop
    if final is None:
        return Ending(ErrorCode.INTERNAL, "the engine ended the request without a final output")
    return Ending(ErrorCode.INTERNAL, "the engine aborted the request")


def final_event(running: Running, ending: Ending, usage: Usage) -> FinalEvent:
    """The request's final event: `done` with its text, usage and timings, or the error
    it ended with."""
    item = running.item
    if ending.code is not None:
        return ErrorEvent(id=item.id, code=ending.code, message=ending.message)
    first = running.first_token_at
    timings = Timings(
        queued_s=max(0.0, item.dispatched_at - item.enqueued_at),
        ttft_s=None if first is None else max(0.0, first - item.enqueued_at),
        total_s=max(0.0, time.time() - item.enqueued_at),
    )
    finish_reason = running.finish_reason
    return DoneEvent(
        id=item.id,
        seq=running.seq,
        text="".join(running.parts),
        usage=usage,
        timings=timings,
        metadata=item.request.metadata,
        finish_reason=finish_reason if finish_reason in FINISH_REASONS else None,
        embedding=running.embedding,
    )
