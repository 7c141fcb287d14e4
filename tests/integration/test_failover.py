"""A failing card costs a step, never the run: device errors in model.fit on emulated devices (Drift fails=True).

The oracle: single-device training on the same batches, in the same order. A run whose card fails mid-fit and is set
aside must match it to 1e-5 (no example lost or applied twice), with one optimizer iteration per batch.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from hetero_cs import DeviceFaultError, HeteroCentralStorageStrategy, ReplicaStepError
from hetero_cs.emulation import Drift, Emulator
from tiny_regression import B, DEVICES, WORKLOAD, mlp, regression_data

NUM_BATCHES = 8


def data():
    return regression_data(NUM_BATCHES)


def reference(initial_weights, epochs):
    model = mlp()
    model.set_weights(initial_weights)
    model.compile(optimizer="adam", loss="mse")
    x, y = data()
    history = model.fit(x, y, batch_size=B, epochs=epochs, shuffle=False, verbose=0)
    return model, history


@pytest.fixture
def fast_emulation(monkeypatch, tmp_path):
    monkeypatch.setenv("HETERO_CS_CACHE_DIR", str(tmp_path))


def fit_with(drift, epochs=1, **strategy_kwargs):
    emulator = Emulator(["A10", "T4", "T4"], workload=WORKLOAD, time_scale=1.0, drift=drift)
    strategy = HeteroCentralStorageStrategy(DEVICES, emulate=emulator, **strategy_kwargs)
    with strategy.scope():
        model = mlp()
        model.compile(optimizer="adam", loss="mse")
    initial = model.get_weights()
    x, y = data()
    history = model.fit(x, y, batch_size=B, epochs=epochs, shuffle=False, verbose=0)
    return strategy, model, initial, history


def assert_matches_reference(model, initial, history, epochs):
    ref, ref_history = reference(initial, epochs)
    assert int(model.optimizer.iterations) == int(ref.optimizer.iterations) == epochs * NUM_BATCHES
    for got, want in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-5)
    np.testing.assert_allclose(history.history["loss"], ref_history.history["loss"], atol=1e-5)


def test_a_card_that_fails_for_good_is_set_aside_and_training_stays_exact(fast_emulation, caplog):
    caplog.set_level("WARNING", logger="hetero_cs.engine.central_storage")
    strategy, model, initial, history = fit_with(
        [Drift(replica_id=1, from_step=3, fails=True)], epochs=2, batch_split=[1, 1, 1])
    assert_matches_reference(model, initial, history, epochs=2)
    recovery = strategy._step_recovery  # noqa: SLF001
    assert recovery.failover.exclusions == [1]
    assert recovery.failover.retries == 1  # retried once on the same plan, then set aside
    assert strategy.balancer.max_batch_sizes[1] == 0
    assert strategy.plan.per_replica_batch_sizes[1] == 0  # the fixed shares of the others: [24, 0, 24]
    assert strategy.plan.per_replica_batch_sizes == (24, 0, 24)
    sample = strategy.monitor.last_step()  # an idle replica reports 0 examples in 0 s: nothing ran on it
    assert sample.per_replica_batch_sizes == (24, 0, 24) and sample.per_replica_step_times_s[1] == 0.0
    messages = [r.getMessage() for r in caplog.records]
    assert any("retrying the same global batch once" in m and "emulated T4" in m for m in messages)
    assert any("excluded from training" in m and "/device:CPU:2" in m and "CUDA_ERROR_ECC_UNCORRECTABLE" in m
               for m in messages)
    assert strategy.stats.history["excluded_replicas"][-1] == 1.0


def test_a_transient_fault_costs_one_retried_step_and_keeps_the_card(fast_emulation):
    strategy, model, initial, history = fit_with(
        [Drift(replica_id=2, from_step=4, until_step=5, fails=True)], batch_split=[2, 1, 1])
    assert_matches_reference(model, initial, history, epochs=1)
    failover = strategy._step_recovery.failover  # noqa: SLF001
    assert failover.retries == 1 and failover.exclusions == []
    assert strategy.plan.per_replica_batch_sizes == (24, 12, 12)


def test_auto_balance_solves_the_plan_again_from_the_other_cards(fast_emulation, modelled_step_times):
    strategy, model, initial, history = fit_with(
        [Drift(replica_id=0, from_step=2, fails=True)], rebalance=False, guard=False)
    assert_matches_reference(model, initial, history, epochs=1)
    sizes = strategy.plan.per_replica_batch_sizes
    assert sizes[0] == 0 and sizes[1] + sizes[2] == B and abs(sizes[1] - sizes[2]) <= 1  # two alike T4s


def test_a_card_failing_for_good_mid_trial_is_retried_on_the_same_plan_and_set_aside(fast_emulation):
    """A guard trial serves its two plans by turns; a retry after a device error must not take the turn. The candidate
    leaves the failing card idle: retried on it, the batch succeeded, the card failed once per batch and was never
    set aside (a failed step every few steps, the trial never measuring its incumbent)."""
    from hetero_cs import LinearCostModel

    emulator = Emulator(["A10", "T4", "T4"], workload=WORKLOAD, time_scale=1.0,
                        drift=[Drift(replica_id=1, from_step=2, fails=True)])
    strategy = HeteroCentralStorageStrategy(DEVICES, emulate=emulator, rebalance=False)
    with strategy.scope():
        model = mlp()
        model.compile(optimizer="adam", loss="mse")
    initial = model.get_weights()
    x, y = data()
    strategy.calibrate(model, (x[:B], y[:B]), progress=False)
    slow_card = [LinearCostModel(1e-3, 1e-5), LinearCostModel(1.0, 1e-2), LinearCostModel(1e-3, 1e-5)]
    strategy.balancer.set_cost_models(slow_card, trial=True, reference_batch_size=B)
    assert strategy.balancer.guard.in_trial and strategy.balancer.guard.candidate.per_replica_batch_sizes[1] == 0
    history = model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert_matches_reference(model, initial, history, epochs=1)
    failover = strategy._step_recovery.failover  # noqa: SLF001
    assert failover.exclusions == [1] and failover.retries == 1


def test_on_device_error_raise_ends_fit_with_a_device_fault_error_and_applies_nothing(fast_emulation):
    emulator = Emulator(["A10", "T4", "T4"], workload=WORKLOAD, time_scale=1.0,
                        drift=[Drift(replica_id=2, from_step=1, fails=True)])
    strategy = HeteroCentralStorageStrategy(DEVICES, emulate=emulator, batch_split=[1, 1, 1],
                                            on_device_error="raise")
    with strategy.scope():  # the moving statistics, updated by the other replicas of the failed step, are put back
        keras.utils.set_random_seed(5)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(12), keras.layers.BatchNormalization(),
                                  keras.layers.Dense(1)])
        model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    x, y = data()
    model.fit(x[:B], y[:B], batch_size=B, epochs=1, shuffle=False, verbose=0)
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(DeviceFaultError, match=r"replica 2, /device:CPU:3 \(emulated T4\).*CUDA_ERROR_ECC") as info:
        model.fit(x[:B], y[:B], batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert isinstance(info.value, ReplicaStepError) and info.value.replica_id == 2
    assert "on_device_error='raise'" in str(info.value)
    assert isinstance(info.value.__cause__, tf.errors.UnknownError)
    for got, want in zip(model.get_weights(), before):
        np.testing.assert_array_equal(got, want)
    assert int(model.optimizer.iterations) == 1


def test_a_program_error_is_never_taken_for_a_failing_card(fast_emulation):
    # An InternalError without a driver's fault text, raised inside replica 1's step: a program error.
    emulator = Emulator(["A10", "T4", "T4"], workload=WORKLOAD, time_scale=1.0,
                        drift=[Drift(replica_id=0, from_step=10_000, fails=True)])  # faults possible: armed
    strategy = HeteroCentralStorageStrategy(DEVICES, emulate=emulator, batch_split=[1, 1, 1])

    class Faulty(keras.layers.Layer):
        def call(self, inputs):
            def check(values):
                raise RuntimeError("a bug in the user's layer, not the card")

            done = tf.numpy_function(check, [inputs], tf.float32)
            with tf.control_dependencies([done]):  # outside the data path, which the loss reader reads
                return tf.identity(inputs)

    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), Faulty(), keras.layers.Dense(1)])
        model.compile(optimizer="adam", loss="mse")
    x, y = data()
    with pytest.raises(ReplicaStepError) as info:
        model.fit(x[:B], y[:B], batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert not isinstance(info.value, DeviceFaultError)
    failover = strategy._step_recovery.failover  # noqa: SLF001
    assert failover.retries == 0 and failover.exclusions == []


def test_the_last_card_left_failing_ends_fit_with_what_was_excluded(fast_emulation):
    with pytest.raises(DeviceFaultError, match=r"no other card is left.*every card failed in turn") as info:
        fit_with([Drift(replica_id=1, from_step=1, fails=True), Drift(replica_id=0, from_step=2, fails=True),
                  Drift(replica_id=2, from_step=2, fails=True)], batch_split=[1, 1, 1])
    assert len(info.value.excluded) == 2


def test_micro_batches_carry_on_when_the_card_set_aside_held_most_of_the_batch(fast_emulation, modelled_step_times):
    # Two cards that hold 16 examples each and a third that holds the whole batch: when the large one fails for
    # good, the batch of 48 trains as sub-steps on the small ones, still exactly. The cards report their modelled
    # times, so the plan uses the A10 however busy the host is (a noisy calibration could leave it idle: it would
    # never fail).
    small = WORKLOAD.fixed_memory_bytes + 16 * 10_000
    emulator = Emulator(["A10", f"T4@{small}B", f"T4@{small}B"], workload=WORKLOAD, time_scale=1.0,
                        drift=[Drift(replica_id=0, from_step=2, fails=True)])
    strategy = HeteroCentralStorageStrategy(DEVICES, emulate=emulator, rebalance=False, guard=False)
    with strategy.scope():
        model = mlp()
        model.compile(optimizer="adam", loss="mse")
    initial = model.get_weights()
    x, y = data()
    history = model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert_matches_reference(model, initial, history, epochs=1)
    assert strategy._step_recovery.failover.exclusions == [0]  # noqa: SLF001
    assert strategy.micro_batching.micro_batched_steps >= 1


NODE = "\n\t [[{{node replica_1/sequential/dense/MatMul}}]]"


@pytest.mark.parametrize("error, form, replica", [
    (tf.errors.InternalError(None, None, "Failed to memcpy from device to host: CUDA_ERROR_ILLEGAL_ADDRESS: an "
                             "illegal memory access was encountered" + NODE), "illegal address", 1),
    (tf.errors.InternalError(None, None, "GPU sync failed"), "sync", None),  # names no replica: not set aside
    (tf.errors.UnknownError(None, None, "CUDA_ERROR_ECC_UNCORRECTABLE: uncorrectable ECC error encountered on "
                            "/job:localhost/replica:0/task:0/device:CPU:3"), "ecc", 2),
    (tf.errors.InternalError(None, None, "cuBLAS call failed status = CUBLAS_STATUS_EXECUTION_FAILED" + NODE),
     "cublas", 1),
    (tf.errors.InternalError(None, None, "CUDA_ERROR_HARDWARE_STACK_ERROR" + NODE), "hardware stack", 1),
    (tf.errors.UnknownError(None, None, "Traceback (most recent call last):\n  ...\nEmulatedDeviceError: "
                            "CUDA_ERROR_ECC_UNCORRECTABLE: emulated device fault on replica=2 (T4)"), "ecc", 2),
])
def test_the_rule_takes_driver_faults_for_a_failing_card(error, form, replica):
    from hetero_cs.devices.device_errors import device_fault

    fault = device_fault(error, ["/device:CPU:1", "/device:CPU:2", "/device:CPU:3"])
    assert fault is not None and fault.form == form and fault.replica_id == replica


@pytest.mark.parametrize("error", [
    tf.errors.InvalidArgumentError(None, None, "Incompatible shapes: [16,3] vs. [16,4]" + NODE),
    tf.errors.InternalError(None, None, "Could not find valid device for node" + NODE),  # no driver fault text
    tf.errors.InternalError(None, None, "CUDA_ERROR_ASSERT: device-side assert triggered" + NODE),  # a kernel bug
    tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor: CUDA_ERROR_OUT_OF_MEMORY" + NODE),
    tf.errors.InvalidArgumentError(None, None, "CUDA_ERROR_ECC_UNCORRECTABLE, in a user's check" + NODE),
    ValueError("CUDA_ERROR_ECC_UNCORRECTABLE"),  # not TensorFlow's
    # Codes a program or a build causes, not the hardware:
    tf.errors.InternalError(None, None, "CUDA_ERROR_NO_BINARY_FOR_GPU: no kernel image" + NODE),
    tf.errors.InternalError(None, None, "cudaErrorNoKernelImageForDevice" + NODE),
    tf.errors.InternalError(None, None, "CUDA_ERROR_INVALID_PTX" + NODE),
    tf.errors.InternalError(None, None, "cudaErrorDevicesUnavailable: exclusive compute mode" + NODE),
    # What CUDA reports after a device-side assert is the assert's:
    tf.errors.InternalError(None, None, "device-side assert triggered\nGPU sync failed" + NODE),
    # A Python error inside the step, whatever its text:
    tf.errors.UnknownError(None, None, "Traceback (most recent call last):\n  File x\nRuntimeError: my check "
                           "mentions CUDA_ERROR_ECC_UNCORRECTABLE" + NODE),
])
def test_the_rule_never_takes_a_program_error_or_out_of_memory_for_a_failing_card(error):
    from hetero_cs.devices.device_errors import device_fault

    assert device_fault(error, ["/device:CPU:1", "/device:CPU:2", "/device:CPU:3"]) is None


@pytest.mark.parametrize("text", [
    "CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access was encountered",
    "CUDA_ERROR_ECC_UNCORRECTABLE: uncorrectable ECC error encountered",
    "unspecified launch failure",
])
def test_a_sticky_cuda_error_is_neither_retried_nor_set_aside_in_the_process(text):
    # A real card's context is broken after a sticky error (every later op there fails): the tests injected these
    # as Python exceptions, and the in-process retry and exclusion went on against a context that cannot work.
    from hetero_cs.engine import _compat

    strategy = HeteroCentralStorageStrategy(DEVICES, batch_split=[1, 1, 1], profile_cache=False)
    recovery = strategy._step_recovery  # noqa: SLF001
    calls = []

    def step(data):
        calls.append(1)
        raise tf.errors.InternalError(None, None, f"{text}{NODE}")

    with pytest.raises(DeviceFaultError, match=r"replica 1.*the error is sticky: CUDA's context on that card is "
                                               r"broken.*only when NVML shows it lost"):
        recovery.run(step, _compat.per_replica((tf.zeros([48, 6]),)))
    assert len(calls) == 1 and recovery.failover.retries == 0 and recovery.failover.exclusions == []
    assert strategy.balancer.memory_caps.caps[1] != 0
