"""Checked inputs of the solver and checked, counted evaluation of the replicas' cost models (pure)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hetero_cs.errors import ConfigError, InfeasiblePlanError
from hetero_cs.planning.cost_checks import checked_prediction, predictor
from hetero_cs.planning.cost_model import CostModel
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
        hint = _INT_HINTS.get(name, "")
        raise ConfigError(f"{name} must be an integer >= {low}. Received: {name}={value!r}. {hint}".rstrip())
    return int(value)


def _checked_problem(cost_models: Sequence[CostModel], global_batch_size: Any, max_batch_sizes: Any,
                     min_batch_size: Any) -> tuple[list[CostModel], int, int, list[int | None]]:
    """The checked inputs of one split (models, B, min_batch_size, caps); raises as ``solve_batch_split`` says."""
    models = _checked_models(cost_models)
    B = _checked_int("global_batch_size", global_batch_size, low=1)
    min_b = _checked_int("min_batch_size", min_batch_size, low=0)
    caps = _checked_caps(max_batch_sizes, len(models), min_b)
    _check_feasible(B, len(models), min_b, caps)
    return models, B, min_b, caps


def _checked_models(cost_models: Sequence[CostModel]) -> list[CostModel]:
    try:
        models = list(cost_models)
    except TypeError as exc:
        raise ConfigError(f"cost_models must be a sequence of cost models. Received: {cost_models!r}.") from exc
    if not models:
        raise ConfigError(
            "cost_models is empty: give one cost model per replica (e.g. from calibration.calibrate, or "
            "LinearCostModel(fixed_overhead_s, seconds_per_example))."
        )
    for i, model in enumerate(models):
        predictor(model, i)
    return models


def _checked_caps(max_batch_sizes: Sequence[int | None] | None, R: int, min_b: int) -> list[int | None]:
    if max_batch_sizes is None:
        return [None] * R
    if isinstance(max_batch_sizes, (str, bytes)) or not isinstance(max_batch_sizes, (Sequence, np.ndarray)) or (
        isinstance(max_batch_sizes, np.ndarray) and max_batch_sizes.ndim != 1
    ):
        raise ConfigError(
            f"max_batch_sizes must be None or a sequence of R={R} caps (ints, or None for no cap). Received: "
            f"max_batch_sizes={max_batch_sizes!r}. Example: max_batch_sizes=[512, None, 128]."
        )
    caps = list(max_batch_sizes)
    if len(caps) != R:
        raise ConfigError(
            f"max_batch_sizes must hold one cap per replica: len(max_batch_sizes)={len(caps)} but there are "
            f"R={R} cost models. Received: max_batch_sizes={caps}. Use None for a replica without a cap."
        )
    for i, cap in enumerate(caps):
        if cap is not None and (not _is_int(cap) or cap < 0):
            raise ConfigError(
                f"max_batch_sizes[{i}] must be an integer >= 0 (examples; 0 leaves the replica idle) or None (no "
                f"cap). Received: max_batch_sizes[{i}]={cap!r}."
            )
    low = [(i, int(c)) for i, c in enumerate(caps) if c is not None and c < min_b]
    if low:
        listing = ", ".join(f"max_batch_sizes[{i}]={c}" for i, c in low)
        raise InfeasiblePlanError(
            f"{listing} below min_batch_size={min_b}: such a replica cannot hold even the smallest slice. "
            "Pass min_batch_size=0 (lets it sit idle), raise its cap, or leave the device out."
        )
    return [None if c is None else int(c) for c in caps]


def _caps_listing(caps: Sequence[int | None]) -> str:
    return ", ".join(f"replica {i}: {'no cap' if c is None else c}" for i, c in enumerate(caps))


def _check_feasible(B: int, R: int, min_b: int, caps: Sequence[int | None]) -> None:
    if B < R * min_b:
        raise InfeasiblePlanError(
            f"global_batch_size={B} is less than num_replicas={R} x min_batch_size={min_b} = {R * min_b}: every "
            "replica must get at least min_batch_size examples. Pass min_batch_size=0 (lets replicas sit idle), "
            "raise the global batch size, or use fewer replicas."
        )
    if all(c is not None for c in caps):
        total = sum(c for c in caps if c is not None)
        if total < B:
            raise InfeasiblePlanError(
                f"global_batch_size={B} exceeds the total capacity: max_batch_sizes={list(caps)} sum to {total} "
                f"({_caps_listing(caps)}). Lower the global batch size to at most {total}, raise the caps "
                "(recalibrate the memory limits), or add replicas."
            )



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


@dataclass(frozen=True)
class _Grid:
    """Legal slices of replica i: lo[i] + j * k for j = 0..length[i]; M steps of k examples to hand out."""

    lo: list[int]
    length: list[int]
    M: int


def _first_at_least(minimum: int, offset: int, k: int) -> int:
    """The smallest v >= minimum with v = offset (mod k), for 0 <= offset < k."""
    return offset + -(-max(0, minimum - offset) // k) * k


def _grid(B: int, R: int, min_b: int, k: int, caps: Sequence[int | None]) -> _Grid:
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
    empty = [i for i in range(R) if hi[i] is not None and hi[i] < lo[i]]  # type: ignore[operator]
    if empty:
        listing = ", ".join(f"max_batch_sizes[{i}]={caps[i]}" for i in empty)
        raise InfeasiblePlanError(
            f"{listing} admits no slice that is a multiple of multiple_of={k} and >= min_batch_size={min_b} "
            f"(the smallest legal slice is {lo[empty[0]]}). Pass min_batch_size=0, a smaller multiple_of, or "
            "raise the cap."
        )
    if sum(lo) > B:
        raise InfeasiblePlanError(
            f"global_batch_size={B} cannot be split into slices that are multiples of multiple_of={k} and >= "
            f"min_batch_size={min_b}: the smallest legal slices {lo} sum to {sum(lo)} > {B}. Pass "
            "min_batch_size=0, a smaller multiple_of, or a larger global batch size."
        )
    M = (B - sum(lo)) // k
    length = [M if h is None else min(M, (h - l) // k) for h, l in zip(hi, lo)]
    if sum(length) < M:
        largest = [l + n * k for l, n in zip(lo, length)]
        raise InfeasiblePlanError(
            f"global_batch_size={B} exceeds the total capacity once slices are rounded to multiples of "
            f"multiple_of={k}: the largest legal slices {largest} sum to {sum(largest)} ({_caps_listing(caps)}). "
            f"Lower the global batch size, use a smaller multiple_of, or raise the caps."
        )
    return _Grid(lo, length, M)
