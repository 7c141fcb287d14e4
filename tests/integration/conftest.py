"""TensorFlow integration tests: one process, logical CPU devices configured once before TF initialises.

CPU:0 is the parameter device; CPU:1..4 are compute devices (up to 4 replicas).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

NUM_COMPUTE_DEVICES = 4


def _configure() -> None:
    cpus = tf.config.list_physical_devices("CPU")
    try:
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(NUM_COMPUTE_DEVICES + 1)]
        )
        # Emulated waits overlap across replicas only with enough inter-op threads.
        tf.config.threading.set_inter_op_parallelism_threads(NUM_COMPUTE_DEVICES + 4)
    except RuntimeError:
        pass  # Already initialised by an earlier module in this process; the configuration then stands.


_configure()


@pytest.fixture(scope="session")
def compute_devices():
    """The 4 logical CPU compute devices."""
    return [f"/device:CPU:{i}" for i in range(1, NUM_COMPUTE_DEVICES + 1)]
