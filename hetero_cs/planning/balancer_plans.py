"""The plans the Balancer serves beside the plan it solved for training: fixed shares, evaluation and prediction
batches, and probes of idle cards (pure).

Part of :class:`hetero_cs.planning.balancer.Balancer` (a base class of it, in its own module for size).

**Fixed shares** (:meth:`OtherPlans.set_batch_split`): set them, or go back to the auto-balanced plan that was in
force.

**Evaluation and prediction batches** (:meth:`OtherPlans.plan_for_inference`), kept apart from training's plans. An
inference step (``evaluate``, ``predict``, a validation pass inside ``fit``) needs its batch cut too, but it must not
touch what training's plan lifecycle owns: the reference size whose plan is :attr:`Balancer.plan`, the plans in
force, a guard trial, the re-balancer's look. Before these plans existed, a validation batch larger than the training
batch became the reference size, and every later training batch was then solved afresh as a "partial" batch: a
plan the guard had reverted came back, re-plans applied unguarded, and ``strategy.plan`` showed the validation
plan. Memory caps bound a *training* step: its slice keeps every activation for the backward pass, and holds the
gradients. An inference step keeps neither, so a batch the training caps cannot hold is split without them rather
than refused (the split within the caps is used whenever there is one).

**Probes of idle cards**: cards the plan left out are timed on one example now and then. A card that a solved plan
leaves idle (its fixed cost per step is more than the others need for the whole batch, or it drifted far slower)
has no step times in the monitor's window, so nothing would tell the re-planner that it became fast again. Every
``PROBE_INTERVAL_STEPS`` served training batches, each such card is probed on one example. Its time updates the
card's cost model (the monitor keeps the last measured speed of an idle card); when a card is fast again the
re-planner proposes a plan that uses it, which the guard tries as any re-plan.

Where the engine can (central storage, with the model it calibrated), the probe runs off the step's path
(``Balancer(idle_prober=...)``): a step of its own on the idle card, beside training, with no update and no change
to any variable (:mod:`hetero_cs.engine.idle_probes`), so training steps neither wait for the probed card nor
change their set of active replicas. Otherwise (several machines; no model calibrated yet; a custom loop, or ``fit``
with ``steps_per_execution`` above 1 or micro-batches, before the card's probe step was traced in ``fit``) the step
served gives every idle card one example, taken from the largest slices, and is timed: it lasts as long as the
slowest probed card takes for one example (for a card 50x slower than calibrated, about 50x its fixed cost per step),
once per interval. Probing every idle card in the same step makes such a step use every card, whose branch every
step has (:mod:`hetero_cs.engine.step.idle_replicas`).

This module imports neither TensorFlow nor pynvml.
"""

import logging
from collections.abc import Sequence

from hetero_cs.errors import BatchSplitError, InfeasiblePlanError
from hetero_cs.planning.plan import BatchPlan, _checked_global_batch_size, ordered_values, split_by_shares
from hetero_cs.planning.solver import plan_from_split

logger = logging.getLogger("hetero_cs.planning.balancer")  # the messages users filter on

PROBE_INTERVAL_STEPS = 40
"""Served training batches between two probes of a card the plan leaves idle."""


class OtherPlans:
    """Methods of :class:`~hetero_cs.planning.balancer.Balancer` (which holds the state they use, under its lock)."""

    def set_batch_split(self, shares: Sequence[float] | None) -> None:
        """Fixes the relative shares (one per replica) from now on; None returns to auto-balance / even.

        Returning to auto-balance restores the plan that was in force before the shares were set (a plan the guard
        kept or reverted to stays as it was) when the global batch is the same; otherwise the split is solved anew.
        A failure (e.g. shares the split cannot use) leaves everything as it was.

        Examples:
            >>> from hetero_cs.planning.balancer import Balancer
            >>> balancer = Balancer(3, rebalance=False, guard=False)
            >>> balancer.plan_for(12).per_replica_batch_sizes
            (4, 4, 4)
            >>> balancer.set_batch_split([2, 1, 1])
            >>> balancer.plan.per_replica_batch_sizes
            (6, 3, 3)
        """
        if shares is not None:
            split_by_shares(0, shares)  # BatchSplitError for values that are not shares
            shares = list(ordered_values(shares))
            if len(shares) != self._num_replicas:
                raise BatchSplitError(f"shares must hold one share per replica ({self._num_replicas}). Received: "
                                      f"{len(shares)} shares {shares!r}.")
        with self._lock:
            if shares is None and self._shares is None:
                return  # already auto-balanced (or even): nothing changes, a running trial goes on
            shares = None if shares is None else tuple(float(s) for s in shares)
            B, restored = self._reference_batch_size, self._auto_plan if shares is None else None
            if restored is not None and restored.global_batch_size != B:
                restored = None  # the auto-balanced plan of another global batch: solved anew
            # Solved before anything changes, so a failure leaves everything as it was.
            plan = restored if restored is not None or B is None else self._solve(B, shares=shares)
            if shares is not None and self._shares is None:
                self._auto_plan = self._plan  # the plan to come back to
            elif restored is not None:
                self._auto_plan = None
            self._shares = shares
            self._forget_plans()
            if plan is not None:
                self._commit(plan)

    def plan_for_inference(self, global_batch_size: int) -> BatchPlan:
        """The plan to cut an evaluation or prediction batch of ``global_batch_size`` examples with.

        It changes nothing of training's plan lifecycle (reference size, plan in force, guard, re-balancer). A batch
        of the reference size gets the plan in force (during a guard trial, the incumbent); any other size the split
        chosen as for training (fixed shares, even, or solved from the cost models) within the memory caps, or
        without them when they cannot hold it. Plans are kept per size until the plan in force, the models, the
        shares or the caps change.

        Raises:
            ConfigError: ``global_batch_size`` is not an integer >= 1.

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
        b = _checked_global_batch_size(global_batch_size, allow_zero=False)
        with self._lock:
            if self._plan is not None and self._plan.global_batch_size == b:
                return self._plan
            if b in self._inference_plans:
                return self._inference_plans[b]
            try:
                plan = self._solve(b, log_ties=False)
            except InfeasiblePlanError:
                # A card with a cap of 0 stays out (set aside for a device error, or unable to hold one training
                # example: inference may not fit either); the other caps are lifted.
                out = set(self._memory.excluded) | {i for i, cap in enumerate(self._max_batch_sizes or ()) if cap == 0}
                caps = [0 if i in out else None for i in range(self._num_replicas)] if out else None
                plan = self._solve(b, log_ties=False, max_batch_sizes=caps)
                logger.info(
                    "hetero_cs: an evaluation/prediction batch of %d examples is more than the training memory caps %s "
                    "hold; it is split %s without them (an inference step keeps no activations for a backward pass).",
                    b, list(self._max_batch_sizes), list(plan.per_replica_batch_sizes))
            self._inference_plans[b] = plan
            return plan

    @property
    def probes(self) -> int:
        """How many times the cards the plan left idle were due a probe so far (beside training, a card whose last
        probe still runs is not probed again)."""
        return self._probes

    def _maybe_probe(self, plan: BatchPlan) -> BatchPlan:
        """``plan`` (the plan in force for a full training batch, outside a guard trial), or a probe of it."""
        sizes = plan.per_replica_batch_sizes
        served = self._served
        for i, b in enumerate(sizes):
            if b > 0 or i not in self._last_worked:
                self._last_worked[i] = served
        if not self.rebalance_enabled or plan.global_batch_size < self._num_replicas or 0 not in sizes:
            return plan
        caps = self._max_batch_sizes or [None] * self._num_replicas
        idle = [i for i, b in enumerate(sizes) if b == 0 and caps[i] != 0]
        if not any(served - self._last_worked[i] >= PROBE_INTERVAL_STEPS for i in idle):
            return plan
        for i in idle:
            self._last_worked[i] = served
        self._probes += 1
        if self._idle_prober is not None and self._idle_prober(idle):
            logger.info("hetero_cs: probing idle replica(s) %s with 1 example each, beside training (the plan in "
                        "force is %s).", idle, list(sizes))
            return plan
        probe = list(sizes)
        for i in idle:
            donor = max(range(len(probe)), key=lambda j: probe[j])
            probe[i], probe[donor] = 1, probe[donor] - 1
        logger.info("hetero_cs: probing idle replica(s) %s with 1 example each: %s (the plan in force is %s).",
                    idle, probe, list(sizes))
        self._probe_due = True
        return plan_from_split(probe, self._cost_models, max_batch_sizes=self._max_batch_sizes)
