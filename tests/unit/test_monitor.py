"""Unit tests for hetero_cs.planning.monitor: step pairing, straggler statistics, robust estimates (pure, no TF)."""

from __future__ import annotations

import logging
import math
import random
import threading

import numpy as np
import pytest

from hetero_cs.planning.cost_model import LinearCostModel, ScaledCostModel
from hetero_cs.errors import CalibrationError, ConfigError
from hetero_cs.planning.monitor import StepSample, StepTimeMonitor


def _record_step(monitor: StepTimeMonitor, sizes, times_s) -> None:
    for replica_id, (b, t) in enumerate(zip(sizes, times_s)):
        monitor.record(replica_id, b, t)


def test_step_sample_statistics_worked_example():
    sample = StepSample.from_times(3, [10, 20, 30], [0.10, 0.20, 0.30])
    assert sample.step == 3
    assert sample.makespan_s == pytest.approx(0.30)
    assert sample.straggler_replica == 2
    assert sample.straggler_wait_s == pytest.approx(0.10)  # mean of waits [0.20, 0.10, 0]
    assert sample.total_idle_s == pytest.approx(0.30)
    assert sample.balance_efficiency == pytest.approx(0.2 / 0.3)


def test_step_sample_all_zero_times_is_balanced():
    sample = StepSample.from_times(0, [0, 0], [0.0, 0.0])
    assert sample.balance_efficiency == 1.0
    assert sample.straggler_wait_s == 0.0


def test_step_sample_ties_name_lowest_replica_as_straggler():
    assert StepSample.from_times(0, [1, 1, 1], [0.2, 0.3, 0.3]).straggler_replica == 1


def test_step_completes_only_when_every_replica_reported():
    monitor = StepTimeMonitor(3)
    monitor.record(2, 8, 0.3)
    monitor.record(0, 8, 0.1)
    assert monitor.completed_steps == 0
    assert monitor.last_step() is None
    monitor.record(1, 8, 0.2)
    assert monitor.completed_steps == 1
    last = monitor.last_step()
    assert last.step == 0
    assert last.per_replica_step_times_s == (0.1, 0.2, 0.3)
    assert last.straggler_replica == 2


def test_a_report_that_names_its_idle_replicas_completes_the_step_as_their_own_reports_would():
    # The engine's first active replica reports the replicas its step left idle in the same call (one host callback).
    together, apart = StepTimeMonitor(3), StepTimeMonitor(3)
    for key in (1.5, 2.5):
        together.record(1, 8, 0.2, step_key=key, idle_replicas=(0, 2))
        apart.record(1, 8, 0.2, step_key=key)
        apart.record(0, 0, 0.0, step_key=key)
        apart.record(2, 0, 0.0, step_key=key)
    assert together.completed_steps == apart.completed_steps == 2
    assert together.last_step() == apart.last_step()
    assert together.last_step().per_replica_batch_sizes == (0, 8, 0)
    with pytest.raises(ConfigError, match="idle_replicas"):
        together.record(1, 8, 0.2, step_key=3.5, idle_replicas=(3,))
    assert together.completed_steps == 2


def test_kth_report_of_each_replica_belongs_to_step_k():
    monitor = StepTimeMonitor(2)
    monitor.record(0, 10, 1.0)  # step 0
    monitor.record(0, 11, 2.0)  # step 1
    monitor.record(0, 12, 3.0)  # step 2
    assert monitor.completed_steps == 0
    monitor.record(1, 20, 4.0)  # step 0
    assert monitor.last_step().per_replica_batch_sizes == (10, 20)
    monitor.record(1, 21, 5.0)  # step 1
    last = monitor.last_step()
    assert (last.step, last.per_replica_batch_sizes, last.per_replica_step_times_s) == (1, (11, 21), (2.0, 5.0))
    assert monitor.completed_steps == 2


def test_window_is_bounded_and_keeps_the_latest_steps():
    monitor = StepTimeMonitor(2, window_steps=8)
    for k in range(40):
        _record_step(monitor, [k, k], [1.0, 1.0])
    window = monitor.window()
    assert monitor.num_samples == len(window) == 8
    assert [s.step for s in window] == list(range(32, 40))
    assert monitor.completed_steps == 40


@pytest.mark.parametrize("bad_time", [math.nan, math.inf, -0.5, "fast"])
def test_invalid_time_is_ignored_with_one_warning(caplog, bad_time):
    monitor = StepTimeMonitor(2)
    with caplog.at_level(logging.WARNING, logger="hetero_cs.planning.monitor"):
        _record_step(monitor, [4, 4], [bad_time, 0.1])
        _record_step(monitor, [4, 4], [0.2, bad_time])
        _record_step(monitor, [4, 4], [0.2, 0.1])
    warnings = [r for r in caplog.records if "invalid step time" in r.getMessage()]
    assert len(warnings) == 1
    assert monitor.completed_steps == 3  # Pairing is kept: the invalid reports still complete their steps.
    assert [s.step for s in monitor.window()] == [2]
    assert monitor.last_step().per_replica_step_times_s == (0.2, 0.1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_replicas": 0}, "num_replicas must be a positive integer. Received: num_replicas=0"),
        ({"num_replicas": 2, "window_steps": 0}, "window_steps=0"),
        ({"num_replicas": 2.0}, "num_replicas=2.0"),
        ({"num_replicas": True}, "num_replicas=True"),
    ],
)
def test_constructor_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        StepTimeMonitor(**kwargs)


def test_record_rejects_bad_replica_id_and_batch_size():
    monitor = StepTimeMonitor(2)
    with pytest.raises(ConfigError, match=r"replica_id must be an integer in \[0, 2\). Received: replica_id=2"):
        monitor.record(2, 4, 0.1)
    with pytest.raises(ConfigError, match="batch_size must be a non-negative integer.*batch_size=-1"):
        monitor.record(0, -1, 0.1)
    with pytest.raises(ValueError, match="batch_size=2.5"):  # ConfigError is also a ValueError.
        monitor.record(0, 2.5, 0.1)
    assert monitor.completed_steps == 0


def test_throughput_is_a_windowed_median_robust_to_an_outlier():
    monitor = StepTimeMonitor(2, window_steps=5)
    for t0 in [0.10, 0.10, 5.0, 0.10, 0.10]:  # One 50x outlier (a GC pause) on replica 0.
        _record_step(monitor, [10, 0], [t0, 0.01])
    throughput = monitor.per_replica_throughput_examples_per_s()
    assert throughput.shape == (2,)
    assert throughput[0] == pytest.approx(100.0)
    assert math.isnan(throughput[1])  # No example in the window: unknown.


def test_updated_models_scale_base_by_the_median_ratio():
    base = [LinearCostModel(0.01, 0.001), LinearCostModel(0.0, 0.002)]
    monitor = StepTimeMonitor(2, window_steps=7)
    # Replica 0 runs 2x slower than calibrated, at two slice sizes; replica 1 as calibrated, with one outlier.
    for k in range(7):
        b0 = 20 if k % 2 else 40
        t0 = 2.0 * base[0].predict_step_time_s(b0)
        t1 = base[1].predict_step_time_s(30) * (10.0 if k == 3 else 1.0)
        _record_step(monitor, [b0, 30], [t0, t1])
    models = monitor.updated_cost_models(base)
    assert isinstance(models[0], ScaledCostModel)
    for b in (1, 25, 100):
        assert models[0].predict_step_time_s(b) == pytest.approx(2.0 * base[0].predict_step_time_s(b))
        assert models[1].predict_step_time_s(b) == pytest.approx(base[1].predict_step_time_s(b))


def test_replica_without_examples_keeps_its_base_model():
    base = [LinearCostModel(0.0, 0.001), LinearCostModel(0.005, 0.004)]
    monitor = StepTimeMonitor(2)
    for _ in range(4):
        _record_step(monitor, [32, 0], [0.064, 0.005])
    models = monitor.updated_cost_models(base)
    assert models[1] is base[1]
    assert models[0].predict_step_time_s(32) == pytest.approx(0.064)


def test_empty_window_returns_base_models_unchanged():
    base = [LinearCostModel(0.0, 0.001)]
    assert StepTimeMonitor(1).updated_cost_models(base) == [base[0]]


def test_base_models_length_must_match():
    with pytest.raises(ConfigError, match=r"len\(base_models\)=1, num_replicas=2"):
        StepTimeMonitor(2).updated_cost_models([LinearCostModel(0.0, 0.001)])


def test_without_base_one_slice_size_gives_a_proportional_model():
    monitor = StepTimeMonitor(1)
    for t in [0.10, 0.11, 0.09, 0.10, 3.0]:
        _record_step(monitor, [50], [t])
    (model,) = monitor.updated_cost_models()
    assert model.predict_step_time_s(0) == pytest.approx(0.0)
    assert model.predict_step_time_s(100) == pytest.approx(0.20)


def test_without_base_a_wide_size_range_gives_an_affine_fit():
    true = LinearCostModel(0.02, 0.001)
    monitor = StepTimeMonitor(1, window_steps=12)
    for k in range(12):
        b = [16, 32, 64][k % 3]
        _record_step(monitor, [b], [true.predict_step_time_s(b) * (1.0 if k != 4 else 3.0)])
    (model,) = monitor.updated_cost_models()
    for b in (8, 50, 200):
        assert model.predict_step_time_s(b) == pytest.approx(true.predict_step_time_s(b), rel=1e-9)


def test_without_base_a_narrow_size_range_falls_back_to_proportional():
    # Slices 48 and 50 with noisy times: a fitted slope would be noise; the secant through the origin is used.
    monitor = StepTimeMonitor(1, window_steps=4)
    for b, t in [(48, 0.050), (50, 0.049), (48, 0.049), (50, 0.051)]:
        _record_step(monitor, [b], [t])
    (model,) = monitor.updated_cost_models()
    assert model.predict_step_time_s(0) == pytest.approx(0.0)
    secant_s_per_example = np.median([0.050 / 48, 0.049 / 50, 0.049 / 48, 0.051 / 50])
    assert model.predict_step_time_s(49) == pytest.approx(49 * secant_s_per_example)


def test_without_base_a_negative_intercept_falls_back_to_proportional():
    monitor = StepTimeMonitor(1, window_steps=4)
    for b, t in [(10, 0.001), (40, 0.040), (10, 0.001), (40, 0.040)]:  # Line through (10, 1 ms), (40, 40 ms).
        _record_step(monitor, [b], [t])
    (model,) = monitor.updated_cost_models()
    assert model.predict_step_time_s(0) == pytest.approx(0.0)


def test_without_base_an_unknown_replica_gets_the_slowest_known_model():
    monitor = StepTimeMonitor(3)
    for _ in range(3):
        _record_step(monitor, [40, 40, 0], [0.040, 0.120, 0.0])
    models = monitor.updated_cost_models()
    assert models[2].predict_step_time_s(40) == pytest.approx(0.120)
    assert models[0].predict_step_time_s(40) == pytest.approx(0.040)


def test_without_base_and_without_samples_raises():
    with pytest.raises(CalibrationError, match="no step where a replica had a positive slice.*pass base_models"):
        StepTimeMonitor(2).updated_cost_models()


def test_relative_standard_errors_follow_the_mad_formula():
    model = LinearCostModel(0.0, 0.001)
    monitor = StepTimeMonitor(3, window_steps=5)
    levels = [1.0, 1.1, 0.9, 1.05, 0.95]  # median 1.0, absolute deviations [0, .1, .1, .05, .05]: MAD 0.05
    for level in levels:
        _record_step(monitor, [20, 20, 0], [level * 0.020, 0.020, 0.001])
    errors = monitor.relative_standard_errors([model, model, model])
    assert errors.shape == (3,)
    assert errors[0] == pytest.approx(1.2533 * 1.4826 * 0.05 / math.sqrt(5))
    assert errors[1] == 0.0  # Steady: no spread.
    assert errors[2] == 0.0  # No example in the window: the model is taken as given.


def test_relative_standard_errors_are_large_while_a_speed_changes():
    model = LinearCostModel(0.0, 0.001)
    monitor = StepTimeMonitor(1, window_steps=16)
    for k in range(16):
        _record_step(monitor, [10], [0.010 * (2.0 if k >= 8 else 1.0)])
    (error,) = monitor.relative_standard_errors([model])
    assert error > 0.1  # Half the window at 1x, half at 2x: the level is known to no better than tens of %.


def test_relative_standard_errors_need_one_model_per_replica():
    with pytest.raises(ConfigError, match=r"len\(cost_models\)=1, num_replicas=2"):
        StepTimeMonitor(2).relative_standard_errors([LinearCostModel(0.0, 0.001)])


def test_reset_forgets_samples_and_restarts_pairing():
    monitor = StepTimeMonitor(2)
    monitor.record(0, 4, 0.1)
    _record_step(monitor, [4, 4], [0.1, 0.1])  # Replica 0's second report is pending for step 1.
    monitor.reset()
    assert (monitor.completed_steps, monitor.num_samples, monitor.last_step()) == (0, 0, None)
    monitor.record(1, 8, 0.3)
    monitor.record(0, 8, 0.2)
    assert monitor.last_step().step == 0
    assert monitor.last_step().per_replica_step_times_s == (0.2, 0.3)


def test_incomplete_steps_are_dropped_to_bound_memory(caplog):
    monitor = StepTimeMonitor(2, window_steps=1)
    with caplog.at_level(logging.WARNING, logger="hetero_cs.planning.monitor"):
        for k in range(200):
            monitor.record(0, k, 0.1)  # Replica 1 falls 200 steps behind.
        for k in range(200):
            monitor.record(1, k, 0.1)
    dropped = [r for r in caplog.records if "Dropping incomplete step" in r.getMessage()]
    assert len(dropped) == 1
    assert monitor.completed_steps < 200  # The oldest steps were dropped, not kept without bound.
    assert monitor.last_step().step == 199
    assert monitor.last_step().per_replica_batch_sizes == (199, 199)  # Pairing survives the drops.


def test_concurrent_records_pair_into_the_right_steps():
    # Concurrency test: 4 threads report 300 steps each, interleaving at random; every step must pair reports
    # of the same step index (each report carries its step index as batch size).
    num_replicas, num_steps = 4, 300
    monitor = StepTimeMonitor(num_replicas, window_steps=num_steps)
    start = threading.Barrier(num_replicas)

    def report(replica_id: int) -> None:
        rng = random.Random(replica_id)
        start.wait()
        for k in range(num_steps):
            monitor.record(replica_id, k, 0.001 * (replica_id + 1))
            if rng.random() < 0.05:
                threading.Event().wait(0.0001)

    threads = [threading.Thread(target=report, args=(i,)) for i in range(num_replicas)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)  # Generous: a hang would mean a deadlock.
    assert not any(thread.is_alive() for thread in threads)
    assert monitor.completed_steps == num_steps
    samples = monitor.window()
    assert [s.step for s in samples] == list(range(num_steps))  # Steps complete in order.
    assert all(s.per_replica_batch_sizes == (s.step,) * num_replicas for s in samples)
    assert all(s.straggler_replica == num_replicas - 1 for s in samples)


def test_a_load_that_slows_whole_steps_divides_out_of_the_relative_levels():
    """Regression (busy host): each step runs 0.5x-3x as long for every replica alike; the ratio stays exact."""
    models = [LinearCostModel(0.0, 0.001), LinearCostModel(0.0, 0.002)]
    monitor = StepTimeMonitor(2, window_steps=16)
    loads = [1.0, 3.0, 0.5, 2.0, 1.2, 2.7, 0.8, 1.9, 3.0, 1.1, 0.6, 2.2, 1.4, 2.9, 0.7, 1.6]
    for k, load in enumerate(loads):
        noise = 1.0 + 0.01 * ((-1) ** k)  # 1 % of the replica's own noise
        _record_step(monitor, [20, 10], [0.020 * load * noise, 0.040 * load / noise])
    fast, slow = monitor.updated_cost_models(models)
    assert slow.factor / fast.factor == pytest.approx(2.0, rel=0.021)


def test_a_clear_shift_is_seen_after_four_steps():
    model = LinearCostModel(0.0, 0.001)
    monitor = StepTimeMonitor(2, window_steps=16)
    for k in range(16):
        slowed = 2.0 if k >= 12 else 1.0  # replica 1 runs 2x slower in the last 4 steps only
        _record_step(monitor, [10, 10], [0.010 * (1 + 0.01 * (k % 3)), 0.010 * slowed])
    fast, slow = monitor.updated_cost_models([model, model])
    assert slow.factor / fast.factor == pytest.approx(2.0, rel=0.03)  # the window median alone would say ~1
    errors = monitor.relative_standard_errors([fast, slow])
    assert errors[1] < 0.05  # the new level is known from the steps since the shift


def test_no_shift_is_seen_in_noise_of_under_15_percent():
    model = LinearCostModel(0.0, 0.001)
    monitor = StepTimeMonitor(2, window_steps=16)
    for k in range(16):
        wobble = 1.12 if k >= 12 else 1.0  # a 12 % rise: below the shift threshold, so the median decides
        _record_step(monitor, [10, 10], [0.010, 0.010 * wobble])
    fast, slow = monitor.updated_cost_models([model, model])
    assert slow.factor / fast.factor == pytest.approx(1.0, rel=0.01)


# Step pairing across a failed step (issue 30, bug 3): a step that failed part-way leaves reports of some replicas
# only; with step keys (the engine passes the step's clock start) later steps still pair their own reports.


def _record_keyed_step(monitor: StepTimeMonitor, key, sizes, times_s, replicas=None) -> None:
    for replica_id in replicas if replicas is not None else range(len(sizes)):
        monitor.record(replica_id, sizes[replica_id], times_s[replica_id], step_key=key)


def test_a_step_that_failed_part_way_does_not_shift_the_pairing_of_later_steps():
    monitor = StepTimeMonitor(3)
    _record_keyed_step(monitor, 1.0, [8, 8, 4], [0.1, 0.2, 0.3])
    # Step 2.0 fails in replica 1: replicas 0 and 2 reported it, replica 1 never will.
    _record_keyed_step(monitor, 2.0, [4, 4, 2], [9.0, 9.0, 9.0], replicas=[0, 2])
    _record_keyed_step(monitor, 3.0, [8, 8, 4], [0.1, 0.2, 0.3], replicas=[1, 0, 2])
    last = monitor.last_step()
    assert last.per_replica_batch_sizes == (8, 8, 4)  # by order it would have been (8, 4, 4): two steps mixed
    assert last.per_replica_step_times_s == (0.1, 0.2, 0.3)
    assert [s.step for s in monitor.window()] == [0, 2]  # the failed step keeps its index, not a sample
    assert monitor.completed_steps == 2
    _record_keyed_step(monitor, 4.0, [8, 8, 4], [0.1, 0.2, 0.3], replicas=[2, 1, 0])
    assert [s.per_replica_batch_sizes for s in monitor.window()] == [(8, 8, 4)] * 3


def test_a_late_report_of_a_failed_step_is_ignored():
    monitor = StepTimeMonitor(2)
    monitor.record(0, 4, 9.0, step_key="failed")
    _record_keyed_step(monitor, "next", [6, 6], [0.1, 0.2], replicas=[1, 0])  # replica 1 never reported "failed"
    monitor.record(1, 4, 9.0, step_key="failed")  # late: that step was dropped when replica 1 moved on
    _record_keyed_step(monitor, "after", [6, 6], [0.3, 0.4])
    assert [s.per_replica_step_times_s for s in monitor.window()] == [(0.1, 0.2), (0.3, 0.4)]


def test_keyed_steps_complete_in_any_replica_order_and_keep_unkeyed_pairing_aligned():
    monitor = StepTimeMonitor(2)
    monitor.record(0, 1, 1.0)  # an unkeyed report whose step never completes (replica 1 failed)
    _record_keyed_step(monitor, 10.0, [2, 2], [0.5, 0.5], replicas=[1, 0])
    assert monitor.last_step().step == 1  # after every step begun so far
    _record_step(monitor, [3, 3], [0.7, 0.8])  # unkeyed again: lined up behind the keyed step
    last = monitor.last_step()
    assert (last.step, last.per_replica_batch_sizes, last.per_replica_step_times_s) == (2, (3, 3), (0.7, 0.8))


def test_abandon_open_steps_drops_partial_keyed_steps():
    monitor = StepTimeMonitor(2)
    monitor.record(0, 4, 9.0, step_key=1.0)
    monitor.abandon_open_steps()
    monitor.record(1, 4, 9.0, step_key=1.0)  # a report of the abandoned step
    assert monitor.completed_steps == 0
    _record_keyed_step(monitor, 2.0, [5, 5], [0.1, 0.1])
    assert monitor.last_step().per_replica_batch_sizes == (5, 5)


def test_a_second_report_of_one_replica_under_one_key_is_ignored_with_one_warning(caplog):
    monitor = StepTimeMonitor(2)
    with caplog.at_level(logging.WARNING, logger="hetero_cs.planning.monitor"):
        for _ in range(3):
            monitor.record(0, 4, 0.1, step_key=7)
    assert sum("second report" in r.getMessage() for r in caplog.records) == 1
    monitor.record(1, 4, 0.2, step_key=7)
    assert monitor.last_step().per_replica_step_times_s == (0.1, 0.2)


def test_keyed_steps_that_never_complete_are_dropped_to_bound_memory(caplog):
    monitor = StepTimeMonitor(2, window_steps=1)
    with caplog.at_level(logging.WARNING, logger="hetero_cs.planning.monitor"):
        for k in range(200):
            monitor.record(0, k, 0.1, step_key=k)  # replica 1 never reports (it reports no later step either)
    assert sum("Dropping incomplete step" in r.getMessage() for r in caplog.records) == 1
    monitor.record(1, 199, 0.2, step_key=199)
    assert monitor.last_step().per_replica_batch_sizes == (199, 199)


def test_an_unhashable_step_key_is_rejected():
    with pytest.raises(ConfigError, match="step_key must be hashable"):
        StepTimeMonitor(2).record(0, 4, 0.1, step_key=[1.0])


def test_a_steps_end_adds_the_host_tail_to_its_makespan():
    monitor = StepTimeMonitor(2, window_steps=4)
    monitor.record(0, 8, 0.10, step_key=1.5)
    monitor.record(1, 8, 0.30, step_key=1.5)
    assert monitor.last_step().makespan_s == pytest.approx(0.30) and monitor.last_step().host_tail_s == 0.0
    monitor.record_step_end(1.5, 0.34)  # the update ended 40 ms after the slowest replica's gradients arrived
    sample = monitor.last_step()
    assert sample.host_tail_s == pytest.approx(0.04) and sample.makespan_s == pytest.approx(0.34)
    assert sample.replica_makespan_s == pytest.approx(0.30)
    assert sample.straggler_wait_s == pytest.approx(0.10)  # waits are the replicas': the tail is nobody's
    monitor.record_step_end(1.5, 0.50)  # a second end of the same step, and ends of unknown steps, change nothing
    monitor.record_step_end(9.9, 0.50)
    monitor.record_step_end(None, float("nan"))
    assert monitor.last_step().makespan_s == pytest.approx(0.34)
