"""costmodel: output estimates, NNLS calibration, autoscaling policy, profiles."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from costmodel.calibrate import Fit, Sample, fit_profile, grid
from costmodel.capacity import Autoscaler, DriftMeter, DriftPolicy, ScalingPolicy
from costmodel.estimate import Ema, OutputEstimator
from costmodel.units import ModelProfile, Usage, dump_profile, load_profile

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


@pytest.mark.parametrize(
    "kwargs", [{"smoothing": 0.0}, {"prior": 1.5}, {"prior": -0.1}, {"max_keys": 0}]
)
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
    observations=st.lists(st.tuples(st.integers(-10, 10_000), st.integers(-5, 5_000)), max_size=30),
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


def _samples(points: list[tuple[int, int, int]], noise: float = 0.0, seed: int = 0) -> list[Sample]:
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
    samples = [
        Sample(i, o, 0, max(0.01 * i - 0.001 * o, 0.0))
        for i, o, _ in grid([100, 200, 400], [1, 10, 100])
    ]
    fit = fit_profile(samples)
    assert fit.beta == 0.0
    assert fit.alpha > 0.0
    assert fit.r2 < 1.0


@given(alpha=st.floats(0.0, 1e-2), beta=st.floats(0.0, 0.1), gamma=st.floats(0.0, 1.0))
@settings(max_examples=50)
def test_fit_recovers_any_non_negative_coefficients(
    alpha: float, beta: float, gamma: float
) -> None:
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
    assert profile == ModelProfile(
        name="m", alpha=0.001, beta=0.02, gamma=0.3, capacity_mu_per_s=25.0
    )


def test_grid_is_the_full_product_in_order() -> None:
    assert grid([1, 2], [3], images=(0, 5)) == [(1, 3, 0), (1, 3, 5), (2, 3, 0), (2, 3, 5)]
    assert grid(np.array([4]), [5]) == [(4, 5, 0)]
    assert all(type(v) is int for v in grid(np.array([4]), [5])[0])


@pytest.mark.parametrize(
    ("inputs", "outputs", "images", "match"),
    [
        ([], [1], (0,), "input_lengths must not be empty"),
        ([0], [1], (0,), "input_lengths"),
        ([1], [0], (0,), "output_lengths"),
        ([1], [1.5], (0,), "output_lengths"),
        ([1], [1], (-1,), "images"),
        ([True], [1], (0,), "input_lengths"),
    ],
)
def test_grid_rejects_bad_lengths(inputs: list, outputs: list, images: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        grid(inputs, outputs, images)


# -- autoscaling -----------------------------------------------------------------------

# 10 model units per second per replica, at most 80% of it; demand smoothed over 10 s.
POLICY = ScalingPolicy(
    min_replicas=1,
    max_replicas=10,
    target_utilisation=0.8,
    scale_down_after_s=60.0,
    cold_start_s=0.0,
    rate_window_s=10.0,
    drain_s=10.0,
)


def steady(scaler: Autoscaler, mu_per_s: float, start: float, end: float) -> None:
    """Arrivals of `mu_per_s` model units per second, one per second."""
    for t in range(int(start), int(end)):
        scaler.arrived(mu_per_s, float(t))


def test_demand_at_the_target_needs_exactly_that_many_replicas() -> None:
    scaler = Autoscaler(POLICY, 10.0)
    steady(scaler, 24.0, 0, 11)  # 24 MU/s at 8 per replica: 3, not 4 (no float noise)
    decision = scaler.decide(10.5, serving=3, backlog_mu=0.0)
    assert decision.desired == 3 and decision.demand_mu_per_s == pytest.approx(24.0)
    assert decision.utilisation == pytest.approx(0.8)


def test_a_backlog_counts_as_demand_to_drain_within_drain_s() -> None:
    scaler = Autoscaler(POLICY, 10.0)
    # No arrivals in the window, 160 model units queued: 16 MU/s for 10 s, 2 replicas.
    assert scaler.decide(100.0, serving=1, backlog_mu=160.0).desired == 2
    # Worked off: the extra replica stays for the quiet window, then goes.
    assert scaler.decide(101.0, serving=2, backlog_mu=0.0).desired == 2
    assert scaler.decide(160.5, serving=2, backlog_mu=0.0).desired == 1


def test_scaling_up_is_immediate_and_down_waits_for_the_quiet_window() -> None:
    scaler = Autoscaler(POLICY, 10.0)
    desired = {}
    for t in range(240):
        # 40 MU/s (5 replicas) for 20 s, then 8 MU/s (1), a burst of 80 MU/s from 200 s.
        scaler.arrived(40.0 if t < 20 else 80.0 if t >= 200 else 8.0, float(t))
        desired[t] = scaler.decide(t + 0.5, serving=1, backlog_mu=0.0).desired
    # Up as soon as the load shows (the rate since the first arrival, until a whole
    # window has passed): 40 MU/s seen as 27 after 1.5 s, 34 after 3.5 s.
    assert desired[0] == 1 and desired[1] == 4 and desired[3] == 5
    # The rate falls below 5 replicas' worth after 20.5 s and to 1 replica's at 28.5 s;
    # the count follows each step one quiet window (60 s) later.
    assert all(desired[t] == 5 for t in range(3, 81))
    assert desired[81] == 4 and all(desired[t] == 1 for t in range(88, 200))
    assert desired[200] == 2 and desired[208] == 10  # max_replicas


def test_a_cold_start_asks_for_more_to_work_off_what_piles_up_meanwhile() -> None:
    warm = Autoscaler(POLICY, 10.0)
    cold = Autoscaler(
        ScalingPolicy(
            min_replicas=1,
            max_replicas=10,
            target_utilisation=0.8,
            cold_start_s=30.0,
            rate_window_s=10.0,
            drain_s=10.0,
        ),
        10.0,
    )
    for scaler in (warm, cold):
        steady(scaler, 24.0, 0, 11)
    assert warm.decide(10.5, serving=1, backlog_mu=0.0).desired == 3
    # 16 MU/s more than one replica takes at its target, for 30 s: 480 MU to drain in
    # 10 s on top of 24 MU/s: 72 MU/s, 9 replicas.
    assert cold.decide(10.5, serving=1, backlog_mu=0.0).desired == 9
    # With the serving fleet already large enough, the cold start adds nothing.
    fresh = Autoscaler(cold.policy, 10.0)
    steady(fresh, 24.0, 0, 11)
    assert fresh.decide(10.5, serving=3, backlog_mu=0.0).desired == 3


def test_an_idle_endpoint_goes_to_zero_and_its_first_request_brings_one_back() -> None:
    policy = ScalingPolicy(
        min_replicas=0,
        max_replicas=4,
        scale_down_after_s=60.0,
        cold_start_s=60.0,
        rate_window_s=10.0,
        drain_s=10.0,
    )
    scaler = Autoscaler(policy, 10.0)
    steady(scaler, 5.0, 0, 10)
    assert scaler.decide(9.5, serving=1, backlog_mu=0.0).desired == 1
    assert scaler.decide(40.0, serving=1, backlog_mu=0.0).desired == 1  # quiet, not long
    decision = scaler.decide(70.0, serving=1, backlog_mu=0.0)
    assert decision.desired == 0 and decision.demand_mu_per_s == 0.0
    assert scaler.decide(80.0, serving=0, backlog_mu=0.0).utilisation == 0.0
    scaler.arrived(3.0, 100.0)
    decision = scaler.decide(100.5, serving=0, backlog_mu=3.0)
    assert decision.desired >= 1 and decision.utilisation == math.inf


def test_the_desired_count_stays_within_min_and_max() -> None:
    scaler = Autoscaler(ScalingPolicy(min_replicas=2, max_replicas=3), 10.0)
    assert scaler.decide(0.0, serving=2, backlog_mu=0.0).desired == 2
    assert scaler.decide(1.0, serving=2, backlog_mu=1e9).desired == 3


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"min_replicas": -1}, "min_replicas"),
        ({"min_replicas": 3, "max_replicas": 2}, "max_replicas"),
        ({"min_replicas": 0, "max_replicas": 0}, "max_replicas"),
        ({"target_utilisation": 0.0}, "target_utilisation"),
        ({"target_utilisation": 1.5}, "target_utilisation"),
        ({"cold_start_s": -1.0}, "cold_start_s"),
        ({"scale_down_after_s": math.inf}, "scale_down_after_s"),
        ({"rate_window_s": 0.0}, "rate_window_s"),
        ({"drain_s": math.nan}, "drain_s"),
    ],
)
def test_a_bad_policy_is_refused(fields: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ScalingPolicy(**fields)
    with pytest.raises(ValueError, match="mu_per_s_per_replica"):
        Autoscaler(ScalingPolicy(), 0.0)


@settings(max_examples=100, deadline=None)
@given(
    rates=st.lists(st.floats(0, 200), min_size=1, max_size=40),
    backlogs=st.lists(st.floats(0, 5_000), min_size=1, max_size=40),
)
def test_decisions_stay_in_bounds_and_the_rates_replicas_stay_through_the_quiet_window(
    rates: list[float], backlogs: list[float]
) -> None:
    scaler, steady = Autoscaler(POLICY, 10.0), Autoscaler(POLICY, 10.0)
    history: list[tuple[float, int]] = []  # decisions with no backlog
    for t, (rate, backlog) in enumerate(zip(rates, backlogs)):
        for each in (scaler, steady):
            each.arrived(rate, float(t))
        desired = scaler.decide(t + 0.5, serving=1, backlog_mu=backlog).desired
        assert POLICY.min_replicas <= desired <= POLICY.max_replicas
        # With a backlog, at least what the same arrivals without one are given ...
        without = steady.decide(t + 0.5, serving=1, backlog_mu=0.0).desired
        assert desired >= without
        # ... which never drops below a count of the last quiet window.
        recent = [n for at, n in history if at > t + 0.5 - POLICY.scale_down_after_s]
        assert without >= max(recent, default=0)
        history.append((t + 0.5, without))


# -- drift -------------------------------------------------------------------------------

DRIFT = DriftPolicy(window_s=60.0, min_full_s=20.0, warn_after_s=60.0)


def feed(
    meter: DriftMeter,
    start: float,
    end: float,
    mu_per_s: float,
    *,
    serving_mu_per_s: float = 10.0,
    full: bool = True,
    completed: float = 0.0,
) -> float:
    """Ticks every second from `start` to `end` with `mu_per_s` completed; the total."""
    for now in range(int(start), int(end) + 1):
        meter.observe(float(now), completed, serving_mu_per_s, full)
        completed += mu_per_s
    return completed


def test_drift_is_completed_over_predicted_while_full() -> None:
    meter = DriftMeter(DRIFT)
    feed(meter, 0, 30, 5.0)  # two workers of 5 MU/s predicted 10, doing 5
    assert meter.ratio == pytest.approx(0.5)


def test_drift_has_no_reading_below_min_full_s_or_while_not_full() -> None:
    meter = DriftMeter(DRIFT)
    total = feed(meter, 0, 15, 5.0)
    assert meter.ratio is None  # 15 s full: too little
    total = feed(meter, 16, 200, 1.0, full=False, completed=total)
    assert meter.ratio is None  # a light load says nothing about capacity
    feed(meter, 201, 230, 12.0, completed=total)
    assert meter.ratio == pytest.approx(1.2)  # only the full seconds count


def test_drift_reading_covers_only_the_window() -> None:
    meter = DriftMeter(DRIFT)
    total = feed(meter, 0, 100, 20.0)
    assert meter.ratio == pytest.approx(2.0)
    feed(meter, 101, 200, 10.0, completed=total)
    assert meter.ratio == pytest.approx(1.0)


def test_drift_warns_once_per_excursion_after_warn_after_s() -> None:
    meter = DriftMeter(DRIFT)
    total = feed(meter, 0, 20, 5.0)
    assert meter.ratio == pytest.approx(0.5)  # out of the band from t = 20
    assert not meter.warning_due(79.0)
    total = feed(meter, 21, 80, 5.0, completed=total)
    assert meter.warning_due(80.0)
    assert not meter.warning_due(81.0)  # once
    total = feed(meter, 81, 200, 10.0, completed=total)  # back in the band
    assert meter.ratio == pytest.approx(1.0) and not meter.warning_due(200.0)
    total = feed(meter, 201, 400, 15.0, completed=total)  # out again: a new excursion
    assert meter.ratio == pytest.approx(1.5) and meter.warning_due(400.0)


def test_drift_warns_only_after_warn_after_s_of_readings_out_of_band() -> None:
    meter = DriftMeter(DRIFT)
    total = feed(meter, 0, 50, 5.0)  # out of the band from t = 20
    total = feed(meter, 51, 200, 5.0, full=False, completed=total)  # the load went away
    assert meter.ratio is None and not meter.warning_due(200.0)
    # Full again, still off: readings from t = 221 on, and a minute of them is needed;
    # the excursion before the gap does not count.
    total = feed(meter, 201, 280, 5.0, completed=total)
    assert meter.ratio == pytest.approx(0.5) and not meter.warning_due(280.0)
    feed(meter, 281, 281, 5.0, completed=total)
    assert meter.warning_due(281.0)


def test_drift_skips_a_look_with_a_non_finite_figure() -> None:
    meter = DriftMeter(DRIFT)
    total = feed(meter, 0, 30, 5.0)
    meter.observe(31.0, math.nan, 10.0, True)
    meter.observe(31.0, total, math.inf, True)
    feed(meter, 31, 40, 5.0, completed=total)
    assert meter.ratio == pytest.approx(0.5)


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"low": 0.0}, "band"),
        ({"low": 1.1}, "band"),
        ({"high": 0.9}, "band"),
        ({"min_full_s": 0.0}, "min_full_s"),
        ({"min_full_s": 90.0}, "min_full_s"),
        ({"warn_after_s": -1.0}, "warn_after_s"),
    ],
)
def test_a_bad_drift_policy_is_refused(fields: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DriftPolicy(**fields)


# -- profiles --------------------------------------------------------------------------


def test_profile_round_trip(tmp_path) -> None:
    profile = ModelProfile(
        name="llama",
        alpha=1 / 8000,
        beta=0.025,
        gamma=0.05,
        capacity_mu_per_s=30.0,
        cached_input_factor=0.1,
    )
    path = tmp_path / "llama.toml"
    dump_profile(profile, path)
    assert load_profile(path) == profile


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('name = "x"\nalpha = -1.0\n', "alpha must be finite and >= 0"),
        ('name = "x"\nbeta = nan\n', "beta must be finite"),
        ('name = "x"\ncapacity_mu_per_s = 0.0\n', "capacity_mu_per_s must be > 0"),
        ('name = "x"\ncached_input_factor = 2.0\n', "cached_input_factor must be <= 1"),
        ('name = "x"\ndelta = 1.0\n', "delta"),
        ('name = "x\n', "x.toml"),
    ],
)
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


@pytest.mark.parametrize(
    "fields",
    [
        {"model_units": math.nan},
        {"model_units": math.inf},
        {"other_units": math.nan},
        {"other_units": -1.0},
        {"input_tokens": -1},
        {"cached_input_tokens": -5},
    ],
)
def test_usage_refuses_counts_that_would_corrupt_running_sums(fields: dict) -> None:
    values = {"input_tokens": 10, "output_tokens": 5, "model_units": 1.0} | fields
    with pytest.raises(ValueError, match="finite and >= 0"):
        Usage(**values)
    # On the wire too: a worker's usage decodes to an error, never into the sums.
    with pytest.raises(msgspec.ValidationError, match="finite and >= 0"):
        msgspec.msgpack.decode(msgspec.msgpack.encode(values), type=Usage)
