"""The guard's side-by-side trial of an overlapped micro-batched plan against the plan it would replace.

An overlapped micro-batched plan (:mod:`hetero_cs.engine.memory.micro_batches`) is chosen over the plan it replaces - the
one step within the caps when it fits, else sub-steps with a barrier each - when it is *predicted* 2 % faster. The
prediction prices each micro-batch at the card's calibrated step time and the host's work from the last calls; a
card whose fixed cost per step is mis-measured, or a host slower at dispatching one large traced call, can make the
prediction wrong, and the user would train slower than the simpler plan without knowing it.

So, with the guard on, the first time a global batch size gets an overlapped plan under a set of cost models, both
plans are served side by side with the guard's own rules (:class:`hetero_cs.planning.guard.PlanGuard`: the pattern
candidate, candidate, incumbent; paired wall times of whole steps, host work included; early decisions, the
Wilcoxon test, the candidate's first step a warm-up). Kept, the overlapped plan runs from then on; reverted, the
plan it would have replaced does, until the cost models or caps change (a re-plan, new calibration), which starts
a new trial. Every step of either plan is exact, so a trial costs time only.
"""

import logging
import threading

from hetero_cs.planning.guard import GuardPolicy, PlanGuard
from hetero_cs.planning.micro_batches import MicroBatchPlan
from hetero_cs.planning.plan import BatchPlan

logger = logging.getLogger("hetero_cs.engine.central_storage")

_MAX_KEYS = 64  # verdicts kept (one per global batch size and set of cost models and caps)


class OverlapTrials:
    """Trials and verdicts of overlapped plans, per (global batch size, cost models, caps). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._trials: dict = {}  # key -> (PlanGuard, candidate MicroBatchPlan, incumbent MicroBatchPlan)
        self._verdicts: dict = {}  # key -> True (the overlapped plan measured faster) or False
        self._served: tuple | None = None  # (key, the plan served for the step running now)
        self._pinned: dict = {}  # key -> the objects whose ids it holds
        self._observed = 0
        self.decisions: list = []  # every GuardDecision, oldest first

    def choose(self, key, overlapped: MicroBatchPlan, incumbent: MicroBatchPlan, policy: GuardPolicy, *,
               pin=None) -> MicroBatchPlan:
        """The plan to run the next step with: the overlapped plan, or during a trial the pattern's plan, or after a
        revert the incumbent. ``pin``: objects whose ids are in ``key`` (the cost models), kept alive with it so
        that no other object takes their ids while the verdict stands."""
        with self._lock:
            self._pinned[key] = pin
            verdict = self._verdicts.get(key)
            if verdict is not None:
                self._served = None
                return overlapped if verdict else incumbent
            entry = self._trials.get(key)
            if entry is None:
                B = overlapped.global_batch_size
                if overlapped.per_replica_batch_sizes == incumbent.per_replica_batch_sizes:
                    self._remember(key, True)  # nothing to tell apart by the slices: as predicted
                    return overlapped
                guard = PlanGuard(policy, quiet=True)  # one trial per key, logged here (no back-off applies)
                guard.start(BatchPlan(incumbent.per_replica_batch_sizes, B),
                            BatchPlan(overlapped.per_replica_batch_sizes, B), step=self._observed)
                logger.info(
                    "hetero_cs guard: trying the micro-batched plan %s (each card's micro-batches back to back, "
                    "predicted %.1f ms) against %s (predicted %.1f ms), side by side.",
                    list(overlapped.per_replica_batch_sizes), (overlapped.predicted_makespan_s or 0) * 1e3,
                    _describe(incumbent), (incumbent.predicted_makespan_s or 0) * 1e3)
                entry = self._trials[key] = (guard, overlapped, incumbent)
            guard, candidate, old = entry
            plan = candidate if guard.plan_to_serve() is guard.candidate else old
            self._served = (key, plan)
            return plan

    def observe(self, plan: MicroBatchPlan, seconds: float, *, as_planned: bool) -> None:
        """The step served by :meth:`choose` took ``seconds`` (wall clock, host work included); ``as_planned`` is
        False when it ran otherwise (a failed overlapped call re-run with barriers, a refusal): not a sample."""
        with self._lock:
            key, served = self._served or (None, None)
            self._served = None
            if served is not plan or key not in self._trials:
                return
            guard, candidate, incumbent = self._trials[key]
            self._observed += 1
            sizes = plan.per_replica_batch_sizes if as_planned else ()
            decision = guard.observe(sizes, seconds if as_planned else float("nan"), step=self._observed)
            if decision is None:
                return
            del self._trials[key]
            self.decisions.append(decision)
            self._remember(key, decision.kept)
            logger.info(
                "hetero_cs guard: the micro-batched plan %s %s: its steps took %.3f of %s's (median over %d "
                "pairs); %s from now on, until the cost models or caps change.",
                list(candidate.per_replica_batch_sizes), decision.outcome, decision.median_ratio,
                _describe(incumbent), decision.num_pairs,
                "it runs" if decision.kept else f"{_describe(incumbent)} runs")

    def _remember(self, key, verdict: bool) -> None:
        if len(self._verdicts) >= _MAX_KEYS:
            self._verdicts.pop(oldest := next(iter(self._verdicts)))
            if oldest not in self._trials:
                self._pinned.pop(oldest, None)
        self._verdicts[key] = verdict


def _describe(plan: MicroBatchPlan) -> str:
    return (f"one step {list(plan.per_replica_batch_sizes)}" if plan.num_sub_steps == 1
            else f"{plan.num_sub_steps} sub-steps with a barrier each")
