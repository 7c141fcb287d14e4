"""The device layer: what devices exist (TensorFlow joined with NVML) and emulated accelerators for CPU machines.

``discovery`` and ``nvml`` describe real devices; ``catalog``, ``emulation`` and ``logical`` emulate unlike GPUs on
logical CPU devices. Importing this package loads neither TensorFlow nor pynvml.
"""

from hetero_cs.devices.discovery import DeviceInfo, discover_devices, format_device_table

__all__ = ["DeviceInfo", "discover_devices", "format_device_table"]
