"""The guard and sampled timing inside model.fit (TensorFlow on logical CPU devices).

What the guard decides follows from step times. A busy host adds its scheduling delays to every measured step
(enough to hide a 30 % gain, or to keep a trial from deciding within a short fit), so these tests feed the library
deterministic step times: the emulated devices' modelled times (the ``modelled_step_times`` fixture) or a fixed
time. Everything else - the trial's serving pattern, pairing each step's reports, the decision, the plan switch
and the logged keys - runs for real inside ``model.fit``. The same keep on the host's clock is a ``slow`` test.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from hetero_cs import HeteroCentralStorageStrategy, LinearCostModel
from hetero_cs.emulation import Emulator, Workload

DEVICES = ["/cpu:1", "/cpu:2", "/cpu:3"]
B = 96
STEP_S = 0.004  # the fixed step time the sampled-timing test reports


def mlp():
    return keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(4)])


def data(n=B * 8, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 16)).astype(np.float32)
    return x, rng.integers(0, 4, size=n).astype(np.int32)


def compiled(strategy):
    with strategy.scope():
        model = mlp()
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_sampled_timing_keeps_replicas_paired_and_times_fewer_steps(monkeypatch):
    """Steps of a few ms: timing every step would cost more than 1 %, so it is sampled.

    Every report says 4 ms (real CPU steps are a few ms on a quiet host, but a busy one can stretch a step past
    the 60 ms at which every step would be timed), so how often steps are timed does not depend on the host.
    """
    from hetero_cs.planning.sampling import MAX_TIMING_INTERVAL_STEPS, TIMING_COST_S, interval_steps

    monkeypatch.delenv("HETERO_CS_TIMING", raising=False)
    monkeypatch.setattr(HeteroCentralStorageStrategy, "_record_step_time",
                        lambda self, replica_id, batch_size, _measured_s, **key: self.balancer.record_step_time(
                            int(replica_id), int(batch_size), STEP_S, **key))
    monkeypatch.setattr(HeteroCentralStorageStrategy, "_record_step_end", lambda *args: None)  # no measured tail
    strategy = HeteroCentralStorageStrategy(DEVICES, auto_balance=True, rebalance=True, profile_cache=False)
    model = compiled(strategy)
    x, y = data()
    strategy.calibrate(model, (x[:B], y[:B]), progress=False)  # fit does not calibrate again (nor start a trial)
    # Alike, and as fast as the reports say (so the plan measures as predicted, and no check against one card
    # alone starts a trial): the even split at once, no trial.
    strategy.set_cost_models([LinearCostModel(STEP_S - 32e-5, 1e-5)] * 3)
    assert strategy.plan_for(B).per_replica_batch_sizes == (32, 32, 32) and not strategy.balancer.guard.in_trial
    steps = 120
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(B, drop_remainder=True).repeat()
    model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0)
    monitor = strategy.monitor
    interval = strategy.balancer.timing_interval_steps()
    assert interval == interval_steps(TIMING_COST_S, STEP_S, MAX_TIMING_INTERVAL_STEPS) > 1
    assert 0 < monitor.completed_steps < steps  # some steps timed, not all
    assert monitor.completed_steps <= steps // 2  # after the re-planner's first samples, one step in `interval`
    for sample in monitor.window():  # a mis-paired step would mix slices of different steps
        assert sum(sample.per_replica_batch_sizes) == B


def test_emulated_devices_time_sampled_steps_only_and_wait_out_every_step(monkeypatch):
    """As on real devices, only sampled steps are timed; every step still waits out its emulated devices' time
    (their step counters say so). Every report says 4 ms, as in the test above."""
    monkeypatch.delenv("HETERO_CS_TIMING", raising=False)
    monkeypatch.setattr(HeteroCentralStorageStrategy, "_record_step_time",
                        lambda self, replica_id, batch_size, _measured_s, **key: self.balancer.record_step_time(
                            int(replica_id), int(batch_size), STEP_S, **key))
    monkeypatch.setattr(HeteroCentralStorageStrategy, "_record_step_end", lambda *args: None)
    emulator = Emulator(["T4", "T4", "T4"], workload=Workload(flops_per_example=2e6, parameter_bytes=4_000))
    emulator.fix_time_scale(emulator.calibrate_time_scale(B, target_makespan_s=STEP_S), "the test's scale")
    strategy = HeteroCentralStorageStrategy(DEVICES, emulate=emulator, auto_balance=True, rebalance=True,
                                            profile_cache=False)
    model = compiled(strategy)
    x, y = data()
    strategy.calibrate(model, (x[:B], y[:B]), progress=False)
    strategy.set_cost_models([LinearCostModel(STEP_S - 32e-5, 1e-5)] * 3)
    assert strategy.plan_for(B).per_replica_batch_sizes == (32, 32, 32) and not strategy.balancer.guard.in_trial
    steps, before = 120, emulator.steps_done
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(B, drop_remainder=True).repeat()
    model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0)
    assert [done - was for done, was in zip(emulator.steps_done, before)] == [steps] * 3  # every step waited
    assert 0 < strategy.monitor.completed_steps <= steps // 2  # some steps timed, not all
    for sample in strategy.monitor.window():
        assert sum(sample.per_replica_batch_sizes) == B


def modelled_ratio(emulator, decision):
    """candidate / incumbent makespan as the emulated devices model them (what modelled_step_times reports)."""
    def makespan_s(sizes):
        return max(emulator.step_time_s(i, b, step=0) for i, b in enumerate(sizes))

    return makespan_s(decision.candidate_per_replica_batch_sizes) / makespan_s(
        decision.incumbent_per_replica_batch_sizes)


def lying_emulator():
    emulator = Emulator(["T4", "T4", "T4"], workload=Workload(flops_per_example=2e9, parameter_bytes=4_000_000))
    emulator.calibrate_time_scale(B, target_makespan_s=0.03)
    return emulator


def test_guard_reverts_a_plan_that_measures_slower_in_fit(caplog, modelled_step_times):
    """The cost models claim replica 0 is 4x faster; the (emulated) devices are alike, so the plan is reverted."""
    strategy = HeteroCentralStorageStrategy(DEVICES, emulate=lying_emulator(), profile_cache=False, rebalance=False)
    model = compiled(strategy)
    x, y = data()
    strategy.calibrate(model, (x[:B], y[:B]), progress=False)  # sizes the emulated devices for the model
    lie = [LinearCostModel(0.001, 0.25e-3), LinearCostModel(0.001, 1e-3), LinearCostModel(0.001, 1e-3)]
    strategy.balancer.set_cost_models(lie, trial=True, reference_batch_size=B)
    assert strategy.balancer.guard.in_trial and strategy.plan.per_replica_batch_sizes == (32, 32, 32)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(B, drop_remainder=True).repeat()
    with caplog.at_level("INFO", logger="hetero_cs"):
        history = model.fit(dataset, epochs=8, steps_per_epoch=3, verbose=0)  # no decision in the first epoch
    decision = strategy.balancer.last_guard_decision
    assert decision is not None and decision.outcome == "reverted"
    assert decision.median_ratio == pytest.approx(modelled_ratio(strategy.emulator, decision))  # ~2: 64 vs 32 on a T4
    assert strategy.plan.per_replica_batch_sizes == (32, 32, 32)
    stats = strategy.stats.history
    assert stats["guard_kept"][-1] == 0.0 and stats["guard_reverts"][-1] == 1.0
    # Every key is recorded every epoch (NaN before the first decision), so the lists line up with the epochs.
    assert {key: len(values) for key, values in stats.items()} == {key: 8 for key in stats}
    assert {key: len(values) for key, values in history.history.items()} == {key: 8 for key in history.history}
    assert [stats[f"replica_{i}_batch_size"][-1] for i in range(3)] == [32.0, 32.0, 32.0]
    assert any("guard: reverted" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("clock", [
    "modelled",
    # On the host's clock: the decision depends on how busy the host is (a trial may not decide in 24 steps).
    pytest.param("measured", marks=pytest.mark.slow),
])
def test_guard_keeps_a_plan_that_measures_faster_in_fit(request, clock):
    if clock == "modelled":
        request.getfixturevalue("modelled_step_times")
    emulator = Emulator(["A10", "T4", "P100"], workload=Workload(flops_per_example=2e9, parameter_bytes=4_000_000))
    emulator.calibrate_time_scale(B, target_makespan_s=0.03)
    strategy = HeteroCentralStorageStrategy(DEVICES, emulate=emulator, profile_cache=False, rebalance=False)
    model = compiled(strategy)
    x, y = data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(B, drop_remainder=True).repeat()
    history = model.fit(dataset, epochs=2, steps_per_epoch=12, verbose=0)  # calibrates, then tries the plan
    decision = strategy.balancer.last_guard_decision
    assert decision is not None and decision.kept
    assert strategy.plan.per_replica_batch_sizes == decision.candidate_per_replica_batch_sizes
    assert strategy.plan.per_replica_batch_sizes[0] > strategy.plan.per_replica_batch_sizes[1]
    assert strategy.stats.history["guard_kept"][-1] == 1.0 and strategy.stats.history["guard_in_trial"][-1] == 0.0
    if clock == "modelled":  # the emulated A10 takes about half the batch: clearly faster in every pair
        assert decision.median_ratio == pytest.approx(modelled_ratio(emulator, decision))
        assert decision.median_ratio < 1 - strategy.balancer.guard.policy.early_gain
        assert decision.num_pairs == strategy.balancer.guard.policy.min_pairs


def test_guard_false_uses_the_calibrated_plan_at_once(modelled_step_times):
    emulator = Emulator(["A10", "T4", "P100"], workload=Workload(flops_per_example=2e9, parameter_bytes=4_000_000))
    emulator.calibrate_time_scale(B, target_makespan_s=0.03)
    strategy = HeteroCentralStorageStrategy(DEVICES, emulate=emulator, profile_cache=False, rebalance=False,
                                            guard=False)
    model = compiled(strategy)
    x, y = data()
    strategy.calibrate(model, (x[:B], y[:B]), progress=False)
    assert strategy.plan.per_replica_batch_sizes[0] > strategy.plan.per_replica_batch_sizes[1]
    assert strategy.balancer.last_guard_decision is None and not strategy.balancer.guard.in_trial


def test_guard_keys_stay_in_every_epoch_after_a_batch_split_is_set_in_training():
    strategy = HeteroCentralStorageStrategy(DEVICES, emulate=["A10", "T4", "P100"], profile_cache=False,
                                            rebalance=False)
    model = compiled(strategy)
    x, y = data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(B, drop_remainder=True).repeat()

    class FixTheSplit(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                strategy.set_batch_split([2, 1, 1])  # the guard is off from here

    history = model.fit(dataset, epochs=3, steps_per_epoch=4, verbose=0, callbacks=[FixTheSplit()])
    for key in ("guard_kept", "guard_in_trial", "guard_reverts"):
        values = strategy.stats.history[key]
        assert len(values) == 3, (key, values)
        assert key == "guard_kept" or np.isfinite(values[0]), (key, values)  # guard_kept: NaN until a decision
        assert np.isnan(values[1:]).all(), (key, values)  # NaN once the guard is off: History stays aligned
    assert strategy.plan.per_replica_batch_sizes == (48, 24, 24)


def test_a_guard_policy_turns_the_guard_on_with_its_own_thresholds():
    from hetero_cs import GuardPolicy

    policy = GuardPolicy(alone_check_margin=0.1, min_pairs=4)
    strategy = HeteroCentralStorageStrategy(DEVICES, profile_cache=False, guard=policy)
    assert strategy.balancer.guard_enabled and strategy.balancer.guard.policy is policy
    assert not HeteroCentralStorageStrategy(DEVICES, profile_cache=False, guard=False).balancer.guard_enabled
