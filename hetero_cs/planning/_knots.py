"""Knot tables of piecewise-linear cost models and the continuous (ideal) makespan bound on them (pure).

The solver's closed-form path: every model of this library is exactly linear between known breakpoints, so the
continuous relaxation "every replica stops where its time reaches T" is solved on the knots with numpy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from hetero_cs.planning._curves import _Curves
from hetero_cs.planning.cost_checks import decreasing_error
from hetero_cs.planning.cost_model import CostModel, LinearCostModel, PiecewiseLinearCostModel, ScaledCostModel


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


def _knot_tables(
    models: Sequence[CostModel], lows: Sequence[int], highs: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """Knots (x, t_i(x)) of each replica's curve on [lows[i], highs[i]], shapes [R, K], padded with the last knot.

    Between knots each curve is exactly linear (the models have closed-form breakpoints).
    """
    curves = _Curves(models)
    rows_x, rows_t = [], []
    for i, model in enumerate(models):
        low, high = lows[i], highs[i]
        inner = [b for b in _breakpoints(model) if low < b < high]  # type: ignore[union-attr]
        xs = [low, *inner] + ([high] if high > low else [])
        ts = [curves.time(i, x) for x in xs]
        for a in range(1, len(ts)):
            if ts[a] < ts[a - 1]:
                raise decreasing_error(i, xs[a - 1], ts[a - 1], xs[a], ts[a])
        rows_x.append(xs)
        rows_t.append(ts)
    width = max(2, max(len(r) for r in rows_x))
    X = np.array([r + [r[-1]] * (width - len(r)) for r in rows_x], dtype=np.float64)
    T = np.array([r + [r[-1]] * (width - len(r)) for r in rows_t], dtype=np.float64)
    return X, T


def _ideal_tables(
    models: Sequence[CostModel], B: int, min_b: int, caps: Sequence[int | None]
) -> tuple[np.ndarray, np.ndarray]:
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


def _closed_form_ideal(X: np.ndarray, T: np.ndarray, B: int) -> float:
    """The ideal bound of :func:`ideal_makespan_s` from :func:`_ideal_tables`."""
    return max(float(T[:, 0].max()), _lowest_level(X, T, B))


