"""What a model asks of an emulated device: FLOPs and transfer bytes per step, the step time, memory per slice.

``Workload`` holds the model-dependent inputs of the emulated step time (forward FLOPs per example, trainable
parameter bytes, layers, activation bytes, the dtype the layers compute in and whether float32 runs as TF32) and of
the emulated memory footprint (optimizer bytes, activation bytes per example); ``estimate_workload`` reads them off a
built Keras 3 model; ``emulated_step_time_s`` is one replica's step on a catalog device (the emulator's waits and the
what-if's predictions); ``slice_memory_bytes`` is what one replica's slice of ``b`` examples needs. This module is
pure apart from ``estimate_workload``, which imports Keras and TensorFlow inside the function.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

from hetero_cs.devices.catalog import (
    ACTIVATION_PASSES,
    DEFAULT_COMPUTE_EFFICIENCY,
    DEFAULT_LAUNCH_OVERHEAD_S,
    LAYER_OVERHEAD_S,
    DeviceSpec,
    _is_real,
    compute_dtype_of,
)
from hetero_cs.errors import ConfigError

logger = logging.getLogger("hetero_cs.devices.emulation")


def _non_negative_int(owner: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{owner}.{name}={value!r} must be an int >= 0.")


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
        if not (isinstance(self.flops_per_example, (int, float)) and math.isfinite(self.flops_per_example)
                and self.flops_per_example >= 0):
            raise ConfigError(
                f"Workload.flops_per_example={self.flops_per_example!r} must be a finite number >= 0.")
        for name in ("parameter_bytes", "optimizer_bytes", "activation_bytes_per_example", "non_trainable_bytes",
                     "layers"):
            _non_negative_int("Workload", name, getattr(self, name))
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
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 0:
        raise ConfigError(f"batch_size={batch_size!r} must be an int >= 0 (examples in the replica's slice).")
    if not (_is_real(compute_efficiency) and 0.0 < compute_efficiency <= 1.0):
        raise ConfigError(
            f"compute_efficiency={compute_efficiency!r} must be a number in (0, 1], the fraction of peak "
            f"FLOP/s sustained; the default is {DEFAULT_COMPUTE_EFFICIENCY}.")
    if not (_is_real(launch_overhead_s) and math.isfinite(launch_overhead_s) and launch_overhead_s >= 0.0):
        raise ConfigError(
            f"launch_overhead_s={launch_overhead_s!r} must be a finite number of seconds >= 0; the default is "
            f"{DEFAULT_LAUNCH_OVERHEAD_S}.")
    if batch_size == 0:
        return 0.0
    bandwidth = spec.pcie_bandwidth_bytes_per_s
    transfer_s = 0.0 if math.isinf(bandwidth) else workload.parameter_bytes / bandwidth
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
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 0:
        raise ConfigError(f"batch_size={batch_size!r} must be an int >= 0 (examples in the replica's slice).")
    if batch_size == 0:
        return 0
    fixed = (workload.fixed_memory_bytes if training
             else workload.parameter_bytes + workload.non_trainable_bytes)
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


def _dtype_size_bytes(dtype: Any) -> int:
    """Bytes per element of a Keras/numpy dtype name ('float32', 'bfloat16', ...)."""
    import numpy as np

    try:
        return int(np.dtype(dtype).itemsize)
    except TypeError:
        digits = "".join(ch for ch in str(dtype) if ch.isdigit())
        return max(1, int(digits) // 8) if digits else 4


def _output_shape(layer: Any) -> tuple | None:
    """A layer's output shape (batch dim included), or None when it cannot be known."""
    try:
        return tuple(layer.output.shape)
    except (AttributeError, ValueError):
        pass
    from hetero_cs.engine import _compat

    build_shapes = _compat.layer_build_shapes(layer)
    if build_shapes and len(build_shapes) == 1:
        try:
            return tuple(layer.compute_output_shape(next(iter(build_shapes.values()))))
        except Exception:  # noqa: BLE001 - any layer may refuse; the estimate then uses a fallback.
            return None
    return None


def _per_example_elements(shape: tuple | None) -> int | None:
    """prod(shape[1:]) for a known shape with a batch dimension, else None."""
    if not shape or any(d is None for d in shape[1:]):
        return None
    return math.prod(int(d) for d in shape[1:])


def _positions(layer: Any, channels: int) -> int:
    """Output positions per example: prod(output dims but batch) / channels; 1 when the shape is unknown."""
    elements = _per_example_elements(_output_shape(layer))
    if elements is None:
        logger.debug("estimate_workload: output shape of %s unknown; counting one output row.", layer.name)
        return 1
    return max(1, elements // max(1, channels))


def _bytes(variables: Any) -> int:
    seen: set[int] = set()
    total = 0
    for variable in variables:
        if id(variable) in seen:
            continue
        seen.add(id(variable))
        total += math.prod(int(d) for d in variable.shape) * _dtype_size_bytes(variable.dtype)
    return int(total)


def _leaves(model: Any, layers: list) -> list:
    """The layers that run kernels: not containers (their leaves are counted) nor input layers."""
    return [layer for layer in layers if not (layer is model or getattr(layer, "layers", None)
                                              or type(layer).__name__ == "InputLayer")]


def _activation_bytes_per_example(model: Any, leaves: list) -> int:
    """Every leaf layer's output (and the model's inputs), bytes per example, from the built shapes."""
    total = 0
    try:
        inputs = list(getattr(model, "inputs", None) or ())
    except (AttributeError, ValueError, TypeError):  # a subclassed model has no symbolic inputs
        inputs = []
    for tensor in inputs:
        elements = _per_example_elements(tuple(tensor.shape))
        total += (elements or 0) * _dtype_size_bytes(getattr(tensor, "dtype", "float32"))
    for layer in leaves:
        elements = _per_example_elements(_output_shape(layer))
        if elements is None:
            continue
        dtype = getattr(layer, "compute_dtype", None) or "float32"
        total += elements * _dtype_size_bytes(dtype)
    return int(total)


def estimate_workload(model: Any) -> Workload:
    """Estimates a built Keras 3 model's FLOPs per example, and its memory footprint, for emulated devices.

    FLOPs (nested models and sublayers included): ``Dense`` costs 2 * in * out per output row;
    ``Conv1D``/``Conv2D``/``Conv3D`` cost 2 * kernel.size per output position (kernel.size = k... * cin/groups *
    cout). Every other layer counts ~0 (activations, normalisation, pooling are small beside these).

    Memory: ``parameter_bytes`` and ``non_trainable_bytes`` are the sizes of the model's weights;
    ``optimizer_bytes`` the sizes of the compiled optimizer's variables once it is built (0 before);
    ``activation_bytes_per_example`` adds up, per example, the output of every leaf layer and the model's inputs,
    with the shapes the layers were built with on the real batch and their compute dtype - what the forward pass
    keeps for the backward pass. It is counted from the real model's shapes, not read from an allocator (CPU
    devices report no memory to TensorFlow); on a GPU the calibration's search measures the real cap instead.
    ``layers`` counts the leaf layers; ``tensor_float_32`` is TensorFlow's setting now
    (``tf.config.experimental.tensor_float_32_execution_enabled()``).

    Args:
        model: A built ``keras.Model`` or ``keras.layers.Layer``.

    Returns:
        The Workload; ``compute_dtype`` is the model's dtype policy's ("float16" under mixed_float16; the weights,
        float32 variables under a mixed policy, are counted at their own dtype).

    Raises:
        ConfigError: If the model has not been built (it has no weights yet).

    Examples:
        Dense(784 -> 256) + Dense(256 -> 10): flops_per_example = 2*784*256 + 2*256*10 = 406,528;
        activation_bytes_per_example = 4 * (784 + 256 + 10) = 4,200.
    """
    import keras
    import tensorflow as tf

    if not getattr(model, "built", False):
        raise ConfigError(
            f"estimate_workload: model={getattr(model, 'name', model)!r} is not built. Build it first, e.g. "
            f"model.build(input_shape) or call it on one batch.")
    from hetero_cs.engine import _compat

    layers = _compat.all_sublayers(model)
    leaves = _leaves(model, layers)
    convs = tuple(c for c in (getattr(keras.layers, n, None) for n in ("Conv1D", "Conv2D", "Conv3D")) if c)
    flops = 0.0
    for layer in layers:
        if isinstance(layer, keras.layers.Dense):
            fan_in, units = (int(d) for d in layer.kernel.shape)
            flops += 2.0 * fan_in * units * _positions(layer, units)
        elif convs and isinstance(layer, convs):
            flops += 2.0 * math.prod(int(d) for d in layer.kernel.shape) * _positions(layer, int(layer.filters))
    policy = getattr(getattr(model, "dtype_policy", None), "compute_dtype", None) or "float32"
    optimizer = getattr(model, "optimizer", None)
    optimizer_variables = list(getattr(optimizer, "variables", ()) or ()) if getattr(optimizer, "built", False) else []
    return Workload(
        flops_per_example=flops,
        parameter_bytes=_bytes(model.trainable_weights),
        optimizer_bytes=_bytes(optimizer_variables),
        activation_bytes_per_example=_activation_bytes_per_example(model, leaves),
        non_trainable_bytes=_bytes(model.non_trainable_weights),
        compute_dtype=policy if policy in ("float16", "bfloat16") else "float32",
        layers=len(leaves),
        tensor_float_32=bool(tf.config.experimental.tensor_float_32_execution_enabled()),
    )
