"""XLA per replica: ``compile(jit_compile=True)`` under the central-storage strategy, against one device with XLA.

The oracle is the same model fit on one device with ``jit_compile=True`` (Keras compiles its whole step there).
Under the strategy each replica's forward pass, loss and gradient are one XLA function on its device; that the step
went that way is counted where hetero_cs builds it (``_cut_step``), and a layer XLA cannot compile proves that
the function really is compiled.
"""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

from fixed_splits import strategy_for
from test_mixed_precision import global_policy

from hetero_cs import HeteroCentralStorageStrategy
from hetero_cs.engine._compat import replica_pass
from hetero_cs.errors import ConfigError

ATOL = 1e-5


@pytest.fixture
def compiled_steps(monkeypatch):
    """Counts the replica train steps traced with a compiled forward and backward pass."""
    calls = []
    original = replica_pass._cut_step

    def counting(model, data, step, *, jit, skip_when_empty, **kwargs):
        if jit:
            calls.append(step.replica_id)
        return original(model, data, step, jit=jit, skip_when_empty=skip_when_empty, **kwargs)

    monkeypatch.setattr(replica_pass, "_cut_step", counting)
    return calls


def assert_same_training(model, history, reference, reference_history, atol=ATOL):
    for w, ref in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(w, ref, atol=atol)
    for v, ref in zip(model.optimizer.variables, reference.optimizer.variables):
        np.testing.assert_allclose(np.asarray(v), np.asarray(ref), atol=atol, err_msg=v.path)
    assert set(reference_history.history) <= set(history.history)  # (plans may add makespan_ms, ...)
    for key, values in reference_history.history.items():
        np.testing.assert_allclose(history.history[key], values, atol=atol, err_msg=key)


def compare(build, x, y, shares, *, batch_size, epochs=2, strategy=None, atol=ATOL, **fit_kwargs):
    reference = build()
    reference_history = reference.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0,
                                      **fit_kwargs)
    strategy = strategy or strategy_for(shares)
    with strategy.scope():
        model = build()
    assert model.jit_compile is True
    history = model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, **fit_kwargs)
    assert model.jit_compile is True  # what the user compiled with, after fit too
    assert_same_training(model, history, reference, reference_history, atol=atol)
    return model


def regularized_classifier():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(16, activation="relu", kernel_regularizer="l2", activity_regularizer="l1"),
        keras.layers.LayerNormalization(),
        keras.layers.Dense(3),
    ])
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], weighted_metrics=["accuracy"], jit_compile=True)
    return model


def classification_data(n=100):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int32), rng.uniform(size=n).astype(np.float32)


def test_uneven_splits_with_an_idle_replica_and_a_partial_batch_equal_one_device_with_xla(compiled_steps):
    # Sample weights, kernel and activity regularizers, LayerNormalization, Adam, weighted metrics; 100 examples in
    # batches of 32 leave a last batch of 4; the share 0 idles replica 1 (it runs no step at all).
    x, y, sample_weight = classification_data()
    compare(regularized_classifier, x, y, [5, 0, 2], batch_size=32, sample_weight=sample_weight)
    assert {0, 2} <= set(compiled_steps)  # (the first trace also has the branch in which every replica steps)


def test_two_outputs_with_loss_weights_and_per_output_metrics_equal_one_device_with_xla(compiled_steps, caplog):
    # Keras updates each output's loss tracker inside _compute_loss, in the compiled function: their sums come out
    # of it and are added to the central trackers (regression: XLA read them on the parameter device and failed).
    # A tracker's value is the loss unscaled (the share divided by b_i / B), read without an all-reduce (regression:
    # the loss reader took it for a ratio of batch aggregates, and the step fell back from XLA with a warning).
    def build():
        keras.utils.set_random_seed(6)
        inputs = {"a": keras.Input((8,), name="a"), "b": keras.Input((2,), name="b")}
        hidden = keras.layers.Dense(8, activation="tanh")(keras.layers.Concatenate()([inputs["a"], inputs["b"]]))
        model = keras.Model(inputs, {"cls": keras.layers.Dense(3, name="cls")(hidden),
                                     "reg": keras.layers.Dense(1, name="reg")(hidden)})
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss={"cls": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "reg": "mse"},
                      loss_weights={"cls": 1.0, "reg": 0.5}, metrics={"cls": ["accuracy"], "reg": ["mae"]},
                      jit_compile=True)
        return model

    x, y, _ = classification_data(50)
    features = {"a": x, "b": x[:, :2] * 2.0}
    with caplog.at_level(logging.WARNING, logger="hetero_cs"):
        compare(build, features, {"cls": y, "reg": x[:, :1]}, [3, 1, 2], batch_size=16)
    assert compiled_steps
    assert not [r.getMessage() for r in caplog.records if "XLA" in r.getMessage()]


def test_a_loss_normalised_across_replicas_trains_without_xla_with_a_warning(compiled_steps, caplog):
    # reduction="mean_with_sample_weight" divides by the whole global batch's sample weights: an all-reduce inside
    # the loss, which a per-replica function cannot hold. Found while tracing; the step runs Keras' own.
    def build():
        keras.utils.set_random_seed(7)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss=keras.losses.MeanSquaredError(reduction="mean_with_sample_weight"),
                      jit_compile=True)
        return model

    x, _, sample_weight = classification_data(30)
    with caplog.at_level(logging.WARNING, logger="hetero_cs"):
        compare(build, x, x[:, :1], [2, 1], batch_size=10, epochs=1, sample_weight=sample_weight)
    assert compiled_steps  # tried, then fell back
    warnings = [r.getMessage() for r in caplog.records if "all-reduces across replicas" in r.getMessage()]
    assert len(warnings) == 1, warnings


def test_a_layer_xla_cannot_compile_fails_with_the_fix_and_changes_nothing(compiled_steps):
    def through_strings(t):  # each example's own values, by string ops XLA cannot compile
        return tf.strings.to_number(tf.strings.as_string(t))

    def build(jit_compile):
        keras.utils.set_random_seed(1)
        inputs = keras.Input((3,))
        through_python = keras.layers.Lambda(through_strings, output_shape=(3,))(inputs)
        model = keras.Model(inputs, keras.layers.Dense(1)(through_python))
        model.compile(optimizer="adam", loss="mse", jit_compile=jit_compile)
        return model

    x, y = np.ones((12, 3), np.float32), np.ones((12, 1), np.float32)
    with strategy_for([2, 1]).scope():
        model = build(True)
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ConfigError, match=r"XLA could not compile a replica's forward and backward pass.*"
                                          r"jit_compile=False") as raised:
        model.fit(x, y, batch_size=6, epochs=1, verbose=0)
    assert "AsString" in str(raised.value) or "StringToNumber" in str(raised.value)
    assert compiled_steps  # it failed in the compiled function
    for w, old in zip(model.get_weights(), before):
        np.testing.assert_array_equal(w, old)
    assert int(model.optimizer.iterations) == 0
    with strategy_for([2, 1]).scope():
        model = build(False)
    model.fit(x, y, batch_size=6, epochs=1, verbose=0)  # the fix the message names trains
    assert int(model.optimizer.iterations) == 2


def test_batch_normalization_trains_without_xla_with_a_warning_naming_the_layer(compiled_steps, caplog):
    def build():
        keras.utils.set_random_seed(2)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6),
                                  keras.layers.BatchNormalization(name="the_bn"), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse", jit_compile=True)
        return model

    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(24, 4)).astype(np.float32), rng.normal(size=(24, 1)).astype(np.float32)
    with caplog.at_level(logging.WARNING, logger="hetero_cs"):
        compare(build, x, y, [3, 1], batch_size=8, epochs=1, atol=1e-4)
    assert not compiled_steps
    messages = [r.getMessage() for r in caplog.records if "jit_compile=True" in r.getMessage()]
    assert len(messages) == 1 and "'the_bn'" in messages[0] and "trains exactly" in messages[0]


def test_a_train_step_override_trains_without_xla_with_a_warning(compiled_steps, caplog):
    class OwnStep(keras.Sequential):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
            self.optimizer.apply_gradients(zip(tape.gradient(loss, self.trainable_variables),
                                               self.trainable_variables))
            return {"loss": loss}

    with strategy_for([2, 1]).scope():
        model = OwnStep([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    with caplog.at_level(logging.WARNING, logger="hetero_cs"):
        model.fit(np.ones((6, 2), np.float32), np.ones((6, 1), np.float32), batch_size=6, verbose=0)
    assert not compiled_steps
    assert any("OwnStep overrides train_step" in r.getMessage() for r in caplog.records)


def test_a_jit_compile_setting_that_is_not_a_bool_is_refused_with_the_values_that_work():
    with strategy_for([1, 1]).scope():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse", jit_compile="yes")  # Keras stores what it is given
    x = np.ones((4, 2), np.float32)
    for call in (lambda: model.fit(x, x[:, :1], verbose=0), lambda: model.predict(x, verbose=0)):
        with pytest.raises(ConfigError, match=r"must be True, False or \"auto\"\. Received: jit_compile='yes'"):
            call()


def test_auto_turns_xla_on_where_keras_would_on_one_device(monkeypatch):
    def build():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")  # jit_compile="auto"
        return model

    with strategy_for([1, 1]).scope():
        assert build().jit_compile is False  # a CPU-only machine: off, as on one device
    real = tf.config.list_physical_devices
    gpu = tf.config.PhysicalDevice(name="/physical_device:GPU:0", device_type="GPU")
    monkeypatch.setattr(tf.config, "list_physical_devices",
                        lambda device_type=None: real(device_type) + ([gpu] if device_type in (None, "GPU") else []))
    with strategy_for([1, 1]).scope():
        assert build().jit_compile is True  # what Keras resolves on one GPU; stock Keras says False under any strategy
    assert keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]).jit_compile is True


@pytest.mark.slow
def test_mixed_float16_loss_scaling_equals_one_device_with_xla(compiled_steps):
    def build():
        keras.utils.set_random_seed(4)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(3, dtype="float32")])
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=True)
        return model

    x, y, _ = classification_data(60)
    with global_policy("mixed_float16"):
        model = compare(build, x, y, [3, 1, 2], batch_size=20, atol=2e-3)
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert compiled_steps


@pytest.mark.slow
def test_a_masked_gru_with_dropout_free_embedding_equals_one_device_with_xla(compiled_steps):
    def build():
        keras.utils.set_random_seed(5)
        model = keras.Sequential([keras.Input((6,), dtype="int32"), keras.layers.Embedding(12, 4, mask_zero=True),
                                  keras.layers.GRU(5), keras.layers.Dense(1)])
        model.compile(optimizer="rmsprop", loss="mse", metrics=["mae"], jit_compile=True)
        return model

    rng = np.random.default_rng(3)
    x = rng.integers(1, 12, size=(40, 6)).astype(np.int32)
    x[:, 4:] = 0  # padding the mask hides
    x[::3, 2:] = 0
    y = rng.normal(size=(40, 1)).astype(np.float32)
    compare(build, x, y, [1, 3, 0, 2], batch_size=12)
    assert compiled_steps


@pytest.mark.slow
def test_micro_batched_slices_equal_one_device_with_xla(compiled_steps):
    from hetero_cs.planning import LinearCostModel

    strategy = HeteroCentralStorageStrategy([f"/cpu:{i}" for i in (1, 2, 3)], profile_cache=False,
                                            rebalance=False, micro_batches=True)
    strategy.set_cost_models([LinearCostModel(1e-3, 1e-5), LinearCostModel(1e-3, 4e-5),
                              LinearCostModel(1e-3, 4e-5)], max_batch_sizes=[4, 16, 16])
    x, y, sample_weight = classification_data(90)
    compare(regularized_classifier, x, y, None, batch_size=40, strategy=strategy, sample_weight=sample_weight)
    assert strategy.micro_batching.micro_batched_steps >= 1
    assert compiled_steps


def test_a_custom_loops_xla_function_runs_without_xla_with_a_warning_and_stays_exact(caplog):
    import hetero_cs

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 3)).astype(np.float32), rng.normal(size=(8, 1)).astype(np.float32)

    def build():
        keras.utils.set_random_seed(1)
        return keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])

    strategy = strategy_for([3, 1])
    with strategy.scope():
        model, optimizer = build(), keras.optimizers.SGD(0.1)
        optimizer.build(model.trainable_variables)

    @tf.function(jit_compile=True)
    def replica_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(tf.square(model(x) - y)[:, 0],
                                              global_batch_size=hetero_cs.current_global_batch_size())
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    @tf.function
    def train_step(batch):
        return strategy.reduce("SUM", strategy.run(replica_step, args=batch), axis=None)

    dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(8))
    with caplog.at_level(logging.WARNING, logger="hetero_cs"):
        loss = float(train_step(next(iter(dataset))))
    assert any("runs its replica function without XLA" in r.getMessage() for r in caplog.records)

    reference, reference_optimizer = build(), keras.optimizers.SGD(0.1)
    with tf.GradientTape() as tape:
        reference_loss = tf.reduce_mean(tf.square(reference(x) - y))
    gradients = tape.gradient(reference_loss, reference.trainable_variables)
    reference_optimizer.apply_gradients(zip(gradients, reference.trainable_variables))
    np.testing.assert_allclose(loss, float(reference_loss), atol=ATOL)
    for w, ref in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(w, ref, atol=ATOL)
