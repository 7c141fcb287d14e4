"""The Balancer's guard trials: starting one, serving it, feeding it the measured steps, acting on its verdict (pure).

Part of :class:`hetero_cs.planning.balancer.Balancer` (a base class of it, in its own module for size). A solved plan
that differs from the plan in force is tried against it (:class:`~hetero_cs.planning.guard.PlanGuard`): the guard says
which of the two each training batch runs, compares the paired makespans and keeps the candidate only if it measured
faster; a refuted re-plan restores the cost models the plan in force was made with. This module imports neither
TensorFlow nor pynvml.
"""

from __future__ import annotations

import logging

from hetero_cs.planning.choice import _violates
from hetero_cs.planning.plan import BatchPlan, even_batch_split
from hetero_cs.planning.solver import plan_from_split

logger = logging.getLogger("hetero_cs.planning.balancer")


class GuardTrials:
    """Methods of :class:`~hetero_cs.planning.balancer.Balancer` (which holds the state they use, under its lock)."""

    def _adopt(self, plan: BatchPlan, *, trial: bool) -> None:
        """Makes ``plan`` the plan, through a guard trial when asked and it differs from the plan in force."""
        incumbent = self._incumbent_for(plan)
        if (
            trial and self.guard_enabled and incumbent is not None
            and incumbent.per_replica_batch_sizes != plan.per_replica_batch_sizes
            and not _violates(incumbent.per_replica_batch_sizes, self._max_batch_sizes)
        ):
            self._commit(incumbent)
            self._start_trial(incumbent, plan)
            return
        self._commit(plan)

    def _start_trial(self, incumbent: BatchPlan, candidate: BatchPlan, *, against_alone: bool = False) -> None:
        """Starts a guard trial of ``candidate`` against ``incumbent``, the plan in force."""
        self._trial_served = 0
        # Steps measured before the trial belong to neither side of it.
        self._observed_step = max([self._observed_step, *(s.step for s in self._monitor.window())])
        recent = [sample.makespan_s for sample in self._monitor.window()
                  if tuple(sample.per_replica_batch_sizes) == incumbent.per_replica_batch_sizes][-5:]
        self._guard.start(incumbent, candidate, step=self._monitor.completed_steps, against_alone=against_alone,
                          incumbent_recent_s=sorted(recent)[len(recent) // 2] if recent else None)
        if self._on_trial is not None:
            self._on_trial(candidate)

    def _incumbent_for(self, plan: BatchPlan) -> BatchPlan | None:
        """The plan a candidate for ``plan.global_batch_size`` replaces: the plan in force, else the even split."""
        B = plan.global_batch_size
        if self._plan is not None and self._plan.global_batch_size == B:
            return plan_from_split(self._plan.per_replica_batch_sizes, self._cost_models)
        return plan_from_split(even_batch_split(B, self._num_replicas), self._cost_models)

    def _serve_trial(self) -> BatchPlan:
        """The side of the running trial to serve next; the candidate, kept unmeasured, when no step of the trial
        was timed after 3 x ``max_trial_steps`` batches."""
        self._trial_served += 1
        if self._trial_served > 3 * self._guard.policy.max_trial_steps and self._guard.observed_steps == 0:
            logger.warning(
                "hetero_cs guard: no step of the trial was timed after %d batches (a custom loop without "
                "a Keras optimizer is not timed); keeping %s unmeasured.",
                self._trial_served, list(self._guard.candidate.per_replica_batch_sizes),
            )
            candidate = self._guard.candidate
            self._guard.abandon()
            self._models_before_replan = None
            self._commit(candidate)
            return candidate
        return self._guard.plan_to_serve()

    def _observe_trial(self, completed: int) -> None:
        """Feeds the running trial the steps measured since the last call, and acts on its decision."""
        for sample in self._monitor.window():
            if sample.step <= self._observed_step:
                continue
            self._observed_step = sample.step
            decision = self._guard.observe(sample.per_replica_batch_sizes, sample.makespan_s, step=completed)
            if decision is None:
                continue
            restored, self._models_before_replan = self._models_before_replan, None
            if decision.kept:
                self._commit(self._plan_of(decision.candidate_per_replica_batch_sizes))
            elif restored is not None:  # refuted models: back to those the plan in force was made with
                self._cost_models = restored
                self._plans_by_batch.clear()
                self._commit(plan_from_split(self._plan.per_replica_batch_sizes, restored,
                                             max_batch_sizes=self._max_batch_sizes))
            if decision.against_alone:  # checked, kept or not: not checked again under these models
                self._alone_checked.add(decision.incumbent_per_replica_batch_sizes)
            elif decision.kept:
                self._forget_alone_checks()  # a kept re-plan's measured models are new models
            self._maybe_check_alone()  # the plan now in force, against the fastest card alone
            return
