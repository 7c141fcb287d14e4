"""The public state of the strategies: read-only properties.

:class:`SharedState` is a base class of both strategies, :class:`StrategyState` (the central-storage strategy's)
adds what only it has; in their own module for size. The strategies' constructors set the attributes they read.
"""

from hetero_cs.planning.balancer import Balancer
from hetero_cs.planning.cost_model import CostModel
from hetero_cs.planning.monitor import StepTimeMonitor
from hetero_cs.planning.plan import BatchPlan


class SharedState:
    """Read-only properties of both strategies (plan, balancer, emulator, statistics)."""

    @property
    def plan(self) -> BatchPlan | None:
        """The plan in force for the full global batch (None before the first global batch is seen).

        While the guard tries a new plan this is still the plan it would replace (see :attr:`balancer`). Under the
        multi-worker strategy with a fixed or even split every worker knows it; with auto_balance only the chief's
        Balancer plans (the other workers receive each step's split inside the step), so it is None on the others.
        """
        return self._balancer.plan

    @property
    def stats(self):
        """The last fit's per-epoch figures (:class:`hetero_cs.engine.callbacks.FitStats`; on the chief under the
        multi-worker strategy), or None before one."""
        return self._fit_stats

    @property
    def balancer(self) -> Balancer:
        """This worker's plan lifecycle (:class:`hetero_cs.planning.balancer.Balancer`): monitor, re-balancer, guard
        (under the multi-worker strategy the chief's is the one that decides)."""
        return self._balancer

    @property
    def emulator(self):
        """The :class:`hetero_cs.emulation.Emulator` adding emulated device time (every replica of the cluster under
        the multi-worker strategy), or None on real devices."""
        return self._emulator


class StrategyState(SharedState):
    """Read-only properties of the central-storage strategy (devices, calibration, cost models, backups)."""

    fused_update = property(lambda self: self._fused_update,
                            doc="The ``fused_update`` setting: None (Keras' optimizers, dense gradients), True, False.")

    @property
    def micro_batching(self):
        """Micro-batching (:class:`hetero_cs.engine.memory.micro_batches.MicroBatching`): ``last_plan``, step counts."""
        return self._micro_batching

    compute_devices = property(lambda self: self._compute_devices, doc="The replicas' devices, in replica-id order.")

    @property
    def parameter_device(self) -> str:
        """Where the central variables live."""
        return self._parameter_device

    @property
    def monitor(self) -> StepTimeMonitor:
        """Per-replica step-time statistics: of sampled steps under auto_balance or re-balancing, of every step on
        emulated devices without them or with HETERO_CS_TIMING=1 (see ``docs/trust.md``)."""
        return self._balancer.monitor

    @property
    def calibration(self):
        """The last ``calibration.CalibrationResult`` used for the plan, or None."""
        return self._calibration

    @property
    def cost_models(self) -> list[CostModel] | None:
        """Per-replica cost models behind the plan (calibrated, then updated online), or None."""
        return self._balancer.cost_models

    @property
    def backup(self):
        """The last supervised fit's :class:`hetero_cs.engine.faults.backup.SupervisedBackup` (``backups``,
        ``backup_time_s``, ``interval_steps``: the most steps a lost card costs, ``resumed_from``), or None outside
        ``hetero-cs run``."""
        return getattr(self, "_backup", None)
