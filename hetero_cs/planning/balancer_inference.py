"""The Balancer's plans for evaluation and prediction batches, kept apart from training's (pure).

Part of :class:`hetero_cs.planning.balancer.Balancer` (a base class of it, in its own module for size). An
inference step (``evaluate``, ``predict``, a validation pass inside ``fit``) needs its batch cut too, but it must not
touch what training's plan lifecycle owns: the reference size whose plan is :attr:`Balancer.plan`, the plans in
force, a guard trial, the re-balancer's look. Before these plans existed, a validation batch larger than the training
batch became the reference size, and every later training batch was then solved afresh as a "partial" batch: a
plan the guard had reverted came back, re-plans applied unguarded, and ``strategy.plan`` showed the validation
plan.

Memory caps bound a *training* step: its slice keeps every activation for the backward pass, and holds the
gradients. An inference step keeps neither, so a batch the training caps cannot hold is split without them rather
than refused (the split within the caps is used whenever there is one).

This module imports neither TensorFlow nor pynvml.
"""

from __future__ import annotations

import logging

from hetero_cs.errors import InfeasiblePlanError
from hetero_cs.planning.choice import choose_plan
from hetero_cs.planning.plan import BatchPlan, _checked_global_batch_size

logger = logging.getLogger("hetero_cs.planning.balancer")  # the messages users filter on


class InferencePlans:
    """Methods of :class:`~hetero_cs.planning.balancer.Balancer` (which holds the state they use, under its lock).

    Examples:
        >>> from hetero_cs.planning.balancer import Balancer
        >>> from hetero_cs.planning.cost_model import LinearCostModel
        >>> balancer = Balancer(2, rebalance=False, guard=False)
        >>> balancer.set_cost_models([LinearCostModel(0.0, 1e-3)] * 2, max_batch_sizes=[40, 40],
        ...                          reference_batch_size=64)
        >>> balancer.serve(256, training=False).per_replica_batch_sizes   # above the training caps: split anyway
        (128, 128)
        >>> balancer.plan.global_batch_size                                # training's plan is untouched
        64
    """

    def plan_for_inference(self, global_batch_size: int) -> BatchPlan:
        """The plan to cut an evaluation or prediction batch of ``global_batch_size`` examples with.

        It changes nothing of training's plan lifecycle (reference size, plan in force, guard, re-balancer). A batch
        of the reference size gets the plan in force (during a guard trial, the incumbent); any other size the split
        chosen as for training (fixed shares, even, or solved from the cost models) within the memory caps, or
        without them when they cannot hold it. Plans are kept per size until the plan in force, the models, the
        shares or the caps change.

        Raises:
            ConfigError: ``global_batch_size`` is not an integer >= 1.
        """
        b = _checked_global_batch_size(global_batch_size, allow_zero=False)
        with self._lock:
            if self._plan is not None and self._plan.global_batch_size == b:
                return self._plan
            key = (self._plan, self._shares, self._auto_balance, None if self._max_batch_sizes is None
                   else tuple(self._max_batch_sizes), self._cost_models)
            cached_key, plans = self._inference_plans
            if cached_key is None or not _same_key(cached_key, key):
                plans = {}
                self._inference_plans = (key, plans)
            plan = plans.get(b)
            if plan is None:
                plan = plans[b] = self._solve_for_inference(b)
            return plan

    def _solve_for_inference(self, global_batch_size: int) -> BatchPlan:
        arguments = dict(shares=self._shares, auto_balance=self._auto_balance, cost_models=self._cost_models,
                         log_ties=False, idle_free=self._idle_free)
        try:
            return choose_plan(global_batch_size, self._num_replicas, max_batch_sizes=self._max_batch_sizes,
                               **arguments)
        except InfeasiblePlanError:
            # A card with a cap of 0 stays out (set aside for a device error, or unable to hold one training
            # example: inference may not fit either); the other caps are lifted.
            in_force = self._max_batch_sizes or [None] * self._num_replicas
            out = set(self._memory.excluded) | {i for i, cap in enumerate(in_force) if cap == 0}
            caps = [0 if i in out else None for i in range(self._num_replicas)] if out else None
            plan = choose_plan(global_batch_size, self._num_replicas, max_batch_sizes=caps, **arguments)
            logger.info(
                "hetero_cs: an evaluation/prediction batch of %d examples is more than the training memory caps %s "
                "hold; it is split %s without them (an inference step keeps no activations for a backward pass).",
                global_batch_size, list(self._max_batch_sizes), list(plan.per_replica_batch_sizes),
            )
            return plan


def _same_key(a: tuple, b: tuple) -> bool:
    # The cost models are compared by identity: the Balancer replaces the list whenever a model changes.
    return a[:-1] == b[:-1] and a[-1] is b[-1]
