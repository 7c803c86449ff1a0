"""costmodel.calibrate.fit_decode_curve: the batched decode curve from timed steps."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from costmodel.calibrate import DecodeCurve, Fit, StepSample, fit_decode_curve
from costmodel.units import ModelProfile

BASE, PER_SEQ = 0.0247, 0.0003
BATCHES = (1, 4, 16, 64)


def steps(base: float, per_seq: float, batches: tuple[int, ...] = BATCHES) -> list[StepSample]:
    return [StepSample(n, base + per_seq * n) for n in batches]


def test_the_fit_recovers_a_noiseless_curve() -> None:
    curve = fit_decode_curve(steps(BASE, PER_SEQ))
    assert curve.base_s == pytest.approx(BASE, rel=1e-9)
    assert curve.per_seq_s == pytest.approx(PER_SEQ, rel=1e-9)
    assert curve.r2 == pytest.approx(1.0, abs=1e-12)
    assert curve.max_residual == pytest.approx(0.0, abs=1e-9)
    assert (curve.batches, curve.n) == (BATCHES, 4)
    assert curve.step_s(32) == pytest.approx(BASE + 32 * PER_SEQ, rel=1e-9)


@given(base=st.floats(1e-5, 1.0), per_seq=st.floats(0.0, 0.1))
@settings(max_examples=50)
def test_the_fit_recovers_any_non_negative_curve(base: float, per_seq: float) -> None:
    curve = fit_decode_curve(steps(base, per_seq, (1, 8, 256)))
    scale = base + per_seq * 256  # the longest step
    # Compared on the time each coefficient contributes to the longest step.
    assert curve.base_s == pytest.approx(base, abs=1e-9 * scale)
    assert curve.per_seq_s * 256 == pytest.approx(per_seq * 256, abs=1e-9 * scale)


def test_the_fit_recovers_a_noisy_curve_from_repeated_batches() -> None:
    rng = np.random.default_rng(3)
    samples = [
        StepSample(s.batch, s.seconds * (1 + 0.01 * rng.standard_normal()))
        for s in steps(BASE, PER_SEQ) * 5
    ]
    curve = fit_decode_curve(samples)
    assert curve.base_s == pytest.approx(BASE, rel=0.02)
    assert curve.per_seq_s == pytest.approx(PER_SEQ, rel=0.05)
    assert 0.98 < curve.r2 < 1 and 0 < curve.max_residual < 0.05
    assert (curve.batches, curve.n) == (BATCHES, 20)


def test_the_largest_residual_is_relative_to_the_measured_step() -> None:
    # The line through the means, 0.1 + 1.0 * n, misses every step by 0.1.
    samples = [StepSample(1, 1.0), StepSample(1, 1.2), StepSample(2, 2.0), StepSample(2, 2.2)]
    curve = fit_decode_curve(samples)
    assert (curve.base_s, curve.per_seq_s) == (pytest.approx(0.1), pytest.approx(1.0))
    assert curve.max_residual == pytest.approx(0.1)  # 0.1 off the step of 1.0


def test_steps_that_shrink_with_the_batch_clamp_the_slope_to_zero() -> None:
    # Least squares would give a negative cost per sequence.
    samples = steps(0.05, -0.0001)
    curve = fit_decode_curve(samples)
    assert curve.per_seq_s == 0.0
    assert curve.base_s == pytest.approx(np.mean([s.seconds for s in samples]), rel=1e-9)
    assert curve.r2 == pytest.approx(0.0, abs=1e-9)  # no better than the mean


def test_a_line_below_the_origin_clamps_the_base_to_zero() -> None:
    # -0.01 + 0.002 n: least squares would give a negative fixed cost.
    samples = steps(-0.01, 0.002, (8, 16, 32))
    curve = fit_decode_curve(samples)
    assert curve.base_s == 0.0
    # Then the slope is the least-squares line through the origin.
    expected = sum(s.batch * s.seconds for s in samples) / sum(s.batch**2 for s in samples)
    assert curve.per_seq_s == pytest.approx(expected, rel=1e-9)
    assert curve.r2 < 1


@pytest.mark.parametrize(
    "samples, got",
    [([StepSample(8, 0.03)] * 3, "only batch 8"), ([], "no samples")],
    ids=["one-batch-size", "empty"],
)
def test_fewer_than_two_batch_sizes_name_the_fix(samples: list[StepSample], got: str) -> None:
    with pytest.raises(ValueError, match="2 or more batch sizes") as raised:
        fit_decode_curve(samples)
    assert got in str(raised.value)
    assert "--batches 1,8,32,64" in str(raised.value)


@pytest.mark.parametrize(
    "batch, seconds, field",
    [
        (0, 0.1, "batch"),
        (True, 0.1, "batch"),
        (1.5, 0.1, "batch"),
        (1, 0.0, "seconds"),
        (1, -0.1, "seconds"),
        (1, math.nan, "seconds"),
        (1, math.inf, "seconds"),
    ],
)
def test_a_step_sample_rejects_bad_values(batch: object, seconds: float, field: str) -> None:
    with pytest.raises(ValueError, match=f"step sample {field}"):
        StepSample(batch, seconds)  # type: ignore[arg-type]


def test_a_fit_with_a_curve_makes_a_batched_profile() -> None:
    fit = Fit(alpha=0.001, beta=0.03, gamma=0.3, r2=0.99, n=10)
    curve = DecodeCurve(0.02, 0.001, r2=0.999, max_residual=0.01, batches=(1, 8), n=2)
    profile = fit.to_profile("m", 0.97, curve, operating_batch=8)
    assert profile == ModelProfile(
        name="m",
        alpha=0.001,
        decode_base_s=0.02,
        decode_per_seq_s=0.001,
        operating_batch=8,
        gamma=0.3,
        capacity_mu_per_s=0.97,
    )
    # The fit's beta (the prefill runs' constant) does not enter it: beta is the curve's.
    assert profile.beta == pytest.approx(0.021)
    assert profile.decode_token_s() == pytest.approx(0.02 / 8 + 0.001)
