"""Micro-batched plans: one global batch trained as ``K`` sub-steps, so memory never caps a card's compute (pure).

A card's memory caps how many examples it holds at once (``max_batch_sizes``), not how many it may process per
optimizer step. When the caps bind, hetero_cs runs the global batch of ``B`` examples as ``K`` sub-steps of
``B_1..B_K`` examples (sizes differing by at most one): each sub-step is an ordinary step cut by a plan within the
caps, its gradients are summed on the host without an update, and the last sub-step applies the sum once. Every
example weighs ``1 / B`` of the whole batch, so the update equals one single-device step on all ``B`` examples
(:mod:`hetero_cs.engine.memory.micro_batches`).

Replica ``i`` thus runs ``k_i`` micro-batches (the sub-steps that give it examples) of at most ``m_i`` examples
(``m_i`` within its cap), ``b_i`` examples in all. Its cost per step is ``sum_j t_i(b_ij)``: every micro-batch pays
the card's per-step fixed cost again (parameters to the card, gradients back), which the calibrated cost models
measure; nothing is guessed. The sub-steps run one after another and every replica waits for the slowest in each,
so the step's makespan is ``sum_j max_i t_i(b_ij)``.

How ``K`` is chosen (:func:`plan_micro_batches`): at least ``K_min = ceil(B / sum(caps))`` (a batch larger than all
cards hold together); within the search, the ``K`` with the least predicted makespan, each sub-step solved by the
minimum-makespan solver within the caps. More sub-steps than ``K_min`` pay off where a fast card with little memory
would otherwise idle part of the step: it gets ``m_i`` examples in every sub-step. A micro-batched plan replaces the
single step (``K = 1``, where it fits) only if predicted ``MIN_PREDICTED_GAIN`` (2 %) faster: closer calls are
decided by calibration noise.

What the search guarantees: for every ``K`` it tries, the plan is the best one whose sub-steps differ by at most one
example, each cut optimally within the caps. It tries ``K_min`` to ``K_min + MAX_EXTRA_SUB_STEPS`` and stops
early once ``K`` times the cost of the smallest sub-step exceeds the best makespan found (no larger ``K`` can do
better, since a sub-step costs at least that).

Overlapped plans (:func:`plan_overlapped_micro_batches`). Where the engine runs the sub-steps in one traced call (up
to :data:`SUB_STEPS_PER_CALL`; more as several calls), a card's micro-batches run back to back and no card waits for
another between them, so the makespan is ``max_i sum_j t_i(b_ij)`` per call. The best such plan is solved directly, exactly: the minimum-makespan split under each
card's micro-batched curve (:class:`~hetero_cs.planning.cost_model.MicroBatchedCostModel`), each card's share then cut
into ``k_i`` near-equal micro-batches within its cap, run in its first ``k_i`` sub-steps.

Pure Python: no TensorFlow, no NVML.
"""

import functools
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hetero_cs.errors import ConfigError, InfeasiblePlanError
from hetero_cs.planning.choice import MIN_PREDICTED_GAIN
from hetero_cs.planning.cost_model import MicroBatchedCostModel, idle_free, near_equal_micro_batches
from hetero_cs.planning.plan import BatchPlan, _checked_global_batch_size, check_range, even_batch_split, ms_text
from hetero_cs.planning.plan import ratio
from hetero_cs.planning.solver import plan_from_split, solve_batch_split

__all__ = ["MAX_EXTRA_SUB_STEPS", "MAX_OVERLAPPED_SUB_STEPS", "SUB_STEPS_PER_CALL", "MicroBatchPlan", "capacity_of",
           "plan_micro_batches", "plan_overlapped_micro_batches", "prefer_overlapped"]

MAX_EXTRA_SUB_STEPS = 64
"""How many sub-steps beyond ``K_min`` the search tries (each costs at most two solver calls, once per B)."""


SUB_STEPS_PER_CALL = 16
"""The most sub-steps the engine traces into one overlapped call (each one more copy of the train step in the graph).
An overlapped plan with more runs as several calls of at most this many, each ending at a barrier."""

MAX_OVERLAPPED_SUB_STEPS = 65536
"""The most sub-steps an overlapped plan has (4096 calls; calls of the same shape share one trace, and each costs the
host about a millisecond); a plan needing more runs as sub-steps with a barrier each."""


_FIGURES = ("single_step_makespan_s", "sub_step_overhead_s", "overlapped")  # MicroBatchPlan's fields beside its plans


def capacity_of(max_batch_sizes: Sequence[int | None] | None) -> int | None:
    """How many examples all replicas hold together: ``sum(caps)``, or None when some replica is uncapped."""
    return None if max_batch_sizes is None or None in max_batch_sizes else int(sum(max_batch_sizes))


@dataclass(frozen=True)
class MicroBatchPlan:
    """A global batch trained as ``K`` sub-steps, each an ordinary plan within the memory caps.

    Attributes:
        sub_step_plans: The ``K >= 1`` sub-steps' plans, in the order they run; their global batch sizes sum to
            ``global_batch_size`` and differ by at most one.
        single_step_makespan_s: The predicted makespan of the batch in one step within the caps (seconds), or
            None when the caps cannot hold it in one step or nothing is predicted.
        sub_step_overhead_s: The host's measured time per step beyond the replicas' (dispatch, the plan's Python
            call, the gradient sum), seconds >= 0; counted once per sub-step in the predictions (once per step when
            ``overlapped``, once per call).
        overlapped: The sub-steps run in traced calls of up to :data:`SUB_STEPS_PER_CALL` each, each card's
            micro-batches back to back within a call (:func:`plan_overlapped_micro_batches`): replica ``i`` takes part
            in its first ``k_i`` sub-steps only, and the makespan is ``max_i sum_j t_i(b_ij)`` per call, summed over
            the calls. False: one call per sub-step, each ending at a barrier (``sum_j max_i t_i(b_ij)``).
        call_sub_steps: When ``overlapped``: the sub-steps of each call, in order (they sum to ``K``, each at most
            :data:`SUB_STEPS_PER_CALL`); empty for one call of all ``K``.

    Raises:
        ConfigError: No sub-step, or sub-steps of different replica counts.

    Examples:
        >>> steps = (BatchPlan((16, 24, 24), 64), BatchPlan((16, 24, 24), 64))
        >>> plan = MicroBatchPlan(steps)
        >>> plan.per_replica_batch_sizes, plan.micro_batch_sizes, plan.micro_batch_counts
        ((32, 48, 48), (16, 24, 24), (2, 2, 2))
    """

    sub_step_plans: tuple[BatchPlan, ...]
    single_step_makespan_s: float | None = None
    sub_step_overhead_s: float = 0.0
    overlapped: bool = False
    call_sub_steps: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        plans = tuple(self.sub_step_plans)
        if not plans or not all(isinstance(p, BatchPlan) for p in plans):
            raise ConfigError(f"MicroBatchPlan needs one or more BatchPlan sub-steps. Received: "
                              f"{self.sub_step_plans!r}.")
        if len({p.num_replicas for p in plans}) != 1:
            raise ConfigError(f"MicroBatchPlan's sub-steps must cut for the same replicas; got replica counts "
                              f"{[p.num_replicas for p in plans]}.")
        object.__setattr__(self, "sub_step_plans", plans)
        calls = tuple(int(n) for n in self.call_sub_steps)
        if calls and (sum(calls) != len(plans) or min(calls) < 1 or not self.overlapped):
            raise ConfigError(f"MicroBatchPlan.call_sub_steps must be sub-step counts >= 1 summing to the "
                              f"{len(plans)} sub-steps of an overlapped plan. Received: call_sub_steps={calls!r}, "
                              f"overlapped={self.overlapped!r}.")
        object.__setattr__(self, "call_sub_steps", calls)

    @property
    def num_sub_steps(self) -> int:
        """``K``, the sub-steps per global batch (1: an ordinary step)."""
        return len(self.sub_step_plans)

    @property
    def calls(self) -> tuple[tuple[BatchPlan, ...], ...]:
        """The sub-steps of each traced call, in order: one per call when ``overlapped``, else one each."""
        if not self.overlapped:
            return tuple((p,) for p in self.sub_step_plans)
        return tuple(_cut(self.sub_step_plans, self.call_sub_steps or (self.num_sub_steps,)))

    @property
    def num_calls(self) -> int:
        """How many traced calls the step makes (``K`` unless ``overlapped``)."""
        return len(self.calls)

    @property
    def global_batch_size(self) -> int:
        """``B``, the examples of the whole optimizer step."""
        return sum(p.global_batch_size for p in self.sub_step_plans)

    @property
    def sub_step_sizes(self) -> tuple[int, ...]:
        """``B_1..B_K``, the examples per sub-step."""
        return tuple(p.global_batch_size for p in self.sub_step_plans)

    @property
    def per_replica_batch_sizes(self) -> tuple[int, ...]:
        """``b_i``, replica ``i``'s examples over the whole step, shape [R]."""
        return tuple(sum(column) for column in zip(*(p.per_replica_batch_sizes for p in self.sub_step_plans)))

    @property
    def micro_batch_sizes(self) -> tuple[int, ...]:
        """``m_i``, replica ``i``'s largest micro-batch (what its memory must hold), shape [R]."""
        return tuple(max(column) for column in zip(*(p.per_replica_batch_sizes for p in self.sub_step_plans)))

    @property
    def micro_batch_counts(self) -> tuple[int, ...]:
        """``k_i``, how many micro-batches replica ``i`` runs per step (0: idle all step), shape [R]."""
        return tuple(sum(1 for b in column if b > 0)
                     for column in zip(*(p.per_replica_batch_sizes for p in self.sub_step_plans)))

    @property
    def predicted_makespan_s(self) -> float | None:
        """In seconds, or None if unknown: ``sum_j max_i t_i(b_ij)`` plus the host's overhead per sub-step (the
        sub-steps run one after another, each ending at a barrier); when ``overlapped``, ``max_i sum_j t_i(b_ij)``
        plus the host's overhead once per call of up to :data:`SUB_STEPS_PER_CALL` sub-steps (each card runs its
        micro-batches back to back), summed over the calls."""
        if self.overlapped:
            if any(p.predicted_step_times_s is None for p in self.sub_step_plans):
                return None
            return sum(max(float(sum(column)) for column in zip(*(p.predicted_step_times_s for p in call)))
                       + self.sub_step_overhead_s for call in self.calls)
        times = [p.predicted_makespan_s for p in self.sub_step_plans]
        return None if None in times else float(sum(times)) + self.num_sub_steps * self.sub_step_overhead_s

    @property
    def predicted_speedup_vs_single_step(self) -> float | None:
        """``single_step_makespan_s / predicted_makespan_s``, or None when either is unknown."""
        return ratio(self.single_step_makespan_s, self.predicted_makespan_s)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict; inverse of :meth:`from_dict`."""
        return {"sub_step_plans": [p.to_dict() for p in self.sub_step_plans],
                **{key: getattr(self, key) for key in _FIGURES}, "call_sub_steps": list(self.call_sub_steps)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "MicroBatchPlan":
        """Rebuilds a plan from :meth:`to_dict` output.

        Raises:
            ConfigError: Not a mapping, or a sub-step is not a valid plan.
        """
        if not isinstance(data, Mapping) or "sub_step_plans" not in data:
            raise ConfigError(f"MicroBatchPlan.from_dict needs the mapping MicroBatchPlan.to_dict() writes, with "
                              f"'sub_step_plans'. Received: {data!r}.")
        return cls(tuple(BatchPlan.from_dict(p) for p in data["sub_step_plans"]),
                   call_sub_steps=tuple(data.get("call_sub_steps", ())), **{k: data[k] for k in _FIGURES if k in data})

    @classmethod
    def of_slices(cls, plan: BatchPlan, max_batch_sizes: Sequence[int | None],
                  cost_models: Sequence[Any] | None = None) -> "MicroBatchPlan":
        """How an engine that micro-batches within each replica's step runs ``plan``: replica ``i``'s ``b_i``
        examples as :func:`~hetero_cs.planning.cost_model.near_equal_micro_batches` within its cap, back to back
        (``overlapped``, one call). Sub-step ``j`` holds each replica's ``j``-th micro-batch (0 once its are done).

        Args:
            plan: The split of the step (``b_i`` per replica).
            max_batch_sizes: Per-replica caps in examples (None entries: uncapped), shape [R]; a cap of 0 only for a
                replica that takes no example.
            cost_models: Per-replica step-time models (one micro-batch is one step of them), for the predictions;
                None: no predictions.

        Raises:
            ConfigError: Not one cap per replica, or a replica with examples and a cap of 0.
        """
        sizes = plan.per_replica_batch_sizes
        caps = list(max_batch_sizes)
        if len(caps) != len(sizes) or any(c is not None and c < 1 and b > 0 for b, c in zip(sizes, caps)):
            raise ConfigError(f"MicroBatchPlan.of_slices needs one cap per replica, >= 1 where the replica has "
                              f"examples. Received: split {list(sizes)}, max_batch_sizes={caps!r}.")
        chains = [[] if b == 0 else near_equal_micro_batches(b, c) for b, c in zip(sizes, caps)]
        K = max(1, max(len(chain) for chain in chains))
        if cost_models is not None:  # a replica whose micro-batches are done runs nothing in the later sub-steps
            cost_models = idle_free(list(cost_models))
        steps = tuple(plan_from_split([chain[j] if j < len(chain) else 0 for chain in chains], cost_models)
                      for j in range(K))
        fits = cost_models is not None and all(c is None or b <= c for b, c in zip(sizes, caps))
        single = plan_from_split(list(sizes), cost_models).predicted_makespan_s if fits else None  # all in one step
        return cls(steps, single_step_makespan_s=single, overlapped=True, call_sub_steps=(K,))

    def __str__(self) -> str:
        K = self.num_sub_steps
        lines = [f"MicroBatchPlan: global_batch_size={self.global_batch_size} in {K} sub-step{'' if K == 1 else 's'} "
                 f"of {_sizes_text(self.sub_step_sizes)} examples",
                 f"{'replica':>7}  {'examples':>8}  {'micro-batch':>11}  {'count':>5}"]
        lines += [f"{i:>7}  {b:>8}  {m if k else 'idle':>11}  {k:>5}" for i, (b, m, k) in
                  enumerate(zip(self.per_replica_batch_sizes, self.micro_batch_sizes, self.micro_batch_counts))]

        speedup = self.predicted_speedup_vs_single_step
        single = (ms_text(self.single_step_makespan_s) if self.single_step_makespan_s is not None
                  else "does not fit" if self.predicted_makespan_s is not None else "n/a")  # n/a: nothing predicted
        calls = "" if self.num_calls == 1 else f"in {self.num_calls} calls of up to {SUB_STEPS_PER_CALL} sub-steps, "
        how = (f"{calls}each card's micro-batches back to back, with {self.sub_step_overhead_s * 1e3:.3f} ms of host "
               f"time per {'call' if calls else 'step'}" if self.overlapped else
               f"a barrier after each sub-step, with {self.sub_step_overhead_s * 1e3:.3f} ms of host time per sub-step")
        lines += [f"predicted makespan: {ms_text(self.predicted_makespan_s)} ({how})",
                  f"in one step within the caps: {single}"]
        if speedup is not None:
            lines.append(f"predicted speedup vs one step: {speedup:.3f}x")
        return "\n".join(lines)


def _sizes_text(sizes: Sequence[int]) -> str:
    distinct = sorted(set(sizes), reverse=True)
    return " and ".join(f"{size} ({sizes.count(size)}x)" if len(distinct) > 1 else str(size) for size in distinct)


def _no_room_error() -> InfeasiblePlanError:
    return InfeasiblePlanError(
        "No replica can hold one example (every memory cap is 0), so no micro-batch fits. Free the devices' memory "
        "(another process may hold it), use a smaller model, or train on other devices.")


def plan_micro_batches(global_batch_size: int, solve: Callable[[int], BatchPlan], *, capacity: int | None,
                       min_gain: float = MIN_PREDICTED_GAIN, max_extra_sub_steps: int = MAX_EXTRA_SUB_STEPS,
                       sub_step_overhead_s: float = 0.0, incumbent_sub_steps: int | None = None) -> MicroBatchPlan:
    """The sub-steps to train one global batch of ``B`` examples in (see the module docstring).

    Args:
        global_batch_size: ``B >= 1``.
        solve: ``solve(b)`` -> the plan of a sub-step of ``b`` examples within the caps (e.g.
            :func:`hetero_cs.planning.choice.choose_plan`); called at most twice per ``K`` tried, each size once.
        capacity: ``sum(caps)`` (:func:`capacity_of`), or None when some replica is uncapped.
        min_gain: A micro-batched plan replaces one step that fits only if predicted this much faster (a fraction).
        max_extra_sub_steps: How many ``K`` beyond ``K_min`` to try (>= 0).
        sub_step_overhead_s: The host's time per step beyond the replicas' (seconds >= 0, measured by the
            engine): each sub-step pays it once.
        incumbent_sub_steps: The ``K`` in use for this batch size, if any: another ``K`` replaces it only if
            predicted ``min_gain`` faster (the measured overhead varies a little from step to step; each new ``K``
            cuts new sub-step sizes, which a traced step may have to be traced again for).

    Returns:
        The :class:`MicroBatchPlan`; ``K = 1`` when one step within the caps is best (or nothing is predicted and
        the batch fits), ``K = K_min`` when nothing is predicted and it does not.

    Raises:
        ConfigError: ``B`` not an integer >= 1, ``capacity`` not None or an integer >= 0.
        InfeasiblePlanError: ``capacity`` is 0: no replica can hold one example.
    """
    B = _checked_global_batch_size(global_batch_size, allow_zero=False)
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0):
        raise ConfigError(f"capacity must be None or an integer >= 0 (examples). Received: capacity={capacity!r}.")
    if capacity == 0:
        raise _no_room_error()
    check_range("sub_step_overhead_s", sub_step_overhead_s, 0, hint="seconds")
    overhead = float(sub_step_overhead_s)
    k_min = 1 if capacity is None or B <= capacity else math.ceil(B / capacity)
    plan_of = functools.cache(solve)  # each sub-step size solved once

    def makespan(K: int) -> float | None:
        times = [plan_of(size).predicted_makespan_s for size in even_batch_split(B, K)]
        return None if None in times else float(sum(times)) + K * overhead

    single = makespan(1) if k_min == 1 else None
    best_k, best = k_min, makespan(k_min)
    if best is not None:  # (else nothing is predicted, and single is None: the fewest sub-steps that fit)
        smallest = (plan_of(1).predicted_makespan_s or 0.0) + overhead  # no sub-step costs less than one example's
        for K in range(k_min + 1, min(B, k_min + max_extra_sub_steps) + 1):
            if smallest > 0 and K * smallest >= best:
                break
            if (value := makespan(K)) is not None and value < best:
                best_k, best = K, value
        if single is not None and best_k != 1 and best * (1.0 + min_gain) > single:
            best_k, best = 1, single  # not clearly faster than the one step that fits
        if incumbent_sub_steps is not None and incumbent_sub_steps != best_k and k_min <= incumbent_sub_steps <= B:
            if (kept := makespan(incumbent_sub_steps)) is not None and best * (1.0 + min_gain) > kept:
                best_k = incumbent_sub_steps  # not clearly faster than the K in use
    return MicroBatchPlan(tuple(plan_of(size) for size in even_batch_split(B, best_k)), single_step_makespan_s=single,
                          sub_step_overhead_s=overhead)


def micro_batched_curves(cost_models, max_batch_sizes) -> list:
    """Each replica's time for ``b`` examples run as micro-batches within its cap, back to back
    (:class:`~hetero_cs.planning.cost_model.MicroBatchedCostModel`); an uncapped replica's model as it is, and a cap
    of 0 left to :func:`zero_caps` (such a replica takes no example)."""
    return [model if cap is None or cap < 1 else MicroBatchedCostModel(model, int(cap))
            for model, cap in zip(cost_models, max_batch_sizes)]


def zero_caps(max_batch_sizes) -> list:
    """The caps a solver over :func:`micro_batched_curves` needs: 0 where a replica holds no example, else none."""
    return [0 if cap is not None and cap < 1 else None for cap in max_batch_sizes]


def plan_overlapped_micro_batches(global_batch_size: int, cost_models: Sequence[Any],
                                  max_batch_sizes: Sequence[int | None], *, host_overhead_s: float = 0.0,
                                  single_step_makespan_s: float | None = None,
                                  max_sub_steps: int = MAX_OVERLAPPED_SUB_STEPS) -> MicroBatchPlan | None:
    """The fastest overlapped plan: each card runs its ``b_i`` examples as micro-batches within its cap, back to back.

    Minimises ``max_i T_i(b_i)`` over integer splits of ``B``, where ``T_i`` is
    :class:`~hetero_cs.planning.cost_model.MicroBatchedCostModel` over replica ``i``'s model and cap (``k_i =
    ceil(b_i / cap_i)`` near-equal micro-batches, each paying the card's per-step fixed cost again), exactly, with
    the minimum-makespan solver (these curves are non-decreasing). An uncapped replica runs its share in one
    micro-batch; one whose cap is 0 gets nothing. Sub-step ``j`` then gives replica ``i`` its ``j``-th micro-batch
    (largest first) while ``j < k_i``, and 0 examples after: ``K = max_i k_i`` sub-steps, which the engine runs in
    one traced call with no barrier between them (:mod:`hetero_cs.engine.memory.micro_batches`). When ``K`` exceeds
    :data:`SUB_STEPS_PER_CALL`, the step runs as several calls, each ending at a barrier (``call_sub_steps``): the
    faster of this split with each card's micro-batches spread evenly over ``n = ceil(K / SUB_STEPS_PER_CALL)``
    calls, and ``n`` to ``n + 8`` calls of near-equal examples, each planned as its own overlapped step.

    Args:
        global_batch_size: ``B >= 1``.
        cost_models: One per replica, ``R >= 1``: each card's per-step model (:class:`CostModel`), idle-free where
            the engine runs nothing for an idle replica (``t(0) = 0``).
        max_batch_sizes: Memory caps in examples, shape [R] (None: uncapped).
        host_overhead_s: The host's measured time per overlapped step beyond the cards' (seconds >= 0).
        single_step_makespan_s: The predicted makespan of one step within the caps, recorded in the plan (or None).
        max_sub_steps: Plans needing more sub-steps return None (see :data:`MAX_OVERLAPPED_SUB_STEPS`). The
            sub-steps run in calls of up to :data:`SUB_STEPS_PER_CALL`, whose barriers the prediction counts; the
            split itself is the best one without them.

    Returns:
        The :class:`MicroBatchPlan` with ``overlapped=True`` (``K = 1`` when no card needs a second micro-batch),
        or None when it would need more than ``max_sub_steps`` sub-steps.

    Raises:
        ConfigError: ``B`` not an integer >= 1, or the caps' length is not R.
        InfeasiblePlanError: No replica can hold one example.
        InvalidCostModelError: From the models.

    Examples:
        >>> from hetero_cs.planning.cost_model import LinearCostModel
        >>> fast = LinearCostModel(0.002, 0.001)       # little memory: 16 examples at once
        >>> slow = LinearCostModel(0.002, 0.004)
        >>> plan = plan_overlapped_micro_batches(96, [fast, slow], [16, 64])
        >>> plan.per_replica_batch_sizes, plan.micro_batch_sizes, plan.micro_batch_counts
        ((75, 21), (15, 21), (5, 1))
    """
    B = _checked_global_batch_size(global_batch_size, allow_zero=False)
    models, caps = list(cost_models), list(max_batch_sizes)
    if len(caps) != len(models):
        raise ConfigError(f"max_batch_sizes needs one entry per replica ({len(models)}). Received: {caps!r}.")
    if all(cap is not None and cap < 1 for cap in caps):
        raise _no_room_error()
    curves = micro_batched_curves(models, caps)
    # The minimum-makespan solver, exact for any non-decreasing curve (a micro-batched line costs O(1) to evaluate).
    split = solve_batch_split(curves, B, max_batch_sizes=zero_caps(caps), min_batch_size=0).per_replica_batch_sizes
    parts = [curve.micro_batches(b) if isinstance(curve, MicroBatchedCostModel) else ([b] if b else [])
             for curve, b in zip(curves, split)]
    K = max(len(p) for p in parts)
    if K > max_sub_steps:
        return None
    overlapped = functools.partial(MicroBatchPlan, single_step_makespan_s=single_step_makespan_s,
                                   sub_step_overhead_s=float(host_overhead_s), overlapped=True)
    if K <= SUB_STEPS_PER_CALL:
        return _spread(parts, 1, models, overlapped)
    # More sub-steps than one call holds. Two ways to cut the step into calls, the faster kept: (a) this split with
    # each card's micro-batches spread evenly over n calls; (b) n calls of about B / n examples, each its own
    # overlapped plan (balanced within the call, so no card waits long at a call's end, whatever its micro-batch).
    n = -(-K // SUB_STEPS_PER_CALL)
    best = _spread(parts, n, models, overlapped)
    for calls in range(n, min(n + 8, B) + 1):
        sizes = even_batch_split(B, calls)
        per_size = {size: plan_overlapped_micro_batches(size, models, caps, host_overhead_s=host_overhead_s,
                                                        max_sub_steps=SUB_STEPS_PER_CALL) for size in set(sizes)}
        if any(plan is None for plan in per_size.values()):
            continue
        steps = [q for size in sizes for q in per_size[size].sub_step_plans]
        candidate = overlapped(tuple(steps), call_sub_steps=tuple(per_size[size].num_sub_steps for size in sizes))
        if candidate.predicted_makespan_s < best.predicted_makespan_s:
            best = candidate
    return best


def _spread(parts: list, n: int, models, overlapped: Callable[..., MicroBatchPlan]) -> MicroBatchPlan:
    """Each card's micro-batches (``parts[i]``, largest first) spread evenly over ``n`` calls; within a call, sub-step
    ``j`` gives each card its ``j``-th micro-batch there; ``overlapped`` makes the plan of the sub-steps."""
    sub_steps, call_sub_steps = [], []
    for group in zip(*(_cut(p, even_batch_split(len(p), n)) for p in parts)):
        depth = max(len(p) for p in group)
        if not depth:
            continue  # a call no card has a micro-batch in
        call_sub_steps.append(depth)
        for j in range(depth):
            sizes = tuple(p[j] if j < len(p) else 0 for p in group)
            times = tuple(float(models[i].predict_step_time_s(b)) if b else 0.0 for i, b in enumerate(sizes))
            sub_steps.append(BatchPlan(sizes, sum(sizes), predicted_makespan_s=max(times),
                                       predicted_step_times_s=times))
    return overlapped(tuple(sub_steps), call_sub_steps=tuple(call_sub_steps) if len(call_sub_steps) > 1 else ())


def _cut(items: Sequence, sizes: Sequence[int]) -> list:
    """``items`` cut into consecutive pieces of ``sizes`` examples each (they sum to ``len(items)``)."""
    return [items[end - size:end] for size, end in zip(sizes, itertools.accumulate(sizes))]


def prefer_overlapped(barrier_plan: MicroBatchPlan, overlapped_plan: MicroBatchPlan | None, *,
                      min_gain: float = MIN_PREDICTED_GAIN) -> MicroBatchPlan:
    """``overlapped_plan`` where it has 2 or more sub-steps and is predicted ``min_gain`` faster than
    ``barrier_plan`` (sub-steps with a barrier each, or the one step that fits), else ``barrier_plan``.

    Compared on the cards' time alone (each plan's host time per call taken out): the host's time is measured only
    for the path that runs, and a barrier plan pays at least an overlapped call's in each of its sub-steps.
    """
    if overlapped_plan is None or overlapped_plan.num_sub_steps < 2 or overlapped_plan.predicted_makespan_s is None:
        return barrier_plan
    ours = overlapped_plan.predicted_makespan_s - overlapped_plan.num_calls * overlapped_plan.sub_step_overhead_s
    theirs = barrier_plan.predicted_makespan_s
    if theirs is not None:
        theirs -= barrier_plan.num_sub_steps * barrier_plan.sub_step_overhead_s
    return barrier_plan if theirs is not None and ours * (1.0 + min_gain) > theirs else overlapped_plan
