"""Fit model-unit coefficients from engine timings.

Two fits, both by non-negative least squares (a negative cost would let a tenant earn
budget):

- `fit_profile`, over requests timed one at a time on a grid of input and output lengths
  (`grid`): `seconds ~ alpha * input_tokens + beta * output_tokens + gamma * other`,
  without an intercept (a request of no tokens costs nothing). Its alpha and gamma do not
  batch; `fairq calibrate` runs one output token per request, which makes beta the
  constant every request pays besides (its first token, overheads) and keeps that out
  of alpha and gamma.
- `fit_decode_curve`, over decode steps timed with n identical requests running together
  at several n: `step_seconds ~ base + per_seq * n`, the batched decode curve of a
  `ModelProfile`, which prices a decode token at `base / n + per_seq`.
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import nnls

from costmodel.units import ModelProfile

MIN_SAMPLES = 3
# Batch sizes a decode curve (two coefficients) needs to be fitted at all.
MIN_BATCH_SIZES = 2
# Relative residual below which a fit counts as exact when the timings do not vary.
_EXACT_TOLERANCE = 1e-12


@dataclass(frozen=True, slots=True)
class Sample:
    """One timed request: its token counts, other units (images) and wall seconds."""

    input_tokens: float
    output_tokens: float
    other: float
    seconds: float

    def __post_init__(self) -> None:
        for name in ("input_tokens", "output_tokens", "other", "seconds"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"sample {name} must be finite and >= 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class Fit:
    """Fitted coefficients, the coefficient of determination and the sample count."""

    alpha: float
    beta: float
    gamma: float
    r2: float
    n: int

    def to_profile(
        self,
        name: str,
        capacity_mu_per_s: float,
        curve: DecodeCurve | None = None,
        operating_batch: int = 1,
    ) -> ModelProfile:
        """The profile of these coefficients: decode tokens priced on `curve`, or at
        `beta` at every occupancy without one."""
        decode: dict[str, float] = (
            {"beta": self.beta}
            if curve is None
            else {"decode_base_s": curve.base_s, "decode_per_seq_s": curve.per_seq_s}
        )
        return ModelProfile(
            name=name,
            alpha=self.alpha,
            gamma=self.gamma,
            operating_batch=operating_batch,
            capacity_mu_per_s=capacity_mu_per_s,
            **decode,
        )


def fit_profile(samples: Iterable[Sample]) -> Fit:
    """Non-negative least squares of seconds on (input, output, other); no intercept.

    A column that is zero in every sample (no images in the grid) gets coefficient 0.
    Raises ValueError when there are fewer than 3 samples or the samples cannot separate
    the coefficients (all zero, or the nonzero columns are linearly dependent, e.g. the
    output length is always a fixed multiple of the input length).
    """
    samples = list(samples)
    if len(samples) < MIN_SAMPLES:
        raise ValueError(
            f"need at least {MIN_SAMPLES} samples to fit a profile, got {len(samples)}"
        )
    design = np.array([[s.input_tokens, s.output_tokens, s.other] for s in samples], dtype=float)
    seconds = np.array([s.seconds for s in samples], dtype=float)

    norms = np.linalg.norm(design, axis=0)
    used = norms > 0
    if not used.any():
        raise ValueError("every sample has zero input, output and other units: nothing to fit")
    # Unit-norm columns: tokens count in thousands and images in ones, and the rank
    # test and the solver both behave better on comparable scales.
    scaled = design[:, used] / norms[used]
    if np.linalg.matrix_rank(scaled) < scaled.shape[1]:
        raise ValueError(
            "samples do not vary enough to separate the coefficients: "
            "vary input and output lengths independently (see grid())"
        )
    solution, _ = nnls(scaled, seconds)
    coefficients = np.zeros(3)
    coefficients[used] = solution / norms[used]

    residual = float(np.sum((design @ coefficients - seconds) ** 2))
    total = float(np.sum((seconds - seconds.mean()) ** 2))
    return Fit(
        alpha=float(coefficients[0]),
        beta=float(coefficients[1]),
        gamma=float(coefficients[2]),
        r2=_r_squared(residual, total, seconds),
        n=len(samples),
    )


@dataclass(frozen=True, slots=True)
class StepSample:
    """One timed decode step: `batch` sequences each emitting a token, in `seconds`."""

    batch: int
    seconds: float

    def __post_init__(self) -> None:
        if isinstance(self.batch, bool) or not isinstance(self.batch, int) or self.batch < 1:
            raise ValueError(f"step sample batch must be an integer >= 1, got {self.batch!r}")
        # A step takes time: a zero would make every relative residual meaningless.
        if not (self.seconds > 0 and math.isfinite(self.seconds)):
            raise ValueError(f"step sample seconds must be finite and > 0, got {self.seconds!r}")


@dataclass(frozen=True, slots=True)
class DecodeCurve:
    """A fitted decode step time `base_s + per_seq_s * n` for n sequences, with its
    coefficient of determination, its largest residual relative to the measured step, and
    the batch sizes and sample count it was fitted on."""

    base_s: float
    per_seq_s: float
    r2: float
    max_residual: float
    batches: tuple[int, ...]
    n: int

    def step_s(self, batch: int) -> float:
        return self.base_s + self.per_seq_s * batch


def fit_decode_curve(samples: Iterable[StepSample]) -> DecodeCurve:
    """Non-negative least squares of step seconds on (1, batch).

    A step time that falls with the batch clamps the slope to 0 (the mean step time is
    the base); one that would need a negative base clamps the base to 0. Raises
    ValueError unless the samples cover at least two batch sizes.
    """
    samples = list(samples)
    batches = tuple(sorted({s.batch for s in samples}))
    if len(batches) < MIN_BATCH_SIZES:
        got = f"only batch {batches[0]}" if batches else "no samples"
        raise ValueError(
            f"the decode curve needs steps timed at {MIN_BATCH_SIZES} or more batch sizes, "
            f"got {got}: time more batch sizes (fairq calibrate --batches 1,8,32,64)"
        )
    design = np.array([[1.0, s.batch] for s in samples])
    seconds = np.array([s.seconds for s in samples])
    # Unit-norm columns: batch sizes run to hundreds, the intercept column is ones.
    norms = np.linalg.norm(design, axis=0)
    solution, _ = nnls(design / norms, seconds)
    base, per_seq = (float(c) for c in solution / norms)
    residuals = design @ np.array([base, per_seq]) - seconds
    total = float(np.sum((seconds - seconds.mean()) ** 2))
    return DecodeCurve(
        base_s=base,
        per_seq_s=per_seq,
        r2=_r_squared(float(np.sum(residuals**2)), total, seconds),
        max_residual=float(np.max(np.abs(residuals) / seconds)),
        batches=batches,
        n=len(samples),
    )


def _r_squared(residual: float, total: float, seconds: np.ndarray) -> float:
    """1 - SS_res / SS_tot; with constant timings, 1 for an exact fit and 0 otherwise."""
    if total > 0:
        return 1.0 - residual / total
    scale = float(np.sum(seconds**2))
    return 1.0 if residual <= _EXACT_TOLERANCE * max(scale, 1.0) else 0.0


def grid(
    input_lengths: Sequence[int], output_lengths: Sequence[int], images: Sequence[int] = (0,)
) -> list[tuple[int, int, int]]:
    """Every (input_tokens, output_tokens, images) combination, in the order given."""
    return list(
        itertools.product(
            _counts("input_lengths", input_lengths, minimum=1),
            _counts("output_lengths", output_lengths, minimum=1),
            _counts("images", images, minimum=0),
        )
    )


def _counts(name: str, values: Sequence[int], minimum: int) -> list[int]:
    """`values` as plain ints, each checked to be an integer >= `minimum`."""
    if len(values) == 0:
        raise ValueError(f"{name} must not be empty")
    for value in values:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
            raise ValueError(f"{name} must be integers >= {minimum}, got {value!r}")
    return [int(value) for value in values]
