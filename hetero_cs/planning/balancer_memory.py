"""The Balancer's out-of-memory recovery: lower a replica's cap, re-solve within the caps, grow caps back (pure).

Part of :class:`hetero_cs.planning.balancer.Balancer` (a base class of it, in its own module for size); the cap
policy itself is :class:`hetero_cs.planning.memory_caps.MemoryCaps`. An engine calls :meth:`recover_from_oom`
when a replica's step ran out of memory (then retries the same global batch with the plan it returns) and
:meth:`record_step_success` after each step that completed. This module imports neither TensorFlow nor pynvml.
"""

from __future__ import annotations

from collections.abc import Sequence

from hetero_cs._copying import DeepcopiedWithNewLocks
from hetero_cs.errors import InfeasiblePlanError
from hetero_cs.planning.memory_caps import CapChange, MemoryCaps
from hetero_cs.planning.plan import BatchPlan
from hetero_cs.planning.rebalance import Rebalancer


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

    def recover_from_oom(
        self, replica_id: int, failed_batch_size: int, global_batch_size: int
    ) -> tuple[BatchPlan, CapChange]:
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
            self._apply_memory_caps()
            if self._reference_batch_size is not None:
                try:
                    self.plan_for(self._reference_batch_size)
                except InfeasiblePlanError:
                    pass  # training's next step meets it (sub-steps, or its own StepOOMError)
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
                self._apply_memory_caps()
                if self._reference_batch_size is not None:
                    self.plan_for(self._reference_batch_size)
            return changes

    def _plan_to_retry(self, change: CapChange, global_batch_size: int) -> tuple[BatchPlan, CapChange]:
        """After a failed step: its partial reports dropped, the plan of the batch to retry within the new caps."""
        self._monitor.abandon_open_steps()
        self._apply_memory_caps()
        return self.plan_for(global_batch_size), change

    def _apply_memory_caps(self) -> None:
        caps = self._memory.caps
        self._max_batch_sizes = caps
        self._rebalancer = Rebalancer(self._rebalance_policy, max_batch_sizes=caps)
        self._forget_plans()
