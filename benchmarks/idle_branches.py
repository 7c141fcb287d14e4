"""Benchmark: a card alone inside a strategy of several, the cost of noted sets of idle replicas, a retrace's memory.

What it measures. ``model.fit`` on the benchmarks' CNN (B = 256) under ``HeteroCentralStorageStrategy`` on an emulated
mix (default A10,T4,P100) at an emulated step of ``--target-ms`` (default 5 ms, where the real compute on the CPU
dominates and a step's own overhead shows). fit traces its train step once per set of active replicas, each a
function that runs only its set (:class:`hetero_cs.engine.step.idle_replicas.StepPerSet`); a step with branches (one
per set that plans used: evaluate, predict, a custom loop) walks the ops of the branches it does not take, as
TensorFlow lowers the branch op to switch/merge. Side by side, in interleaved rounds:

* ``default_even`` / ``default_alone``: the strategy as fit leaves it (calibration notes the fastest card alone),
  pinned to the even split and to replica 0 alone;
* ``all_sets_even`` / ``all_sets_alone``: the same with every set of active replicas there is noted before the first
  trace (for three cards, six): what a step with a branch for each would cost; fit's step per set costs the same as
  the default's;
* ``one_card``: replica 0's device alone in a one-replica strategy (same emulated card and time scale), what the
  main job compares with (``speedup_vs_fastest``).

Each configuration reports the median wall time of a step (Keras' batch callbacks) and the process's CPU time per
step (user + system, all threads: the work the step costs the host's cores, less sensitive to other load than wall
time). Then ``--retraces`` times the step is traced again with the same sets (``model.train_function = None``), and
the resident memory after each says what one retrace keeps; a plain Keras model on one device, traced again the same
way, is the reference.

    python benchmarks/idle_branches.py [--target-ms 5] [--rounds 4] [--steps 30] [--retraces 4] [--json F]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _common  # noqa: E402
from benchmarks._common import log  # noqa: E402

B = 256


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="benchmarks/idle_branches.py", description=__doc__.split("\n\n")[0],
                                     epilog="Timings are emulated (see the module docstring).")
    parser.add_argument("--mix", default="A10,T4,P100", help="device mix (default A10,T4,P100)")
    parser.add_argument("--target-ms", type=float, default=5.0, help="emulated even-split step (default 5 ms)")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds (default 4)")
    parser.add_argument("--steps", type=int, default=30, help="steps per configuration and round (default 30)")
    parser.add_argument("--retraces", type=int, default=4, help="retraces for the memory figure (default 4)")
    parser.add_argument("--json", type=Path, default=None, help="write the results to this JSON file")
    args = parser.parse_args(argv)
    if min(args.rounds, args.steps, args.retraces) < 1 or args.target_ms <= 0:
        parser.error("--rounds, --steps, --retraces and --target-ms must be positive")
    return args


def rss_mb() -> float:
    """The process's resident memory, MB (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = _common.parse_mix(args.mix)
    os.environ["HETERO_CS_EMULATION_TARGET_MAKESPAN_MS"] = f"{args.target_ms:g}"
    devices = _common.setup_devices(names)
    _common.quiet_libraries()
    import keras
    import tensorflow as tf

    from hetero_cs import HeteroCentralStorageStrategy
    from hetero_cs.emulation import Emulator

    log(f"hetero_cs idle-branches benchmark - {_common.EMULATED_NOTE}")
    log(f"   model.fit, CNN, B={B}, mix {_common.mix_label(names)}, emulated step ~{args.target_ms:g} ms; "
        f"{args.rounds} rounds of {args.steps} steps per configuration")
    dataset = _common.batch_dataset(_common.synthetic_batch("cnn", B))

    def compiled(strategy):
        with strategy.scope():
            model = _common.build_model("cnn")
            model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=_common.loss_function())
        return model

    strategies, models = {}, {}
    for name in ("default", "all_sets"):
        strategy = HeteroCentralStorageStrategy(devices, emulate=names, rebalance=False, guard=False,
                                                profile_cache=False)
        model = compiled(strategy)
        if name == "all_sets":  # a branch for every set of active replicas, noted before the first trace
            for k in range(1, len(names)):
                for active in itertools.combinations(range(len(names)), k):
                    strategy._active_sets.note([int(i in active) for i in range(len(names))],  # noqa: SLF001
                                               training=True)
        model.fit(dataset, epochs=1, steps_per_epoch=5, verbose=0)  # calibrates, traces
        strategies[name], models[name] = strategy, model
    main_emulator = strategies["default"].emulator
    one = HeteroCentralStorageStrategy(
        [devices[0]], emulate=Emulator([names[0]], workload=main_emulator.workload,
                                       time_scale=main_emulator.time_scale),
        auto_balance=False, rebalance=False, profile_cache=False)
    models["one_card"] = compiled(one)
    log("   traced sets: " + ", ".join(f"{n} {list(s._active_sets.for_trace(training=True))}"  # noqa: SLF001
                                        for n, s in strategies.items()))

    class Timer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.start_s = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.times_s.append(time.perf_counter() - self.start_s)

    def measure(model, split, strategy):
        def run(steps):
            if split is not None:
                strategy.set_batch_split(split)  # pinned: no plan changes while measuring
            timer = Timer()
            timer.times_s = []
            cpu_s = time.process_time()
            model.fit(dataset, epochs=1, steps_per_epoch=steps + 1, verbose=0, callbacks=[timer])
            return statistics.median(timer.times_s[1:]), (time.process_time() - cpu_s) / (steps + 1)
        return run

    alone = [1] + [0] * (len(names) - 1)
    configs = {f"{n}_{label}": measure(models[n], split, strategies[n])
               for n in ("default", "all_sets") for label, split in (("even", [1] * len(names)), ("alone", alone))}
    configs["one_card"] = measure(models["one_card"], None, None)
    for run in configs.values():
        run(3)  # traces each pinned split's step once
    wall = {name: [] for name in configs}
    cpu = {name: [] for name in configs}
    order = list(configs)
    for r in range(args.rounds):
        for name in order[r % len(order):] + order[:r % len(order)]:
            wall_s, cpu_s = configs[name](args.steps)
            wall[name].append(wall_s)
            cpu[name].append(cpu_s)
        log(f"   round {r + 1}/{args.rounds} done")

    # Memory kept by a retrace of the same step (same sets): the hetero_cs step and a plain Keras model.
    def retrace_growth(model):
        model.fit(dataset, epochs=1, steps_per_epoch=2, verbose=0)
        gc.collect()
        before = rss_mb()
        for _ in range(args.retraces):
            model.train_function = None  # private: Keras traces its train step again when this is None
            model.fit(dataset, epochs=1, steps_per_epoch=2, verbose=0)
            gc.collect()
        return (rss_mb() - before) / args.retraces

    strategies["default"].set_batch_split(None)
    plain = _common.build_model("cnn")
    plain.compile(optimizer=keras.optimizers.Adam(1e-3), loss=_common.loss_function())
    with tf.device(devices[0]):
        plain_mb = retrace_growth(plain)
    hetero_mb = retrace_growth(models["default"])

    log("\n== results (timings EMULATED; wall clock of this host, which other work shares)")
    results = {"target_ms": args.target_ms, "mix": _common.mix_label(names), "configs": {}}
    for name in configs:
        w, c = statistics.median(wall[name]), statistics.median(cpu[name])
        vs_one = statistics.median(o / x for o, x in zip(wall["one_card"], wall[name]))
        results["configs"][name] = {"wall_ms": w * 1e3, "cpu_ms_per_step": c * 1e3, "speed_vs_one_card": vs_one,
                                    "wall_ms_rounds": [x * 1e3 for x in wall[name]]}
        log(f"   {name:>15}: wall {w * 1e3:6.2f} ms, CPU {c * 1e3:6.2f} ms a step; speed vs one_card {vs_one:.3f} "
            f"(rounds {', '.join(f'{x * 1e3:.1f}' for x in wall[name])} ms)")
    for label in ("even", "alone"):
        extra = statistics.median(cpu[f"all_sets_{label}"]) - statistics.median(cpu[f"default_{label}"])
        results[f"all_sets_extra_cpu_ms_{label}"] = extra * 1e3
        log(f"   every set traced, {label}: {extra * 1e3:+.2f} ms of CPU a step over the default sets")
    results.update(retrace_mb_hetero=hetero_mb, retrace_mb_plain_keras=plain_mb)
    log(f"   memory kept per retrace of the same step: hetero_cs {hetero_mb:.1f} MB, plain Keras on one device "
        f"{plain_mb:.1f} MB (over {args.retraces} retraces)")
    if args.json:
        log(f"   wrote {_common.write_json(args.json, results)}")
    return 0


if __name__ == "__main__":
    _common.exit_now(main())
