"""The small regression model and data the failover tests train (test_failover, test_supervised_restart)."""

import keras
import numpy as np

from hetero_cs.emulation import Workload

DEVICES = ["/cpu:1", "/cpu:2", "/cpu:3"]
WORKLOAD = Workload(flops_per_example=2e7, parameter_bytes=10_000, activation_bytes_per_example=10_000)
B = 48


def mlp():
    """A 6-12-1 MLP with fixed initial weights."""
    keras.utils.set_random_seed(5)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(12, activation="relu"), keras.layers.Dense(1)])


def regression_data(num_batches):
    """``num_batches`` global batches of B examples: (x [N, 6], y [N, 1]), the same every call."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(B * num_batches, 6)).astype(np.float32)
    return x, (x[:, :1] * 0.5 - x[:, 1:2]).astype(np.float32)
