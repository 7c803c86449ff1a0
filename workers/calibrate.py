"""`fairq calibrate`: time an engine over a grid of request shapes and write its cost profile.

    fairq calibrate --engine sim|vllm [--engine-config TOML] [--model DIR]
                    [--inputs 64,256,1024] [--outputs 16,64,256] [--images 0] [--repeats 1]
                    [--name NAME] [--capacity-mu-per-s X | --capacity-shape IN,OUT[,IMAGES]]
                    [--time-scale X] --out PROFILE.toml

Coefficients. Every grid point (input length, output length, images) runs `repeats` times,
one request at a time: a model unit is a replica-second at batch size 1. A request's wall
seconds, from calling `generate()` to its final delta, are one `Sample`, and
`costmodel.calibrate.fit_profile` fits alpha, beta and gamma to them. One untimed warm-up
request runs first (vLLM's first request pays one-off costs). Prompts are random words, a
new draw per request so that a prefix cache never shortens a prefill, with exactly the
target count of the engine's own tokens (`count_tokens`). The output length is forced:
the simulated engine gets `target_output_tokens`, vLLM runs with `ignore_eos`. A request
that comes back with other counts fails the calibration.

Capacity (`capacity_mu_per_s`, unless --capacity-mu-per-s sets it): as many requests as the
engine runs at once (its `max_sequences`, fewer if their KV-cache reservations do not fit),
all of one shape (--capacity-shape, by default the grid's median input and output lengths
with the fewest images), submitted together; capacity is the model units they cost under
the fitted coefficients divided by the wall seconds until the last one finishes. Batching
amortises decode steps, so it exceeds 1 where decoding dominates; prefill gains little.
It therefore depends on the shape: give the shape of your real traffic.

`--time-scale X` (simulated engine only) makes every simulated step last X times its
modelled duration; measured seconds are divided by X, so the profile stays in unscaled
seconds (X < 1 calibrates faster, with timing noise magnified by 1/X).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import string
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from functools import cache, partial
from itertools import count
from pathlib import Path
from typing import Any

import msgspec

from costmodel.calibrate import Fit, Sample, fit_profile, grid
from costmodel.engine_model import EngineParams, load_engine_params
from costmodel.units import ModelProfile, dump_profile, read_toml
from workers.engine import Delta, Engine, EngineError, EngineRequest
from workers.images import PreparedImage
from workers.sim_engine import SimEngine

DEFAULT_INPUTS = (64, 256, 1024)
# Per engine. The simulated engine's are short, so that its default run takes seconds (a
# decode step lasts 25 ms at time scale 1).
DEFAULT_OUTPUTS = {"sim": (1, 4, 16), "vllm": (16, 64, 256)}
# What a simulated image is made of: the simulated engine only counts images.
SYNTHETIC_IMAGE = PreparedImage(1, 1, bytes(3))
# Word lists tried per prompt before giving up on an exact token count.
PROMPT_ATTEMPTS = 8
# A prompt search gives up beyond this many words per token asked for: the engine's count
# then does not grow with the prompt.
MAX_WORDS_PER_TOKEN = 16


class CalibrationError(RuntimeError):
    """The engine did not run a calibration request as asked."""


@dataclass(frozen=True, slots=True)
class Shape:
    """One request shape of the grid."""

    input_tokens: int
    output_tokens: int
    images: int = 0


@dataclass(frozen=True, slots=True)
class Plan:
    """What to measure; every value is checked on construction (ValueError)."""

    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    images: tuple[int, ...] = (0,)
    repeats: int = 1
    # The time scale the (simulated) engine runs at: measured seconds are divided by it.
    time_scale: float = 1.0
    # None: measure it with a batched run of `capacity_shape` (None: the grid's middle).
    capacity_mu_per_s: float | None = None
    capacity_shape: Shape | None = None

    def __post_init__(self) -> None:
        self.shapes()  # grid() checks the lengths and counts
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or self.repeats < 1:
            raise ValueError(f"repeats must be an integer >= 1, got {self.repeats!r}")
        if not (0 < self.time_scale < math.inf):
            raise ValueError(f"time scale must be finite and > 0, got {self.time_scale!r}")
        if self.capacity_mu_per_s is not None and not (0 < self.capacity_mu_per_s < math.inf):
            raise ValueError(
                f"capacity_mu_per_s must be finite and > 0, got {self.capacity_mu_per_s!r}"
            )
        if self.capacity_shape is not None:  # a one-point grid checks it like the others
            shape = self.capacity_shape
            grid([shape.input_tokens], [shape.output_tokens], [shape.images])

    def shapes(self) -> list[Shape]:
        return [Shape(*point) for point in grid(self.inputs, self.outputs, self.images)]

    def capacity_run_shape(self) -> Shape:
        """The given capacity shape, else median input and output lengths, fewest images."""
        if self.capacity_shape is not None:
            return self.capacity_shape
        return Shape(_median(self.inputs), _median(self.outputs), min(self.images))


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


@dataclass(frozen=True, slots=True)
class Calibration:
    fit: Fit
    profile: ModelProfile
    samples: list[Sample]
    capacity_run: CapacityRun | None  # None when the capacity was given


async def calibrate(engine: Engine, plan: Plan, name: str) -> Calibration:
    """Time a running engine over the plan's grid, fit the coefficients, find capacity.

    Raises ValueError for a plan the engine cannot run (a prompt longer than its context,
    images on a text-only engine), CalibrationError when it runs a request otherwise than
    asked, EngineError when it fails.
    """
    requests = _Requests(engine)
    shapes = plan.shapes()
    await _run(engine, requests.make(shapes[0]), shapes[0])  # warm-up, not timed
    samples = [
        await _timed(engine, requests, shape, plan.time_scale)
        for _ in range(plan.repeats)
        for shape in shapes
    ]
    fit = fit_profile(samples)
    run = None
    capacity = plan.capacity_mu_per_s
    if capacity is None:
        run = await _measure_capacity(
            engine, requests, fit.to_profile(name, 1.0), plan.capacity_run_shape(), plan.time_scale
        )
        capacity = run.mu_per_s
    return Calibration(fit, fit.to_profile(name, capacity), samples, run)


async def _measure_capacity(
    engine: Engine, requests: _Requests, profile: ModelProfile, shape: Shape, time_scale: float
) -> CapacityRun:
    """Run as many requests of `shape` at once as the engine holds; model units per second."""
    limits = engine.capacity
    n = min(limits.sequences, limits.tokens // (shape.input_tokens + shape.output_tokens))
    if n < 1:
        raise ValueError(
            f"a request of {shape.input_tokens} input and {shape.output_tokens} "
            f"output tokens does not fit the engine's KV cache of "
            f"{limits.tokens} tokens"
        )
    units = profile.model_units(shape.input_tokens, shape.output_tokens, shape.images)
    if units <= 0:
        raise CalibrationError(
            "the fitted coefficients give a request no model units, so "
            "capacity cannot be measured in them"
        )
    batch = [requests.make(shape) for _ in range(n)]  # prompts built before the clock runs
    start = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for request in batch:
            tg.create_task(_run(engine, request, shape))
    seconds = (time.perf_counter() - start) / time_scale
    return CapacityRun(shape, n, seconds, n * units)


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


class _Requests:
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


async def _timed(engine: Engine, requests: _Requests, shape: Shape, time_scale: float) -> Sample:
    request = requests.make(shape)
    start = time.perf_counter()
    await _run(engine, request, shape)
    seconds = (time.perf_counter() - start) / time_scale
    return Sample(shape.input_tokens, shape.output_tokens, shape.images, seconds)


async def _run(engine: Engine, request: EngineRequest, shape: Shape) -> Delta:
    """Run a request to its end; its final delta, checked to have the asked-for counts."""
    final = None
    async with aclosing(engine.generate(request)) as deltas:
        async for delta in deltas:
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


def _median(values: Sequence[int]) -> int:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


# -- the command ---------------------------------------------------------------------------


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "calibrate",
        help="fit a model-unit cost profile by timing an engine",
        description="Time an engine over a grid of input and output lengths, one request "
        "at a time, fit alpha/beta/gamma (non-negative least squares), measure "
        "the batched capacity, and write the profile TOML.",
    )
    parser.add_argument("--engine", choices=sorted(DEFAULT_OUTPUTS), default="sim")
    parser.add_argument(
        "--engine-config",
        type=Path,
        metavar="TOML",
        help="sim: EngineParams (e.g. configs/engine.toml); vllm: "
        "VLLMEngineConfig fields (ignore_eos is always on)",
    )
    parser.add_argument("--model", metavar="DIR", help="vllm: the model directory")
    parser.add_argument(
        "--inputs",
        type=_lengths,
        default=DEFAULT_INPUTS,
        metavar="N,N,...",
        help=f"input lengths in tokens (default {_joined(DEFAULT_INPUTS)})",
    )
    defaults = "; ".join(
        f"{engine}: {_joined(outputs)}" for engine, outputs in DEFAULT_OUTPUTS.items()
    )
    parser.add_argument(
        "--outputs",
        type=_lengths,
        metavar="N,N,...",
        help=f"output lengths in tokens (default {defaults})",
    )
    parser.add_argument(
        "--images",
        type=_lengths,
        default=(0,),
        metavar="N,N,...",
        help="images per request (default 0; vLLM runs text only)",
    )
    parser.add_argument(
        "--repeats", type=int, default=1, metavar="N", help="runs per grid point (default 1)"
    )
    parser.add_argument(
        "--name",
        help="profile name (default: the name of --model's directory, else the engine's name)",
    )
    capacity = parser.add_mutually_exclusive_group()
    capacity.add_argument(
        "--capacity-mu-per-s",
        type=float,
        metavar="X",
        help="write this capacity instead of measuring it",
    )
    capacity.add_argument(
        "--capacity-shape",
        type=_lengths,
        metavar="IN,OUT[,IMAGES]",
        help="the request shape of the capacity run (default: median "
        "input and output lengths of the grid, fewest images)",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        metavar="X",
        help="sim only: step times are multiplied by X and measurements divided by it (default 1)",
    )
    parser.add_argument(
        "--out", type=Path, required=True, metavar="PROFILE.toml", help="where to write the profile"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Exit 0 with the profile written; 2 for unusable input; 1 if the engine fails."""
    try:
        plan = _plan(args)
        engine = _sim_engine(args, plan) if args.engine == "sim" else _vllm_engine(args)
        result = asyncio.run(_calibrate(engine, plan, _profile_name(args)))
    except ValueError as exc:
        return _fail(str(exc), 2)
    except (CalibrationError, EngineError) as exc:
        return _fail(str(exc), 1)
    except ImportError as exc:
        return _fail(f"{exc} (vLLM runs in its own environment, see docs/vllm.md)", 1)
    print(format_report(result))
    try:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        dump_profile(result.profile, args.out)
    except OSError as exc:
        return _fail(f"cannot write {args.out}: {exc}", 1)
    print(f"wrote {args.out}")
    return 0


async def _calibrate(engine: Engine, plan: Plan, name: str) -> Calibration:
    async with engine:
        return await calibrate(engine, plan, name)


def format_report(result: Calibration) -> str:
    fit, profile, run = result.fit, result.profile, result.capacity_run
    lines = [
        f"profile {profile.name!r} from {fit.n} timed requests",
        f"alpha = {fit.alpha:.6g} s per input token",
        f"beta  = {fit.beta:.6g} s per output token",
        f"gamma = {fit.gamma:.6g} s per image",
        f"R^2   = {fit.r2:.6f}",
    ]
    if run is None:
        lines.append(f"capacity_mu_per_s = {profile.capacity_mu_per_s:.6g} (given)")
    else:
        lines.append(
            f"capacity_mu_per_s = {run.mu_per_s:.6g} ({run.requests} concurrent "
            f"requests of {run.shape.input_tokens} input, {run.shape.output_tokens} "
            f"output tokens and {run.shape.images} images in {run.seconds:.3f} s)"
        )
    return "\n".join(lines)


def _plan(args: argparse.Namespace) -> Plan:
    if args.engine != "sim" and args.time_scale is not None:
        raise ValueError("--time-scale is for --engine sim")
    capacity_shape = None
    if args.capacity_shape is not None:
        if len(args.capacity_shape) not in (2, 3):
            raise ValueError(
                "--capacity-shape takes IN,OUT or IN,OUT,IMAGES, "
                f"got {_joined(args.capacity_shape)}"
            )
        capacity_shape = Shape(*args.capacity_shape)
    return Plan(
        inputs=args.inputs,
        outputs=args.outputs or DEFAULT_OUTPUTS[args.engine],
        images=args.images,
        repeats=args.repeats,
        time_scale=1.0 if args.time_scale is None else args.time_scale,
        capacity_mu_per_s=args.capacity_mu_per_s,
        capacity_shape=capacity_shape,
    )


def _profile_name(args: argparse.Namespace) -> str:
    if args.name:
        return args.name
    model = Path(args.model).name if args.model else ""
    return model or args.engine


def _sim_engine(args: argparse.Namespace, plan: Plan) -> SimEngine:
    if args.model is not None:
        raise ValueError("--model is for --engine vllm; the simulated engine has no model")
    params = (
        load_engine_params(args.engine_config) if args.engine_config is not None else EngineParams()
    )
    return SimEngine(params, time_scale=plan.time_scale)


def _vllm_engine(args: argparse.Namespace) -> Engine:
    if any(args.images):
        raise ValueError("--images: the vLLM calibration runs text requests only")
    # Imported only here: its module is the one place fairq reaches vllm from.
    from workers.vllm_engine import VLLMEngine, VLLMEngineConfig

    fields: dict[str, Any] = (
        {} if args.engine_config is None else read_toml(args.engine_config, dict[str, Any])
    )
    if args.model is not None:
        fields["model"] = args.model
    if "model" not in fields:
        raise ValueError("--engine vllm needs --model DIR (or `model` in --engine-config)")
    fields["ignore_eos"] = True  # every request must generate exactly its max_tokens
    try:
        return VLLMEngine(msgspec.convert(fields, VLLMEngineConfig))
    except msgspec.ValidationError as exc:
        raise ValueError(
            f"{args.engine_config or '--model'}: invalid vLLM engine config: {exc}"
        ) from exc


def _lengths(text: str) -> tuple[int, ...]:
    """A comma-separated list of integers (ranges are checked by the plan)."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def _joined(values: Sequence[int]) -> str:
    return ",".join(map(str, values))


def _fail(message: str, code: int) -> int:
    print(f"fairq calibrate: {message}", file=sys.stderr)
    return code
