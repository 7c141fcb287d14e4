"""Data order (issue 14, pattern 5): with a dataset that reshuffles on each iteration, training under the strategy
sees the batches single-device training sees - with a fixed split and with calibration (auto_balance), which reads
the first batch ahead and must leave the data and its random state as they were."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from hetero_cs import HeteroCentralStorageStrategy
from test_exact_patterns import assert_same_state, strategy_for


def shuffle_data(n=40):
    rng = np.random.default_rng(9)
    return rng.normal(size=(n, 3)).astype(np.float32), rng.normal(size=(n, 1)).astype(np.float32)


def sgd_model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(1))])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


class ShufflingPyDataset(keras.utils.PyDataset):
    """Batches of 8 in its own order, reshuffled by its own generator at the end of every epoch."""

    def __init__(self, x, y):
        super().__init__()
        self.x, self.y = x, y
        self.order = np.arange(len(x))
        self.rng = np.random.default_rng(7)

    def __len__(self):
        return len(self.x) // 8

    def __getitem__(self, index):
        rows = self.order[index * 8:(index + 1) * 8]
        return self.x[rows], self.y[rows]

    def on_epoch_end(self):
        self.rng.shuffle(self.order)


def fit_in_order(model, kind, x, y):
    import random

    random.seed(5)  # fit(shuffle=True) on a PyDataset orders its batches with Python's random
    if kind == "seeded_shuffle":
        data = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=3).batch(8)
        return model.fit(data, epochs=3, verbose=0)
    return model.fit(ShufflingPyDataset(x, y), epochs=3, verbose=0, shuffle=kind == "pydataset_fit_shuffle")


@pytest.mark.parametrize("auto_balance", [False, True], ids=["batch_split", "auto_balance"])
@pytest.mark.parametrize("kind", ["seeded_shuffle", "pydataset_fit_shuffle", "pydataset_own_shuffle"])
def test_fit_sees_the_batches_of_single_device_training(kind, auto_balance):
    # The calibration read (auto_balance) and Keras' symbolic build used to open an extra iterator, which moved a
    # reshuffling dataset: every epoch then saw another order than on one device.
    x, y = shuffle_data()
    reference = sgd_model()
    fit_in_order(reference, kind, x, y)
    if auto_balance:  # a new strategy each time: calibration reads the data (no cached calibration)
        strategy = HeteroCentralStorageStrategy(["/cpu:1", "/cpu:2", "/cpu:3"], rebalance=False, guard=False,
                                                profile_cache=False)
    else:
        strategy = strategy_for([3, 0, 5])
    with strategy.scope():
        model = sgd_model()
    fit_in_order(model, kind, x, y)
    assert_same_state(reference, model)


def test_a_custom_loop_after_calibrate_sees_the_datasets_own_order():
    x, y = shuffle_data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=4).batch(8)
    fresh = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=4).batch(8)
    expected = [[xb.numpy() for xb, _ in fresh] for _ in range(2)]  # two epochs on one device
    strategy = strategy_for([3, 0, 5])
    with strategy.scope():
        model = sgd_model()
    strategy.calibrate(model, dataset, progress=False)  # reads the first batch, then rewinds
    distributed = strategy.experimental_distribute_dataset(dataset)
    for epoch in range(2):
        got = [strategy.gather(element[0], axis=0).numpy() for element in distributed]
        np.testing.assert_array_equal(np.concatenate(got), np.concatenate(expected[epoch]), err_msg=f"epoch {epoch}")
