"""Keras patterns people write, each against the single-device oracle (issue 14).

Every test runs one pattern on an uneven split with a 0-example slice and a partial last batch, and compares
weights, optimizer slots, logged loss and metrics with the same model trained on one device.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import hetero_cs
from hetero_cs import HeteroCentralStorageStrategy

ATOL = 1e-5
_STRATEGIES: dict[int, HeteroCentralStorageStrategy] = {}


def strategy_for(shares) -> HeteroCentralStorageStrategy:
    """One strategy per replica count for the whole module (re-split with set_batch_split)."""
    num_replicas = len(shares)
    if num_replicas not in _STRATEGIES:
        devices = [f"/cpu:{i}" for i in range(1, num_replicas + 1)]
        _STRATEGIES[num_replicas] = HeteroCentralStorageStrategy(
            devices, auto_balance=False, rebalance=False, batch_split=shares, profile_cache=False
        )
    strategy = _STRATEGIES[num_replicas]
    strategy.set_batch_split(shares)
    return strategy


def assert_same_state(reference, model, atol=ATOL):
    for ref_w, w in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(w, ref_w, atol=atol)
    ref_opt = getattr(reference, "optimizer", None)
    if ref_opt is not None:
        for ref_v, v in zip(ref_opt.variables, model.optimizer.variables):
            np.testing.assert_allclose(np.asarray(v), np.asarray(ref_v), atol=atol, err_msg=v.path)


def assert_same_logs(expected: dict, got: dict, atol=ATOL):
    assert set(got) >= set(expected), (sorted(expected), sorted(got))
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], atol=atol, err_msg=key)


def regression_data(n=23, features=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype(np.float32)
    y = (x[:, :1] * 2 + rng.normal(size=(n, 1))).astype(np.float32)
    return x, y


# ------------------------------------------------------------------------------------------------------------------
# 7. A tf.function step passed to strategy.run from an eager loop
# ------------------------------------------------------------------------------------------------------------------
def dense(seed=0, features=3):
    init = keras.initializers.GlorotUniform(seed)
    return keras.Sequential([keras.Input((features,)), keras.layers.Dense(4, activation="tanh", kernel_initializer=init),
                             keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed + 1))])


def test_tf_function_step_passed_to_run_from_an_eager_loop_is_exact():
    # TensorFlow's own CentralStorageStrategy custom-loop pattern: the optimizer's gradient all-reduce inside a
    # tf.function that strategy.run is given. It raised "merge_call called while defining a new graph" before.
    x, y = regression_data(17)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(6)  # 6, 6, 5
    reference, ref_opt = dense(), keras.optimizers.Adam(0.05)
    for xb, yb in dataset:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(reference(xb) - yb))
        ref_opt.apply_gradients(zip(tape.gradient(loss, reference.trainable_variables), reference.trainable_variables))

    strategy = strategy_for([3, 0, 2])
    with strategy.scope():
        model, optimizer = dense(), keras.optimizers.Adam(0.05)

    @tf.function
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            per_example = tf.reduce_sum(tf.square(model(xb) - yb), axis=-1)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=hetero_cs.current_global_batch_size())
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        examples = tf.distribute.get_replica_context().all_reduce("SUM", tf.shape(xb)[0])
        return loss, examples

    sizes = []
    for element in strategy.experimental_distribute_dataset(dataset):
        _, examples = strategy.run(train_step, args=element)
        sizes.append(int(strategy.experimental_local_results(examples)[0]))
    assert sizes == [6, 6, 5]
    for ref_w, w in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(w, ref_w, atol=ATOL)
    for ref_v, v in zip(ref_opt.variables, optimizer.variables):
        np.testing.assert_allclose(np.asarray(v), np.asarray(ref_v), atol=ATOL)


# ------------------------------------------------------------------------------------------------------------------
# 6. Metrics that accumulate in other forms than var + delta
# ------------------------------------------------------------------------------------------------------------------
class AccumulatingForms(keras.metrics.Metric):
    """Accumulates with var + a + b, tf.add_n, subtracting a negative, and var - 2 * d (a vector)."""

    def __init__(self, name="forms", **kwargs):
        super().__init__(name=name, **kwargs)
        self.plus_two = self.add_variable((), "zeros", name="plus_two")
        self.add_n = self.add_variable((), "zeros", name="add_n")
        self.minus_negative = self.add_variable((), "zeros", name="minus_negative")
        self.vector = self.add_variable((2,), "zeros", name="vector")

    def update_state(self, y_true, y_pred, sample_weight=None):
        total = tf.reduce_sum(y_pred)
        count = tf.cast(tf.size(y_pred), self.dtype)
        self.plus_two.assign(self.plus_two + total + count)
        self.add_n.assign(tf.add_n([self.add_n, total, count]))
        self.minus_negative.assign(self.minus_negative - (-total))
        self.vector.assign(self.vector - tf.stack([-total, count]) * 2.0)

    def result(self):
        return {"plus_two": self.plus_two.value, "add_n": self.add_n.value,
                "minus_negative": self.minus_negative.value, "vector": tf.reduce_sum(self.vector.value)}


def test_metrics_accumulating_in_other_linear_forms_match_single_device():
    x, y = regression_data(23, features=1)

    def build():
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, kernel_initializer="ones")])
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", metrics=[AccumulatingForms()])
        return model

    reference = build()
    ref_hist = reference.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0)
    expected = reference.evaluate(x, y, batch_size=6, verbose=0, return_dict=True)
    strategy = strategy_for([2, 0, 3])
    with strategy.scope():
        model = build()
    hist = model.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0)
    got = model.evaluate(x, y, batch_size=6, verbose=0, return_dict=True)
    assert_same_state(reference, model)
    assert_same_logs(ref_hist.history, hist.history, atol=1e-4)
    assert_same_logs(expected, got, atol=1e-4)
