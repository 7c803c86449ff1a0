"""`fairq calibrate`: time an engine and write its cost profile.

    fairq calibrate --engine sim|vllm [--engine-config TOML] [--model DIR]
                    [--inputs 64,256,1024] [--images 0] [--batches 1,4,16,64]
                    [--decode-shape IN,OUT] [--repeats 1] [--name NAME]
                    [--capacity-mu-per-s X | --capacity-shape IN,OUT[,IMAGES]]
                    [--time-scale X] --out PROFILE.toml

One untimed warm-up request runs first (vLLM's first request pays one-off costs); the
runs themselves are in workers/calibrate_runs.py.

Prefill and images (alpha, gamma). For every input length and image count (--inputs x
--images), one request alone generates one token, `repeats` times; the fastest counts,
since a busy host only ever adds time. Its wall seconds are its prefill, its images and
a constant (the first token's decode step and the per-request overhead of the engine and
of this client). `costmodel.calibrate.fit_profile` fits them with the output column, one
token everywhere, as that constant: alpha and gamma are slopes, so a fixed overhead does
not leak into them. Prefill and image encoding do not batch, so these are the profile's.

Decode (the curve). For each batch size n (--batches; by default 1, 4, 16, ... and the
engine's room), n requests of the decode shape (a short prompt and a long forced output)
run at once; the time of a decode step of n sequences is the per-token time in the
window where all n decode, from their token timestamps (`measure_decode_step`), which
keeps prefill, staggered admission and per-request overheads out of it and averages over
the window's steps (a longer decode output averages over more). Each batch size runs
`repeats` times too and the fastest counts: one step slowed by a busy host would
otherwise bend the line.
`costmodel.calibrate.fit_decode_curve` fits `decode_base_s + decode_per_seq_s * n` to
the steps. A batch size above the engine's room for the decode shape (its sequence
slots, fewer if the requests' KV-cache reservations do not fit) runs at the room.

Operating point and capacity. `operating_batch` is the engine's room for the capacity
shape (--capacity-shape, by default the median input length, the decode shape's output
length and the fewest images). Unless --capacity-mu-per-s sets it, `capacity_mu_per_s`
is measured by running that many requests of the capacity shape at once: the model units
they cost under the fitted profile (priced at the operating batch) over the wall seconds
until the last one finishes (the fastest of `repeats` such runs). A model unit is an
engine-second at the operating point, so it comes out near 1; what it falls short says
how long the run spent off that point (filling and draining the batch, prefill beside
decode).

`--time-scale X` (simulated engine only) makes every simulated step last X times its
modelled duration; measured seconds are divided by X, so the profile stays in unscaled
seconds (X < 1 calibrates faster, with timing noise magnified by 1/X).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from costmodel.calibrate import (
    MIN_BATCH_SIZES,
    DecodeCurve,
    Fit,
    Sample,
    StepSample,
    fit_decode_curve,
    fit_profile,
    grid,
)
from costmodel.engine_model import EngineParams, load_engine_params
from costmodel.units import ModelProfile, dump_profile, read_toml
from workers.calibrate_runs import (
    CalibrationError,
    CapacityRun,
    DecodeRun,
    Requests,
    Shape,
    batch_room,
    measure_capacity,
    measure_decode_step,
    run_request,
    timed_request,
)
from workers.engine import Engine, EngineError
from workers.sim_engine import SimEngine

DEFAULT_INPUTS = (64, 256, 1024)
# The decode runs' requests, per engine: a short prompt, so that nearly all of a run is
# decoding. The simulated engine's output is short, so that its default run takes
# seconds (a decode step lasts 25 to 45 ms at time scale 1).
DEFAULT_DECODE_SHAPES = {"sim": Shape(16, 32), "vllm": Shape(16, 128)}
# Decode outputs shorter than this leave too few shared steps once a batch's first and
# last tokens are cut off (MIN_DECODE_STEPS in calibrate_runs).
MIN_DECODE_OUTPUT = 16
# Default batch sizes grow by this factor from 1 up to the engine's room.
BATCH_GROWTH = 4


@dataclass(frozen=True, slots=True)
class Plan:
    """What to measure; every value is checked on construction (ValueError)."""

    inputs: tuple[int, ...]
    images: tuple[int, ...] = (0,)
    # Decode batch sizes; None: 1, 4, 16, ... and the engine's room (`batch_sizes`).
    batches: tuple[int, ...] | None = None
    decode_shape: Shape = DEFAULT_DECODE_SHAPES["sim"]
    repeats: int = 1
    # The time scale the (simulated) engine runs at: measured seconds are divided by it.
    time_scale: float = 1.0
    # None: measure it with a batched run of `capacity_shape` (None: see capacity_run_shape).
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
        for shape in (self.capacity_shape, self.decode_shape):
            if shape is not None:  # a one-point grid checks it like the others
                grid([shape.input_tokens], [shape.output_tokens], [shape.images])
        if self.decode_shape.output_tokens < MIN_DECODE_OUTPUT or self.decode_shape.images:
            raise ValueError(
                f"the decode shape needs at least {MIN_DECODE_OUTPUT} output tokens and no "
                f"images, got {self.decode_shape.output_tokens} and {self.decode_shape.images}"
            )
        if self.batches is not None and not (
            all(type(batch) is int and batch >= 1 for batch in self.batches)
            and len(set(self.batches)) >= MIN_BATCH_SIZES
        ):
            raise ValueError(
                f"batches must be {MIN_BATCH_SIZES} or more different integers >= 1 to fit "
                f"the decode curve, got {_joined(self.batches)} (e.g. --batches 1,8,32,64)"
            )

    def shapes(self) -> list[Shape]:
        """The prefill runs' shapes: every input length and image count, one output token."""
        return [Shape(*point) for point in grid(self.inputs, [1], self.images)]

    def capacity_run_shape(self) -> Shape:
        """The given capacity shape, else the median input length, the decode shape's
        output length and the fewest images."""
        if self.capacity_shape is not None:
            return self.capacity_shape
        return Shape(_median(self.inputs), self.decode_shape.output_tokens, min(self.images))

    def batch_sizes(self, room: int) -> list[int]:
        """The decode batch sizes to run on an engine that holds `room` decode requests:
        the plan's, each capped at the room, else 1, 4, 16, ... and the room itself."""
        if self.batches is not None:
            return sorted({min(batch, room) for batch in self.batches})
        sizes = [1]
        while sizes[-1] * BATCH_GROWTH < room:
            sizes.append(sizes[-1] * BATCH_GROWTH)
        return sorted({*sizes, room})


@dataclass(frozen=True, slots=True)
class Calibration:
    # alpha and gamma; its beta is the constant of a one-token request (module docstring).
    fit: Fit
    curve: DecodeCurve
    profile: ModelProfile
    samples: list[Sample]
    decode_runs: list[DecodeRun]
    capacity_run: CapacityRun | None  # None when the capacity was given


async def calibrate(engine: Engine, plan: Plan, name: str) -> Calibration:
    """Time a running engine as the plan says, fit the profile, find capacity.

    Raises ValueError for a plan the engine cannot run (a prompt longer than its context,
    images on a text-only engine, fewer than two batch sizes it can hold),
    CalibrationError when it runs a request otherwise than asked, EngineError when it
    fails.
    """
    requests = Requests(engine)
    shapes = plan.shapes()
    batches = plan.batch_sizes(batch_room(engine, plan.decode_shape))
    if len(batches) < MIN_BATCH_SIZES:
        raise ValueError(
            f"the engine runs only {batches[-1]} request(s) of the decode shape at once: "
            "the decode curve needs two batch sizes (more sequence slots or KV cache)"
        )
    operating_batch = batch_room(engine, plan.capacity_run_shape())
    await run_request(engine, requests.make(shapes[0]), shapes[0])  # warm-up, not timed
    samples = [
        await _fastest(
            plan.repeats,
            lambda shape=shape: timed_request(engine, requests, shape, plan.time_scale),
            lambda sample: sample.seconds,
        )
        for shape in shapes
    ]
    fit = fit_profile(samples)  # before the decode runs: a grid it refuses ends it early
    decode_runs = [
        await _fastest(
            plan.repeats,
            lambda batch=batch: measure_decode_step(
                engine, requests, plan.decode_shape, batch, plan.time_scale
            ),
            lambda run: run.step_s,
        )
        for batch in batches
    ]
    curve = fit_decode_curve(StepSample(run.batch, run.step_s) for run in decode_runs)
    run = None
    capacity = plan.capacity_mu_per_s
    if capacity is None:
        priced = fit.to_profile(name, 1.0, curve, operating_batch)
        run = await _fastest(
            plan.repeats,
            lambda: measure_capacity(
                engine,
                requests,
                priced,
                plan.capacity_run_shape(),
                operating_batch,
                plan.time_scale,
            ),
            lambda run: run.seconds,
        )
        capacity = run.mu_per_s
    profile = fit.to_profile(name, capacity, curve, operating_batch)
    return Calibration(fit, curve, profile, samples, decode_runs, run)


Timed = TypeVar("Timed")


async def _fastest(
    repeats: int, measure: Callable[[], Awaitable[Timed]], seconds: Callable[[Timed], float]
) -> Timed:
    """The fastest of `repeats` measurements: delays only ever add time, so it is the
    closest to what the engine itself took."""
    runs = [await measure() for _ in range(repeats)]
    return min(runs, key=seconds)


def _median(values: Sequence[int]) -> int:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


# -- the command ---------------------------------------------------------------------------


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "calibrate",
        help="fit a model-unit cost profile by timing an engine",
        description="Time an engine's prefill over input lengths, one request at a time "
        "(alpha, gamma), and its decode steps at several batch sizes (the decode "
        "curve), both fitted by non-negative least squares; measure the batched "
        "capacity, and write the profile TOML.",
    )
    parser.add_argument("--engine", choices=sorted(DEFAULT_DECODE_SHAPES), default="sim")
    parser.add_argument(
        "--engine-config",
        type=Path,
        metavar="TOML",
        help="sim: EngineParams (e.g. configs/engine.toml); vllm: "
        "VLLMEngineConfig fields (ignore_eos is always on)",
    )
    parser.add_argument("--model", metavar="DIR", help="vllm: the model directory")
    _add_run_options(parser)
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
        help="the request shape of the capacity run (default: the median input "
        "length, the decode shape's output length, the fewest images)",
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


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    """The prefill and decode runs' options."""
    parser.add_argument(
        "--inputs",
        type=_lengths,
        default=DEFAULT_INPUTS,
        metavar="N,N,...",
        help="input lengths in tokens of the prefill runs, one request at a time "
        f"(default {_joined(DEFAULT_INPUTS)})",
    )
    parser.add_argument(
        "--images",
        type=_lengths,
        default=(0,),
        metavar="N,N,...",
        help="images per request of the prefill runs (default 0; vLLM runs text only)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        metavar="N",
        help="runs per input length and image count, per decode batch size and of the "
        "capacity batch, the fastest counting (default 1)",
    )
    parser.add_argument(
        "--batches",
        type=_lengths,
        metavar="N,N,...",
        help="decode batch sizes, each capped at what the engine holds (default 1, 4, "
        "16, ... and the engine's max_sequences, fewer if the KV cache runs out first)",
    )
    decode_defaults = "; ".join(
        f"{engine}: {shape.input_tokens},{shape.output_tokens}"
        for engine, shape in DEFAULT_DECODE_SHAPES.items()
    )
    parser.add_argument(
        "--decode-shape",
        type=_lengths,
        metavar="IN,OUT",
        help=f"input and output tokens of the decode runs' requests (default {decode_defaults})",
    )


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
    fit, curve, profile = result.fit, result.curve, result.profile
    steps = [
        f"  n = {run.batch:>3}: {run.step_s:.6g} s measured over {run.steps} steps, "
        f"{curve.step_s(run.batch):.6g} fitted"
        for run in result.decode_runs
    ]
    lines = [
        f"profile {profile.name!r} from {fit.n} requests prefilled alone and decode steps "
        f"at {len(curve.batches)} batch sizes",
        f"alpha = {fit.alpha:.6g} s per input token",
        f"gamma = {fit.gamma:.6g} s per image",
        f"R^2   = {fit.r2:.6f} (prefill fit, plus {fit.beta:.6g} s per request)",
        f"decode step = {curve.base_s:.6g} + {curve.per_seq_s:.6g} * n s",
        *steps,
        f"R^2   = {curve.r2:.6f} (decode curve; largest residual "
        f"{curve.max_residual:.2%} of a measured step)",
        f"decode token = {profile.decode_token_s(1):.6g} s alone, "
        f"{profile.decode_token_s():.6g} s at operating_batch = {profile.operating_batch}",
    ]
    run = result.capacity_run
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
    decode_shape = DEFAULT_DECODE_SHAPES[args.engine]
    if args.decode_shape is not None:
        if len(args.decode_shape) != 2:
            raise ValueError(f"--decode-shape takes IN,OUT, got {_joined(args.decode_shape)}")
        decode_shape = Shape(*args.decode_shape)
    return Plan(
        inputs=args.inputs,
        images=args.images,
        repeats=args.repeats,
        batches=args.batches,
        decode_shape=decode_shape,
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
