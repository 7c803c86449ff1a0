"""Answering the dispatcher's black-box health probes.

A heartbeat only says that the worker's event loop runs; a probe says that its engine
does. The dispatcher sends one to a worker that holds work and completed nothing for a
while, or that sat idle: one short generation, which the worker runs at the highest
engine priority in a sequence slot it keeps free for probes (its advertised capacity is
`PROBE_ROOM` less than the engine's), so neither a full batch nor an engine that does
not preempt makes a healthy worker miss one. The answer is a Completion with `probe`
set; nothing is stored and no event is published.
"""

from __future__ import annotations

import asyncio
import logging
import time

from broker_config.wire import ErrorCode
from broker_config.wire_internal import BatchItem, Completion
from costmodel.units import Capacity, Usage
from workers.engine import PROBE, Engine, EngineError, EngineRequest

log = logging.getLogger("fairq.worker")

# What a probe needs of the engine: one sequence and a short prompt's KV cache.
PROBE_ROOM = Capacity(1, 64, 0.0)


def advertised(engine_capacity: Capacity) -> Capacity:
    """The capacity a worker offers the dispatcher: the engine's, less the probes' room
    (an engine of one sequence keeps it, and probes then rely on engine priority)."""
    return Capacity(
        max(1, engine_capacity.sequences - PROBE_ROOM.sequences),
        max(1, engine_capacity.tokens - PROBE_ROOM.tokens),
        engine_capacity.model_units,
    )


async def answer_probe(engine: Engine, item: BatchItem, worker_id: str) -> Completion | None:
    """Run the probe `item` through `engine` until its deadline; the Completion to report,
    or None when the deadline passed first (the dispatcher has counted a failure)."""
    request = EngineRequest(
        id=f"probe~{item.id}",
        max_tokens=item.max_tokens,
        prompt=item.request.prompt or "ping",
        priority=PROBE,
        input_tokens=item.request.input_tokens,
    )
    code, usage = None, Usage(0, 0, 0.0)
    deadline = item.request.deadline
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout_at(
            None if deadline is None else loop.time() + (deadline - time.time())
        ):
            async for delta in engine.generate(request):
                if delta.finished:
                    usage = Usage(delta.input_tokens, delta.output_tokens, 0.0)
                    if delta.finish_reason == "abort":
                        code = ErrorCode.INTERNAL
    except TimeoutError:
        log.warning("probe %s got no answer from the engine before its deadline", item.id)
        try:
            await engine.abort(request.id)
        except EngineError as exc:
            log.warning("engine abort of probe %s failed: %s", item.id, exc)
        return None
    except EngineError as exc:
        log.warning("the engine failed probe %s: %s", item.id, exc)
        code = ErrorCode.INTERNAL
    return Completion(
        id=item.id,
        tenant=item.tenant,
        endpoint=item.endpoint,
        worker_id=worker_id,
        usage=usage,
        code=code,
        stored=False,
        finished_at=time.time(),
        probe=True,
    )
