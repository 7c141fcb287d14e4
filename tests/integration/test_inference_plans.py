"""Evaluation and prediction batches are cut by plans of their own, which leave training's plan lifecycle alone."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from hetero_cs import HeteroCentralStorageStrategy, LinearCostModel
from hetero_cs.errors import ReplicaStepError

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
    strategy = HeteroCentralStorageStrategy(DEVICES, emulate=emulator, auto_balance=False, profile_cache=False,
                                            oom_recovery=False)
    model = compiled(strategy)
    x, y = data(96)
    logits = model.predict(x, batch_size=96, verbose=0)  # 32 examples a replica
    np.testing.assert_allclose(logits, model(x, training=False).numpy(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ReplicaStepError, match="Emulated out of memory") as raised:
        model.fit(x, y, batch_size=96, epochs=1, verbose=0)  # the same 32 a replica: more than a training step holds
    cause = raised.value
    while cause is not None and not isinstance(cause, tf.errors.ResourceExhaustedError):
        cause = cause.__cause__
    assert cause is not None, raised.value


def test_regression_the_on_batch_methods_cut_the_batch_and_return_one_devices_values():
    # A review found predict_on_batch(x[:30]) returning (90, 3) and test_on_batch a loss and accuracy counted 3
    # times: Keras hands the plain batch to every replica. They now run as fit, evaluate and predict on that batch.
    strategy = HeteroCentralStorageStrategy(DEVICES, batch_split=[3, 1, 2], profile_cache=False)
    model = compiled(strategy)
    with strategy.scope():
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    keras.utils.set_random_seed(1)
    reference = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(3)])
    reference.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    reference.set_weights(model.get_weights())
    x, y = data(30)
    weights = np.random.default_rng(2).random(30).astype(np.float32)
    for step in range(2):  # Keras resets the metrics on every call: the second call's values are its own
        expected = reference.train_on_batch(x, y, sample_weight=weights, return_dict=True)
        got = model.train_on_batch(x, y, sample_weight=weights, return_dict=True)
        assert got.keys() == expected.keys()
        np.testing.assert_allclose([got[k] for k in expected], list(expected.values()), rtol=1e-5)
    for a, b in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.test_on_batch(x, y), reference.test_on_batch(x, y), rtol=1e-5)
    predictions = model.predict_on_batch(x)
    assert predictions.shape == (30, 3)
    np.testing.assert_allclose(predictions, reference.predict_on_batch(x), rtol=1e-5, atol=1e-6)
    assert strategy.plan.per_replica_batch_sizes == (15, 5, 10)  # the batch was cut by the shares
