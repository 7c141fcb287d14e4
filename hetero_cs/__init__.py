"""hetero_cs: balanced, exact central-storage training on machines whose accelerators are not alike.

The pure layer (cost models, solver, plan, rebalance policy, emulation catalog) imports without TensorFlow; the
TensorFlow-facing names (the strategy, the callback, the replica-step accessors, device discovery) are imported
on first use, so ``import hetero_cs`` neither loads TensorFlow nor initialises any device.
"""

from hetero_cs.cost_model import CostModel, LinearCostModel, PiecewiseLinearCostModel, ScaledCostModel
from hetero_cs.errors import (
    BatchSplitError,
    CalibrationError,
    CalibrationOOMError,
    ConfigError,
    DeviceError,
    EmulationError,
    HeteroCSError,
    InfeasiblePlanError,
    InputError,
    InvalidCostModelError,
    NotInReplicaStepError,
    ProfileCacheError,
    ReplicaStepError,
    UnknownEmulatedDeviceError,
)
from hetero_cs.monitor import StepTimeMonitor
from hetero_cs.plan import BatchPlan, even_batch_split, split_by_shares
from hetero_cs.rebalance import RebalancePolicy, Rebalancer
from hetero_cs.solver import solve_batch_split

# Name -> module for the TensorFlow-facing API (PEP 562 lazy attributes; see the module docstring).
_LAZY = {
    "HeteroCentralStorageStrategy": "hetero_cs.strategy",
    "BalanceCallback": "hetero_cs.callbacks",
    "current_global_batch_size": "hetero_cs.training",
    "replica_weight": "hetero_cs.training",
    "discover_devices": "hetero_cs.devices",
    "DeviceInfo": "hetero_cs.devices",
}


def __dir__():
    return sorted(set(globals()) | set(__all__))


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hetero_cs' has no attribute {name!r}")


__all__ = [
    "BalanceCallback",
    "BatchPlan",
    "BatchSplitError",
    "CalibrationError",
    "CalibrationOOMError",
    "ConfigError",
    "CostModel",
    "DeviceError",
    "DeviceInfo",
    "EmulationError",
    "HeteroCSError",
    "HeteroCentralStorageStrategy",
    "InfeasiblePlanError",
    "InputError",
    "InvalidCostModelError",
    "LinearCostModel",
    "NotInReplicaStepError",
    "PiecewiseLinearCostModel",
    "ProfileCacheError",
    "RebalancePolicy",
    "Rebalancer",
    "ReplicaStepError",
    "ScaledCostModel",
    "StepTimeMonitor",
    "UnknownEmulatedDeviceError",
    "current_global_batch_size",
    "discover_devices",
    "even_batch_split",
    "replica_weight",
    "solve_batch_split",
    "split_by_shares",
]
