"""A global batch smaller than the replica count trains with the defaults (auto_balance and re-balancing on)."""

import warnings

import keras
import numpy as np
import pytest

from hetero_cs import HeteroCentralStorageStrategy
from hetero_cs.planning.rebalance import REPLANNED, RebalancePolicy


@pytest.fixture
def fast_emulation(monkeypatch, tmp_path):
    monkeypatch.setenv("HETERO_CS_EMULATION_TARGET_MAKESPAN_MS", "20")
    monkeypatch.setenv("HETERO_CS_CACHE_DIR", str(tmp_path))


@pytest.mark.parametrize("global_batch_size", [1, 2])
def test_regression_fit_with_a_global_batch_smaller_than_the_replica_count(fast_emulation, global_batch_size):
    # B < R: every plan leaves a replica idle. The re-planner solved with min_batch_size=1 and raised
    # InfeasiblePlanError after a few steps, with advice fit cannot follow.
    # The defaults (auto_balance, rebalance), with the guard off: whether a guard trial keeps or reverts a plan
    # depends on measured times, and on a busy host a revert's back-off can keep the re-planner from looking at all
    # during this short fit; the regression is about the re-planner itself.
    strategy = HeteroCentralStorageStrategy(emulate=["A10", "T4", "P100"], guard=False)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(24 * global_batch_size, 8)).astype(np.float32)
    y = rng.integers(0, 3, size=len(x)).astype(np.int64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(x, y, batch_size=global_batch_size, epochs=3, shuffle=False, verbose=0)
    # Calibration solved a plan for B < R too (it warned "no plan fits" and kept none).
    assert not [w for w in caught if "no plan fits" in str(w.message)], [str(w.message) for w in caught]
    assert strategy.calibration.plan is not None and strategy.calibration.plan.global_batch_size == global_batch_size

    assert len(history.history["loss"]) == 3 and np.all(np.isfinite(history.history["loss"]))
    assert strategy.plan.global_batch_size == global_batch_size
    assert strategy.balancer.rebalancer.last_decision is not None  # the re-planner looked, more than once
    # A full window of timed steps (sampled, as on real devices: while deciding every step, then one in N).
    assert strategy.monitor.completed_steps >= RebalancePolicy().min_samples
    for decision in strategy.balancer.rebalancer.switches:
        assert decision.outcome == REPLANNED and sum(decision.new_per_replica_batch_sizes) == global_batch_size
