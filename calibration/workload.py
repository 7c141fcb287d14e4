"""A built Keras model's workload for emulated devices and the what-if: FLOPs, weights and activations.

:func:`estimate_workload` counts what :class:`hetero_cs.devices.workload.Workload` holds from the model itself (its
layers' shapes and weights), for the emulator's waits and memory and for ``hetero-cs calibrate --what-if``.
"""

import contextlib
import logging
import math
from typing import Any

from hetero_cs.devices.workload import Workload
from hetero_cs.engine._compat.layers import all_sublayers, layer_build_shapes
from hetero_cs.errors import ConfigError

logger = logging.getLogger("hetero_cs.devices.emulation")


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
    with contextlib.suppress(AttributeError, ValueError):
        return tuple(layer.output.shape)
    build_shapes = layer_build_shapes(layer)
    if build_shapes and len(build_shapes) == 1:
        with contextlib.suppress(Exception):  # any layer may refuse; the estimate then uses a fallback.
            return tuple(layer.compute_output_shape(next(iter(build_shapes.values()))))
    return None


def _per_example_elements(shape: tuple | None) -> int | None:
    """prod(shape[1:]) for a known shape with a batch dimension, else None."""
    return None if not shape or any(d is None for d in shape[1:]) else math.prod(int(d) for d in shape[1:])


def _positions(layer: Any, channels: int) -> int:
    """Output positions per example: prod(output dims but batch) / channels; 1 when the shape is unknown."""
    elements = _per_example_elements(_output_shape(layer))
    if elements is None:
        logger.debug("estimate_workload: output shape of %s unknown; counting one output row.", layer.name)
        return 1
    return max(1, elements // max(1, channels))


def _bytes(variables: Any) -> int:
    """The size of the variables, each counted once (a shared variable may be listed twice), in bytes."""
    unique = {id(variable): variable for variable in variables}.values()
    return int(sum(math.prod(int(d) for d in v.shape) * _dtype_size_bytes(v.dtype) for v in unique))


def _activation_bytes_per_example(model: Any, leaves: list) -> int:
    """Every leaf layer's output (and the model's inputs), bytes per example, from the built shapes."""
    def per_example_bytes(shape: tuple | None, dtype: Any) -> int:  # 0 where the shape is unknown
        return (_per_example_elements(shape) or 0) * _dtype_size_bytes(dtype)

    try:
        inputs = list(getattr(model, "inputs", None) or ())
    except (AttributeError, ValueError, TypeError):  # a subclassed model has no symbolic inputs
        inputs = []
    return int(sum(per_example_bytes(tuple(t.shape), getattr(t, "dtype", "float32")) for t in inputs)
               + sum(per_example_bytes(_output_shape(layer), getattr(layer, "compute_dtype", None) or "float32")
                     for layer in leaves))


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
        raise ConfigError(f"estimate_workload: model={getattr(model, 'name', model)!r} is not built. Build it first, "
                          f"e.g. model.build(input_shape) or call it on one batch.")
    layers = all_sublayers(model)
    # The layers that run kernels: not containers (their leaves are counted) nor input layers.
    leaves = [layer for layer in layers if not (layer is model or getattr(layer, "layers", None)
                                                or type(layer).__name__ == "InputLayer")]
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
    return Workload(flops_per_example=flops, parameter_bytes=_bytes(model.trainable_weights),
                    optimizer_bytes=_bytes(optimizer_variables),
                    activation_bytes_per_example=_activation_bytes_per_example(model, leaves),
                    non_trainable_bytes=_bytes(model.non_trainable_weights),
                    compute_dtype=policy if policy in ("float16", "bfloat16") else "float32", layers=len(leaves),
                    tensor_float_32=bool(tf.config.experimental.tensor_float_32_execution_enabled()))
