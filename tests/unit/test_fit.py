"""Cost-model fitting from timing points (pure; no TensorFlow)."""

from __future__ import annotations

import numpy as np
import pytest

from calibration.fit import FitResult, fit_cost_model
from hetero_cs.planning.cost_checks import check_cost_model
from hetero_cs.planning.cost_model import LinearCostModel, PiecewiseLinearCostModel
from hetero_cs.errors import ConfigError

SIZES = (1, 4, 16, 64, 256)


def _linear_times(fixed_overhead_s, seconds_per_example, sizes=SIZES):
    return [fixed_overhead_s + seconds_per_example * b for b in sizes]


def test_exact_linear_points_are_recovered():
    result = fit_cost_model(SIZES, _linear_times(0.012, 3e-4))
    assert result.kind == "linear"
    assert isinstance(result.cost_model, LinearCostModel)
    assert result.cost_model.fixed_overhead_s == pytest.approx(0.012, rel=1e-9)
    assert result.cost_model.seconds_per_example == pytest.approx(3e-4, rel=1e-9)
    assert result.fit_error == pytest.approx(0.0, abs=1e-9)
    assert result.loo_error == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("seed", range(10))
def test_noisy_linear_points_predict_unprobed_sizes_within_5_percent(seed):
    rng = np.random.default_rng(seed)
    fixed_overhead_s, seconds_per_example = rng.uniform(1e-3, 5e-2), rng.uniform(1e-5, 1e-3)
    noisy = np.array(_linear_times(fixed_overhead_s, seconds_per_example)) * (1 + rng.uniform(-0.02, 0.02, 5))
    result = fit_cost_model(SIZES, noisy.tolist())
    assert result.kind == "linear"
    for b in (2, 8, 30, 100, 200):
        truth = fixed_overhead_s + seconds_per_example * b
        assert result.cost_model.predict_step_time_s(b) == pytest.approx(truth, rel=0.05)


def test_relative_weighting_keeps_small_batches_accurate():
    # Times span 100x; an unweighted least-squares fit would sacrifice the 1-example point.
    times = _linear_times(0.001, 4e-4)
    times[-1] *= 1.03
    result = fit_cost_model(SIZES, times)
    assert result.cost_model.predict_step_time_s(1) == pytest.approx(times[0], rel=0.03)


def test_non_monotone_raw_points_give_a_non_decreasing_model():
    times = [0.010, 0.009, 0.0125, 0.0121, 0.050]  # two dips: noise, not physics.
    result = fit_cost_model(SIZES, times)
    predictions = check_cost_model(result.cost_model, range(0, 400))  # raises if the curve ever decreases
    assert np.all(np.diff(predictions) >= 0)
    assert result.fit_error > 0  # measured dips cannot be followed exactly


def test_gpu_like_curve_is_fitted_piecewise_through_the_points():
    times = [0.010, 0.010, 0.0102, 0.014, 0.040]  # flat while kernels under-fill the device, then linear.
    result = fit_cost_model(SIZES, times)
    assert result.kind == "piecewise"
    assert isinstance(result.cost_model, PiecewiseLinearCostModel)
    assert result.fit_error == pytest.approx(0.0, abs=1e-12)
    assert result.cost_model.predict_step_time_s(160) == pytest.approx(0.027)  # midway between 64 and 256
    assert result.loo_error is not None and result.loo_error > 0


def test_linear_tolerance_zero_prefers_the_piecewise_model_for_noisy_points():
    times = np.array(_linear_times(0.01, 1e-4)) * np.array([1.0, 1.01, 0.99, 1.0, 1.0])
    assert fit_cost_model(SIZES, times.tolist()).kind == "linear"
    assert fit_cost_model(SIZES, times.tolist(), linear_tolerance=0.0).kind == "piecewise"


def test_single_point_gives_a_proportional_model():
    result = fit_cost_model([32], [0.016])
    assert result.kind == "linear"
    assert result.cost_model == LinearCostModel(fixed_overhead_s=0.0, seconds_per_example=0.0005)
    assert result.loo_error is None


def test_repeated_sizes_are_averaged():
    result = fit_cost_model([8, 8, 64, 64], [0.010, 0.012, 0.020, 0.022])
    assert result.cost_model.predict_step_time_s(8) == pytest.approx(0.011)
    assert result.cost_model.predict_step_time_s(64) == pytest.approx(0.021)
    assert result.fit_error == pytest.approx(0.001 / 0.010)


def test_unsorted_points_are_sorted():
    forward = fit_cost_model(SIZES, _linear_times(0.01, 1e-4))
    backward = fit_cost_model(SIZES[::-1], _linear_times(0.01, 1e-4)[::-1])
    assert backward.cost_model.predict_step_time_s(100) == pytest.approx(forward.cost_model.predict_step_time_s(100))


def test_loo_error_flags_a_bad_interior_point():
    times = _linear_times(0.01, 1e-4)
    times[2] *= 1.5
    result = fit_cost_model(SIZES, times, linear_tolerance=0.0)
    assert result.loo_error is not None and result.loo_error > 0.2


@pytest.mark.parametrize(
    ("sizes", "times", "match"),
    [
        ([], [], "at least one"),
        ([1, 2], [0.1], "as many step times"),
        ([0, 2], [0.1, 0.2], "integers >= 1"),
        ([1.5, 2], [0.1, 0.2], "integers >= 1"),
        ([1, 2], [0.1, -0.2], "finite and >= 0"),
        ([1, 2], [0.1, float("inf")], "finite and >= 0"),
    ],
)
def test_invalid_points_raise(sizes, times, match):
    with pytest.raises(ConfigError, match=match):
        fit_cost_model(sizes, times)


def test_invalid_tolerance_raises():
    with pytest.raises(ConfigError, match="linear_tolerance"):
        fit_cost_model([1, 2], [0.1, 0.2], linear_tolerance=1.0)


def test_fit_result_validates():
    with pytest.raises(ConfigError, match="kind"):
        FitResult(LinearCostModel(0.0, 1.0), 0.0, "cubic")
    with pytest.raises(ConfigError, match="fit_error"):
        FitResult(LinearCostModel(0.0, 1.0), float("nan"), "linear")
