"""Emulated memory (pure): NAME@SIZE overrides, Drift(memory_bytes=...), what a slice needs, the legacy cards."""

import pytest

from hetero_cs import ConfigError, EmulatedOutOfMemoryError, HeteroCSError
from hetero_cs.emulation import (
    CATALOG,
    Drift,
    Emulator,
    Workload,
    get_device_spec,
    max_examples_in_memory,
    parse_memory_bytes,
    slice_memory_bytes,
)

WORKLOAD = Workload(1e6, parameter_bytes=1_000, optimizer_bytes=2_000, activation_bytes_per_example=100,
                    non_trainable_bytes=500)  # fixed: 2 * 1000 + 500 + 2000 = 4500 bytes


@pytest.mark.parametrize(
    "name, fp32, fp16, memory_gb, bandwidth_gb_s",
    [("GTX1080Ti", 11.3, 0.177, 11, 484), ("P40", 12.0, 0.188, 24, 346), ("K80", 4.37, 4.37, 12, 240),
     ("RTX2080Ti", 13.4, 53.8, 11, 616)],
)
def test_legacy_cards_carry_their_published_figures_and_sources(name, fp32, fp16, memory_gb, bandwidth_gb_s):
    spec = get_device_spec(name.lower())
    assert spec is CATALOG[name]
    assert (spec.fp32_tflops, spec.fp16_tflops, spec.memory_bytes) == (fp32, fp16, memory_gb * 10**9)
    assert spec.memory_bandwidth_bytes_per_s == bandwidth_gb_s * 1e9
    assert (spec.pcie_generation, spec.pcie_lanes) == (3, 16)
    assert "NVIDIA" in spec.source


def test_k80_is_one_die_of_the_board():
    assert "per GPU die" in CATALOG["K80"].source and CATALOG["K80"].memory_bytes == 12 * 10**9


@pytest.mark.parametrize(
    "text, expected",
    [("48MB", 48_000_000), ("48 mb", 48_000_000), ("1.5GiB", 3 * 2**29), ("512KiB", 2**19), ("7B", 7),
     ("2GB", 2 * 10**9)],
)
def test_parse_memory_bytes(text, expected):
    assert parse_memory_bytes(text) == expected


@pytest.mark.parametrize("text", ["48", "MB", "-1MB", "0.1B", "12 parsecs", ""])
def test_parse_memory_bytes_rejects_what_is_not_a_size(text):
    with pytest.raises(ConfigError, match=r"A memory size is a number and a unit.*e.g. '48MB'"):
        parse_memory_bytes(text)


def test_a_name_may_override_the_catalog_memory():
    spec = get_device_spec("t4@48MB")
    assert spec.name == "T4@48MB" and spec.memory_bytes == 48_000_000  # the name keeps the override
    assert spec.fp32_tflops == CATALOG["T4"].fp32_tflops
    assert Emulator(["A10", "T4@48MB", "P100"]).specs[1].memory_bytes == 48_000_000
    assert get_device_spec(spec.name) == spec  # looked up again by its name (an Emulator passed on as names)
    with pytest.raises(ConfigError, match="memory size"):
        get_device_spec("T4@lots")
    for text in ("T4@", "T4@ ", "T4@\u0661\u0662MB"):  # no size; digits that are not ASCII
        with pytest.raises(ConfigError, match="memory size"):
            get_device_spec(text)


def test_what_a_slice_needs():
    assert WORKLOAD.fixed_memory_bytes == 4_500
    assert slice_memory_bytes(WORKLOAD, 0) == 0  # an idle replica needs nothing
    assert slice_memory_bytes(WORKLOAD, 10) == 5_500
    assert max_examples_in_memory(WORKLOAD, 5_599) == 10
    assert max_examples_in_memory(WORKLOAD, 4_599) == 0
    assert max_examples_in_memory(Workload(1.0, 10), 100) is None  # nothing grows with the batch
    with pytest.raises(ConfigError, match="batch_size=-1 must be an int >= 0"):
        slice_memory_bytes(WORKLOAD, -1)


def test_an_inference_slice_needs_no_gradients_or_optimizer_variables():
    assert slice_memory_bytes(WORKLOAD, 10, training=False) == 1_000 + 500 + 1_000  # weights, statistics, activations
    assert slice_memory_bytes(WORKLOAD, 0, training=False) == 0
    emulator = Emulator(["T4@6000B"], workload=WORKLOAD, time_scale=1.0)
    emulator.check_memory(0, 40, training=False)  # 5500 bytes: an evaluate or predict slice fits
    with pytest.raises(EmulatedOutOfMemoryError, match="needs 8500 bytes"):
        emulator.check_memory(0, 40)  # the same slice in a training step does not


def test_drift_memory_bytes_makes_factor_optional():
    drift = Drift(replica_id=1, from_step=20, memory_bytes=5_000)
    assert drift.factor == 1.0 and drift.describe() == "0.005 MB steps [20, end)"
    assert Drift(0, 2.0, 1, 9, memory_bytes=48_000_000).describe() == "x2 48 MB steps [1, 9)"
    assert Drift(1, 2.0, 200).factor == 2.0  # positional, as before
    with pytest.raises(ConfigError, match=r"changes nothing: give factor= .*, memory_bytes= .*, fails=True"):
        Drift(replica_id=1, from_step=3)
    with pytest.raises(ConfigError, match="memory_bytes=0 must be None or an int >= 1"):
        Drift(replica_id=1, memory_bytes=0)


def test_the_emulator_raises_out_of_memory_in_the_drift_window_only():
    emulator = Emulator(["A10", "T4@6000B"], workload=WORKLOAD, time_scale=1.0,
                        drift=[Drift(replica_id=1, from_step=2, until_step=4, memory_bytes=5_000)])
    assert emulator.memory_bytes(1) == 6_000 and emulator.max_batch_size(1) == 15
    assert emulator.memory_bytes(1, step=2) == 5_000 and emulator.max_batch_size(1, step=3) == 5
    emulator.delay_s(1, 15)
    emulator.delay_s(1, 15)
    with pytest.raises(EmulatedOutOfMemoryError, match=r"replica=1 \(T4@6000B\) needs 6000 bytes .* memory_bytes=5000"
                       ) as info:
        emulator.delay_s(1, 15)
    assert isinstance(info.value, MemoryError) and isinstance(info.value, HeteroCSError)
    assert (info.value.replica_id, info.value.needed_bytes, info.value.memory_bytes) == (1, 6_000, 5_000)
    assert emulator.steps_done == (0, 2)  # the failed step is not counted: its retry is the same step
    emulator.delay_s(1, 5)
    emulator.delay_s(1, 5)
    emulator.delay_s(1, 15)  # step 4: the memory is back
    emulator.check_memory(0, 10**6)  # the A10's 24 GB hold a million examples of 100 bytes


def test_the_smallest_overlapping_memory_limit_applies_and_describe_shows_it():
    emulator = Emulator(["T4"], workload=WORKLOAD, drift=[
        Drift(0, memory_bytes=9_000), Drift(0, factor=2.0, from_step=0, until_step=5, memory_bytes=7_000)])
    assert emulator.memory_bytes(0) == 7_000
    assert emulator.memory_bytes(0, step=5) == 9_000
    text = "\n".join(emulator.describe(64))
    assert "0.009 MB steps [0, end), x2 0.007 MB steps [0, 5)" in text
