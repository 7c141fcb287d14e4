"""Emulated accelerators (the public path of :mod:`hetero_cs.devices.emulation` and its catalog).

``hetero_cs.emulation.setup_logical_devices([...])``, ``Emulator``, ``Drift``, ``get_device_spec`` and the
``CATALOG`` of published device figures, as docs/emulation.md shows them; emulated memory (``"T4@48MB"``,
``Drift(memory_bytes=...)``, ``slice_memory_bytes``). Importing this module does not load TensorFlow.
"""

from hetero_cs.devices.catalog import (
    CATALOG, DEFAULT_COMPUTE_EFFICIENCY, DEFAULT_LAUNCH_OVERHEAD_S, MAX_EMULATED_MAKESPAN_S, MAX_TIME_SCALE,
    MIN_TARGET_MAKESPAN_MS, PCIE_BYTES_PER_S_PER_LANE, TARGET_MAKESPAN_ENV_VAR, TIME_SCALE_ENV_VAR, DeviceSpec,
    get_device_spec, parse_memory_bytes)
from hetero_cs.devices.emulation import Drift, Emulator, Workload, emulated_step_time_s
from hetero_cs.devices.workload import max_examples_in_memory, slice_memory_bytes
from hetero_cs.devices.logical import setup_logical_devices

__all__ = [
    "CATALOG", "DEFAULT_COMPUTE_EFFICIENCY", "DEFAULT_LAUNCH_OVERHEAD_S", "MAX_EMULATED_MAKESPAN_S", "MAX_TIME_SCALE",
    "MIN_TARGET_MAKESPAN_MS", "PCIE_BYTES_PER_S_PER_LANE", "TARGET_MAKESPAN_ENV_VAR", "TIME_SCALE_ENV_VAR",
    "DeviceSpec", "Drift", "Emulator", "Workload", "emulated_step_time_s", "estimate_workload", "get_device_spec",
    "max_examples_in_memory", "parse_memory_bytes", "setup_logical_devices", "slice_memory_bytes"]


def __getattr__(name: str):
    # estimate_workload reads a Keras model, so it is imported (with TensorFlow) only when asked for.
    if name == "estimate_workload":
        from calibration.workload import estimate_workload

        return estimate_workload
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
