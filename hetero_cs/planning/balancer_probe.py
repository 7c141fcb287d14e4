"""The Balancer's probes of idle cards: a card the plan left out is timed on one example now and then (pure).

Part of :class:`hetero_cs.planning.balancer.Balancer` (a base class of it, in its own module for size). A card that a
solved plan leaves idle (its fixed cost per step is more than the others need for the whole batch, or it drifted
far slower) has no step times in the monitor's window, so nothing would tell the re-planner that it became fast
again. Every ``PROBE_INTERVAL_STEPS`` served training batches, one step gives such a card one example, taken from the
largest slice, and is timed. Its time updates that card's cost model (the monitor keeps the last measured speed of
an idle card); when the card is fast again the re-planner proposes a plan that uses it, which the guard tries as
any re-plan. A probe costs one step of one example on the card: for a card 50x slower than calibrated, about 50x
its fixed cost per step, once per interval. This module imports neither TensorFlow nor pynvml.
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

    def probed_replicas(self, sizes) -> list[int]:
        """The replicas that probes of a plan with these slices may give one example: its idle cards whose cap
        is not 0, where probes run (re-balancing on, no fixed shares); none otherwise."""
        with self._lock:
            if not (self.rebalance_enabled and self._shares is None and self.timing_needed) \
                    or sum(sizes) < self._num_replicas:
                return []
            caps = self._max_batch_sizes or [None] * self._num_replicas
            return [i for i, b in enumerate(sizes) if b == 0 and caps[i] != 0]

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
        if not (self.rebalance_enabled and self._shares is None and self.timing_needed) \
                or plan.global_batch_size < self._num_replicas or 0 not in sizes:
            return plan
        caps = self._max_batch_sizes or [None] * self._num_replicas
        due = [i for i, b in enumerate(sizes) if b == 0 and caps[i] != 0
               and served - self._last_worked[i] >= PROBE_INTERVAL_STEPS]
        if not due:
            return plan
        replica = min(due, key=lambda i: self._last_worked[i])
        donor = max(range(len(sizes)), key=lambda i: sizes[i])
        probe = list(sizes)
        probe[replica], probe[donor] = 1, probe[donor] - 1
        logger.info("hetero_cs: probing replica %d, idle for %d steps, with 1 example: %s (the plan in force is %s).",
                    replica, served - self._last_worked[replica], probe, list(sizes))
        self._last_worked[replica] = served
        self._probe_due = True
        self._probes += 1
        return plan_from_split(probe, self._cost_models, max_batch_sizes=self._max_batch_sizes)
