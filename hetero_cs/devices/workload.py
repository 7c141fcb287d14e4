"""What a model asks of an emulated device: FLOPs and transfer bytes per step, the step time, memory per slice.

``Workload`` holds the model-dependent inputs of the emulated step time (forward FLOPs per example, trainable
parameter bytes, layers, activation bytes, the dtype the layers compute in and whether float32 runs as TF32) and of
the emulated memory footprint (optimizer bytes, activation bytes per example);
:func:`calibration.workload.estimate_workload` reads them off a built Keras 3 model; ``emulated_step_time_s`` is one replica's step on a catalog device (the emulator's waits and the
what-if's predictions); ``slice_memory_bytes`` is what one replica's slice of ``b`` examples needs. This module is
pure: it imports neither TensorFlow nor Keras.
"""

import dataclasses
import math
from typing import Any

from hetero_cs.devices.catalog import (
    ACTIVATION_PASSES, DEFAULT_COMPUTE_EFFICIENCY, DEFAULT_LAUNCH_OVERHEAD_S, LAYER_OVERHEAD_S, DeviceSpec, _is_real,
    compute_dtype_of)
from hetero_cs.errors import ConfigError

def _check_non_negative_int(name: str, value: Any, what: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name}={value!r} must be an int >= 0{what}.")


@dataclasses.dataclass(frozen=True)
class Workload:
    """The model-dependent inputs of the emulated step time and memory footprint.

    Attributes:
        flops_per_example: Forward-pass FLOPs for one example (a multiply-add counts 2); finite, >= 0.
        parameter_bytes: Bytes of the trainable weights (what is broadcast, and returned as gradients); >= 0.
        optimizer_bytes: Bytes of the optimizer's variables (Adam: two slots per weight); >= 0. Default 0.
        activation_bytes_per_example: Bytes the forward pass keeps per example for the backward pass (every
            layer's output, and the input); >= 0. Default 0 (then memory grows with nothing but the weights).
        non_trainable_bytes: Bytes of the model's non-trainable weights (e.g. BatchNormalization statistics),
            which a replica also holds; >= 0. Default 0.
        compute_dtype: What the layers compute in: "float32", "float16" (mixed_float16) or "bfloat16"
            (mixed_bfloat16); a policy name is accepted and stored as its compute dtype. Selects the peak figure.
        layers: Layers that run kernels each step (leaf layers), >= 0; each costs LAYER_OVERHEAD_S a step whatever
            the slice. Default 0 (only the per-step launch overhead).
        tensor_float_32: Whether float32 matmuls and convolutions run on TF32 tensor cores where a card has them
            (TensorFlow's default on Ampere and newer: ``tf.config.experimental.tensor_float_32_execution_enabled()``).
            Default True.
    """

    flops_per_example: float
    parameter_bytes: int
    optimizer_bytes: int = 0
    activation_bytes_per_example: int = 0
    non_trainable_bytes: int = 0
    compute_dtype: str = "float32"
    layers: int = 0
    tensor_float_32: bool = True

    def __post_init__(self) -> None:
        flops = self.flops_per_example
        if not (_is_real(flops) and math.isfinite(flops) and flops >= 0):
            raise ConfigError(f"Workload.flops_per_example={self.flops_per_example!r} must be a finite number >= 0.")
        for name in ("parameter_bytes", "optimizer_bytes", "activation_bytes_per_example", "non_trainable_bytes",
                     "layers"):
            _check_non_negative_int(f"Workload.{name}", getattr(self, name))
        object.__setattr__(self, "compute_dtype", compute_dtype_of(self.compute_dtype))
        if not isinstance(self.tensor_float_32, bool):
            raise ConfigError(f"Workload.tensor_float_32={self.tensor_float_32!r} must be True or False.")

    @property
    def fixed_memory_bytes(self) -> int:
        """Memory a replica needs whatever its slice: weights + gradients + optimizer variables, bytes.

        Central storage keeps the optimizer's variables on the host; they are counted here anyway, so an emulated
        cap errs on the safe side (a real device also needs scratch space for the update's temporaries).
        """
        return 2 * self.parameter_bytes + self.non_trainable_bytes + self.optimizer_bytes


def emulated_step_time_s(spec: DeviceSpec, batch_size: int, workload: Workload, *,
                         compute_efficiency: float = DEFAULT_COMPUTE_EFFICIENCY,
                         launch_overhead_s: float = DEFAULT_LAUNCH_OVERHEAD_S) -> float:
    """Time one replica on ``spec`` would take for one training step on ``batch_size`` examples.

    t = launch_overhead_s + layers * LAYER_OVERHEAD_S                (fixed per-step cost)
      + parameter_bytes / pcie_bandwidth                             (broadcast of the central variables)
      + 3 * flops_per_example * b / (peak_tflops * 1e12 * compute_efficiency)
                                                                     (forward + backward ~ 3x forward)
      + ACTIVATION_PASSES * activation_bytes_per_example * b / memory_bandwidth
                                                                     (the layers' memory traffic)
      + parameter_bytes / pcie_bandwidth                             (gradient return to the host)

    peak_tflops is the rate TensorFlow runs the workload's compute dtype at on this card (``spec.peak_tflops``):
    fp16 or bf16 tensor cores under a mixed policy; for float32, TF32 tensor cores where the card has them and
    ``workload.tensor_float_32`` (TensorFlow's default), else its fp32 CUDA cores. The memory term is why tensor
    cores speed a step up far less than their peak (ACTIVATION_PASSES). The host CPU entry has no PCIe link
    (variables live in its memory), so both transfers cost 0. A replica with 0 examples idles: it costs 0 s.

    Args:
        spec: The emulated device.
        batch_size: Examples in the replica's slice, b >= 0.
        workload: The model's figures (FLOPs per example, parameter and activation bytes, layers, dtype).
        compute_efficiency: Fraction of the peak FLOP/s the step's matmuls and convolutions sustain, in (0, 1].
        launch_overhead_s: Fixed per-step cost in seconds, >= 0.

    Returns:
        Emulated seconds, >= 0.

    Raises:
        ConfigError: If an argument is out of range.
        UnsupportedPrecisionError: If ``spec`` has no arithmetic in the workload's compute dtype (bf16 on a T4).

    Examples:
        T4, batch 256, MLP of 406,528 FLOPs and 814,120 parameter bytes (no layers or activations given):
        0.5 ms + 2 x 0.052 ms (PCIe gen3 x16) + 3 x 406,528 x 256 / (8.1e12 x 0.5) = 0.077 ms, in all ~0.68 ms.
    """
    _check_non_negative_int("batch_size", batch_size, " (examples in the replica's slice)")
    if not (_is_real(compute_efficiency) and 0.0 < compute_efficiency <= 1.0):
        raise ConfigError(f"compute_efficiency={compute_efficiency!r} must be a number in (0, 1], the fraction of peak "
                          f"FLOP/s sustained; the default is {DEFAULT_COMPUTE_EFFICIENCY}.")
    if not (_is_real(launch_overhead_s) and math.isfinite(launch_overhead_s) and launch_overhead_s >= 0.0):
        raise ConfigError(f"launch_overhead_s={launch_overhead_s!r} must be a finite number of seconds >= 0; the "
                          f"default is {DEFAULT_LAUNCH_OVERHEAD_S}.")
    if batch_size == 0:
        return 0.0
    transfer_s = workload.parameter_bytes / spec.pcie_bandwidth_bytes_per_s  # the host CPU's is inf: 0 s
    peak_tflops = spec.peak_tflops(workload.compute_dtype, tf32=workload.tensor_float_32)
    per_example_s = (3.0 * workload.flops_per_example / (peak_tflops * 1e12 * compute_efficiency)
                     + ACTIVATION_PASSES * workload.activation_bytes_per_example / spec.memory_bandwidth_bytes_per_s)
    fixed_s = launch_overhead_s + workload.layers * LAYER_OVERHEAD_S
    return fixed_s + 2.0 * transfer_s + per_example_s * batch_size


def slice_memory_bytes(workload: Workload, batch_size: int, *, training: bool = True) -> int:
    """Device memory one replica's step on ``batch_size`` examples needs, bytes.

    A training step needs ``fixed_memory_bytes + activation_bytes_per_example * batch_size``. An inference step
    (``training=False``: evaluate, predict) holds no gradients and no optimizer variables:
    ``parameter_bytes + non_trainable_bytes + activation_bytes_per_example * batch_size``, which still counts every
    layer's output as kept (a real forward pass frees them as it goes), so it errs on the safe side. A replica with
    0 examples idles and needs 0.

    Raises:
        ConfigError: If ``batch_size`` is not an int >= 0.

    Examples:
        >>> slice_memory_bytes(Workload(0.0, 1000, optimizer_bytes=2000, activation_bytes_per_example=50), 10)
        4500
    """
    _check_non_negative_int("batch_size", batch_size, " (examples in the replica's slice)")
    if batch_size == 0:
        return 0
    fixed = workload.fixed_memory_bytes if training else workload.parameter_bytes + workload.non_trainable_bytes
    return fixed + workload.activation_bytes_per_example * batch_size


def max_examples_in_memory(workload: Workload, memory_bytes: int) -> int | None:
    """The largest slice that fits in ``memory_bytes`` (0 when not even the weights fit); None if unbounded.

    Examples:
        >>> max_examples_in_memory(Workload(0.0, 1000, activation_bytes_per_example=50), 4500)
        50
    """
    if memory_bytes < workload.fixed_memory_bytes + workload.activation_bytes_per_example:
        return 0
    if workload.activation_bytes_per_example == 0:
        return None
    return (memory_bytes - workload.fixed_memory_bytes) // workload.activation_bytes_per_example

