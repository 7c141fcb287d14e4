"""The oracle: one step on any split equals one single-device step on the whole batch (model.fit path)."""

import copy
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hetero_cs
from hetero_cs import HeteroCentralStorageStrategy

_STRATEGIES: dict[int, HeteroCentralStorageStrategy] = {}


def strategy_for(num_replicas: int, shares) -> HeteroCentralStorageStrategy:
    """One strategy per replica count for the whole module (re-split with set_batch_split)."""
    if num_replicas not in _STRATEGIES:
        devices = [f"/cpu:{i}" for i in range(1, num_replicas + 1)]
        _STRATEGIES[num_replicas] = HeteroCentralStorageStrategy(
            devices, auto_balance=False, rebalance=False, batch_split=shares, profile_cache=False
        )
    strategy = _STRATEGIES[num_replicas]
    strategy.set_batch_split(shares)
    return strategy


def linear_model():
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


SEVEN_ONES_THREE_ZEROS = (np.ones((10, 1), np.float32), np.array([1.0] * 7 + [0.0] * 3, np.float32).reshape(10, 1))


@pytest.mark.parametrize("shares", [[7, 3], [1, 9], [9, 1], [5, 3, 2]])
def test_one_fit_step_on_uneven_split_equals_full_batch(shares):
    # Full batch: grad = mean(2 * (w*x - y) * x) = -1.4 at w=0, so w = 0.14; loss = mean(y^2) = 0.7.
    # Weighting each replica by 1/N instead of b_i/B gives w = 0.10 and loss 0.5 for [7, 3].
    strategy = strategy_for(len(shares), shares)
    with strategy.scope():
        model = linear_model()
    x, y = SEVEN_ONES_THREE_ZEROS
    history = model.fit(x, y, batch_size=10, epochs=1, shuffle=False, verbose=0)
    assert strategy.plan.per_replica_batch_sizes == tuple(shares)
    np.testing.assert_allclose(model.get_weights()[0], [[0.14]], atol=1e-6)
    np.testing.assert_allclose(history.history["loss"][0], 0.7, atol=1e-6)


def test_deepcopy_gives_an_independent_strategy_as_stock_strategies_do():
    # Regression (issue 29): copy.deepcopy(strategy) raised "TypeError: cannot pickle '_thread.lock' object" (the
    # strategy, its Balancer, monitor and emulator hold locks) where stock strategies copy: Strategy.__deepcopy__
    # deep-copies every attribute, the extended object included, and points the copy's extended at the copy.
    stock = tf.distribute.experimental.CentralStorageStrategy(["/cpu:1", "/cpu:2"])
    stock_copy = copy.deepcopy(stock)
    assert stock_copy.extended is not stock.extended and stock_copy.extended._container_strategy() is stock_copy
    strategy = HeteroCentralStorageStrategy(["/cpu:1", "/cpu:2"], emulate=["A10", "T4"], batch_split=[7, 3],
                                            profile_cache=False)
    with strategy.scope():
        model = linear_model()
    x, y = SEVEN_ONES_THREE_ZEROS
    model.fit(x, y, batch_size=10, epochs=1, shuffle=False, verbose=0)  # after fit: plan, dataset, timing state
    copied = copy.deepcopy(strategy)
    assert type(copied) is HeteroCentralStorageStrategy and copied.extended is not strategy.extended
    assert copied.extended._container_strategy() is copied  # noqa: SLF001 - as stock's copy
    assert copied.balancer is not strategy.balancer and copied.emulator is not strategy.emulator
    assert copied.plan == strategy.plan and copied.compute_devices == strategy.compute_devices
    with copied.scope():  # the copy trains, exactly
        other = linear_model()
    other.fit(x, y, batch_size=10, epochs=1, shuffle=False, verbose=0)
    np.testing.assert_allclose(other.get_weights()[0], [[0.14]], atol=1e-6)
    copied.set_batch_split([1, 9])  # independent: the original keeps its split and trains on
    assert copied.plan_for(10).per_replica_batch_sizes == (1, 9)
    model.fit(x, y, batch_size=10, epochs=1, shuffle=False, verbose=0)
    assert strategy.plan.per_replica_batch_sizes == (7, 3)


def dense_model(seed: int, *, optimizer: str, clip: dict | None = None, batchnorm: bool | str = False):
    init = keras.initializers.GlorotUniform(seed=seed)
    layers = [keras.Input((3,)), keras.layers.Dense(4, activation="tanh", kernel_initializer=init)]
    if batchnorm:
        layers.append(keras.layers.BatchNormalization(synchronized=batchnorm != "default"))
    layers.append(keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=seed + 1)))
    model = keras.Sequential(layers)
    opt_cls = {"sgd": keras.optimizers.SGD, "adam": keras.optimizers.Adam, "adamw": keras.optimizers.AdamW}[optimizer]
    # Adam's step m / (sqrt(v) + epsilon) is ill-conditioned where a gradient is near 0: at the default epsilon 1e-7 a
    # gradient of 2e-6 turned a rounding difference of the summation order (about 1e-9) into 8.5e-5 in a weight
    # (hypothesis found it: shares [0, 0, 2, 9], B = 8). A larger epsilon keeps the comparison about the weighting.
    extra = {"sgd": {}, "adam": {"epsilon": 1e-3}, "adamw": {"epsilon": 1e-3, "weight_decay": 0.1}}[optimizer]
    model.compile(optimizer=opt_cls(learning_rate=0.05, **extra, **(clip or {})), loss="mse", metrics=["mae"])
    return model


def reference_and_distributed(shares, *, x, y, global_batch_size, optimizer, seed=0, clip=None, batchnorm=False):
    reference = dense_model(seed, optimizer=optimizer, clip=clip, batchnorm=batchnorm)
    ref_hist = reference.fit(x, y, batch_size=global_batch_size, epochs=1, shuffle=False, verbose=0)
    strategy = strategy_for(len(shares), shares)
    with strategy.scope():
        model = dense_model(seed, optimizer=optimizer, clip=clip, batchnorm=batchnorm)
    hist = model.fit(x, y, batch_size=global_batch_size, epochs=1, shuffle=False, verbose=0)
    return reference, ref_hist, model, hist


def assert_same_state(reference, model, atol=1e-5):
    for ref_w, w in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(w, ref_w, atol=atol)
    for ref_v, v in zip(reference.optimizer.variables, model.optimizer.variables):
        np.testing.assert_allclose(np.asarray(v), np.asarray(ref_v), atol=atol, err_msg=v.path)
    assert int(model.optimizer.iterations) == int(reference.optimizer.iterations)


RANDOM_SPLIT = given(
    data=st.data(),
    num_replicas=st.integers(1, 4),
    global_batch_size=st.integers(4, 24),
    steps=st.integers(1, 3),
    optimizer=st.sampled_from(["sgd", "adam", "adamw"]),
)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@RANDOM_SPLIT
def test_random_splits_match_single_device(data, num_replicas, global_batch_size, steps, optimizer):
    check_random_split(data, num_replicas, global_batch_size, steps, optimizer)


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@RANDOM_SPLIT
def test_random_splits_match_single_device_long(data, num_replicas, global_batch_size, steps, optimizer):
    check_random_split(data, num_replicas, global_batch_size, steps, optimizer)


def check_random_split(data, num_replicas, global_batch_size, steps, optimizer):
    """Random shares (zeros allowed) of a random batch, maybe a partial last batch: equal to one device."""
    shares = data.draw(
        st.lists(st.integers(0, 9), min_size=num_replicas, max_size=num_replicas).filter(lambda s: sum(s) > 0)
    )
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    n = global_batch_size * steps - data.draw(st.integers(0, global_batch_size - 1))  # maybe a partial last batch
    x = rng.normal(size=(n, 3)).astype(np.float32)
    y = rng.normal(size=(n, 1)).astype(np.float32)
    reference, ref_hist, model, hist = reference_and_distributed(
        shares, x=x, y=y, global_batch_size=global_batch_size, optimizer=optimizer
    )
    assert_same_state(reference, model)
    np.testing.assert_allclose(hist.history["loss"], ref_hist.history["loss"], atol=1e-5)
    np.testing.assert_allclose(hist.history["mae"], ref_hist.history["mae"], atol=1e-5)


@pytest.mark.parametrize("shares", [[7, 3], [2, 0, 5]])
def test_adamw_weight_decay_matches_single_device(shares):
    # hetero_cs applies the decoupled decay in the update merge (behind the failure barrier): same result, and
    # exclude_from_weight_decay still honoured.
    def adamw_model(seed=3):
        init = keras.initializers.GlorotUniform(seed=seed)
        model = keras.Sequential([
            keras.Input((3,)),
            keras.layers.Dense(4, activation="tanh", kernel_initializer=init, name="decayed"),
            keras.layers.Dense(1, kernel_initializer=init, bias_initializer="ones", name="kept"),
        ])
        optimizer = keras.optimizers.AdamW(learning_rate=0.05, weight_decay=0.3)
        optimizer.exclude_from_weight_decay(var_names=["kept"])
        model.compile(optimizer=optimizer, loss="mse")
        return model

    rng = np.random.default_rng(7)
    x = rng.normal(size=(23, 3)).astype(np.float32)
    y = rng.normal(size=(23, 1)).astype(np.float32)
    reference = adamw_model()
    reference.fit(x, y, batch_size=sum(shares) + 1, epochs=2, shuffle=False, verbose=0)
    strategy = strategy_for(len(shares), shares)
    with strategy.scope():
        model = adamw_model()
    model.fit(x, y, batch_size=sum(shares) + 1, epochs=2, shuffle=False, verbose=0)
    assert_same_state(reference, model)


def test_gradient_accumulation_over_three_steps_is_exact_in_float64():
    # Regression: the host scaled the accumulated sum by tf.cast(1 / 3, float64), a third rounded to float32 first,
    # so float64 weights drifted about 1e-8 from one device's (g + accumulated) / 3.
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(48, 4)), rng.normal(size=(48, 1))

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,), dtype="float64"),
                                  keras.layers.Dense(3, activation="tanh", dtype="float64"),
                                  keras.layers.Dense(1, dtype="float64")])
        model.compile(optimizer=keras.optimizers.SGD(0.5, gradient_accumulation_steps=3), loss="mse")
        return model

    reference = build()
    with strategy_for(3, [5, 2, 1]).scope():
        model = build()
    model.set_weights(reference.get_weights())
    for trained in (reference, model):
        trained.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)  # 6 steps: 2 updates
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-13)


def test_adam_first_moment_has_no_replica_count_factor():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(12, 3)).astype(np.float32)
    y = rng.normal(size=(12, 1)).astype(np.float32)
    reference = dense_model(5, optimizer="sgd")
    with tf.GradientTape() as tape:
        loss = keras.losses.mean_squared_error(y, reference(x))
        loss = tf.reduce_mean(loss)
    full_batch_grads = tape.gradient(loss, reference.trainable_variables)
    _, _, model, _ = reference_and_distributed([6, 4, 2], x=x, y=y, global_batch_size=12, optimizer="adam", seed=5)
    beta_1 = model.optimizer.beta_1
    momentums = model.optimizer._momentums  # noqa: SLF001 - the slot variables under test
    for m, g in zip(momentums, full_batch_grads):
        np.testing.assert_allclose(np.asarray(m), (1 - beta_1) * g.numpy(), atol=1e-6)


@pytest.mark.parametrize(
    "clip", [{"clipnorm": 0.05}, {"global_clipnorm": 0.05}, {"clipvalue": 0.01}], ids=lambda c: next(iter(c))
)
def test_gradient_clipping_acts_on_the_aggregated_gradient(clip):
    rng = np.random.default_rng(11)
    x = rng.normal(size=(16, 3)).astype(np.float32)
    y = (3 * rng.normal(size=(16, 1))).astype(np.float32)
    reference, _, model, _ = reference_and_distributed(
        [9, 5, 2], x=x, y=y, global_batch_size=16, optimizer="sgd", clip=clip
    )
    assert_same_state(reference, model, atol=1e-6)


def test_synchronized_batchnorm_gives_full_batch_moving_statistics():
    rng = np.random.default_rng(4)
    x = (rng.normal(size=(30, 3)) * [1, 5, 0.1] + [0, 3, -2]).astype(np.float32)
    y = rng.normal(size=(30, 1)).astype(np.float32)
    reference, _, model, _ = reference_and_distributed(
        [4, 9, 17], x=x, y=y, global_batch_size=30, optimizer="sgd", batchnorm=True
    )
    bn_ref = reference.layers[1]
    bn = model.layers[1]
    np.testing.assert_allclose(bn.moving_mean.numpy(), bn_ref.moving_mean.numpy(), atol=1e-5)
    np.testing.assert_allclose(bn.moving_variance.numpy(), bn_ref.moving_variance.numpy(), atol=1e-5)
    assert_same_state(reference, model)


@pytest.mark.parametrize("batchnorm", ["default", "synchronized"])
@pytest.mark.parametrize(
    "shares,global_batch_size,n",
    [([4, 9, 17], 30, 30), ([0, 5, 5], 10, 22), ([3, 2, 1], 6, 14)],
    ids=["uneven", "zero-share-and-partial-batch", "last-batch-smaller-than-replicas"],
)
def test_batchnorm_normalises_by_the_global_batch(batchnorm, shares, global_batch_size, n):
    """Regression: default BatchNormalization normalised each slice by its own statistics (not one device's step),
    and a 0-example slice turned the weights and moving statistics into NaN after one step."""
    rng = np.random.default_rng(4)
    x = (rng.normal(size=(n, 3)) * [1, 5, 0.1] + [0, 3, -2]).astype(np.float32)
    y = rng.normal(size=(n, 1)).astype(np.float32)
    reference, ref_hist, model, hist = reference_and_distributed(
        shares, x=x, y=y, global_batch_size=global_batch_size, optimizer="adam", batchnorm=batchnorm
    )
    bn_ref, bn = reference.layers[1], model.layers[1]
    assert np.all(np.isfinite(bn.moving_variance.numpy()))
    np.testing.assert_allclose(bn.moving_mean.numpy(), bn_ref.moving_mean.numpy(), atol=1e-5)
    np.testing.assert_allclose(bn.moving_variance.numpy(), bn_ref.moving_variance.numpy(), atol=1e-5)
    assert_same_state(reference, model)
    np.testing.assert_allclose(hist.history["loss"], ref_hist.history["loss"], rtol=1e-5, atol=1e-6)


def test_masked_batchnorm_normalises_by_the_global_batch():
    """A masked BatchNormalization (after Embedding(mask_zero=True)) counts the whole batch's unmasked entries."""
    rng = np.random.default_rng(5)
    x = rng.integers(0, 6, size=(24, 5)).astype(np.int32)  # token 0 is padding (masked)
    y = rng.normal(size=(24, 1)).astype(np.float32)

    def build(seed=0):
        model = keras.Sequential([
            keras.Input((5,), dtype="int32"),
            keras.layers.Embedding(6, 4, mask_zero=True, embeddings_initializer=keras.initializers.RandomNormal(
                seed=seed)),
            keras.layers.BatchNormalization(),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=seed + 1)),
        ])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return model

    reference = build()
    reference.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    strategy = strategy_for(3, [6, 5, 1])
    with strategy.scope():
        model = build()
    model.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    for ref_w, w in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(w, ref_w, atol=1e-5)


@pytest.mark.parametrize(
    "shares,global_batch_size",
    [([0, 5, 5], 10), ([1, 8, 1], 10), ([1, 1, 1], 2)],
    ids=["zero-example-slice", "one-example-slices", "batch-smaller-than-replicas"],
)
def test_tiny_and_empty_slices_stay_exact(shares, global_batch_size):
    rng = np.random.default_rng(8)
    x = rng.normal(size=(global_batch_size * 2, 3)).astype(np.float32)
    y = rng.normal(size=(global_batch_size * 2, 1)).astype(np.float32)
    reference, ref_hist, model, hist = reference_and_distributed(
        shares, x=x, y=y, global_batch_size=global_batch_size, optimizer="adam"
    )
    assert np.isfinite(hist.history["loss"][0])
    assert_same_state(reference, model)
    np.testing.assert_allclose(hist.history["loss"], ref_hist.history["loss"], atol=1e-5)


def test_dropout_model_trains_on_three_replicas():
    # Stock CentralStorageStrategy fails at step 0 on this model ("You must specify an aggregation method...").
    strategy = strategy_for(3, [3, 2, 1])
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((16,)),
                keras.layers.Dense(128, activation="relu"),
                keras.layers.Dropout(0.2),
                keras.layers.GaussianNoise(0.1),
                keras.layers.Dense(10),
            ]
        )
        model.compile(
            optimizer="adam",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(240, 16)).astype(np.float32)
    y = (x[:, :10].argmax(axis=1)).astype(np.int32)
    history = model.fit(x, y, batch_size=48, epochs=4, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert all(np.isfinite(history.history["loss"]))


def test_evaluate_and_predict_match_single_device():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(25, 3)).astype(np.float32)
    y = rng.normal(size=(25, 1)).astype(np.float32)
    reference = dense_model(7, optimizer="sgd")
    strategy = strategy_for(3, [5, 1, 2])
    with strategy.scope():
        model = dense_model(7, optimizer="sgd")
    ref_eval = reference.evaluate(x, y, batch_size=10, verbose=0, return_dict=True)
    got_eval = model.evaluate(x, y, batch_size=10, verbose=0, return_dict=True)
    for key in ref_eval:
        np.testing.assert_allclose(got_eval[key], ref_eval[key], atol=1e-5, err_msg=key)
    np.testing.assert_allclose(model.predict(x, batch_size=10, verbose=0), reference.predict(x, batch_size=10, verbose=0), atol=1e-6)


@pytest.mark.parametrize("steps_per_execution", [3, 4])
def test_steps_per_execution_matches_single_device(steps_per_execution):
    # Several steps per call loop over iterator.get_next_as_optional(); 23 examples in batches of 6 end on a
    # partial batch of 5, inside a loop of 3 or 4 steps.
    rng = np.random.default_rng(3)
    x = rng.normal(size=(23, 3)).astype(np.float32)
    y = rng.normal(size=(23, 1)).astype(np.float32)
    reference = dense_model(5, optimizer="adam")
    reference.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse", steps_per_execution=steps_per_execution)
    ref_hist = reference.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0)
    strategy = strategy_for(3, [3, 2, 1])
    with strategy.scope():
        model = dense_model(5, optimizer="adam")
        model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse", steps_per_execution=steps_per_execution)
    hist = model.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0)
    assert_same_state(reference, model)
    np.testing.assert_allclose(hist.history["loss"], ref_hist.history["loss"], atol=1e-5)
    assert int(model.optimizer.iterations) == 8


def test_metrics_that_accumulate_with_assign_match_single_device():
    # TruePositives, Precision, Recall, AUC and R2Score update with var.assign(var + delta), not assign_add.
    rng = np.random.default_rng(5)
    x = rng.normal(size=(53, 3)).astype(np.float32)
    y = (x[:, :1] + 0.5 * rng.normal(size=(53, 1)) > 0).astype(np.float32)

    def build():
        init = keras.initializers.GlorotUniform(seed=9)
        dense = keras.layers.Dense(1, activation="sigmoid", kernel_initializer=init)
        model = keras.Sequential([keras.Input((3,)), dense])
        metrics = [keras.metrics.TruePositives(name="tp"), keras.metrics.Precision(name="precision"),
                   keras.metrics.Recall(name="recall"), keras.metrics.AUC(name="auc"), keras.metrics.R2Score(name="r2")]
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="binary_crossentropy", metrics=metrics)
        return model

    reference = build()
    ref_hist = reference.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
    strategy = strategy_for(3, [5, 3, 2])
    with strategy.scope():
        model = build()
    hist = model.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
    for key in ("tp", "precision", "recall", "auc", "r2"):
        np.testing.assert_allclose(hist.history[key], ref_hist.history[key], atol=1e-4, err_msg=key)
    ref_eval = reference.evaluate(x, y, batch_size=7, verbose=0, return_dict=True)
    got_eval = model.evaluate(x, y, batch_size=7, verbose=0, return_dict=True)
    for key in ref_eval:
        np.testing.assert_allclose(got_eval[key], ref_eval[key], atol=1e-4, err_msg=key)


class LastBatchMean(keras.metrics.Metric):
    """Sets its state to the batch's sums (no accumulation): the last batch's mean prediction."""

    def __init__(self, name="last_batch_mean", **kwargs):
        super().__init__(name=name, **kwargs)
        self.total = self.add_variable((), "zeros", name="total")
        self.count = self.add_variable((), "zeros", name="count")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.total.assign(tf.reduce_sum(y_pred))
        self.count.assign(tf.cast(tf.size(y_pred), "float32"))

    def result(self):
        return tf.math.divide_no_nan(self.total.value, self.count.value)


def test_a_metric_that_sets_its_state_keeps_the_sum_over_replicas():
    # Only assign(var + delta) is turned into an aggregated add; setting the state to the batch's sums stays a sum
    # over the replicas' slices, which is the full batch's sum.
    x = np.arange(40, dtype=np.float32).reshape(40, 1) / 40
    y = np.zeros((40, 1), np.float32)

    def build():
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, kernel_initializer="ones")])
        model.compile(loss="mse", metrics=[LastBatchMean(), keras.metrics.TruePositives(name="tp")])
        return model

    expected = build().evaluate(x, y, batch_size=10, verbose=0, return_dict=True)
    strategy = strategy_for(2, [3, 1])
    with strategy.scope():
        model = build()
    got = model.evaluate(x, y, batch_size=10, verbose=0, return_dict=True)
    assert got["last_batch_mean"] == pytest.approx(float(x[30:].mean()))
    for key in expected:
        assert got[key] == pytest.approx(expected[key], abs=1e-6), key


class ReplicatedTerms(keras.metrics.Metric):
    """Accumulates terms every replica computes alike: a count of steps (assign_add of a constant), a total that adds
    a sum times a variable that is not its own plus constants (assign of var + delta), and the mean over steps of
    that variable (assign_add)."""

    def __init__(self, scale, name="replicated_terms", **kwargs):
        super().__init__(name=name, **kwargs)
        self.steps = self.add_variable((), "zeros", name="steps")
        self.total = self.add_variable((), "zeros", name="total")
        self.scales = self.add_variable((), "zeros", name="scales")
        self._scale = [scale]  # in a list: not tracked, so not reset with the metric's state

    def update_state(self, y_true, y_pred, sample_weight=None):
        scale = self._scale[0]
        self.steps.assign_add(1.0)
        self.total.assign(self.total + tf.reduce_sum(y_pred) * scale + 1.0 + scale)
        self.scales.assign_add(scale * 3.0 + 1.0)

    def result(self):
        return {"steps": self.steps.value, "offset_total": self.total.value,
                "mean_of_batches": self.scales.value / self.steps.value}


def test_a_metric_that_counts_steps_or_reads_another_variable_matches_single_device():
    # Each replica adds the same 1 to the step count: summed over the replicas it counted R a step, and so every
    # term that every replica computes alike (a constant, another variable's value) in a metric's accumulation (a
    # read of another variable there also raised AttributeError while the step was traced).
    x = np.arange(46, dtype=np.float32).reshape(46, 1) / 46
    y = np.zeros((46, 1), np.float32)

    def build():
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, kernel_initializer="ones")])
        scale = tf.Variable(2.0, trainable=False)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse",
                      metrics=[ReplicatedTerms(scale)])
        return model

    reference = build().fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0).history
    strategy = strategy_for(3, [5, 3, 2])
    with strategy.scope():
        model = build()
    history = model.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0).history
    assert history["steps"] == pytest.approx([5.0, 5.0], abs=1e-5)  # 5 steps an epoch
    for key in ("offset_total", "mean_of_batches"):
        np.testing.assert_allclose(history[key], reference[key], rtol=1e-5, err_msg=key)


def test_the_stateless_metric_api_leaves_the_variables_alone():
    strategy = strategy_for(2, [3, 1])
    with strategy.scope():
        metric = keras.metrics.TruePositives()
    element = next(iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensors((np.ones((8, 1), np.float32), np.ones((8, 1), np.float32))))))

    @tf.function
    def step(dist):
        def replica_fn(y_true, y_pred):
            new_state = metric.stateless_update_state([v.value for v in metric.variables], y_true, y_pred)
            return new_state[0]

        return strategy.run(replica_fn, args=dist)

    new_states = strategy.experimental_local_results(step(element))
    assert [float(t[0]) for t in new_states] == [6.0, 2.0]  # each replica's own new state
    assert float(metric.variables[0][0]) == 0.0  # the variable itself is unchanged


@pytest.mark.parametrize("run_eagerly", [False, True])
def test_weight_constraints_match_single_device(run_eagerly):
    # Keras applies kernel_constraint after the update by assigning in replica context (stock raises there).
    rng = np.random.default_rng(6)
    x = rng.normal(size=(16, 4)).astype(np.float32)
    y = x[:, :2] * 3

    def build():
        init = keras.initializers.GlorotUniform(seed=2)
        dense = keras.layers.Dense(2, kernel_initializer=init, kernel_constraint=keras.constraints.MaxNorm(0.3))
        model = keras.Sequential([keras.Input((4,)), dense])
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse", run_eagerly=run_eagerly)
        return model

    reference = build()
    reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    strategy = strategy_for(2, [3, 1])
    with strategy.scope():
        model = build()
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert_same_state(reference, model)
    assert np.linalg.norm(model.get_weights()[0], axis=0).max() <= 0.3 + 1e-6


def test_plan_change_does_not_retrace_the_train_step_unless_it_idles_a_new_set_of_replicas():
    # A strategy of its own: the module's shared ones have met sets of idle replicas in other tests.
    strategy = HeteroCentralStorageStrategy(["/cpu:1", "/cpu:2", "/cpu:3"], auto_balance=False, rebalance=False,
                                            profile_cache=False)
    with strategy.scope():
        model = dense_model(1, optimizer="sgd")
    rng = np.random.default_rng(1)
    x = rng.normal(size=(60, 3)).astype(np.float32)
    y = rng.normal(size=(60, 1)).astype(np.float32)
    traces = []
    original_train_step = model.train_step

    def counting_train_step(data):  # runs once per replica each time the step function is traced
        traces.append(1)
        return original_train_step(data)

    model.train_step = counting_train_step
    model.fit(x, y, batch_size=12, epochs=1, verbose=0)
    traced = len(traces)
    assert traced > 0
    for shares in ([5, 1, 1], [2, 2, 1]):
        strategy.set_batch_split(shares)
        model.fit(x, y, batch_size=12, epochs=1, verbose=0)
    assert strategy.plan.per_replica_batch_sizes == (5, 5, 2)
    assert len(traces) == traced
    # A plan that leaves a replica idle is traced once more, with a branch in which that replica does no work
    # (hetero_cs.engine.step.idle_replicas); going back and forth between known sets traces nothing.
    strategy.set_batch_split([1, 0, 3])
    model.fit(x, y, batch_size=12, epochs=1, verbose=0)
    retraced = len(traces)
    assert retraced > traced
    for shares in ([5, 1, 1], [1, 0, 3], [2, 2, 1]):
        strategy.set_batch_split(shares)
        model.fit(x, y, batch_size=12, epochs=1, verbose=0)
    assert len(traces) == retraced


def test_replica_weight_outside_a_replica_raises():
    with pytest.raises(hetero_cs.HeteroCSError, match="inside a replica function"):
        hetero_cs.current_global_batch_size()


# Patches that check themselves: a Keras that stops calling a patched hook, or lacks a private name, is a clear
# UnsupportedVersionError naming it and the versions, never a silently different step or an AttributeError.

def _keras_original(owner, name):
    return getattr(owner, name).__wrapped__  # functools.wraps: the patch made a pass-through to Keras' own code


@pytest.mark.parametrize("owner, name, compile_kwargs, missing", [
    ("optimizer", "_all_reduce_sum_gradients", {"clipnorm": 1.0}, "TFOptimizer._all_reduce_sum_gradients"),
    ("optimizer", "_apply_weight_decay", {"weight_decay": 0.1}, "TFOptimizer._apply_weight_decay"),
    ("losses", "scale_loss_for_distribution", {}, "keras.src.losses.loss.scale_loss_for_distribution"),
])
def test_a_hook_keras_no_longer_calls_is_a_clear_error_at_the_first_traced_step(
        monkeypatch, owner, name, compile_kwargs, missing):
    from keras.src.backend.tensorflow.optimizer import TFOptimizer
    from keras.src.losses import loss as loss_module

    strategy = strategy_for(2, [3, 1])  # installs the patches
    target = {"optimizer": TFOptimizer, "losses": loss_module}[owner]
    monkeypatch.setattr(target, name, _keras_original(target, name))  # the hook never runs, so never records
    with strategy.scope():
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, kernel_initializer="ones")])
        model.compile(optimizer=keras.optimizers.AdamW(0.1, **compile_kwargs), loss="mse", metrics=["mae"])
    before = [w.copy() for w in model.get_weights()]
    x, y = SEVEN_ONES_THREE_ZEROS
    with pytest.raises(hetero_cs.UnsupportedVersionError) as info:
        model.fit(x[:8], y[:8], batch_size=4, epochs=1, verbose=0)
    message = str(info.value)
    assert isinstance(info.value, hetero_cs.ConfigError)
    assert missing in message.split("did not run", 1)[1].split("Installed:", 1)[0]  # named among the missing
    assert f"tensorflow {tf.__version__}, keras {keras.__version__}" in message
    assert "tensorflow>=2.16.2,<2.22 with keras>=3.8,<3.16" in message and "Install a supported pair" in message
    for old, new in zip(before, model.get_weights()):  # the step never ran
        np.testing.assert_array_equal(old, new)


def test_every_hook_of_a_clipped_decayed_step_runs_on_the_installed_keras(monkeypatch):
    from hetero_cs.engine._compat import hooks

    checked = []
    original_verify = hooks.verify

    def verify(record):
        checked.append(dict(record.expected))
        return original_verify(record)

    monkeypatch.setattr(hooks, "verify", verify)
    strategy = strategy_for(2, [3, 1])
    with strategy.scope():
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.AdamW(0.1, weight_decay=0.1, clipnorm=1.0), loss="mse",
                      metrics=["mae"])
    x, y = SEVEN_ONES_THREE_ZEROS
    model.fit(x[:8], y[:8], batch_size=4, epochs=1, verbose=0)
    assert checked, "no traced step was checked"
    needed = set(checked[0])
    assert {hooks.ALL_REDUCE, hooks.UPDATE, hooks.CLIP_SKIPPED, hooks.CLIP_SUMMED, hooks.DECAY_DEFERRED,
            hooks.DECAY_APPLIED, hooks.VARIABLE_WRITE, hooks.LOSS_REDUCE, hooks.LOSS_SCALE,
            hooks.LOSS_UNSCALE} <= needed


def test_a_missing_private_symbol_is_a_clear_error_not_an_attribute_error(monkeypatch):
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    from hetero_cs.engine import _compat

    strategy_for(2, [3, 1])  # installs the patches
    _compat.check_private_symbols()  # the installed pair has every one
    monkeypatch.delattr(TFOptimizer, "_distributed_tf_update_step")
    name = "keras.src.backend.tensorflow.optimizer.TFOptimizer._distributed_tf_update_step"
    with pytest.raises(hetero_cs.UnsupportedVersionError, match=name.replace(".", r"\.")) as info:
        _compat.check_private_symbols()
    assert f"tensorflow {tf.__version__}, keras {keras.__version__}" in str(info.value)
    assert "tensorflow>=2.16.2,<2.22 with keras>=3.8,<3.16" in str(info.value)
    # Installing the patches checks first, and patches nothing when a name is missing.
    monkeypatch.setattr(_compat, "_installed", False)
    clip = TFOptimizer._clip_gradients
    with pytest.raises(hetero_cs.UnsupportedVersionError, match=name.replace(".", r"\.")):
        _compat.install()
    assert TFOptimizer._clip_gradients is clip and _compat._installed is False


def test_private_names_are_found_at_their_home_after_kerass_backend_refactor(monkeypatch):
    # keras-nightly 3.16.0.dev (the pluggable-backend refactor) moved keras.src.backend.tensorflow.core to
    # ...tensorflow.ops.core and renamed Trainer -> BaseTrainer, TensorFlowTrainer -> Trainer: each is found at
    # whichever home the installed Keras has (fake modules).
    import types

    from hetero_cs.engine._compat import symbols

    old_home = types.ModuleType("fake_keras_core")
    new_home = types.ModuleType("fake_keras_ops_core")
    new_home.Variable = type("Variable", (), {})
    renamed = types.ModuleType("fake_keras_trainer")
    renamed.BaseTrainer = type("BaseTrainer", (), {})
    monkeypatch.setitem(sys.modules, "fake_keras_ops_core", new_home)
    monkeypatch.setitem(sys.modules, "fake_keras_trainer", renamed)
    monkeypatch.setitem(symbols.MOVED_MODULES, "fake_keras_core", "fake_keras_ops_core")
    monkeypatch.setitem(symbols.RENAMED_CLASSES, ("fake_keras_trainer", "Trainer"), "BaseTrainer")
    assert symbols.resolve("fake_keras_core") is new_home  # the old home does not exist (not importable)
    assert symbols.resolve("fake_keras_core", "Variable") is new_home.Variable
    assert symbols.resolve("fake_keras_trainer", "Trainer") is renamed.BaseTrainer
    assert symbols.resolve("fake_keras_trainer", "Nothing") is None
    monkeypatch.setitem(sys.modules, "fake_keras_core", old_home)
    assert symbols.resolve("fake_keras_core") is old_home  # the supported releases' home comes first
