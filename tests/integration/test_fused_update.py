"""The host update compiled with XLA (``fused_update``): where it applies, and that it stays exact.

Whether the update was compiled is counted at the one place that builds the compiled function. The oracle is the same model trained on one device without any
strategy (and so without XLA: Keras compiles nothing on a CPU-only machine).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from hetero_cs import HeteroCentralStorageStrategy
from hetero_cs.engine.step import fused_update
from hetero_cs.errors import ConfigError

SHARES = [5, 3, 2]
DEVICES = [f"/cpu:{i}" for i in range(1, len(SHARES) + 1)]
_STRATEGIES: dict = {}


def strategy_with(setting):
    """One strategy per setting for the module (logical devices are configured once per process)."""
    if setting not in _STRATEGIES:
        _STRATEGIES[setting] = HeteroCentralStorageStrategy(
            DEVICES, batch_split=SHARES, profile_cache=False, fused_update=setting
        )
    return _STRATEGIES[setting]


class ScaledSGD(keras.optimizers.SGD):
    """A user's optimizer: SGD whose step is scaled by a constant (not one of Keras' own classes)."""

    def update_step(self, gradient, variable, learning_rate):
        super().update_step(gradient * 0.5, variable, learning_rate)


def make_model(optimizer, *, embedding=False):
    init = keras.initializers.GlorotUniform(seed=3)
    if embedding:
        layers = [keras.Input((2,), dtype="int32"), keras.layers.Embedding(7, 3, embeddings_initializer=init),
                  keras.layers.Flatten()]
    else:
        layers = [keras.Input((3,)), keras.layers.Dense(8, activation="tanh", kernel_initializer=init)]
    model = keras.Sequential(layers + [keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(4))])
    model.compile(optimizer=optimizer, loss="mse", metrics=["mae"])
    return model


def data(embedding=False):
    rng = np.random.RandomState(0)
    x = rng.randint(0, 7, size=(40, 2)).astype("int32") if embedding else rng.normal(size=(40, 3)).astype("float32")
    return x, rng.normal(size=(40, 1)).astype("float32")


def train(setting, optimizer_factory, *, embedding=False, epochs=2):
    x, y = data(embedding)
    reference = make_model(optimizer_factory(), embedding=embedding)
    ref_history = reference.fit(x, y, batch_size=10, epochs=epochs, shuffle=False, verbose=0)
    strategy = strategy_with(setting)
    with strategy.scope():
        model = make_model(optimizer_factory(), embedding=embedding)
    history = model.fit(x, y, batch_size=10, epochs=epochs, shuffle=False, verbose=0)
    return reference, ref_history, model, history


def assert_same_training(reference, ref_history, model, history):
    for ref_w, w in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(w, ref_w, atol=1e-5)
    for ref_v, v in zip(reference.optimizer.variables, model.optimizer.variables):
        np.testing.assert_allclose(np.asarray(v), np.asarray(ref_v), atol=1e-5, err_msg=v.path)
    np.testing.assert_allclose(history.history["loss"], ref_history.history["loss"], atol=1e-5)
    assert int(model.optimizer.iterations) == int(reference.optimizer.iterations) == 8


@pytest.fixture
def compiled_traces(monkeypatch):
    """Counts the host updates traced as XLA functions (calls of what fused_update.compiled returns)."""
    calls = []
    original = fused_update.compiled

    def counting(update, device):
        run = original(update, device)

        def counted(grads_and_vars):
            calls.append(device)
            return run(grads_and_vars)

        return counted

    monkeypatch.setattr(fused_update, "compiled", counting)
    return calls


@pytest.mark.parametrize("optimizer_name", ["adam", "adamw", "sgd_momentum", "rmsprop", "adam_clipnorm"])
def test_the_default_compiles_keras_optimizers_and_matches_one_device(optimizer_name, compiled_traces):
    factory = {
        "adam": lambda: keras.optimizers.Adam(0.05),
        "adamw": lambda: keras.optimizers.AdamW(0.05, weight_decay=0.1),
        "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
        "rmsprop": lambda: keras.optimizers.RMSprop(0.05),
        "adam_clipnorm": lambda: keras.optimizers.Adam(0.05, global_clipnorm=0.1),
    }[optimizer_name]
    reference, ref_history, model, history = train(None, factory)
    assert compiled_traces and set(compiled_traces) == {"/device:CPU:0"}
    assert_same_training(reference, ref_history, model, history)


def test_false_runs_the_update_uncompiled_and_matches_one_device(compiled_traces):
    reference, ref_history, model, history = train(False, lambda: keras.optimizers.Adam(0.05))
    assert not compiled_traces
    assert_same_training(reference, ref_history, model, history)


def test_a_users_optimizer_is_compiled_only_when_asked_for(compiled_traces):
    reference, ref_history, model, history = train(None, lambda: ScaledSGD(0.05))
    assert not compiled_traces
    assert_same_training(reference, ref_history, model, history)
    reference, ref_history, model, history = train(True, lambda: ScaledSGD(0.05))
    assert compiled_traces
    assert_same_training(reference, ref_history, model, history)


def test_sparse_gradients_are_left_uncompiled_by_default(compiled_traces):
    reference, ref_history, model, history = train(None, lambda: keras.optimizers.Adam(0.05), embedding=True)
    assert not compiled_traces
    assert_same_training(reference, ref_history, model, history)


def test_applies_follows_the_setting_the_optimizer_and_the_gradients():
    adam, user = keras.optimizers.Adam(), ScaledSGD()
    dense = [tf.zeros([2]), None]
    sparse = [tf.IndexedSlices(tf.zeros([1, 2]), tf.constant([0]), tf.constant([3, 2]))]

    def traced(setting, optimizer, grads):  # as while tracing a training step
        with tf.Graph().as_default():
            return fused_update.applies(setting, optimizer, grads)

    assert traced(None, adam, dense) and traced(True, adam, dense) and not traced(False, adam, dense)
    assert not traced(None, user, dense) and traced(True, user, dense)
    assert not traced(None, adam, sparse) and traced(True, adam, sparse)
    assert not fused_update.applies(True, adam, dense)  # executing eagerly: never


@pytest.mark.parametrize("bad", ["yes", 1, 0.0])
def test_a_bad_setting_is_a_config_error_naming_the_value(bad):
    with pytest.raises(ConfigError, match=r"fused_update=.*" + repr(bad).replace(".", r"\.")):
        HeteroCentralStorageStrategy(DEVICES, fused_update=bad, profile_cache=False)


class PyFunctionSGD(keras.optimizers.SGD):
    """A user's optimizer whose update runs a Python function, which XLA cannot compile."""

    def update_step(self, gradient, variable, learning_rate):
        halved = tf.py_function(lambda g: g * 0.5, [gradient], gradient.dtype)
        super().update_step(tf.reshape(halved, tf.shape(gradient)), variable, learning_rate)


def test_an_update_xla_cannot_compile_is_a_config_error_with_the_fix_and_false_runs_it():
    x, y = data()
    with strategy_with(True).scope():
        model = make_model(PyFunctionSGD(0.05))
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ConfigError, match=r"XLA could not compile the optimizer's update.*fused_update=False"):
        model.fit(x, y, batch_size=10, epochs=1, shuffle=False, verbose=0)
    for w0, w in zip(before, model.get_weights()):
        np.testing.assert_array_equal(w, w0)  # nothing of the failed step applied
    reference = make_model(PyFunctionSGD(0.05))
    ref_history = reference.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
    with strategy_with(False).scope():
        model = make_model(PyFunctionSGD(0.05))
    history = model.fit(x, y, batch_size=10, epochs=2, shuffle=False, verbose=0)
    assert_same_training(reference, ref_history, model, history)
