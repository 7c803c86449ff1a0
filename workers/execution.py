"""One request's run on the engine, and its end: the engine request built (images
prepared in the pool, input counted), its output streamed as token events, its deadline
kept, then its final event stored before it is sent and its Completion reported
(the order of workers/service.py's module doc)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from broker_config.wire import ErrorCode, TokenEvent
from broker_config.wire_internal import BatchItem, Completion
from costmodel.units import ModelProfile, Usage
from workers.engine import Delta, Engine, EngineError, EngineRequest
from workers.engine_time import EngineTimeMeter
from workers.images import ImagePool
from workers.outbox import Outbox
from workers.results import FinalResults
from workers.running import Ending, Running, close_stream, conclude, engine_request, final_event

log = logging.getLogger("workers.service")


class Execution:
    def __init__(
        self,
        engine: Engine,
        *,
        worker_id: str,
        embed: bool,
        images: ImagePool,
        profile: ModelProfile | None,
        results: FinalResults,
        outbox: Outbox,
        report: Callable[[Completion], None],
        expire: Callable[[Running], None],
    ) -> None:
        """`report` queues a Completion; `expire` ends a request whose deadline passed."""
        self._engine = engine
        self.worker_id = worker_id
        self._embed = embed  # an embedding endpoint's worker
        self._images = images
        self._profile = profile
        # Measures engine time for engines that do not report it (vLLM).
        self._meter = EngineTimeMeter(profile)
        self._results = results
        self._outbox = outbox
        self._report = report
        self._expire = expire

    async def run(self, running: Running) -> None:
        ending = await self._execute(running)
        running.finalizing = True
        await self._finish(running, ending)

    async def _execute(self, running: Running) -> Ending:
        item = running.item
        deadline = item.request.deadline

        def wanted() -> bool:  # checked when its images' turn in the pool comes
            return running.stop is None and (deadline is None or time.time() < deadline)

        try:
            if item.request.images and not self._engine.accepts_images:
                raise ValueError("it has images, and this endpoint's model takes text only")
            request = await engine_request(
                running.key, item, embed=self._embed, images=self._images, wanted=wanted
            )
            if request is not None and item.request.input_tokens is None:
                # With images an engine may run the model's image processor to count.
                count = self._engine.count_tokens
                running.input_tokens = (
                    await asyncio.to_thread(count, request) if request.images else count(request)
                )
                running.footprint_mu = self.model_units(item, running.input_tokens, item.max_tokens)
        except ValueError as exc:
            return Ending(ErrorCode.INVALID_REQUEST, str(exc))
        if running.stop is not None:  # cancelled while its images waited for the pool
            return running.stop
        if deadline is not None and time.time() >= deadline or request is None:
            return Ending(ErrorCode.DEADLINE_EXCEEDED, "the deadline passed before the start")
        timer = self._deadline_timer(running)
        try:
            final = await self._stream(running, request)
        except EngineError as exc:
            return Ending(ErrorCode.INTERNAL, str(exc))
        except ValueError as exc:
            return Ending(ErrorCode.INVALID_REQUEST, str(exc))
        except Exception as exc:
            log.exception("engine failed request %s", running.key)
            return Ending(ErrorCode.INTERNAL, f"engine failure: {exc!r}")
        finally:
            if timer is not None:
                timer.cancel()
        return conclude(running, final)

    def _deadline_timer(self, running: Running) -> asyncio.TimerHandle | None:
        deadline = running.item.request.deadline
        if deadline is None:
            return None
        loop = asyncio.get_running_loop()
        return loop.call_at(loop.time() + (deadline - time.time()), self._expire, running)

    async def _stream(self, running: Running, request: EngineRequest) -> Delta | None:
        """Publish the engine's output; the final delta, or None if stopped before it."""
        if running.stop is not None:
            return None
        running.in_engine = True
        deltas = self._engine.generate(request)
        try:
            async for delta in deltas:
                if delta.finished:
                    await self._emit(running, delta)
                    return delta
                if running.stop is not None:
                    return None
                await self._emit(running, delta)
            return None
        finally:
            self._meter.ended(running.key)
            await close_stream(deltas)

    async def _emit(self, running: Running, delta: Delta) -> None:
        running.output_tokens += delta.token_count
        running.decode_s += self._meter.emitted(running.key, delta.token_count)
        if delta.logprobs is not None:
            running.pending_logprobs = (running.pending_logprobs or []) + delta.logprobs
        if not delta.text and not (delta.finished and running.pending_logprobs):
            # Its logprobs, if any, go with the next piece of text, or with an empty
            # one at the end, so that every generated token's are sent.
            return
        if running.first_token_at is None:
            running.first_token_at = time.time()
        running.parts.append(delta.text)
        event = TokenEvent(
            id=running.item.id, seq=running.seq, text=delta.text, logprobs=running.pending_logprobs
        )
        running.pending_logprobs = None
        running.seq += 1
        await self._outbox.event(running.item, event)

    async def _finish(self, running: Running, ending: Ending) -> None:
        item = running.item
        cost = (
            self.model_units(
                item, running.input_tokens, running.output_tokens, running.cached_input_tokens
            )
            if running.in_engine
            else 0.0
        )
        images = len(item.request.images)
        engine_s = self._engine_s(running, images) if running.in_engine else 0.0
        # Only when there are some: msgspec omits a default by identity, not by value,
        # and the contract's usage has no `other_units` (or `engine_s`) otherwise.
        usage = Usage(
            running.input_tokens,
            running.output_tokens,
            cost,
            **({"other_units": float(images)} if images else {}),
            cached_input_tokens=running.cached_input_tokens,
            **({"engine_s": engine_s} if engine_s > 0 else {}),
        )
        event = final_event(running, ending, usage)
        stored, result = await self._results.store(running.key, item, event)
        if result is not None:
            await self._outbox.event(item, result)
        self._report(
            Completion(
                id=item.id,
                tenant=item.tenant,
                endpoint=item.endpoint,
                worker_id=self.worker_id,
                usage=usage,
                code=ending.code,
                stored=stored,
                finished_at=time.time(),
                first_token_at=running.first_token_at,
            )
        )

    def _engine_s(self, running: Running, images: int) -> float:
        """The request's engine time: the engine's exact attribution when it gave one,
        else the worker's measure (0 when the profile has no curve to measure with)."""
        if running.engine_s > 0:
            return running.engine_s
        return self._meter.engine_s(
            running.decode_s, running.input_tokens, running.cached_input_tokens, images
        )

    def model_units(
        self, item: BatchItem, input_tokens: int, output_tokens: int, cached_input_tokens: int = 0
    ) -> float:
        if self._profile is None:
            return 0.0
        return self._profile.model_units(
            input_tokens,
            output_tokens,
            other=len(item.request.images),
            cached_input_tokens=cached_input_tokens,
        )
