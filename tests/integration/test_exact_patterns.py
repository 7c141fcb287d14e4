"""Keras patterns people write, each against the single-device oracle (issue 14).

Every test runs one pattern on an uneven split with a 0-example slice and a partial last batch, and compares
weights, optimizer slots, logged loss and metrics with the same model trained on one device.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import hetero_cs
from fixed_splits import strategy_for

ATOL = 1e-5


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


def padded_dense(seed=0):
    init = keras.initializers.GlorotUniform(seed)
    return keras.Sequential([keras.Input((3,)), keras.layers.Reshape((3, 1)), keras.layers.ZeroPadding1D(1),
                             keras.layers.Flatten(), keras.layers.Dense(4, activation="tanh", kernel_initializer=init),
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


def test_a_mean_metric_given_the_replicas_share_in_strategy_run_reads_the_full_batch_loss():
    # The documented custom-loop loss (compute_average_loss over B) is each replica's share of the batch's loss; a
    # Mean fed it inside strategy.run counts one value per step, as on one device (it read 1/R of it before).
    x, y = regression_data(17)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(6)  # 6, 6, 5
    model = dense()
    expected = np.mean([float(tf.reduce_mean(tf.reduce_sum(tf.square(model(xb) - yb), axis=-1))) for xb, yb in dataset])
    strategy = strategy_for([3, 0, 2])
    with strategy.scope():
        replica_model = dense()
        tracker = keras.metrics.Mean()

    @tf.function
    def step(element):
        def step_fn(xb, yb):
            per_example = tf.reduce_sum(tf.square(replica_model(xb) - yb), axis=-1)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=hetero_cs.current_global_batch_size())
            tracker.update_state(loss)

        strategy.run(step_fn, args=element)

    for element in strategy.experimental_distribute_dataset(dataset):
        step(element)
    np.testing.assert_allclose(float(tracker.result()), expected, atol=ATOL)


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


# ------------------------------------------------------------------------------------------------------------------
# Oracle through model.fit and model.evaluate: split [3, 0, 2] (a 0-example slice), 23 examples in batches of 6
# (a partial last batch of 5), two epochs.
# ------------------------------------------------------------------------------------------------------------------
SHARES = [3, 0, 2]


def check_fit_and_evaluate(build, x, y, *, shares=SHARES, sample_weight=None, batch_size=6, epochs=2):
    reference = build()
    ref_hist = reference.fit(x, y, sample_weight=sample_weight, batch_size=batch_size, epochs=epochs, shuffle=False,
                             verbose=0)
    expected = reference.evaluate(x, y, sample_weight=sample_weight, batch_size=batch_size, verbose=0,
                                  return_dict=True)
    strategy = strategy_for(shares)
    with strategy.scope():
        model = build()
    hist = model.fit(x, y, sample_weight=sample_weight, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    got = model.evaluate(x, y, sample_weight=sample_weight, batch_size=batch_size, verbose=0, return_dict=True)
    assert_same_state(reference, model)
    assert_same_logs(ref_hist.history, hist.history)
    assert_same_logs(expected, got)
    return model


def test_an_activity_regularizer_after_batch_normalization_logs_one_devices_loss():
    # The replicas call the same layer objects at once; BatchNormalization's statistics all-reduce lines them up,
    # and every replica's compute_loss used to read all replicas' activity losses from the layer's one list (the
    # logged loss 7 % high, the weights right). Each replica now keeps its own.
    x, y = regression_data(n=24, features=6)

    def build():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([
            keras.Input((6,)), keras.layers.Dense(8), keras.layers.BatchNormalization(),
            keras.layers.Dense(4, activation="relu", activity_regularizer=keras.regularizers.L2(0.1)),
            keras.layers.Dense(1)])
        # SGD: the bias before BatchNormalization has a gradient of 0 up to rounding, which Adam turns into steps.
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return model

    check_fit_and_evaluate(build, x, y, shares=[3, 1, 2], batch_size=12)


def compiled(model, loss="mse", run_eagerly=False, **kwargs):
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss=loss, run_eagerly=run_eagerly, **kwargs)
    return model


def mean_squared_error_reduced(y_true, y_pred):
    """A loss function that reduces itself to a scalar over the batch."""
    return tf.reduce_mean(tf.square(y_true - y_pred))


class ReducedMeanSquaredError(keras.losses.Loss):
    """A Loss subclass whose call reduces itself to a scalar."""

    def call(self, y_true, y_pred):
        return mean_squared_error_reduced(y_true, y_pred)


# 1. A loss that returns a scalar ----------------------------------------------------------------------------------
@pytest.mark.parametrize("run_eagerly", [False, True])
def test_a_loss_function_that_reduces_itself_weighs_as_its_slice_mean(run_eagerly):
    x, y = regression_data()
    check_fit_and_evaluate(lambda: compiled(dense(), mean_squared_error_reduced, run_eagerly, metrics=["mae"]), x, y)


class MeanOverride(keras.Sequential):
    """Keras' compute_loss docstring example: its own mean, its own loss tracker, the layers' losses added."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.own_loss = keras.metrics.Mean(name="own_loss")

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = keras.ops.mean((y_pred - y) ** 2)
        loss += keras.ops.sum(self.losses)
        self.own_loss.update_state(loss)
        return loss


class AddsToKerasLoss(keras.Sequential):
    """Keras' own loss (already weighted) plus a term of its own (a mean over the batch)."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training)
        return loss + 0.5 * keras.ops.mean(keras.ops.abs(y_pred)) - 0.1


def regularized(cls, seed=0):
    init = keras.initializers.GlorotUniform(seed)
    return cls([keras.Input((3,)),
                keras.layers.Dense(4, activation="tanh", kernel_initializer=init, kernel_regularizer="l2"),
                keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed + 1))])


@pytest.mark.parametrize("run_eagerly", [False, True])
def test_a_compute_loss_override_that_returns_a_mean_is_exact(run_eagerly):
    x, y = regression_data()
    model = check_fit_and_evaluate(lambda: compiled(regularized(MeanOverride), "mse", run_eagerly), x, y)
    assert "own_loss" in [m.name for m in model.metrics]


def test_a_compute_loss_override_that_adds_its_own_term_to_kerass_is_exact():
    x, y = regression_data()
    check_fit_and_evaluate(lambda: compiled(regularized(AddsToKerasLoss), "mse"), x, y)


def test_a_mixed_compute_loss_override_run_eagerly_is_refused():
    x, y = regression_data()
    strategy = strategy_for(SHARES)
    with strategy.scope():
        model = compiled(regularized(AddsToKerasLoss), "mse", run_eagerly=True)
    with pytest.raises(hetero_cs.ConfigError, match="compute_loss of AddsToKerasLoss .* run_eagerly=True"):
        model.fit(x, y, batch_size=6, epochs=1, verbose=0)


def test_a_scalar_loss_with_sample_weights_is_refused():
    x, y = regression_data()
    weights = np.linspace(0.5, 1.5, len(x)).astype(np.float32)
    loss = ReducedMeanSquaredError(name="reduced_mse")
    strategy = strategy_for(SHARES)
    with strategy.scope():
        model = compiled(dense(), loss)
    with pytest.raises(hetero_cs.errors.LossPatternError, match="sample weights") as info:
        model.fit(x, y, sample_weight=weights, batch_size=6, epochs=1, verbose=0)
    assert "'reduced_mse'" in str(info.value) and "per-example losses" in str(info.value)


def test_a_scalar_loss_with_reduction_sum_is_read_and_exact():
    # Keras returns a loss function's scalar as it is, whatever the reduction: the loss reader reads the mean inside
    # (it was refused before: "cannot tell whether it is the slice's sum or its mean").
    x, y = regression_data()
    check_fit_and_evaluate(lambda: compiled(dense(), ReducedMeanSquaredError(reduction="sum", name="reduced_mse")),
                           x, y)


class SumOverride(keras.Sequential):
    """A compute_loss override returning a sum over the batch: not a mean, so it cannot weigh b_i / B."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return keras.ops.sum((y_pred - y) ** 2)


class SummedSquaredError(keras.losses.Loss):
    def call(self, y_true, y_pred):
        return tf.reduce_sum(tf.square(y_true - y_pred))


def test_a_scalar_sum_over_the_batch_from_a_loss_function_is_kept_as_a_sum_and_exact():
    # One device's loss is the batch's sum; each replica's sum over its slice is its share (refused before).
    x, y = regression_data()
    check_fit_and_evaluate(lambda: compiled(dense(), SummedSquaredError(name="summed")), x, y)


class SummedActivity(keras.layers.Layer):
    """A layer adding a penalty summed over the batch (one device adds the whole batch's sum)."""

    def call(self, inputs):
        self.add_loss(0.01 * tf.reduce_sum(inputs ** 2))
        return inputs


def test_sums_over_the_batch_in_compute_loss_and_add_loss_are_kept_exactly():
    # A compute_loss override returning ops.sum of per-example losses, and a layer's add_loss of a tf.reduce_sum over
    # its inputs: each replica's part of the sum, unweighted, adds up to one device's (before, they were weighed as
    # means, off by 0.1 in the weights, or refused).
    x, y = regression_data()
    check_fit_and_evaluate(lambda: compiled(regularized(SumOverride), "mse"), x, y)

    def with_penalty():
        init = keras.initializers.GlorotUniform(0)
        return compiled(keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh",
                                                                                kernel_initializer=init),
                                          SummedActivity(), keras.layers.Dense(1, kernel_initializer=init)]), "mse")

    check_fit_and_evaluate(with_penalty, x, y)


# 2. Masked losses and mean_with_sample_weight ---------------------------------------------------------------------
def padded_sequences(n=23, steps=5, seed=3):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 9, size=(n, steps))
    for row, length in enumerate(rng.integers(1, steps + 1, size=n)):
        tokens[row, length:] = 0  # padding, masked by mask_zero=True
    targets = rng.normal(size=(n, steps, 1)).astype(np.float32)
    return tokens, targets


def masked_sequence_model(masking_layer: bool):
    first = (
        [keras.layers.Embedding(10, 4, mask_zero=True, embeddings_initializer=keras.initializers.RandomUniform(seed=1))]
        if not masking_layer
        else [keras.layers.Masking(0.0)]
    )
    model = keras.Sequential([
        keras.Input((5,) if not masking_layer else (5, 1)),
        *first,
        keras.layers.Dense(3, activation="tanh", kernel_initializer=keras.initializers.GlorotUniform(2)),  # keeps the mask
        keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(4)),
    ])
    return compiled(model, "mse", metrics=["mae"])


@pytest.mark.parametrize("masking_layer", [False, True], ids=["mask_zero", "Masking"])
def test_a_masked_loss_divides_by_the_whole_batchs_unmasked_count(masking_layer):
    tokens, targets = padded_sequences()
    x = tokens if not masking_layer else tokens[..., None].astype(np.float32)
    check_fit_and_evaluate(lambda: masked_sequence_model(masking_layer), x, targets)


def test_mean_with_sample_weight_divides_by_the_whole_batchs_weight_sum():
    x, y = regression_data()
    weights = np.random.default_rng(4).uniform(0.1, 2.0, size=len(x)).astype(np.float32)
    loss = keras.losses.MeanSquaredError(reduction="mean_with_sample_weight")
    check_fit_and_evaluate(lambda: compiled(dense(), loss, weighted_metrics=["mae"]), x, y, sample_weight=weights)


# 3. Per-output loss metrics ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("run_eagerly", [False, True])
def test_per_output_loss_metrics_of_a_multi_output_model_match_single_device(run_eagerly):
    x, y = regression_data()

    def build():
        inputs = keras.Input((3,))
        hidden = keras.layers.Dense(4, activation="tanh", kernel_initializer=keras.initializers.GlorotUniform(0))(inputs)
        first = keras.layers.Dense(1, name="first", kernel_initializer=keras.initializers.GlorotUniform(1))(hidden)
        second = keras.layers.Dense(1, name="second", kernel_initializer=keras.initializers.GlorotUniform(2))(hidden)
        model = keras.Model(inputs, [first, second])
        return compiled(model, ["mse", "mae"], run_eagerly, loss_weights=[1.0, 0.5])

    model = check_fit_and_evaluate(build, x, [y, -y])
    assert {"first_loss", "second_loss"} <= set(model.history.history)


# 4. A custom train_step as Keras' guide writes it -----------------------------------------------------------------
class GuideModel(keras.Model):
    """keras.io "Customizing what happens in fit()": compute_loss, then every metric, the loss tracker included."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


@pytest.mark.parametrize("run_eagerly", [False, True])
def test_a_custom_train_step_from_kerass_guide_logs_the_full_batch_loss(run_eagerly):
    x, y = regression_data()

    def build():
        inputs = keras.Input((3,))
        hidden = keras.layers.Dense(4, activation="tanh", kernel_initializer=keras.initializers.GlorotUniform(0))(inputs)
        outputs = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(1))(hidden)
        return compiled(GuideModel(inputs, outputs), "mse", run_eagerly, metrics=["mae"])

    check_fit_and_evaluate(build, x, y)


# 1 and 2 in a custom loop: a Keras loss called inside strategy.run -------------------------------------------------
@pytest.mark.parametrize("kind", ["reduces_itself", "masked"])
def test_keras_losses_in_a_custom_loop_are_exact(kind):
    tokens, targets = padded_sequences(17)
    if kind == "reduces_itself":
        x, y = regression_data(17)
        loss_fn = ReducedMeanSquaredError()

        def build():
            return dense()
    else:
        x, y = tokens, targets
        loss_fn = keras.losses.MeanSquaredError()

        def build():
            return keras.Sequential(masked_sequence_model(False).layers)

    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(6)  # 6, 6, 5
    reference, ref_opt = build(), keras.optimizers.SGD(0.1)
    ref_losses = []
    for xb, yb in dataset:
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, reference(xb, training=True))
        ref_opt.apply_gradients(zip(tape.gradient(loss, reference.trainable_variables), reference.trainable_variables))
        ref_losses.append(float(loss))

    strategy = strategy_for(SHARES)
    with strategy.scope():
        model, optimizer = build(), keras.optimizers.SGD(0.1)

    @tf.function
    def train_step(element):
        def step_fn(xb, yb):
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True))  # this replica's share of the batch's loss
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
            return loss

        return strategy.reduce("SUM", strategy.run(step_fn, args=element), axis=None)

    losses = [float(train_step(element)) for element in strategy.experimental_distribute_dataset(dataset)]
    np.testing.assert_allclose(losses, ref_losses, atol=ATOL)
    for ref_w, w in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(w, ref_w, atol=ATOL)


# ------------------------------------------------------------------------------------------------------------------
# An Embedding looked up without the batch: a Transformer's positions, Embedding(T, D)(arange(T))
# ------------------------------------------------------------------------------------------------------------------
class PositionalEmbedding(keras.layers.Layer):
    """Token embeddings plus position embeddings looked up for arange(T) (Keras' text-classification example)."""

    def __init__(self, length, vocabulary, dim, **kwargs):
        super().__init__(**kwargs)
        self.tokens = keras.layers.Embedding(vocabulary, dim,
                                             embeddings_initializer=keras.initializers.RandomNormal(seed=1))
        self.positions = keras.layers.Embedding(length, dim,
                                                embeddings_initializer=keras.initializers.RandomNormal(seed=2))
        self.length = length

    def call(self, x):
        return self.tokens(x) + self.positions(keras.ops.arange(self.length))


@pytest.mark.parametrize("shares", [[3, 1, 2], [1, 0, 1]])
def test_an_embedding_looked_up_without_the_batch_sums_its_rows_as_one_device_does(shares):
    # One device's gradient of Embedding(T, D)(arange(T)) has T rows, each summed over the batch; Adam squares each
    # row. The replicas' rows for the same positions must be added, not concatenated (Adam would square the parts).
    def build():
        model = keras.Sequential([keras.Input((6,), dtype="int32"), PositionalEmbedding(6, 11, 4),
                                  keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
        return model

    rng = np.random.default_rng(3)
    x, y = rng.integers(0, 11, size=(24, 6)).astype(np.int32), rng.normal(size=(24, 1)).astype(np.float32)
    keras.utils.set_random_seed(4)
    reference = build()
    with strategy_for(shares).scope():
        model = build()
    model.set_weights(reference.get_weights())
    reference.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    assert_same_state(reference, model)


class PositionsOfItsOwnLength(keras.Model):
    """Keras' NER example: positions arange(T) with T read from each batch's shape (batches padded to their own
    longest sequence), softmax tags, no Input layer (subclassed)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.tokens = keras.layers.Embedding(30, 4, embeddings_initializer=keras.initializers.RandomNormal(seed=1))
        self.positions = keras.layers.Embedding(16, 4, embeddings_initializer=keras.initializers.RandomNormal(seed=2))
        self.tags = keras.layers.Dense(6, activation="softmax", kernel_initializer=keras.initializers.GlorotUniform(3))

    def call(self, x):
        return self.tags(self.tokens(x) + self.positions(keras.ops.arange(keras.ops.shape(x)[-1])))


def test_regression_positions_of_a_batch_padded_to_its_own_length_sum_their_rows_as_one_device_does():
    # The row count of arange(T) is not known while tracing here: the replicas' rows were concatenated, and Adam
    # squared each replica's part of a row (Keras' NER example: weights 3e-2 off one device after 2 epochs).
    rng = np.random.default_rng(0)
    sentences = [rng.integers(1, 30, n) for n in rng.integers(3, 12, 40)]

    def dataset():
        rows = tf.data.Dataset.from_generator(lambda: ((s, s % 6) for s in sentences), output_signature=(
            tf.TensorSpec([None], tf.int64), tf.TensorSpec([None], tf.int64)))
        return rows.apply(tf.data.experimental.assert_cardinality(len(sentences))).padded_batch(16)

    def build():
        model = PositionsOfItsOwnLength()
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="sparse_categorical_crossentropy")
        model(np.ones((1, 5), np.int64))
        return model

    reference = build()
    with strategy_for([5, 0, 3]).scope():
        model = build()
    model.set_weights(reference.get_weights())
    reference.fit(dataset(), epochs=2, verbose=0)
    model.fit(dataset(), epochs=2, verbose=0)
    assert_same_state(reference, model)


# ------------------------------------------------------------------------------------------------------------------
# A loss reduced by the user's own code, then tape.gradient (a train_step override, a custom loop)
# ------------------------------------------------------------------------------------------------------------------
class OwnMeanModel(keras.Model):
    """A train_step that reduces its loss itself (no compute_loss, no Keras loss object), with the layers' losses."""

    def __init__(self, reduce_mean, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(4, activation="tanh", kernel_initializer=keras.initializers.GlorotUniform(0),
                                         kernel_regularizer=keras.regularizers.L2(0.05))
        self.out = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(1))
        self.reduce_mean = reduce_mean
        self.tracker = keras.metrics.Mean(name="loss")

    def call(self, x):
        return self.out(self.hidden(x))

    @property
    def metrics(self):
        return [self.tracker]

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.reduce_mean(tf.square(y - self(x, training=True))) + tf.add_n(self.losses)
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        self.tracker.update_state(loss)
        return {"loss": self.tracker.result()}


@pytest.mark.parametrize("reduce_mean", [tf.reduce_mean, keras.ops.mean], ids=["tf.reduce_mean", "ops.mean"])
def test_a_train_step_that_reduces_its_own_loss_is_exact(reduce_mean):
    # The slices' own means used to be summed unweighted (w 0.20 against 0.14 on one device, split [7, 3, 0]); each
    # is now weighed b_i / B, and the L2 term every replica adds counts once, as on one device.
    x, y = regression_data()

    def build():
        model = OwnMeanModel(reduce_mean)
        model(np.zeros((1, 3), np.float32))  # builds the layers
        return compiled(model)

    reference = build()
    ref_hist = reference.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
    with strategy_for([7, 3, 0]).scope():
        model = build()
    hist = model.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)  # batches 10, 10, 3
    assert_same_state(reference, model)
    assert_same_logs(ref_hist.history, hist.history)


def own_loss_step(kind, model, xb, yb, global_batch=6):
    """One replica's (or one device's) loss, reduced by hand in one of the ways custom loops do it."""
    if kind in ("gradient_penalty", "gradient_penalty_through_a_pad"):
        # An inner tape on the inputs, as WGAN-GP writes it: not weighted itself. Through a pad (keras-io's WGAN-GP
        # pads its images), the penalty holds the pad's gradient: a Slice by the input's shape.
        with tf.GradientTape() as inner:
            inner.watch(xb)
            pred = model(xb, training=True)
        slope = tf.norm(inner.gradient(pred, xb), axis=-1)
        return tf.reduce_mean(tf.square(pred - yb)) + 0.1 * tf.reduce_mean(tf.square(slope - 1.0))
    pred = model(xb, training=True)
    if kind == "sum_over_a_constant":  # TensorFlow's older idiom: the sum over the slice / the global batch size
        return tf.reduce_sum(tf.square(pred - yb)) / global_batch
    if kind == "weights_in_variables":  # loss weights kept in variables (annealed), around a mean and a sum
        if not LOSS_WEIGHTS:
            with tf.init_scope():
                LOSS_WEIGHTS.extend([tf.Variable(0.7, trainable=False), tf.Variable(0.3, trainable=False)])
        return (LOSS_WEIGHTS[0] * tf.reduce_mean(tf.square(pred - yb))
                + LOSS_WEIGHTS[1] * tf.reduce_sum(tf.abs(pred - yb)) / global_batch)
    return tf.reduce_mean(tf.square(pred - yb)) + 0.01 * tf.add_n([tf.nn.l2_loss(w) for w in model.trainable_weights])


def custom_loop_step(strategy, model, optimizer, loss_of):
    """A custom loop's step: ``strategy.run`` in a tf.function, each replica applying the gradient of
    ``loss_of(model, xb, yb)`` with a Keras optimizer."""

    @tf.function
    def train_step(element):
        def step_fn(xb, yb):
            with tf.GradientTape() as tape:
                loss = loss_of(model, xb, yb)
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

        strategy.run(step_fn, args=element)

    return train_step


LOSS_WEIGHTS: list = []  # two tf.Variable loss weights, made at first use (after the logical devices exist)


@pytest.mark.parametrize("kind", ["mean_plus_l2", "sum_over_a_constant", "gradient_penalty",
                                  "gradient_penalty_through_a_pad", "weights_in_variables"])
def test_a_custom_loop_loss_reduced_by_hand_is_exact(kind):
    x, y = regression_data(17)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(6)  # 6, 6, 5
    dense = padded_dense if kind == "gradient_penalty_through_a_pad" else globals()["dense"]
    reference, ref_opt = dense(), keras.optimizers.SGD(0.1)
    for xb, yb in dataset:
        with tf.GradientTape() as tape:
            loss = own_loss_step(kind, reference, xb, yb)
        ref_opt.apply_gradients(zip(tape.gradient(loss, reference.trainable_variables), reference.trainable_variables))

    strategy = strategy_for(SHARES)
    with strategy.scope():
        model, optimizer = dense(), keras.optimizers.SGD(0.1)

    train_step = custom_loop_step(strategy, model, optimizer, lambda m, xb, yb: own_loss_step(kind, m, xb, yb))
    for element in strategy.experimental_distribute_dataset(dataset):
        train_step(element)
    for ref_w, w in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(w, ref_w, atol=ATOL)


def test_a_loss_computed_in_a_nested_tf_function_is_refused_not_guessed():
    # Its inside cannot be read: a slice mean (to weigh b_i / B) and a share (to keep) look the same from outside.
    strategy = strategy_for(SHARES)
    with strategy.scope():
        model, optimizer = dense(), keras.optimizers.SGD(0.1)

    @tf.function
    def mean_squared_error(yb, pred):
        return tf.reduce_mean(tf.square(pred - yb))

    train_step = custom_loop_step(strategy, model, optimizer,
                                  lambda m, xb, yb: mean_squared_error(yb, m(xb, training=True)))

    x, y = regression_data(6)
    before = model.get_weights()
    element = next(iter(strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(6))))
    with pytest.raises(hetero_cs.errors.LossPatternError, match="nested tf.function"):
        train_step(element)
    for old, new in zip(before, model.get_weights()):
        np.testing.assert_array_equal(old, new)


def test_nadam_is_exact():
    # Nadam writes its own state (_u_product) through Keras' TFOptimizer.assign inside the replica step; that raised
    # TensorFlow's "You must specify an aggregation method" at the first step.
    x, y = regression_data()
    check_fit_and_evaluate(lambda: _compiled_with(keras.optimizers.Nadam(0.05)), x, y)


def _compiled_with(optimizer):
    model = dense()
    model.compile(optimizer=optimizer, loss="mse")
    return model


def test_an_optimizer_with_use_ema_is_refused_with_the_fix_and_changes_nothing():
    x, y = regression_data()
    with strategy_for(SHARES).scope():
        model = _compiled_with(keras.optimizers.Adam(0.05, use_ema=True))
    before = model.get_weights()
    with pytest.raises(hetero_cs.ConfigError, match="use_ema=True.*Train with use_ema=False"):
        model.fit(x, y, batch_size=6, epochs=1, verbose=0)
    for old, new in zip(before, model.get_weights()):
        np.testing.assert_array_equal(old, new)


def test_an_l2_loss_of_residuals_is_read_as_a_sum_and_exact():
    # tf.nn.l2_loss sums over the batch (half the sum of squares): each replica's is its share (refused before).
    x, y = regression_data(12)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(6)
    reference, ref_opt = dense(), keras.optimizers.SGD(0.01)
    for xb, yb in dataset:
        with tf.GradientTape() as tape:
            loss = tf.nn.l2_loss(reference(xb, training=True) - yb)
        ref_opt.apply_gradients(zip(tape.gradient(loss, reference.trainable_variables), reference.trainable_variables))
    strategy = strategy_for(SHARES)
    with strategy.scope():
        model, optimizer = dense(), keras.optimizers.SGD(0.01)
    train_step = custom_loop_step(strategy, model, optimizer, lambda m, xb, yb: tf.nn.l2_loss(m(xb, training=True) - yb))
    for element in strategy.experimental_distribute_dataset(dataset):
        train_step(element)
    assert_same_state(reference, model)


def test_a_norm_of_residuals_is_refused_naming_the_op():
    # tf.norm is the square root of a sum over the batch: not linear in the examples' values, so no replica's part
    # adds up to one device's. Refused before the first update, naming the op.
    strategy = strategy_for(SHARES)
    with strategy.scope():
        model, optimizer = dense(), keras.optimizers.SGD(0.1)
    train_step = custom_loop_step(strategy, model, optimizer,
                                  lambda m, xb, yb: tf.square(tf.norm(m(xb, training=True) - yb)))
    x, y = regression_data(6)
    before = model.get_weights()
    element = next(iter(strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(6))))
    with pytest.raises(hetero_cs.errors.LossPatternError, match="(Sqrt|Square|Pow) op .* is not linear"):
        train_step(element)
    for old, new in zip(before, model.get_weights()):
        np.testing.assert_array_equal(old, new)
