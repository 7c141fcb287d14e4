"""The public API is a deliberate diff, and the pure layer never needs TensorFlow."""

import subprocess
import sys
import textwrap

import hetero_cs

EXPECTED_ALL = [
    "BalanceCallback",
    "BatchPlan",
    "BatchSplitError",
    "CalibrationError",
    "CalibrationOOMError",
    "ConfigError",
    "CostModel",
    "DeviceError",
    "DeviceFaultError",
    "DeviceInfo",
    "EmulatedDeviceError",
    "EmulatedOutOfMemoryError",
    "EmulationError",
    "GuardPolicy",
    "HeteroCSError",
    "HeteroCentralStorageStrategy",
    "HeteroMultiWorkerMirroredStrategy",
    "IdleFreeCostModel",
    "InfeasiblePlanError",
    "InputError",
    "InvalidCostModelError",
    "LinearCostModel",
    "MemoryRecoveryPolicy",
    "MicroBatchError",
    "MicroBatchPlan",
    "NotInReplicaStepError",
    "PiecewiseLinearCostModel",
    "ProfileCacheError",
    "RebalancePolicy",
    "Rebalancer",
    "ReplicaStepError",
    "ScaledCostModel",
    "StepOOMError",
    "StepTimeMonitor",
    "UnknownEmulatedDeviceError",
    "UnsupportedPrecisionError",
    "UnsupportedVersionError",
    "WorkerLostError",
    "current_global_batch_size",
    "discover_devices",
    "even_batch_split",
    "per_example",
    "replica_weight",
    "solve_batch_split",
    "split_by_shares",
]


def test_all_snapshot():
    assert sorted(hetero_cs.__all__) == EXPECTED_ALL


def test_every_error_subclasses_the_base_and_a_builtin():
    errors = [getattr(hetero_cs, n) for n in EXPECTED_ALL if n.endswith("Error") and n != "HeteroCSError"]
    for error in errors:
        assert issubclass(error, hetero_cs.HeteroCSError), error
        builtins = [b for b in error.__mro__ if b.__module__ == "builtins" and b not in (object, BaseException, Exception)]
        assert builtins, f"{error.__name__} subclasses no builtin error"


def test_pure_layer_imports_without_tensorflow_or_pynvml():
    code = textwrap.dedent(
        """
        import sys
        sys.modules["tensorflow"] = None
        sys.modules["pynvml"] = None
        sys.modules["keras"] = None
        import hetero_cs
        from hetero_cs import emulation, errors
        from hetero_cs.devices import catalog, nvml
        from hetero_cs.planning import (
            balancer, cost_model, guard, monitor, plan, rebalance, simulation, solver,
        )
        from calibration import timing, fit, store
        plan_ = hetero_cs.solve_batch_split(
            [hetero_cs.LinearCostModel(0.001, 1e-4), hetero_cs.LinearCostModel(0.001, 3e-4)], 64
        )
        assert sum(plan_.per_replica_batch_sizes) == 64
        assert emulation.get_device_spec("T4").name == "T4"
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_import_does_not_load_tensorflow():
    code = "import sys, hetero_cs, calibration; print('tensorflow' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_planning_layer_imports_nothing_above_it():
    """Every module of hetero_cs/planning imports only the standard library, NumPy, SciPy, errors, _copying (the
    deepcopy helper, standard library only) and itself."""
    import ast
    import pathlib

    allowed_roots = {"numpy", "scipy", "hetero_cs"}
    package = pathlib.Path(hetero_cs.__file__).parent
    stdlib = set(sys.stdlib_module_names)
    for node in ast.walk(ast.parse((package / "_copying.py").read_text())):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module]
            assert all(name.split(".")[0] in stdlib for name in names), f"_copying.py imports {names}"
    for path in sorted((package / "planning").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            for name in names:
                root = name.split(".")[0]
                assert root in stdlib or root in allowed_roots, f"{path.name} imports {name}"
                if root == "hetero_cs":
                    assert name.startswith(("hetero_cs.planning", "hetero_cs.errors", "hetero_cs._copying")), (
                        f"{path.name} imports {name}")


def test_emulation_is_reachable_from_the_package():
    """``import hetero_cs; hetero_cs.emulation.setup_logical_devices`` works as the docs write it."""
    code = "import sys, hetero_cs; print(callable(hetero_cs.emulation.setup_logical_devices), 'tensorflow' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True False"

