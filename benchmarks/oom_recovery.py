"""Benchmark: out-of-memory recovery in model.fit - examples lost, steps to recover, plan quality, retraces, leaks.

What it measures. One HeteroCentralStorageStrategy (auto_balance=True, guard and re-balancing off so that only the
memory caps move the plan) trains an MLP with model.fit on an emulated mix (default A10,T4,P100) whose replica 1
(the T4) has room for --cap examples until its step --drop-at, then for only --low-cap examples (another process
took the rest). The memory policy grows a lowered cap back after every successful step (grow_after_steps=1,
growth_factor=4) so the cap keeps probing above the memory that is there: every probe runs out of memory and is
recovered, which gives --recoveries (default 50) recoveries in a short run. Timings are EMULATED.

Reported:
  * examples_lost: |optimizer iterations - batches| plus the largest weight difference against single-device
    training on the same batches (0 and < 1e-5 when no example is lost or applied twice);
  * max_retries_per_batch: the most retries one global batch needed (goal <= 3);
  * plan_vs_optimum: after each recovery, the true emulated makespan of the re-solved plan divided by the optimum
    for the same caps (solve_batch_split over the emulator's true step times); the worst and the median are
    reported (goal <= 1.02). The plan is solved from the calibrated cost models, so their error (timing noise of
    a busy host) is what separates it from the optimum; the split is optimal for the models it is given;
  * retraces: traces of Keras' train step after the first (goal 0);
  * rss_growth_mb and python_objects_growth: resident memory and gc-tracked objects after the last recovery minus
    after the 10th (the first ones warm caches up), so a leak per recovery shows as steady growth.

    python benchmarks/oom_recovery.py [--recoveries 50] [--json F]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _common  # noqa: E402
from benchmarks._common import log  # noqa: E402


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="benchmarks/oom_recovery.py", description=__doc__.split("\n\n")[0],
                                     epilog="Timings are emulated (see the module docstring).")
    parser.add_argument("--mix", default="A10,T4,P100", help="device mix (default A10,T4,P100)")
    parser.add_argument("--global-batch-size", type=int, default=96, help="B (default 96)")
    parser.add_argument("--cap", type=int, default=40, help="examples replica 1 holds before the drop (40)")
    parser.add_argument("--low-cap", type=int, default=9, help="examples replica 1 holds after the drop (9)")
    parser.add_argument("--drop-at", type=int, default=5, help="replica 1's step the memory drops at (5)")
    parser.add_argument("--recoveries", type=int, default=50, help="recoveries to run (default 50)")
    parser.add_argument("--json", type=Path, default=None, help="write the results to this JSON file")
    return parser.parse_args(argv)


def rss_mb() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def main(argv=None) -> int:
    args = parse_args(argv)
    names = _common.parse_mix(args.mix)
    os.environ.setdefault("HETERO_CS_EMULATION_TARGET_MAKESPAN_MS", "10")
    devices = _common.setup_devices(names)
    _common.quiet_libraries()
    import keras
    import numpy as np
    import tensorflow as tf

    from hetero_cs import HeteroCentralStorageStrategy, MemoryRecoveryPolicy, solve_batch_split
    from hetero_cs.emulation import Drift, Emulator, Workload

    B = args.global_batch_size
    activation = 10_000
    workload = Workload(flops_per_example=2e7, parameter_bytes=10_000, activation_bytes_per_example=activation)
    memory = lambda n: workload.fixed_memory_bytes + n * activation  # noqa: E731
    mix = list(names)
    mix[1] = f"{names[1].partition('@')[0]}@{memory(args.cap)}B"  # this benchmark sets replica 1's memory
    emulator = Emulator(mix, workload=workload, time_scale=20.0,
                        drift=[Drift(replica_id=1, from_step=args.drop_at, memory_bytes=memory(args.low_cap))])
    policy = MemoryRecoveryPolicy(grow_after_steps=1, max_grow_after_steps=1, growth_factor=4.0, max_retries=4)
    strategy = HeteroCentralStorageStrategy(devices, emulate=emulator, rebalance=False, guard=False,
                                            profile_cache=False, oom_recovery=policy)

    def mlp():
        keras.utils.set_random_seed(3)
        return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                 keras.layers.Dense(1)])

    with strategy.scope():
        model = mlp()
        model.compile(optimizer="adam", loss="mse")
    initial = model.get_weights()
    traces = [0]
    original_step = model.train_step

    def counting_step(batch):
        traces[0] += 1
        return original_step(batch)

    model.train_step = counting_step
    recovery = strategy._step_recovery  # noqa: SLF001
    samples: dict[int, tuple[float, int]] = {}
    ratios: list[float] = []

    original_recover = strategy.balancer.recover_from_oom

    def recover_and_compare(replica_id, failed_batch_size, global_batch_size):
        plan, change = original_recover(replica_id, failed_batch_size, global_batch_size)
        caps = strategy.balancer.max_batch_sizes
        true = _common.true_profiles(emulator, step=emulator.steps_done[1])
        makespan = max(t.predict_step_time_s(b) for t, b in zip(true, plan.per_replica_batch_sizes))
        optimum = solve_batch_split(true, global_batch_size, max_batch_sizes=caps, min_batch_size=1)
        ratios.append(makespan / optimum.predicted_makespan_s)
        return plan, change

    strategy.balancer.recover_from_oom = recover_and_compare

    class Watch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            count = recovery.recoveries
            if count >= 10 and 10 not in samples:
                gc.collect()
                samples[10] = (rss_mb(), len(gc.get_objects()))
            if count >= args.recoveries:
                gc.collect()
                samples[args.recoveries] = (rss_mb(), len(gc.get_objects()))
                self.model.stop_training = True

    rng = np.random.default_rng(0)
    batches = 4 * args.recoveries + 40
    x = rng.normal(size=(B * batches, 8)).astype(np.float32)
    y = rng.normal(size=(B * batches, 1)).astype(np.float32)
    start_s = time.perf_counter()
    model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0, callbacks=[Watch()])
    wall_s = time.perf_counter() - start_s
    steps = int(model.optimizer.iterations)

    reference = mlp()
    reference.set_weights(initial)
    reference.compile(optimizer="adam", loss="mse")
    reference.fit(x[: B * steps], y[: B * steps], batch_size=B, epochs=1, shuffle=False, verbose=0)
    weight_diff = max(float(np.max(np.abs(a - b))) for a, b in zip(model.get_weights(), reference.get_weights()))
    first, last = samples.get(10), samples.get(args.recoveries)
    result = {
        "recoveries": recovery.recoveries,
        "steps": steps,
        "examples_lost": abs(steps - int(reference.optimizer.iterations)),
        "max_weight_diff_vs_single_device": weight_diff,
        "max_retries_per_batch": recovery.max_retries_used,
        "plan_vs_optimum": max(ratios) if ratios else None,
        "plan_vs_optimum_median": sorted(ratios)[len(ratios) // 2] if ratios else None,
        "retraces": traces[0] // len(devices) - 1,
        "rss_growth_mb": None if not (first and last) else last[0] - first[0],
        "python_objects_growth": None if not (first and last) else last[1] - first[1],
        "wall_s": wall_s,
        "emulated": True,
    }
    log(f"EMULATED devices {mix}; memory of replica 1 drops to {args.low_cap} examples at its step {args.drop_at}")
    for key, value in result.items():
        log(f"  {key} = {value}")
    if args.json is not None:
        _common.write_json(args.json, result)
    del tf
    return 0


if __name__ == "__main__":
    sys.exit(main())
