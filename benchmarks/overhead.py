"""Benchmark: engine overhead of hetero_cs against stock CentralStorageStrategy, and the cost of per-replica timing.

What it measures. Real compute, no emulation: an MLP 784-256-256-10 (ReLU, Adam) with a global batch of 256 on
identical devices (3 logical CPU compute devices, CPU:0 holds the variables), trained by one custom training loop
(strategy.run in tf.function) under six configurations, interleaved in rounds (order rotating), medians:

* ``stock``: tf.distribute.experimental.CentralStorageStrategy (even split);
* ``hetero_even``: HeteroCentralStorageStrategy(auto_balance=False, rebalance=False), per-replica timing off;
* ``hetero_even_timed``: the same with per-replica timing on (HETERO_CS_TIMING=1 when the strategy is built);
* ``hetero_even_any_size``: ``hetero_even`` on the same batches from ``dataset.batch(B)``, whose size is unknown while
  tracing: the step then has a branch for each batch smaller than the replicas (a last partial batch), which every
  step pays for a little;
* ``hetero_auto``: HeteroCentralStorageStrategy(auto_balance=True, rebalance=True), calibrated by the library
  (timing on, because re-balancing reads it);
* ``stock_step`` and ``hetero_step``: stock and hetero_cs (even, timing off) fed fixed per-replica values of the
  same even split instead of a distributed dataset: the step alone, without the input pipeline, to locate an
  overhead in the step or in the input pipeline;
* ``keras_stock``, ``keras_hetero`` and ``keras_hetero_xla``: Keras' own ``model.train_step`` (what ``model.fit``
  runs in each replica) instead of the custom loop's step, under stock CentralStorageStrategy, under hetero_cs
  (even, timing off) compiled with ``jit_compile=False``, and the same compiled with ``jit_compile=True``: each
  replica's forward and backward pass then runs as one XLA function on its device
  (:mod:`hetero_cs.engine._compat.replica_xla`); ``keras_one`` and ``keras_one_xla``: the same step on one device (the
  default strategy, the whole batch) without and with XLA, to tell XLA's own effect on this CPU from hetero_cs's;
* ``stock_again``: a second, identical stock strategy: the A/A control. Its ratio to ``stock`` is what the method
  reads when there is no difference at all (the noise floor of the ratios above).

Ratios are paired per round (each round's median step time of a configuration over the same round's median of its
reference), then the median over rounds is reported, which cancels slow drifts of the shared machine's load.
Goals: hetero_even / stock <= 1.03; timing on vs off costs < 2 % of the step time. The XLA figure
(keras_hetero_xla / keras_hetero) is reported, not a goal: what XLA fuses on a CPU is not what it fuses on a GPU.

    python benchmarks/overhead.py [--rounds 60] [--steps-per-round 8] [--json F] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _common  # noqa: E402
from benchmarks._common import log, ms  # noqa: E402

OVERHEAD_GOAL = 1.03
TIMING_GOAL = 0.02
TIMING_ENV_VAR = "HETERO_CS_TIMING"
LABELS = {
    "stock": "stock CentralStorageStrategy",
    "hetero_even": "hetero_cs even split, timing off",
    "hetero_even_timed": "hetero_cs even split, timing on",
    "hetero_even_any_size": "hetero_cs even split, batch size unknown",
    "hetero_auto": "hetero_cs auto_balance (+rebalance)",
    "stock_step": "stock CSS, step only (no input pipeline)",
    "hetero_step": "hetero_cs even, step only (no input pipeline)",
    "keras_stock": "stock CSS, Keras train_step",
    "keras_hetero": "hetero_cs even, Keras train_step, no XLA",
    "keras_hetero_xla": "hetero_cs even, Keras train_step, XLA",
    "keras_one": "one device, Keras train_step, no XLA",
    "keras_one_xla": "one device, Keras train_step, XLA",
    "stock_again": "stock CentralStorageStrategy again (A/A control)",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="benchmarks/overhead.py", description=__doc__.split("\n\n")[0],
                                     epilog="Real compute (no emulation). Outputs go where --json says.")
    parser.add_argument("--replicas", type=int, default=3, help="identical logical CPU compute devices (default 3)")
    parser.add_argument("--global-batch-size", type=int, default=256, help="B (default 256)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="interleaved rounds (default 60; quick 24); many short rounds keep each pair of round "
                             "medians under the same load of the shared machine")
    parser.add_argument("--steps-per-round", type=int, default=None,
                        help="timed steps per configuration per round (default 8; quick 6)")
    parser.add_argument("--warmup-steps", type=int, default=10, help="untimed steps per configuration (default 10)")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and synthetic data")
    parser.add_argument("--quick", action="store_true", help="fewer rounds and steps")
    parser.add_argument("--json", type=Path, default=None, help="write the results to this JSON file")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (24 if args.quick else 60)
    args.steps_per_round = args.steps_per_round or (6 if args.quick else 8)
    if min(args.rounds, args.steps_per_round, args.global_batch_size, args.replicas) < 1 or args.warmup_steps < 0:
        parser.error("--rounds, --steps-per-round, --global-batch-size, --replicas must be >= 1; --warmup-steps >= 0")
    return args


@contextlib.contextmanager
def timing_env(enabled: bool) -> Iterator[None]:
    """Sets or clears HETERO_CS_TIMING while a strategy is built (the strategy reads it in its constructor)."""
    previous = os.environ.get(TIMING_ENV_VAR)
    if enabled:
        os.environ[TIMING_ENV_VAR] = "1"
    else:
        os.environ.pop(TIMING_ENV_VAR, None)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(TIMING_ENV_VAR, None)
        else:
            os.environ[TIMING_ENV_VAR] = previous


def make_keras_train_step(strategy: Any, model: Any):
    """``train_step(iterator) -> loss``: Keras' own ``model.train_step`` in each replica, as ``model.fit`` runs it."""
    import tensorflow as tf

    @tf.function
    def train_step(iterator):
        logs = strategy.run(model.train_step, args=(next(iterator),))
        return strategy.experimental_local_results(logs["loss"])[0]  # the loss tracker's mean, every update run

    return train_step


def paired_ratio(config: _common.Config, reference: _common.Config) -> float:
    """Median over rounds of (config's round median / reference's round median)."""
    return statistics.median(a / b for a, b in zip(config.round_medians_s, reference.round_medians_s))


def main(argv: list[str] | None = None, *, keep_alive: list | None = None) -> int:
    """Runs the benchmark; returns 0 (goals are reported, not enforced)."""
    args = parse_args(argv)
    start_s = time.perf_counter()
    _common.quiet_libraries()
    devices = _common.setup_devices(["CPU"] * args.replicas)  # before TensorFlow initialises
    import keras
    import tensorflow as tf

    from hetero_cs import HeteroCentralStorageStrategy
    from hetero_cs.planning.plan import even_batch_split

    B = args.global_batch_size
    log("hetero_cs overhead benchmark - REAL compute (no emulation), identical logical CPU devices")
    log(f"method: {_common.METHOD_NOTE}; {_common.MODEL_DESCRIPTIONS['mlp']}, B={B}, {args.replicas} compute "
        f"devices {devices}, parameter device /device:CPU:0")
    batch = _common.synthetic_batch("mlp", B, seed=args.seed)
    dataset = _common.batch_dataset(batch)

    # The same batches with their size unknown while tracing (dataset.batch without drop_remainder): a custom loop's
    # step under the even split then gets a branch for each batch smaller than the replicas (a last partial batch).
    any_size = tf.data.Dataset.from_tensor_slices(batch).repeat().batch(B)

    def new_config(name: str, strategy: Any, *, calibrate: bool = False, step_only: bool = False,
                   data: Any = None) -> _common.Config:
        keras.utils.set_random_seed(args.seed)
        with strategy.scope():
            model = _common.build_model("mlp", seed=args.seed)
            optimizer = keras.optimizers.Adam(1e-3)
            model.compile(optimizer=optimizer, loss=_common.loss_function())
        if calibrate:
            calibration_start_s = time.perf_counter()
            strategy.calibrate(model, dataset, progress=False)
            log(f"   {name}: library calibration {time.perf_counter() - calibration_start_s:.1f} s, plan "
                f"{list(strategy.plan.per_replica_batch_sizes)}")
        monitor = getattr(strategy, "monitor", None)
        if step_only:
            source = _common.fixed_distributed_batch(strategy, batch, even_batch_split(B, args.replicas))
        else:
            source = iter(strategy.experimental_distribute_dataset(dataset if data is None else data))
        train_step = _common.make_train_step(strategy, model, optimizer, global_batch_size=B,
                                             from_iterator=not step_only)
        return _common.Config(name, LABELS[name], train_step, source, monitor=monitor, strategy=strategy)

    configs = [new_config("stock", tf.distribute.experimental.CentralStorageStrategy(
        devices, parameter_device="/device:CPU:0"))]
    with timing_env(False):
        configs.append(new_config("hetero_even", HeteroCentralStorageStrategy(
            devices, auto_balance=False, rebalance=False, profile_cache=False)))
        configs.append(new_config("hetero_even_any_size", HeteroCentralStorageStrategy(
            devices, auto_balance=False, rebalance=False, profile_cache=False), data=any_size))
    with timing_env(True):
        configs.append(new_config("hetero_even_timed", HeteroCentralStorageStrategy(
            devices, auto_balance=False, rebalance=False, profile_cache=False)))
    with timing_env(False):
        configs.append(new_config("hetero_auto", HeteroCentralStorageStrategy(
            devices, auto_balance=True, rebalance=True, profile_cache=False), calibrate=True))
    configs.append(new_config("stock_step", tf.distribute.experimental.CentralStorageStrategy(
        devices, parameter_device="/device:CPU:0"), step_only=True))
    with timing_env(False):
        configs.append(new_config("hetero_step", HeteroCentralStorageStrategy(
            devices, auto_balance=False, rebalance=False, profile_cache=False), step_only=True))

    def keras_config(name: str, strategy: Any, *, jit_compile: bool) -> _common.Config:
        keras.utils.set_random_seed(args.seed)
        with strategy.scope():
            model = _common.build_model("mlp", seed=args.seed)
            model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=_common.loss_function(),
                          jit_compile=jit_compile)
            model.optimizer.build(model.trainable_variables)
        source = iter(strategy.experimental_distribute_dataset(dataset))
        return _common.Config(name, LABELS[name], make_keras_train_step(strategy, model), source, strategy=strategy)

    configs.append(keras_config("keras_stock", tf.distribute.experimental.CentralStorageStrategy(
        devices, parameter_device="/device:CPU:0"), jit_compile=False))
    with timing_env(False):
        configs.append(keras_config("keras_hetero", HeteroCentralStorageStrategy(
            devices, auto_balance=False, rebalance=False, profile_cache=False), jit_compile=False))
        configs.append(keras_config("keras_hetero_xla", HeteroCentralStorageStrategy(
            devices, auto_balance=False, rebalance=False, profile_cache=False), jit_compile=True))
    configs.append(keras_config("keras_one", tf.distribute.get_strategy(), jit_compile=False))
    configs.append(keras_config("keras_one_xla", tf.distribute.get_strategy(), jit_compile=True))
    configs.append(new_config("stock_again", tf.distribute.experimental.CentralStorageStrategy(
        devices, parameter_device="/device:CPU:0")))
    by_name = {c.name: c for c in configs}
    if keep_alive is not None:  # freed at exit_now, not here (see _common.exit_now)
        keep_alive.append(configs)

    log(f"   measuring: {args.warmup_steps} warm-up steps, then {args.rounds} rounds x {args.steps_per_round} steps "
        f"per configuration")
    _common.run_interleaved(configs, rounds=args.rounds, steps_per_round=args.steps_per_round,
                            warmup_steps=args.warmup_steps, progress_every=10)

    timed_on = [c.name for c in configs if c.monitor is not None and c.monitor.completed_steps > 0]
    results: dict[str, Any] = {
        "emulated": False,
        "method": _common.METHOD_NOTE + "; interleaved rounds; ratios are medians over rounds of paired round "
                                        "medians",
        "model": _common.MODEL_DESCRIPTIONS["mlp"], "global_batch_size": B, "devices": devices,
        "rounds": args.rounds, "steps_per_round": args.steps_per_round,
        "configs": {c.name: {"label": c.label, "median_step_s": c.median_step_s, "steps": len(c.step_times_s),
                             "round_medians_s": c.round_medians_s,
                             "per_replica_timing": c.name in timed_on} for c in configs},
        "hetero_auto_plan": list(by_name["hetero_auto"].strategy.plan.per_replica_batch_sizes),
        "overhead_ratio": paired_ratio(by_name["hetero_even"], by_name["stock"]),
        "auto_balance_ratio": paired_ratio(by_name["hetero_auto"], by_name["stock"]),
        "timing_ratio": paired_ratio(by_name["hetero_even_timed"], by_name["hetero_even"]),
        "any_size_ratio": paired_ratio(by_name["hetero_even_any_size"], by_name["hetero_even"]),
        "step_only_ratio": paired_ratio(by_name["hetero_step"], by_name["stock_step"]),
        "control_ratio": paired_ratio(by_name["stock_again"], by_name["stock"]),
        "keras_step_ratio": paired_ratio(by_name["keras_hetero"], by_name["keras_stock"]),
        "xla_ratio": paired_ratio(by_name["keras_hetero_xla"], by_name["keras_hetero"]),
        "xla_vs_stock_ratio": paired_ratio(by_name["keras_hetero_xla"], by_name["keras_stock"]),
        "one_device_xla_ratio": paired_ratio(by_name["keras_one_xla"], by_name["keras_one"]),
    }
    results["timing_overhead"] = results["timing_ratio"] - 1.0
    results["timing_overhead_s"] = results["timing_overhead"] * by_name["hetero_even"].median_step_s
    results["goals"] = {"overhead_ratio": OVERHEAD_GOAL, "timing_overhead": TIMING_GOAL}
    results["overhead_goal_met"] = bool(results["overhead_ratio"] <= OVERHEAD_GOAL)
    results["timing_goal_met"] = bool(results["timing_overhead"] < TIMING_GOAL)
    results["goals_met"] = results["overhead_goal_met"] and results["timing_goal_met"]

    log(f"\n== results (real compute; {args.rounds * args.steps_per_round} timed steps per configuration)")
    log(f"   {'configuration':<46} {'median step':>12} {'per-replica timing':>19}")
    for c in configs:
        log(f"   {c.label:<46} {ms(c.median_step_s):>12} {'on' if c.name in timed_on else 'off':>19}")
    log(f"   hetero_cs even / stock        = {results['overhead_ratio']:.3f}   (goal <= {OVERHEAD_GOAL})")
    log(f"   batch size unknown while tracing / known (custom loop, even split) = {results['any_size_ratio']:.3f}")
    log(f"   hetero_cs auto_balance / stock = {results['auto_balance_ratio']:.3f}   (plan "
        f"{results['hetero_auto_plan']}; includes per-replica timing)")
    log(f"   step only (no input pipeline): hetero_cs even / stock = {results['step_only_ratio']:.3f}")
    log(f"   Keras train_step: hetero_cs even / stock = {results['keras_step_ratio']:.3f}; with XLA per replica / "
        f"without = {results['xla_ratio']:.3f}; with XLA / stock = {results['xla_vs_stock_ratio']:.3f}; one "
        f"device with XLA / without = {results['one_device_xla_ratio']:.3f}")
    log(f"   A/A control: stock again / stock = {results['control_ratio']:.3f}   (no difference reads as this)")
    log(f"   per-replica timing on vs off  = {results['timing_overhead'] * 100:+.2f} % of the step "
        f"({results['timing_overhead_s'] * 1e3:+.3f} ms)   (goal < {TIMING_GOAL * 100:.0f} %)")
    log(f"   goals met: overhead {results['overhead_goal_met']}, per-replica timing {results['timing_goal_met']}")
    if args.json is not None:
        _common.write_json(args.json, results)
        log(f"   JSON: {args.json}")
    log(f"   wall time {time.perf_counter() - start_s:.0f} s")
    return 0


if __name__ == "__main__":
    _objects: list = []
    _common.exit_now(main(keep_alive=_objects))
