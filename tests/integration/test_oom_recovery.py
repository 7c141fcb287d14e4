"""Out-of-memory recovery through model.fit on emulated devices whose memory drops mid-training.

The oracle: single-device training on the same batches, in the same order. A recovered run must match it to 1e-5
(no example lost or applied twice) with one optimizer iteration per batch.
"""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

from hetero_cs import HeteroCentralStorageStrategy, MemoryRecoveryPolicy, StepOOMError
from hetero_cs.emulation import Drift, Emulator, Workload

DEVICES = ["/cpu:1", "/cpu:2", "/cpu:3"]
ACTIVATION_BYTES = 10_000  # per example, so caps are round numbers of examples
WORKLOAD = Workload(flops_per_example=2e7, parameter_bytes=10_000, activation_bytes_per_example=ACTIVATION_BYTES)
B = 96
NUM_BATCHES = 12


def memory_for(examples):
    """Emulated device memory that holds exactly ``examples`` examples of WORKLOAD."""
    return WORKLOAD.fixed_memory_bytes + examples * ACTIVATION_BYTES


def mlp():
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(B * NUM_BATCHES, 8)).astype(np.float32), rng.normal(size=(B * NUM_BATCHES, 1)).astype(
        np.float32
    )


class TraceCounter:
    """Counts how often Keras' train step is traced (it runs once per replica per trace, never per step)."""

    def __init__(self, model):
        self.calls = 0
        original = model.train_step

        def train_step(batch):
            self.calls += 1
            return original(batch)

        model.train_step = train_step


def reference(initial_weights, epochs):
    model = mlp()
    model.set_weights(initial_weights)
    model.compile(optimizer="adam", loss="mse")
    x, y = data()
    history = model.fit(x, y, batch_size=B, epochs=epochs, shuffle=False, verbose=0)
    return model, history


@pytest.fixture
def fast_emulation(monkeypatch, tmp_path):
    monkeypatch.setenv("HETERO_CS_EMULATION_TARGET_MAKESPAN_MS", "10")
    monkeypatch.setenv("HETERO_CS_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_a_card_whose_memory_drops_mid_fit_recovers_exactly_and_grows_back(fast_emulation, modelled_step_times):
    # Replica 1 fits 40 examples; from its step 6 until its step 14 another process leaves it room for 9. The three
    # devices are alike and report their modelled times (a busy host's noise could skew the calibrated split), so
    # the plan gives replica 1 a third of the batch (~32).
    emulator = Emulator(
        ["T4", f"T4@{memory_for(40)}B", "T4"], workload=WORKLOAD, time_scale=20.0,
        drift=[Drift(replica_id=1, from_step=6, until_step=14, memory_bytes=memory_for(9))],
    )
    # Growth every 2 successful steps, x2, without waiting longer after a failed probe: the test's 24 steps see
    # the cap probe during the drop and come back after it.
    policy = MemoryRecoveryPolicy(grow_after_steps=2, max_grow_after_steps=2, growth_factor=2.0)
    # One step per batch (micro_batches=False): this test is about the retried step and the cap growing back without
    # a retrace; with micro-batches the lowered cap would give replica 1 micro-batches, traced as calls of their own.
    strategy = HeteroCentralStorageStrategy(DEVICES, emulate=emulator, rebalance=False, oom_recovery=policy,
                                            micro_batches=False)
    with strategy.scope():
        model = mlp()
        model.compile(optimizer="adam", loss="mse")
    initial = model.get_weights()
    counter = TraceCounter(model)
    x, y = data()
    history = model.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0)

    ref, ref_history = reference(initial, epochs=2)
    assert int(model.optimizer.iterations) == int(ref.optimizer.iterations) == 2 * NUM_BATCHES
    for got, want in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-5)
    np.testing.assert_allclose(history.history["loss"], ref_history.history["loss"], atol=1e-5)

    recovery = strategy._step_recovery  # noqa: SLF001
    drops = [c for c in strategy.balancer.memory_caps.history if c.reason == "out_of_memory"]
    assert drops and all(c.replica_id == 1 for c in drops)
    assert recovery.max_retries_used <= 3  # recovered within 3 retries of the same batch
    assert min(c.new_cap for c in drops) <= 9  # a cap that fits the drop was reached
    assert strategy.stats.history["oom_recoveries"][-1] == recovery.recoveries >= 1
    # The memory came back at step 14: the cap grew back (8 -> 16 -> 32 -> lifted) to the calibrated cap of 40.
    assert any(c.reason == "grow" for c in strategy.balancer.memory_caps.history)
    assert strategy.balancer.max_batch_sizes[1] == 40
    # Traced once, never per recovery: one call per replica, in the step of the set of every replica (fit traces its
    # step once per set of active replicas it runs; the lowered caps left every card a share).
    assert counter.calls == len(DEVICES)


def test_calibration_finds_the_emulated_cap_and_a_lowered_cap_is_written_back(fast_emulation, modelled_step_times):
    # Three alike devices reporting their modelled times, so the plan gives replica 1 a third of the batch (its
    # cap of 30 binds): the drop to 12 examples certainly makes it run out of memory.
    emulator = Emulator(
        ["T4", f"T4@{memory_for(30)}B", "T4"], workload=WORKLOAD, time_scale=20.0,
        drift=[Drift(replica_id=1, from_step=3, memory_bytes=memory_for(12))],
    )
    strategy = HeteroCentralStorageStrategy(DEVICES, emulate=emulator, rebalance=False, guard=False)
    with strategy.scope():
        model = mlp()
        model.compile(optimizer="adam", loss="mse")
    x, y = data()
    model.fit(x[: 6 * B], y[: 6 * B], batch_size=B, epochs=1, shuffle=False, verbose=0)
    lowered = strategy.balancer.max_batch_sizes[1]
    assert lowered <= 12
    assert strategy.balancer.max_batch_sizes == [None, lowered, None]  # 16 GB hold the whole batch
    assert [p.max_batch_size for p in strategy.calibration.profiles] == [None, lowered, None]  # written back
    (entry,) = fast_emulation.glob("*.json")
    stored = json.loads(entry.read_text())
    text = json.dumps(stored)
    assert f'"max_batch_size": {lowered}' in text
    # The search found the emulated cap as it would a GPU's: before the drop, 30 examples fit and 31 do not.
    assert strategy.balancer.memory_caps.history[0].old_cap == 30


def test_an_eager_step_that_runs_out_of_memory_is_recovered_too(fast_emulation, modelled_step_times):
    """Regression: with run_eagerly=True an emulated device's error arrives as itself (a MemoryError), not as a
    TensorFlow error, and recovery let it end fit."""
    emulator = Emulator(["T4", f"T4@{memory_for(40)}B", "T4"], workload=WORKLOAD, time_scale=20.0,
                        drift=[Drift(replica_id=1, from_step=2, memory_bytes=memory_for(9))])
    strategy = HeteroCentralStorageStrategy(DEVICES, emulate=emulator, batch_split=[1, 1, 1], oom_recovery=True)
    with strategy.scope():
        model = mlp()
        model.compile(optimizer="adam", loss="mse", run_eagerly=True)
    initial = model.get_weights()
    x, y = data()
    model.fit(x[:4 * B], y[:4 * B], batch_size=B, epochs=1, shuffle=False, verbose=0)
    ref = mlp()
    ref.set_weights(initial)
    ref.compile(optimizer="adam", loss="mse")
    ref.fit(x[:4 * B], y[:4 * B], batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert strategy._step_recovery.recoveries >= 1  # noqa: SLF001
    for got, want in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_out_of_memory_on_every_retry_raises_a_clear_error_and_changes_nothing(fast_emulation):
    # With micro-batches off: the retries run out and fit ends (with them on, the step goes on in sub-steps, cut
    # finer until the T4's cap falls to 0: test_micro_batches).
    emulator = Emulator(
        ["A10", "T4", "P100"], workload=WORKLOAD, time_scale=20.0,
        drift=[Drift(replica_id=1, from_step=2, memory_bytes=WORKLOAD.fixed_memory_bytes)],  # not one example
    )
    strategy = HeteroCentralStorageStrategy(
        DEVICES, emulate=emulator, auto_balance=False, oom_recovery=MemoryRecoveryPolicy(max_retries=2),
        micro_batches=False,
    )
    with strategy.scope():
        model = mlp()
        model.compile(optimizer="adam", loss="mse")
    x, y = data()
    model.fit(x[: 2 * B], y[: 2 * B], batch_size=B, epochs=1, shuffle=False, verbose=0)  # replica steps 0, 1
    before = [v.numpy() for v in [*model.variables, *model.optimizer.variables]]
    with pytest.raises(StepOOMError, match=r"replica 1 \(/device:CPU:2\).*still ran out of memory after 2 retries.*"
                       r"caps_tried=\[32, 16, 8\].*Free that device's memory") as info:
        model.fit(x[: 2 * B], y[: 2 * B], batch_size=B, epochs=1, shuffle=False, verbose=0)
    error = info.value
    assert isinstance(error, MemoryError)
    assert (error.replica_id, error.device, error.caps_tried, error.global_batch_size) == (
        1, "/device:CPU:2", (32, 16, 8), B)
    assert isinstance(error.__cause__, tf.errors.ResourceExhaustedError)
    after = [v.numpy() for v in [*model.variables, *model.optimizer.variables]]
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)


def test_oom_recovery_false_lets_the_error_end_fit(fast_emulation):
    emulator = Emulator(["A10", f"T4@{memory_for(10)}B"], workload=WORKLOAD, time_scale=20.0)
    strategy = HeteroCentralStorageStrategy(DEVICES[:2], emulate=emulator, auto_balance=False, oom_recovery=False)
    with strategy.scope():
        model = mlp()
        model.compile(optimizer="adam", loss="mse")
    x, y = data()
    with pytest.raises(Exception, match="Emulated out of memory: replica=1") as info:
        model.fit(x[:B], y[:B], batch_size=B, epochs=1, verbose=0)
    assert "ResourceExhausted" in type(info.value.__cause__ or info.value).__name__ or "ResourceExhausted" in str(
        info.value)
    assert int(model.optimizer.iterations) == 0


def test_failed_replica_reads_the_emulated_message_and_tensorflow_node_names():
    from hetero_cs.devices.device_errors import blamed_replica

    def error(message):
        return tf.errors.ResourceExhaustedError(None, None, message)

    assert blamed_replica(error("MemoryError: Emulated out of memory: replica=2 (T4) needs 5 bytes"), DEVICES)[0] == 2
    assert blamed_replica(error("OOM allocating\n\t [[{{node replica_1/sequential/dense/MatMul}}]]"), DEVICES)[0] == 1
    # An op without prefix is replica 0's only when known to be a replica's op (here: the model's forward pass);
    # the optimizer's update on the parameter device carries no prefix either. More in test_oom_errors.py.
    unprefixed = error("OOM when allocating\n\t [[{{node sequential/dense/MatMul}}]]")
    assert blamed_replica(unprefixed, DEVICES)[0] is None
    assert blamed_replica(unprefixed, DEVICES, replica_scopes=("sequential",))[0] == 0
    assert blamed_replica(error("OOM\n\t [[{{node IteratorGetNext}}]]"), DEVICES)[0] is None  # the input pipeline
    assert blamed_replica(error("OOM\n\t [[{{node replica_7/x}}]]"), DEVICES)[0] is None  # not one of ours
    assert blamed_replica(error("OOM, no op named"), DEVICES)[0] is None


def test_steps_per_execution_above_one_and_validation_keep_keras_path_and_stay_exact(fast_emulation):
    strategy = HeteroCentralStorageStrategy(DEVICES, batch_split=[2, 1, 1], profile_cache=False)
    with strategy.scope():
        model = mlp()
        model.compile(optimizer="adam", loss="mse", steps_per_execution=2)
    initial = model.get_weights()
    x, y = data()
    history = model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0, validation_data=(x[:B], y[:B]))
    ref, _ = reference(initial, epochs=1)
    for got, want in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-5)
    assert "val_loss" in history.history and int(model.optimizer.iterations) == NUM_BATCHES


@pytest.mark.slow
def test_fifty_recoveries_lose_nothing_and_never_retrace(fast_emulation, tmp_path):
    from benchmarks import oom_recovery

    out = tmp_path / "oom.json"
    assert oom_recovery.main(["--recoveries", "50", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["recoveries"] >= 50 and result["examples_lost"] == 0
    assert result["max_weight_diff_vs_single_device"] < 1e-5
    assert result["retraces"] == 0 and result["max_retries_per_batch"] <= 3


def test_emulate_names_may_carry_memory_overrides():
    strategy = HeteroCentralStorageStrategy(DEVICES, emulate=["A10", "T4@48MB", "p100@1GiB"], profile_cache=False)
    assert [s.memory_bytes for s in strategy.emulator.specs] == [24 * 10**9, 48_000_000, 2**30]
    assert [s.name for s in strategy.emulator.specs] == ["A10", "T4@48MB", "P100@1GiB"]  # banners show it


def test_estimate_workload_counts_the_model_memory():
    from hetero_cs.emulation import estimate_workload

    model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(256, activation="relu"),
                              keras.layers.BatchNormalization(), keras.layers.Dense(10)])
    model.compile(optimizer="adam", loss="mse")
    before = estimate_workload(model)
    assert before.optimizer_bytes == 0  # the optimizer is not built yet
    model.optimizer.build(model.trainable_variables)
    workload = estimate_workload(model)
    trainable = 4 * (784 * 256 + 256 + 2 * 256 + 256 * 10 + 10)
    assert workload.parameter_bytes == trainable
    assert workload.non_trainable_bytes == 4 * 2 * 256  # the moving mean and variance
    assert workload.optimizer_bytes >= 2 * trainable  # Adam's two slots per weight (+ its counters)
    assert workload.activation_bytes_per_example == 4 * (784 + 256 + 256 + 10)  # input, Dense, BN, Dense
    assert workload.flops_per_example == 2 * 784 * 256 + 2 * 256 * 10


def test_by_default_the_batch_is_kept_in_hand_only_where_a_step_can_run_out_of_memory():
    # Keeping the batch for a retry costs host time every step, so the default arms recovery only where an
    # out-of-memory error is possible.
    from hetero_cs.engine.memory.oom_recovery import _out_of_memory_possible

    roomy = Emulator(["A10", "T4", "P100"], workload=WORKLOAD, time_scale=20.0)
    small = Emulator(["A10", f"T4@{memory_for(40)}B", "P100"], workload=WORKLOAD, time_scale=20.0)
    drops = Emulator(["A10", "T4", "P100"], workload=WORKLOAD, time_scale=20.0,
                     drift=[Drift(replica_id=2, from_step=50, memory_bytes=memory_for(10))])
    assert not _out_of_memory_possible(DEVICES, None, B)  # plain CPU devices: the host's memory
    assert _out_of_memory_possible(["/device:GPU:0", "/device:GPU:1"], None, B)
    assert not _out_of_memory_possible(DEVICES, roomy, B)  # 16-24 GB hold the whole batch
    assert _out_of_memory_possible(DEVICES, small, B) and not _out_of_memory_possible(DEVICES, small, 40)
    assert _out_of_memory_possible(DEVICES, drops, B)  # the drift's limit counts before it starts
    assert _out_of_memory_possible(DEVICES, roomy, None)  # size not known yet: armed


@pytest.mark.parametrize("oom_recovery, armed", [(None, False), (True, True)])
def test_plain_cpu_devices_read_the_batch_in_the_graph_unless_recovery_is_asked_for(oom_recovery, armed):
    strategy = HeteroCentralStorageStrategy(DEVICES, batch_split=[2, 1, 1], profile_cache=False,
                                            oom_recovery=oom_recovery)
    with strategy.scope():
        model = mlp()
        model.compile(optimizer="adam", loss="mse")
    x, y = data()
    model.fit(x[: 2 * B], y[: 2 * B], batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert strategy._step_recovery.armed() is armed  # noqa: SLF001


def inference_memory_for(examples):
    """Emulated device memory that holds exactly ``examples`` examples of WORKLOAD in an inference step."""
    return WORKLOAD.parameter_bytes + WORKLOAD.non_trainable_bytes + examples * ACTIVATION_BYTES


@pytest.mark.parametrize("kind", ["evaluate", "predict"])
def test_evaluate_and_predict_that_run_out_of_memory_lower_the_cap_and_run_the_batch_again(
        kind, fast_emulation, caplog):
    # Replica 1 holds 20 examples in an inference step; the even split gives it 32 of 96.
    caplog.set_level("WARNING", logger="hetero_cs.engine.central_storage")
    emulator = Emulator(["T4", f"T4@{inference_memory_for(20)}B", "T4"], workload=WORKLOAD, time_scale=1.0)
    strategy = HeteroCentralStorageStrategy(DEVICES, emulate=emulator, batch_split=[1, 1, 1])
    with strategy.scope():
        model = mlp()
        model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    single = mlp()
    single.set_weights(model.get_weights())
    single.compile(optimizer="adam", loss="mse", metrics=["mae"])
    x, y = data()
    if kind == "evaluate":
        got, want = (m.evaluate(x, y, batch_size=B, verbose=0) for m in (model, single))
    else:
        got, want = (m.predict(x, batch_size=B, verbose=0) for m in (model, single))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)  # every example counted once
    assert strategy._step_recovery.recoveries >= 1  # noqa: SLF001
    assert 0 < strategy.balancer.max_batch_sizes[1] <= 20
    assert any("in an evaluation or prediction step" in r.getMessage() for r in caplog.records)


def test_evaluate_out_of_memory_without_recovery_is_the_librarys_error_not_tensorflows(fast_emulation):
    from hetero_cs import ReplicaStepError

    emulator = Emulator(["T4", f"T4@{inference_memory_for(20)}B", "T4"], workload=WORKLOAD, time_scale=1.0)
    strategy = HeteroCentralStorageStrategy(DEVICES, emulate=emulator, batch_split=[1, 1, 1], oom_recovery=False)
    with strategy.scope():
        model = mlp()
        model.compile(optimizer="adam", loss="mse")
    x, y = data()
    with pytest.raises(ReplicaStepError, match=r"The evaluation step failed in replica 1") as info:
        model.evaluate(x, y, batch_size=B, verbose=0)
    assert isinstance(info.value.__cause__, tf.errors.ResourceExhaustedError)
