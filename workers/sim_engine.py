"""A simulated inference engine: continuous batching in real time, with fault modes.

`SimEngine` drives `costmodel.engine_model.BatchingEngineModel` from one background step
loop: a step lasts the model's duration (times `time_scale` and the slow fault), then every
sequence in it receives its token. Workers use it when no GPU is present; end-to-end tests
and benchmarks use it with a small time scale, or 0 for an engine with no compute time.

Output text is filler: words chosen deterministically from the seed, the request id and
the token's position. Without `target_output_tokens` the output length is likewise a
deterministic pseudo-random draw in [1, max_tokens]. A request's `sampling.seed`, or
temperature 0, draws from its prompt instead of its id, so the same prompt gives the same
text; stop strings end the output where they appear; logprobs are made up, but
consistent. An embedding request runs its prompt only and returns a deterministic unit
vector of EMBEDDING_DIM numbers drawn from its text.

A request's final delta carries the engine time the model attributed to it
(`Delta.engine_s`: its prefill, images and share of every decode step it was in), in the
model's unscaled seconds: neither `time_scale` nor the slow fault changes what a request
costs.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
import zlib
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from itertools import chain
from typing import cast

from broker_config.wire import ChatMessage, Sampling, TokenLogprob, TopLogprob
from costmodel.engine_model import BatchingEngineModel, EngineParams, StepResult
from costmodel.units import UNLIMITED_MODEL_UNITS, Capacity, approx_tokens
from workers.engine import Delta, EngineError, EngineRequest
from workers.stops import StopScanner

# Characters per token of the simulated tokenizer (about right for English text).
_WORDS = tuple(
    " " + word
    for word in (
        "the quick model queue token batch tenant fair share worker engine stream "
        "prefill decode cache step"
    ).split()
)
# How often a hung engine looks whether the hang was lifted.
_HANG_POLL_S = 0.01
# Step pacing makes up at most this much lag behind the real clock, so a stalled event
# loop is not followed by a burst of zero-length steps.
_MAX_LAG_S = 0.05
_CRASHED = "the simulated engine crashed (crash fault)"
EMBEDDING_DIM = 32


def _check_slow_factor(value: object) -> None:
    if not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ValueError(f"slow_factor must be a finite number > 0, got {value!r}")


@dataclass(slots=True)
class Faults:
    """Fault modes, settable while the engine runs (`engine.faults.hang = True`).

    hang: steps stop, so requests never progress, but `healthy` stays True, as with a
        real engine wedged inside a kernel: only an end-to-end probe notices.
    crash: every current and new request raises EngineError and `healthy` is False;
        clearing it brings the engine back, empty, as a restart would.
    slow_factor: multiplies every step's duration.
    """

    hang: bool = False
    crash: bool = False
    slow_factor: float = 1.0

    def __setattr__(self, name: str, value: object) -> None:
        # Checked on every assignment, not only in __init__: faults change at runtime.
        if name == "slow_factor":
            _check_slow_factor(value)
        object.__setattr__(self, name, value)


@dataclass(frozen=True, slots=True)
class _End:
    """The last item of a request's queue: how it finished, or why it failed."""

    finish_reason: str
    error: str | None = None


@dataclass(slots=True, eq=False, repr=False)
class _Stream:
    """A request inside the engine; also its sequence id in the model (by identity, so a
    step that ran before an abort can never deliver to a later request with the same id)."""

    request_id: str
    input_tokens: int
    finish_reason: str  # when it runs to the end: "length" if max_tokens cut it, else "stop"
    word_seed: int
    stops: StopScanner | None = None
    top_logprobs: int | None = None  # None: not asked for
    embedding: list[float] | None = None  # an embedding request's answer
    accepted: float = field(default_factory=time.monotonic)
    queue: asyncio.Queue[Delta | _End] = field(default_factory=asyncio.Queue)
    output_tokens: int = 0
    first_token_at: float | None = None
    # The engine time the model attributed to it, unscaled, read when it leaves the model.
    engine_s: float = 0.0
    ended: bool = False

    def __repr__(self) -> str:
        return repr(self.request_id)  # the model's error messages name the sequence

    def token(self, now: float) -> bool:
        """Deliver the next token; True if it completed a stop string."""
        if self.ended or self.embedding is not None:
            # Stopped while the step that produced it ran; an embedding generates nothing.
            return False
        if self.first_token_at is None:
            self.first_token_at = now
        draw = zlib.crc32(b"%d" % self.output_tokens, self.word_seed)
        word = _WORDS[draw % len(_WORDS)]
        self.output_tokens += 1
        text, stopped = (word, False) if self.stops is None else self.stops.feed(word)
        logprobs = None if self.top_logprobs is None else [_logprob(word, draw, self.top_logprobs)]
        self.queue.put_nowait(Delta(text, 1, logprobs=logprobs))
        return stopped

    def end(self, finish_reason: str, error: str | None = None) -> None:
        if self.ended:
            return
        self.ended = True
        if (
            self.stops is not None
            and finish_reason in ("stop", "length")
            and (held := self.stops.flush())
        ):
            self.queue.put_nowait(Delta(held, 0))
        self.queue.put_nowait(_End(finish_reason, error))

    def final(self, finish_reason: str) -> Delta:
        ttft = None if self.first_token_at is None else self.first_token_at - self.accepted
        return Delta(
            "",
            0,
            finished=True,
            input_tokens=self.input_tokens,
            output_tokens=self.output_tokens,
            ttft_s=ttft,
            finish_reason=finish_reason,
            embedding=self.embedding,
            engine_s=self.engine_s,
        )


class SimEngine:
    """An Engine that simulates continuous batching in real time on the running loop."""

    def __init__(
        self,
        params: EngineParams | None = None,
        *,
        time_scale: float = 1.0,
        seed: int = 0,
        faults: Faults | None = None,
    ) -> None:
        if not 0 <= time_scale < math.inf:
            raise ValueError(f"time_scale must be finite and >= 0, got {time_scale!r}")
        self.params = params if params is not None else EngineParams()
        self.faults = faults if faults is not None else Faults()
        self._time_scale = time_scale
        self._seed = seed
        self._model = BatchingEngineModel(self.params)
        self._capacity = Capacity(
            self.params.max_sequences, self.params.kv_cache_tokens, UNLIMITED_MODEL_UNITS
        )
        self._streams: dict[str, _Stream] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._step_end = 0.0  # loop time at which the step being paced ends
        self._engine_time_s = 0.0

    # -- state ------------------------------------------------------------------------

    @property
    def capacity(self) -> Capacity:
        return self._capacity

    @property
    def healthy(self) -> bool:
        return self._task is not None and not self._task.done() and not self.faults.crash

    @property
    def accepts_images(self) -> bool:
        """It simulates a multimodal model: images cost their model units, nothing more."""
        return True

    @property
    def time_scale(self) -> float:
        return self._time_scale

    @property
    def free_sequences(self) -> int:
        return self._model.free_sequences

    @property
    def free_kv_tokens(self) -> int:
        return self._model.free_kv_tokens

    @property
    def waiting(self) -> int:
        """Requests queued in the engine and not yet admitted to the batch."""
        return self._model.waiting

    @property
    def engine_time_s(self) -> float:
        """Engine seconds of all steps run, unscaled: what the requests' `engine_s` add up
        to (with those of requests still running)."""
        return self._engine_time_s

    @property
    def active_requests(self) -> int:
        """Requests inside generate(): waiting, running, or with output not yet consumed."""
        return len(self._streams)

    # -- lifecycle --------------------------------------------------------------------

    async def __aenter__(self) -> SimEngine:
        if self._task is not None:
            raise RuntimeError("this SimEngine is already running")
        self._step_end = asyncio.get_running_loop().time()
        self._task = asyncio.create_task(self._run(), name="sim-engine-steps")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        await asyncio.wait([task])
        # Every open generate() ends with an abort delta instead of waiting forever.
        self._stop_all("abort")
        if not task.cancelled() and (error := task.exception()) is not None:
            raise error

    # -- Engine protocol --------------------------------------------------------------

    def count_tokens(self, request: EngineRequest) -> int:
        return approx_tokens(_render(request))

    async def generate(self, request: EngineRequest) -> AsyncIterator[Delta]:
        stream = self._register(request)
        try:
            while isinstance(item := await stream.queue.get(), Delta):
                yield item
        finally:
            # Also when the consumer leaves early: the slot and KV tokens free at once.
            self._model.abort(stream)
            del self._streams[stream.request_id]
        if item.error is not None:
            raise EngineError(f"request {request.id!r}: {item.error}")
        yield stream.final(item.finish_reason)

    async def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            self._stop(stream, "abort")

    # -- internals --------------------------------------------------------------------

    def _register(self, request: EngineRequest) -> _Stream:
        if self._task is None or self._task.done():
            raise EngineError("the simulated engine is not running")
        if self.faults.crash:
            raise EngineError(f"request {request.id!r}: {_CRASHED}")
        if request.id in self._streams:
            raise ValueError(f"request {request.id!r} is already running")
        if request.max_tokens < 1:
            raise ValueError(
                f"request {request.id!r}: max_tokens must be >= 1, got {request.max_tokens!r}"
            )
        text = _render(request)  # checked even when the input length is given
        # A declared count stands in for text a benchmark did not bother to write, but
        # never makes the input smaller than its text: as a real engine, this one
        # reports what it read, so a client that under-declares is charged the truth.
        # At least 1: an engine prefills a token (a tokenizer's BOS) for an empty prompt.
        input_tokens = max(approx_tokens(text), request.input_tokens or 0)
        sampling = request.sampling or Sampling()
        digest = _digest(_draw_key(self._seed, request, sampling, text))
        wanted = request.target_output_tokens
        if wanted is None:
            wanted = 1 + digest % request.max_tokens
        if request.embed:
            wanted = 1  # one pass over the input
        stream = _Stream(
            request.id,
            input_tokens,
            "length" if wanted >= request.max_tokens else "stop",
            word_seed=digest >> 32,
            stops=StopScanner(sampling.stop) if sampling.stop else None,
            top_logprobs=sampling.logprobs,
            embedding=_embedding(text) if request.embed else None,
        )
        # The model checks the lengths (>= 1, fits the KV cache) and names the request.
        self._model.add(
            stream,
            input_tokens,
            min(wanted, request.max_tokens),
            len(request.images),
            request.priority,
        )
        self._streams[request.id] = stream
        self._wake.set()
        return stream

    def _stop(self, stream: _Stream, finish_reason: str, error: str | None = None) -> None:
        if not stream.ended:
            if stream in self._model:  # else it finished in a step, which recorded its time
                stream.engine_s = self._model.engine_s(stream)
            self._model.abort(stream)
            stream.end(finish_reason, error)

    def _stop_all(self, finish_reason: str, error: str | None = None) -> None:
        for stream in self._streams.values():
            self._stop(stream, finish_reason, error)

    async def _run(self) -> None:
        try:
            await self._step_loop()
        except Exception as exc:
            # A failed loop must not leave consumers waiting forever.
            self._stop_all("error", f"the simulated engine failed: {exc!r}")
            raise

    async def _step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        model = self._model
        while True:
            if self.faults.crash:
                self._stop_all("error", _CRASHED)
            if model.idle:
                self._wake.clear()
                await self._wake.wait()
                self._step_end = loop.time()  # pacing restarts after a pause
            elif self.faults.hang:
                await asyncio.sleep(_HANG_POLL_S)
                self._step_end = loop.time()
            else:
                result = model.step()
                self._engine_time_s += result.duration_s
                # Recorded before pacing: an abort meanwhile finds them gone from the model.
                for stream, engine_s in result.engine_s.items():
                    cast("_Stream", stream).engine_s = engine_s
                await self._pace(loop, result.duration_s)
                self._deliver(result)

    async def _pace(self, loop: asyncio.AbstractEventLoop, duration_s: float) -> None:
        """Sleep for one step, on an absolute schedule so sleep overheads do not add up."""
        delay = duration_s * self._time_scale * self.faults.slow_factor
        if delay == 0:
            await asyncio.sleep(0)  # the instant engine still lets consumers run each step
            return
        now = loop.time()
        self._step_end = max(self._step_end, now - _MAX_LAG_S) + delay
        await asyncio.sleep(self._step_end - now)

    def _deliver(self, result: StepResult) -> None:
        now = time.monotonic()
        # The model's sequence ids are the streams themselves.
        for stream in cast("Iterable[_Stream]", chain(result.first_tokens, result.tokens)):
            if stream.token(now):
                self._stop(stream, "stop")
        for stream in cast("Iterable[_Stream]", result.finished):
            stream.end(stream.finish_reason)


def _digest(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest())


def _draw_key(seed: int, request: EngineRequest, sampling: Sampling, text: str) -> str:
    """What a request's output is drawn from: its id, unless a seed or greedy sampling
    makes the output a function of the prompt."""
    if sampling.seed is not None:
        return f"{seed}\0seed {sampling.seed}\0{text}"
    if sampling.temperature == 0:
        return f"{seed}\0greedy\0{text}"
    return f"{seed}\0{request.id}"


def _logprob(word: str, draw: int, alternatives: int) -> TokenLogprob:
    logprob = -0.01 - (draw >> 8) % 3000 / 1000
    # The token itself is the most likely; other words follow, each half as likely.
    others = [w for w in _WORDS if w != word][: max(0, alternatives - 1)]
    top = [TopLogprob(word, logprob)] if alternatives else []
    top += [TopLogprob(w, logprob - math.log(2) * (i + 1)) for i, w in enumerate(others)]
    return TokenLogprob(word, logprob, top)


def _embedding(text: str) -> list[float]:
    """A unit vector drawn from the text: equal texts, equal vectors."""
    raw = hashlib.blake2b(text.encode(), digest_size=EMBEDDING_DIM).digest()
    values = [byte - 127.5 for byte in raw]
    norm = math.sqrt(sum(v * v for v in values))
    return [v / norm for v in values]


def _render(request: EngineRequest) -> str:
    """The prompt text the engine sees; ValueError unless exactly one of prompt/messages."""
    if request.messages is None:
        if request.prompt is None:
            raise ValueError(f"request {request.id!r} has neither a prompt nor messages")
        return request.prompt
    if request.prompt is not None:
        raise ValueError(f"request {request.id!r} has both a prompt and messages")
    if not request.messages:
        raise ValueError(f"request {request.id!r} has an empty message list")
    return "".join(_chat_turn(message) for message in request.messages)


def _chat_turn(message: ChatMessage) -> str:
    # A minimal chat template: role markers cost tokens, as in a real template.
    return f"<|{message.role}|>\n{message.content}\n"
