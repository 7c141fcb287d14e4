"""solve_batch_split: the per-replica slices of one global batch that minimise the step makespan.

The problem. Replica i takes b_i examples and its step takes t_i(b_i) seconds, t_i non-decreasing (a cost model).
All replicas wait for the slowest, so one step takes the makespan max_i t_i(b_i). Find integers b_i with
sum_i b_i = B, min_batch_size <= b_i <= cap_i (and b_i a multiple of ``multiple_of``, see below) minimising it.

The method. Give every replica its smallest legal slice; the rest of the batch is M "steps" (of ``multiple_of``
examples each) to hand out. The j-th step of replica i has the key (t_i(lo_i + j*k), lo_i + j*k, i), and each
replica's keys increase with j. Any legal split takes M steps in all, a prefix of each replica's list, and its
makespan is the largest time it takes (or the largest idle-slice time t_i(lo_i), if larger). Any M steps include
one whose time is at least the M-th smallest time, so taking the M smallest keys is optimal. The solver therefore
*selects the M smallest elements of R sorted lists* whose elements are step times computed on demand:

* Generic path (any CostModel): a chunked selection. With r steps still to hand out and h replicas that still
  have steps, probe each replica's step s = floor(r / 2h) ahead; the replica whose probe has the smallest key can
  take all s of those steps, because at most h*s - h + 1 <= r steps have keys no larger than that probe. Repeat
  while r >= h*s, then halve s; finish one step at a time with a heap. Each halving of s costs about 2R model
  evaluations, so a solve costs O(R log(B / R)) evaluations in all (about 1,600 for R=64, B=65,536) and never
  loops over examples.
* Closed-form path (all models are this library's LinearCostModel, PiecewiseLinearCostModel or ScaledCostModel
  of those): the continuous relaxation, solved on the models' knots with numpy, gives every replica's slice to
  within about one step; the selection starts from just below it, and the result is certified (the largest
  chosen key is below every replica's next key) or recomputed by the generic path.

Both paths return the same split, so the tie rule is one rule: *examples go, one legal step at a time, to the
replica whose step time after taking them is lowest; ties go to the replica whose slice would be smaller, then to
the lower replica index*. Among all splits with the minimum makespan the solver returns the one this greedy
builds; for identical replicas (multiple_of=1, no binding cap) that is :func:`~hetero_cs.plan.even_batch_split`.
The greedy does not spread slack: a replica whose idle time already sets the makespan gets no examples that
others can finish sooner.

``multiple_of = k``: every slice is a multiple of k, except that when B is not, exactly one replica - the
*lowest-index replica whose cap admits a slice congruent to B mod k* (replica 0 unless its cap is too small) -
takes a slice congruent to B mod k (it holds the remainder). The minimum slice is min_batch_size rounded up to
the replica's grid.

Pure Python + numpy: no TensorFlow, no NVML.
"""

from __future__ import annotations

import heapq
import logging
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hetero_cs.cost_model import CostModel, _breakpoints
from hetero_cs.errors import ConfigError, InfeasiblePlanError, InvalidCostModelError
from hetero_cs.plan import BatchPlan, even_batch_split

logger = logging.getLogger(__name__)

__all__ = ["ideal_makespan_s", "solve_batch_split"]

_INF = math.inf
# The closed-form path starts its selection at this relative distance below the continuous optimum, far more
# than the rounding error of computing it (the final certificate catches anything else).
_WARM_START_MARGIN = 1e-9


def solve_batch_split(
    cost_models: Sequence[CostModel],
    global_batch_size: int,
    *,
    max_batch_sizes: Sequence[int | None] | None = None,
    min_batch_size: int = 1,
    multiple_of: int = 1,
) -> BatchPlan:
    """Splits one global batch across replicas to minimise the step makespan, exactly, over integers.

    Minimises max_i t_i(b_i) subject to sum_i b_i = B and min_batch_size <= b_i <= cap_i, for any
    non-decreasing per-replica step-time curves t_i (linear, flat then rising, stepped). An idle replica
    (b_i = 0, allowed with min_batch_size=0) still costs t_i(0). Among optimal splits it returns the one the greedy
    of the module docstring builds (ties to the smaller slice, then to the lower replica index); the result is
    deterministic.

    Args:
        cost_models: One per replica, in replica-id order; length R >= 1. Each has
            ``predict_step_time_s(batch_size) -> float`` (seconds, finite, >= 0, non-decreasing).
        global_batch_size: B, examples per optimizer step, integer >= 1.
        max_batch_sizes: Per-replica memory caps in examples, shape [R], integers >= min_batch_size; a None entry
            (or None for all) means no cap.
        min_batch_size: Smallest slice per replica, integer >= 0; 0 lets a replica sit idle.
        multiple_of: k >= 1; every slice is a multiple of k, except one remainder slice when B is not (module
            docstring).

    Returns:
        A BatchPlan whose per_replica_batch_sizes has shape [R] and sums to B, with predicted_step_times_s,
        predicted_makespan_s, even_split_makespan_s (:func:`~hetero_cs.plan.even_batch_split`, ignoring caps) and
        ideal_makespan_s (:func:`ideal_makespan_s` under the same caps and minimum, clamped to at most the
        predicted makespan).

    Raises:
        ConfigError: If B, min_batch_size or multiple_of is not an integer in range, cost_models is empty, or
            max_batch_sizes has the wrong length or a value that is not an integer.
        InfeasiblePlanError: If B < R * min_batch_size, B exceeds the sum of the caps, a cap is below
            min_batch_size, or no split meets multiple_of (the message lists each cap and the fix).
        InvalidCostModelError: If a model has no predict_step_time_s, or predicts NaN, an infinite or negative
            time, or a time that decreases with batch size (the message names the replica, sizes and values;
            monotonicity is checked at the batch sizes the solver evaluates).

    Example:
        Three cards with illustrative linear costs: 5 ms fixed per step, and seconds per example proportional to
        1 / fp32 TFLOPS (NVIDIA datasheets: A10 31.2, T4 8.1, Tesla P100 PCIe 9.3 TFLOPS):

        >>> from hetero_cs.cost_model import LinearCostModel
        >>> models = [LinearCostModel(0.005, 0.01 / tflops) for tflops in (31.2, 8.1, 9.3)]
        >>> plan = solve_batch_split(models, 256)
        >>> plan.per_replica_batch_sizes
        (165, 42, 49)
        >>> round(plan.predicted_makespan_s * 1e3, 2), round(plan.even_split_makespan_s * 1e3, 2)
        (57.88, 109.94)
        >>> round(plan.predicted_speedup_vs_even, 2), round(plan.efficiency, 3)
        (1.9, 0.996)
    """
    models = _checked_models(cost_models)
    R = len(models)
    B = _checked_int("global_batch_size", global_batch_size, low=1)
    min_b = _checked_int("min_batch_size", min_batch_size, low=0)
    k = _checked_int("multiple_of", multiple_of, low=1)
    caps = _checked_caps(max_batch_sizes, R, min_b)
    _check_feasible(B, R, min_b, caps)
    grid = _grid(B, R, min_b, k, caps)
    curves = _Curves(models, grid.lo, grid.length, k)

    closed_form = all(_breakpoints(m) is not None for m in models)
    if closed_form:
        tables = _ideal_tables(models, B, min_b, caps)
        relaxed = _lowest_level(*tables, B)
        ideal_s = max(float(tables[1][:, 0].max()), relaxed)
        if k > 1:  # (with k = 1 the grid is [min_b, min(cap_i, B - (R - 1) * min_b)], the ideal's own tables)
            tables = _knot_tables(models, grid.lo, [lo + n * k for lo, n in zip(grid.lo, grid.length)])
            relaxed = _lowest_level(*tables, B)
        counts, step_times = _warm_selection(curves, grid, tables, relaxed)
        path = "closed-form"
    else:
        counts = [0] * R
        step_times = [curves.time(i, b) for i, b in enumerate(grid.lo)]
        if k == 1:  # the unit-step selection is also the one the ideal bound needs
            ideal_s = _select_with_ideal(curves, counts, step_times, grid.M, B, max(step_times))
        else:
            _select(curves, counts, step_times, grid.M)
            ideal_s = _generic_ideal(models, B, min_b, caps)
        path = "generic"

    sizes = tuple(lo + c * k for lo, c in zip(grid.lo, counts))
    even_s = max(curves.time(i, b) for i, b in enumerate(even_batch_split(B, R)))
    makespan_s = max(step_times)
    logger.debug("solve_batch_split: R=%d B=%d k=%d path=%s evaluations=%d sizes=%s", R, B, k, path,
                 curves.evaluations, sizes)
    return BatchPlan(
        per_replica_batch_sizes=sizes,
        global_batch_size=B,
        predicted_makespan_s=makespan_s,
        even_split_makespan_s=even_s,
        ideal_makespan_s=min(ideal_s, makespan_s),
        predicted_step_times_s=tuple(step_times),
    )


def ideal_makespan_s(
    cost_models: Sequence[CostModel],
    global_batch_size: int,
    *,
    max_batch_sizes: Sequence[int | None] | None = None,
    min_batch_size: int = 1,
) -> float:
    """The continuous lower bound on the makespan: examples infinitely divisible.

    Each t_i is extended to real batch sizes x by linear interpolation between consecutive integers (for this
    library's linear and piecewise-linear models that is the model itself). The bound is

        T_ideal = min { T >= max_i t_i(min_batch_size) : sum_i x_i(T) >= B },
        x_i(T) = max { x in [min_batch_size, cap_i] : t_i(x) <= T },

    the makespan if every replica could stop at the exact real batch size where its time reaches T. It
    ignores ``multiple_of``. No integer split under the same caps and minimum does better, so
    ideal / predicted makespan (BatchPlan.efficiency) is at most 1. For linear costs without caps and a zero
    minimum it is the classic (B + sum_i a_i / c_i) / (sum_i 1 / c_i).

    Args:
        cost_models: One per replica, length R >= 1.
        global_batch_size: B, integer >= 1.
        max_batch_sizes: Per-replica caps, shape [R] (None entries: no cap), or None.
        min_batch_size: Smallest slice, integer >= 0.

    Returns:
        T_ideal in seconds.

    Raises:
        ConfigError, InfeasiblePlanError, InvalidCostModelError: As :func:`solve_batch_split`.

    Example:
        >>> from hetero_cs.cost_model import LinearCostModel
        >>> models = [LinearCostModel(0.0, 0.001), LinearCostModel(0.0, 0.003)]
        >>> round(ideal_makespan_s(models, 6, min_batch_size=0), 12)  # x = (4.5, 1.5)
        0.0045
    """
    models = _checked_models(cost_models)
    R = len(models)
    B = _checked_int("global_batch_size", global_batch_size, low=1)
    min_b = _checked_int("min_batch_size", min_batch_size, low=0)
    caps = _checked_caps(max_batch_sizes, R, min_b)
    _check_feasible(B, R, min_b, caps)
    if all(_breakpoints(m) is not None for m in models):
        return _closed_form_ideal(*_ideal_tables(models, B, min_b, caps), B)
    return _generic_ideal(models, B, min_b, caps)


# ----------------------------------------------------------------------------------------------------------------
# Input checks
# ----------------------------------------------------------------------------------------------------------------
def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


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
        if not callable(getattr(model, "predict_step_time_s", None)):
            raise InvalidCostModelError(
                f"cost_models[{i}] has no predict_step_time_s method. Received: {model!r}. Pass a CostModel "
                "such as LinearCostModel or PiecewiseLinearCostModel."
            )
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
        if cap is not None and not _is_int(cap):
            raise ConfigError(
                f"max_batch_sizes[{i}] must be an integer or None (no cap). Received: max_batch_sizes[{i}]={cap!r}."
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


@dataclass(frozen=True)
class _Grid:
    """Legal slices of replica i: lo[i] + j * k for j = 0..length[i]; M steps of k examples to hand out."""

    lo: list[int]
    length: list[int]
    M: int
    remainder_replica: int | None


def _first_at_least(minimum: int, offset: int, k: int) -> int:
    """The smallest v >= minimum with v = offset (mod k), for 0 <= offset < k."""
    return offset + -(-max(0, minimum - offset) // k) * k


def _grid(B: int, R: int, min_b: int, k: int, caps: Sequence[int | None]) -> _Grid:
    rem = B % k
    offsets = [0] * R
    remainder_replica = None
    if rem:
        first = _first_at_least(min_b, rem, k)
        for i, cap in enumerate(caps):
            if cap is None or first <= cap:
                remainder_replica = i
                break
        if remainder_replica is None:
            raise InfeasiblePlanError(
                f"global_batch_size={B} is not a multiple of multiple_of={k}, so one replica must take a slice of "
                f"{rem} (mod {k}), at least {first} examples, but every cap is smaller: {_caps_listing(caps)}. "
                f"Use a global batch size that is a multiple of {k}, a smaller multiple_of, or larger caps."
            )
        offsets[remainder_replica] = rem
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
    return _Grid(lo, length, M, remainder_replica)


# ----------------------------------------------------------------------------------------------------------------
# Generic selection
# ----------------------------------------------------------------------------------------------------------------
class _Curves:
    """Checked, counted evaluation of each replica's cost model on its grid lo[i] + j * step."""

    def __init__(self, models: Sequence[CostModel], lo: Sequence[int], length: Sequence[int], step: int):
        self.predict = [m.predict_step_time_s for m in models]
        self.lo = list(lo)
        self.length = list(length)
        self.step = step
        self.evaluations = 0

    def time(self, i: int, batch_size: int) -> float:
        self.evaluations += 1
        try:
            value = float(self.predict[i](batch_size))
        except Exception as exc:  # noqa: BLE001 - any failure of a user's model is reported with its replica
            raise InvalidCostModelError(
                f"cost_models[{i}].predict_step_time_s({batch_size}) failed: {exc}. A cost model returns seconds "
                "as a float for any batch size >= 0."
            ) from exc
        if not 0.0 <= value < _INF:
            raise InvalidCostModelError(
                f"cost_models[{i}].predict_step_time_s({batch_size}) returned {value!r}; step times must be finite "
                f"and >= 0 seconds. Recalibrate replica {i} or fix its cost model."
            )
        return value

    def decreasing(self, i: int, b0: int, t0: float, b1: int, t1: float) -> InvalidCostModelError:
        return InvalidCostModelError(
            f"cost_models[{i}] predicts a shorter step for a larger batch: predict_step_time_s({b0})={t0!r} s > "
            f"predict_step_time_s({b1})={t1!r} s. Cost models must be non-decreasing in batch_size; fit replica "
            f"{i}'s measurements with calibration's isotonic fit (calibration.fit.fit_cost_model)."
        )


def _select(curves: _Curves, counts: list[int], step_times: list[float], remaining: int) -> None:
    """Hands out the ``remaining`` smallest-key steps beyond ``counts`` (module docstring), in place.

    On entry counts[i] steps of replica i are chosen (a set of smallest keys) and step_times[i] is t_i at that
    slice; on exit ``remaining`` more are chosen, the set is again the smallest keys, and step_times is updated.
    """
    R = len(counts)
    lo, length, k, time = curves.lo, curves.length, curves.step, curves.time
    above_j = [-1] * R  # an evaluated, not chosen step of replica i (memo and monotonicity check), or -1
    above_t = [0.0] * R

    def probe(i: int, j: int) -> float:
        if above_j[i] == j:
            return above_t[i]
        b = lo[i] + j * k
        t = time(i, b)
        if t < step_times[i]:
            raise curves.decreasing(i, lo[i] + counts[i] * k, step_times[i], b, t)
        if above_j[i] > j and t > above_t[i]:
            raise curves.decreasing(i, b, t, lo[i] + above_j[i] * k, above_t[i])
        return t

    while remaining > 0:
        active = [i for i in range(R) if counts[i] < length[i]]
        s = remaining // (2 * len(active))
        if s < 2:  # one step at a time: a plain greedy merge
            heap = [(probe(i, counts[i] + 1), lo[i] + (counts[i] + 1) * k, i) for i in active]
            heapq.heapify(heap)
            while remaining > 0:
                t, b, i = heapq.heappop(heap)
                j = counts[i] + 1
                counts[i], step_times[i], above_j[i] = j, t, -1
                remaining -= 1
                if j < length[i]:
                    heapq.heappush(heap, (probe(i, j + 1), b + k, i))
            return
        heap = []
        for i in active:
            j = counts[i] + min(s, length[i] - counts[i])
            heap.append((probe(i, j), lo[i] + j * k, i))
        heapq.heapify(heap)
        # The smallest probe's chunk has at most len(heap) * s - len(heap) + 1 keys at or below it: all chosen.
        while heap and remaining >= len(heap) * s:
            t, b, i = heapq.heappop(heap)
            j = (b - lo[i]) // k
            remaining -= j - counts[i]
            counts[i], step_times[i], above_j[i] = j, t, -1
            if j < length[i]:
                j2 = j + min(s, length[i] - j)
                heapq.heappush(heap, (probe(i, j2), lo[i] + j2 * k, i))
        for t, b, i in heap:
            above_j[i], above_t[i] = (b - lo[i]) // k, t


def _select_with_ideal(
    curves: _Curves, counts: list[int], step_times: list[float], M: int, B: int, base_s: float
) -> float:
    """Unit steps only: chooses the M smallest keys (in place, as _select) and returns the ideal bound.

    The ideal T lies where the chosen set is "all steps with time <= T": there x_i(T) = slice_i + a fraction of
    the next step, so sum_i x_i is linear in T until the next key, and the set has more than M - R steps (each
    fraction is < 1). So: choose M - R steps, then go one step at a time; at each state whose largest chosen
    time is below every next time, solve sum_i x_i(T) = B on that linear piece.
    """
    head_start = max(0, M - len(counts))
    _select(curves, counts, step_times, head_start)
    remaining = M - head_start
    lo, length, time = curves.lo, curves.length, curves.time
    R = len(counts)
    chosen = np.array(step_times, dtype=np.float64)
    nxt = np.full(R, _INF)
    heap = []
    for i in range(R):
        if counts[i] < length[i]:
            b = lo[i] + counts[i] + 1
            t = time(i, b)
            if t < step_times[i]:
                raise curves.decreasing(i, b - 1, step_times[i], b, t)
            nxt[i] = t
            heap.append((t, b, i))
    heapq.heapify(heap)
    last = max((step_times[i] for i in range(R) if counts[i] > 0), default=-_INF)
    whole = sum(lo) + sum(counts)
    ideal = None
    while True:
        upper = heap[0][0] if heap else _INF
        if ideal is None and last < upper:
            low = max(last, base_s)
            if low < upper:
                gaps = nxt - chosen  # > 0: nxt >= upper > low >= chosen
                examples = whole + float(np.sum((low - chosen) / gaps))
                if examples >= B:
                    ideal = low
                else:
                    rate = float(np.sum(1.0 / gaps))
                    if rate > 0:
                        root = low + (B - examples) / rate
                        if root < upper:
                            ideal = root
        if remaining == 0:
            break
        t, b, i = heapq.heappop(heap)
        counts[i] += 1
        step_times[i] = last = t
        chosen[i] = t
        whole += 1
        remaining -= 1
        if counts[i] < length[i]:
            t2 = time(i, b + 1)
            if t2 < t:
                raise curves.decreasing(i, b, t, b + 1, t2)
            nxt[i] = t2
            heapq.heappush(heap, (t2, b + 1, i))
        else:
            nxt[i] = _INF
    return max(base_s, last) if ideal is None else ideal


def _generic_ideal(models: Sequence[CostModel], B: int, min_b: int, caps: Sequence[int | None]) -> float:
    R = len(models)
    M = B - R * min_b
    length = [M if c is None else min(M, c - min_b) for c in caps]
    curves = _Curves(models, [min_b] * R, length, 1)
    step_times = [curves.time(i, min_b) for i in range(R)]
    return _select_with_ideal(curves, [0] * R, step_times, M, B, max(step_times))


# ----------------------------------------------------------------------------------------------------------------
# Closed-form path (piecewise-linear models of this library)
# ----------------------------------------------------------------------------------------------------------------
def _knot_tables(
    models: Sequence[CostModel], lows: Sequence[int], highs: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """Knots (x, t_i(x)) of each replica's curve on [lows[i], highs[i]], shapes [R, K], padded with the last knot.

    Between knots each curve is exactly linear (the models have closed-form breakpoints).
    """
    curves = _Curves(models, lows, [0] * len(models), 1)
    rows_x, rows_t = [], []
    for i, model in enumerate(models):
        low, high = lows[i], highs[i]
        inner = [b for b in _breakpoints(model) if low < b < high]  # type: ignore[union-attr]
        xs = [low, *inner] + ([high] if high > low else [])
        ts = [curves.time(i, x) for x in xs]
        for a in range(1, len(ts)):
            if ts[a] < ts[a - 1]:
                raise curves.decreasing(i, xs[a - 1], ts[a - 1], xs[a], ts[a])
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
        return -_INF
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


def _warm_selection(
    curves: _Curves, grid: _Grid, tables: tuple[np.ndarray, np.ndarray], relaxed: float
) -> tuple[list[int], list[float]]:
    """The selection started from the continuous relaxation, certified; the generic selection if not certified.

    Relax the grid problem: x_i real in [lo_i, largest legal slice], curves as given, and ignore the idle-slice
    times. Its optimum T_r is at most the M-th smallest step time v* (the optimal integer split is feasible for
    it), so every step with time below T_r is among the M smallest: those are chosen first, from a level a
    little below T_r to absorb rounding; the selection then finishes the rest. The certificate - the largest
    chosen key is below every replica's next key - proves the result is the M smallest keys whatever rounding did.

    Args:
        curves: Evaluation on the grid.
        grid: The legal slices.
        tables: Knot tables on exactly [lo_i, largest legal slice_i].
        relaxed: T_r, ``_lowest_level(*tables, B)``.
    """
    lo, length, k = grid.lo, grid.length, curves.step
    R = len(lo)
    counts = [0] * R
    if relaxed > 0:
        x = _fill(*tables, relaxed * (1.0 - _WARM_START_MARGIN)).tolist()
        counts = [max(0, min(n, int((xi - l) // k))) for xi, l, n in zip(x, lo, length)]
    if sum(counts) <= grid.M:
        step_times = [curves.time(i, lo[i] + counts[i] * k) for i in range(R)]
        _select(curves, counts, step_times, grid.M - sum(counts))
        last = max(((step_times[i], lo[i] + counts[i] * k, i) for i in range(R) if counts[i] > 0), default=None)
        if last is None:
            return counts, step_times
        nxt = [(curves.time(i, lo[i] + (counts[i] + 1) * k), lo[i] + (counts[i] + 1) * k, i)
               for i in range(R) if counts[i] < length[i]]
        if not nxt or last < min(nxt):
            return counts, step_times
    logger.debug("solve_batch_split: warm start not certified; using the generic selection")
    counts = [0] * R
    step_times = [curves.time(i, b) for i, b in enumerate(lo)]
    _select(curves, counts, step_times, grid.M)
    return counts, step_times
