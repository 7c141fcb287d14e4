"""Robust statistics over the monitor's window of step times (pure): the median and its relative standard error,
the start of a level shift, and the Theil-Sen affine fit of one replica's samples.
"""

import math
import statistics

import numpy as np

from hetero_cs.planning.cost_model import LinearCostModel

# An affine fit t = a + c*b from the window is used only when its slice sizes span at least this factor
# (max b / min b). Over a narrower range the slope is mostly noise: with 10 % timing noise and slices 48 vs 50,
# the fitted slope is off by ~100 %, and the intercept absorbs the error. The proportional model t = c*b is a
# secant through the origin instead; re-planning on secants converges to equal finishing times.
_MIN_SIZE_SPREAD_FOR_AFFINE_FIT = 2.0

# Shift detection: when a replica's last SHIFT_STEPS relative levels all lie more than SHIFT_THRESHOLD above (or
# below) the median of its earlier ones in the window, its speed changed; its estimate then uses only those recent
# steps instead of waiting for the window median to flip (window_steps // 2 + 1 steps). With up to 10 % uniform
# per-replica noise a false shift is impossible (every sample would have to be 15 % off); with 10 % lognormal noise
# its odds are about 4e-5 per replica per step - and the guard measures any re-plan it causes.
SHIFT_STEPS = 4
SHIFT_THRESHOLD = 0.15


def _median(values: np.ndarray) -> float:
    """The median of a 1-D array (the mean of the two middle values for an even count), as ``np.median`` gives it;
    NaN when it is empty.

    The window holds at most a few dozen values, where sorting a Python list (``statistics.median``) costs a few
    microseconds and ``np.median`` about 25: a look computes several medians per replica, and it runs beside the
    training step.
    """
    return float(statistics.median(values.tolist())) if values.size else math.nan


def median_and_error(values: np.ndarray) -> tuple[float, float]:
    """The median of ``values`` (1-D, n >= 1) and its relative standard error, 1.2533 * 1.4826 * MAD / median /
    sqrt(n): 1.4826 * MAD estimates the standard deviation robustly (consistent for normal noise), and 1.2533 / sqrt(n)
    is the standard error of a median of n such samples. The error is 0 when the median is not positive."""
    center = _median(values)
    if not center > 0:
        return center, 0.0
    return center, 1.2533 * 1.4826 * _median(np.abs(values - center)) / center / math.sqrt(values.size)


def _shift_start(levels: np.ndarray) -> int | None:
    """Index where the last SHIFT_STEPS levels start if they all moved past SHIFT_THRESHOLD of the earlier median.

    ``levels`` is one replica's finite relative levels, oldest first; at least SHIFT_STEPS earlier ones are needed.
    """
    if levels.size < 2 * SHIFT_STEPS:
        return None
    start = levels.size - SHIFT_STEPS
    recent, before = levels[start:], _median(levels[:start])
    up, down = np.all(recent > before * (1.0 + SHIFT_THRESHOLD)), np.all(recent < before * (1.0 - SHIFT_THRESHOLD))
    return start if before > 0 and (up or down) else None


def _fit_linear_model(sizes: np.ndarray, times_s: np.ndarray) -> LinearCostModel | None:
    """Fits t = a + c*b to one replica's window samples (shape [S] each); None if no usable sample."""
    usable = (sizes > 0) & (times_s > 0)
    b, t = sizes[usable], times_s[usable]
    if b.size == 0:
        return None
    if b.max() >= _MIN_SIZE_SPREAD_FOR_AFFINE_FIT * b.min():
        i, j = np.triu_indices(b.size, k=1)
        distinct = b[i] != b[j]
        slope = _median((t[j][distinct] - t[i][distinct]) / (b[j][distinct] - b[i][distinct]))
        if slope > 0 and (intercept := _median(t - slope * b)) >= 0:
            return LinearCostModel(intercept, slope)
    return LinearCostModel(0.0, _median(t / b))
