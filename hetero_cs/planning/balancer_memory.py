"""The Balancer's memory: out-of-memory recovery (lower a replica's cap, re-solve within the caps, grow caps back)
and the watch over micro-batched steps (their times reach the monitor, and drift re-plans them) (pure).

Part of :class:`hetero_cs.planning.balancer.Balancer` (a base class of it, in its own module for size); the cap
policy itself is :class:`hetero_cs.planning.memory_caps.MemoryCaps`. An engine calls :meth:`recover_from_oom`
when a replica's step ran out of memory (then retries the same global batch with the plan it returns) and
:meth:`record_step_success` after each step that completed.

**Micro-batched steps.** A global batch that the memory caps cannot hold in one step (or that runs faster as
micro-batches) is run by the engine as one traced call in which each card runs its micro-batches back to back
(:mod:`hetero_cs.engine.memory.micro_batches`). Such a step is not cut through
:meth:`~hetero_cs.planning.balancer.Balancer.serve`, so without this watch its times would reach nobody: a card that
slowed down would keep its share for the rest of the run.

After each such step the engine reports every card's examples, time and micro-batch count
(:meth:`MemoryRecovery.record_micro_batched_step`). The monitor takes it as one step (its makespan is the
step's), and estimates each card's speed from its mean micro-batch, one step of the card's cost model. Every
``look interval`` steps the re-balance policy (deadband, noise margin, cooldown; :mod:`hetero_cs.planning.rebalance`)
compares the split in use with the split solved under the monitor's models, both priced as micro-batches
(:class:`~hetero_cs.planning.cost_model.MicroBatchedCostModel` within each card's cap). When it would re-plan, the
balancer adopts the monitor's models; the engine's micro-batch plans, solved from the balancer's models, follow at
the next step. There is no guard trial here: the micro-batched split is not served through the guard's pattern,
and the policy's noise margin stands in for it.

The other way round: while steps run as one step within the caps with a card held at its cap (a card that drifted
slower was planned out of its micro-batches), the engine asks before each step
(:meth:`MemoryRecovery.consider_micro_batched_models`). Every look interval, when the monitor's models differ
from those in force by more than the deadband at the slices in use, and a split priced as micro-batches under the
monitor's models beats the step in use by more than the deadband, the balancer takes the monitor's models: the
engine then plans micro-batches again (and the guard tries them side by side before keeping them). So a card that
recovers gets its micro-batches back; the re-planner of one-step plans cannot see that, since the cap holds its
slice where it is.

This module imports neither TensorFlow nor pynvml.
"""

import contextlib
import logging
from collections.abc import Sequence

from hetero_cs._copying import DeepcopiedWithNewLocks
from hetero_cs.errors import InfeasiblePlanError
from hetero_cs.planning.memory_caps import CapChange, MemoryCaps
from hetero_cs.planning.micro_batches import micro_batched_curves, zero_caps
from hetero_cs.planning.plan import BatchPlan
from hetero_cs.planning.rebalance import Rebalancer
from hetero_cs.planning.solver import solve_batch_split

logger = logging.getLogger("hetero_cs.planning.balancer")


class MemoryRecovery(DeepcopiedWithNewLocks):
    """Methods of :class:`~hetero_cs.planning.balancer.Balancer` (which holds the state they use, under its lock).

    Examples:
        >>> from hetero_cs.planning.balancer import Balancer
        >>> from hetero_cs.planning.cost_model import LinearCostModel
        >>> balancer = Balancer(2, rebalance=False, guard=False)
        >>> balancer.set_cost_models([LinearCostModel(0.0, 1e-3)] * 2, reference_batch_size=100)
        >>> balancer.plan.per_replica_batch_sizes
        (50, 50)
        >>> plan, change = balancer.recover_from_oom(1, 50, 100)   # replica 1 ran out of memory at 50 examples
        >>> change.new_cap, plan.per_replica_batch_sizes
        (25, (75, 25))
    """

    @property
    def memory_caps(self) -> MemoryCaps:
        """The memory caps in force (calibrated, lowered by out-of-memory steps, grown back) and their history."""
        return self._memory

    def recover_from_oom(self, replica_id: int, failed_batch_size: int,
                         global_batch_size: int) -> tuple[BatchPlan, CapChange]:
        """After a step ran out of memory on one replica: lowers its cap and re-solves the plan within the caps.

        The plan for ``global_batch_size`` (the batch to retry) is solved within the new caps and, for the
        reference size, put in force at once (a running guard trial is abandoned: caps are hard limits, not a
        speed bet). The monitor drops the failed step's partial reports.

        Returns:
            (the plan to retry the batch with, the cap change).

        Raises:
            ConfigError: ``replica_id`` out of range, or a batch size not an int >= 1.
            InfeasiblePlanError: The caps can no longer hold ``global_batch_size`` examples (the cap stays lowered).
        """
        with self._lock:
            return self._plan_to_retry(self._memory.record_out_of_memory(replica_id, failed_batch_size),
                                       global_batch_size)

    def lower_cap(self, replica_id: int, failed_batch_size: int) -> CapChange:
        """After an evaluation or prediction step ran out of memory on one replica: lowers its cap.

        Training's plan for the reference size is solved again within the new caps where they hold it (else the
        next training step finds out, as after any cap change); nothing else of training's plan lifecycle moves.
        Inference plans are solved anew (they are kept per caps).

        Raises:
            ConfigError: ``replica_id`` out of range, or ``failed_batch_size`` not an int >= 1.
        """
        with self._lock:
            change = self._memory.record_out_of_memory(replica_id, failed_batch_size)
            self._apply_memory_caps(self._memory.caps)
            if self._reference_batch_size is not None:
                # Caps that cannot hold it: training's next step meets them (sub-steps, or its own StepOOMError).
                with contextlib.suppress(InfeasiblePlanError):
                    self.plan_for(self._reference_batch_size)
            return change

    def exclude_replica(self, replica_id: int, failed_batch_size: int,
                        global_batch_size: int) -> tuple[BatchPlan, CapChange]:
        """After a replica's device failed: sets it aside for good (cap 0) and re-solves the plan without it.

        The plan for ``global_batch_size`` (the batch to retry) is solved from the other replicas' cost models and
        put in force at once, as after an out-of-memory step. The replica's cap stays 0 through new cost models.

        Returns:
            (the plan to retry the batch with, the cap change).

        Raises:
            ConfigError: ``replica_id`` out of range, or a batch size not an int >= 1.
            InfeasiblePlanError: The other replicas' caps cannot hold ``global_batch_size`` examples (or none is
                left); the replica stays excluded.
        """
        with self._lock:
            return self._plan_to_retry(self._memory.exclude(replica_id, failed_batch_size), global_batch_size)

    def record_step_success(self, per_replica_batch_sizes: Sequence[int]) -> list[CapChange]:
        """Notes a step that completed with these slices; a lowered cap may grow back (the plan is re-solved)."""
        with self._lock:
            changes = self._memory.record_success(per_replica_batch_sizes, self._reference_batch_size)
            if changes:
                self._apply_memory_caps(self._memory.caps)
                if self._reference_batch_size is not None:
                    self.plan_for(self._reference_batch_size)
            return changes

    def _plan_to_retry(self, change: CapChange, global_batch_size: int) -> tuple[BatchPlan, CapChange]:
        """After a failed step: its partial reports dropped, the plan of the batch to retry within the new caps."""
        self._monitor.abandon_open_steps()
        self._apply_memory_caps(self._memory.caps)
        return self.plan_for(global_batch_size), change

    def _apply_memory_caps(self, caps: list[int | None] | None) -> None:
        """``caps`` are the memory caps in force (the memory policy's, or new ones): a re-balancer within them, and
        every plan solved again."""
        self._max_batch_sizes = caps
        self._rebalancer = Rebalancer(self._rebalance_policy, max_batch_sizes=caps)
        self._forget_plans()

    @property
    def micro_batched_replans(self) -> int:
        """How many times the models behind micro-batched steps were replaced from measured step times."""
        return self._micro_replans

    def record_micro_batched_step(self, batch_sizes: Sequence[int], step_times_s: Sequence[float],
                                  micro_batches: Sequence[int]) -> bool:
        """Records a micro-batched step (replica i: ``b_i`` examples in ``k_i`` micro-batches, ``t_i`` seconds in
        all) and re-plans from the monitor when the re-balance policy says so (see the module docstring).

        Returns:
            True when the cost models were replaced (the engine's micro-batch plans are solved again from them).

        Raises:
            ConfigError: As :meth:`StepTimeMonitor.record_micro_batched_step`.
        """
        with self._lock:
            self._monitor.record_micro_batched_step(batch_sizes, step_times_s, micro_batches)
            if not self.rebalance_enabled or self._cost_models is None or not self._look_due("micro"):
                return False
            caps = list(self._max_batch_sizes or [None] * self._num_replicas)
            if self._micro_rebalancer is None or self._micro_rebalancer_caps != zero_caps(caps):
                # Micro-batched slices are not capped (each micro-batch is); a card with a cap of 0 stays out.
                self._micro_rebalancer_caps = zero_caps(caps)
                self._micro_rebalancer = Rebalancer(self._rebalance_policy, max_batch_sizes=self._micro_rebalancer_caps)
            current = BatchPlan(tuple(int(b) for b in batch_sizes), int(sum(int(b) for b in batch_sizes)))
            measured = self._monitor.updated_cost_models(self._calibrated_models)
            proposal = self._micro_rebalancer.propose(
                self._last_looks["micro"], current, micro_batched_curves(measured, caps),
                num_samples=self._monitor.num_samples,
                relative_standard_errors=self._monitor.relative_standard_errors(measured))
            if proposal is None:
                return False
            logger.info("hetero_cs: micro-batched steps measured the cards' speeds off their models: their "
                        "micro-batches are planned again from the measured times (%s -> %s examples per replica "
                        "predicted).", list(current.per_replica_batch_sizes), list(proposal.per_replica_batch_sizes))
            self._take_measured_models(measured)
            return True

    def consider_micro_batched_models(self, global_batch_size: int) -> bool:
        """Before a step of ``global_batch_size`` that would run as one step within the caps: takes the monitor's
        models when micro-batches priced by them would beat that step (see the module docstring).

        Returns:
            True when the cost models were replaced (the engine's plans are solved again from them).
        """
        with self._lock:
            plan, caps = self._plan, self._max_batch_sizes
            if (not self.rebalance_enabled or self._cost_models is None or caps is None
                    or plan is None or plan.global_batch_size != int(global_batch_size)
                    or self._monitor.num_samples < self._rebalance_policy.min_samples):
                return False
            sizes = plan.per_replica_batch_sizes
            # No card is held at its cap (the one-step re-planner sees everything), or no look is due.
            if not any(cap is not None and 0 < cap <= b for b, cap in zip(sizes, caps)) or not self._look_due("micro"):
                return False
            measured = self._monitor.updated_cost_models(self._calibrated_models)
            deadband = float(self._rebalance_policy.deadband)
            moved = max((abs(float(new.predict_step_time_s(b)) / float(old.predict_step_time_s(b)) - 1.0)
                         for new, old, b in zip(measured, self._cost_models, sizes)
                         if b > 0 and float(old.predict_step_time_s(b)) > 0), default=0.0)  # 0: nothing to compare
            if not moved > deadband:
                return False  # the models in force still describe the cards
            current_s = max(float(m.predict_step_time_s(b)) for m, b in zip(measured, sizes))
            best = solve_batch_split(micro_batched_curves(measured, caps), int(global_batch_size),
                                    max_batch_sizes=zero_caps(caps), min_batch_size=0)
            if not best.predicted_makespan_s < (1.0 - deadband) * current_s:
                return False
            logger.info("hetero_cs: the cards measured off their models while a card is held at its cap: micro-batches "
                        "planned from the measured times are predicted %.3f of the step in use (%s -> %s examples per "
                        "replica); they are planned again, and tried against it.",
                        best.predicted_makespan_s / current_s, list(sizes), list(best.per_replica_batch_sizes))
            self._take_measured_models(measured)
            return True

    def _take_measured_models(self, measured) -> None:
        self._cost_models = measured
        self._micro_replans += 1
        self._forget_plans()
        if self._reference_batch_size is not None:
            self._commit(self._solve(self._reference_batch_size))

