"""Logical CPU devices for emulation: one parameter device and one compute device per emulated name.

TensorFlow is imported inside the function, so importing this module does not load it.
"""

from __future__ import annotations

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

    Example:
        >>> setup_logical_devices(["A10", "T4", "T4"])  # first thing in main() or a conftest
        ['/device:CPU:1', '/device:CPU:2', '/device:CPU:3']
    """
    if isinstance(names, str) or not names:
        raise ConfigError(f"names={names!r} must be a non-empty sequence of catalog names, e.g. ['A10', 'T4'].")
    for name in names:
        get_device_spec(name)
    import tensorflow as tf

    num_replicas = len(names)
    wanted_devices = num_replicas + 1
    wanted_threads = num_replicas + 2
    device_names = [f"/device:CPU:{i}" for i in range(1, wanted_devices)]
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        configured = tf.config.get_logical_device_configuration(cpu) or []
        if len(configured) < wanted_devices:
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(wanted_devices)])
            logger.info("Emulated devices %s on %s.", list(names), device_names)
        threads = tf.config.threading.get_inter_op_parallelism_threads()
        if threads == 0 or threads < wanted_threads:
            tf.config.threading.set_inter_op_parallelism_threads(wanted_threads)
    except RuntimeError as exc:  # TF refuses once its context is initialised.
        existing = tf.config.list_logical_devices("CPU")
        if len(existing) < wanted_devices:
            raise EmulationError(
                f"TensorFlow is already initialised with logical_cpu_devices={len(existing)}, but "
                f"{wanted_devices} are needed for names={list(names)}. Call setup_logical_devices(...) before any "
                f"TensorFlow op runs (first thing in main, or in a conftest).") from exc
        threads = tf.config.threading.get_inter_op_parallelism_threads() or (os.cpu_count() or 1)
        if threads < wanted_threads:
            logger.warning("inter_op_parallelism_threads=%d < %d: emulated replicas may wait one after another.",
                           threads, wanted_threads)
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
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        configured = tf.config.get_logical_device_configuration(cpu) or []
        if len(configured) < count:
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(count)])
        threads = tf.config.threading.get_inter_op_parallelism_threads()
        if threads == 0 or threads < count + 2:
            tf.config.threading.set_inter_op_parallelism_threads(count + 2)
    except RuntimeError as exc:  # TF refuses once its context is initialised.
        existing = tf.config.list_logical_devices("CPU")
        if len(existing) < count:
            raise EmulationError(
                f"TensorFlow is already initialised with logical_cpu_devices={len(existing)}, but this worker "
                f"emulates {count} local replicas. Build the HeteroMultiWorkerMirroredStrategy before any "
                f"TensorFlow op runs (first thing in the script).") from exc
    return [f"/device:CPU:{i}" for i in range(count)]
