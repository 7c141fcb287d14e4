"""NVML (the NVIDIA driver's management library) read through ``pynvml`` from the ``nvidia-ml-py`` distribution.

``read_nvml_records`` turns NVML's per-device answers into plain ``NvmlRecord``s (pure: it takes the ``pynvml``
module as an argument, so tests pass a fake one); ``_query_nvml`` imports ``pynvml`` when called, initialises and
shuts NVML down around the read, and reports why NVML cannot be used instead of raising.
"""

import contextlib
import dataclasses
import re
from typing import Any

from hetero_cs.errors import DeviceError


@dataclasses.dataclass(frozen=True)
class NvmlRecord:
    """What NVML says about one GPU or one MIG slice (fields NVML would not give are None).

    Attributes:
        uuid: "GPU-..." or "MIG-...".
        pci_bus_id: Normalised PCI bus id (a MIG slice: its parent's).
        name: Product name.
        memory_total_bytes, memory_free_bytes: In bytes (a MIG slice: the slice's).
        pcie_generation, pcie_width: Maximum link generation and width for this card in this slot.
        compute_capability: (major, minor).
        mig: True for a MIG slice, or a GPU whose MIG mode is on.
        parent_uuid: The parent GPU's UUID for a MIG slice, else None.
        index: NVML's index for a GPU (PCI order; ignores CUDA_VISIBLE_DEVICES); None for a MIG slice.
    """

    uuid: str
    pci_bus_id: str
    name: str | None = None
    memory_total_bytes: int | None = None
    memory_free_bytes: int | None = None
    pcie_generation: int | None = None
    pcie_width: int | None = None
    compute_capability: tuple[int, int] | None = None
    mig: bool = False
    parent_uuid: str | None = None
    index: int | None = None


def _text(value: str | bytes) -> str:
    return value.decode("ascii", "replace") if isinstance(value, (bytes, bytearray)) else str(value)


_PCI_BUS_ID = re.compile(r"^(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])$")


def normalize_pci_bus_id(bus_id: str | bytes) -> str:
    """Puts a PCI bus id in one form so CUDA's and NVML's spellings compare equal.

    CUDA writes "0000:3B:00.0", NVML "00000000:3B:00.0"; both become "00000000:3b:00.0".

    Raises:
        DeviceError: If ``bus_id`` is not "[domain:]bus:device.function" in hex.
    """
    text = _text(bus_id).strip().rstrip("\x00")
    if not (match := _PCI_BUS_ID.match(text)):
        raise DeviceError(f"pci_bus_id={text!r} is not of the form 'domain:bus:device.function', e.g. '0000:3b:00.0'.")
    domain, bus, device, function = match.groups()
    return f"{int(domain or '0', 16):08x}:{int(bus, 16):02x}:{int(device, 16):02x}.{int(function)}"



def read_nvml_records(pynvml: Any) -> tuple[list[NvmlRecord], list[str]]:
    """Reads every GPU (and MIG slice) NVML knows; NVML must be initialised.

    The identity of a device (count, handle, UUID, PCI info) must be readable, or this raises. Any other fact that
    NVML refuses (``NVMLError_NotSupported``: silently; ``NVMLError_NoPermission`` or another NVMLError: reported
    in the returned problems) is left as None.

    Args:
        pynvml: The ``pynvml`` module (from nvidia-ml-py), or a stand-in with the same functions.

    Returns:
        (records, problems): GPUs then their MIG slices; problems as "field of uuid: ErrorName" strings.

    Raises:
        pynvml.NVMLError: If a device's identity cannot be read.
    """
    problems: list[str] = []
    not_supported = getattr(pynvml, "NVMLError_NotSupported", ())

    def optional(field: str, owner: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except not_supported:
            return None
        except pynvml.NVMLError as exc:
            problems.append(f"{field} of {owner}: {type(exc).__name__}")
            return None

    def record(handle: Any, uuid: str, **facts: Any) -> NvmlRecord:
        """The record of one GPU or MIG slice: its name and memory, and ``facts``."""
        name = optional("name", uuid, pynvml.nvmlDeviceGetName, handle)
        memory = optional("memory", uuid, pynvml.nvmlDeviceGetMemoryInfo, handle)
        return NvmlRecord(uuid=uuid, name=_text(name) if name is not None else None,
                          memory_total_bytes=int(memory.total) if memory is not None else None,
                          memory_free_bytes=int(memory.free) if memory is not None else None, **facts)

    records: list[NvmlRecord] = []
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
        bus_id = normalize_pci_bus_id(pynvml.nvmlDeviceGetPciInfo(handle).busId)
        generation = optional("pcie_generation", uuid, pynvml.nvmlDeviceGetMaxPcieLinkGeneration, handle)
        width = optional("pcie_width", uuid, pynvml.nvmlDeviceGetMaxPcieLinkWidth, handle)
        capability = optional("compute_capability", uuid, pynvml.nvmlDeviceGetCudaComputeCapability, handle)
        mig_mode = optional("mig_mode", uuid, pynvml.nvmlDeviceGetMigMode, handle)
        mig_on = bool(mig_mode) and mig_mode[0] == getattr(pynvml, "NVML_DEVICE_MIG_ENABLE", 1)
        common = dict(pci_bus_id=bus_id, pcie_generation=generation, pcie_width=width,
                      compute_capability=tuple(capability) if capability else None)
        records.append(record(handle, uuid, mig=mig_on, index=index, **common))
        if not mig_on:
            continue
        for slot in range(optional("mig_device_count", uuid, pynvml.nvmlDeviceGetMaxMigDeviceCount, handle) or 0):
            try:
                mig_handle = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            except pynvml.NVMLError:  # NotFound: an empty slot.
                continue
            records.append(record(mig_handle, _text(pynvml.nvmlDeviceGetUUID(mig_handle)), mig=True, parent_uuid=uuid,
                                  **common))
    return records, problems


def _query_nvml() -> tuple[list[NvmlRecord] | None, list[str], str | None]:
    """(records, problems, None) from NVML, or (None, [], reason) when NVML cannot be used."""
    try:
        import pynvml
    except ImportError as exc:
        return None, [], f"pynvml could not be imported ({exc}); install nvidia-ml-py"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return None, [], f"nvmlInit() raised {type(exc).__name__}: {exc}"
    try:
        return (*read_nvml_records(pynvml), None)
    except pynvml.NVMLError as exc:
        return None, [], f"an NVML device query raised {type(exc).__name__}: {exc}"
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()
