"""Precision in the pure layer: the catalog's fp16/bf16 figures, the workload's compute dtype, the emulated step time
and the solved plan under each policy, the refusal of bf16 where a device has none, and the profile cache key."""

from __future__ import annotations

import dataclasses

import pytest

from calibration.store import profile_key
from hetero_cs import UnsupportedPrecisionError
from hetero_cs.emulation import CATALOG, Emulator, Workload, emulated_step_time_s, get_device_spec
from hetero_cs.errors import ConfigError, HeteroCSError
from hetero_cs.planning.solver import solve_batch_split

# The benchmarks' CNN-sized step: 20 MFLOP per example, 1 MB of float32 parameters.
FLOPS, PARAMETER_BYTES = 20e6, 1_000_000


def workload(policy: str) -> Workload:
    return Workload(flops_per_example=FLOPS, parameter_bytes=PARAMETER_BYTES, compute_dtype=policy)


class EmulatedProfile:
    """The emulated step time of one replica as a cost model (time_scale 1)."""

    def __init__(self, emulator: Emulator, replica_id: int):
        self.emulator, self.replica_id = emulator, replica_id

    def predict_step_time_s(self, batch_size: int) -> float:
        return self.emulator.step_time_s(self.replica_id, batch_size)


def solved_split(names, policy: str, global_batch_size: int = 4096) -> tuple[int, ...]:
    emulator = Emulator(names, workload=workload(policy), time_scale=1.0)
    models = [EmulatedProfile(emulator, i) for i in range(len(names))]
    return solve_batch_split(models, global_batch_size).per_replica_batch_sizes


@pytest.mark.parametrize("name, fp16, bf16", [
    ("A10", 125.0, 125.0), ("T4", 65.0, None), ("P100", 18.7, None), ("V100", 112.0, None),
    ("A100", 312.0, 312.0), ("H100", 756.0, 756.0), ("CPU", 1.28, 1.28)])
def test_published_half_precision_figures(name, fp16, bf16):
    spec = get_device_spec(name)
    assert spec.fp16_tflops == fp16 and spec.bf16_tflops == bf16
    assert spec.peak_tflops("float32", tf32=False) == spec.fp32_tflops
    assert spec.peak_tflops("mixed_float16") == spec.peak_tflops("float16") == fp16
    if bf16 is None:
        assert "BF16" in spec.source  # the source says why there is none
    else:
        assert spec.peak_tflops("mixed_bfloat16") == bf16


@pytest.mark.parametrize("name", ["T4", "P100", "V100"])
def test_bf16_is_refused_on_devices_without_it(name):
    with pytest.raises(UnsupportedPrecisionError, match=f"{name} has no bfloat16 .*mixed_float16") as info:
        get_device_spec(name).peak_tflops("bfloat16")
    assert isinstance(info.value, (HeteroCSError, ValueError))
    assert info.value.device == name and info.value.compute_dtype == "bfloat16"
    with pytest.raises(UnsupportedPrecisionError, match=name):
        Emulator(["A10", name], workload=workload("mixed_bfloat16"))
    emulator = Emulator(["A10", name], workload=workload("float32"))
    with pytest.raises(UnsupportedPrecisionError, match=name):
        emulator.set_workload(workload("bfloat16"))
    assert emulator.workload.compute_dtype == "float32"  # the refused workload was not set


def test_unknown_precision_is_a_config_error():
    with pytest.raises(ConfigError, match="float64"):
        workload("float64")
    with pytest.raises(ConfigError, match="'int8'"):
        get_device_spec("A10").peak_tflops("int8")


def test_workload_stores_the_compute_dtype_of_a_policy_name():
    assert workload("mixed_float16").compute_dtype == "float16"
    assert workload("mixed_bfloat16").compute_dtype == "bfloat16"
    assert Workload(FLOPS, PARAMETER_BYTES).compute_dtype == "float32"


def test_half_precision_compute_uses_the_half_precision_figure():
    for name in CATALOG:
        spec = get_device_spec(name)
        fixed = emulated_step_time_s(spec, 0, workload("float32"))  # 0 examples: idles, 0 s
        assert fixed == 0.0
        # The compute term alone: the difference between two batch sizes.
        fp32, fp16 = (emulated_step_time_s(spec, 200, workload(d)) - emulated_step_time_s(spec, 100, workload(d))
                      for d in ("float32", "float16"))
        assert fp32 / fp16 == pytest.approx(spec.fp16_tflops / spec.peak_tflops("float32"), rel=1e-9)


def test_the_devices_order_changes_with_precision():
    # fp32: the P100 (9.3 TFLOPS) is faster than the T4 (8.1); fp16: the T4 (65) overtakes the P100 (18.7).
    a10, t4, p100 = solved_split(["A10", "T4", "P100"], "float32")
    assert p100 > t4
    a10_h, t4_h, p100_h = solved_split(["A10", "T4", "P100"], "mixed_float16")
    assert t4_h > p100_h
    # The A10 : T4 ratio (62.5 / 8.1 = 7.7 in float32, the A10 running it as TF32; 125 / 65 = 1.9 in fp16) drops.
    assert a10 / t4 > 1.6 * (a10_h / t4_h)


def test_the_profile_cache_key_includes_the_dtype_policy():
    keys = {profile_key(device_ids=["/device:CPU:1"], model_fingerprint="m", input_signature="s",
                        tf_version="2.21.0", dtype_policy=policy)
            for policy in ("float32", "mixed_float16", "mixed_bfloat16")}
    assert len(keys) == 3
    with pytest.raises(ConfigError, match="dtype_policy"):
        profile_key(device_ids=["/device:CPU:1"], model_fingerprint="m", input_signature="s", tf_version="2.21.0",
                    dtype_policy=None)


def test_real_gpus_below_compute_capability_8_are_refused_bf16_only():
    from hetero_cs.devices.precision import check_policy_support

    t4, a10, cpu = ("/device:GPU:0", (7, 5)), ("/device:GPU:1", (8, 6)), ("/device:CPU:1", None)
    for policy in ("float32", "mixed_float16"):
        check_policy_support(policy, [t4, a10, cpu])
    check_policy_support("mixed_bfloat16", [a10, cpu])
    with pytest.raises(UnsupportedPrecisionError, match=r"GPU:0 \(compute capability 7.5\).*mixed_float16") as info:
        check_policy_support("mixed_bfloat16", [a10, t4])
    assert info.value.device == "/device:GPU:0"


def test_the_emulator_table_shows_the_figure_of_the_workloads_precision():
    lines = Emulator(["A10", "T4"], workload=workload("mixed_float16")).describe(global_batch_size=64)
    assert "peak TF" in lines[1]
    assert lines[2].split()[1:4] == ["A10", "125.0", "fp16"] and lines[3].split()[1:4] == ["T4", "65.0", "fp16"]
    assert Emulator(["T4"]).describe()[2].split()[1:4] == ["T4", "8.1", "fp32"]
    # float32: the A10 at its TF32 rate (TensorFlow's default), at its fp32 rate with TF32 off.
    assert Emulator(["A10"]).describe()[2].split()[1:4] == ["A10", "62.5", "tf32"]
    off = dataclasses.replace(workload("float32"), tensor_float_32=False)
    assert Emulator(["A10"], workload=off).describe()[2].split()[1:4] == ["A10", "31.2", "fp32"]
