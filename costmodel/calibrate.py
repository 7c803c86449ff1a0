"""Fit model-unit coefficients from engine timings.

The `calibrate` command times single requests over a grid of input and output lengths
(`grid`) and hands the timings to `fit_profile`, which fits

    seconds ~ alpha * input_tokens + beta * output_tokens + gamma * other

by non-negative least squares, without an intercept: a request of no tokens costs nothing,
and no coefficient may be negative (a negative cost would let a tenant earn budget).
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

    def to_profile(self, name: str, capacity_mu_per_s: float) -> ModelProfile:
        return ModelProfile(
            name=name,
            alpha=self.alpha,
            beta=self.beta,
            gamma=self.gamma,
            capacity_mu_per_s=capacity_mu_per_s,
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
