"""Whether a GPU is lost: evidence about the card from NVML, never a line of text alone.

A script that dies after a CUDA error names at most a device (``/device:GPU:1``), and the same text follows a
program's bug (an illegal address, a device-side assert) as a failing card. So ``hetero-cs run`` and ``hetero-cs
launch`` decide that a card is lost only from what NVML says about it while the script ran (:class:`CardWatch`):

* NVML reports it lost (``NVMLError_GPUIsLost``: the card fell off the bus);
* its count of uncorrected ECC errors (volatile) grew;
* NVML delivered a critical Xid event for it whose code is a hardware fault (:data:`HARDWARE_XIDS`), or the script's
  output holds the kernel's Xid line (``NVRM: Xid (PCI:0000:3b:00): 79, ...``) with such a code for its PCI bus id.

The GPUs are named by NVML's UUID and PCI bus id, joined with CUDA's ordinals through the CUDA driver
(:func:`hetero_cs.devices.discovery.join_gpu_records`), never by index: NVML counts in PCI order, CUDA fastest
first. Without the CUDA driver or NVML, :func:`visible_gpus` is empty and no GPU is ever called lost.

This module imports neither TensorFlow nor pynvml at import time.
"""

import contextlib
import dataclasses
import os
import re
import threading
from collections.abc import Sequence

HARDWARE_XIDS = frozenset({48, 61, 62, 64, 74, 79, 94, 95, 119, 120})
"""Xid codes of hardware faults (NVIDIA's Xid catalog): 48 double-bit ECC, 61/62 internal micro-controller, 64 ECC
page retirement failed, 74 NVLink, 79 fallen off the bus, 94/95 contained/uncontained ECC, 119/120 GSP. Codes a
program causes (13 graphics exception, 31 MMU fault, 43 stopped application) are not among them."""

_KERNEL_XID = re.compile(r"NVRM: Xid \(PCI:([0-9a-fA-F]+:[0-9a-fA-F]+:[0-9a-fA-F]+)[^)]*\): (\d+)")


@dataclasses.dataclass(frozen=True)
class Gpu:
    """One GPU a script may use: its ``ordinal`` in CUDA's order for this process, NVML's ``uuid`` and
    ``pci_bus_id``, and its ``name``."""

    ordinal: int
    uuid: str
    pci_bus_id: str
    name: str | None = None

    def __str__(self) -> str:
        return f"{self.name or 'GPU'} {self.uuid} (PCI {self.pci_bus_id})"


def visible_gpus() -> list[Gpu]:
    """The GPUs CUDA shows this process (``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER`` applied by the driver),
    in CUDA's order, each joined with its NVML record on UUID or PCI bus id; [] when the CUDA driver or NVML cannot
    be asked, or when one GPU has no NVML match (then no GPU can be named safely)."""
    from hetero_cs.devices import discovery

    records, _, reason = discovery._query_nvml()  # noqa: SLF001 - the module's own NVML read
    if records is None:
        return []
    identities = discovery._cuda_driver_identities()  # noqa: SLF001
    cuda = [discovery.TfGpuRecord(index=k, pci_bus_id=bus, uuid=uuid) for k, (bus, uuid) in sorted(identities.items())]
    joined = discovery.join_gpu_records(cuda, records, cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
                                        cuda_device_order=os.environ.get("CUDA_DEVICE_ORDER"))
    return [] if any(record is None for record in joined) else [
        Gpu(k.index, r.uuid, r.pci_bus_id, r.name) for k, r in zip(cuda, joined)]


def kernel_xid(line: str) -> tuple[str, int] | None:
    """(PCI ``domain:bus:device``, Xid code) of a kernel Xid line (``NVRM: Xid (PCI:0000:3b:00): 79, ...``)."""
    if (match := _KERNEL_XID.search(line)) is None:
        return None
    domain, bus, device = (int(part, 16) for part in match.group(1).split(":"))
    return f"{domain:08x}:{bus:02x}:{device:02x}", int(match.group(2))


class CardWatch:
    """NVML's view of ``gpus`` while a script runs: ``with CardWatch(gpus) as watch: ...; watch.lost()``.

    Entering reads each card's uncorrected ECC count and listens for critical Xid events (a thread); :meth:`lost`
    then stops listening, reads the events NVML queued, and lists the cards with evidence of a fault. Nothing when
    NVML is missing (``lost`` is then [] and ``available`` False).
    """

    def __init__(self, gpus: Sequence[Gpu]) -> None:
        self.gpus = list(gpus)
        self._nvml, self.available = None, False  # pynvml once NVML answered
        self._start: dict[str, int | None] = {}
        self._xids: dict[str, list[int]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def __enter__(self) -> "CardWatch":
        if not self.gpus:
            return self
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception:  # noqa: BLE001 - no nvidia-ml-py, no driver: no evidence can be had
            return self
        self._nvml, self.available = pynvml, True
        self._start = {gpu.uuid: self.state(gpu)[1] for gpu in self.gpus}
        self._thread = threading.Thread(target=self._listen, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._settle()
        if self._nvml is not None:
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()

    def state(self, gpu: Gpu) -> tuple[bool, int | None]:
        """(lost, uncorrected volatile ECC count or None when NVML does not say) for ``gpu`` now."""
        nvml = self._nvml
        try:
            handle = nvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
            return False, int(nvml.nvmlDeviceGetTotalEccErrors(handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                               nvml.NVML_VOLATILE_ECC))
        except Exception as exc:  # noqa: BLE001 - not supported (no ECC), or the card is lost
            return type(exc).__name__ == "NVMLError_GPUIsLost", None

    def _settle(self) -> None:
        """Stops listening, once the events NVML has queued are read."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def _record_next(self, wait, events, timeout_ms: int) -> bool:
        """Records the next critical Xid event within ``timeout_ms``; False when none came."""
        try:
            data = wait(events, timeout_ms)
        except Exception:  # noqa: BLE001 - NVMLError_Timeout: no event in that time
            return False
        uuid = self._nvml.nvmlDeviceGetUUID(data.device)
        uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
        with self._lock:
            self._xids.setdefault(uuid, []).append(int(data.eventData))
        return True

    def _listen(self) -> None:
        """Records critical Xid events per UUID until the watch ends (nothing where NVML has no events)."""
        nvml = self._nvml
        try:
            events = nvml.nvmlEventSetCreate()
        except Exception:  # noqa: BLE001
            return
        try:
            for gpu in self.gpus:
                with contextlib.suppress(Exception):  # not supported on this card
                    nvml.nvmlDeviceRegisterEvents(nvml.nvmlDeviceGetHandleByUUID(gpu.uuid),
                                                  nvml.nvmlEventTypeXidCriticalError, events)
            wait = getattr(nvml, "nvmlEventSetWait_v2", None) or nvml.nvmlEventSetWait
            while not self._stop.is_set():
                self._record_next(wait, events, 200)
            while self._record_next(wait, events, 50):  # the events NVML queued before the watch stopped
                pass
        finally:
            with contextlib.suppress(Exception):
                nvml.nvmlEventSetFree(events)

    def lost(self, lines: Sequence[str] = ()) -> list[tuple[Gpu, str]]:
        """The cards with evidence of a fault now, each with that evidence in words; ``lines``: the script's last
        lines, for the kernel's Xid lines."""
        if not self.available:
            return []
        self._settle()  # every event of the script's run read, however busy the host
        kernel = [found for found in map(kernel_xid, lines) if found is not None]
        found = []
        for gpu in self.gpus:
            lost, ecc = self.state(gpu)
            before = self._start.get(gpu.uuid)
            with self._lock:
                xids = [x for x in self._xids.get(gpu.uuid, []) if x in HARDWARE_XIDS]
            xids += [x for bus, x in kernel if gpu.pci_bus_id.startswith(bus) and x in HARDWARE_XIDS]
            if lost:
                found.append((gpu, "NVML reports it lost (off the bus)"))
            elif ecc is not None and before is not None and ecc > before:
                found.append((gpu, f"its uncorrected ECC error count grew from {before} to {ecc}"))
            elif xids:
                found.append((gpu, f"Xid {xids[0]} (a hardware fault) named it"))
        return found

    def health(self, gpu: Gpu) -> str:
        """How NVML sees ``gpu`` now, in words (for the line that says a card is not lost)."""
        if not self.available:
            return "NVML is not available (install nvidia-ml-py), so nothing shows the card lost"
        lost, ecc = self.state(gpu)
        return "NVML reports it lost" if lost else (
            f"NVML reports it present, uncorrected ECC errors {ecc if ecc is not None else 'not reported'}")
