"""The Balancer's probes of idle cards: cards the plan left out are timed on one example now and then (pure).

Part of :class:`hetero_cs.planning.balancer.Balancer` (a base class of it, in its own module for size). A card that a
solved plan leaves idle (its fixed cost per step is more than the others need for the whole batch, or it drifted
far slower) has no step times in the monitor's window, so nothing would tell the re-planner that it became fast
again. Every ``PROBE_INTERVAL_STEPS`` served training batches, one step gives every such card one example, taken
from the largest slices, and is timed. Its time updates each card's cost model (the monitor keeps the last measured
speed of an idle card); when a card is fast again the re-planner proposes a plan that uses it, which the guard tries
as any re-plan. A probe costs one step in which the slowest probed card does one example: for a card 50x slower than
calibrated, about 50x its fixed cost per step, once per interval. Probing every idle card in the same step makes a
probe step use every card, whose branch every step has (:mod:`hetero_cs.engine.step.idle_replicas`): probes never make
a step traced again. This module imports neither TensorFlow nor pynvml.
"""

from __future__ import annotations

import logging

from hetero_cs.planning.plan import BatchPlan
from hetero_cs.planning.solver import plan_from_split

logger = logging.getLogger("hetero_cs.planning.balancer")

PROBE_INTERVAL_STEPS = 40
"""Served training batches between two probes of a card the plan leaves idle."""


class IdleProbes:
    """Methods of :class:`~hetero_cs.planning.balancer.Balancer` (which holds the state they use, under its lock)."""

    def _init_probes(self) -> None:
        self._last_worked: dict[int, int] = {}  # replica -> the served count when it last had examples
        self._probe_due = False  # the batch just served is a probe: time it
        self._probes = 0

    @property
    def probes(self) -> int:
        """How many probe steps were served so far (one example on a card the plan left idle)."""
        return self._probes

    def _take_probe_due(self) -> bool:
        due, self._probe_due = self._probe_due, False
        return due

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
        probe = list(sizes)
        for i in idle:
            donor = max(range(len(probe)), key=lambda j: probe[j])
            probe[i], probe[donor] = 1, probe[donor] - 1
            self._last_worked[i] = served
        logger.info("hetero_cs: probing idle replica(s) %s with 1 example each: %s (the plan in force is %s).",
                    idle, probe, list(sizes))
        self._probe_due = True
        self._probes += 1
        return plan_from_split(probe, self._cost_models, max_batch_sizes=self._max_batch_sizes)
