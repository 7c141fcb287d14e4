"""How the split of one global batch is chosen: fixed shares, the even split, or the solved split (pure)."""

import logging
from collections.abc import Sequence

from hetero_cs.planning.cost_model import CostModel, LinearCostModel
from hetero_cs.planning.plan import BatchPlan, even_batch_split, split_by_shares
from hetero_cs.planning.solver import plan_from_split, solve_batch_split

logger = logging.getLogger("hetero_cs.planning.balancer")  # the messages users filter on

MIN_PREDICTED_GAIN = 0.02
"""An auto-balanced plan replaces the even split only if it is predicted at least 2 % faster (noise margin)."""


def choose_plan(global_batch_size: int, num_replicas: int, *, shares: Sequence[float] | None, auto_balance: bool,
                cost_models: Sequence[CostModel] | None, max_batch_sizes: Sequence[int | None] | None,
                log_ties: bool = True, idle_free: bool = False) -> BatchPlan:
    """The plan for one global batch of B examples on R replicas.

    Fixed ``shares`` win; without them, no auto-balance or no cost models give the even split (either one, when
    memory caps forbid it, moved to the closest split within the caps: the examples over a cap go to the replicas
    with room, in proportion to their shares); else the
    minimum-makespan split (``solve_batch_split``, min_batch_size 1 when B >= R, else 0), unless it is predicted
    less than MIN_PREDICTED_GAIN faster than the even split and the caps allow the even split: such ties are decided
    by calibration noise (e.g. 3/197 on two identical CPUs), so the even split stays (logged at INFO when
    ``log_ties``, at DEBUG otherwise, e.g. for a last partial batch). Predictions are filled when models are given.
    With ``idle_free`` (an engine that runs nothing for a replica with 0 examples; the models are then
    :class:`~hetero_cs.planning.cost_model.IdleFreeCostModel`, ``t(0) = 0``) the solver may give any replica 0
    examples, and does wherever leaving it out is predicted faster.
    """
    if shares is not None or not auto_balance or cost_models is None:
        split = (split_by_shares(global_batch_size, shares) if shares is not None
                 else even_batch_split(global_batch_size, num_replicas))
        if _violates(split, max_batch_sizes):  # memory caps lowered after an out-of-memory step
            split = _split_within_caps(global_batch_size, shares or [1.0] * num_replicas, max_batch_sizes)
        return plan_from_split(split, cost_models)
    holds_none = max_batch_sizes is not None and any(cap == 0 for cap in max_batch_sizes)  # that card takes none
    min_batch_size = 1 if global_batch_size >= num_replicas and not idle_free and not holds_none else 0
    plan = solve_batch_split(
        cost_models, global_batch_size, max_batch_sizes=max_batch_sizes, min_batch_size=min_batch_size)
    even = even_batch_split(global_batch_size, num_replicas)
    speedup = plan.predicted_speedup_vs_even
    if not _violates(even, max_batch_sizes) and speedup is not None and speedup < 1.0 + MIN_PREDICTED_GAIN:
        logger.log(logging.INFO if log_ties else logging.DEBUG, "hetero_cs: the solved split %s is predicted only %.1f "
                   "%% faster than the even split (below MIN_PREDICTED_GAIN=%.0f %%); keeping the even split %s.",
                   list(plan.per_replica_batch_sizes), (speedup - 1.0) * 100, MIN_PREDICTED_GAIN * 100, list(even))
        return plan_from_split(even, cost_models, max_batch_sizes=max_batch_sizes)
    return plan


def _violates(split: Sequence[int], caps: Sequence[int | None] | None) -> bool:
    return caps is not None and any(c is not None and b > c for b, c in zip(split, caps))


def _split_within_caps(global_batch_size: int, shares: Sequence[float], caps: Sequence[int | None]) -> tuple[int, ...]:
    """The split closest to ``shares`` within ``caps``: the minimum-makespan split for step times b_i / share_i
    (a replica with share 0 gets nothing). Raises InfeasiblePlanError when the caps cannot hold the batch."""
    models = [LinearCostModel(0.0, 1.0 / s if s > 0 else 1.0) for s in shares]
    caps = [0 if s <= 0 else c for s, c in zip(shares, caps)]
    return solve_batch_split(models, global_batch_size, max_batch_sizes=caps, min_batch_size=0).per_replica_batch_sizes
