"""The Balancer's check of a plan against the fastest card alone, measured side by side (pure).

Part of :class:`hetero_cs.planning.balancer.Balancer` (a base class of it, in its own module for size). The first
question a user with one new card beside old ones asks is whether all of them beat the new card alone. The solver
already answers it on the cost models (it leaves a card out wherever that is predicted faster), but the models are
a prediction: a card calibrated on a busy host, or one that slows down, can make a plan that spreads the batch
slower than its fastest card alone. So when the guard has decided on a plan that uses two cards or more, and that
plan is predicted less than ``GuardPolicy.alone_check_below`` times faster than the fastest card alone, the guard
measures the two side by side in one more trial (:mod:`hetero_cs.planning.guard`, item 4). Kept, the fastest card
runs the whole batch and the others sit idle (the idle probes and the re-planner bring them back when they help);
reverted, the plan stays, with no back-off.

Each plan in force is checked once per set of cost models (a check that was interrupted, by fixed shares set
mid-trial for example, runs again later): a re-plan that the guard keeps is checked again, a reverted one is not
(the plan in force did not change). No check runs where the models predict the plan in force slower than the
fastest card alone (a measurement overruled them: a reverted trial), nor right after the guard measured that very
split slower. This module imports neither TensorFlow nor pynvml.
"""

from __future__ import annotations

import logging

from hetero_cs.planning.plan import BatchPlan
from hetero_cs.planning.solver import plan_from_split

logger = logging.getLogger("hetero_cs.planning.balancer")


class AloneCheck:
    """Methods of :class:`~hetero_cs.planning.balancer.Balancer` (which holds the state they use, under its lock)."""

    def _init_alone_check(self) -> None:
        self._alone_checked: set[tuple[int, ...]] = set()  # splits in force checked under the current models

    def _forget_alone_checks(self) -> None:
        """New cost models: every plan may be checked again."""
        self._alone_checked.clear()

    def fastest_alone_plan(self, global_batch_size: int) -> BatchPlan | None:
        """The whole global batch on the card predicted fastest alone, among those whose memory cap holds it.

        Returns:
            The plan (one replica with ``global_batch_size`` examples, the rest idle) with its predicted step times,
            or None before cost models exist or when no card's cap holds the whole batch.
        """
        with self._lock:
            models = self._cost_models
            if models is None:
                return None
            caps = self._max_batch_sizes or [None] * self._num_replicas
            B = int(global_batch_size)
            holding = [i for i in range(self._num_replicas) if caps[i] is None or caps[i] >= B]
            if not holding:
                return None
            fastest = min(holding, key=lambda i: (models[i].predict_step_time_s(B), i))
            split = [0] * self._num_replicas
            split[fastest] = B
            return plan_from_split(split, models, max_batch_sizes=self._max_batch_sizes)

    def _maybe_check_alone(self) -> None:
        """Starts a guard trial of the fastest card alone against the plan in force, where it is due (see above)."""
        plan = self._plan
        if (
            # Only an engine whose idle replicas run nothing (central storage) gains by leaving cards out.
            not self._idle_free or not self.guard_enabled or self._shares is not None or plan is None
            or self._guard.in_trial
            or plan.global_batch_size != self._reference_batch_size
        ):
            return
        sizes = plan.per_replica_batch_sizes
        if sum(1 for b in sizes if b > 0) < 2 or sizes in self._alone_checked:
            return
        alone = self.fastest_alone_plan(plan.global_batch_size)
        plan_s = plan.predicted_makespan_s
        alone_s = None if alone is None else alone.predicted_makespan_s
        last = self._guard.last_decision
        if (
            alone is None or alone.per_replica_batch_sizes == sizes or plan_s is None or alone_s is None
            or not plan_s > 0
            # The guard has just measured that very split slower: no second trial of it (its back-off stands).
            or (last is not None and not last.kept
                and last.candidate_per_replica_batch_sizes == alone.per_replica_batch_sizes)
        ):
            self._alone_checked.add(sizes)  # nothing to check for this plan under these models
            return
        predicted_speedup = alone_s / plan_s
        # Below 1 the models prefer the card alone, yet the plan in force is another: a measurement overruled them
        # (a reverted trial), and the models are not evidence for another trial.
        if not 1.0 <= predicted_speedup < self._guard.policy.alone_check_below:
            self._alone_checked.add(sizes)
            return
        logger.info(
            "hetero_cs guard: %s is predicted %.3fx faster than the fastest card alone (replica %d); measuring "
            "both side by side", list(sizes), predicted_speedup, alone.per_replica_batch_sizes.index(
                plan.global_batch_size),
        )
        self._start_trial(plan, alone, against_alone=True)
