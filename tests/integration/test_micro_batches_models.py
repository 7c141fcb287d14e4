"""Micro-batched realistic models against single-device Keras (``-m slow``: outside the default run's time budget).

The cards hold 16, 64 and 64 examples; every global batch below is larger than the 144 they hold together, with a
partial last batch. Each model trains the same batches on one device and under the strategy, and the weights,
optimizer iterations and logged figures must agree (the default run covers the mechanics in test_micro_batches.py).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from test_micro_batches import CAPACITY, DEVICES, assert_same_training, emulator

from hetero_cs import HeteroCentralStorageStrategy

pytestmark = pytest.mark.slow
B = 2 * CAPACITY + 5


@pytest.fixture(autouse=True)
def fast_emulation(monkeypatch, tmp_path):
    monkeypatch.setenv("HETERO_CS_EMULATION_TARGET_MAKESPAN_MS", "10")
    monkeypatch.setenv("HETERO_CS_CACHE_DIR", str(tmp_path))


def compare(build, x, y, atol=1e-5, **fit_kwargs):
    reference = build()
    reference_history = reference.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0, **fit_kwargs)
    strategy = HeteroCentralStorageStrategy(DEVICES, emulate=emulator(), profile_cache=False, rebalance=False)
    with strategy.scope():
        model = build()
    history = model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0, **fit_kwargs)
    assert strategy.micro_batching.micro_batched_steps >= 1
    assert_same_training(model, history, reference, reference_history, atol=atol)


def test_a_small_cnn():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2 * B + 7, 8, 8, 1)).astype(np.float32)
    y = rng.integers(0, 4, size=2 * B + 7)

    def build():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(4, 3, activation="relu"),
                                  keras.layers.MaxPooling2D(), keras.layers.Flatten(), keras.layers.Dense(4)])
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
        return model

    compare(build, x, y)


def test_an_lstm():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2 * B + 7, 5, 3)).astype(np.float32)
    y = rng.normal(size=(2 * B + 7, 1)).astype(np.float32)

    def build():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((5, 3)), keras.layers.LSTM(6), keras.layers.Dense(1)])
        model.compile(optimizer="rmsprop", loss="mse")
        return model

    compare(build, x, y)


def test_a_transformer_block_with_an_embedding_and_adam():
    rng = np.random.default_rng(0)
    x = rng.integers(1, 20, size=(2 * B + 7, 6)).astype(np.int32)
    y = rng.integers(0, 2, size=2 * B + 7)

    def build():
        keras.utils.set_random_seed(1)
        inputs = keras.Input((6,))
        h = keras.layers.Embedding(20, 8)(inputs)
        h = keras.layers.LayerNormalization()(h + keras.layers.MultiHeadAttention(2, 4)(h, h))
        outputs = keras.layers.Dense(1, activation="sigmoid")(keras.layers.GlobalAveragePooling1D()(h))
        model = keras.Model(inputs, outputs)
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="binary_crossentropy", metrics=["accuracy"])
        return model

    compare(build, x, y)


def test_a_train_step_override_with_compute_loss():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2 * B + 7, 8)).astype(np.float32)
    y = rng.normal(size=(2 * B + 7, 1)).astype(np.float32)

    class Regressor(keras.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
            gradients = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
                else:
                    metric.update_state(y, y_pred)
            return {metric.name: metric.result() for metric in self.metrics}

    def build():
        keras.utils.set_random_seed(1)
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(16, activation="relu", kernel_regularizer="l2")(inputs)
        model = Regressor(inputs, keras.layers.Dense(1)(hidden))
        model.compile(optimizer="adam", loss="mse", metrics=["mae"])
        return model

    compare(build, x, y)


def test_adamw_with_a_schedule_global_clipnorm_and_class_weights():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2 * B + 7, 8)).astype(np.float32)
    y = (x[:, 0] > 0.3).astype(np.int32)

    def build():
        keras.utils.set_random_seed(1)
        schedule = keras.optimizers.schedules.CosineDecay(0.01, decay_steps=10, warmup_target=0.02, warmup_steps=2)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.AdamW(schedule, global_clipnorm=0.5),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), weighted_metrics=["accuracy"])
        return model

    compare(build, x, y, class_weight={0: 1.0, 1: 3.0})
