"""hetero_cs: balanced, exact central-storage training on machines whose accelerators are not alike.

Layers (see docs/architecture.md): ``hetero_cs.planning`` (pure: cost models, solver, plan, monitor, re-balance
policy, guard, the ``Balancer`` plan lifecycle), ``hetero_cs.engine`` (TensorFlow: the strategy, input slicing,
step timing, the one module of private TF/Keras touches) and ``hetero_cs.devices`` (NVML discovery, emulation).
The TensorFlow-facing names (the strategy, the callback, the replica-step accessors, device discovery) are
imported on first use, so ``import hetero_cs`` neither loads TensorFlow nor initialises any device.
"""

from hetero_cs.errors import (
    BatchSplitError, CalibrationError, CalibrationOOMError, ConfigError, DeviceError, DeviceFaultError,
    EmulatedDeviceError, EmulatedOutOfMemoryError, EmulationError, HeteroCSError, InfeasiblePlanError, InputError,
    InvalidCostModelError, MicroBatchError, NotInReplicaStepError, ProfileCacheError, ReplicaStepError, StepOOMError,
    UnknownEmulatedDeviceError, UnsupportedPrecisionError, UnsupportedVersionError, WorkerLostError)
from hetero_cs.planning.cost_model import (
    CostModel, IdleFreeCostModel, LinearCostModel, PiecewiseLinearCostModel, ScaledCostModel)
from hetero_cs.planning.guard import GuardPolicy
from hetero_cs.planning.memory_caps import MemoryRecoveryPolicy
from hetero_cs.planning.micro_batches import MicroBatchPlan
from hetero_cs.planning.monitor import StepTimeMonitor
from hetero_cs.planning.plan import BatchPlan, even_batch_split, split_by_shares
from hetero_cs.planning.rebalance import RebalancePolicy, Rebalancer
from hetero_cs.planning.solver import solve_batch_split

# Name -> module for the TensorFlow-facing API (PEP 562 lazy attributes; see the module docstring).
_LAZY = {
    "HeteroCentralStorageStrategy": "hetero_cs.engine.central_storage",
    "HeteroMultiWorkerMirroredStrategy": "hetero_cs.engine.multi_worker.strategy",
    "BalanceCallback": "hetero_cs.engine.callbacks",
    "current_global_batch_size": "hetero_cs.engine.step.replica_state",
    "replica_weight": "hetero_cs.engine.step.replica_state",
    "per_example": "hetero_cs.engine.step.replica_state",
    "discover_devices": "hetero_cs.devices",
    "DeviceInfo": "hetero_cs.devices",
}

# Subpackages and modules reachable as attributes without an explicit import (none of them loads TensorFlow).
_SUBMODULES = ("devices", "emulation", "errors", "planning")


def __dir__():
    return sorted(set(globals()) | set(__all__))


def __getattr__(name):
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _SUBMODULES:  # e.g. hetero_cs.emulation.setup_logical_devices(...) after a plain `import hetero_cs`
        return importlib.import_module(f"hetero_cs.{name}")
    raise AttributeError(f"module 'hetero_cs' has no attribute {name!r}")


__all__ = [
    "BalanceCallback", "BatchPlan", "BatchSplitError", "CalibrationError", "CalibrationOOMError", "ConfigError",
    "CostModel", "DeviceError", "DeviceFaultError", "DeviceInfo", "EmulatedDeviceError", "EmulatedOutOfMemoryError",
    "EmulationError", "HeteroCSError", "HeteroCentralStorageStrategy", "HeteroMultiWorkerMirroredStrategy",
    "IdleFreeCostModel", "InfeasiblePlanError", "InputError", "InvalidCostModelError", "MicroBatchError",
    "MicroBatchPlan", "LinearCostModel", "GuardPolicy", "MemoryRecoveryPolicy", "NotInReplicaStepError",
    "PiecewiseLinearCostModel", "ProfileCacheError", "RebalancePolicy", "Rebalancer", "ReplicaStepError",
    "ScaledCostModel", "StepOOMError", "StepTimeMonitor", "UnknownEmulatedDeviceError", "UnsupportedPrecisionError",
    "UnsupportedVersionError", "WorkerLostError", "current_global_batch_size", "discover_devices", "even_batch_split",
    "per_example", "replica_weight", "solve_batch_split", "split_by_shares"]
