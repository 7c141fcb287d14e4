"""Online re-balancing on emulated devices: work moves off a device that slows down, and back when it recovers.

The tests about decisions (re-plans, guard trials) take the emulated devices' modelled step times
(``modelled_step_times``): measured on a busy host, scheduling delays could hide the drift or fake one.
"""

import itertools
import os
import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

import hetero_cs
from hetero_cs import HeteroCentralStorageStrategy
from hetero_cs.emulation import Drift, Emulator, Workload
from keras.src.backend import in_stateless_scope  # (the probes of idle cards run in Keras' stateless scope)

DEVICES = ["/cpu:1", "/cpu:2", "/cpu:3"]


def mlp():
    return keras.Sequential(
        [keras.Input((32,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)]
    )


class PlanRecorder(keras.callbacks.Callback):
    def __init__(self, strategy):
        super().__init__()
        self.strategy = strategy
        self.plans = []

    def on_epoch_end(self, epoch, logs=None):
        self.plans.append(self.strategy.plan.per_replica_batch_sizes)


@pytest.fixture
def fast_emulation(monkeypatch, tmp_path):
    monkeypatch.setenv("HETERO_CS_EMULATION_TARGET_MAKESPAN_MS", "40")
    monkeypatch.setenv("HETERO_CS_CACHE_DIR", str(tmp_path))


def train(strategy, epochs, steps_per_epoch, callbacks=()):
    with strategy.scope():
        model = mlp()
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 32)).astype(np.float32)
    y = rng.integers(0, 10, size=512).astype(np.int32)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(128, drop_remainder=True).repeat()
    return model.fit(
        dataset, epochs=epochs, steps_per_epoch=steps_per_epoch, verbose=0, callbacks=list(callbacks)
    )


def compute_bound_emulator(drift):
    """Emulated devices for a model with a lot of compute per example, so device speeds differ clearly.

    The tiny test MLP itself would be launch-bound on real GPUs, leaving the devices almost alike. The A10 runs at
    its fp32 rate (TF32 off): 3x slower, it is then about as fast as the T4 and the P100.
    """
    emulator = Emulator(
        ["A10", "T4", "P100"], workload=Workload(flops_per_example=2e9, parameter_bytes=4_000_000,
                                                 tensor_float_32=False), drift=drift
    )
    emulator.calibrate_time_scale(128, target_makespan_s=0.04)
    return emulator


def test_plan_moves_work_off_a_slowed_device_and_back(fast_emulation, modelled_step_times):
    # The A10 (replica 0) carries most of the batch; it runs 3x slower for steps [40, 100).
    emulator = compute_bound_emulator([Drift(replica_id=0, factor=3.0, from_step=40, until_step=100)])
    strategy = HeteroCentralStorageStrategy(DEVICES, emulate=emulator)
    recorder = PlanRecorder(strategy)
    train(strategy, epochs=16, steps_per_epoch=10, callbacks=[recorder])
    before, during, after = recorder.plans[3][0], recorder.plans[9][0], recorder.plans[-1][0]
    assert during < 0.8 * before, recorder.plans
    assert after > 1.2 * during, recorder.plans


def test_rebalance_false_freezes_the_plan(fast_emulation, modelled_step_times):
    emulator = compute_bound_emulator([Drift(replica_id=0, factor=3.0, from_step=5)])
    strategy = HeteroCentralStorageStrategy(DEVICES, emulate=emulator, rebalance=False)
    recorder = PlanRecorder(strategy)
    train(strategy, epochs=4, steps_per_epoch=10, callbacks=[recorder])
    assert len(set(recorder.plans)) == 1


def test_fit_logs_and_tensorboard_show_replica_timing_and_plan(fast_emulation, tmp_path):
    strategy = HeteroCentralStorageStrategy(DEVICES, emulate=["A10", "T4", "P100"])
    log_dir = tmp_path / "tb"
    history = train(strategy, epochs=2, steps_per_epoch=6, callbacks=[keras.callbacks.TensorBoard(str(log_dir))])
    # Two figures join Keras' logs (the progress bar, History); the rest go to strategy.stats and TensorBoard.
    logs = history.history
    assert {key for key in logs if key not in ("loss", "accuracy")} == {"straggler_wait_ms", "makespan_ms"}, logs
    stats = strategy.stats.history
    assert stats["makespan_ms"] == logs["makespan_ms"] and len(stats["replica_0_step_ms"]) == 2
    # Some card was timed in the last epoch, and the makespan is the slowest card's. Which cards: the plan decides
    # from measured times (the guard may serve the A10 alone for an epoch), so no one card is named here.
    timed = [stats[f"replica_{i}_step_ms"][-1] for i in range(3)]
    assert stats["makespan_ms"][-1] >= max(timed) > 0, (stats["makespan_ms"], timed)
    assert stats["replica_0_batch_size"][-1] == strategy.plan.per_replica_batch_sizes[0]
    tags = set()
    for root, _, files in os.walk(log_dir):
        for name in files:
            for event in tf.compat.v1.train.summary_iterator(os.path.join(root, name)):
                tags.update(value.tag for value in event.summary.value)
    assert {"epoch_straggler_wait_ms", "epoch_replica_0_step_ms"} <= tags, sorted(tags)


def test_log_everything_puts_every_figure_in_the_logs_as_before(fast_emulation):
    strategy = HeteroCentralStorageStrategy(DEVICES, emulate=["A10", "T4", "P100"])
    history = train(strategy, epochs=1, steps_per_epoch=3,
                    callbacks=[hetero_cs.BalanceCallback(strategy, log_everything=True)])
    assert {"replica_0_step_ms", "replica_2_batch_size", "guard_in_trial", "makespan_ms"} <= set(history.history)
    assert strategy.stats.history["replica_2_batch_size"] == history.history["replica_2_batch_size"]
    with pytest.raises(hetero_cs.ConfigError, match="log_everything must be True or False"):
        hetero_cs.BalanceCallback(strategy, log_everything="yes")


class TraceCounter(keras.layers.Layer):
    """Passes its input through; counts the times a train step traces its call (Python runs only while a step is
    traced). An idle card's probe step, which runs beside training and changes no variable (Keras' stateless scope),
    is not counted: it is traced once per card, never again."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.tally = itertools.count()

    @property
    def traces(self):
        return _peek(self.tally)

    def call(self, x):
        if not in_stateless_scope():
            next(self.tally)
        return x


def _peek(counter):
    return int(repr(counter)[6:-1])  # itertools.count's repr is "count(N)": its next value, taken without a step


@pytest.mark.slow  # about 20 s: a fit of 140 steps, a quarter of them on cards 20x slower
def test_a_long_fit_with_re_planning_and_probes_traces_its_step_once_per_new_set(monkeypatch, tmp_path,
                                                                                modelled_step_times):
    # The T4 and the P100 run 20x slower in steps [10, 100): the plan leaves both out (the set {0}), and both are
    # probed with one example every 10 steps here (every 40 by default). Before, each card was probed on its own
    # (the sets {0, 1} and {0, 2}), and only the 2 most recently used sets kept a branch, so every probe traced the
    # train step again (10 retraces here; 43 in 900 steps of the main job, memory growing with each).
    from hetero_cs.planning import balancer_plans

    monkeypatch.setattr(balancer_plans, "PROBE_INTERVAL_STEPS", 10)
    monkeypatch.setenv("HETERO_CS_EMULATION_TARGET_MAKESPAN_MS", "10")
    monkeypatch.setenv("HETERO_CS_CACHE_DIR", str(tmp_path))
    drift = [Drift(replica_id=i, factor=20.0, from_step=10, until_step=100) for i in (1, 2)]
    strategy = HeteroCentralStorageStrategy(DEVICES, emulate=Emulator(
        ["A10", "T4", "P100"], workload=Workload(flops_per_example=2e9, parameter_bytes=20_000_000), drift=drift))
    with strategy.scope():
        counter = TraceCounter()
        model = keras.Sequential([keras.Input((32,)), counter, keras.layers.Dense(10)])
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(128, 32)).astype(np.float32), rng.integers(0, 10, size=128).astype(np.int32)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(128).repeat()
    traces, plans = [], []

    class Record(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            traces.append(counter.traces)
            plans.append(strategy.plan.per_replica_batch_sizes)

    model.fit(dataset, epochs=14, steps_per_epoch=10, verbose=0, callbacks=[Record()])
    assert (128, 0, 0) in plans[2:9], plans  # both slow cards left out during the drift
    assert strategy.balancer.probes >= 3, strategy.balancer.probes  # (beside training: no step gave them an example)
    retraced = [epoch for epoch in range(1, len(traces)) if traces[epoch] > traces[epoch - 1]]
    # Traced when fit starts, with a branch for the A10 alone (calibration gives it one: the guard may measure it at
    # any time), which the plan that leaves both cards out uses; perhaps once more for a set the recovery meets.
    assert len(retraced) <= 1 and all(epoch < 12 for epoch in retraced), (traces, plans)
    assert (0,) in strategy._active_sets.for_trace(training=True)


def test_idle_cards_are_probed_beside_training_and_the_probes_change_nothing(monkeypatch, tmp_path,
                                                                             modelled_step_times):
    # The T4 runs 20x slower from its step 5 on: the plan leaves it out, and a probe (every 5 served steps here)
    # times it on one example in a step of its own, in another thread. Before, each probe gave it one example in a
    # training step, which then waited for the slow card. Run again with no probe, the same fit ends on the same
    # bits: a probe moves no variable (BatchNormalization statistics, the dropout seed, the optimizer).
    from hetero_cs.planning import balancer_plans

    monkeypatch.setenv("HETERO_CS_EMULATION_TARGET_MAKESPAN_MS", "10")
    monkeypatch.setenv("HETERO_CS_CACHE_DIR", str(tmp_path))
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(128, 32)).astype(np.float32), rng.integers(0, 10, size=128).astype(np.int32)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(128).repeat()

    def run(interval):
        monkeypatch.setattr(balancer_plans, "PROBE_INTERVAL_STEPS", interval)
        strategy = HeteroCentralStorageStrategy(DEVICES, emulate=Emulator(
            ["A10", "T4", "P100"], workload=Workload(flops_per_example=2e9, parameter_bytes=20_000_000),
            drift=[Drift(replica_id=1, factor=20.0, from_step=5)]))
        probes, sizes = [], []
        record_probe = strategy.balancer.record_probe

        def spy(replica_id, batch_size, step_time_s):
            probes.append((replica_id, batch_size, threading.current_thread().name))
            record_probe(replica_id, batch_size, step_time_s)

        strategy.balancer.record_probe = spy
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = keras.Sequential([  # (a weight regularizer: read from the probe's stateless scope)
                keras.Input((32,)), keras.layers.Dense(32, kernel_regularizer="l2"), keras.layers.BatchNormalization(),
                keras.layers.Dropout(0.3), keras.layers.Dense(10, activity_regularizer="l2")])
            model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        steps = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: sizes.append(strategy.monitor.last_step().per_replica_batch_sizes))
        model.fit(dataset, epochs=4, steps_per_epoch=10, verbose=0, callbacks=[steps])
        strategy._idle_probes.wait()  # noqa: SLF001 - the probes still running
        state = [v.numpy() for v in [*model.variables, *model.optimizer.variables]]
        return state, probes, sizes, strategy.balancer.probes

    state, probes, sizes, started = run(5)
    assert (128, 0, 0) != sizes[-1] and sizes[-1][1] == 0, sizes  # the T4 left out
    # Probes due are counted by served steps; how many of them ran depends on the host's speed (a probe still running
    # when the next is due is not started again), so at least the first one, which fit's end waits for.
    assert started >= 3 and 1 <= len(probes) <= started, (probes, started)
    assert {(i, b) for i, b, _ in probes} == {(1, 1)} and all("idle_probe" in name for *_, name in probes), probes
    assert not any(s[1] == 1 for s in sizes), sizes  # no training step gave it an example
    alone_state, no_probes, alone_sizes, _ = run(10**6)
    assert not no_probes and alone_sizes == sizes
    for a, b in zip(state, alone_state):
        np.testing.assert_array_equal(a, b)


def test_a_guard_trial_still_running_when_fit_ends_is_said(fast_emulation, caplog):
    # The quick-start's last guard line was "guard: trying [256, 0, 0] ..." with no verdict after it: fit had ended.
    strategy = HeteroCentralStorageStrategy(DEVICES, emulate=["A10", "T4", "P100"], rebalance=False)
    train(strategy, epochs=1, steps_per_epoch=1)  # calibrated; the plan is in force
    incumbent = strategy.plan
    candidate = hetero_cs.BatchPlan((128, 0, 0), 128) if incumbent.per_replica_batch_sizes[0] != 128 else \
        hetero_cs.BatchPlan((0, 128, 0), 128)
    strategy.balancer.guard.start(incumbent, candidate, step=0)  # two steps below cannot give it a pair
    with caplog.at_level("INFO", logger="hetero_cs.engine.callbacks"):
        train(strategy, epochs=1, steps_per_epoch=2)
    assert strategy.balancer.guard.in_trial
    assert f"the trial of {list(candidate.per_replica_batch_sizes)} had measured 0 of its pairs when fit ended" \
        in caplog.text, caplog.text
