"""Bad input at the TensorFlow-facing boundaries gives a typed error naming the value and the fix.

Strategies run over /cpu:1../cpu:3 (the integration conftest made the logical CPU devices) with
profile_cache=False. Each case checks the hetero_cs class, that it is catchable as the builtin, and the message.

Cases named after what broke (labels longer than x trained silently; a failed set_cost_models left the strategy
unusable; ...) are regression tests.
"""

from __future__ import annotations

import math
import re
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from calibration.__main__ import main as calibration_main
from calibration.calibrate import calibrate as run_calibration
from calibration.probe import DeviceProbe
from hetero_cs import HeteroCentralStorageStrategy, LinearCostModel
from hetero_cs.errors import (
    BatchSplitError,
    CalibrationError,
    CalibrationOOMError,
    ConfigError,
    DeviceError,
    EmulationError,
    HeteroCSError,
    InfeasiblePlanError,
    InputError,
    InvalidCostModelError,
    UnknownEmulatedDeviceError,
)

DEVICES = ["/cpu:1", "/cpu:2", "/cpu:3"]
X = np.ones((12, 4), np.float32)
Y = np.ones((12, 1), np.float32)


def strategy(*args, **kwargs) -> HeteroCentralStorageStrategy:
    kwargs.setdefault("profile_cache", False)
    kwargs.setdefault("rebalance", False)
    return HeteroCentralStorageStrategy(*args, **kwargs)


def fixed_split_strategy() -> HeteroCentralStorageStrategy:
    return strategy(DEVICES, auto_balance=False)


def small_model(under: HeteroCentralStorageStrategy, features: int = 4):
    with under.scope():
        model = keras.Sequential([keras.Input((features,)), keras.layers.Dense(1, kernel_initializer="zeros")])
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model


def dataset_of(batches):
    """A dataset of these ``(x, y)`` batches as they are (4 features, 1 target; a batch may be bad)."""
    return tf.data.Dataset.from_generator(
        lambda: iter(batches),
        output_signature=(tf.TensorSpec([None, 4], tf.float32), tf.TensorSpec([None, 1], tf.float32)),
    )


def expect(fn, cls, builtin, match):
    """Runs fn; asserts it raises cls (a HeteroCSError) catchable as builtin, with a message matching match."""
    with pytest.raises(builtin, match=match) as info:
        fn()
    assert isinstance(info.value, cls), f"{type(info.value).__name__} is not a {cls.__name__}: {info.value}"
    assert isinstance(info.value, HeteroCSError)
    return info.value


class NaNModel:
    def predict_step_time_s(self, batch_size):
        return math.nan


# ----------------------------------------------------------------------------------------------------------------
# HeteroCentralStorageStrategy(...)
# ----------------------------------------------------------------------------------------------------------------
CONSTRUCTOR_CASES = [
    ("no_devices", dict(compute_devices=[]), DeviceError, ValueError,
     r"compute_devices is empty. Give at least one device, e\.g\. \['/gpu:0'\]"),
    ("unknown_gpu", dict(compute_devices=["/gpu:7"]), DeviceError, ValueError,
     r"Unknown device\(s\) \['/device:GPU:7'\]; TensorFlow sees \[.*setup_logical_devices"),
    ("repeated", dict(compute_devices=["/cpu:1", "/cpu:1"]), DeviceError, ValueError,
     r"repeats a device: \['/device:CPU:1', '/device:CPU:1'\]. List each device once"),
    ("repeated_spelled_twice", dict(compute_devices=["/cpu:1", "/device:CPU:1"]), DeviceError, ValueError,
     r"repeats a device"),
    ("parameter_device_computes", dict(compute_devices=["/cpu:0", "/cpu:1"]), DeviceError, ValueError,
     r"parameter device /device:CPU:0 is also a compute device.*drop it from compute_devices"),
    ("explicit_parameter_device_computes", dict(compute_devices=["/cpu:1", "/cpu:2"], parameter_device="/cpu:2"),
     DeviceError, ValueError, r"parameter device /device:CPU:2 is also a compute device"),
    ("not_a_device", dict(compute_devices=["not a device"]), DeviceError, ValueError,
     r"Cannot parse device name='not a device'. Use names like '/device:GPU:0' or '/cpu:1'"),
    ("empty_name", dict(compute_devices=[""]), DeviceError, ValueError, r"non-empty strings. Received: device=''"),
    ("none_name", dict(compute_devices=[None]), DeviceError, ValueError, r"device=None"),
    ("no_index", dict(compute_devices=["/cpu"]), DeviceError, ValueError, r"'/cpu' needs a type and an index"),
    ("unknown_parameter_device", dict(compute_devices=DEVICES, parameter_device="/cpu:9"), DeviceError, ValueError,
     r"Unknown device\(s\) \['/device:CPU:9'\]"),
    ("split_wrong_length", dict(compute_devices=DEVICES, batch_split=[1, 1]), BatchSplitError, ValueError,
     r"len\(batch_split\)=2, but there are R=3 compute devices.*Give 3 shares, e\.g\. \[1, 1, 1\]"),
    ("split_empty", dict(compute_devices=DEVICES, batch_split=[]), BatchSplitError, ValueError,
     r"len\(batch_split\)=0"),
    ("split_negative", dict(compute_devices=DEVICES, batch_split=[1, -1, 1]), BatchSplitError, ValueError,
     r"finite numbers >= 0 with at least one > 0. Received: batch_split=\[1, -1, 1\]. Example: batch_split="),
    ("split_nan", dict(compute_devices=DEVICES, batch_split=[1, math.nan, 1]), BatchSplitError, ValueError,
     r"batch_split=\[1, nan, 1\]"),
    ("split_inf", dict(compute_devices=DEVICES, batch_split=[1, math.inf, 1]), BatchSplitError, ValueError,
     r"batch_split=\[1, inf, 1\]"),
    ("split_all_zero", dict(compute_devices=DEVICES, batch_split=[0, 0, 0]), BatchSplitError, ValueError,
     r"at least one > 0. Received: batch_split=\[0, 0, 0\]"),
    ("split_strings", dict(compute_devices=DEVICES, batch_split=["2", "1", "1"]), BatchSplitError, ValueError,
     r"batch_split=\['2', '1', '1'\]"),
    ("emulate_unknown", dict(compute_devices=DEVICES, emulate=["A10", "T4", "RTX"]), UnknownEmulatedDeviceError,
     KeyError, r"name='RTX'. Known devices: A10, T4, P100"),
    ("emulate_wrong_length", dict(compute_devices=DEVICES, emulate=["A10", "T4"]), ConfigError, ValueError,
     r"len\(emulate\)=2, compute_devices=.*\(R=3\). Give exactly 3 names"),
    ("emulate_plain_string", dict(compute_devices=DEVICES, emulate="A10"), ConfigError, ValueError,
     r"emulate='A10'. Example: emulate=\['A10', 'T4', 'P100'\]"),
    ("emulate_empty", dict(compute_devices=DEVICES, emulate=[]), ConfigError, ValueError, r"emulate=\[\]"),
    ("emulate_set", dict(compute_devices=DEVICES, emulate={"A10", "T4", "P100"}), ConfigError, ValueError,
     r"one per compute device in order. Received: emulate=\{"),
    # Regression: "no" and None counted as True (balancing stayed on), an int gave an untyped TypeError.
    ("auto_balance_string", dict(compute_devices=DEVICES, auto_balance="no"), ConfigError, ValueError,
     r"auto_balance must be True or False. Received: auto_balance='no' \(str\)"),
    ("rebalance_none", dict(compute_devices=DEVICES, rebalance=None), ConfigError, ValueError,
     r"rebalance must be True or False. Received: rebalance=None"),
    ("guard_int", dict(compute_devices=DEVICES, guard=2), ConfigError, ValueError, r"guard=2 \(int\)"),
    ("compute_devices_int", dict(compute_devices=5), ConfigError, ValueError,
     r"compute_devices must be a list of device names.*Received: compute_devices=5"),
]


@pytest.mark.parametrize("kwargs,cls,builtin,match", [c[1:] for c in CONSTRUCTOR_CASES],
                         ids=[c[0] for c in CONSTRUCTOR_CASES])
def test_constructor_rejects(kwargs, cls, builtin, match):
    expect(lambda: strategy(**kwargs), cls, builtin, match)


def test_emulate_more_devices_than_tensorflow_was_started_with():
    existing = len(tf.config.list_logical_devices("CPU"))  # starts TensorFlow if nothing has yet
    expect(lambda: strategy(emulate=["T4"] * existing), EmulationError, RuntimeError,
           rf"already initialised with logical_cpu_devices={existing}, but {existing + 1} are needed.*one per card "
           r"and one for the host's parameters.*HeteroCentralStorageStrategy\(emulate=...\).*before any TensorFlow "
           r"op runs")


@pytest.mark.parametrize("where", ["constructor", "set_batch_split"])
def test_batch_split_that_is_not_a_sequence(where):
    if where == "constructor":
        expect(lambda: strategy(DEVICES, batch_split=3), BatchSplitError, ValueError, r"batch_split=3")
    else:
        expect(lambda: fixed_split_strategy().set_batch_split(3), BatchSplitError, ValueError, r"batch_split=3")


UNORDERED_OR_HUGE_SPLITS = [
    ("regression_set", {3, 1, 2}, r"batch_split=\{1, 2, 3\} \(a set, which has no replica order\)"),
    ("regression_dict", {"a": 2, "b": 1, "c": 1}, r"\(a dict, which has no replica order\)"),
    ("generator", (s for s in [2, 1, 1]), r"\(a generator, not a sequence: make it a list\)"),
    ("regression_int_too_large_for_a_float", [10**400, 1, 1], r"finite numbers >= 0 with at least one > 0"),
    ("regression_sum_too_large_for_a_float", [1e308, 1e308, 1e308], r"sum to more than a float holds"),
]


@pytest.mark.parametrize("where", ["constructor", "set_batch_split"])
@pytest.mark.parametrize("shares,match", [c[1:] for c in UNORDERED_OR_HUGE_SPLITS],
                         ids=[c[0] for c in UNORDERED_OR_HUGE_SPLITS])
def test_batch_split_unordered_or_huge_is_a_batch_split_error(where, shares, match):
    if where == "constructor":
        expect(lambda: strategy(DEVICES, batch_split=shares), BatchSplitError, ValueError, match)
    else:
        under = strategy(DEVICES, batch_split=[2, 1, 1])
        expect(lambda: under.set_batch_split(shares), BatchSplitError, ValueError, match)
        assert under.plan_for(8).per_replica_batch_sizes == (4, 2, 2)


@pytest.mark.parametrize("dtype", [np.int64, np.float32])
def test_numpy_batch_split_is_accepted(dtype):
    shares = np.array([2, 1, 1], dtype)
    under = strategy(DEVICES, batch_split=shares)
    assert under.plan_for(8).per_replica_batch_sizes == (4, 2, 2)
    under.set_batch_split(shares[::-1])
    assert under.plan_for(8).per_replica_batch_sizes == (2, 2, 4)


def test_emulate_that_is_not_a_sequence():
    expect(lambda: strategy(DEVICES, emulate=3), ConfigError, ValueError, r"emulate=3")


def test_profile_cache_of_the_wrong_type():
    expect(lambda: strategy(DEVICES, profile_cache=3), ConfigError, ValueError, r"profile_cache=3")


# ----------------------------------------------------------------------------------------------------------------
# set_batch_split, plan_for, set_cost_models
# ----------------------------------------------------------------------------------------------------------------
SET_BATCH_SPLIT_CASES = [
    ("wrong_length", [1, 2], r"len\(batch_split\)=2, but there are R=3 compute devices. Give 3 shares"),
    ("negative", [1, -2, 1], r"batch_split=\[1, -2, 1\]. Example"),
    ("all_zero", [0, 0, 0], r"batch_split=\[0, 0, 0\]"),
    ("nan", [0, math.nan, 1], r"batch_split=\[0, nan, 1\]"),
]


@pytest.mark.parametrize("shares,match", [c[1:] for c in SET_BATCH_SPLIT_CASES],
                         ids=[c[0] for c in SET_BATCH_SPLIT_CASES])
def test_set_batch_split_rejects_and_keeps_the_split(shares, match):
    under = strategy(DEVICES, batch_split=[2, 1, 1])
    expect(lambda: under.set_batch_split(shares), BatchSplitError, ValueError, match)
    assert under.plan_for(8).per_replica_batch_sizes == (4, 2, 2)


@pytest.mark.parametrize("size", [0, -1])
def test_plan_for_a_global_batch_below_one(size):
    expect(lambda: fixed_split_strategy().plan_for(size), ConfigError, ValueError,
           rf"global_batch_size must be an integer >= 1. Received: global_batch_size={size}")


@pytest.mark.parametrize("size", ["abc", None, 2.7])
def test_plan_for_a_global_batch_that_is_not_an_integer(size):
    expect(lambda: fixed_split_strategy().plan_for(size), ConfigError, ValueError,
           rf"global_batch_size={re.escape(repr(size))}")


def test_set_cost_models_of_the_wrong_length():
    under = strategy(DEVICES)
    expect(lambda: under.set_cost_models([LinearCostModel(0.0, 1e-3)]), ConfigError, ValueError,
           r"one cost model per replica: got 1 for R=3")
    expect(lambda: under.set_cost_models([LinearCostModel(0.0, 1e-3)] * 3, max_batch_sizes=[8]), ConfigError,
           ValueError, r"len\(max_batch_sizes\)=1 but there are R=3")


def test_set_cost_models_with_caps_that_cannot_hold_the_batch():
    under = strategy(DEVICES)
    under.plan_for(12)
    expect(lambda: under.set_cost_models([LinearCostModel(0.0, 1e-3)] * 3, max_batch_sizes=[1, 1, 1]),
           InfeasiblePlanError, ValueError,
           r"global_batch_size=12 exceeds the total capacity: max_batch_sizes=\[1, 1, 1\] sum to 3.*at most 3")


def test_failed_set_cost_models_leaves_the_strategy_as_it_was():
    models = [LinearCostModel(0.0, 1e-3)] * 3
    balanced = strategy(DEVICES)
    balanced.set_cost_models(models)
    before = balanced.plan_for(12)
    with pytest.raises(InfeasiblePlanError):
        balanced.set_cost_models(models, max_batch_sizes=[1, 1, 1])
    assert balanced.plan_for(12) == before

    fixed = strategy(DEVICES, batch_split=[1, 1, 1])
    model = small_model(fixed)
    model.fit(X, Y, batch_size=12, epochs=1, verbose=0)
    with pytest.raises(InvalidCostModelError):
        fixed.set_cost_models([*models[:2], NaNModel()])
    model.fit(X, Y, batch_size=12, epochs=1, verbose=0)  # today: ReplicaStepError wrapping the NaN model


def test_set_cost_models_rejects_nan_costs_at_once():
    expect(lambda: strategy(DEVICES).set_cost_models([LinearCostModel(0.0, 1e-3)] * 2 + [NaNModel()]),
           InvalidCostModelError, ValueError, r"cost_models\[2\]\.predict_step_time_s\(0\) returned nan")


@pytest.mark.parametrize("case", ["generator", "caps_string"])
def test_set_cost_models_with_odd_containers(case):
    under = strategy(DEVICES)
    if case == "generator":
        under.set_cost_models(LinearCostModel(0.0, 1e-3) for _ in range(3))
        assert len(under.cost_models) == 3
    else:
        expect(lambda: under.set_cost_models([LinearCostModel(0.0, 1e-3)] * 3, max_batch_sizes="abc"),
               ConfigError, ValueError, r"max_batch_sizes='abc'")


# ----------------------------------------------------------------------------------------------------------------
# model.fit / evaluate / predict input
# ----------------------------------------------------------------------------------------------------------------
SCALAR_COMPONENT = r"needs a leading batch dimension to be split across replicas.*dataset\.batch\(global_batch_size\)"


def test_fit_on_a_dataset_element_without_a_batch_dimension():
    under = fixed_split_strategy()
    model = small_model(under)
    labels_per_example = tf.data.Dataset.from_tensor_slices((X, np.ones(12, np.float32)))  # not batched: y is ()
    expect(lambda: model.fit(labels_per_example, epochs=1, verbose=0), InputError, ValueError, SCALAR_COMPONENT)
    scalar_label = tf.data.Dataset.from_tensors((X, np.float32(1.0)))
    expect(lambda: model.fit(scalar_label, epochs=1, verbose=0), InputError, ValueError, SCALAR_COMPONENT)
    expect(lambda: model.evaluate(scalar_label, verbose=0), InputError, ValueError, SCALAR_COMPONENT)
    expect(lambda: model.predict(tf.data.Dataset.from_tensors(np.float32(1.0)), verbose=0), InputError, ValueError,
           SCALAR_COMPONENT)


def test_fit_on_components_with_different_batch_sizes_is_an_error_not_silent_training():
    under = fixed_split_strategy()
    model = small_model(under)
    misaligned = tf.data.Dataset.from_tensors((X, np.arange(24, dtype=np.float32).reshape(24, 1)))
    expect(lambda: model.fit(misaligned, epochs=1, verbose=0), InputError, ValueError,
           r"leading (batch )?dimension.*\b12\b.*\b24\b|\b24\b.*\b12\b")


def test_fit_on_an_unbatched_dataset_of_vectors():
    under = fixed_split_strategy()
    model = small_model(under)
    unbatched = tf.data.Dataset.from_tensor_slices((X, Y))  # elements (4,), (1,)
    expect(lambda: model.fit(unbatched, epochs=1, verbose=0), InputError, ValueError, r"(?i)batch")


@pytest.mark.parametrize("emptied", ["take(0)", "a filter that drops everything"])
def test_fit_evaluate_and_predict_on_an_empty_dataset(emptied):
    # A filter's emptiness is unknown before the data is read: Keras' loop ends with a warning and no step
    # (regression: fit and evaluate returned as if they had run).
    under = fixed_split_strategy()
    model = small_model(under)
    batches = tf.data.Dataset.from_tensor_slices((X, Y)).batch(6)
    empty = batches.take(0) if emptied == "take(0)" else batches.filter(lambda x, y: False)
    before = model.get_weights()
    for verb, data in (("fit", empty), ("evaluate", empty), ("predict", empty.map(lambda x, y: x))):
        expect(lambda: getattr(model, verb)(data, verbose=0), InputError, ValueError,
               rf"model.{verb} got no batches: the dataset is empty")
    for got, want in zip(model.get_weights(), before):
        np.testing.assert_array_equal(got, want)


def test_a_scalar_element_of_a_dataset_of_unknown_rank_is_an_input_error():
    # The pipeline's check read the leading dimension with tf.shape(x)[0], which failed on a scalar with TensorFlow's
    # "slice index 0 of dimension 0 out of bounds" (regression).
    model = small_model(fixed_split_strategy())

    def elements():
        yield X[:4]
        yield np.float32(1.0)

    dataset = tf.data.Dataset.from_generator(elements, output_signature=tf.TensorSpec(None, tf.float32))
    expect(lambda: model.predict(dataset, verbose=0), InputError, ValueError,
           r"a component with no leading batch dimension \(a scalar; leading dimensions \['none'\]\)")


def test_fit_on_a_batch_with_zero_examples():
    under = fixed_split_strategy()
    model = small_model(under)
    zero = tf.data.Dataset.from_tensors((X[:0], Y[:0]))
    expect(lambda: model.fit(zero, epochs=1, verbose=0), InputError, ValueError, r"0 examples")


# ----------------------------------------------------------------------------------------------------------------
# Calibration
# ----------------------------------------------------------------------------------------------------------------
CALIBRATE_INPUT_CASES = [
    ("empty_dataset", lambda: tf.data.Dataset.from_tensor_slices((X, Y)).batch(6).take(0),
     r"The dataset is empty; calibration needs one global batch"),
    ("scalar_component", lambda: tf.data.Dataset.from_tensors((np.float32(1.0), Y)),
     r"no batch dimension \(shape=\(\)\); batch the data first"),
    ("none", lambda: None, r"tf\.data\.Dataset of global batches or one batch \(x, y\); got NoneType"),
    ("empty_tuple", lambda: (), r"got tuple"),
]


@pytest.mark.parametrize("data,match", [c[1:] for c in CALIBRATE_INPUT_CASES], ids=[c[0] for c in CALIBRATE_INPUT_CASES])
def test_strategy_calibrate_rejects(data, match):
    under = strategy(DEVICES)
    model = small_model(under)
    expect(lambda: under.calibrate(model, data(), progress=False), InputError, ValueError, match)


def _out_of_memory(self, batch_size):
    raise tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor (simulated)")


def test_calibration_out_of_memory_at_every_probe_size(monkeypatch):
    monkeypatch.setattr(DeviceProbe, "run_step", _out_of_memory)
    under = strategy(DEVICES)
    model = small_model(under)
    error = expect(
        lambda: run_calibration(model, (X, Y), devices=DEVICES, probe_batch_sizes=[4, 12], store=False,
                                progress=False),
        CalibrationOOMError, MemoryError,
        r"No device can hold one example of this model: device='/device:CPU:1' ran out of memory at "
        r"batch_sizes=\[1, 4\], the smallest tried \(probe_batch_sizes=\[4, 12\]\); "
        r"device='/device:CPU:2' .*\. Use a smaller "
        r"model \(or mixed precision\), or devices with more memory")
    assert isinstance(error, CalibrationError) and isinstance(error, RuntimeError)
    # model.fit calibrates on its first global batch: the same error reaches the caller, not a wrapped one.
    expect(lambda: model.fit(X, Y, batch_size=12, epochs=1, verbose=0), CalibrationOOMError, MemoryError,
           r"No device can hold one example of this model")


def test_calibrate_direct_device_names():
    under = strategy(DEVICES)
    model = small_model(under)
    expect(lambda: run_calibration(model, (X, Y), devices=["not a device"], store=False, progress=False),
           DeviceError, ValueError, r"Cannot parse device name='not a device'. Use names like '/device:GPU:0'")
    expect(lambda: run_calibration(model, (X, Y), devices=["/cpu:1"], parameter_device="banana", store=False,
                                   progress=False), DeviceError, ValueError, r"name='banana'")
    expect(lambda: run_calibration(model, (X, Y), devices=[], store=False), DeviceError, ValueError,
           r"devices=\[\]")
    # The strategy's check: the same words for a device named twice (the argument's name aside).
    expect(lambda: run_calibration(model, (X, Y), devices=["/cpu:1", "CPU:1"], store=False), DeviceError, ValueError,
           r"devices repeats a device: \['/device:CPU:1', '/device:CPU:1'\]. List each device once")
    expect(lambda: run_calibration(model, (X, Y), devices=["/cpu:1"], max_batch_sizes=[0], store=False),
           ConfigError, ValueError, r"max_batch_sizes\[0\]=0")
    expect(lambda: run_calibration(model, (X, Y), devices=["/cpu:1"], probe_batch_sizes=[4, -1], store=False),
           ConfigError, ValueError, r"probe_batch_sizes\[1\]=-1")


def test_regression_calibrate_accepts_numpy_sizes():
    under = strategy(DEVICES)
    model = small_model(under)
    result = run_calibration(model, (X, Y), devices=["/cpu:1"], global_batch_size=np.int64(8),
                             probe_batch_sizes=np.array([2, 8]), warmup_steps=0, trials=1, store=False,
                             progress=False)
    assert result.profiles[0].probe_batch_sizes == (2, 8)
    assert result.plan.global_batch_size == 8


# ----------------------------------------------------------------------------------------------------------------
# HETERO_CS_* environment variables
# ----------------------------------------------------------------------------------------------------------------
def test_time_scale_environment_variable_with_garbage(monkeypatch):
    monkeypatch.setenv("HETERO_CS_EMULATION_TIME_SCALE", "fast")
    expect(lambda: strategy(DEVICES, emulate=["A10", "T4", "P100"]), ConfigError, ValueError,
           r"HETERO_CS_EMULATION_TIME_SCALE='fast'.*must be a finite number > 0, e\.g\. 1\.0")


@pytest.mark.parametrize("raw", ["2", "enable"])
def test_timing_flag_environment_variable_with_garbage(monkeypatch, raw):
    # It was silently off, where every other HETERO_CS_* variable is checked.
    monkeypatch.setenv("HETERO_CS_TIMING", raw)
    expect(lambda: strategy(DEVICES), ConfigError, ValueError,
           rf"HETERO_CS_TIMING='{raw}' is not a flag: set it to 1 \(on\) or 0 \(off\), or leave it unset")


@pytest.mark.parametrize("raw", ["soon", "-5", "nan"])
def test_target_makespan_environment_variable_with_garbage(monkeypatch, raw):
    monkeypatch.setenv("HETERO_CS_EMULATION_TARGET_MAKESPAN_MS", raw)
    under = strategy(DEVICES, emulate=["A10", "T4", "P100"], auto_balance=False)
    model = small_model(under)
    expect(lambda: under.calibrate(model, (X, Y), progress=False), ConfigError, ValueError,
           rf"HETERO_CS_EMULATION_TARGET_MAKESPAN_MS='{raw}' must be a positive number of milliseconds, e\.g\. 100")


@pytest.mark.parametrize("raw", ["1e30", "1e4"])
def test_regression_a_huge_time_scale_variable_is_refused_when_the_strategy_is_built(monkeypatch, raw):
    # 1e30 gave a 77-line error about sleep at the first step; 1e4 ran for minutes without a word.
    monkeypatch.setenv("HETERO_CS_EMULATION_TIME_SCALE", raw)
    error = expect(lambda: strategy(DEVICES, emulate=["A10", "T4", "P100"]), ConfigError, ValueError,
                   rf"HETERO_CS_EMULATION_TIME_SCALE='{raw}' \(value .*\) must be a finite number > 0.*at most "
                   r"MAX_TIME_SCALE=1000")
    assert "\n" not in str(error) and "sleep" not in str(error)


@pytest.mark.parametrize("raw", ["1e30", "1e4", "5000.1", "0.5"])
def test_regression_an_out_of_range_target_makespan_variable_is_refused_before_any_step(monkeypatch, raw):
    monkeypatch.setenv("HETERO_CS_EMULATION_TARGET_MAKESPAN_MS", raw)
    under = strategy(DEVICES, emulate=["A10", "T4", "P100"], auto_balance=False)
    model = small_model(under)
    expect(lambda: model.fit(X, Y, batch_size=12, epochs=1, verbose=0), ConfigError, ValueError,
           rf"HETERO_CS_EMULATION_TARGET_MAKESPAN_MS='{re.escape(raw)}' must be a positive number of milliseconds, "
           r"e\.g\. 100, from 1 to 5000 \(an emulated step of at most 5 s\)")
    assert under.emulator.steps_done == (0, 0, 0)  # no step ran


def test_target_makespan_error_is_raised_again_on_retry(monkeypatch):
    monkeypatch.setenv("HETERO_CS_EMULATION_TARGET_MAKESPAN_MS", "soon")
    under = strategy(DEVICES, emulate=["A10", "T4", "P100"], auto_balance=False)
    model = small_model(under)
    with pytest.raises(ConfigError):
        under.calibrate(model, (X, Y), progress=False)
    expect(lambda: under.calibrate(model, (X, Y), progress=False), ConfigError, ValueError,
           r"HETERO_CS_EMULATION_TARGET_MAKESPAN_MS='soon'")


def test_regression_cache_dir_environment_variable_naming_a_file(monkeypatch, tmp_path):
    # It used to warn twice (cannot read, cannot write) on every calibration and carry on without a cache.
    blocker = tmp_path / "cache_file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("HETERO_CS_CACHE_DIR", str(blocker))
    under = strategy(DEVICES, profile_cache=None)
    model = small_model(under)
    expect(lambda: under.calibrate(model, (X, Y), progress=False), ConfigError, ValueError,
           r"HETERO_CS_CACHE_DIR=.*cache_file' names an existing file.*profile_cache=False")


# ----------------------------------------------------------------------------------------------------------------
# Command line: calibrate
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv,match", [
    (["--devices", "not a device"], r"error: Cannot parse device name='not a device'"),
    (["--devices", "/gpu:7"], r"error: Unknown device\(s\) \['/device:GPU:7'\]"),
    (["--emulate", "A10,RTX"], r"error: Unknown emulated device name='RTX'"),
], ids=["regression_unparsable_device", "unknown_device", "unknown_emulated_device"])
def test_cli_calibrate_bad_devices_exit_2(capsys, argv, match):
    status = calibration_main([*argv, "--no-cache", "--no-progress", "--trials", "1", "--warmup-steps", "0"])
    err = capsys.readouterr().err
    assert status == 2
    assert "Traceback" not in err
    assert re.search(match, err), err


class AddLossAutoencoder(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(4)

    def call(self, x):
        out = self.dense(x)
        self.add_loss(tf.reduce_mean((out - x) ** 2))
        return out


def test_auto_balance_on_data_without_labels_says_how_to_train_it():
    x = np.random.default_rng(0).normal(size=(40, 4)).astype(np.float32)
    balanced = HeteroCentralStorageStrategy(["/cpu:1", "/cpu:2"], profile_cache=False)
    with balanced.scope():
        model = AddLossAutoencoder()
        model.compile(optimizer="sgd")
    with pytest.raises(ConfigError, match=r"no labels.*batch_split=\[\.\.\.\].*auto_balance=False"):
        model.fit(x, batch_size=10, epochs=1, verbose=0)
    fixed = HeteroCentralStorageStrategy(["/cpu:1", "/cpu:2"], batch_split=[3, 1], profile_cache=False)
    with fixed.scope():
        model = AddLossAutoencoder()
        model.compile(optimizer="sgd")
    history = model.fit(x, batch_size=10, epochs=1, verbose=0)
    assert math.isfinite(history.history["loss"][0])


def test_calibrating_a_model_compiled_without_a_loss_is_a_calibration_error():
    # The message gives Keras' reason, not the first line of the traced function's error ("in user code:").
    strategy = HeteroCentralStorageStrategy(["/cpu:1", "/cpu:2"], profile_cache=False)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="adam")
    with pytest.raises(CalibrationError, match="No loss to compute.*compiled with a loss.*batch_split"):
        strategy.calibrate(model, tf.data.Dataset.from_tensors((X, Y)), progress=False)


def test_calibrating_on_an_empty_first_batch_is_an_input_error():
    strategy = HeteroCentralStorageStrategy(["/cpu:1", "/cpu:2"], profile_cache=False)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="adam", loss="mse")
    with pytest.raises(InputError, match="0 examples"):
        strategy.calibrate(model, tf.data.Dataset.from_tensors((X[:0], Y[:0])), progress=False)


def test_not_in_replica_step_error_is_exported():
    import hetero_cs

    with pytest.raises(hetero_cs.NotInReplicaStepError):
        hetero_cs.current_global_batch_size()


def test_evaluate_and_predict_raise_the_input_error_of_a_bad_batch():
    strategy = HeteroCentralStorageStrategy(["/cpu:1", "/cpu:2"], auto_balance=False, rebalance=False,
                                            profile_cache=False)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    batches = [(X[:4], Y[:4]), (X[:4], Y[:3])]  # the second batch's components disagree: 4 and 3 examples
    dataset = dataset_of(batches)
    with pytest.raises(InputError, match=r"different leading \(batch\) dimensions \[4, 3\]"):
        model.evaluate(dataset, verbose=0)
    with pytest.raises(InputError, match=r"different leading \(batch\) dimensions \[4, 3\]"):
        model.predict(dataset, verbose=0)


def test_the_multi_worker_strategy_refuses_emulate_as_one_string():
    from hetero_cs import HeteroMultiWorkerMirroredStrategy

    # A list of names or an Emulator (tests/multiworker runs one with drift); a comma-separated string is the
    # launcher's --emulate form, not the argument's.
    with pytest.raises(ConfigError, match="takes catalog device names .* or a hetero_cs.emulation.Emulator, not str"):
        HeteroMultiWorkerMirroredStrategy(emulate="A10,T4")


@pytest.mark.parametrize("emulate", [None, pytest.param(["A10", "T4", "P100"], marks=pytest.mark.slow)])
def test_regression_a_model_created_outside_the_scope_and_fit_inside_it(emulate):
    # Built and compiled outside strategy.scope(), fit inside it: with emulated devices the step said "call
    # strategy.calibrate(model, dataset)", and after that TensorFlow failed with "Mixing different
    # tf.distribute.Strategy objects" (without emulation too, once the optimizer made a slot variable).
    under = strategy(DEVICES, emulate=emulate)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    for calibrated_first in (False, True):
        if calibrated_first:
            under.calibrate(model, (X, Y), progress=False)  # what the old advice led to

        def fit():
            with under.scope():
                model.fit(X, Y, batch_size=6, epochs=1, verbose=0)

        error = expect(fit, ConfigError, ValueError,
                       r"This model \(Sequential\) was created outside `with strategy.scope\(\):`.*"
                       r"inside the scope of a HeteroCentralStorageStrategy")
        message = str(error)
        assert "Create and compile the model inside the strategy's scope" in message, message
        assert "with strategy.scope():\n        model = build_model()\n        model.compile(" in message, message
        assert "strategy.calibrate" not in message, message
    assert int(model.optimizer.iterations) == 0  # refused before any step


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_a_model_compiled_outside_the_scope_says_to_compile_inside_it(optimizer):
    # Adam's slot variables would be made under the strategy (TensorFlow fails: "Mixing different ..."); SGD has none,
    # and each replica's update counted as a step of its own (regression: iterations, and a schedule, R times too fast).
    under = strategy(DEVICES, auto_balance=False)
    with under.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=optimizer, loss="mse")
    before = model.get_weights()
    expect(lambda: model.fit(X, Y, batch_size=6, epochs=1, verbose=0), ConfigError, ValueError,
           r"optimizer was created outside `with strategy.scope\(\):`.*Create and compile the model inside")
    assert int(model.optimizer.iterations) == 0
    for got, want in zip(model.get_weights(), before):
        np.testing.assert_array_equal(got, want)


def test_regression_a_model_built_outside_the_scope_and_compiled_inside_says_to_create_it_inside():
    # TensorFlow's own RuntimeError ('Need to be inside "with strategy.scope()"') reached the user at the first step.
    under = strategy(DEVICES, auto_balance=False)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    with under.scope():
        model.compile(optimizer="adam", loss="mse")
    weights = model.get_weights()
    expect(lambda: model.fit(X, Y, batch_size=6, epochs=1, verbose=0), ConfigError, ValueError,
           r"variables were created outside `with strategy.scope\(\):`.*Create and compile the model inside")
    assert int(model.optimizer.iterations) == 0
    assert all(np.array_equal(a, b) for a, b in zip(weights, model.get_weights()))


class OnlyTrainStep(keras.Model):
    """Keras' WGAN-GP example's shape: sub-layers and a train_step, no call()."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self.dense(x) - y))
        variables = self.dense.trainable_variables
        self.optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return {"loss": loss}


def test_regression_a_model_keras_cannot_build_from_the_first_batch_gets_a_config_error_that_says_why():
    # Keras' own RuntimeError ("Unable to automatically build the model") reached the user from the symbolic build
    # every tf.distribute strategy runs before the first step (one device trains this model).
    with strategy(DEVICES, batch_split=[5, 0, 3]).scope():
        model = OnlyTrainStep()
        model.compile(optimizer="sgd")
    expect(lambda: model.fit(X, Y, batch_size=6, epochs=1, verbose=0), ConfigError, ValueError,
           r"(?s)Keras could not build OnlyTrainStep from its first batch's shapes.*Unable to automatically build.*"
           r"set model.built = True")
    assert int(model.optimizer.iterations) == 0


def test_evaluate_and_predict_of_an_empty_dataset_raise_input_error():
    s = strategy(compute_devices=DEVICES, batch_split=[1, 1, 1])
    with s.scope():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    empty = tf.data.Dataset.from_tensor_slices((np.ones((4, 2), np.float32), np.ones((4, 1), np.float32))).take(0)
    expect(lambda: model.evaluate(empty.batch(2), verbose=0), InputError, ValueError,
           r"model.evaluate got no batches: the dataset is empty")
    expect(lambda: model.predict(empty.map(lambda x, y: x).batch(2), verbose=0), InputError, ValueError,
           r"model.predict got no batches: the dataset is empty")


def test_an_optimizer_that_overrides_a_hooked_method_is_refused():
    """Regression: a subclass overriding _clip_gradients clipped each replica's slice (weights off by 1.5e-3)."""

    class OwnClipping(keras.optimizers.SGD):
        def _clip_gradients(self, grads):
            return [tf.clip_by_norm(g, 0.1) for g in grads]

    s = strategy(compute_devices=DEVICES, batch_split=[2, 1, 1])
    with s.scope():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(optimizer=OwnClipping(0.1), loss="mse")
    before = model.get_weights()
    x = np.ones((8, 2), np.float32)
    expect(lambda: model.fit(x, x[:, :1], batch_size=8, verbose=0), ConfigError, ValueError,
           r"OwnClipping overrides _clip_gradients .*summed gradient.*Use an optimizer that does not override it")
    for got, want in zip(model.get_weights(), before):
        np.testing.assert_array_equal(got, want)


def test_an_evaluate_inside_fit_keeps_fits_pending_input_error():
    # fit's pipeline reads a batch ahead and keeps its error until the step that needs it fails; an evaluate run by a
    # callback in between (its own entry point, distributing its own input) must not drop it, or fit would raise
    # TensorFlow's error, not ours. The evaluate starts its input only once fit's pipeline has kept the error, so the
    # race that dropped it on a busy host is not left to chance.
    strategy = fixed_split_strategy()
    model = small_model(strategy)
    batches = [(X[:4], Y[:4]), (X[:4], Y[:4]), (X[:4], Y[:3])]  # the third batch's components disagree
    dataset = dataset_of(batches)
    good = tf.data.Dataset.from_tensors((X[:4], Y[:4]))
    claim_input = strategy._input_roles.claim_input  # noqa: SLF001
    kept = []

    def claim_once_fits_error_is_kept():
        deadline = time.monotonic() + 20.0
        while not strategy._input_errors and time.monotonic() < deadline:  # noqa: SLF001
            time.sleep(0.01)
        kept.append(bool(strategy._input_errors))  # noqa: SLF001
        return claim_input()

    class EvaluateEachBatch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:  # the pipeline reads the third, bad batch ahead of its step
                strategy._input_roles.claim_input = claim_once_fits_error_is_kept  # noqa: SLF001
            try:
                self.model.evaluate(good, verbose=0)
            finally:
                strategy._input_roles.claim_input = claim_input  # noqa: SLF001

    with pytest.raises(InputError, match=r"different leading \(batch\) dimensions \[4, 3\]"):
        model.fit(dataset, epochs=1, verbose=0, callbacks=[EvaluateEachBatch()])
    assert kept and kept[-1]  # the evaluate ran with fit's error kept
