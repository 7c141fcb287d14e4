"""The planning layer: pure Python, NumPy and SciPy; no TensorFlow, Keras or NVML (a test enforces this).

``cost_model`` (per-replica step-time curves) -> ``solver`` (the minimum-makespan integer split) -> ``plan`` (the
frozen ``BatchPlan``) -> ``monitor`` (per-replica step times during training) -> ``rebalance`` (when to re-plan)
and ``guard`` (keep a new plan only if it measured faster) -> ``balancer`` (the plan lifecycle that owns them all,
used by every engine). ``simulation`` drives the loop with synthetic step times.
"""

from hetero_cs.planning.cost_model import (CostModel, IdleFreeCostModel, LinearCostModel, MicroBatchedCostModel,
                                           PiecewiseLinearCostModel, ScaledCostModel)
from hetero_cs.planning.micro_batches import MicroBatchPlan, plan_micro_batches, plan_overlapped_micro_batches
from hetero_cs.planning.monitor import StepTimeMonitor
from hetero_cs.planning.plan import BatchPlan, even_batch_split, split_by_shares
from hetero_cs.planning.rebalance import RebalancePolicy, Rebalancer
from hetero_cs.planning.solver import ideal_makespan_s, plan_from_split, solve_batch_split

__all__ = ["BatchPlan", "CostModel", "IdleFreeCostModel", "LinearCostModel", "MicroBatchPlan", "MicroBatchedCostModel",
           "PiecewiseLinearCostModel", "RebalancePolicy", "Rebalancer", "ScaledCostModel", "StepTimeMonitor",
           "even_batch_split", "ideal_makespan_s", "plan_micro_batches", "plan_overlapped_micro_batches",
           "plan_from_split", "solve_batch_split", "split_by_shares"]
