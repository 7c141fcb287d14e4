"""When a step fails, the error raised is that step's, not a later prefetched batch's InputError."""

import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from hetero_cs import HeteroCentralStorageStrategy, InputError, ReplicaStepError

NUM_CLASSES = 3


MARKER = 1000.0  # x value of the example with the bad label


def _batches(bad_label_batch: int | None, mismatched_batch: int | None, n: int = 6):
    """Global batches of 6: one with an out-of-range label (at example 3, replica 1's slice [2, 4)) and/or a later
    one whose x and y hold different numbers of examples (the input pipeline raises InputError for it)."""
    rng = np.random.default_rng(0)
    for index in range(n):
        x = rng.normal(size=(6, 4)).astype(np.float32)
        y = rng.integers(0, NUM_CLASSES, size=6).astype(np.int64)
        if index == bad_label_batch:
            y[3] = 10
            x[3, 0] = MARKER
        if index == mismatched_batch:
            y = y[:5]
        yield x, y


def _dataset(bad_label_batch, mismatched_batch):
    signature = (tf.TensorSpec([None, 4], tf.float32), tf.TensorSpec([None], tf.int64))
    return tf.data.Dataset.from_generator(lambda: _batches(bad_label_batch, mismatched_batch),
                                          output_signature=signature)


class WaitForThePipeline(keras.layers.Layer):
    """Identity; on the slice with the marked example it first waits (at most 20 s) until the input pipeline has
    run ahead into the mismatched batch and kept its InputError, so the race the regression needs is not left to
    chance."""

    def __init__(self, strategy, **kwargs):
        super().__init__(**kwargs)
        self.strategy = strategy

    def call(self, x):
        def wait(values):
            if np.abs(values).max() >= MARKER:
                deadline = time.monotonic() + 20.0
                while not self.strategy._input_errors and time.monotonic() < deadline:  # noqa: SLF001
                    time.sleep(0.01)
            return values

        waited = tf.numpy_function(wait, [x], x.dtype, stateful=True)
        with tf.control_dependencies([waited]):  # outside the data path, which the loss reader reads
            return tf.identity(x)


def _model(strategy):
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), WaitForThePipeline(strategy), keras.layers.Dense(NUM_CLASSES)])
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.fixture
def strategy():
    return HeteroCentralStorageStrategy(["/cpu:1", "/cpu:2", "/cpu:3"], batch_split=[1, 1, 1], rebalance=False,
                                        profile_cache=False)


def test_regression_fit_raises_the_failing_steps_error_not_a_prefetched_batchs(strategy):
    # Batch 1 has a label out of range; batch 2 (already prefetched when batch 1 runs) has mismatched components.
    # fit used to raise batch 2's InputError, with the real cause only in __cause__.
    model = _model(strategy)
    with pytest.raises(ReplicaStepError, match=r"replica 1 on /device:CPU:2.*label value of 10") as info:
        model.fit(_dataset(bad_label_batch=1, mismatched_batch=2), epochs=1, verbose=0)
    assert info.value.replica_id == 1
    assert isinstance(info.value.__cause__, tf.errors.InvalidArgumentError)


def test_a_bad_batch_that_is_the_failing_step_is_still_an_input_error(strategy):
    model = _model(strategy)
    with pytest.raises(InputError, match="different leading"):
        model.fit(_dataset(bad_label_batch=None, mismatched_batch=2), epochs=1, verbose=0)


@pytest.mark.parametrize("method", ["evaluate", "predict"])
def test_regression_evaluate_and_predict_raise_the_failing_steps_error(strategy, method):
    model = _model(strategy)
    if method == "evaluate":  # the loss sees the bad label
        with pytest.raises(tf.errors.InvalidArgumentError, match="label value of 10"):
            model.evaluate(_dataset(bad_label_batch=1, mismatched_batch=2), verbose=0)
    else:  # predict does not read labels: the mismatched batch is the first error, and it is the input's
        with pytest.raises(InputError, match="different leading"):
            model.predict(_dataset(bad_label_batch=1, mismatched_batch=2), verbose=0)
