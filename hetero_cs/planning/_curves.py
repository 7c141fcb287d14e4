"""The solver's internals (pure): its checked inputs, the checked and counted evaluation of the replicas' cost
models, the grid of legal slices, and the knot tables of its closed-form path.

The closed-form path: every model of this library is exactly linear between known breakpoints, so the continuous
relaxation "every replica stops where its time reaches T" is solved on the knots with numpy.
"""

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from hetero_cs.errors import ConfigError, InfeasiblePlanError
from hetero_cs.planning.cost_checks import checked_prediction, decreasing_error, predictor
from hetero_cs.planning.cost_model import CostModel, LinearCostModel, PiecewiseLinearCostModel, ScaledCostModel
from hetero_cs.planning.plan import _is_int


# ----------------------------------------------------------------------------------------------------------------
# Input checks
# ----------------------------------------------------------------------------------------------------------------
_INT_HINTS = {
    "global_batch_size": "Pass the number of examples in one optimizer step, e.g. 256.",
    "min_batch_size": "Pass 0 to let a replica sit idle, or 1 (the default) to give every replica work.",
    "multiple_of": "Pass 1 for no rounding, or e.g. 8 to keep every slice a multiple of 8.",
}


def _checked_int(name: str, value: Any, *, low: int) -> int:
    if not _is_int(value) or value < low:
        raise ConfigError(f"{name} must be an integer >= {low}. Received: {name}={value!r}. {_INT_HINTS[name]}")
    return int(value)


def _checked_problem(cost_models: Sequence[CostModel], global_batch_size: Any, max_batch_sizes: Any,
                     min_batch_size: Any) -> tuple[list[CostModel], int, int, list[int | None]]:
    """The checked inputs of one split (models, B, min_batch_size, caps); raises as ``solve_batch_split`` says."""
    models = _checked_models(cost_models)
    B = _checked_int("global_batch_size", global_batch_size, low=1)
    min_b = _checked_int("min_batch_size", min_batch_size, low=0)
    R = len(models)
    caps = _checked_caps(max_batch_sizes, R, min_b)
    if B < R * min_b:
        raise InfeasiblePlanError(
            f"global_batch_size={B} is less than num_replicas={R} x min_batch_size={min_b} = {R * min_b}: every "
            "replica must get at least min_batch_size examples. Pass min_batch_size=0 (lets replicas sit idle), "
            "raise the global batch size, or use fewer replicas.")
    if all(c is not None for c in caps) and (total := sum(caps)) < B:
        raise InfeasiblePlanError(f"global_batch_size={B} exceeds the total capacity: max_batch_sizes={list(caps)} sum "
                                  f"to {total} ({_caps_listing(caps)}). Lower the global batch size to at most "
                                  f"{total}, raise the caps (recalibrate the memory limits), or add replicas.")
    return models, B, min_b, caps


def _checked_models(cost_models: Sequence[CostModel]) -> list[CostModel]:
    try:
        models = list(cost_models)
    except TypeError as exc:
        raise ConfigError(f"cost_models must be a sequence of cost models. Received: {cost_models!r}.") from exc
    if not models:
        raise ConfigError("cost_models is empty: give one cost model per replica (e.g. from calibration.calibrate, or "
                          "LinearCostModel(fixed_overhead_s, seconds_per_example)).")
    for i, model in enumerate(models):
        predictor(model, i)
    return models


def _checked_caps(max_batch_sizes: Sequence[int | None] | None, R: int, min_b: int) -> list[int | None]:
    if max_batch_sizes is None:
        return [None] * R
    if isinstance(max_batch_sizes, (str, bytes)) or not isinstance(max_batch_sizes, (Sequence, np.ndarray)) or (
            isinstance(max_batch_sizes, np.ndarray) and max_batch_sizes.ndim != 1):
        raise ConfigError(f"max_batch_sizes must be None or a sequence of R={R} caps (ints, or None for no cap). "
                          f"Received: max_batch_sizes={max_batch_sizes!r}. Example: max_batch_sizes=[512, None, 128].")
    caps = list(max_batch_sizes)
    if len(caps) != R:
        raise ConfigError(
            f"max_batch_sizes must hold one cap per replica: len(max_batch_sizes)={len(caps)} but there are "
            f"R={R} cost models. Received: max_batch_sizes={caps}. Use None for a replica without a cap.")
    for i, cap in enumerate(caps):
        if cap is not None and (not _is_int(cap) or not 0 <= cap < 2**63):
            raise ConfigError(f"max_batch_sizes[{i}] must be an integer in [0, 2**63) (examples; 0 leaves the replica "
                              f"idle) or None (no cap). Received: max_batch_sizes[{i}]={cap!r}.")
    if low := [(i, int(c)) for i, c in enumerate(caps) if c is not None and c < min_b]:
        listing = ", ".join(f"max_batch_sizes[{i}]={c}" for i, c in low)
        raise InfeasiblePlanError(
            f"{listing} below min_batch_size={min_b}: such a replica cannot hold even the smallest slice. "
            "Pass min_batch_size=0 (lets it sit idle), raise its cap, or leave the device out.")
    return [None if c is None else int(c) for c in caps]


def _caps_listing(caps: Sequence[int | None]) -> str:
    return ", ".join(f"replica {i}: {'no cap' if c is None else c}" for i, c in enumerate(caps))


class _Curves:
    """Checked, counted evaluation of each replica's cost model (on its grid lo[i] + j * step, for the selection)."""

    def __init__(self, models: Sequence[CostModel], lo: Sequence[int] = (), length: Sequence[int] = (), step: int = 1):
        self.predict = [m.predict_step_time_s for m in models]
        self.lo = list(lo)
        self.length = list(length)
        self.step = step
        self.evaluations = 0

    def time(self, i: int, batch_size: int) -> float:
        self.evaluations += 1
        return checked_prediction(self.predict[i], batch_size, i)


def _first_at_least(minimum: int, offset: int, k: int) -> int:
    """The smallest v >= minimum with v = offset (mod k), for 0 <= offset < k."""
    return offset + -(-max(0, minimum - offset) // k) * k


def _grid(B: int, R: int, min_b: int, k: int, caps: Sequence[int | None]) -> tuple[list[int], list[int], int]:
    """(lo, length, M): the legal slices of replica i are lo[i] + j * k for j = 0..length[i], and M steps of k
    examples are to hand out beyond lo."""
    rem = B % k
    offsets = [0] * R
    if rem:  # the lowest-index replica whose cap admits it holds the remainder
        first = _first_at_least(min_b, rem, k)
        holder = next((i for i, cap in enumerate(caps) if cap is None or first <= cap), None)
        if holder is None:
            raise InfeasiblePlanError(
                f"global_batch_size={B} is not a multiple of multiple_of={k}, so one replica must take a slice of "
                f"{rem} (mod {k}), at least {first} examples, but every cap is smaller: {_caps_listing(caps)}. "
                f"Use a global batch size that is a multiple of {k}, a smaller multiple_of, or larger caps.")
        offsets[holder] = rem
    lo = [_first_at_least(min_b, o, k) for o in offsets]
    hi = [None if c is None else o + (c - o) // k * k for c, o in zip(caps, offsets)]
    if empty := [i for i in range(R) if hi[i] is not None and hi[i] < lo[i]]:  # type: ignore[operator]
        listing = ", ".join(f"max_batch_sizes[{i}]={caps[i]}" for i in empty)
        raise InfeasiblePlanError(f"{listing} admits no slice that is a multiple of multiple_of={k} and >= "
                                  f"min_batch_size={min_b} (the smallest legal slice is {lo[empty[0]]}). Pass "
                                  "min_batch_size=0, a smaller multiple_of, or raise the cap.")
    if sum(lo) > B:
        raise InfeasiblePlanError(
            f"global_batch_size={B} cannot be split into slices that are multiples of multiple_of={k} and >= "
            f"min_batch_size={min_b}: the smallest legal slices {lo} sum to {sum(lo)} > {B}. Pass "
            "min_batch_size=0, a smaller multiple_of, or a larger global batch size.")
    M = (B - sum(lo)) // k
    length = [M if h is None else min(M, (h - l) // k) for h, l in zip(hi, lo)]
    if sum(length) < M:
        largest = [l + n * k for l, n in zip(lo, length)]
        raise InfeasiblePlanError(
            f"global_batch_size={B} exceeds the total capacity once slices are rounded to multiples of "
            f"multiple_of={k}: the largest legal slices {largest} sum to {sum(largest)} ({_caps_listing(caps)}). "
            f"Lower the global batch size, use a smaller multiple_of, or raise the caps.")
    return lo, length, M


# ----------------------------------------------------------------------------------------------------------------
# Knot tables (the closed-form path)
# ----------------------------------------------------------------------------------------------------------------
def _breakpoints(model: Any) -> tuple[int, ...] | None:
    """The batch sizes where ``model`` changes slope, if it is piecewise linear in closed form; else None.

    Used by the solver's fast path: between consecutive breakpoints (and beyond the outer ones) the model is
    exactly linear in the batch size. Only :class:`LinearCostModel` (no breakpoint), :class:`PiecewiseLinearCostModel`
    (its knots) and a :class:`ScaledCostModel` of those qualify.
    """
    if type(model) is ScaledCostModel:
        return _breakpoints(model.base)
    if type(model) is PiecewiseLinearCostModel:
        return model.batch_sizes
    return () if type(model) is LinearCostModel else None


def _knot_tables(models: Sequence[CostModel], lows: Sequence[int],
                 highs: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Knots (x, t_i(x)) of each replica's curve on [lows[i], highs[i]], shapes [R, K], padded with the last knot.

    Between knots each curve is exactly linear (the models have closed-form breakpoints).
    """
    curves = _Curves(models)
    rows_x, rows_t = [], []
    for i, (model, low, high) in enumerate(zip(models, lows, highs)):
        inner = [b for b in _breakpoints(model) if low < b < high]  # type: ignore[union-attr]
        xs = [low, *inner] + ([high] if high > low else [])
        ts = [curves.time(i, x) for x in xs]
        if a := next((a for a in range(1, len(ts)) if ts[a] < ts[a - 1]), 0):  # the first knot that decreases
            raise decreasing_error(i, xs[a - 1], ts[a - 1], xs[a], ts[a])
        rows_x.append(xs)
        rows_t.append(ts)
    width = max(2, max(len(r) for r in rows_x))  # each row padded with its last knot
    return tuple(np.array([r + [r[-1]] * (width - len(r)) for r in rows], dtype=float) for rows in (rows_x, rows_t))


def _ideal_tables(models: Sequence[CostModel], B: int, min_b: int,
                  caps: Sequence[int | None]) -> tuple[np.ndarray, np.ndarray]:
    """Knot tables on [min_b, cap_i]; a replica never needs more than B - (R - 1) * min_b, its cap if it has none."""
    most = B - (len(models) - 1) * min_b
    return _knot_tables(models, [min_b] * len(models), [most if c is None else min(c, most) for c in caps])


def _fill(X: np.ndarray, T: np.ndarray, level: float, *, strict: bool = False) -> np.ndarray:
    """x_i(level) = max{x: t_i(x) <= level} per replica (its left limit when strict), shape [R]."""
    below = (T < level) if strict else (T <= level)
    count = below.sum(axis=1)
    width = X.shape[1]
    rows = np.arange(X.shape[0])
    j = np.clip(count, 1, width - 1)
    x0, x1, t0, t1 = X[rows, j - 1], X[rows, j], T[rows, j - 1], T[rows, j]
    with np.errstate(divide="ignore", invalid="ignore"):
        inside = x0 + (level - t0) * ((x1 - x0) / (t1 - t0))
    return np.where(count == 0, X[:, 0], np.where(count == width, X[:, -1], inside))


def _lowest_level(X: np.ndarray, T: np.ndarray, B: int) -> float:
    """min{T: sum_i x_i(T) >= B} on knot tables (x_i at its lowest knot below its curve), -inf if that holds B."""
    if X[:, 0].sum() >= B:
        return -math.inf
    levels = np.unique(T)
    if _fill(X, T, float(levels[0])).sum() >= B:  # below levels[0] every x_i is at its lowest knot
        return float(levels[0])
    lo_idx, hi_idx = 0, len(levels) - 1  # sum x(levels[lo]) < B <= sum x(levels[hi]) (the last knots hold B)
    while hi_idx - lo_idx > 1:
        mid = (lo_idx + hi_idx) // 2
        if _fill(X, T, float(levels[mid])).sum() >= B:
            hi_idx = mid
        else:
            lo_idx = mid
    a, b = float(levels[lo_idx]), float(levels[hi_idx])
    at_a = float(_fill(X, T, a).sum())
    before_b = float(_fill(X, T, b, strict=True).sum())  # sum x is linear on [a, b), then may jump at b
    level = a + (B - at_a) * (b - a) / (before_b - at_a) if before_b >= B else b
    return min(max(level, a), b)
