"""Which devices can compute in a dtype policy (pure: no TensorFlow, no NVML).

bfloat16 arithmetic (``mixed_bfloat16``) needs an NVIDIA GPU of compute capability 8.0 or newer (Ampere: A10, A30,
A100, RTX A6000, RTX 3090; Ada: L4, L40S, RTX 4090; Hopper: H100, H200), and so do TF32 tensor cores, which run the
``float32`` policy's matmuls and convolutions there by default (the catalog's ``tf32_tflops``); float16 (``mixed_float16``) runs on every CUDA GPU TensorFlow supports, on tensor cores from 7.0
(V100, T4) and as packed half precision on the P100 (6.0). Sources: NVIDIA CUDA C++ Programming Guide, "Arithmetic
Instructions" table (bf16 rows from compute capability 8.0), and the datasheets cited in
:mod:`hetero_cs.devices.catalog` (T4, P100 and V100 list no BF16). The host CPU runs every policy (TensorFlow
converts where the CPU has no native half-precision arithmetic).
"""

from collections.abc import Sequence

from hetero_cs.devices.catalog import compute_dtype_of
from hetero_cs.errors import UnsupportedPrecisionError

MIN_BF16_COMPUTE_CAPABILITY = (8, 0)
"""Lowest NVIDIA compute capability with bfloat16 arithmetic (Ampere)."""


def check_policy_support(policy: str, devices: Sequence[tuple[str, tuple[int, int] | None]]) -> None:
    """Refuses a dtype policy that a compute device cannot run.

    Args:
        policy: A Keras dtype policy name ("float32", "mixed_float16", "mixed_bfloat16") or a compute dtype.
        devices: (device name, NVIDIA compute capability (major, minor)) per compute device; the capability is None
            for anything that is not an NVIDIA GPU (CPUs), which is never refused.

    Raises:
        UnsupportedPrecisionError: bfloat16 on a GPU below compute capability 8.0 (the message names the device, its
            capability and the fix).
        ConfigError: An unknown policy name.

    Examples:
        >>> check_policy_support("mixed_float16", [("/device:GPU:0", (7, 5))])  # a T4: fine
        >>> check_policy_support("mixed_bfloat16", [("/device:GPU:0", (7, 5))])
        Traceback (most recent call last):
        ...
        hetero_cs.errors.UnsupportedPrecisionError: ...
    """
    if compute_dtype_of(policy) != "bfloat16":
        return
    for name, capability in devices:
        if capability is not None and tuple(capability) < MIN_BF16_COMPUTE_CAPABILITY:
            major, minor = capability
            raise UnsupportedPrecisionError(
                f"Device {name} (compute capability {major}.{minor}) has no bfloat16 arithmetic, which the dtype "
                f"policy {policy!r} needs (compute capability >= 8.0: A10, A100, H100). Use keras.mixed_precision."
                f"set_global_policy('mixed_float16') with these devices, or leave {name} out of compute_devices.",
                device=name, compute_dtype="bfloat16")
