"""Bad input at every pure public boundary gives a typed error that names the value and the fix (no TensorFlow).

Each case checks three things: the hetero_cs class, that the same error is catchable as the builtin a caller
already handles (ValueError, KeyError, RuntimeError, ...), and the message text (the offending value as
name=value and the fix). Cases named ``regression_*`` are inputs that used to escape as a raw TypeError or
ValueError from deep inside the library, or to be wrongly rejected.
"""

from __future__ import annotations

import inspect
import json
import math
import re
import sys

import numpy as np
import pytest

import hetero_cs.errors as errors_module
from calibration.fit import fit_cost_model
from calibration.result import CalibrationResult, DeviceProfile
from calibration.store import ProfileStore, load_result_file, save_result_file
from calibration.timing import probe_batch_sizes, summarize_trials
from hetero_cs import BatchPlan, LinearCostModel, solve_batch_split
from hetero_cs.cli import main as cli_main
from hetero_cs.planning.cost_model import PiecewiseLinearCostModel, ScaledCostModel, cost_model_from_dict
from hetero_cs.emulation import (
    Drift,
    Emulator,
    Workload,
    emulated_step_time_s,
    get_device_spec,
    setup_logical_devices,
)
from hetero_cs.errors import (
    BatchSplitError,
    ConfigError,
    EmulationError,
    HeteroCSError,
    InfeasiblePlanError,
    InvalidCostModelError,
    ProfileCacheError,
    UnknownEmulatedDeviceError,
)
from hetero_cs.planning.plan import even_batch_split, split_by_shares
from hetero_cs.planning.solver import plan_from_split

FAST = LinearCostModel(0.001, 0.001)
SLOW = LinearCostModel(0.001, 0.003)
WORKLOAD = Workload(flops_per_example=4e5, parameter_bytes=800_000)


class NaNModel:
    def predict_step_time_s(self, batch_size):
        return math.nan


class RaisingModel:
    def predict_step_time_s(self, batch_size):
        raise RuntimeError("boom")


class ShrinkingModel:
    """Shorter steps for larger batches: not a valid cost model."""

    def predict_step_time_s(self, batch_size):
        return 1.0 / (1 + batch_size)


def expect(fn, cls, builtin, match):
    """Runs fn; asserts it raises cls (a HeteroCSError) catchable as builtin, with a message matching match."""
    with pytest.raises(builtin, match=match) as info:
        fn()
    assert isinstance(info.value, cls), f"{type(info.value).__name__} is not a {cls.__name__}: {info.value}"
    assert isinstance(info.value, HeteroCSError)
    return info.value


# ----------------------------------------------------------------------------------------------------------------
# The tree itself
# ----------------------------------------------------------------------------------------------------------------
def test_every_error_class_is_a_hetero_cs_error_and_a_builtin():
    classes = [c for _, c in inspect.getmembers(errors_module, inspect.isclass) if issubclass(c, Exception)]
    assert len(classes) >= 12
    for cls in classes:
        assert issubclass(cls, HeteroCSError), cls
        if cls is HeteroCSError:
            continue
        builtins = [b for b in cls.__mro__ if b.__module__ == "builtins" and b not in (Exception, BaseException, object)]
        assert builtins, f"{cls.__name__} must also subclass a builtin such as ValueError or RuntimeError"


@pytest.mark.parametrize("name, suggested", [("RTX 4090", "RTX4090"), ("h100-sxm", "H100SXM"),
                                             ("rtx_a6000", "RTXA6000"), ("RTX9090", None), ("Quadro", None)])
def test_an_unknown_emulated_device_name_close_to_a_known_one_is_suggested(name, suggested):
    message = str(expect(lambda: get_device_spec(name), UnknownEmulatedDeviceError, KeyError, repr(name)))
    assert (f"Did you mean {suggested!r}?" in message) if suggested else "Did you mean" not in message, message
    assert "Known devices: A10, T4" in message


def test_unknown_emulated_device_error_prints_its_message_not_a_repr():
    error = expect(lambda: get_device_spec("RTX9090"), UnknownEmulatedDeviceError, KeyError, "RTX9090")
    assert str(error).startswith("Unknown emulated device name='RTX9090'")  # KeyError would wrap it in quotes


@pytest.mark.parametrize("call", [lambda: get_device_spec("RTX9090"), lambda: Emulator(["A10", "RTX9090"]),
                                  lambda: setup_logical_devices(["A10", "RTX9090"])], ids=["spec", "emulator", "setup"])
def test_regression_unknown_emulated_device_is_a_value_error_too(call):
    # An invalid argument value was only a KeyError, so `except ValueError` around argument checks missed it.
    error = expect(call, UnknownEmulatedDeviceError, ValueError, "RTX9090")
    assert isinstance(error, KeyError)  # as before
    message = str(error)
    assert message.startswith("Unknown emulated device name='RTX9090'") and not message.startswith(('"', "'"))
    assert message == error.args[0]
    import traceback

    shown = "".join(traceback.format_exception_only(type(error), error))
    assert shown == f"hetero_cs.errors.UnknownEmulatedDeviceError: {message}\n"  # no quotes around it


# ----------------------------------------------------------------------------------------------------------------
# solve_batch_split
# ----------------------------------------------------------------------------------------------------------------
SOLVER_CASES = [
    ("no_models", lambda: solve_batch_split([], 8), ConfigError, ValueError, r"cost_models is empty.*LinearCostModel"),
    ("models_none", lambda: solve_batch_split(None, 8), ConfigError, ValueError, r"Received: None"),
    ("batch_zero", lambda: solve_batch_split([FAST], 0), ConfigError, ValueError,
     r"global_batch_size=0\. Pass the number of examples in one optimizer step, e\.g\. 256"),
    ("batch_negative", lambda: solve_batch_split([FAST], -3), ConfigError, ValueError, r"global_batch_size=-3"),
    ("batch_float", lambda: solve_batch_split([FAST], 8.0), ConfigError, ValueError, r"global_batch_size=8\.0"),
    ("batch_string", lambda: solve_batch_split([FAST], "8"), ConfigError, ValueError, r"global_batch_size='8'"),
    ("batch_bool", lambda: solve_batch_split([FAST], True), ConfigError, ValueError, r"global_batch_size=True"),
    ("nan_cost", lambda: solve_batch_split([FAST, NaNModel()], 8), InvalidCostModelError, ValueError,
     r"cost_models\[1\]\.predict_step_time_s\(1\) returned nan.*Recalibrate replica 1"),
    ("raising_cost", lambda: solve_batch_split([RaisingModel(), FAST], 8), InvalidCostModelError, ValueError,
     r"cost_models\[0\]\.predict_step_time_s\(1\) failed: boom"),
    ("decreasing_cost", lambda: solve_batch_split([FAST, ShrinkingModel()], 8), InvalidCostModelError, ValueError,
     r"cost_models\[1\] predicts a shorter step for a larger batch.*isotonic fit"),
    ("not_a_model", lambda: solve_batch_split([FAST, 3], 8), InvalidCostModelError, ValueError,
     r"cost_models\[1\] has no predict_step_time_s.*Received: 3"),
    ("caps_infeasible", lambda: solve_batch_split([FAST, SLOW], 100, max_batch_sizes=[10, 20]),
     InfeasiblePlanError, ValueError,
     r"global_batch_size=100 exceeds the total capacity: max_batch_sizes=\[10, 20\] sum to 30.*at most 30"),
    ("caps_wrong_length", lambda: solve_batch_split([FAST, SLOW], 10, max_batch_sizes=[10]), ConfigError,
     ValueError, r"len\(max_batch_sizes\)=1 but there are R=2.*Use None for a replica without a cap"),
    ("cap_below_min", lambda: solve_batch_split([FAST, SLOW], 10, max_batch_sizes=[0, 20]), InfeasiblePlanError,
     ValueError, r"max_batch_sizes\[0\]=0 below min_batch_size=1.*Pass min_batch_size=0"),
    ("cap_float", lambda: solve_batch_split([FAST, SLOW], 10, max_batch_sizes=[5.5, 20]), ConfigError, ValueError,
     r"None \(no cap\)\. Received: max_batch_sizes\[0\]=5\.5"),
    ("cap_nan", lambda: solve_batch_split([FAST, SLOW], 10, max_batch_sizes=[math.nan, 20]), ConfigError,
     ValueError, r"max_batch_sizes\[0\]=nan"),
    ("cap_huge", lambda: solve_batch_split([FAST, SLOW], 10, max_batch_sizes=[10**400, 20]), ConfigError,
     ValueError, r"an integer in \[0, 2\*\*63\) .* Received: max_batch_sizes\[0\]=1000"),
    ("caps_string", lambda: solve_batch_split([FAST, SLOW], 10, max_batch_sizes="20"), ConfigError, ValueError,
     r"max_batch_sizes='20'.*Example: max_batch_sizes="),
    ("batch_below_minimum", lambda: solve_batch_split([FAST, SLOW], 3, min_batch_size=2), InfeasiblePlanError,
     ValueError, r"global_batch_size=3 is less than num_replicas=2 x min_batch_size=2 = 4.*min_batch_size=0"),
    ("min_negative", lambda: solve_batch_split([FAST], 3, min_batch_size=-1), ConfigError, ValueError,
     r"min_batch_size=-1\. Pass 0 to let a replica sit idle"),
    ("multiple_of_zero", lambda: solve_batch_split([FAST], 3, multiple_of=0), ConfigError, ValueError,
     r"multiple_of=0\. Pass 1 for no rounding"),
    ("multiple_of_caps", lambda: solve_batch_split([FAST, SLOW], 6, max_batch_sizes=[3, 3], multiple_of=4),
     InfeasiblePlanError, ValueError,
     r"max_batch_sizes\[1\]=3 admits no slice that is a multiple of multiple_of=4.*Pass min_batch_size=0"),
]


@pytest.mark.parametrize("fn,cls,builtin,match", [c[1:] for c in SOLVER_CASES], ids=[c[0] for c in SOLVER_CASES])
def test_solve_batch_split_rejects(fn, cls, builtin, match):
    expect(fn, cls, builtin, match)


def test_regression_numpy_caps_are_accepted():
    # np.array caps (e.g. read from a file) used to be a ConfigError "must be None or a sequence".
    plan = solve_batch_split([FAST, FAST], 10, max_batch_sizes=np.array([3, 20]))
    assert plan.per_replica_batch_sizes == (3, 7)


# ----------------------------------------------------------------------------------------------------------------
# Cost models
# ----------------------------------------------------------------------------------------------------------------
COST_MODEL_CASES = [
    ("linear_nan", lambda: LinearCostModel(math.nan, 0.1), r"fixed_overhead_s=nan.*Refit"),
    ("linear_negative", lambda: LinearCostModel(0.1, -1e-3), r"seconds_per_example=-0\.001"),
    ("linear_inf", lambda: LinearCostModel(math.inf, 0.1), r"fixed_overhead_s=inf"),
    ("linear_string", lambda: LinearCostModel("1", 0.1), r"fixed_overhead_s='1'"),
    ("piecewise_decreasing", lambda: PiecewiseLinearCostModel((1, 2), (0.2, 0.1)),
     r"0\.2 s at batch_size=1 but 0\.1 s at batch_size=2.*fit_cost_model"),
    ("piecewise_nan", lambda: PiecewiseLinearCostModel((1, 2), (0.2, math.nan)), r"\(2, nan\).*Drop failed"),
    ("piecewise_lengths", lambda: PiecewiseLinearCostModel((1, 2, 3), (0.1, 0.2)),
     r"len\(batch_sizes\)=3, len\(step_times_s\)=2"),
    ("piecewise_unsorted", lambda: PiecewiseLinearCostModel((4, 2), (0.1, 0.2)), r"strictly increasing.*Sort"),
    ("piecewise_none", lambda: PiecewiseLinearCostModel(None, None), r"batch_sizes=None"),
    ("scaled_zero", lambda: ScaledCostModel(FAST, 0), r"factor=0"),
    ("scaled_nan", lambda: ScaledCostModel(FAST, math.nan), r"factor=nan"),
    ("scaled_base", lambda: ScaledCostModel(3, 2.0), r"base=3"),
    ("dict_kind", lambda: cost_model_from_dict({"kind": "cubic"}), r"kind='cubic'.*to_dict"),
    ("dict_unknown_key", lambda: cost_model_from_dict(
        {"kind": "linear", "fixed_overhead_s": 0.1, "seconds_per_example": 0.1, "note": 1}), r"unknown=\['note'\]"),
    ("dict_nan", lambda: cost_model_from_dict(
        {"kind": "linear", "fixed_overhead_s": math.nan, "seconds_per_example": 0.1}), r"fixed_overhead_s=nan"),
    ("regression_dict_piecewise_not_lists", lambda: cost_model_from_dict(
        {"kind": "piecewise_linear", "batch_sizes": 5, "step_times_s": 3}), r"batch_sizes=5, step_times_s=3"),
]


@pytest.mark.parametrize("fn,match", [c[1:] for c in COST_MODEL_CASES], ids=[c[0] for c in COST_MODEL_CASES])
def test_cost_models_reject(fn, match):
    expect(fn, InvalidCostModelError, ValueError, match)


@pytest.mark.parametrize("batch_size", [-1, 1.5, None])
def test_predict_step_time_rejects_bad_batch_sizes(batch_size):
    expect(lambda: FAST.predict_step_time_s(batch_size), ConfigError, ValueError,
           rf"batch_size={re.escape(repr(batch_size))}\. Pass the number of examples of one replica's slice")


# ----------------------------------------------------------------------------------------------------------------
# BatchPlan and the fixed splits
# ----------------------------------------------------------------------------------------------------------------
PLAN_CASES = [
    ("empty", lambda: BatchPlan((), 0), ConfigError, r"non-empty sequence.*per_replica_batch_sizes=\(\)"),
    ("sum_mismatch", lambda: BatchPlan((1, 2), 4), ConfigError,
     r"per_replica_batch_sizes=\(1, 2\) sum to 3, not global_batch_size=4.*fix the slices"),
    ("negative_slice", lambda: BatchPlan((-1, 5), 4), ConfigError, r"\(replica, value\): \[\(0, -1\)\]"),
    ("float_slice", lambda: BatchPlan((1.5, 2.5), 4), ConfigError, r"\(0, 1\.5\), \(1, 2\.5\)"),
    ("batch_zero", lambda: BatchPlan((0, 0), 0), ConfigError, r"global_batch_size=0"),
    ("nan_makespan", lambda: BatchPlan((1, 2), 3, predicted_makespan_s=math.nan), ConfigError,
     r"predicted_makespan_s=nan"),
    ("times_length", lambda: BatchPlan((1, 2), 3, predicted_step_times_s=(0.1,)), ConfigError,
     r"predicted_step_times_s=\(0\.1,\) for 2 replicas"),
    ("string_sizes", lambda: BatchPlan("12", 3), ConfigError, r"per_replica_batch_sizes='12'"),
    ("json_garbage", lambda: BatchPlan.from_json("{not json"), ConfigError, r"from_json needs a JSON object"),
    ("json_list", lambda: BatchPlan.from_json("[1, 2]"), ConfigError, r"needs a mapping. Received: \[1, 2\]"),
    ("dict_unknown_key", lambda: BatchPlan.from_dict(
        {"per_replica_batch_sizes": [1], "global_batch_size": 1, "note": 2}), ConfigError,
     r"unknown=\['note'\].*BatchPlan\.to_dict"),
    ("dict_missing_key", lambda: BatchPlan.from_dict({"per_replica_batch_sizes": [1]}), ConfigError,
     r"missing=\['global_batch_size'\]"),
    ("shares_negative", lambda: split_by_shares(10, [1, -1]), BatchSplitError,
     r"shares=\[1, -1\].*\(1, -1\).*e\.g\. \[2, 1, 1\]"),
    ("shares_all_zero", lambda: split_by_shares(10, [0, 0, 0]), BatchSplitError,
     r"all zero: shares=\[0, 0, 0\].*\[1\] \* num_replicas"),
    ("shares_nan", lambda: split_by_shares(10, [1, math.nan]), BatchSplitError, r"\(1, nan\)"),
    ("shares_empty", lambda: split_by_shares(10, []), BatchSplitError, r"shares=\[\]. Pass e\.g\. \[2, 1, 1\]"),
    ("shares_none", lambda: split_by_shares(10, None), BatchSplitError, r"shares=None"),
    ("shares_string", lambda: split_by_shares(10, "21"), BatchSplitError, r"shares='21'"),
    ("even_no_replicas", lambda: even_batch_split(10, 0), ConfigError, r"num_replicas=0"),
    ("even_negative_batch", lambda: even_batch_split(-1, 2), ConfigError, r"global_batch_size=-1"),
    ("from_split_models_length", lambda: plan_from_split([1, 2], [FAST]), ConfigError,
     r"len\(cost_models\)=1, per_replica_batch_sizes=\(1, 2\)"),
    ("from_split_nan_cost", lambda: plan_from_split([1, 2], [FAST, NaNModel()]), InvalidCostModelError,
     r"cost_models\[1\]\.predict_step_time_s\(2\) returned nan"),
    ("from_split_all_zero", lambda: plan_from_split([0, 0]), ConfigError, r"global_batch_size=0"),
]


@pytest.mark.parametrize("fn,cls,match", [c[1:] for c in PLAN_CASES], ids=[c[0] for c in PLAN_CASES])
def test_plans_and_splits_reject(fn, cls, match):
    expect(fn, cls, ValueError, match)


def test_regression_numpy_shares_split_into_python_ints():
    # float32 shares used to raise a raw TypeError from fractions.Fraction; int64 shares gave numpy slices.
    for shares in (np.array([2, 1, 1], np.float32), np.array([2, 1, 1], np.int64), [0.5, 0.25, 0.25]):
        sizes = split_by_shares(10, shares)
        assert sizes == (5, 3, 2)
        assert all(type(b) is int for b in sizes)


# ----------------------------------------------------------------------------------------------------------------
# Emulation
# ----------------------------------------------------------------------------------------------------------------
EMULATION_CASES = [
    ("unknown_name", lambda: Emulator(["A10", "RTX9090"]), UnknownEmulatedDeviceError, KeyError,
     r"name='RTX9090'. Known devices: A10, T4, P100.*case does not matter"),
    ("none_name", lambda: get_device_spec(None), UnknownEmulatedDeviceError, KeyError, r"name=None"),
    ("no_names", lambda: Emulator([]), ConfigError, ValueError, r"device_names=\[\].*e\.g\. \['A10', 'T4'\]"),
    ("one_string", lambda: Emulator("A10"), ConfigError, ValueError, r"device_names='A10'.*\['A10', 'T4'\]"),
    ("regression_not_a_sequence", lambda: Emulator(5), ConfigError, ValueError, r"device_names=5"),
    ("time_scale_zero", lambda: Emulator(["A10"], time_scale=0), ConfigError, ValueError,
     r"time_scale \(value 0\).*e\.g\. 1\.0 for real time"),
    ("time_scale_nan", lambda: Emulator(["A10"], time_scale=math.nan), ConfigError, ValueError, r"value nan"),
    ("time_scale_string", lambda: Emulator(["A10"], time_scale="2"), ConfigError, ValueError, r"value '2'"),
    ("regression_single_drift", lambda: Emulator(["A10"], drift=Drift(0, 2.0)), ConfigError, ValueError,
     r"drift=Drift\(replica_id=0.*Wrap a single drift in a list"),
    ("drift_not_a_drift", lambda: Emulator(["A10"], drift=[{"replica_id": 0}]), ConfigError, ValueError,
     r"Drift instances; received: \{'replica_id': 0\}"),
    ("drift_replica_out_of_range", lambda: Emulator(["A10", "T4"], drift=[Drift(2, 2.0)]), ConfigError,
     ValueError, r"replica_id=2 but there are num_replicas=2 \(ids 0\.\.1\)"),
    ("drift_factor_zero", lambda: Drift(0, 0.0), ConfigError, ValueError, r"factor=0\.0.*2\.0 = twice as slow"),
    ("drift_factor_nan", lambda: Drift(0, math.nan), ConfigError, ValueError, r"factor=nan"),
    ("drift_factor_negative", lambda: Drift(0, -2), ConfigError, ValueError, r"factor=-2"),
    ("regression_drift_factor_bool", lambda: Drift(0, True), ConfigError, ValueError, r"factor=True"),
    ("drift_replica_negative", lambda: Drift(-1, 2.0), ConfigError, ValueError, r"replica_id=-1"),
    ("drift_from_negative", lambda: Drift(0, 2.0, from_step=-1), ConfigError, ValueError, r"from_step=-1"),
    ("drift_until_not_after", lambda: Drift(0, 2.0, from_step=5, until_step=5), ConfigError, ValueError,
     r"until_step=5 must be None or an int > from_step=5"),
    ("regression_drift_until_bool", lambda: Drift(0, 2.0, until_step=True), ConfigError, ValueError,
     r"until_step=True"),
    ("delay_bad_replica", lambda: Emulator(["A10"], workload=WORKLOAD).delay_s(5, 1), ConfigError, ValueError,
     r"replica_id=5 must be an int in \[0, 1\)"),
    ("delay_negative_batch", lambda: Emulator(["A10"], workload=WORKLOAD).delay_s(0, -1), ConfigError,
     ValueError, r"batch_size=-1"),
    ("delay_without_workload", lambda: Emulator(["A10"]).delay_s(0, 1), EmulationError, RuntimeError,
     r"no Workload.*set_workload\(estimate_workload\(model\)\)"),
    ("scale_batch_zero", lambda: Emulator(["A10"], workload=WORKLOAD).calibrate_time_scale(0), ConfigError,
     ValueError, r"global_batch_size=0"),
    ("scale_target_nan", lambda: Emulator(["A10"], workload=WORKLOAD).calibrate_time_scale(
        8, target_makespan_s=math.nan), ConfigError, ValueError, r"target_makespan_s=nan.*e\.g\. 0\.05"),
    ("regression_scale_target_string", lambda: Emulator(["A10"], workload=WORKLOAD).calibrate_time_scale(
        8, target_makespan_s="0.1"), ConfigError, ValueError, r"target_makespan_s='0\.1'"),
    ("efficiency_zero", lambda: emulated_step_time_s(get_device_spec("T4"), 1, WORKLOAD, compute_efficiency=0),
     ConfigError, ValueError, r"compute_efficiency=0.*default is 0\.5"),
    ("regression_efficiency_string", lambda: emulated_step_time_s(
        get_device_spec("T4"), 1, WORKLOAD, compute_efficiency="high"), ConfigError, ValueError,
     r"compute_efficiency='high'"),
    ("launch_overhead_negative", lambda: emulated_step_time_s(
        get_device_spec("T4"), 1, WORKLOAD, launch_overhead_s=-1.0), ConfigError, ValueError, r"launch_overhead_s=-1\.0"),
    ("workload_nan", lambda: Workload(math.nan, 1), ConfigError, ValueError, r"flops_per_example=nan"),
    ("workload_negative_bytes", lambda: Workload(1.0, -1), ConfigError, ValueError, r"parameter_bytes=-1"),
    ("advance_negative", lambda: Emulator(["A10"]).advance_to(-1), ConfigError, ValueError, r"step=-1"),
    # setup_logical_devices checks its names before it imports TensorFlow.
    ("setup_no_names", lambda: setup_logical_devices([]), ConfigError, ValueError, r"names=\[\].*\['A10', 'T4'\]"),
    ("setup_one_string", lambda: setup_logical_devices("A10"), ConfigError, ValueError, r"names='A10'"),
    ("setup_unknown_name", lambda: setup_logical_devices(["A10", "MI50"]), UnknownEmulatedDeviceError, KeyError,
     r"name='MI50'. Known devices"),
]


@pytest.mark.parametrize("fn,cls,builtin,match", [c[1:] for c in EMULATION_CASES],
                         ids=[c[0] for c in EMULATION_CASES])
def test_emulation_rejects(fn, cls, builtin, match):
    expect(fn, cls, builtin, match)


@pytest.mark.parametrize("raw", ["fast", "-1", "0", "nan", "inf"])
def test_time_scale_environment_variable_with_garbage(monkeypatch, raw):
    monkeypatch.setenv("HETERO_CS_EMULATION_TIME_SCALE", raw)
    expect(lambda: Emulator(["A10", "T4"]), ConfigError, ValueError,
           rf"HETERO_CS_EMULATION_TIME_SCALE='{raw}'.*must be a finite number > 0, e\.g\. 1\.0")
    # An explicit argument wins over the environment, so it is not even read.
    assert Emulator(["A10", "T4"], time_scale=2.0).time_scale == 2.0


def test_regression_numpy_numbers_are_accepted_by_the_emulator():
    emulator = Emulator(["A10", "T4"], workload=WORKLOAD, time_scale=np.float32(2.0))
    assert emulator.time_scale == 2.0
    emulator = Emulator(["A10", "T4"], workload=WORKLOAD)
    assert emulator.calibrate_time_scale(np.int64(64), target_makespan_s=np.float64(0.05)) > 0


# ----------------------------------------------------------------------------------------------------------------
# Calibration: timing, fit, profile files and the cache directory
# ----------------------------------------------------------------------------------------------------------------
CALIBRATION_PURE_CASES = [
    ("trials_empty", lambda: summarize_trials([]), r"samples_s=\[\]. Run trials >= 1"),
    ("trials_nan", lambda: summarize_trials([0.1, math.nan]), r"samples_s=\[0\.1, nan\]"),
    ("probe_sizes_zero", lambda: probe_batch_sizes(0), r"max_batch_size=0"),
    ("fit_lengths", lambda: fit_cost_model([1, 2], [0.1]), r"len\(batch_sizes\)=2, len\(step_times_s\)=1"),
    ("fit_nan", lambda: fit_cost_model([1, 2], [0.1, math.nan]), r"step_times_s=\[0\.1, nan\]"),
    ("fit_zero_batch", lambda: fit_cost_model([0, 2], [0.1, 0.2]), r"batch_sizes=\[0, 2\]"),
]


@pytest.mark.parametrize("fn,match", [c[1:] for c in CALIBRATION_PURE_CASES],
                         ids=[c[0] for c in CALIBRATION_PURE_CASES])
def test_calibration_statistics_reject(fn, match):
    expect(fn, ConfigError, ValueError, match)


def _profile(device="/device:CPU:1", seconds_per_example=1e-4, cap=None):
    return DeviceProfile(device=device, cost_model=LinearCostModel(0.001, seconds_per_example), max_batch_size=cap,
                         fit_error=0.01, probe_batch_sizes=(1, 4), median_step_times_s=(0.0011, 0.0014),
                         mad_s=(0.0, 0.0))


@pytest.fixture
def profile_document(tmp_path):
    """A valid profile file for 2 devices and a function that writes an edited copy of it."""
    path = tmp_path / "good.json"
    save_result_file(path, CalibrationResult(profiles=(_profile(), _profile("/device:CPU:2", 3e-4)),
                                             wall_time_s=1.0, emulated=False))
    document = json.loads(path.read_text())

    def write(edit=None, *, text=None, name="edited.json"):
        target = tmp_path / name
        if text is not None:
            target.write_text(text)
        else:
            copy = json.loads(json.dumps(document))
            edit(copy)
            target.write_text(json.dumps(copy))
        return target

    return path, write


def _first_profile(document):
    return document["result"]["profiles"][0]


PROFILE_FILE_CASES = [
    ("corrupt_json", dict(text='{"schema_version": 1, "res'), r"Unterminated string"),
    ("empty_file", dict(text=""), r"Expecting value"),
    ("top_level_list", dict(text="[1, 2]"), r"top level is list, not an object"),
    ("other_schema", dict(edit=lambda d: d.update(schema_version=99)), r"schema_version=99, this version reads 1"),
    ("unknown_top_key", dict(edit=lambda d: d.update(note="x")), r"unknown keys \['note'\]"),
    ("unknown_profile_key", dict(edit=lambda d: _first_profile(d).update(gpu="T4")),
     r"DeviceProfile has unknown keys \['gpu'\]"),
    ("missing_profile_key", dict(edit=lambda d: _first_profile(d).pop("mad_s")), r"misses keys \['mad_s'\]"),
    ("nan_cost", dict(edit=lambda d: _first_profile(d)["cost_model"].update(fixed_overhead_s=math.nan)),
     r"fixed_overhead_s=nan"),
    ("decreasing_cost", dict(edit=lambda d: _first_profile(d).update(cost_model={
        "kind": "piecewise_linear", "batch_sizes": [1, 4], "step_times_s": [0.2, 0.1]})), r"non-decreasing"),
    ("unknown_cost_kind", dict(edit=lambda d: _first_profile(d)["cost_model"].update(kind="cubic")),
     r"kind='cubic'"),
    ("no_profiles", dict(edit=lambda d: d["result"].update(profiles=[])), r"non-empty sequence of DeviceProfile"),
    ("nan_wall_time", dict(edit=lambda d: d["result"].update(wall_time_s=math.nan)), r"wall_time_s=nan"),
    ("zero_cap", dict(edit=lambda d: _first_profile(d).update(max_batch_size=0)),
     r"max_batch_size=0 \(the device cannot hold one example\) has no probed sizes"),
    ("regression_probe_sizes_not_a_list", dict(edit=lambda d: _first_profile(d).update(probe_batch_sizes=5)),
     r"probe_batch_sizes=5"),
    ("regression_probe_sizes_floats", dict(edit=lambda d: _first_profile(d).update(probe_batch_sizes=[1.9, 4.2])),
     r"probe_batch_sizes must be integers.*\[1\.9, 4\.2\]"),
    ("regression_median_strings", dict(edit=lambda d: _first_profile(d).update(median_step_times_s=["a", "b"])),
     r"median_step_times_s=\['a', 'b'\]"),
    ("regression_emulated_as_number", dict(edit=lambda d: _first_profile(d).update(emulated_as=7)),
     r"emulated_as=7"),
    ("plan_of_other_length", dict(edit=lambda d: d["result"].update(
        plan={"per_replica_batch_sizes": [1, 2, 3], "global_batch_size": 6})), r"one slice per profile"),
]


@pytest.mark.parametrize("how,match", [c[1:] for c in PROFILE_FILE_CASES], ids=[c[0] for c in PROFILE_FILE_CASES])
def test_bad_profile_files_are_rejected_with_the_path_and_the_fix(profile_document, how, match):
    _, write = profile_document
    path = write(**how)
    error = expect(lambda: load_result_file(path), ProfileCacheError, ValueError, match)
    assert f"path={str(path)!r}" in str(error)
    assert "Recalibrate with `hetero-cs calibrate ... --output PATH`" in str(error)
    assert ".." not in str(error).replace("...", "")  # no doubled full stops from nested messages


def test_missing_profile_file(tmp_path):
    expect(lambda: load_result_file(tmp_path / "nope.json"), ProfileCacheError, ValueError,
           r"nope\.json.*No such file.*Recalibrate")
    expect(lambda: load_result_file(tmp_path), ProfileCacheError, ValueError, r"Is a directory")


def test_unwritable_profile_path(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    expect(lambda: save_result_file(blocker / "profile.json", CalibrationResult((_profile(),), 1.0, False)),
           ProfileCacheError, ValueError, r"Cannot write the calibration profile.*Choose a writable path")


def test_regression_cache_dir_environment_variable_naming_a_file(tmp_path, monkeypatch):
    # It used to warn twice per calibration (cannot read, cannot write) and carry on without a cache.
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    monkeypatch.setenv("HETERO_CS_CACHE_DIR", str(blocker))
    expect(ProfileStore, ConfigError, ValueError,
           rf"HETERO_CS_CACHE_DIR={re.escape(repr(str(blocker)))} names an existing file.*profile_cache=False")
    expect(lambda: ProfileStore(blocker), ConfigError, ValueError, r"directory=.*not_a_dir.*Point it at a directory")
    expect(lambda: ProfileStore(3), ConfigError, ValueError, r"directory=3")
    monkeypatch.setenv("HETERO_CS_CACHE_DIR", str(tmp_path / "fresh"))
    assert ProfileStore().directory == tmp_path / "fresh"  # a missing directory is fine: created on first save


# ----------------------------------------------------------------------------------------------------------------
# The `hetero-cs` command line (plan verb and argument parsing: no TensorFlow is imported)
# ----------------------------------------------------------------------------------------------------------------
def _cli(argv, capsys):
    try:
        status = cli_main(argv)
    except SystemExit as exc:  # argparse errors
        status = exc.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_cli_plan_with_a_good_profile_prints_json(profile_document, capsys):
    path, _ = profile_document
    status, out, err = _cli(["plan", "--profile", str(path), "--global-batch-size", "64", "--json"], capsys)
    assert status == 0, err
    assert sum(json.loads(out)["per_replica_batch_sizes"]) == 64


CLI_PLAN_CASES = [
    ("missing_file", lambda path, write: ["--profile", str(path.parent / "nope.json"), "--global-batch-size", "8"],
     r"hetero-cs plan: error: Cannot use the calibration profile path=.*nope\.json.*Recalibrate"),
    ("corrupt_file", lambda path, write: ["--profile", str(write(text="{")), "--global-batch-size", "8"],
     r"hetero-cs plan: error: Cannot use the calibration profile.*Recalibrate"),
    ("other_schema", lambda path, write: ["--profile", str(write(lambda d: d.update(schema_version=2))),
                                          "--global-batch-size", "8"], r"schema_version=2"),
    ("unknown_key", lambda path, write: ["--profile", str(write(lambda d: d.update(extra=1))),
                                         "--global-batch-size", "8"], r"unknown keys \['extra'\]"),
    ("nan_cost", lambda path, write: ["--profile", str(write(
        lambda d: _first_profile(d)["cost_model"].update(seconds_per_example=math.nan))), "--global-batch-size", "8"],
     r"seconds_per_example=nan"),
    ("caps_too_small", lambda path, write: ["--profile", str(write(
        lambda d: [p.update(max_batch_size=2) for p in d["result"]["profiles"]])), "--global-batch-size", "64"],
     r"global_batch_size=64 exceeds the total capacity.*at most 4"),
    ("no_plan_and_no_batch", lambda path, write: ["--profile", str(path)],
     r"holds no plan; pass --global-batch-size B"),
    ("batch_below_replicas", lambda path, write: ["--profile", str(path), "--global-batch-size", "1"],
     r"global_batch_size=1 is less than num_replicas=2.*min_batch_size=0"),
]


@pytest.mark.parametrize("argv,match", [c[1:] for c in CLI_PLAN_CASES], ids=[c[0] for c in CLI_PLAN_CASES])
def test_cli_plan_errors_exit_2_with_one_line_on_stderr(profile_document, capsys, argv, match):
    path, write = profile_document
    status, out, err = _cli(["plan", *argv(path, write)], capsys)
    assert status == 2
    assert out == ""
    assert "Traceback" not in err
    assert err.count("\n") == 1, err  # one line: the error and its fix
    assert re.search(match, err), err


CLI_ARGUMENT_CASES = [
    ("batch_zero", ["plan", "--profile", "p.json", "--global-batch-size", "0"],
     r"--global-batch-size: must be an integer from 1 to 10,000,000, got '0'"),
    ("regression_batch_not_a_number", ["plan", "--profile", "p.json", "--global-batch-size", "abc"],
     r"--global-batch-size: must be an integer from 1 to 10,000,000, got 'abc'"),
    # A what-if of 1e20 examples walked its sub-steps until the machine ran out of memory.
    ("regression_batch_huge", ["plan", "--devices", "A10,T4", "--global-batch-size", "99999999999999999999"],
     r"--global-batch-size: must be an integer from 1 to 10,000,000, got '99999999999999999999'"),
    ("regression_min_negative", ["plan", "--profile", "p.json", "--min-batch-size", "-1"],
     r"--min-batch-size: must be an integer >= 0, got '-1'"),
    ("multiple_of_zero", ["plan", "--profile", "p.json", "--multiple-of", "0"], r"--multiple-of: must be an integer"),
    ("unknown_verb", ["frobnicate"], r"invalid choice: 'frobnicate'"),
    ("no_verb", [], r"required"),
    ("probe_size_zero", ["calibrate", "--probe-batch-sizes", "0,4"], r"--probe-batch-sizes: must be an integer >= 1"),
    ("no_emulated_names", ["calibrate", "--emulate", ","], r"--emulate: needs at least one comma-separated name"),
    ("time_scale_nan", ["calibrate", "--time-scale", "nan"], r"--time-scale: must be a finite number > 0"),
    ("regression_target_inf", ["calibrate", "--target-step-ms", "inf"],
     r"--target-step-ms: must be a finite number > 0, got 'inf'"),
    ("regression_warmup_negative", ["calibrate", "--warmup-steps", "-1"],
     r"--warmup-steps: must be an integer >= 0, got '-1'"),
    ("trials_zero", ["calibrate", "--trials", "0"], r"--trials: must be an integer >= 1"),
    ("emulate_and_devices", ["calibrate", "--emulate", "A10", "--devices", "/gpu:0"], r"not allowed with"),
]


@pytest.mark.parametrize("argv,match", [c[1:] for c in CLI_ARGUMENT_CASES], ids=[c[0] for c in CLI_ARGUMENT_CASES])
def test_cli_bad_arguments_exit_2_before_any_work(capsys, argv, match):
    status, out, err = _cli(argv, capsys)
    assert status == 2
    assert "Traceback" not in err
    assert re.search(match, err), err


def test_cli_bench_when_the_benchmarks_package_is_missing(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "benchmarks", None)  # an install that lost the benchmarks package
    status, out, err = _cli(["bench"], capsys)
    assert status == 2
    assert re.search(r"hetero-cs bench: error: `hetero-cs bench` runs the benchmarks package.*could not be "
                     r"imported.*Reinstall hetero_cs", err)


def test_the_wheel_ships_the_benchmarks_package_that_bench_runs():
    # `hetero-cs bench` must work after a plain `pip install .`: the packages setuptools finds with setup.cfg's
    # include list (what goes into the wheel) hold benchmarks.balance's package.
    import configparser
    import pathlib

    setuptools = pytest.importorskip("setuptools")

    root = pathlib.Path(__file__).resolve().parents[2]
    config = configparser.ConfigParser()
    config.read(root / "setup.cfg")
    include = config["options.packages.find"]["include"].split()
    found = setuptools.find_packages(where=str(root), include=include)
    assert "benchmarks" in found and "hetero_cs" in found and "calibration" in found


@pytest.mark.parametrize("read, error, match", [
    (lambda: BatchPlan.from_dict([1, 2]), ConfigError, r"BatchPlan\.from_dict needs a mapping. Received: \[1, 2\]"),
    (lambda: LinearCostModel.from_dict([1, 2]), InvalidCostModelError,
     r"A linear cost model dict needs a mapping. Received: \[1, 2\]"),
    (lambda: DeviceProfile.from_dict([1, 2]), ProfileCacheError, r"DeviceProfile needs a mapping. Received: \[1, 2\]"),
], ids=["plan", "cost_model", "profile"])
def test_every_stored_dict_that_is_not_a_mapping_is_refused_in_the_same_words_with_its_own_type(read, error, match):
    with pytest.raises(error, match=match):
        read()
