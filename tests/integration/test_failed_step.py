"""A step that fails inside one replica changes nothing, and the error names the replica and its device."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from hetero_cs import HeteroCentralStorageStrategy, ReplicaStepError


class RejectNaN(keras.layers.Layer):
    def call(self, x):
        return tf.debugging.check_numerics(x, "non-finite input")


@pytest.mark.parametrize("bad_index,replica,device", [(5, 1, "/device:CPU:2"), (1, 0, "/device:CPU:1")])
def test_failed_replica_step_leaves_state_and_names_the_replica(bad_index, replica, device):
    strategy = HeteroCentralStorageStrategy(
        ["/cpu:1", "/cpu:2", "/cpu:3"], batch_split=[4, 4, 2], rebalance=False, profile_cache=False
    )
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), RejectNaN(), keras.layers.Dense(1)])
        model.compile(optimizer="adam", loss="mse")
    x = np.ones((10, 3), np.float32)
    y = np.ones((10, 1), np.float32)
    model.fit(x, y, batch_size=10, epochs=2, verbose=0)
    before = [np.array(v) for v in [*model.variables, *model.optimizer.variables]]

    x_bad = x.copy()
    x_bad[bad_index] = np.nan  # slices [0, 4), [4, 8), [8, 10)
    with pytest.raises(ReplicaStepError, match=f"replica {replica} on {device}.*non-finite input") as info:
        model.fit(x_bad, y, batch_size=10, epochs=1, shuffle=False, verbose=0)
    assert info.value.replica_id == replica and info.value.device == device
    assert isinstance(info.value.__cause__, tf.errors.InvalidArgumentError)

    after = [np.array(v) for v in [*model.variables, *model.optimizer.variables]]
    for path, a, b in zip([v.path for v in [*model.variables, *model.optimizer.variables]], before, after):
        np.testing.assert_array_equal(a, b, err_msg=path)  # iteration counter included
