"""hetero_cs.devices without TensorFlow or a driver: a fake pynvml module and fake TF device lists.

The machine in these tests has an A10 and a T4 (and, in the MIG tests, an A100 in MIG mode). NVML enumerates in
PCI order (T4 at 3b, A10 at 86, A100 at c1); CUDA's default FASTEST_FIRST order puts the A10 first. A join on the
index would therefore attach the wrong card's facts; every scenario below is one where that happens.
"""

from __future__ import annotations

import types
import warnings

import pytest

from hetero_cs.devices import discovery as devices
from hetero_cs.devices.discovery import (
    DeviceInfo,
    TfGpuRecord,
    discover_devices,
    format_device_table,
    join_gpu_records,
    parse_cuda_visible_devices,
)
from hetero_cs.devices.nvml import NvmlRecord, normalize_pci_bus_id, read_nvml_records
from hetero_cs.errors import DeviceError

GIB = 2**30
T4_UUID = "GPU-11111111-2222-3333-4444-555555555555"
A10_UUID = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"
A100_UUID = "GPU-99999999-8888-7777-6666-555555555555"
MIG_SMALL_UUID = "MIG-01234567-89ab-cdef-0123-456789abcdef"
MIG_LARGE_UUID = "MIG-fedcba98-7654-3210-fedc-ba9876543210"
T4_BUS, A10_BUS, A100_BUS = "00000000:3b:00.0", "00000000:86:00.0", "00000000:c1:00.0"


class FakeCard:
    def __init__(self, uuid, bus_id, name, total_gib, free_gib, generation, width, capability, slices=()):
        self.uuid, self.bus_id, self.name = uuid, bus_id, name
        self.total, self.free = total_gib * GIB, free_gib * GIB
        self.generation, self.width, self.capability = generation, width, capability
        self.slices = list(slices)


def make_cards(*, with_mig=False):
    """NVML's order: PCI order."""
    cards = [
        FakeCard(T4_UUID, "00000000:3B:00.0", "Tesla T4", 15, 14, 3, 16, (7, 5)),
        FakeCard(A10_UUID, "00000000:86:00.0", "NVIDIA A10", 22, 21, 4, 16, (8, 6)),
    ]
    if with_mig:
        slices = [FakeCard(MIG_SMALL_UUID, "", "NVIDIA A100 80GB PCIe MIG 1g.10gb", 10, 9, None, None, None),
                  None,  # an empty slot
                  FakeCard(MIG_LARGE_UUID, "", "NVIDIA A100 80GB PCIe MIG 2g.20gb", 20, 19, None, None, None)]
        cards.append(FakeCard(A100_UUID, "00000000:C1:00.0", "NVIDIA A100 80GB PCIe", 80, 79, 4, 16, (8, 0),
                              slices=slices))
    return cards


def make_fake_pynvml(cards, *, init_error=None, failing=None):
    """A stand-in for the pynvml module. ``failing`` maps a function name to the error class name it raises."""
    module = types.ModuleType("pynvml")
    module.NVML_DEVICE_MIG_ENABLE = 1

    class NVMLError(Exception):
        pass

    module.NVMLError = NVMLError
    for name in ("LibraryNotFound", "DriverNotLoaded", "LibRmVersionMismatch", "NoPermission", "NotSupported",
                 "NotFound", "Unknown"):
        setattr(module, f"NVMLError_{name}", type(f"NVMLError_{name}", (NVMLError,), {}))
    module.calls = {"init": 0, "shutdown": 0}
    failing = dict(failing or {})

    def api(function):
        def wrapper(*args):
            if function.__name__ in failing:
                raise getattr(module, failing[function.__name__])(function.__name__)
            return function(*args)
        wrapper.__name__ = function.__name__
        setattr(module, function.__name__, wrapper)
        return wrapper

    @api
    def nvmlInit():
        module.calls["init"] += 1
        if init_error is not None:
            raise getattr(module, init_error)(init_error)

    @api
    def nvmlShutdown():
        module.calls["shutdown"] += 1

    @api
    def nvmlDeviceGetCount():
        return len(cards)

    @api
    def nvmlDeviceGetHandleByIndex(index):
        return cards[index]

    @api
    def nvmlDeviceGetUUID(handle):
        return handle.uuid

    @api
    def nvmlDeviceGetName(handle):
        return handle.name.encode()  # older pynvml returned bytes

    @api
    def nvmlDeviceGetPciInfo(handle):
        return types.SimpleNamespace(busId=handle.bus_id.encode())

    @api
    def nvmlDeviceGetMemoryInfo(handle):
        return types.SimpleNamespace(total=handle.total, free=handle.free, used=handle.total - handle.free)

    @api
    def nvmlDeviceGetMaxPcieLinkGeneration(handle):
        return handle.generation

    @api
    def nvmlDeviceGetMaxPcieLinkWidth(handle):
        return handle.width

    @api
    def nvmlDeviceGetCudaComputeCapability(handle):
        return handle.capability

    @api
    def nvmlDeviceGetMigMode(handle):
        if handle.capability is None or handle.capability < (8, 0):
            raise module.NVMLError_NotSupported("MIG")
        return [1 if handle.slices else 0, 1 if handle.slices else 0]

    @api
    def nvmlDeviceGetMaxMigDeviceCount(handle):
        return len(handle.slices)

    @api
    def nvmlDeviceGetMigDeviceHandleByIndex(handle, index):
        if handle.slices[index] is None:
            raise module.NVMLError_NotFound("empty slot")
        return handle.slices[index]

    return module


def tf_view(cuda_visible_devices, *, bus_ids=True, uuids=False):
    """The TF GPU records CUDA produces for the fake machine (FASTEST_FIRST: A10 is ordinal 0 when all show)."""
    cuda_order = [("NVIDIA A10", A10_BUS, A10_UUID, (8, 6)), ("Tesla T4", T4_BUS, T4_UUID, (7, 5))]
    if cuda_visible_devices is None:
        visible = cuda_order
    elif cuda_visible_devices.startswith("MIG-"):
        visible = [("NVIDIA A100 80GB PCIe MIG 2g.20gb", A100_BUS, MIG_LARGE_UUID, (8, 0))]
    elif cuda_visible_devices.startswith("GPU-"):
        visible = [next(d for d in cuda_order if d[2].startswith(cuda_visible_devices))]
    else:
        visible = [cuda_order[int(i)] for i in cuda_visible_devices.split(",")]
    return [TfGpuRecord(index=k, pci_bus_id=bus if bus_ids else None, name=name, compute_capability=capability,
                        uuid=uuid[4:] if uuids else None)  # CUDA's UUID has no prefix
            for k, (name, bus, uuid, capability) in enumerate(visible)]


@pytest.fixture()
def nvml_records():
    records, problems = read_nvml_records(make_fake_pynvml(make_cards(with_mig=True)))
    assert problems == []
    return records


@pytest.fixture(autouse=True)
def _fresh_warning_registry(monkeypatch):
    monkeypatch.setattr(devices, "_WARNED_ONCE", set())
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)


# ----------------------------------------------------------------------------------------------- pure helpers


@pytest.mark.parametrize("raw", ["0000:3B:00.0", "00000000:3b:00.0", b"00000000:3B:00.0\x00", "3b:00.0"])
def test_pci_bus_ids_normalise_to_one_spelling(raw):
    assert normalize_pci_bus_id(raw) == T4_BUS


def test_bad_pci_bus_id_is_rejected():
    with pytest.raises(DeviceError, match=r"pci_bus_id='GPU-0'"):
        normalize_pci_bus_id("GPU-0")


@pytest.mark.parametrize(
    "value, expected",
    [(None, None), ("", []), ("1", ["1"]), (" 1, 0 ", ["1", "0"]), ("0,-1,1", ["0"]), ("0,foo,1", ["0"]),
     (f"{MIG_SMALL_UUID},0", [MIG_SMALL_UUID, "0"]), ("gpu-aaaa", ["gpu-aaaa"])],
)
def test_parse_cuda_visible_devices(value, expected):
    assert parse_cuda_visible_devices(value) == expected


def test_read_nvml_records_lists_gpus_and_mig_slices(nvml_records):
    by_uuid = {record.uuid: record for record in nvml_records}
    assert [r.uuid for r in nvml_records] == [T4_UUID, A10_UUID, A100_UUID, MIG_SMALL_UUID, MIG_LARGE_UUID]
    assert by_uuid[T4_UUID] == NvmlRecord(uuid=T4_UUID, pci_bus_id=T4_BUS, name="Tesla T4",
                                          memory_total_bytes=15 * GIB, memory_free_bytes=14 * GIB,
                                          pcie_generation=3, pcie_width=16, compute_capability=(7, 5), index=0)
    large = by_uuid[MIG_LARGE_UUID]
    assert (large.mig, large.parent_uuid, large.pci_bus_id) == (True, A100_UUID, A100_BUS)
    assert large.memory_total_bytes == 20 * GIB and large.pcie_generation == 4
    assert by_uuid[A100_UUID].mig and not by_uuid[A10_UUID].mig


def test_a_denied_memory_query_leaves_memory_empty_and_is_reported():
    fake = make_fake_pynvml(make_cards(), failing={"nvmlDeviceGetMemoryInfo": "NVMLError_NoPermission"})
    records, problems = read_nvml_records(fake)
    assert [r.memory_total_bytes for r in records] == [None, None]
    assert [r.pcie_generation for r in records] == [3, 4]  # the other facts are kept
    assert problems == [f"memory of {T4_UUID}: NVMLError_NoPermission", f"memory of {A10_UUID}: NVMLError_NoPermission"]


# ------------------------------------------------------------------------------------------------------- join


def names_of(joined):
    return [record.name if record is not None else None for record in joined]


@pytest.mark.parametrize(
    "cuda_visible_devices, expected",
    [(None, ["NVIDIA A10", "Tesla T4"]),  # index join would give T4, A10
     ("1", ["Tesla T4"]),  # CUDA ordinal 1 is the T4; NVML index 1 is the A10
     ("1,0", ["Tesla T4", "NVIDIA A10"])],
)
def test_join_on_pci_bus_id_whatever_the_orders(nvml_records, cuda_visible_devices, expected):
    joined = join_gpu_records(tf_view(cuda_visible_devices), nvml_records, cuda_visible_devices=cuda_visible_devices)
    assert names_of(joined) == expected


@pytest.mark.parametrize("entry", [A10_UUID, A10_UUID[:12], A10_UUID.upper()])
def test_join_on_a_uuid_entry_needs_no_bus_id(nvml_records, entry):
    joined = join_gpu_records(tf_view(A10_UUID, bus_ids=False), nvml_records, cuda_visible_devices=entry)
    assert names_of(joined) == ["NVIDIA A10"]


def test_join_on_the_uuid_the_cuda_driver_gave(nvml_records):
    joined = join_gpu_records(tf_view("1,0", bus_ids=False, uuids=True), nvml_records, cuda_visible_devices="1,0")
    assert names_of(joined) == ["Tesla T4", "NVIDIA A10"]


def test_a_mig_entry_reports_the_slice_not_its_parent(nvml_records):
    joined = join_gpu_records(tf_view(MIG_LARGE_UUID), nvml_records, cuda_visible_devices=MIG_LARGE_UUID)
    assert len(joined) == 1
    assert joined[0].uuid == MIG_LARGE_UUID and joined[0].mig
    assert joined[0].memory_total_bytes == 20 * GIB  # the parent card has 80 GiB


def test_without_bus_id_an_index_matches_only_in_pci_order(nvml_records):
    view = tf_view("1", bus_ids=False)
    assert join_gpu_records(view, nvml_records, cuda_visible_devices="1") == [None]
    # With CUDA_DEVICE_ORDER=PCI_BUS_ID, CUDA's device 1 is the second card by bus id: the A10.
    joined = join_gpu_records(view, nvml_records, cuda_visible_devices="1", cuda_device_order="PCI_BUS_ID")
    assert names_of(joined) == ["NVIDIA A10"]


# ---------------------------------------------------------------------------------- discover_devices, end to end


def fake_tf_devices(cuda_visible_devices):
    listed = [("/device:CPU:0", "CPU", None)]
    listed += [(f"/device:GPU:{r.index}", "GPU", r) for r in tf_view(cuda_visible_devices)]
    return lambda: listed


def install(monkeypatch, fake, cuda_visible_devices=None):
    monkeypatch.setitem(__import__("sys").modules, "pynvml", fake)
    monkeypatch.setattr(devices, "_list_tf_devices", fake_tf_devices(cuda_visible_devices))
    if cuda_visible_devices is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", cuda_visible_devices)


def test_discover_devices_joins_nvml_facts(monkeypatch):
    fake = make_fake_pynvml(make_cards(with_mig=True))
    install(monkeypatch, fake, "1,0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        found = discover_devices()
    assert [d.name for d in found] == ["/device:CPU:0", "/device:GPU:0", "/device:GPU:1"]
    cpu, t4, a10 = found
    assert cpu.device_type == "CPU" and cpu.source == "tensorflow" and cpu.pcie_generation is None
    assert (t4.description, t4.uuid, t4.pci_bus_id, t4.memory_free_bytes) == ("Tesla T4", T4_UUID, T4_BUS, 14 * GIB)
    assert (t4.pcie_generation, t4.pcie_width, t4.compute_capability, t4.source) == (3, 16, (7, 5), "nvml")
    assert a10.description == "NVIDIA A10" and a10.memory_total_bytes == 22 * GIB and a10.pcie_generation == 4
    assert fake.calls == {"init": 1, "shutdown": 1}


def test_discover_devices_with_a_mig_slice(monkeypatch):
    install(monkeypatch, make_fake_pynvml(make_cards(with_mig=True)), MIG_SMALL_UUID)
    monkeypatch.setattr(devices, "_list_tf_devices", lambda: [
        ("/device:GPU:0", "GPU", TfGpuRecord(index=0, pci_bus_id=A100_BUS, name="NVIDIA A100 80GB PCIe"))])
    (slice_info,) = discover_devices()
    assert slice_info.mig and slice_info.uuid == MIG_SMALL_UUID
    assert slice_info.memory_total_bytes == 10 * GIB and slice_info.description.endswith("MIG 1g.10gb")


@pytest.mark.parametrize("error", ["NVMLError_DriverNotLoaded", "NVMLError_LibRmVersionMismatch",
                                   "NVMLError_LibraryNotFound"])
def test_nvml_start_up_failure_warns_once_and_falls_back_to_tf(monkeypatch, error):
    install(monkeypatch, make_fake_pynvml(make_cards(), init_error=error), "1")
    with pytest.warns(UserWarning, match=f"NVML is unavailable: nvmlInit\\(\\) raised {error}") as record:
        found = discover_devices()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call must stay silent
        again = discover_devices()
    assert len(record) == 1 and record[0].filename == __file__  # stacklevel points at the caller
    assert found[1:] == again[1:]  # (the CPU's free host memory moves between calls)
    gpu = found[1]
    assert (gpu.description, gpu.pci_bus_id, gpu.compute_capability) == ("Tesla T4", T4_BUS, (7, 5))
    assert (gpu.source, gpu.uuid, gpu.memory_free_bytes, gpu.pcie_generation) == ("tensorflow", None, None, None)


def test_a_failed_device_query_falls_back_and_still_shuts_nvml_down(monkeypatch):
    fake = make_fake_pynvml(make_cards(), failing={"nvmlDeviceGetCount": "NVMLError_Unknown"})
    install(monkeypatch, fake)
    with pytest.warns(UserWarning, match="an NVML device query raised NVMLError_Unknown"):
        found = discover_devices()
    assert {d.source for d in found} == {"tensorflow"}
    assert fake.calls == {"init": 1, "shutdown": 1}


def test_a_denied_memory_query_keeps_the_other_nvml_facts(monkeypatch):
    fake = make_fake_pynvml(make_cards(), failing={"nvmlDeviceGetMemoryInfo": "NVMLError_NoPermission"})
    install(monkeypatch, fake, "0")
    with pytest.warns(UserWarning, match="NVML refused some device facts.*memory of GPU-aaaa.*NoPermission"):
        _, a10 = discover_devices()
    assert (a10.source, a10.uuid, a10.pcie_generation) == ("nvml", A10_UUID, 4)
    assert a10.memory_total_bytes is None and a10.memory_free_bytes is None


def test_missing_pynvml_falls_back(monkeypatch):
    install(monkeypatch, None)  # sys.modules[name] = None makes `import pynvml` raise ImportError
    with pytest.warns(UserWarning, match="pynvml could not be imported.*nvidia-ml-py"):
        found = discover_devices()
    assert [d.source for d in found] == ["tensorflow"] * 3


# ------------------------------------------------------------------------------------------ DeviceInfo, table


@pytest.mark.parametrize(
    "changes, pattern",
    [({"name": ""}, "name is empty"), ({"device_type": "TPU"}, "device_type='TPU'"),
     ({"source": "cuda"}, "source='cuda'"), ({"memory_total_bytes": -1}, "memory_total_bytes=-1")],
)
def test_device_info_validation(changes, pattern):
    fields = dict(name="/device:GPU:0", device_type="GPU", description="NVIDIA A10")
    fields.update(changes)
    with pytest.raises(DeviceError, match=pattern):
        DeviceInfo(**fields)


def test_format_device_table_marks_emulated_devices():
    table = format_device_table([
        DeviceInfo(name="/device:GPU:0", device_type="GPU", description="NVIDIA A10", memory_total_bytes=24 * GIB,
                   memory_free_bytes=23 * GIB, pcie_generation=4, pcie_width=16, compute_capability=(8, 6),
                   source="nvml"),
        DeviceInfo(name="/device:CPU:1", device_type="CPU", description="Xeon", emulated_as="T4"),
    ])
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["device", "type", "description"]
    assert lines[1].split() == ["/device:GPU:0", "GPU", "NVIDIA", "A10", "24.0", "23.0", "gen4", "x16", "8.6", "no",
                                "nvml", "-"]
    assert lines[2].split()[-1] == "T4" and "EMULATED" in lines[3]
    assert "EMULATED" not in format_device_table([DeviceInfo(name="/device:CPU:0", device_type="CPU",
                                                             description="Xeon")])


def test_without_a_gpu_an_unavailable_nvml_is_not_a_warning(monkeypatch, caplog):
    install(monkeypatch, make_fake_pynvml(make_cards(), init_error="NVMLError_LibraryNotFound"))
    monkeypatch.setattr(devices, "_list_tf_devices", lambda: [("/device:CPU:0", "CPU", None)])
    with warnings.catch_warnings(), caplog.at_level("INFO", logger="hetero_cs.devices"):
        warnings.simplefilter("error")
        (cpu,) = discover_devices()
    assert cpu.device_type == "CPU"
    assert any("NVML is unavailable" in r.getMessage() for r in caplog.records)
