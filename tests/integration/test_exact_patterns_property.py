"""Property: for a random split (0-example slices included) and one of issue 14's Keras patterns, model.fit and
model.evaluate under the strategy equal single-device training (weights, optimizer slots, logged loss, metrics)."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_exact_patterns import (
    AccumulatingForms,
    AddsToKerasLoss,
    GuideModel,
    MeanOverride,
    assert_same_logs,
    assert_same_state,
    compiled,
    dense,
    mean_squared_error_reduced,
    regularized,
    strategy_for,
)


def guide_model():
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(4, activation="tanh", kernel_initializer=keras.initializers.GlorotUniform(0))(inputs)
    outputs = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(1))(hidden)
    return compiled(GuideModel(inputs, outputs), "mse", metrics=["mae"])


def two_outputs():
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(4, activation="tanh", kernel_initializer=keras.initializers.GlorotUniform(0))(inputs)
    first = keras.layers.Dense(1, name="first", kernel_initializer=keras.initializers.GlorotUniform(1))(hidden)
    second = keras.layers.Dense(1, name="second", kernel_initializer=keras.initializers.GlorotUniform(2))(hidden)
    return compiled(keras.Model(inputs, [first, second]), ["mse", "mae"], loss_weights=[1.0, 0.5])


def masked_dense():
    model = keras.Sequential([
        keras.Input((4, 3)),
        keras.layers.Masking(0.0),
        keras.layers.Dense(2, kernel_initializer=keras.initializers.GlorotUniform(5)),
    ])
    return compiled(model, "mse", metrics=["mae"])


# pattern -> (model builder, data kind)
PATTERNS = {
    "scalar_loss": (lambda: compiled(dense(), mean_squared_error_reduced, metrics=["mae"]), "plain"),
    "compute_loss_mean": (lambda: compiled(regularized(MeanOverride), "mse"), "plain"),
    "compute_loss_mixed": (lambda: compiled(regularized(AddsToKerasLoss), "mse"), "plain"),
    "masked": (masked_dense, "masked"),
    "mean_with_sample_weight": (
        lambda: compiled(dense(), keras.losses.MeanSquaredError(reduction="mean_with_sample_weight"),
                         weighted_metrics=["mae"]),
        "weighted",
    ),
    "per_output_metrics": (two_outputs, "two_outputs"),
    "custom_train_step": (guide_model, "plain"),
    "metric_forms": (lambda: compiled(dense(), "mse", metrics=[AccumulatingForms()]), "plain"),
    "seeded_shuffle": (lambda: compiled(dense(), "mse", metrics=["mae"]), "shuffled"),
}


def make_data(kind, n, rng):
    x = rng.normal(size=(n, 3)).astype(np.float32)
    y = (x[:, :1] + rng.normal(size=(n, 1))).astype(np.float32)
    if kind == "masked":  # padded rows of 4 steps: zeros are masked
        x = rng.normal(size=(n, 4, 3)).astype(np.float32)
        for row, length in enumerate(rng.integers(1, 5, size=n)):
            x[row, length:] = 0.0
        return x, rng.normal(size=(n, 4, 2)).astype(np.float32), None
    if kind == "weighted":
        return x, y, rng.uniform(0.1, 2.0, size=n).astype(np.float32)
    if kind == "two_outputs":
        return x, [y, -2 * y], None
    return x, y, None


def run(model, kind, x, y, sample_weight, batch_size):
    if kind == "shuffled":
        data = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=1).batch(batch_size)
        history = model.fit(data, epochs=2, verbose=0)
        return history, model.evaluate(data, verbose=0, return_dict=True)
    history = model.fit(x, y, sample_weight=sample_weight, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    logs = model.evaluate(x, y, sample_weight=sample_weight, batch_size=batch_size, verbose=0, return_dict=True)
    return history, logs


def check_pattern(data, pattern, num_replicas, batch_size):
    shares = data.draw(
        st.lists(st.integers(0, 4), min_size=num_replicas, max_size=num_replicas).filter(lambda s: sum(s) > 0),
        label="shares",
    )
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    n = 2 * batch_size - data.draw(st.integers(0, batch_size - 1), label="short")  # maybe a partial last batch
    build, kind = PATTERNS[pattern]
    x, y, sample_weight = make_data(kind, n, rng)
    reference = build()
    ref_hist, expected = run(reference, kind, x, y, sample_weight, batch_size)
    strategy = strategy_for(shares)
    with strategy.scope():
        model = build()
    hist, got = run(model, kind, x, y, sample_weight, batch_size)
    assert_same_state(reference, model)
    assert_same_logs(ref_hist.history, hist.history, atol=1e-4 if pattern == "metric_forms" else 1e-5)
    assert_same_logs(expected, got, atol=1e-4 if pattern == "metric_forms" else 1e-5)


PATTERN_AND_SPLIT = given(
    data=st.data(),
    pattern=st.sampled_from(sorted(PATTERNS)),
    num_replicas=st.integers(2, 4),
    batch_size=st.integers(3, 9),
)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@PATTERN_AND_SPLIT
def test_random_split_and_pattern_match_single_device(data, pattern, num_replicas, batch_size):
    check_pattern(data, pattern, num_replicas, batch_size)


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@PATTERN_AND_SPLIT
def test_random_split_and_pattern_match_single_device_long(data, pattern, num_replicas, batch_size):
    check_pattern(data, pattern, num_replicas, batch_size)
