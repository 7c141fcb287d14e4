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
builds; for identical replicas (multiple_of=1, no binding cap) that is :func:`~hetero_cs.planning.plan.even_batch_split`.
The greedy does not spread slack: a replica whose idle time already sets the makespan gets no examples that
others can finish sooner.

``multiple_of = k``: every slice is a multiple of k, except that when B is not, exactly one replica - the
*lowest-index replica whose cap admits a slice congruent to B mod k* (replica 0 unless its cap is too small) -
takes a slice congruent to B mod k (it holds the remainder). The minimum slice is min_batch_size rounded up to
the replica's grid.

Pure Python + numpy: no TensorFlow, no NVML.
"""

import heapq
import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from hetero_cs.errors import ConfigError
from hetero_cs.planning._curves import _breakpoints, _checked_int, _checked_models, _checked_problem
from hetero_cs.planning._curves import _Curves, _fill, _grid, _ideal_tables, _knot_tables, _lowest_level
from hetero_cs.planning.cost_checks import decreasing_error
from hetero_cs.planning.cost_model import CostModel, holds_no_example
from hetero_cs.planning.plan import BatchPlan, _as_tuple, _is_int, even_batch_split

logger = logging.getLogger(__name__)

__all__ = ["ideal_makespan_s", "plan_from_split", "solve_batch_split"]

# The closed-form path starts its selection at this relative distance below the continuous optimum, far more
# than the rounding error of computing it (the final certificate catches anything else).
_WARM_START_MARGIN = 1e-9


def solve_batch_split(cost_models: Sequence[CostModel], global_batch_size: int, *,
                      max_batch_sizes: Sequence[int | None] | None = None, min_batch_size: int = 1,
                      multiple_of: int = 1) -> BatchPlan:
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
        predicted_makespan_s, even_split_makespan_s (:func:`~hetero_cs.planning.plan.even_batch_split`, ignoring caps) and
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

    Examples:
        Three cards with illustrative linear costs: 5 ms fixed per step, and seconds per example proportional to
        1 / fp32 TFLOPS (NVIDIA datasheets: A10 31.2, T4 8.1, Tesla P100 PCIe 9.3 TFLOPS):

        >>> from hetero_cs.planning.cost_model import LinearCostModel
        >>> models = [LinearCostModel(0.005, 0.01 / tflops) for tflops in (31.2, 8.1, 9.3)]
        >>> plan = solve_batch_split(models, 256)
        >>> plan.per_replica_batch_sizes
        (165, 42, 49)
        >>> round(plan.predicted_makespan_s * 1e3, 2), round(plan.even_split_makespan_s * 1e3, 2)
        (57.88, 109.94)
        >>> round(plan.predicted_speedup_vs_even, 2), round(plan.efficiency, 3)
        (1.9, 0.996)
    """
    models, B, min_b, caps = _checked_problem(cost_models, global_batch_size, max_batch_sizes, min_batch_size)
    R = len(models)
    k = _checked_int("multiple_of", multiple_of, low=1)
    lo, length, M = _grid(B, R, min_b, k, caps)
    curves = _Curves(models, lo, length, k)

    closed_form = all(_breakpoints(m) is not None for m in models)
    if closed_form:
        tables = _ideal_tables(models, B, min_b, caps)
        relaxed = _lowest_level(*tables, B)
        ideal_s = max(float(tables[1][:, 0].max()), relaxed)
        if k > 1:  # (with k = 1 the grid is [min_b, min(cap_i, B - (R - 1) * min_b)], the ideal's own tables)
            tables = _knot_tables(models, lo, [low + n * k for low, n in zip(lo, length)])
            relaxed = _lowest_level(*tables, B)
        counts, step_times = _warm_selection(curves, M, tables, relaxed)
    else:
        counts, step_times = [0] * R, [curves.time(i, b) for i, b in enumerate(lo)]
        if k == 1:  # the unit-step selection is also the one the ideal bound needs
            ideal_s = _select_with_ideal(curves, counts, step_times, M, B, max(step_times))
        else:
            _select(curves, counts, step_times, M)
            ideal_s = _generic_ideal(models, B, min_b, caps)

    sizes = tuple(low + c * k for low, c in zip(lo, counts))
    logger.debug("solve_batch_split: R=%d B=%d k=%d path=%s evaluations=%d sizes=%s", R, B, k,
                 "closed-form" if closed_form else "generic", curves.evaluations, sizes)
    return _priced_plan(sizes, step_times, ideal_s, models, curves.time)


def ideal_makespan_s(cost_models: Sequence[CostModel], global_batch_size: int, *,
                     max_batch_sizes: Sequence[int | None] | None = None, min_batch_size: int = 1) -> float:
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

    Examples:
        >>> from hetero_cs.planning.cost_model import LinearCostModel
        >>> models = [LinearCostModel(0.0, 0.001), LinearCostModel(0.0, 0.003)]
        >>> round(ideal_makespan_s(models, 6, min_batch_size=0), 12)  # x = (4.5, 1.5)
        0.0045
    """
    models, B, min_b, caps = _checked_problem(cost_models, global_batch_size, max_batch_sizes, min_batch_size)
    if all(_breakpoints(m) is not None for m in models):
        X, T = _ideal_tables(models, B, min_b, caps)
        return max(float(T[:, 0].max()), _lowest_level(X, T, B))
    return _generic_ideal(models, B, min_b, caps)



def plan_from_split(per_replica_batch_sizes: Sequence[int], cost_models: Sequence[Any] | None = None, *,
                    max_batch_sizes: Sequence[int | None] | None = None, min_batch_size: int = 0) -> BatchPlan:
    """Wraps a given split in a BatchPlan, with its predicted figures when cost models are given.

    With cost models, predicted_step_times_s is t_i(b_i), predicted_makespan_s their maximum,
    even_split_makespan_s the makespan of ``even_batch_split(B, R)``, and ideal_makespan_s the continuous lower
    bound of :func:`hetero_cs.planning.solver.ideal_makespan_s` under ``max_batch_sizes`` and ``min_batch_size`` (by
    default: no caps, idle replicas allowed - the best any split could do), never above the predicted makespan.
    Without cost models those figures are None.

    Args:
        per_replica_batch_sizes: Slices, shape [R], integers >= 0 with a positive sum B.
        cost_models: One CostModel per replica (shape [R]), or None.
        max_batch_sizes: Per-replica caps for the ideal bound, shape [R] (None entries: no cap), or None.
        min_batch_size: Smallest slice for the ideal bound, integer >= 0.

    Returns:
        The plan; global_batch_size is sum(per_replica_batch_sizes).

    Raises:
        ConfigError: If the slices are invalid or cost_models has the wrong length.
        InvalidCostModelError: If a model predicts NaN, a negative time, or a time that decreases with batch size.

    Examples:
        >>> from hetero_cs.planning.cost_model import LinearCostModel
        >>> models = [LinearCostModel(0.0, 0.001), LinearCostModel(0.0, 0.003)]
        >>> plan = plan_from_split((3, 1), models)
        >>> plan.predicted_makespan_s, plan.even_split_makespan_s, plan.ideal_makespan_s
        (0.003, 0.006, 0.003)
    """
    sizes = _as_tuple(per_replica_batch_sizes)
    if sizes is None:
        raise ConfigError(
            f"per_replica_batch_sizes must be a sequence of integers. Received: {per_replica_batch_sizes!r}.")
    plan = BatchPlan(sizes, sum(b for b in sizes if _is_int(b)))  # validates the slices before any model is called
    if cost_models is None:
        return plan
    models = list(cost_models)
    if len(models) != len(sizes):
        raise ConfigError(f"cost_models must hold one model per slice. Received: len(cost_models)={len(models)}, "
                          f"per_replica_batch_sizes={plan.per_replica_batch_sizes}.")
    curves = _Curves(_checked_models(models))
    times = [curves.time(i, b) for i, b in enumerate(plan.per_replica_batch_sizes)]
    ideal_s = ideal_makespan_s(models, plan.global_batch_size, max_batch_sizes=max_batch_sizes,
                               min_batch_size=min_batch_size)
    return _priced_plan(plan.per_replica_batch_sizes, times, ideal_s, models, curves.time)


def _priced_plan(sizes: tuple[int, ...], step_times: Sequence[float], ideal_s: float, models: Sequence[CostModel],
                 time: Any) -> BatchPlan:
    """The plan of ``sizes`` with its step times, the even split's makespan under ``time(i, b)`` (None where a device
    that holds no example would get some: no even split can run) and the ideal bound, at most the makespan."""
    B = sum(sizes)
    even = even_batch_split(B, len(sizes))
    even_s = None if any(holds_no_example(m) and b > 0 for m, b in zip(models, even)) else max(
        time(i, b) for i, b in enumerate(even))
    makespan_s = max(step_times)
    return BatchPlan(sizes, B, predicted_makespan_s=makespan_s, even_split_makespan_s=even_s,
                     ideal_makespan_s=min(ideal_s, makespan_s), predicted_step_times_s=tuple(step_times))


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
            raise decreasing_error(i, lo[i] + counts[i] * k, step_times[i], b, t)
        if above_j[i] > j and t > above_t[i]:
            raise decreasing_error(i, b, t, lo[i] + above_j[i] * k, above_t[i])
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
        ends = [counts[i] + min(s, length[i] - counts[i]) for i in active]  # each replica's next chunk
        heap = [(probe(i, j), lo[i] + j * k, i) for i, j in zip(active, ends)]
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


def _select_with_ideal(curves: _Curves, counts: list[int], step_times: list[float], M: int, B: int,
                       base_s: float) -> float:
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
    nxt = np.full(R, math.inf)
    heap: list[tuple[float, int, int]] = []

    def push(i: int) -> None:
        """Replica i's next unit step onto the heap, its time in nxt[i] (inf when it has none)."""
        nxt[i] = math.inf
        if counts[i] < length[i]:
            b = lo[i] + counts[i] + 1
            t = time(i, b)
            if t < step_times[i]:
                raise decreasing_error(i, b - 1, step_times[i], b, t)
            nxt[i] = t
            heapq.heappush(heap, (t, b, i))

    for i in range(R):
        push(i)
    last = max((step_times[i] for i in range(R) if counts[i] > 0), default=-math.inf)
    whole = sum(lo) + sum(counts)
    ideal = None
    while True:
        upper = heap[0][0] if heap else math.inf
        if ideal is None and last < upper and (low := max(last, base_s)) < upper:
            gaps = nxt - chosen  # > 0: nxt >= upper > low >= chosen
            examples = whole + float(np.sum((low - chosen) / gaps))
            rate = float(np.sum(1.0 / gaps))  # examples per second of T on this piece
            if (root := low if examples >= B else (low + (B - examples) / rate if rate > 0 else math.inf)) < upper:
                ideal = root
        if remaining == 0:
            break
        t, b, i = heapq.heappop(heap)
        counts[i] += 1
        step_times[i] = chosen[i] = last = t
        whole += 1
        remaining -= 1
        push(i)
    return max(base_s, last) if ideal is None else ideal


def _generic_ideal(models: Sequence[CostModel], B: int, min_b: int, caps: Sequence[int | None]) -> float:
    lo, length, M = _grid(B, len(models), min_b, 1, caps)  # (checked caps: the unit grid [min_b, cap_i] is legal)
    curves = _Curves(models, lo, length, 1)
    step_times = [curves.time(i, b) for i, b in enumerate(lo)]
    return _select_with_ideal(curves, [0] * len(models), step_times, M, B, max(step_times))


def _warm_selection(curves: _Curves, M: int, tables: tuple[np.ndarray, np.ndarray],
                    relaxed: float) -> tuple[list[int], list[float]]:
    """The selection started from the continuous relaxation, certified; the generic selection if not certified.

    Relax the grid problem: x_i real in [lo_i, largest legal slice], curves as given, and ignore the idle-slice
    times. Its optimum T_r is at most the M-th smallest step time v* (the optimal integer split is feasible for
    it), so every step with time below T_r is among the M smallest: those are chosen first, from a level a
    little below T_r to absorb rounding; the selection then finishes the rest. The certificate - the largest
    chosen key is below every replica's next key - proves the result is the M smallest keys whatever rounding did.

    Args:
        curves: Evaluation on the grid of legal slices.
        M: The steps to hand out beyond the smallest legal slices.
        tables: Knot tables on exactly [lo_i, largest legal slice_i].
        relaxed: T_r, ``_lowest_level(*tables, B)``.
    """
    lo, length, k = curves.lo, curves.length, curves.step
    R = len(lo)
    counts = [0] * R
    if relaxed > 0:
        x = _fill(*tables, relaxed * (1.0 - _WARM_START_MARGIN)).tolist()
        counts = [max(0, min(n, int((xi - l) // k))) for xi, l, n in zip(x, lo, length)]
    if sum(counts) <= M:
        step_times = [curves.time(i, lo[i] + counts[i] * k) for i in range(R)]
        _select(curves, counts, step_times, M - sum(counts))
        last = max(((step_times[i], lo[i] + counts[i] * k, i) for i in range(R) if counts[i] > 0), default=None)
        # (no step chosen: M = 0, so no replica has a next step either, and nothing is evaluated)
        nxt = [(curves.time(i, lo[i] + (counts[i] + 1) * k), lo[i] + (counts[i] + 1) * k, i)
               for i in range(R) if counts[i] < length[i]]
        if last is None or not nxt or last < min(nxt):
            return counts, step_times
    logger.debug("solve_batch_split: warm start not certified; using the generic selection")
    counts, step_times = [0] * R, [curves.time(i, b) for i, b in enumerate(lo)]
    _select(curves, counts, step_times, M)
    return counts, step_times
