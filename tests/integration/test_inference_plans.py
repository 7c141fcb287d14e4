"""Evaluation and prediction batches are cut by plans of their own, which leave training's plan lifecycle alone."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from hetero_cs import HeteroCentralStorageStrategy, LinearCostModel

DEVICES = ["/cpu:1", "/cpu:2", "/cpu:3"]


def data(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 8)).astype(np.float32), rng.integers(0, 3, size=n).astype(np.int32)


def compiled(strategy):
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_a_validation_batch_larger_than_the_training_batch_does_not_become_the_plan():
    """Regression: fit(train.batch(48), validation_data=val.batch(192)) made 192 the reference size, so the training
    plan shown and logged after the first validation pass was the validation batch's, and training batches were cut
    as partial batches."""
    strategy = HeteroCentralStorageStrategy(DEVICES, batch_split=[2, 1, 1], profile_cache=False)
    model = compiled(strategy)
    x, y = data(192)
    vx, vy = data(384, seed=1)
    train = tf.data.Dataset.from_tensor_slices((x, y)).batch(48)
    validation = tf.data.Dataset.from_tensor_slices((vx, vy)).batch(192)
    history = model.fit(train, validation_data=validation, epochs=2, verbose=0)
    assert strategy.plan.per_replica_batch_sizes == (24, 12, 12)
    assert strategy.balancer.reference_batch_size == 48
    assert [strategy.stats.history[f"replica_{i}_batch_size"][-1] for i in range(3)] == [24.0, 12.0, 12.0]
    model.evaluate(validation, verbose=0)  # standalone, after fit: the same
    model.predict(vx, batch_size=192, verbose=0)
    assert strategy.plan.per_replica_batch_sizes == (24, 12, 12)


def test_evaluate_and_predict_split_a_batch_the_training_memory_caps_cannot_hold():
    """Regression: an inference batch above the sum of the training caps raised InfeasiblePlanError."""
    strategy = HeteroCentralStorageStrategy(DEVICES, profile_cache=False, rebalance=False, guard=False)
    model = compiled(strategy)
    models = [LinearCostModel(1e-3, 1e-4), LinearCostModel(1e-3, 2e-4), LinearCostModel(1e-3, 2e-4)]
    strategy.set_cost_models(models, max_batch_sizes=[16, 16, 16])
    x, y = data(192)
    loss = model.evaluate(x, y, batch_size=96, verbose=0)
    logits = model.predict(x, batch_size=96, verbose=0)
    expected_logits = model(x, training=False).numpy()
    np.testing.assert_allclose(logits, expected_logits, rtol=1e-5, atol=1e-6)
    expected_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y, expected_logits)
    assert loss == pytest.approx(float(expected_loss), rel=1e-5)
    assert sum(strategy.plan_for(48).per_replica_batch_sizes) == 48  # training batches still within the caps
    assert max(strategy.plan_for(48).per_replica_batch_sizes) <= 16


def test_an_emulated_device_holds_an_evaluation_slice_its_training_step_could_not():
    """An inference step keeps no gradients or optimizer variables: the emulated memory check knows the step."""
    from hetero_cs.emulation import Emulator, Workload

    workload = Workload(1e3, parameter_bytes=1_000, optimizer_bytes=2_000, activation_bytes_per_example=100,
                        non_trainable_bytes=500)
    emulator = Emulator(["T4@6000B"] * 3, workload=workload, time_scale=1e-6)  # training holds 15, inference 45
    strategy = HeteroCentralStorageStrategy(DEVICES, emulate=emulator, auto_balance=False, profile_cache=False)
    model = compiled(strategy)
    x, y = data(96)
    logits = model.predict(x, batch_size=96, verbose=0)  # 32 examples a replica
    np.testing.assert_allclose(logits, model(x, training=False).numpy(), rtol=1e-5, atol=1e-6)
    with pytest.raises(tf.errors.ResourceExhaustedError, match="Emulated out of memory"):
        model.train_on_batch(x[:48], y[:48])  # 48 examples on every replica: more than a training step holds
