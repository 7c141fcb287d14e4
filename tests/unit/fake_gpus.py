"""NVML and CUDA-driver fakes built from a real H200's records (tests/data/h200_nvml.json).

``install(monkeypatch, cards, state)`` puts a fake ``pynvml`` module in ``sys.modules`` and makes the CUDA driver
report ``cards`` in the order given (CUDA's order: fastest first by default), while NVML lists them in PCI bus order,
as the real ones do. A card's faults live in the JSON file ``state`` (``{uuid: {"ecc": n, "lost": bool, "xids":
[..]}}``), so a child process (the script under test) can make its card fail the way the driver would show it.
"""

import dataclasses
import json
import pathlib
import sys
import threading
import time
import types

RECORD = json.loads((pathlib.Path(__file__).resolve().parents[1] / "data" / "h200_nvml.json").read_text())
NVML = RECORD["nvml_record"]


@dataclasses.dataclass(frozen=True)
class Card:
    uuid: str
    pci_bus_id: str
    name: str
    memory_total_bytes: int
    memory_free_bytes: int
    pcie_generation: int
    pcie_width: int
    compute_capability: tuple
    ecc_uncorrected: int = 0


# The real H200 as NVML and the CUDA driver saw it (its UUID was not recorded: made up here).
H200 = Card("GPU-6a4c1f0e-0000-4000-8000-000000000002", NVML["pci_bus_id"], NVML["name"],
            NVML["memory_total_bytes"], NVML["memory_free_bytes"], NVML["pcie_generation"], NVML["pcie_width"],
            tuple(NVML["compute_capability"]), NVML["ecc_uncorrected_volatile"])
# A slower card on a lower PCI bus: NVML counts it first (PCI order), CUDA second (fastest first).
A10 = Card("GPU-1b2d3c4e-0000-4000-8000-0000000000a1", "00000000:00:05.0", "NVIDIA A10", 24 * 2**30, 23 * 2**30, 4,
           16, (8, 6))


def write_state(path, state):
    temp = pathlib.Path(str(path) + ".tmp")
    temp.write_text(json.dumps(state))
    temp.replace(path)


def make_pynvml(cards, state_path):
    """A stand-in for pynvml over ``cards`` (listed in PCI order, as NVML does) and the faults in ``state_path``."""
    module = types.ModuleType("pynvml")
    by_bus = sorted(cards, key=lambda c: c.pci_bus_id)

    class NVMLError(Exception):
        pass

    for name in ("NVMLError_GPUIsLost", "NVMLError_NotSupported", "NVMLError_Timeout", "NVMLError_NotFound"):
        setattr(module, name, type(name, (NVMLError,), {}))
    module.NVMLError = NVMLError
    module.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, module.NVML_VOLATILE_ECC = 1, 0
    module.NVML_DEVICE_MIG_ENABLE, module.nvmlEventTypeXidCriticalError = 1, 8
    delivered = set()
    lock = threading.Lock()

    def state(card):
        try:
            return json.loads(pathlib.Path(state_path).read_text()).get(card.uuid, {})
        except (OSError, ValueError):
            return {}

    def alive(card):
        if state(card).get("lost"):
            raise module.NVMLError_GPUIsLost("GPU is lost")
        return card

    module.nvmlInit = lambda: None
    module.nvmlShutdown = lambda: None
    module.nvmlDeviceGetCount = lambda: len(by_bus)
    module.nvmlDeviceGetHandleByIndex = lambda index: by_bus[index]

    def by_uuid(uuid):
        for card in by_bus:
            if card.uuid == uuid:
                return alive(card)
        raise module.NVMLError_NotFound(uuid)

    module.nvmlDeviceGetHandleByUUID = by_uuid
    module.nvmlDeviceGetUUID = lambda card: card.uuid
    module.nvmlDeviceGetName = lambda card: card.name
    module.nvmlDeviceGetPciInfo = lambda card: types.SimpleNamespace(busId=card.pci_bus_id.encode())
    module.nvmlDeviceGetMemoryInfo = lambda card: types.SimpleNamespace(total=card.memory_total_bytes,
                                                                        free=card.memory_free_bytes)
    module.nvmlDeviceGetMaxPcieLinkGeneration = lambda card: card.pcie_generation
    module.nvmlDeviceGetMaxPcieLinkWidth = lambda card: card.pcie_width
    module.nvmlDeviceGetCudaComputeCapability = lambda card: card.compute_capability
    module.nvmlDeviceGetMigMode = lambda card: (0, 0)
    module.nvmlDeviceGetTotalEccErrors = lambda card, kind, counter: alive(card).ecc_uncorrected + state(card).get(
        "ecc", 0)
    module.nvmlEventSetCreate = lambda: object()
    module.nvmlDeviceRegisterEvents = lambda card, kinds, events: None
    module.nvmlEventSetFree = lambda events: None

    def wait(events, timeout_ms):
        deadline = time.monotonic() + timeout_ms / 1000
        while time.monotonic() < deadline:
            for card in by_bus:
                for n, xid in enumerate(state(card).get("xids", [])):
                    with lock:
                        if (card.uuid, n) not in delivered:
                            delivered.add((card.uuid, n))
                            return types.SimpleNamespace(device=card, eventData=xid)
            time.sleep(0.02)
        raise module.NVMLError_Timeout("timeout")

    module.nvmlEventSetWait_v2 = wait
    return module


def install(monkeypatch, cards, state_path):
    """NVML over ``cards`` and a CUDA driver that shows them in the order given; ``state_path`` holds faults."""
    from hetero_cs.devices import discovery

    write_state(state_path, {})
    monkeypatch.setitem(sys.modules, "pynvml", make_pynvml(cards, state_path))
    # The real record's CUDA identity has the PCI bus id and no UUID: the join is on the bus id, as it was there.
    monkeypatch.setattr(discovery, "_cuda_driver_identities",
                        lambda: {k: (card.pci_bus_id, None) for k, card in enumerate(cards)})
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
