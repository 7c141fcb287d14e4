"""The Balancer's guard trials (starting one, serving it, feeding it the measured steps, acting on its verdict) and
its check of a plan against the fastest card alone, measured side by side in one more trial (pure).

Part of :class:`hetero_cs.planning.balancer.Balancer` (a base class of it, in its own module for size). A solved plan
that differs from the plan in force is tried against it (:class:`~hetero_cs.planning.guard.PlanGuard`): the guard says
which of the two each training batch runs, compares the paired makespans and keeps the candidate only if it measured
faster; a refuted re-plan restores the cost models the plan in force was made with.

**The fastest card alone.** The first question a user with one new card beside old ones asks is whether all of
them beat the new card alone. The solver already answers it on the cost models (it leaves a card out wherever that
is predicted faster), but the models are a prediction, made from each card timed on its own: cards that run
together contend for the host (its cores, PCIe lanes behind one switch, host memory bandwidth), a card calibrated on
a busy host or one that slows down can make a plan that spreads the batch slower than its fastest card alone. So
the guard measures the two side by side in one more trial (:mod:`hetero_cs.planning.guard`, item 4) when the plan in
force, a plan that uses two cards or more,

* measures slower than its prediction by more than the noise margin (``GuardPolicy.alone_check_margin``, or
  ``noise_sigmas`` standard errors of the measured median, whichever is larger): the predictions do not hold here,
  and that the plan beats the card alone was one of them; or
* measures slower than the fastest card's predicted time alone (by more than the measurement's noise); or
* is predicted less than ``GuardPolicy.alone_check_below`` times faster than the fastest card alone (off by
  default: a plan whose prediction holds needs no measurement).

"Measures" is the median makespan of the replicas (the span the cost models predict) over the monitor's window
steps that ran the plan's slices, at least the re-balancer's ``min_samples`` of them. Kept, the fastest card runs
the whole batch and the others sit idle (the idle probes and the re-planner bring them back when they help);
reverted, the plan stays, with no back-off.

Each plan in force is checked at most once per set of cost models (a check that was interrupted, by fixed shares set
mid-trial for example, runs again later): a re-plan that the guard keeps may be checked again, a reverted one is not
(the plan in force did not change). No check runs right after the guard measured that very split (the card alone)
slower. The re-planner looks first: a plan that a drifting card made slow is re-planned, not checked.

This module imports neither TensorFlow nor pynvml.
"""

import logging
import math

import numpy as np

from hetero_cs.planning.choice import _violates
from hetero_cs.planning.cost_model import ScaledCostModel
from hetero_cs.planning.plan import BatchPlan, even_batch_split
from hetero_cs.planning.robust_stats import median_and_error
from hetero_cs.planning.solver import plan_from_split

logger = logging.getLogger("hetero_cs.planning.balancer")


class GuardTrials:
    """Methods of :class:`~hetero_cs.planning.balancer.Balancer` (which holds the state they use, under its lock)."""

    def _adopt(self, plan: BatchPlan, *, trial: bool) -> None:
        """Makes ``plan`` the plan, through a guard trial when asked and it differs from the plan in force."""
        # The plan it replaces: the plan in force for its global batch, else the even split.
        B = plan.global_batch_size
        in_force = self._plan is not None and self._plan.global_batch_size == B
        split = self._plan.per_replica_batch_sizes if in_force else even_batch_split(B, self._num_replicas)
        incumbent = plan_from_split(split, self._cost_models)
        if (trial and self.guard_enabled and incumbent.per_replica_batch_sizes != plan.per_replica_batch_sizes
                and not _violates(incumbent.per_replica_batch_sizes, self._max_batch_sizes)):
            self._commit(incumbent)
            self._start_trial(incumbent, plan)
        else:
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

    def serve_again(self) -> None:
        """Makes the next training ``serve`` of the same size return the plan served last, as it was, and move
        nothing else (no trial's turn, no probe, no look): a global batch retried on the same plan after a device
        error (:mod:`hetero_cs.engine.faults.failover`). During a guard trial the next batch would otherwise get the
        trial's other plan, and a card that fails on one of them only would never fail twice in one batch."""
        with self._lock:
            self._again = self._last_served

    def _serve_trial(self) -> BatchPlan:
        """The side of the running trial to serve next; the candidate, kept unmeasured, when no step of the trial
        was timed after 3 x ``max_trial_steps`` batches."""
        self._trial_served += 1
        if self._trial_served > 3 * self._guard.policy.max_trial_steps and self._guard.observed_steps == 0:
            logger.warning("hetero_cs guard: no step of the trial was timed after %d batches (a custom loop without a "
                           "Keras optimizer is not timed); keeping %s unmeasured.", self._trial_served,
                           list(self._guard.candidate.per_replica_batch_sizes))
            candidate = self._guard.candidate
            self._guard.abandon()
            self._models_before_replan = None
            self._commit(candidate)
            return candidate
        return self._guard.plan_to_serve()

    def _observe_trial(self, completed: int) -> None:
        """Feeds the running trial the steps measured since the last call, and acts on its decision."""
        for sample in (s for s in self._monitor.window() if s.step > self._observed_step):
            self._observed_step = sample.step
            decision = self._guard.observe(sample.per_replica_batch_sizes, sample.makespan_s, step=completed)
            if decision is None:
                continue
            restored, self._models_before_replan = self._models_before_replan, None
            if decision.kept:
                self._commit(self._plan_of(decision.candidate_per_replica_batch_sizes))
            elif restored is not None:  # refuted models: back to those the plan in force was made with
                self._cost_models = restored  # (_commit drops the plans of other sizes)
                self._commit(plan_from_split(self._plan.per_replica_batch_sizes, restored,
                                             max_batch_sizes=self._max_batch_sizes))
            if decision.against_alone:  # checked, kept or not: not checked again under these models
                self._alone_checked.add(decision.incumbent_per_replica_batch_sizes)
            elif decision.kept:
                self._alone_checked.clear()  # a kept re-plan's measured models are new models: every plan checked again
            self._maybe_check_alone()  # the plan now in force, against the fastest card alone
            return

    def _alone_models(self) -> list:
        """The cost models of each card stepping alone: its model over its contention factor."""
        return [m if f == 1.0 else ScaledCostModel(m, 1.0 / f)
                for m, f in zip(self._cost_models, self._contention_factors)]

    def _plan_of(self, sizes) -> BatchPlan:
        """The plan of these slices with its predicted times: a card that works alone does not contend."""
        alone = sum(1 for b in sizes if b > 0) == 1
        return plan_from_split(sizes, self._alone_models() if alone else self._cost_models,
                               max_batch_sizes=self._max_batch_sizes)

    def fastest_alone_plan(self, global_batch_size: int) -> BatchPlan | None:
        """The whole global batch on the card predicted fastest alone, among those whose memory cap holds it.

        A card alone does not contend with others for the host: its predicted time is its cost model's over its
        contention factor (``set_cost_models(..., contention_factors=...)``).

        Returns:
            The plan (one replica with ``global_batch_size`` examples, the rest idle) with its predicted step times,
            or None before cost models exist or when no card's cap holds the whole batch.
        """
        with self._lock:
            if self._cost_models is None:
                return None
            caps = self._max_batch_sizes or [None] * self._num_replicas
            B = int(global_batch_size)
            if not (holding := [i for i in range(self._num_replicas) if caps[i] is None or caps[i] >= B]):
                return None
            alone = self._alone_models()
            fastest = min(holding, key=lambda i: (alone[i].predict_step_time_s(B), i))
            return self._plan_of([B if i == fastest else 0 for i in range(self._num_replicas)])

    def _maybe_check_alone(self) -> None:
        """Starts a guard trial of the fastest card alone against the plan in force, where it is due (see above)."""
        plan = self._plan
        # Only an engine whose idle replicas run nothing (central storage) gains by leaving cards out.
        if (not self._idle_free or not self.guard_enabled or self._shares is not None or plan is None
                or self._guard.in_trial or plan.global_batch_size != self._reference_batch_size):
            return
        sizes = plan.per_replica_batch_sizes
        if sum(1 for b in sizes if b > 0) < 2 or sizes in self._alone_checked:
            return
        alone = self.fastest_alone_plan(plan.global_batch_size)
        plan_s, alone_s = plan.predicted_makespan_s, None if alone is None else alone.predicted_makespan_s
        last = self._guard.last_decision
        if (alone_s is None or alone.per_replica_batch_sizes == sizes or plan_s is None or not plan_s > 0
                # The guard has just measured that very split slower: no second trial of it (its back-off stands).
                or (last is not None and not last.kept
                    and last.candidate_per_replica_batch_sizes == alone.per_replica_batch_sizes)):
            self._alone_checked.add(sizes)  # nothing to check for this plan under these models
            return
        if (why := self._alone_check_reason(sizes, plan_s, alone_s)) is None:
            return  # not due now; later steps may measure it slower
        logger.info("hetero_cs guard: %s %s (replica %d alone); measuring both side by side", list(sizes), why,
                    alone.per_replica_batch_sizes.index(plan.global_batch_size))
        self._start_trial(plan, alone, against_alone=True)

    def _alone_check_reason(self, sizes: tuple[int, ...], plan_s: float, alone_s: float) -> str | None:
        """Why the plan of ``sizes`` (predicted ``plan_s``) is due a check against the card alone (predicted
        ``alone_s``), or None."""
        policy = self._guard.policy
        if alone_s / plan_s < policy.alone_check_below:
            return (f"is predicted at {alone_s / plan_s:.3f}x the fastest card alone's speed (below "
                    f"GuardPolicy.alone_check_below={policy.alone_check_below:g})")
        if math.isinf(policy.alone_check_margin):
            return None
        # Measured: the replicas' median makespan over the window's steps that ran ``sizes``, and the relative
        # standard error of that median (robust_stats.median_and_error, as the monitor's noise margin).
        times = np.array([s.replica_makespan_s for s in self._monitor.window() if s.per_replica_batch_sizes == sizes])
        if times.size < self._rebalance_policy.min_samples:  # (min_samples >= 1)
            return None
        (median_s, error), n = median_and_error(times), times.size
        noise = self._rebalance_policy.noise_sigmas * error
        if median_s > alone_s * (1.0 + noise):
            return (f"measured {median_s * 1e3:.3f} ms a step (median of {n}), slower than the fastest card's "
                    f"predicted {alone_s * 1e3:.3f} ms alone")
        if median_s > plan_s * (1.0 + max(policy.alone_check_margin, noise)):
            return (f"measured {median_s * 1e3:.3f} ms a step (median of {n}), {median_s / plan_s:.3f}x its "
                    f"predicted {plan_s * 1e3:.3f} ms: the predictions do not hold here")
        return None
