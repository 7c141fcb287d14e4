"""Robust timing statistics and probe batch sizes (pure; no TensorFlow)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from calibration.timing import TimingStats, probe_batch_sizes, summarize_trials
from hetero_cs.errors import ConfigError


def test_median_and_mad_of_clean_samples():
    stats = summarize_trials([0.010, 0.012, 0.011, 0.013, 0.009])
    assert stats.median_s == pytest.approx(0.011)
    assert stats.mad_s == pytest.approx(0.001)
    assert (stats.min_s, stats.max_s) == (pytest.approx(0.009), pytest.approx(0.013))
    assert (stats.n, stats.n_outliers) == (5, 0)


def test_one_slow_outlier_is_dropped_and_does_not_move_the_median():
    stats = summarize_trials([0.010, 0.011, 0.010, 0.012, 0.250])
    assert stats.n_outliers == 1
    assert stats.n == 4
    assert stats.max_s == pytest.approx(0.012)
    assert stats.median_s == pytest.approx(0.0105)


def test_gaussian_noise_keeps_almost_every_sample():
    rng = np.random.default_rng(0)
    samples = 0.020 + 0.0005 * rng.standard_normal(200)
    stats = summarize_trials(samples.tolist())
    assert stats.n_outliers <= 2  # 5 MADs ~ 3.4 sigma: ~0.07 % of Gaussian samples lie beyond.
    assert stats.median_s == pytest.approx(0.020, rel=0.01)
    assert stats.mad_s == pytest.approx(0.0005 / 1.4826, rel=0.2)


def test_heavy_tail_of_stalls_is_removed():
    rng = np.random.default_rng(1)
    samples = np.concatenate([0.015 + 0.0002 * rng.standard_normal(40), [0.09, 0.12, 0.2]])
    stats = summarize_trials(samples.tolist())
    assert 3 <= stats.n_outliers <= 4  # the three stalls, and at most one ~3.4-sigma Gaussian sample
    assert stats.max_s < 0.02


def test_identical_samples_have_zero_mad_and_no_outliers():
    stats = summarize_trials([0.005] * 6)
    assert stats == TimingStats(median_s=0.005, mad_s=0.0, min_s=0.005, max_s=0.005, n=6, n_outliers=0)


def test_samples_equal_to_float_rounding_are_not_outliers():
    stats = summarize_trials([0.005, 0.005, 0.005, 0.005 * (1 + 1e-9)])
    assert stats.n_outliers == 0


def test_single_sample():
    stats = summarize_trials([0.25])
    assert (stats.median_s, stats.mad_s, stats.n, stats.n_outliers) == (0.25, 0.0, 1, 0)


def test_outlier_threshold_is_configurable():
    samples = [1.0, 1.1, 0.9, 1.0, 1.6]  # 1.6 is 6 MADs (MAD = 0.1) from the median.
    assert summarize_trials(samples, outlier_mads=5.0).n_outliers == 1
    assert summarize_trials(samples, outlier_mads=7.0).n_outliers == 0


@pytest.mark.parametrize(
    ("samples", "kwargs", "match"),
    [
        ([], {}, "at least one sample"),
        ([0.1, -0.1], {}, "finite and >= 0"),
        ([0.1, float("nan")], {}, "finite and >= 0"),
        ([0.1], {"outlier_mads": 0.0}, "outlier_mads"),
    ],
)
def test_invalid_samples_raise(samples, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        summarize_trials(samples, **kwargs)


def test_timing_stats_validates():
    with pytest.raises(ConfigError, match="min_s <= median_s <= max_s"):
        TimingStats(median_s=1.0, mad_s=0.0, min_s=2.0, max_s=3.0, n=1, n_outliers=0)
    with pytest.raises(ConfigError, match="n >= 1"):
        TimingStats(median_s=1.0, mad_s=0.0, min_s=1.0, max_s=1.0, n=0, n_outliers=0)


def test_probe_batch_sizes_are_geometric_and_end_at_the_maximum():
    assert probe_batch_sizes(256) == (1, 4, 16, 64, 256)
    assert probe_batch_sizes(1000, num=4, min_batch_size=10) == (10, 46, 215, 1000)


@pytest.mark.parametrize("max_batch_size", [1, 2, 3, 7, 100, 257, 4096])
@pytest.mark.parametrize("num", [1, 2, 5, 9])
def test_probe_batch_sizes_invariants(max_batch_size, num):
    sizes = probe_batch_sizes(max_batch_size, num=num)
    assert sizes[-1] == max_batch_size
    assert 1 <= len(sizes) <= num
    assert list(sizes) == sorted(set(sizes))
    assert all(1 <= b <= max_batch_size for b in sizes)
    if num >= 2:
        assert sizes[0] == 1


def test_probe_batch_sizes_deduplicate_narrow_ranges():
    assert probe_batch_sizes(3, num=5) == (1, 2, 3)
    assert probe_batch_sizes(1, num=5) == (1,)


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((0,), {}, "max_batch_size >= 1"),
        ((8,), {"num": 0}, "num >= 1"),
        ((8,), {"min_batch_size": 16}, "max_batch_size >= min_batch_size"),
        ((8.0,), {}, "integer max_batch_size"),
    ],
)
def test_probe_batch_sizes_invalid(args, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        probe_batch_sizes(*args, **kwargs)


def test_pure_modules_import_without_tensorflow():
    code = (
        "import sys; sys.modules['tensorflow'] = None; sys.modules['pynvml'] = None\n"
        "import calibration.timing, calibration.fit, calibration.store, calibration.result\n"
        "assert 'keras' not in sys.modules, 'keras was imported'\n"
    )
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr


def test_calibration_public_api_snapshot():
    import calibration

    assert sorted(calibration.__all__) == [
        "CalibrationResult", "DeviceProbe", "DeviceProfile", "FitResult", "ProfileStore", "TimingStats",
        "build_model", "calibrate", "default_cache_dir", "fit_cost_model", "input_signature", "load_result_file",
        "model_fingerprint", "preserved_model_state", "probe_batch_sizes", "profile_key", "save_result_file",
        "summarize_trials",
    ]
