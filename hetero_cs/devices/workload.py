"""What one training step of a model costs, for the emulator: forward FLOPs per example, parameter bytes, and the
dtype the layers compute in (pure: ``estimate_workload`` imports Keras inside the function).

:mod:`hetero_cs.devices.emulation` turns a ``Workload`` into a device's step time with the catalog's figures.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

from hetero_cs.devices.catalog import compute_dtype_of
from hetero_cs.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Workload:
    """The model-dependent inputs of the emulated step time.

    Attributes:
        flops_per_example: Forward-pass FLOPs for one example (a multiply-add counts 2); finite, >= 0.
        parameter_bytes: Bytes of the trainable weights (what is broadcast, and returned as gradients); >= 0.
        compute_dtype: What the layers compute in: "float32", "float16" (mixed_float16) or "bfloat16"
            (mixed_bfloat16); a policy name is accepted and stored as its compute dtype. Selects the peak figure.
    """

    flops_per_example: float
    parameter_bytes: int
    compute_dtype: str = "float32"

    def __post_init__(self) -> None:
        if not (isinstance(self.flops_per_example, (int, float)) and math.isfinite(self.flops_per_example)
                and self.flops_per_example >= 0):
            raise ConfigError(
                f"Workload.flops_per_example={self.flops_per_example!r} must be a finite number >= 0.")
        if isinstance(self.parameter_bytes, bool) or not isinstance(self.parameter_bytes, int) \
                or self.parameter_bytes < 0:
            raise ConfigError(f"Workload.parameter_bytes={self.parameter_bytes!r} must be an int >= 0.")
        object.__setattr__(self, "compute_dtype", compute_dtype_of(self.compute_dtype))


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


def _positions(layer: Any, channels: int) -> int:
    """Output positions per example: prod(output dims but batch) / channels; 1 when the shape is unknown."""
    shape = _output_shape(layer)
    if not shape or any(d is None for d in shape[1:]):
        logger.debug("estimate_workload: output shape of %s unknown; counting one output row.", layer.name)
        return 1
    return max(1, math.prod(int(d) for d in shape[1:]) // max(1, channels))


def estimate_workload(model: Any) -> Workload:
    """Estimates forward FLOPs per example and trainable parameter bytes of a built Keras 3 model.

    Counted layers (nested models and sublayers included): ``Dense`` costs 2 * in * out per output row;
    ``Conv1D``/``Conv2D``/``Conv3D`` cost 2 * kernel.size per output position (kernel.size = k... * cin/groups *
    cout). Every other layer counts ~0 (activations, normalisation, pooling are small beside these).

    Args:
        model: A built ``keras.Model`` or ``keras.layers.Layer``.

    Returns:
        Workload(flops_per_example, parameter_bytes, compute_dtype), parameter_bytes summing size * dtype size over
        the distinct trainable weights (float32 variables under a mixed policy), compute_dtype the model's policy's.

    Raises:
        ConfigError: If the model has not been built (it has no weights yet).

    Example:
        Dense(784 -> 256) + Dense(256 -> 10): flops_per_example = 2*784*256 + 2*256*10 = 406,528.
    """
    import keras

    if not getattr(model, "built", False):
        raise ConfigError(
            f"estimate_workload: model={getattr(model, 'name', model)!r} is not built. Build it first, e.g. "
            f"model.build(input_shape) or call it on one batch.")
    from hetero_cs.engine import _compat

    layers = _compat.all_sublayers(model)
    convs = tuple(c for c in (getattr(keras.layers, n, None) for n in ("Conv1D", "Conv2D", "Conv3D")) if c)
    flops = 0.0
    for layer in layers:
        if isinstance(layer, keras.layers.Dense):
            fan_in, units = (int(d) for d in layer.kernel.shape)
            flops += 2.0 * fan_in * units * _positions(layer, units)
        elif convs and isinstance(layer, convs):
            flops += 2.0 * math.prod(int(d) for d in layer.kernel.shape) * _positions(layer, int(layer.filters))
    seen: set[int] = set()
    parameter_bytes = 0
    for weight in model.trainable_weights:
        if id(weight) in seen:
            continue
        seen.add(id(weight))
        parameter_bytes += math.prod(int(d) for d in weight.shape) * _dtype_size_bytes(weight.dtype)
    policy = getattr(getattr(model, "dtype_policy", None), "compute_dtype", None) or "float32"
    return Workload(flops_per_example=flops, parameter_bytes=int(parameter_bytes),
                    compute_dtype=policy if policy in ("float16", "bfloat16") else "float32")
