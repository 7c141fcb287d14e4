"""The public state of :class:`hetero_cs.engine.central_storage.HeteroCentralStorageStrategy`: read-only properties.

A base class of the strategy, in its own module for size; the strategy's constructor sets the attributes they read.
"""

from __future__ import annotations

from hetero_cs.planning.balancer import Balancer
from hetero_cs.planning.cost_model import CostModel
from hetero_cs.planning.monitor import StepTimeMonitor
from hetero_cs.planning.plan import BatchPlan


class StrategyState:
    """Read-only properties of the strategy (plan, balancer, devices, emulator, statistics)."""
    @property
    def plan(self) -> BatchPlan | None:
        """The plan in force for the full global batch (None before the first global batch is seen).

        While the guard tries a new plan this is still the plan it would replace (see :attr:`balancer`)."""
        return self._balancer.plan

    fused_update = property(lambda self: self._fused_update,
                            doc="The ``fused_update`` setting: None (Keras' optimizers, dense gradients), True, False.")

    @property
    def stats(self):
        """The last fit's per-epoch figures (:class:`hetero_cs.engine.callbacks.FitStats`), or None before one."""
        return self._fit_stats

    @property
    def micro_batching(self):
        """Micro-batching (:class:`hetero_cs.engine.memory.micro_batches.MicroBatching`): ``last_plan``, step counts."""
        return self._micro_batching

    @property
    def balancer(self) -> Balancer:
        """The plan lifecycle (:class:`hetero_cs.planning.balancer.Balancer`): monitor, re-balancer, guard."""
        return self._balancer

    compute_devices = property(lambda self: self._compute_devices, doc="The replicas' devices, in replica-id order.")

    @property
    def parameter_device(self) -> str:
        """Where the central variables live."""
        return self._parameter_device

    @property
    def emulator(self):
        """The :class:`hetero_cs.emulation.Emulator` adding emulated device time, or None on real devices."""
        return self._emulator

    @property
    def monitor(self) -> StepTimeMonitor:
        """Per-replica step-time statistics (filled while timing is on: auto_balance, emulation, HETERO_CS_TIMING=1)."""
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
