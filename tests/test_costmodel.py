"""costmodel: output estimates, NNLS calibration, autoscaling policy, profiles."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from costmodel.calibrate import Fit, Sample, fit_profile, grid
from costmodel.capacity import ScalingPolicy, desired_replicas, utilisation
from costmodel.estimate import Ema, OutputEstimator
from costmodel.units import ModelProfile, dump_profile, load_profile

# -- Ema and OutputEstimator -----------------------------------------------------------


def test_ema_first_update_sets_value_then_smooths() -> None:
    ema = Ema(smoothing=0.5)
    assert ema.value is None
    assert ema.update(10.0) == 10.0
    assert ema.update(20.0) == 15.0
    assert ema.update(15.0) == 15.0


def test_ema_with_initial_value_blends_first_observation() -> None:
    ema = Ema(smoothing=0.25, initial=1.0)
    assert ema.update(0.0) == pytest.approx(0.75)


@pytest.mark.parametrize("smoothing", [0.0, -0.1, 1.5, math.nan])
def test_ema_rejects_bad_smoothing(smoothing: float) -> None:
    with pytest.raises(ValueError, match="smoothing"):
        Ema(smoothing)


def test_ema_rejects_non_finite_observation() -> None:
    with pytest.raises(ValueError, match="finite"):
        Ema().update(math.inf)


def test_unseen_key_uses_prior() -> None:
    est = OutputEstimator(prior=0.5)
    assert est.estimate(("acme", "chat"), 100) == 50
    assert est.ratio(("acme", "chat")) == 0.5
    assert len(est) == 0  # reading does not create keys


def test_observations_move_the_estimate_by_ema() -> None:
    est = OutputEstimator(smoothing=0.2, prior=0.5)
    key = ("acme", "chat")
    est.observe(key, output_tokens=10, max_tokens=100)
    assert est.ratio(key) == pytest.approx(0.5 + 0.2 * (0.1 - 0.5))
    assert est.estimate(key, 100) == 42
    for _ in range(200):
        est.observe(key, 10, 100)
    assert est.estimate(key, 1000) == 100
    # Other keys keep the prior.
    assert est.estimate(("globex", "chat"), 100) == 50


def test_estimate_is_clamped_to_one_and_max_tokens() -> None:
    est = OutputEstimator(smoothing=1.0, prior=0.5)
    est.observe("short", 0, 100)
    assert est.estimate("short", 100) == 1
    est.observe("long", 500, 100)  # more output than max_tokens: ratio clamps to 1
    assert est.ratio("long") == 1.0
    assert est.estimate("long", 7) == 7
    est.observe("negative", -5, 100)
    assert est.ratio("negative") == 0.0


def test_observe_ignores_non_positive_max_tokens() -> None:
    est = OutputEstimator()
    est.observe("k", 10, 0)
    est.observe("k", 10, -3)
    assert len(est) == 0


def test_estimate_rejects_non_positive_max_tokens() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        OutputEstimator().estimate("k", 0)


@pytest.mark.parametrize("kwargs", [{"smoothing": 0.0}, {"prior": 1.5}, {"prior": -0.1},
                                    {"max_keys": 0}])
def test_estimator_rejects_bad_settings(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        OutputEstimator(**kwargs)  # type: ignore[arg-type]


def test_estimator_evicts_least_recently_used_key() -> None:
    est = OutputEstimator(smoothing=1.0, prior=0.5, max_keys=2)
    est.observe("a", 10, 100)
    est.observe("b", 20, 100)
    est.estimate("a", 100)  # touching "a" makes "b" the least recently used
    est.observe("c", 30, 100)
    assert len(est) == 2
    assert est.ratio("a") == pytest.approx(0.1)
    assert est.ratio("b") == 0.5  # forgotten: back to the prior
    assert est.ratio("c") == pytest.approx(0.3)


@given(
    observations=st.lists(st.tuples(st.integers(-10, 10_000), st.integers(-5, 5_000)),
                          max_size=30),
    max_tokens=st.integers(1, 100_000),
    smoothing=st.floats(0.01, 1.0),
    prior=st.floats(0.0, 1.0),
)
def test_estimate_always_within_one_and_max_tokens(
    observations: list[tuple[int, int]], max_tokens: int, smoothing: float, prior: float
) -> None:
    est = OutputEstimator(smoothing=smoothing, prior=prior, max_keys=3)
    for output, cap in observations:
        est.observe("k", output, cap)
        assert 0.0 <= est.ratio("k") <= 1.0
    assert 1 <= est.estimate("k", max_tokens) <= max_tokens


# -- calibration -----------------------------------------------------------------------

ALPHA, BETA, GAMMA = 1 / 8000, 0.025, 0.05


def _samples(points: list[tuple[int, int, int]], noise: float = 0.0,
             seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    samples = []
    for inp, out, img in points:
        seconds = ALPHA * inp + BETA * out + GAMMA * img
        seconds *= 1 + noise * rng.standard_normal()
        samples.append(Sample(inp, out, img, max(seconds, 0.0)))
    return samples


POINTS = grid([64, 256, 1024, 4096], [1, 8, 64, 256], images=(0, 1, 4))


def test_fit_recovers_noiseless_coefficients() -> None:
    fit = fit_profile(_samples(POINTS))
    assert fit.alpha == pytest.approx(ALPHA, rel=1e-9)
    assert fit.beta == pytest.approx(BETA, rel=1e-9)
    assert fit.gamma == pytest.approx(GAMMA, rel=1e-9)
    assert fit.r2 == pytest.approx(1.0, abs=1e-12)
    assert fit.n == len(POINTS)


def test_fit_recovers_noisy_coefficients() -> None:
    fit = fit_profile(_samples(POINTS * 5, noise=0.02, seed=7))
    assert fit.alpha == pytest.approx(ALPHA, rel=0.03)
    assert fit.beta == pytest.approx(BETA, rel=0.03)
    assert fit.gamma == pytest.approx(GAMMA, rel=0.10)
    assert 0.99 < fit.r2 < 1.0


def test_fit_without_images_gives_zero_gamma() -> None:
    fit = fit_profile(_samples(grid([100, 1000], [1, 50])))
    assert fit.gamma == 0.0
    assert fit.alpha == pytest.approx(ALPHA, rel=1e-9)
    assert fit.beta == pytest.approx(BETA, rel=1e-9)


def test_fit_never_returns_negative_coefficients() -> None:
    # Timings that fall with output length: least squares would give beta < 0.
    samples = [Sample(i, o, 0, max(0.01 * i - 0.001 * o, 0.0))
               for i, o, _ in grid([100, 200, 400], [1, 10, 100])]
    fit = fit_profile(samples)
    assert fit.beta == 0.0
    assert fit.alpha > 0.0
    assert fit.r2 < 1.0


@given(alpha=st.floats(0.0, 1e-2), beta=st.floats(0.0, 0.1), gamma=st.floats(0.0, 1.0))
@settings(max_examples=50)
def test_fit_recovers_any_non_negative_coefficients(alpha: float, beta: float,
                                                    gamma: float) -> None:
    samples = [Sample(i, o, g, alpha * i + beta * o + gamma * g) for i, o, g in POINTS]
    fit = fit_profile(samples)
    scale = alpha * 4096 + beta * 256 + gamma * 4  # the largest sample's time
    # Coefficients are compared on the time they contribute to the largest sample.
    assert fit.alpha * 4096 == pytest.approx(alpha * 4096, abs=1e-9 * scale + 1e-15)
    assert fit.beta * 256 == pytest.approx(beta * 256, abs=1e-9 * scale + 1e-15)
    assert fit.gamma * 4 == pytest.approx(gamma * 4, abs=1e-9 * scale + 1e-15)


def test_fit_refuses_too_few_samples() -> None:
    with pytest.raises(ValueError, match="at least 3 samples"):
        fit_profile(_samples([(10, 1, 0), (20, 2, 0)]))


def test_fit_refuses_all_zero_design() -> None:
    with pytest.raises(ValueError, match="nothing to fit"):
        fit_profile([Sample(0, 0, 0, 1.0)] * 3)


def test_fit_refuses_samples_that_cannot_separate_coefficients() -> None:
    # Output always twice the input: alpha and beta cannot be told apart.
    samples = [Sample(n, 2 * n, 0, 0.1 * n) for n in (10, 20, 40, 80)]
    with pytest.raises(ValueError, match="do not vary enough"):
        fit_profile(samples)
    with pytest.raises(ValueError, match="do not vary enough"):
        fit_profile([Sample(100, 10, 0, 1.0)] * 5)


@pytest.mark.parametrize("field", ["input_tokens", "output_tokens", "other", "seconds"])
@pytest.mark.parametrize("value", [-1.0, math.nan, math.inf])
def test_sample_rejects_bad_values(field: str, value: float) -> None:
    values = {"input_tokens": 1, "output_tokens": 1, "other": 0, "seconds": 1.0, field: value}
    with pytest.raises(ValueError, match=field):
        Sample(**values)


def test_fit_to_profile() -> None:
    profile = Fit(alpha=0.001, beta=0.02, gamma=0.3, r2=0.99, n=10).to_profile("m", 25.0)
    assert profile == ModelProfile(name="m", alpha=0.001, beta=0.02, gamma=0.3,
                                   capacity_mu_per_s=25.0)


def test_grid_is_the_full_product_in_order() -> None:
    assert grid([1, 2], [3], images=(0, 5)) == [(1, 3, 0), (1, 3, 5), (2, 3, 0), (2, 3, 5)]
    assert grid(np.array([4]), [5]) == [(4, 5, 0)]
    assert all(type(v) is int for v in grid(np.array([4]), [5])[0])


@pytest.mark.parametrize(("inputs", "outputs", "images", "match"), [
    ([], [1], (0,), "input_lengths must not be empty"),
    ([0], [1], (0,), "input_lengths"),
    ([1], [0], (0,), "output_lengths"),
    ([1], [1.5], (0,), "output_lengths"),
    ([1], [1], (-1,), "images"),
    ([True], [1], (0,), "input_lengths"),
])
def test_grid_rejects_bad_lengths(inputs: list, outputs: list, images: tuple,
                                  match: str) -> None:
    with pytest.raises(ValueError, match=match):
        grid(inputs, outputs, images)


# -- autoscaling -----------------------------------------------------------------------

POLICY = ScalingPolicy(target_utilisation=0.7, scale_out_above=0.85, scale_in_below=0.4,
                       min_replicas=1, max_replicas=10)


@pytest.mark.parametrize(("replicas", "demand", "expected"), [
    (4, 4 * 10 * 0.6, 4),    # utilisation 0.6: inside the band
    (4, 4 * 10 * 0.85, 4),   # on the scale-out threshold: still inside
    (4, 4 * 10 * 0.4, 4),    # on the scale-in threshold: still inside
    (4, 4 * 10 * 0.9, 6),    # 36 MU/s at 70 % of 10 per replica needs ceil(5.14) = 6
    (4, 4 * 10 * 0.2, 2),    # 8 MU/s needs ceil(1.14) = 2
    (2, 14.0, 2),            # exactly the target: no float-noise extra replica
    (5, 35.0 * 1.3, 7),      # 45.5 / 7 = 6.5 -> 7
])
def test_desired_replicas_hysteresis(replicas: int, demand: float, expected: int) -> None:
    assert desired_replicas(POLICY, replicas, demand, 10.0) == expected


def test_desired_replicas_ignores_float_noise_at_the_target() -> None:
    # 10.5 / (3.0 * 0.7) is 5.000000000000001 in floats: five replicas, not six.
    assert desired_replicas(POLICY, 2, 10.5, 3.0) == 5


def test_desired_replicas_clamps_to_min_and_max() -> None:
    assert desired_replicas(POLICY, 4, 0.0, 10.0) == 1
    assert desired_replicas(POLICY, 4, 1000.0, 10.0) == 10
    # A fleet already outside the bounds is brought back inside, even in the band.
    assert desired_replicas(POLICY, 12, 12 * 10 * 0.6, 10.0) == 10


def test_desired_replicas_from_zero() -> None:
    policy = ScalingPolicy(min_replicas=0, max_replicas=8)
    assert desired_replicas(policy, 0, 0.0, 10.0) == 0
    assert desired_replicas(policy, 0, 1.0, 10.0) == 1
    assert desired_replicas(policy, 3, 0.0, 10.0) == 0
    assert utilisation(0, 1.0, 10.0) == math.inf


@pytest.mark.parametrize("kwargs", [
    {"target_utilisation": 0.9},                    # above scale_out_above
    {"scale_in_below": 0.8},                        # above the target
    {"scale_in_below": -0.1},
    {"scale_out_above": math.inf},
    {"target_utilisation": math.nan},
    {"min_replicas": -1},
    {"min_replicas": 5, "max_replicas": 4},
    {"min_replicas": 0, "max_replicas": 0},
])
def test_scaling_policy_rejects_bad_settings(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        ScalingPolicy(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(("replicas", "demand", "capacity", "match"), [
    (-1, 1.0, 1.0, "replicas"),
    (1, -1.0, 1.0, "demand"),
    (1, math.nan, 1.0, "demand"),
    (1, 1.0, 0.0, "capacity"),
    (1, 1.0, math.inf, "capacity"),
])
def test_desired_replicas_rejects_bad_inputs(replicas: int, demand: float, capacity: float,
                                             match: str) -> None:
    with pytest.raises(ValueError, match=match):
        desired_replicas(POLICY, replicas, demand, capacity)


@given(replicas=st.integers(0, 20), demand=st.floats(0.0, 1e4), capacity=st.floats(0.1, 1e3))
def test_desired_replicas_properties(replicas: int, demand: float, capacity: float) -> None:
    wanted = desired_replicas(POLICY, replicas, demand, capacity)
    assert POLICY.min_replicas <= wanted <= POLICY.max_replicas
    load = utilisation(replicas, demand, capacity)
    if POLICY.scale_in_below <= load <= POLICY.scale_out_above:
        assert wanted == min(max(replicas, POLICY.min_replicas), POLICY.max_replicas)
    elif POLICY.min_replicas < wanted < POLICY.max_replicas:
        # Not clamped: the smallest fleet that runs at or below the target utilisation.
        assert utilisation(wanted, demand, capacity) <= POLICY.target_utilisation + 1e-9
        assert utilisation(wanted - 1, demand, capacity) > POLICY.target_utilisation
        assert (wanted > replicas) == (load > POLICY.scale_out_above)


# -- profiles --------------------------------------------------------------------------


def test_profile_round_trip(tmp_path) -> None:
    profile = ModelProfile(name="llama", alpha=1 / 8000, beta=0.025, gamma=0.05,
                           capacity_mu_per_s=30.0, cached_input_factor=0.1)
    path = tmp_path / "llama.toml"
    dump_profile(profile, path)
    assert load_profile(path) == profile


@pytest.mark.parametrize(("text", "match"), [
    ('name = "x"\nalpha = -1.0\n', "alpha must be finite and >= 0"),
    ('name = "x"\nbeta = nan\n', "beta must be finite"),
    ('name = "x"\ncapacity_mu_per_s = 0.0\n', "capacity_mu_per_s must be > 0"),
    ('name = "x"\ncached_input_factor = 2.0\n', "cached_input_factor must be <= 1"),
    ('name = "x"\ndelta = 1.0\n', "delta"),
    ('name = "x\n', "x.toml"),
])
def test_load_profile_rejects_bad_files(tmp_path, text: str, match: str) -> None:
    path = tmp_path / "x.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        load_profile(path)


def test_load_profile_missing_file_names_it(tmp_path) -> None:
    with pytest.raises(ValueError, match="missing.toml: cannot read"):
        load_profile(tmp_path / "missing.toml")


def test_model_units_with_cached_input_discount() -> None:
    profile = ModelProfile(alpha=1.0, beta=2.0, gamma=3.0, cached_input_factor=0.25)
    assert profile.model_units(100, 10, 2) == 100 + 20 + 6
    # 40 cached input tokens cost a quarter each: 60 + 10 + 20 + 6.
    assert profile.model_units(100, 10, 2, cached_input_tokens=40) == 96
    # More cached tokens than input tokens: all input is cached, no more.
    assert profile.model_units(100, 0, cached_input_tokens=500) == 25
    assert profile.model_units(100, 0, cached_input_tokens=-5) == 100
