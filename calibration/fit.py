"""Fits a step-time cost model t(b) to measured (batch size, step time) points (pure: numpy and scipy only).

Method:
    1. Points are sorted by batch size; repeated sizes are merged into their mean, weighted by count.
    2. The times are made non-decreasing in batch size by weighted isotonic regression
       (``scipy.optimize.isotonic_regression``, pool-adjacent-violators): a larger slice can never take less time,
       and a measured dip is noise.
    3. A linear model t(b) = a + c*b with a >= 0 and c >= 0 is fitted by non-negative least squares on relative
       residuals (each row divided by its time), so the 1-example probe counts as much as the 256-example one.
    4. A monotone piecewise-linear model is fitted through the monotone points (one knot per probed size).
    5. The linear model is chosen when its largest relative error at the monotone points is <= linear_tolerance
       (default 5 %): it extrapolates smoothly and is immune to one noisy probe. Otherwise the piecewise model is
       chosen: real GPUs are not linear at small batches (kernels under-fill the device until the batch is large
       enough), and the knots follow that curve exactly.

A real curve need not be monotone: an H200 in TF32 took 21.5 ms for a ResNet-50 step on 1 example and 15.6 ms on 16
(the library picks other kernels at other sizes). Step 2 then pools the dip with the slower sizes around it, and
the model misses the curve there by 20-30 %. With ``anchor_batch_size`` (the slice the plan gives the device, probed)
the isotonic fit is held to the time measured there, so the model is right where the device will operate and the
sizes that violate monotonicity around it bend to it instead (calibration probes the plan's slices and refits so).

``fit_error`` is the largest relative error of the chosen model at the raw (not monotone) measured points, and
``loo_error`` the largest relative error predicting each interior probed point from a fit to the other points
(leave-one-out; an estimate of the error at unprobed batch sizes inside the probed range).
"""

import dataclasses
import math
from collections.abc import Sequence
from typing import Literal

import numpy as np
from scipy import optimize

from hetero_cs.planning.cost_model import CostModel, LinearCostModel, PiecewiseLinearCostModel
from hetero_cs.errors import ConfigError

__all__ = ["FitResult", "fit_cost_model"]

FitKind = Literal["linear", "piecewise"]

# Relative errors are taken against max(t, this), so a 0-second measurement cannot divide by zero.
_MIN_TIME_S = 1e-12


@dataclasses.dataclass(frozen=True)
class FitResult:
    """A fitted step-time model and how well it explains the measurements.

    Attributes:
        cost_model: The chosen model, non-decreasing in batch size.
        fit_error: Largest relative error |t_model(b) - t(b)| / t(b) over the measured points, >= 0.
        kind: "linear" (LinearCostModel) or "piecewise" (PiecewiseLinearCostModel).
        loo_error: Largest leave-one-out relative error over interior probed points, >= 0; None with fewer than
            three distinct batch sizes.
    """

    cost_model: CostModel
    fit_error: float
    kind: FitKind
    loo_error: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("linear", "piecewise"):
            raise ConfigError(f"FitResult.kind must be 'linear' or 'piecewise'. Received: kind={self.kind!r}.")
        for name, value in (("fit_error", self.fit_error), ("loo_error", self.loo_error)):
            if (value is not None or name == "fit_error") and not (
                    isinstance(value, (int, float)) and math.isfinite(value) and value >= 0.0):
                raise ConfigError(f"FitResult.{name} must be finite and >= 0. Received: {name}={value!r}.")


def fit_cost_model(batch_sizes: Sequence[int], step_times_s: Sequence[float], *, linear_tolerance: float = 0.05,
                   anchor_batch_size: int | None = None) -> FitResult:
    """Fits a non-decreasing step-time model to measured points.

    Args:
        batch_sizes: Probed batch sizes, shape [N], N >= 1, each an integer >= 1 (repeats allowed).
        step_times_s: Measured step time at each size (typically a median over trials), seconds, shape [N],
            finite and >= 0.
        linear_tolerance: Largest relative error at the (monotone) points for which the linear model is preferred,
            in [0, 1). 0 always picks the piecewise model unless the points are exactly linear.
        anchor_batch_size: A probed size the monotone fit must pass through (the plan's slice of this device);
            None for none. A size that was not probed is ignored.

    Returns:
        A FitResult. With one distinct batch size b0 (time t0) the model is proportional, t(b) = (t0 / b0) * b:
        one point cannot separate overhead from slope, and proportional scaling is the neutral guess for splitting.

    Raises:
        ConfigError: If the inputs have different lengths, are empty, or hold invalid values.

    Examples:
        >>> result = fit_cost_model([1, 4, 16, 64], [0.0102, 0.0108, 0.0132, 0.0228])
        >>> result.kind, round(result.cost_model.predict_step_time_s(32), 4)
        ('linear', 0.0164)
    """
    # The inputs checked, then the raw points as arrays and the distinct sorted sizes with their mean times and counts.
    raw_sizes = np.asarray(batch_sizes).reshape(-1)
    raw_times = np.asarray(step_times_s, dtype=np.float64).reshape(-1)
    if raw_sizes.size == 0 or raw_sizes.size != raw_times.size:
        raise ConfigError("fit_cost_model needs as many step times as batch sizes, at least one. Received: "
                          f"len(batch_sizes)={raw_sizes.size}, len(step_times_s)={raw_times.size}.")
    if not np.issubdtype(raw_sizes.dtype, np.integer) or np.any(raw_sizes < 1):
        raise ConfigError(f"Batch sizes must be integers >= 1. Received: batch_sizes={raw_sizes.tolist()!r}.")
    if not np.all(np.isfinite(raw_times)) or np.any(raw_times < 0.0):
        raise ConfigError(f"Step times must be finite and >= 0 seconds. Received: step_times_s={raw_times.tolist()!r}.")
    if not (math.isfinite(linear_tolerance) and 0.0 <= linear_tolerance < 1.0):
        raise ConfigError(f"linear_tolerance must be in [0, 1). Received: linear_tolerance={linear_tolerance!r}.")
    raw_sizes = raw_sizes.astype(np.int64)
    sizes, inverse, counts = np.unique(raw_sizes, return_inverse=True, return_counts=True)
    times = np.bincount(inverse, weights=raw_times) / counts
    weights = counts.astype(np.float64)
    weights[sizes == anchor_batch_size] = counts.sum() * 1e6  # the others bend to it (module docstring)
    monotone = np.asarray(optimize.isotonic_regression(times, weights=weights, increasing=True).x, dtype=np.float64)

    if sizes.size == 1:
        model: CostModel = LinearCostModel(fixed_overhead_s=0.0, seconds_per_example=float(monotone[0] / sizes[0]))
        return FitResult(model, _max_relative_error(model, raw_sizes, raw_times), "linear", None)

    linear = _fit_linear(sizes, monotone, counts)
    kind: FitKind = "linear" if _max_relative_error(linear, sizes, monotone) <= linear_tolerance else "piecewise"
    model = linear if kind == "linear" else _fit_piecewise(sizes, monotone)
    return FitResult(model, _max_relative_error(model, raw_sizes, raw_times), kind,
                     _leave_one_out_error(kind, sizes, monotone, counts))


def _fit_linear(sizes: np.ndarray, times: np.ndarray, counts: np.ndarray) -> LinearCostModel:
    """Non-negative least squares on relative residuals: min sum_i w_i ((a + c b_i - t_i) / t_i)^2, a, c >= 0."""
    row_scale = np.sqrt(counts) / np.maximum(times, _MIN_TIME_S)
    design = np.stack([np.ones_like(times), sizes.astype(np.float64)], axis=1) * row_scale[:, None]
    (fixed_overhead_s, seconds_per_example), _ = optimize.nnls(design, times * row_scale)
    return LinearCostModel(fixed_overhead_s=float(fixed_overhead_s), seconds_per_example=float(seconds_per_example))


def _fit_piecewise(sizes: np.ndarray, times: np.ndarray) -> PiecewiseLinearCostModel:
    """Knots at the probed sizes through the (already non-decreasing) times."""
    return PiecewiseLinearCostModel(batch_sizes=tuple(map(int, sizes)), step_times_s=tuple(map(float, times)))


def _max_relative_error(model: CostModel, sizes: np.ndarray, times: np.ndarray) -> float:
    predicted = np.array([model.predict_step_time_s(int(b)) for b in sizes], dtype=np.float64)
    return float(np.max(np.abs(predicted - times) / np.maximum(times, _MIN_TIME_S)))


def _leave_one_out_error(kind: FitKind, sizes: np.ndarray, times: np.ndarray, counts: np.ndarray) -> float | None:
    """Largest relative error predicting each interior point from the same kind of fit to the others."""
    def error_without(i: int) -> float:
        keep = np.arange(sizes.size) != i
        others = (sizes[keep], times[keep])
        model = _fit_linear(*others, counts[keep]) if kind == "linear" else _fit_piecewise(*others)
        return _max_relative_error(model, sizes[i:i + 1], times[i:i + 1])

    return max(map(error_without, range(1, sizes.size - 1))) if sizes.size >= 3 else None
