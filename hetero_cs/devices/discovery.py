"""What devices this process can use: TensorFlow's devices joined with NVML facts.

TensorFlow names the devices (``/device:GPU:0``) and says what it can run on; NVML (the NVIDIA driver's management
library, ``pynvml`` from the ``nvidia-ml-py`` distribution) says how much memory a card has free, its PCIe link, its
UUID and whether it is a MIG slice. The two are joined on the PCI bus id or the UUID, never on the index: NVML
enumerates every card in PCI order and ignores ``CUDA_VISIBLE_DEVICES``, while TensorFlow's GPU k is CUDA's ordinal
k, which follows ``CUDA_VISIBLE_DEVICES`` (indices, reordered lists, ``GPU-``/``MIG-`` UUIDs) and
``CUDA_DEVICE_ORDER`` (FASTEST_FIRST by default). The PCI bus id and UUID of CUDA ordinal k are read from the CUDA
driver (``cuDeviceGetPCIBusId``/``cuDeviceGetUuid_v2`` through ctypes), which creates no CUDA context and reserves no
memory; TensorFlow's public API does not expose them without creating its devices.

Without NVML (no driver, driver not loaded, library/driver version mismatch, a failed query) the devices come from
TensorFlow alone, with one warning per process. Nothing here initialises TensorFlow's logical devices:
``discover_devices`` uses only ``tf.config`` calls that leave them unconfigured, so it may run before
``setup_logical_devices`` or ``set_memory_growth``.

The pure part (``parse_cuda_visible_devices``, ``join_gpu_records``, ``format_device_table``, and
:mod:`hetero_cs.devices.nvml`'s ``normalize_pci_bus_id`` and ``read_nvml_records``) needs neither TensorFlow nor a
driver.
"""

import contextlib
import dataclasses
import itertools
import logging
import os
import sys
import threading
import warnings
from collections.abc import Sequence
from uuid import UUID

from hetero_cs.devices.nvml import NvmlRecord, _query_nvml, normalize_pci_bus_id
from hetero_cs.errors import DeviceError

logger = logging.getLogger(__name__)

DEVICE_TYPES = ("CPU", "GPU")
SOURCES = ("nvml", "tensorflow")

# The one piece of process state in this module, by design: the style rules ask for one warning per process when
# NVML degrades, and Python's warning filters cannot promise that (pytest and `-W always` reset them).
_WARNED_ONCE: set[str] = set()
_WARNED_ONCE_LOCK = threading.Lock()


def _first_time(key: str) -> bool:
    with _WARNED_ONCE_LOCK:
        first = key not in _WARNED_ONCE
        _WARNED_ONCE.add(key)
    return first


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """One device TensorFlow can place ops on, with what NVML knows about it.

    Attributes:
        name: TF logical device name, e.g. "/device:GPU:0".
        device_type: "GPU" or "CPU".
        description: Product name, e.g. "NVIDIA A10" (a MIG slice: "NVIDIA A100 ... MIG 1g.10gb"); the CPU model
            for CPUs.
        uuid: NVML UUID ("GPU-..." or "MIG-..."); None without NVML and for CPUs.
        pci_bus_id: "dddddddd:bb:dd.f" (lower-case hex); None for CPUs or when unknown.
        memory_total_bytes: Device memory (a MIG slice: the slice's), in bytes; for CPU devices the host's (shared
            by all logical CPU devices); None when unknown.
        memory_free_bytes: Free memory when ``discover_devices`` ran (before TF reserves any), in bytes; None when
            unknown.
        pcie_generation: Maximum PCIe generation of the card in this slot (the current link drops when idle);
            None when unknown or for CPUs.
        pcie_width: Maximum PCIe link width in lanes for this card in this slot; None when unknown or for CPUs.
        compute_capability: (major, minor) for NVIDIA GPUs, else None.
        mig: True for a MIG slice (or a GPU in MIG mode).
        source: "nvml" when NVML facts were joined in, "tensorflow" when only TF (and the OS) were asked.
        emulated_as: Catalog name when this device emulates another (see hetero_cs.emulation), else None.
    """

    name: str
    device_type: str
    description: str
    uuid: str | None = None
    pci_bus_id: str | None = None
    memory_total_bytes: int | None = None
    memory_free_bytes: int | None = None
    pcie_generation: int | None = None
    pcie_width: int | None = None
    compute_capability: tuple[int, int] | None = None
    mig: bool = False
    source: str = "tensorflow"
    emulated_as: str | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise DeviceError("DeviceInfo.name is empty; give the TF device name, e.g. name='/device:GPU:0'.")
        for field, allowed in (("device_type", DEVICE_TYPES), ("source", SOURCES)):
            if getattr(self, field) not in allowed:
                raise DeviceError(f"DeviceInfo {field}={getattr(self, field)!r} must be one of {allowed}.")
        for field in ("memory_total_bytes", "memory_free_bytes", "pcie_generation", "pcie_width"):
            value = getattr(self, field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise DeviceError(f"DeviceInfo {self.name}: {field}={value!r} must be None or an int >= 0.")


@dataclasses.dataclass(frozen=True)
class TfGpuRecord:
    """What TensorFlow (and the CUDA driver) say about one physical GPU.

    Attributes:
        index: TF physical GPU index k ("/physical_device:GPU:k"), which is CUDA ordinal k.
        pci_bus_id: Normalised PCI bus id of CUDA ordinal k, or None when the CUDA driver could not say.
        name: TF's ``device_name`` detail (e.g. "NVIDIA A10"), or None.
        compute_capability: TF's ``compute_capability`` detail, or None.
        uuid: UUID of CUDA ordinal k (hex, with or without a "GPU-"/"MIG-" prefix), or None.
    """

    index: int
    pci_bus_id: str | None = None
    name: str | None = None
    compute_capability: tuple[int, int] | None = None
    uuid: str | None = None


def parse_cuda_visible_devices(value: str | None) -> list[str] | None:
    """Parses ``CUDA_VISIBLE_DEVICES`` as CUDA does.

    Entries are indices ("1"), UUIDs ("GPU-8932f937-..." or a unique prefix), or MIG ids ("MIG-..."), separated by
    commas; CUDA stops at the first invalid entry (a negative index hides everything after it).

    Returns:
        None when the variable is unset (every device is visible), else the entries in order (maybe empty).
    """
    if value is None:
        return None
    # Up to the first entry that is neither an index nor a UUID ("", "-1", garbage): CUDA ignores it and every
    # later one.
    entries = (raw.strip() for raw in value.split(","))
    return list(itertools.takewhile(lambda e: e.isdecimal() or e.upper().startswith(("GPU-", "MIG-")), entries))


def _uuid_body(uuid: str) -> str:
    body = uuid.strip().lower()
    return body[4:] if body.startswith(("gpu-", "mig-")) else body


def _only(candidates: list) -> NvmlRecord | None:
    """The one candidate, or None when there are none or several (an ambiguous match is no match)."""
    return candidates[0] if len(candidates) == 1 else None


def join_gpu_records(tf_gpus: Sequence[TfGpuRecord], nvml_records: Sequence[NvmlRecord], *,
                     cuda_visible_devices: str | None, cuda_device_order: str | None = None) -> list[NvmlRecord | None]:
    """Finds the NVML record of each TF GPU, matching on UUID or PCI bus id, never on the index.

    For TF GPU k (CUDA ordinal k), in order of preference:
    1. entry k of CUDA_VISIBLE_DEVICES when it is a UUID ("GPU-..."/"MIG-...", or a unique prefix): that GPU or
       MIG slice (so a MIG slice reports the slice's memory, not its parent's);
    2. the UUID the CUDA driver gave for ordinal k;
    3. the PCI bus id the CUDA driver gave for ordinal k (a whole GPU, not one of its MIG slices);
    4. only when ``cuda_device_order == "PCI_BUS_ID"`` (CUDA then enumerates in PCI order): the n-th GPU by PCI
       bus id, n being entry k of CUDA_VISIBLE_DEVICES when it is an index, else k.
    Otherwise the GPU stays unmatched (None): CUDA's default FASTEST_FIRST order cannot be reproduced here.

    Args:
        tf_gpus: TF's physical GPUs, in TF order.
        nvml_records: Every GPU and MIG slice NVML reported, in any order.
        cuda_visible_devices: The value of CUDA_VISIBLE_DEVICES, or None when unset.
        cuda_device_order: The value of CUDA_DEVICE_ORDER, or None when unset.

    Returns:
        One NvmlRecord or None per TF GPU, shape [len(tf_gpus)].
    """
    entries = parse_cuda_visible_devices(cuda_visible_devices)
    gpus_by_bus = sorted((r for r in nvml_records if r.parent_uuid is None), key=lambda r: r.pci_bus_id)
    joined: list[NvmlRecord | None] = []
    for gpu in tf_gpus:
        entry = entries[gpu.index] if entries is not None and gpu.index < len(entries) else None
        match: NvmlRecord | None = None
        if entry is not None and not entry.isdigit():
            wanted = entry.lower()
            match = _only([r for r in nvml_records if r.uuid.lower() == wanted]
                          or [r for r in nvml_records if r.uuid.lower().startswith(wanted)])
        if match is None and gpu.uuid:
            match = _only([r for r in nvml_records if _uuid_body(r.uuid) == _uuid_body(gpu.uuid)])
        if match is None and gpu.pci_bus_id:
            match = _only([r for r in gpus_by_bus if r.pci_bus_id == gpu.pci_bus_id])
        if match is None and (cuda_device_order or "").strip().upper() == "PCI_BUS_ID":
            position = int(entry) if entry is not None and entry.isdigit() else gpu.index
            match = gpus_by_bus[position] if position < len(gpus_by_bus) else None
        if match is None:
            logger.info("TF GPU %d (pci_bus_id=%s) has no NVML match; its NVML facts are left empty.",
                        gpu.index, gpu.pci_bus_id)
        joined.append(match)
    return joined


def _cuda_driver_identities() -> dict[int, tuple[str | None, str | None]]:
    """{CUDA ordinal: (pci_bus_id, uuid hex)} from the CUDA driver API; {} when it cannot be loaded or asked.

    ``cuInit`` creates no context and reserves no device memory, and the driver applies CUDA_VISIBLE_DEVICES and
    CUDA_DEVICE_ORDER itself, so ordinal k here is TF's physical GPU k.
    """
    import ctypes

    library = None
    for candidate in (("nvcuda.dll",) if sys.platform == "win32" else ("libcuda.so.1", "libcuda.so")):
        with contextlib.suppress(OSError):
            library = ctypes.CDLL(candidate)
            break
    if library is None:
        return {}
    try:
        count = ctypes.c_int(0)
        if library.cuInit(0) != 0 or library.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return {}
        get_uuid = getattr(library, "cuDeviceGetUuid_v2", None) or getattr(library, "cuDeviceGetUuid", None)
        identities: dict[int, tuple[str | None, str | None]] = {}
        for ordinal in range(count.value):
            device = ctypes.c_int(0)
            if library.cuDeviceGet(ctypes.byref(device), ordinal) != 0:
                continue
            buffer, raw = ctypes.create_string_buffer(64), (ctypes.c_ubyte * 16)()
            found = library.cuDeviceGetPCIBusId(buffer, ctypes.c_int(64), device) == 0
            bus_id = normalize_pci_bus_id(buffer.value) if found else None
            found = get_uuid is not None and get_uuid(raw, device) == 0
            identities[ordinal] = (bus_id, str(UUID(bytes=bytes(raw))) if found else None)  # UUID: 8-4-4-4-12 hex
        return identities
    except (OSError, AttributeError, DeviceError) as exc:
        logger.debug("CUDA driver query failed: %s", exc)
        return {}


def _host_description() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as handle:
        for line in handle:
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    import platform

    return platform.processor() or platform.machine() or "host CPU"


def _host_memory_bytes() -> tuple[int | None, int | None]:
    """(total, available) host memory in bytes, or None where the OS does not say."""
    total = available = None
    with contextlib.suppress(AttributeError, ValueError, OSError):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/meminfo", encoding="utf-8") as handle:
        for line in handle:
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    return total, available


def _list_tf_devices() -> list[tuple[str, str, TfGpuRecord | None]]:
    """[(logical name, device type, TfGpuRecord or None)] without initialising TF's logical devices.

    Logical names follow TF's rule: the visible physical devices of a type, in order, each expanded into its
    logical-device configuration (one logical device when unconfigured).
    """
    import tensorflow as tf

    # {CUDA ordinal: (pci_bus_id, uuid)}, asked of the CUDA driver only when TensorFlow sees a GPU
    identities = _cuda_driver_identities() if tf.config.get_visible_devices("GPU") else {}
    listed: list[tuple[str, str, TfGpuRecord | None]] = []
    for device_type in ("CPU", "GPU"):
        logical_index = 0
        for physical in tf.config.get_visible_devices(device_type):
            record = None
            if device_type == "GPU":
                index = int(physical.name.rsplit(":", 1)[1])
                try:
                    details = tf.config.experimental.get_device_details(physical)
                except (ValueError, RuntimeError):
                    details = {}
                bus_id, uuid = identities.get(index, (None, None))
                capability = details.get("compute_capability")
                record = TfGpuRecord(index=index, pci_bus_id=bus_id, name=details.get("device_name"),
                                     compute_capability=tuple(capability) if capability else None, uuid=uuid)
            count = len(tf.config.get_logical_device_configuration(physical) or []) or 1
            listed += [(f"/device:{device_type}:{logical_index + k}", device_type, record) for k in range(count)]
            logical_index += count
    return listed


def discover_devices() -> list[DeviceInfo]:
    """Lists the devices TensorFlow can use, with NVML's facts joined in on PCI bus id or UUID.

    NVML is asked at discovery, so ``memory_free_bytes`` is the free memory before this process's TF reserves
    any (call it before building a model). A GPU split into several logical devices appears once per logical
    device, each with the whole card's NVML facts. Emulation is not applied here (``emulated_as`` is None).

    Returns:
        CPU devices then GPU devices, in TF's logical-device order.

    Warns:
        UserWarning: Once per process, when TensorFlow sees a GPU but NVML is unavailable (no driver, driver not
            loaded, version mismatch, a failed device query; the devices then come from TF alone), or when NVML
            refused some facts (e.g. NVMLError_NoPermission on memory; those fields are None). Without a GPU an
            unavailable NVML is only logged (INFO).

    Examples:
        >>> for device in discover_devices():
        ...     print(device.name, device.description, device.memory_free_bytes)
    """
    tf_devices = _list_tf_devices()
    nvml_records, problems, reason = _query_nvml()
    if reason is not None and not any(kind == "GPU" for _, kind, _ in tf_devices):
        # No GPU to describe (a CPU-only or emulated run): nothing is missing, so no warning.
        logger.info("NVML is unavailable (%s); TensorFlow sees no GPU.", reason)
    elif reason is not None and _first_time("nvml-unavailable"):
        warnings.warn(f"NVML is unavailable: {reason}. hetero_cs lists TensorFlow's devices without NVML facts (free "
                      f"memory, PCIe link, UUID, MIG). On a GPU machine, install or load the NVIDIA driver and "
                      f"nvidia-ml-py.", UserWarning, stacklevel=2)
    if problems and _first_time("nvml-partial"):
        warnings.warn(f"NVML refused some device facts ({'; '.join(problems)}); those fields are None. Run with the "
                      f"permissions NVML needs to read them.", UserWarning, stacklevel=2)
    gpu_records = list(dict.fromkeys(record for _, kind, record in tf_devices if kind == "GPU"))
    joined = dict(zip(gpu_records, join_gpu_records(
        gpu_records, nvml_records or [], cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
        cuda_device_order=os.environ.get("CUDA_DEVICE_ORDER"))))
    host_total, host_free = _host_memory_bytes()
    cpu = dict(device_type="CPU", memory_total_bytes=host_total, memory_free_bytes=host_free,
               description=_host_description() if any(kind == "CPU" for _, kind, _ in tf_devices) else "")
    return [DeviceInfo(name=name, **cpu) if record is None else gpu_device_info(name, record, joined.get(record))
            for name, _, record in tf_devices]  # a CPU device has no TfGpuRecord


def gpu_device_info(name: str, record: TfGpuRecord, nvml: NvmlRecord | None) -> DeviceInfo:
    """Builds a GPU's DeviceInfo from TF's record and its NVML match (None: TF's facts only)."""
    if nvml is None:
        return DeviceInfo(name=name, device_type="GPU", description=record.name or "GPU",
                          pci_bus_id=record.pci_bus_id, compute_capability=record.compute_capability)
    shared = ("uuid", "pci_bus_id", "memory_total_bytes", "memory_free_bytes", "pcie_generation", "pcie_width", "mig")
    return DeviceInfo(name=name, device_type="GPU", description=nvml.name or record.name or "GPU", source="nvml",
                      compute_capability=record.compute_capability or nvml.compute_capability,
                      **{field: getattr(nvml, field) for field in shared})


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**30:.1f}"


def format_device_table(devices: Sequence[DeviceInfo]) -> str:
    """A plain-text table of devices (for ``hetero-cs devices``); says which devices are emulated.

    Args:
        devices: From ``discover_devices``, possibly with ``emulated_as`` set.

    Returns:
        The table, lines joined by newlines, without a trailing newline.
    """
    header = ("device", "type", "description", "mem total GiB", "mem free GiB", "PCIe", "CC", "MIG", "source",
              "emulated as")
    rows = [header, *((d.name, d.device_type, d.description or "-", _gib(d.memory_total_bytes),
                       _gib(d.memory_free_bytes),
                       "-" if d.pcie_generation is None else f"gen{d.pcie_generation} x{d.pcie_width or '?'}",
                       "-" if d.compute_capability is None else ".".join(str(v) for v in d.compute_capability),
                       "yes" if d.mig else "no", d.source, d.emulated_as or "-") for d in devices)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    if any(d.emulated_as for d in devices):
        lines.append("Devices with 'emulated as' run on the host CPU; their step times are EMULATED from the "
                     "catalog (hetero_cs.emulation), not measured on that hardware.")
    return "\n".join(lines)
