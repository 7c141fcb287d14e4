"""The fastest card alone, for benchmarks/balance.py: the whole global batch on one device, nothing else in the step.

The contract's figure "all cards (auto_balance) vs the fastest card alone on the whole batch": a configuration
``fastest_alone`` beside the others in the same interleaved rounds. It is a second HeteroCentralStorageStrategy
over that one compute device (not a 0 share for the other replicas: an idle replica still runs its step and pays
its fixed costs), with an Emulator of that one card built from the same workload and time scale as the other
configurations' emulators, so the emulated times compare; the same model (same weights), optimizer and training step.

Which card: the one with the highest throughput on the whole batch B by the true emulated profiles
(``Emulator.step_time_s(i, B)``, the catalog's figures that the logical device waits for).

Theoretical value: the cards' summed throughputs at the ideal (continuous, perfectly balanced) slices over the
fastest card's throughput at B. At the ideal split every card busy takes the ideal makespan T, so the sum is B / T
and the ratio is ``t_fastest(B) / T``.
"""

from __future__ import annotations

import warnings
from typing import Any

from benchmarks import _common

CONFIG_NAME = "fastest_alone"
FRACTION_GOAL = 0.95
"""On a quiet machine: speedup_vs_fastest >= 0.95 x theoretical_speedup_vs_fastest (and >= 1.0 always)."""


def fastest_replica(emulator: Any, global_batch_size: int) -> int:
    """Index of the replica whose true emulated step on the whole batch is shortest (highest throughput at B)."""
    times_s = [emulator.step_time_s(i, global_batch_size, step=0) for i in range(emulator.num_replicas)]
    return min(range(len(times_s)), key=times_s.__getitem__)


def fastest_figures(emulator: Any, global_batch_size: int, ideal_makespan_s: float) -> dict[str, Any]:
    """The fastest card, its true step time on the whole batch and the theoretical speedup of all cards over it."""
    index = fastest_replica(emulator, global_batch_size)
    alone_s = float(emulator.step_time_s(index, global_batch_size, step=0))
    return {"fastest": emulator.specs[index].name, "fastest_replica": index, "fastest_alone_makespan_s": alone_s,
            "theoretical_speedup_vs_fastest": alone_s / ideal_makespan_s}


def fastest_alone_config(device: str, name: str, *, workload: Any, time_scale: float, kind: str,
                         weights: Any, dataset: Any, args: Any) -> tuple[Any, Any]:
    """The ``fastest_alone`` configuration on ``device`` emulating ``name``; returns (Config, its Emulator).

    The model is ``kind``'s architecture with ``weights`` (the other configurations' initial weights); the optimizer
    and training step are the hetero_cs configurations' (Keras Adam, LossScaleOptimizer under mixed_float16,
    ``_common.make_train_step``).
    """
    import keras

    from hetero_cs import HeteroCentralStorageStrategy
    from hetero_cs.emulation import Emulator

    B = args.global_batch_size
    emulator = Emulator([name], workload=workload, time_scale=time_scale)
    with warnings.catch_warnings():  # one compute device: "nothing to balance" is the point of this configuration
        warnings.filterwarnings("ignore", message=".*nothing to balance.*")
        strategy = HeteroCentralStorageStrategy([device], emulate=emulator, auto_balance=False, rebalance=False,
                                                profile_cache=False)
    with strategy.scope():
        model = _common.build_model(kind, seed=args.seed)
        optimizer = keras.optimizers.Adam(1e-3)
        if args.policy == "mixed_float16":
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        model.compile(optimizer=optimizer, loss=_common.loss_function())
    model.set_weights(weights)
    strategy.calibrate(model, dataset, progress=False)  # auto_balance=False: only fixes the plan for B
    config = _common.Config(
        CONFIG_NAME, f"hetero_cs, {name} alone, whole batch",
        _common.make_train_step(strategy, model, optimizer, global_batch_size=B),
        iter(strategy.experimental_distribute_dataset(dataset)), monitor=strategy.monitor, strategy=strategy)
    return config, emulator


def add_figures(record: dict[str, Any], figures: dict[str, Any], *, noise: bool) -> None:
    """Adds speedup_vs_fastest (measured fastest_alone step / hetero_auto step), its theoretical value, the fraction
    and ``fastest_goals_met`` (>= 1.0 always; >= 0.95 x theoretical unless ``noise``) to a case record."""
    configs = record["configs"]
    record.update(figures)
    record["speedup_vs_fastest"] = configs[CONFIG_NAME]["median_step_s"] / configs["hetero_auto"]["median_step_s"]
    record["speedup_vs_fastest_fraction_of_theoretical"] = (record["speedup_vs_fastest"]
                                                            / record["theoretical_speedup_vs_fastest"])
    record["fastest_goals_met"] = bool(record["speedup_vs_fastest"] >= 1.0 and (
        noise or record["speedup_vs_fastest_fraction_of_theoretical"] >= FRACTION_GOAL))
