"""Logical CPU devices for emulation: one parameter device and one compute device per emulated name.

TensorFlow is imported inside the function, so importing this module does not load it.
"""

import logging
import os
from collections.abc import Sequence

from hetero_cs.devices.catalog import get_device_spec
from hetero_cs.errors import ConfigError, EmulationError

logger = logging.getLogger(__name__)

MAX_EMULATED_REPLICAS_PER_WORKER = 4
"""Emulated replicas per multi-worker process at most. Tested with 2 and 4 per worker; with 8 per worker on a 2-core
machine ``predict`` stalled in 3 of 4 launches (8 blocking emulated waits beside the CPU collectives)."""


def setup_logical_devices(names: Sequence[str]) -> list[str]:
    """Splits the host CPU into a parameter device and one compute device per emulated name.

    Must run before TensorFlow initialises its devices (before any op runs). Creates len(names) + 1 logical CPU
    devices (CPU:0 holds the central variables, CPU:1..R compute) and raises the inter-op thread pool to at least
    R + 2 threads (only when it is unset or lower), so the replicas' emulated waits overlap. Calling it again is
    harmless: if TF is already initialised with enough logical CPU devices, the names are returned as they are.

    Args:
        names: Catalog names, one per compute replica, R >= 1.

    Returns:
        ["/device:CPU:1", ..., "/device:CPU:R"].

    Raises:
        UnknownEmulatedDeviceError: If a name is not in the catalog.
        ConfigError: If ``names`` is empty.
        EmulationError: If TF is already initialised with fewer than R + 1 logical CPU devices.

    Examples:
        >>> setup_logical_devices(["A10", "T4", "T4"])  # first thing in main() or a conftest
        ['/device:CPU:1', '/device:CPU:2', '/device:CPU:3']
    """
    if isinstance(names, str) or not names:
        raise ConfigError(f"names={names!r} must be a non-empty sequence of catalog names, e.g. ['A10', 'T4'].")
    for name in names:
        get_device_spec(name)
    num_replicas = len(names)
    device_names = [f"/device:CPU:{i}" for i in range(1, num_replicas + 1)]
    if _split_host_cpu(num_replicas + 1, num_replicas + 2,
                       needed_for=f"names={list(names)} (one per card and one for the host's parameters)",
                       fix="Build HeteroCentralStorageStrategy(emulate=...) (or call setup_logical_devices(...)) "
                           "before any TensorFlow op runs: first thing in main, or in a conftest."):
        logger.info("Emulated devices %s on %s.", list(names), device_names)
    return device_names


def setup_worker_replica_cpus(count: int) -> list[str]:
    """Splits a multi-worker process's CPU into ``count`` logical devices, one per local replica.

    For :class:`hetero_cs.HeteroMultiWorkerMirroredStrategy` emulating several devices per worker: its replicas run on
    ``CPU:0..count-1`` (there is no separate parameter device: every replica keeps its own copy of the variables).
    Must run before TensorFlow initialises its devices; raises the inter-op thread pool to at least ``count + 2``
    threads, so the replicas' emulated waits overlap.

    Args:
        count: Local replicas, >= 1.

    Returns:
        ``["/device:CPU:0", ..., "/device:CPU:{count-1}"]``.

    Raises:
        ConfigError: ``count`` is not an int >= 1.
        EmulationError: TensorFlow is already initialised with fewer than ``count`` logical CPU devices.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ConfigError(f"count={count!r} must be an int >= 1 (local replicas of this worker).")
    _split_host_cpu(count, count + 2, needed_for=f"this worker's {count} emulated local replicas",
                    fix="Build the HeteroMultiWorkerMirroredStrategy before any TensorFlow op runs (first thing in "
                        "the script).")
    return [f"/device:CPU:{i}" for i in range(count)]


def _split_host_cpu(num_devices: int, min_threads: int, *, needed_for: str, fix: str) -> bool:
    """Splits the host CPU into at least ``num_devices`` logical devices and raises the inter-op thread pool to at
    least ``min_threads`` (so emulated waits overlap); True when it configured the devices now.

    Once TensorFlow is initialised it can change neither: enough existing devices are taken as they are (a warning
    when the thread pool is smaller), too few raise EmulationError with ``needed_for`` and ``fix``.
    """
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        if created := len(tf.config.get_logical_device_configuration(cpu) or []) < num_devices:
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(num_devices)])
        threads = tf.config.threading.get_inter_op_parallelism_threads()
        if threads == 0 or threads < min_threads:
            tf.config.threading.set_inter_op_parallelism_threads(min_threads)
        return created
    except RuntimeError as exc:  # TF refuses once its context is initialised.
        existing = tf.config.list_logical_devices("CPU")
        if len(existing) < num_devices:
            raise EmulationError(f"TensorFlow is already initialised with logical_cpu_devices={len(existing)}, but "
                                 f"{num_devices} are needed for {needed_for}. {fix}") from exc
        threads = tf.config.threading.get_inter_op_parallelism_threads() or (os.cpu_count() or 1)
        if threads < min_threads:
            logger.warning("inter_op_parallelism_threads=%d < %d: emulated replicas may wait one after another.",
                           threads, min_threads)
        return False
