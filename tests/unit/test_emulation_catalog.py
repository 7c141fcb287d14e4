"""The pure part of hetero_cs.emulation: catalog, step-time model, drift, Emulator (no TensorFlow)."""

from __future__ import annotations

import dataclasses
import math
import pathlib
import re
import subprocess
import sys
import threading

import pytest

from hetero_cs.emulation import (
    CATALOG,
    MAX_EMULATED_MAKESPAN_S,
    MAX_TIME_SCALE,
    TIME_SCALE_ENV_VAR,
    DeviceSpec,
    Drift,
    Emulator,
    Workload,
    emulated_step_time_s,
    get_device_spec,
)
from hetero_cs.errors import ConfigError, EmulationError, HeteroCSError, UnknownEmulatedDeviceError

# MLP 784-256-10 in fp32: forward FLOPs 2*784*256 + 2*256*10; parameters (784*256+256 + 256*10+10) * 4 bytes.
MLP = Workload(flops_per_example=2 * 784 * 256 + 2 * 256 * 10, parameter_bytes=(784 * 256 + 256 + 256 * 10 + 10) * 4)
REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _no_time_scale_env(monkeypatch):
    monkeypatch.delenv(TIME_SCALE_ENV_VAR, raising=False)


# ----------------------------------------------------------------------------------------------------- catalog


def test_catalog_holds_the_documented_devices_and_is_read_only():
    assert set(CATALOG) == {"A10", "T4", "P100", "V100", "A100", "H100", "H100SXM", "H200", "L4", "L40S", "RTXA6000",
                            "RTX3090", "RTX4090", "GTX1080Ti", "P40", "K80", "RTX2080Ti", "CPU"}
    with pytest.raises(TypeError):
        CATALOG["X"] = CATALOG["T4"]  # type: ignore[index]
    with pytest.raises(Exception):  # frozen dataclass
        CATALOG["T4"].fp32_tflops = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    "name, fp32, tf32, fp16, memory_gb, bandwidth_gb_s, generation",
    [
        ("A10", 31.2, 62.5, 125.0, 24, 600, 4),
        ("T4", 8.1, None, 65.0, 16, 320, 3),
        ("P100", 9.3, None, 18.7, 16, 732, 3),
        ("V100", 14.0, None, 112.0, 32, 900, 3),
        ("A100", 19.5, 156.0, 312.0, 80, 1935, 4),
        ("H100", 51.0, 378.0, 756.0, 80, 2000, 5),
        ("H100SXM", 67.0, 494.7, 989.4, 80, 3350, 5),
        ("H200", 67.0, 494.7, 989.4, 141, 4800, 5),
        ("L4", 30.3, 60.0, 121.0, 24, 300, 4),
        ("L40S", 91.6, 183.0, 362.05, 48, 864, 4),
        ("RTXA6000", 38.7, 77.4, 154.8, 48, 768, 4),
        ("RTX3090", 35.6, 35.6, 71.0, 24, 936, 4),
        ("RTX4090", 82.6, 82.6, 165.2, 24, 1008, 4),
    ],
)
def test_published_figures(name, fp32, tf32, fp16, memory_gb, bandwidth_gb_s, generation):
    spec = CATALOG[name]
    assert spec.name == name
    assert spec.fp32_tflops == fp32
    assert spec.tf32_tflops == tf32
    assert spec.fp16_tflops == fp16
    assert spec.memory_bytes == memory_gb * 10**9
    assert spec.memory_bandwidth_bytes_per_s == pytest.approx(bandwidth_gb_s * 1e9)
    assert (spec.pcie_generation, spec.pcie_lanes) == (generation, 16)
    assert ("datasheet" in spec.source or "whitepaper" in spec.source) and "https://" in spec.source
    assert "nvidia" in spec.source.lower()


def test_cpu_entry_is_a_stated_assumption_without_pcie():
    cpu = CATALOG["CPU"]
    assert cpu.source.startswith("Assumption")
    assert cpu.pcie_generation is None and cpu.pcie_lanes is None
    assert math.isinf(cpu.pcie_bandwidth_bytes_per_s)
    assert cpu.fp32_tflops < min(spec.fp32_tflops for name, spec in CATALOG.items() if name != "CPU")


@pytest.mark.parametrize("name, expected", [("T4", 0.985e9 * 16), ("A10", 1.969e9 * 16), ("H100", 3.938e9 * 16)])
def test_pcie_bandwidth_per_direction(name, expected):
    assert CATALOG[name].pcie_bandwidth_bytes_per_s == pytest.approx(expected)


@pytest.mark.parametrize("name", ["a10", "T4", " h100 ", "Cpu"])
def test_get_device_spec_is_case_insensitive(name):
    assert get_device_spec(name) is CATALOG[name.strip().upper()]


def test_unknown_device_lists_known_names_and_is_a_key_error():
    with pytest.raises(UnknownEmulatedDeviceError, match=r"name='MI50'.*Known devices: A10, T4, P100"):
        get_device_spec("MI50")
    with pytest.raises(KeyError):
        get_device_spec("")
    with pytest.raises(HeteroCSError):
        get_device_spec(None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "changes, pattern",
    [
        ({"fp32_tflops": 0.0}, "fp32_tflops=0.0"),
        ({"memory_bytes": -1}, "memory_bytes=-1"),
        ({"pcie_generation": 7}, "pcie_generation=7"),
        ({"pcie_lanes": None}, "both be set"),
        ({"pcie_lanes": 64}, "pcie_lanes=64"),
        ({"source": ""}, "source is empty"),
    ],
)
def test_device_spec_validation(changes, pattern):
    fields = dict(name="X", fp32_tflops=1.0, fp16_tflops=2.0, memory_bytes=10**9, memory_bandwidth_bytes_per_s=1e9,
                  pcie_generation=3, pcie_lanes=16, source="test")
    fields.update(changes)
    with pytest.raises(ConfigError, match=pattern):
        DeviceSpec(**fields)


@pytest.mark.parametrize("flops, parameter_bytes", [(-1.0, 0), (math.nan, 0), (1.0, -4), (1.0, 2.5)])
def test_workload_validation(flops, parameter_bytes):
    with pytest.raises(ConfigError, match="Workload"):
        Workload(flops_per_example=flops, parameter_bytes=parameter_bytes)


# -------------------------------------------------------------------------------------------- step-time model


def test_step_time_is_the_sum_of_documented_terms():
    t4 = CATALOG["T4"]
    transfer_s = MLP.parameter_bytes / t4.pcie_bandwidth_bytes_per_s
    compute_s = 3 * MLP.flops_per_example * 256 / (8.1e12 * 0.5)
    expected = 5e-4 + transfer_s + compute_s + transfer_s
    assert emulated_step_time_s(t4, 256, MLP) == pytest.approx(expected, rel=1e-12)
    assert emulated_step_time_s(t4, 256, MLP) == pytest.approx(6.81e-4, rel=1e-2)  # the docstring's example
    faster = emulated_step_time_s(t4, 256, MLP, compute_efficiency=1.0, launch_overhead_s=0.0)
    assert faster == pytest.approx(2 * transfer_s + compute_s / 2, rel=1e-12)
    # Each layer costs a fixed LAYER_OVERHEAD_S a step; each example moves its activations ACTIVATION_PASSES times
    # through device memory at the card's bandwidth.
    deep = dataclasses.replace(MLP, layers=10, activation_bytes_per_example=4_200)
    memory_s = 10.0 * 4_200 * 256 / t4.memory_bandwidth_bytes_per_s
    assert emulated_step_time_s(t4, 256, deep) == pytest.approx(expected + 10 * 6e-5 + memory_s, rel=1e-12)


def test_float32_runs_at_tf32_on_cards_that_have_it_unless_it_is_off():
    compute_only = Workload(flops_per_example=1e9, parameter_bytes=0)
    fp32 = dataclasses.replace(compute_only, tensor_float_32=False)
    for name in ("A10", "A100", "H100", "H100SXM", "H200", "L4", "L40S", "RTXA6000", "RTX3090", "RTX4090"):
        spec = CATALOG[name]
        assert spec.rate_name() == "tf32" and spec.rate_name(tf32=False) == "fp32"
        ratio = emulated_step_time_s(spec, 100, fp32, launch_overhead_s=0) / emulated_step_time_s(
            spec, 100, compute_only, launch_overhead_s=0)
        assert ratio == pytest.approx(spec.tf32_tflops / spec.fp32_tflops)
    for name in ("T4", "P100", "V100", "RTX2080Ti", "GTX1080Ti", "P40", "K80", "CPU"):
        spec = CATALOG[name]  # no TF32: float32 runs on the CUDA cores whatever the setting
        assert spec.rate_name() == "fp32" and spec.peak_tflops("float32") == spec.fp32_tflops
        assert emulated_step_time_s(spec, 100, fp32) == emulated_step_time_s(spec, 100, compute_only)


def test_host_cpu_pays_no_transfer():
    heavy_params = Workload(flops_per_example=0.0, parameter_bytes=10**9)
    assert emulated_step_time_s(CATALOG["CPU"], 8, heavy_params, launch_overhead_s=0.0) == 0.0
    assert emulated_step_time_s(CATALOG["T4"], 8, heavy_params, launch_overhead_s=0.0) > 0.1


def test_empty_slice_idles():
    assert emulated_step_time_s(CATALOG["P100"], 0, MLP) == 0.0


def test_step_time_grows_with_batch_and_keeps_device_ratios():
    times = [emulated_step_time_s(CATALOG["T4"], b, MLP) for b in (1, 2, 64, 1024)]
    assert times == sorted(times) and times[0] < times[-1]
    compute_only = Workload(flops_per_example=1e9, parameter_bytes=0)
    ratio = (emulated_step_time_s(CATALOG["T4"], 1000, compute_only, launch_overhead_s=0.0)
             / emulated_step_time_s(CATALOG["A10"], 1000, compute_only, launch_overhead_s=0.0))
    assert ratio == pytest.approx(62.5 / 8.1)  # the A10 runs float32 as TF32, the T4 has no TF32


@pytest.mark.parametrize(
    "kwargs, pattern",
    [({"batch_size": -1}, "batch_size=-1"), ({"compute_efficiency": 0.0}, "compute_efficiency=0.0"),
     ({"launch_overhead_s": -1.0}, "launch_overhead_s=-1.0")],
)
def test_step_time_validation(kwargs, pattern):
    arguments = {"batch_size": 4, **kwargs}
    batch_size = arguments.pop("batch_size")
    with pytest.raises(ConfigError, match=pattern):
        emulated_step_time_s(CATALOG["T4"], batch_size, MLP, **arguments)


# ------------------------------------------------------------------------------------------------------ drift


@pytest.mark.parametrize(
    "kwargs, pattern",
    [({"replica_id": -1, "factor": 2.0}, "replica_id=-1"), ({"replica_id": 0, "factor": 0.0}, "factor=0.0"),
     ({"replica_id": 0, "factor": 2.0, "from_step": -3}, "from_step=-3"),
     ({"replica_id": 0, "factor": 2.0, "from_step": 5, "until_step": 5}, "until_step=5")],
)
def test_drift_validation(kwargs, pattern):
    with pytest.raises(ConfigError, match=pattern):
        Drift(**kwargs)


def test_drift_applies_on_half_open_range():
    drift = Drift(replica_id=0, factor=2.0, from_step=3, until_step=5)
    assert [drift.applies(s) for s in range(7)] == [False, False, False, True, True, False, False]
    assert Drift(replica_id=0, factor=2.0, from_step=3).applies(10**6)


# --------------------------------------------------------------------------------------------------- Emulator


def test_emulator_validates_names_and_drift():
    with pytest.raises(UnknownEmulatedDeviceError, match="Known devices"):
        Emulator(["A10", "MI50"])
    with pytest.raises(ConfigError, match="non-empty"):
        Emulator([])
    with pytest.raises(ConfigError, match="non-empty"):
        Emulator("T4")
    with pytest.raises(ConfigError, match=r"replica_id=2 but there are num_replicas=2"):
        Emulator(["A10", "T4"], drift=[Drift(replica_id=2, factor=2.0)])
    with pytest.raises(ConfigError, match="time_scale"):
        Emulator(["T4"], time_scale=0.0)


def test_time_scale_from_argument_environment_or_default(monkeypatch):
    assert Emulator(["T4"]).time_scale == 1.0
    monkeypatch.setenv(TIME_SCALE_ENV_VAR, "25")
    assert Emulator(["T4"]).time_scale == 25.0
    assert Emulator(["T4"], time_scale=3.0).time_scale == 3.0
    monkeypatch.setenv(TIME_SCALE_ENV_VAR, "fast")
    with pytest.raises(ConfigError, match=r"HETERO_CS_EMULATION_TIME_SCALE='fast'"):
        Emulator(["T4"])


def test_calibrate_time_scale_puts_the_slowest_replica_on_target():
    emulator = Emulator(["A10", "T4", "T4", "P100"], workload=MLP)
    scale = emulator.calibrate_time_scale(1022, target_makespan_s=0.05)  # 256/256/255/255
    assert scale == emulator.time_scale > 1.0
    times = [emulator.step_time_s(i, b) for i, b in enumerate([256, 256, 255, 255])]
    assert max(times) == pytest.approx(0.05)
    assert times[0] < times[1]  # the A10 beats the T4: ratios survive scaling
    assert emulator.steps_done == (0, 0, 0, 0)  # a pure query


def test_calibrate_keeps_a_fixed_scale(monkeypatch):
    assert Emulator(["T4"], workload=MLP, time_scale=2.0).calibrate_time_scale(64) == 2.0
    monkeypatch.setenv(TIME_SCALE_ENV_VAR, "7")
    assert Emulator(["T4"], workload=MLP).calibrate_time_scale(64) == 7.0


def test_calibrate_needs_a_workload_and_valid_arguments():
    emulator = Emulator(["T4", "A10"])
    with pytest.raises(EmulationError, match="set_workload"):
        emulator.calibrate_time_scale(64)
    with pytest.raises(EmulationError, match="no Workload"):
        emulator.step_time_s(0, 4)
    emulator.set_workload(MLP)
    with pytest.raises(ConfigError, match="global_batch_size=0"):
        emulator.calibrate_time_scale(0)
    with pytest.raises(ConfigError, match="target_makespan_s=-1"):
        emulator.calibrate_time_scale(8, target_makespan_s=-1)


def test_delay_applies_drift_at_each_replicas_own_step_and_advances():
    drift = [Drift(replica_id=1, factor=2.0, from_step=2, until_step=4), Drift(replica_id=1, factor=3.0, from_step=3)]
    emulator = Emulator(["T4", "T4"], workload=MLP, time_scale=1.0, drift=drift)
    base_s = emulated_step_time_s(CATALOG["T4"], 32, MLP)
    delays = [emulator.delay_s(1, 32) for _ in range(5)]
    assert delays == pytest.approx([base_s, base_s, 2 * base_s, 6 * base_s, 3 * base_s])
    assert emulator.steps_done == (0, 5)
    assert emulator.delay_s(0, 32) == pytest.approx(base_s)  # replica 0 is not drifted
    assert emulator.step_time_s(1, 32, step=3) == pytest.approx(6 * base_s)
    emulator.advance_to(0)
    assert emulator.steps_done == (0, 0)
    assert emulator.delay_s(1, 0) == 0.0  # an empty slice idles, drift or not


def test_skip_step_advances_idle_replicas_as_an_empty_slice_does_and_never_fails():
    # fit's step per set advances its idle replicas' counters in one call (no step time, no memory, no fault).
    drift = [Drift(replica_id=1, factor=2.0, from_step=1, fails=True)]
    skipped, stepped = (Emulator(["T4", "T4", "P100"], workload=MLP, time_scale=1.0, drift=drift) for _ in range(2))
    for _ in range(3):
        skipped.skip_step([1, 2])
        assert stepped.delay_s(1, 0) == stepped.delay_s(2, 0) == 0.0
    assert skipped.steps_done == stepped.steps_done == (0, 3, 3)
    with pytest.raises(ConfigError, match=r"replica_id=3 must be an int in \[0, 3\)"):
        skipped.skip_step([0, 3])
    assert skipped.steps_done == (0, 3, 3)  # checked before any counter moves


def test_query_validation():
    emulator = Emulator(["T4"], workload=MLP)
    with pytest.raises(ConfigError, match=r"replica_id=1 must be an int in \[0, 1\)"):
        emulator.delay_s(1, 4)
    with pytest.raises(ConfigError, match="step=-1"):
        emulator.step_time_s(0, 4, step=-1)
    with pytest.raises(ConfigError, match="step=-2"):
        emulator.advance_to(-2)
    with pytest.raises(ConfigError, match="Workload"):
        emulator.set_workload({"flops_per_example": 1})  # type: ignore[arg-type]


def test_delay_counters_are_thread_safe():
    emulator = Emulator(["T4", "A10"], workload=MLP)
    barrier = threading.Barrier(8)

    def worker():
        barrier.wait()
        for _ in range(200):
            emulator.delay_s(0, 8)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert emulator.steps_done == (1600, 0)


def test_describe_says_times_are_emulated():
    emulator = Emulator(["A10", "T4"], workload=MLP, drift=[Drift(replica_id=1, factor=2.0, from_step=200)])
    lines = emulator.describe(global_batch_size=64)
    assert "emulated, not measured" in lines[0]
    assert len(lines) == 4
    assert "A10" in lines[2] and "gen4 x16" in lines[2] and "ms (32)" in lines[2]
    assert "x2 steps [200, end)" in lines[3]
    assert Emulator(["CPU"]).describe()[2].split()[1:5] == ["CPU", "1.3", "fp32", "host"]


def test_pure_modules_import_without_tensorflow_or_pynvml():
    """Loads hetero_cs.emulation and hetero_cs.devices with tensorflow, keras and pynvml blocked.

    A fresh interpreter, and a stand-in package object, so the test holds whatever hetero_cs/__init__ imports.
    """
    code = (
        "import sys, types\n"
        "for blocked in ('tensorflow', 'keras', 'pynvml'):\n"
        "    sys.modules[blocked] = None\n"
        "package = types.ModuleType('hetero_cs')\n"
        f"package.__path__ = [{str(REPO_ROOT / 'hetero_cs')!r}]\n"
        "sys.modules['hetero_cs'] = package\n"
        "import hetero_cs.emulation as e, hetero_cs.devices as d\n"
        "assert e.get_device_spec('t4').name == 'T4'\n"
        "assert 'numpy' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


# ------------------------------------------------------------------------------------ time-scale bounds


@pytest.mark.parametrize("raw", ["1e30", "1e4", "1000.5"])
def test_regression_a_huge_time_scale_variable_is_refused_at_construction_naming_it(monkeypatch, raw):
    # 1e30 gave a 77-line error about sleep at the first step; 1e4 ran for minutes without a word.
    monkeypatch.setenv(TIME_SCALE_ENV_VAR, raw)
    with pytest.raises(ConfigError, match=rf"HETERO_CS_EMULATION_TIME_SCALE='{re.escape(raw)}' \(value .*\) must be "
                                          r"a finite number > 0.*at most MAX_TIME_SCALE=1000") as info:
        Emulator(["T4"])
    assert "\n" not in str(info.value)


def test_time_scale_bounds_are_inclusive_and_apply_to_the_argument(monkeypatch):
    monkeypatch.setenv(TIME_SCALE_ENV_VAR, str(MAX_TIME_SCALE))
    assert Emulator(["T4"]).time_scale == MAX_TIME_SCALE
    assert Emulator(["T4"], time_scale=1e-9).time_scale == 1e-9
    with pytest.raises(ConfigError, match=r"time_scale \(value 5000\.0\).*MAX_TIME_SCALE=1000"):
        Emulator(["T4"], time_scale=5000.0)


def test_a_fixed_scale_that_stretches_the_step_beyond_the_maximum_is_refused_naming_its_source(monkeypatch):
    heavy = Workload(flops_per_example=2e9, parameter_bytes=4_000_000)
    unscaled_s = max(Emulator(["T4", "A10"], workload=heavy).step_time_s(i, 64) for i in range(2))
    allowed = MAX_EMULATED_MAKESPAN_S / unscaled_s
    assert allowed < MAX_TIME_SCALE  # this model's step stretches past 5 s below the scale's own bound
    monkeypatch.setenv(TIME_SCALE_ENV_VAR, f"{allowed * 1.5:.6g}")
    emulator = Emulator(["T4", "A10"], workload=heavy)
    with pytest.raises(ConfigError, match=r"HETERO_CS_EMULATION_TIME_SCALE='.*' \(value .*\) stretches this model's "
                                          r"emulated even-split step at global_batch_size=128 to .* s, above "
                                          r"MAX_EMULATED_MAKESPAN_S=5 s\. Use at most"):
        emulator.calibrate_time_scale(128)
    with pytest.raises(ConfigError, match=r"^time_scale \(value .*\) stretches"):
        Emulator(["T4", "A10"], workload=heavy, time_scale=allowed * 1.5).calibrate_time_scale(128)
    scale = allowed * 0.9
    assert Emulator(["T4", "A10"], workload=heavy, time_scale=scale).calibrate_time_scale(128) == scale


def test_the_target_makespan_is_bounded():
    emulator = Emulator(["T4"], workload=MLP)
    with pytest.raises(ConfigError, match=r"target_makespan_s=6\.0 must be .* at most MAX_EMULATED_MAKESPAN_S=5"):
        emulator.calibrate_time_scale(64, target_makespan_s=6.0)
    emulator.calibrate_time_scale(64, target_makespan_s=MAX_EMULATED_MAKESPAN_S)
    assert max(emulator.step_time_s(0, 64), 0) == pytest.approx(MAX_EMULATED_MAKESPAN_S)


@pytest.mark.parametrize("argv,match", [
    (["--time-scale", "1e4"], r"--time-scale: must be at most 1000, got '1e4'"),
    (["--target-step-ms", "1e4"], r"--target-step-ms: must be at most 5000, got '1e4'"),
])
def test_cli_emulation_options_are_bounded(capsys, argv, match):
    from hetero_cs.cli import main as cli_main

    with pytest.raises(SystemExit) as info:
        cli_main(["calibrate", *argv])
    assert info.value.code == 2
    assert re.search(match, capsys.readouterr().err)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [({"replica_id": 0, "fails": True, "lost": True}, "both fails=True and lost=True"),
     ({"replica_id": 0, "lost": True, "from_step": 2, "until_step": 4}, "leave until_step=None"),
     ({"replica_id": 0, "fails": 1}, r"fails=1 must be True or False"),
     ({"replica_id": 0}, "changes nothing.*fails=True")],
)
def test_drift_faults_are_validated(kwargs, pattern):
    with pytest.raises(ConfigError, match=pattern):
        Drift(**kwargs)


def test_a_failing_card_raises_a_device_error_and_each_attempt_counts_as_a_step():
    from hetero_cs.errors import EmulatedDeviceError

    emulator = Emulator(["A10", "T4"], workload=Workload(4e5, 800_000), time_scale=1.0,
                        drift=[Drift(replica_id=1, from_step=1, until_step=3, fails=True)])
    assert emulator.may_fail and not Emulator(["A10"]).may_fail
    emulator.delay_s(1, 8)  # step 0 is fine
    for step in (1, 2):
        with pytest.raises(EmulatedDeviceError, match=rf"CUDA_ERROR_ECC_UNCORRECTABLE.*replica=1 \(T4\) at its step "
                                                      rf"{step}") as info:
            emulator.delay_s(1, 8)
        assert (info.value.replica_id, info.value.device_name, info.value.step) == (1, "T4", step)
    assert emulator.delay_s(1, 8) > 0  # the fault is over at step 3
    assert emulator.delay_s(1, 0) == 0.0  # an idle replica never fails
    assert "fails steps [1, 3)" in "\n".join(emulator.describe())


def test_a_lost_card_names_itself_and_aborts_the_process():
    import subprocess
    import sys

    code = ("from hetero_cs.emulation import Drift, Emulator, Workload\n"
            "e = Emulator(['A10', 'P100'], workload=Workload(4e5, 800_000), time_scale=1.0,"
            " drift=[Drift(replica_id=1, from_step=1, lost=True)])\n"
            "e.delay_s(1, 4)\nprint('step 0 done', flush=True)\ne.delay_s(1, 4)\nprint('not reached')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == -6  # SIGABRT, as after a sticky CUDA error
    assert "step 0 done" in done.stdout and "not reached" not in done.stdout
    assert "hetero_cs emulation: lost replica=1 (P100) at its step 1: CUDA_ERROR_ECC_UNCORRECTABLE" in done.stderr


@pytest.mark.parametrize("name,generation,lanes,memory", [
    ("P100~x1", 3, 1, 16e9), ("t4@8GB~GEN2x4", 2, 4, 8e9), ("A10~x8", 4, 8, 24e9)])
def test_a_link_override_changes_the_host_link_and_keeps_the_rest(name, generation, lanes, memory):
    spec = get_device_spec(name)
    base = get_device_spec(name.partition("~")[0])
    assert (spec.pcie_generation, spec.pcie_lanes, spec.memory_bytes) == (generation, lanes, memory)
    assert spec.fp32_tflops == base.fp32_tflops and spec.name.endswith(name.partition("~")[2])
    workload = Workload(flops_per_example=1e6, parameter_bytes=100_000_000)
    # The link costs twice per step (parameters out, gradients back): the one-lane riser's fixed cost dominates.
    extra = emulated_step_time_s(spec, 1, workload) - emulated_step_time_s(base, 1, workload)
    expected = 2 * workload.parameter_bytes * (1 / spec.pcie_bandwidth_bytes_per_s - 1 / base.pcie_bandwidth_bytes_per_s)
    assert extra == pytest.approx(expected)


@pytest.mark.parametrize("name,match", [
    ("CPU~x1", "host CPU has no PCIe link"), ("P100~x0", "1-32 lanes"), ("P100~gen6x1", "generation 1-5"),
    ("P100~fast", "comes last"), ("P100~x1@8GB", "comes last"), ("P100~", "Received: ''"),
    ("P100~x\u0661", "comes last")])  # an Arabic-Indic digit one is not a lane count
def test_a_bad_link_override_is_a_clear_error(name, match):
    with pytest.raises(ConfigError, match=match):
        get_device_spec(name)


def test_a_profile_calibrated_on_another_link_is_another_device():
    from hetero_cs.devices.catalog import emulated_identity

    assert emulated_identity("p100~x1") == emulated_identity("P100~X1") != emulated_identity("P100")
    assert emulated_identity("T4@8GB") != emulated_identity("T4@8GB~x1")
    assert emulated_identity("T4@48MB") == emulated_identity("t4@48000000B")
