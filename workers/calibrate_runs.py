"""The engine runs `fairq calibrate` times (workers/calibrate.py says what it makes of them).

- `timed_request`: one request alone, from calling `generate()` to its final delta.
- `measure_decode_step`: `batch` identical decode-heavy requests at once; the time of
  one decode step while all of them decode, from their token timestamps.
- `measure_capacity`: as many requests of one shape as the engine holds; the model units
  they cost under a profile per wall second.

Prompts are random words, a new draw per request so that a prefix cache never shortens a
prefill, with exactly the target count of the engine's own tokens (`count_tokens`). The
output length is forced: the simulated engine gets `target_output_tokens`, vLLM runs
with `ignore_eos`. A request that comes back with other counts fails the calibration.
Measured seconds are divided by the (simulated) engine's time scale.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import string
import time
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass
from functools import cache, partial
from itertools import count

import numpy as np

from costmodel.calibrate import Sample
from costmodel.units import ModelProfile
from workers.engine import Delta, Engine, EngineRequest
from workers.images import PreparedImage

# What a simulated image is made of: the simulated engine only counts images.
SYNTHETIC_IMAGE = PreparedImage(1, 1, bytes(3))
# Word lists tried per prompt before giving up on an exact token count.
PROMPT_ATTEMPTS = 8
# A prompt search gives up beyond this many words per token asked for: the engine's count
# then does not grow with the prompt.
MAX_WORDS_PER_TOKEN = 16
# Decode steps a batch must run with all its requests decoding for its step time to count.
MIN_DECODE_STEPS = 8

# (seconds since the run started, output tokens so far) at each delta that carried tokens.
Trace = list[tuple[float, int]]


class CalibrationError(RuntimeError):
    """The engine did not run a calibration request as asked."""


@dataclass(frozen=True, slots=True)
class Shape:
    """One request shape of the grid."""

    input_tokens: int
    output_tokens: int
    images: int = 0

    @property
    def kv_tokens(self) -> int:
        return self.input_tokens + self.output_tokens


def batch_room(engine: Engine, shape: Shape) -> int:
    """Requests of `shape` the engine runs at once: its sequence slots, fewer if their
    KV-cache reservations do not fit; ValueError if not even one fits."""
    limits = engine.capacity
    room = min(limits.sequences, limits.tokens // shape.kv_tokens)
    if room < 1:
        raise ValueError(
            f"a request of {shape.input_tokens} input and {shape.output_tokens} output "
            f"tokens does not fit the engine's KV cache of {limits.tokens} tokens"
        )
    return room


# -- runs --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DecodeRun:
    """`batch` requests of `shape` at once: they all decoded together for `steps` steps
    (the fewest seen by any of them) of `step_s` seconds each."""

    batch: int
    shape: Shape
    step_s: float
    steps: int


@dataclass(frozen=True, slots=True)
class CapacityRun:
    """A batched run: `requests` of `shape` at once, finished in `seconds`."""

    shape: Shape
    requests: int
    seconds: float
    model_units: float

    @property
    def mu_per_s(self) -> float:
        return self.model_units / self.seconds


async def timed_request(
    engine: Engine, requests: Requests, shape: Shape, time_scale: float
) -> Sample:
    """One request of `shape` alone, timed from calling generate() to its final delta."""
    request = requests.make(shape)
    start = time.perf_counter()
    await run_request(engine, request, shape)
    seconds = (time.perf_counter() - start) / time_scale
    return Sample(shape.input_tokens, shape.output_tokens, shape.images, seconds)


async def measure_decode_step(
    engine: Engine, requests: Requests, shape: Shape, batch: int, time_scale: float
) -> DecodeRun:
    """Run `batch` requests of `shape` at once and time the decode steps they share.

    Per-token times come from token timestamps, not from whole requests, so prefill, the
    staggered admission of a batch and per-request overheads stay out of them: only the
    window in which every request has its first token and none has its last counts.
    """
    batch_requests = [requests.make(shape) for _ in range(batch)]  # built before the clock
    traces: list[Trace] = [[] for _ in batch_requests]
    await run_together(engine, batch_requests, shape, traces)
    step_s, steps = shared_step(traces)
    if steps < MIN_DECODE_STEPS:
        raise CalibrationError(
            f"{batch} requests of {shape.input_tokens} input and {shape.output_tokens} "
            f"output tokens decoded together for {steps} steps, fewer than "
            f"{MIN_DECODE_STEPS}: the engine did not run them at once; give fewer "
            "--batches or a longer --decode-shape output"
        )
    return DecodeRun(batch, shape, step_s / time_scale, steps)


def shared_step(traces: list[Trace]) -> tuple[float, int]:
    """The time per token while every trace's request decoded, and the fewest tokens any
    of them emitted in that window.

    Per request, the least-squares slope of time on its token count within the window (a
    delta that carries several tokens, as a consumer that fell behind reads them, is one
    point); the median over the requests.
    """
    start = max(trace[0][0] for trace in traces)  # every request has its first token
    end = min(trace[-1][0] for trace in traces)  # none has its last
    slopes, spans = [], []
    for trace in traces:
        window = [(t, tokens) for t, tokens in trace if start <= t <= end]
        span = window[-1][1] - window[0][1] if window else 0
        spans.append(span)
        if span > 0:
            times, tokens = zip(*window, strict=True)
            slopes.append(float(np.polyfit(tokens, times, 1)[0]))
    steps = min(spans)
    return (statistics.median(slopes) if steps > 0 else 0.0), steps


async def measure_capacity(
    engine: Engine,
    requests: Requests,
    profile: ModelProfile,
    shape: Shape,
    n: int,
    time_scale: float,
) -> CapacityRun:
    """Run `n` requests of `shape` at once; model units (by `profile`) per second."""
    units = profile.model_units(shape.input_tokens, shape.output_tokens, shape.images)
    if units <= 0:
        raise CalibrationError(
            "the fitted coefficients give a request no model units, so "
            "capacity cannot be measured in them"
        )
    batch = [requests.make(shape) for _ in range(n)]  # prompts built before the clock runs
    start = time.perf_counter()
    await run_together(engine, batch, shape)
    seconds = (time.perf_counter() - start) / time_scale
    return CapacityRun(shape, n, seconds, n * units)


async def run_together(
    engine: Engine,
    batch: list[EngineRequest],
    shape: Shape,
    traces: list[Trace] | None = None,
) -> None:
    """Run requests of `shape` at once, each tracing into its own trace if given."""
    start = time.perf_counter()
    try:
        async with asyncio.TaskGroup() as tg:
            for i, request in enumerate(batch):
                trace = None if traces is None else traces[i]
                tg.create_task(run_request(engine, request, shape, trace, start))
    except ExceptionGroup as group:
        # The first failure cancelled the others: raise it as it came, so that callers
        # handle CalibrationError, EngineError and ValueError as from one request.
        raise group.exceptions[0] from None


async def run_request(
    engine: Engine,
    request: EngineRequest,
    shape: Shape,
    trace: Trace | None = None,
    start: float = 0.0,
) -> Delta:
    """Run a request to its end; its final delta, checked to have the asked-for counts.
    With `trace`, appends (seconds since `start`, tokens so far) at each delta with tokens."""
    final = None
    tokens = 0
    async with aclosing(engine.generate(request)) as deltas:
        async for delta in deltas:
            if delta.token_count and trace is not None:
                tokens += delta.token_count
                trace.append((time.perf_counter() - start, tokens))
            if delta.finished:
                final = delta
    if final is None:
        raise CalibrationError(f"request {request.id}: the engine sent no final delta")
    ran = (final.input_tokens, final.output_tokens)
    if ran != (shape.input_tokens, shape.output_tokens) or final.finish_reason == "abort":
        raise CalibrationError(
            f"request {request.id}: asked for {shape.input_tokens} input and "
            f"{shape.output_tokens} output tokens, the engine ran {ran[0]} and {ran[1]} "
            f"(finish reason {final.finish_reason!r})"
        )
    return final


# -- requests and prompts ------------------------------------------------------------------


class Requests:
    """Engine requests of given shapes, each with its own prompt and id."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._numbers = count()

    def make(self, shape: Shape) -> EngineRequest:
        n = next(self._numbers)
        return EngineRequest(
            id=f"calibration-{n}",
            max_tokens=shape.output_tokens,
            prompt=synthetic_prompt(self._engine, shape.input_tokens, seed=n),
            target_output_tokens=shape.output_tokens,
            images=[SYNTHETIC_IMAGE] * shape.images,
        )


def synthetic_prompt(engine: Engine, tokens: int, seed: int = 0) -> str:
    """A prompt of exactly `tokens` input tokens by `engine.count_tokens`, words drawn
    from `seed`; ValueError if the engine's tokenizer admits none."""
    for attempt in range(PROMPT_ATTEMPTS):
        words = _Words(f"{seed}/{attempt}")
        length = _exact_length(cache(partial(_prompt_tokens, engine, words)), tokens)
        if length is not None:
            return words.text(length)
    raise ValueError(
        f"cannot build a prompt of exactly {tokens} input tokens for this engine's tokenizer"
    )


class _Words:
    """One-letter words drawn from a seed; `text(n)` is the first n of the same sequence."""

    def __init__(self, seed: str) -> None:
        self._rng = random.Random(seed)
        self._words: list[str] = []

    def text(self, n: int) -> str:
        while len(self._words) < n:
            self._words.append(" " + self._rng.choice(string.ascii_lowercase))
        return "".join(self._words[:n])


def _prompt_tokens(engine: Engine, words: _Words, n: int) -> int:
    return engine.count_tokens(
        EngineRequest(id="calibration-prompt", max_tokens=1, prompt=words.text(n))
    )


def _exact_length(tokens_of: Callable[[int], int], target: int) -> int | None:
    """The fewest words with exactly `target` tokens, given tokens_of(words) grows with
    words; None if it jumps over the target or does not reach it."""
    limit = MAX_WORDS_PER_TOKEN * target
    below, words = 0, max(1, target)
    while (tokens := tokens_of(words)) < target:
        if words >= limit:
            return None
        below = words
        # Proportional step: about the right length at once when tokens ~ rate * words.
        words = min(limit, max(words + 1, words * target // max(tokens, 1)))
    above = words
    while above - below > 1:  # tokens_of(below) < target <= tokens_of(above)
        middle = (below + above) // 2
        if tokens_of(middle) >= target:
            above = middle
        else:
            below = middle
    return above if tokens_of(above) == target else None
