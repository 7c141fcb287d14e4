"""The main job: train a small CNN on scikit-learn's handwritten digits with auto-balanced central storage.

Run:
    pip install ".[examples]" && python examples/train_digits.py

With two or more GPUs it trains on them. On a machine without GPUs it emulates an A10 + T4 + P100 mix on logical
CPU devices (each replica computes for real on the CPU and also waits for the time the named GPU would take) and
says so. It prints the device table, the calibration per device, the batch plan, Keras' progress bar, the test
accuracy, and examples/s with auto_balance beside the even split measured in the same run, then one summary line
of key=value pairs.

Data: the 1,797 8x8 digit images that ship inside scikit-learn (no download), 80 % train / 20 % held-out test,
or your own ``.npz`` with arrays ``x`` (N, 8, 8) or (N, 8, 8, 1) and ``y`` (N,) via ``--data``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

DEFAULT_EMULATION = "A10,T4,P100"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=20, help="training epochs (default 20)")
    parser.add_argument("--global-batch-size", type=int, default=256,
                        help="examples per optimizer step (B; default 256)")
    parser.add_argument(
        "--emulate",
        default=None,
        help=f"comma-separated catalog devices to emulate on logical CPUs (default on a CPU-only machine: "
        f"{DEFAULT_EMULATION}); 'none' to use the real devices",
    )
    parser.add_argument("--no-auto-balance", action="store_true", help="train with an even split")
    parser.add_argument("--seed", type=int, default=0, help="seed for the data split, weights and shuffling")
    parser.add_argument("--traceback", action="store_true", help="on a hetero_cs error, show the full traceback")
    parser.add_argument("-v", "--verbose", action="store_true", help="also show TensorFlow's start-up lines")
    parser.add_argument("--data", default=None, help="optional .npz with x (N, 8, 8[, 1]) and y (N,)")
    parser.add_argument(
        "--timing-steps", type=int, default=30,
        help="steps per configuration for the examples/s comparison (default 30)"
    )
    args = parser.parse_args(argv)
    if args.epochs < 1 or args.global_batch_size < 1 or args.timing_steps < 1:
        parser.error("--epochs, --global-batch-size and --timing-steps must be >= 1")
    if args.data and not os.path.isfile(args.data):
        parser.error(f"--data {args.data!r}: no such file (an .npz with arrays x (N, 8, 8) and y (N,))")
    return args


def load_digits(path: str | None, seed: int):
    import numpy as np

    if path:
        with np.load(path) as data:
            missing = sorted({"x", "y"} - set(data.files))
            if missing:
                raise SystemExit(f"train_digits.py: error: --data {path} has no array(s) {missing}; it holds "
                                 f"{sorted(data.files)}. Save x (N, 8, 8[, 1]) and y (N,) with np.savez.")
            x, y = data["x"].astype("float32"), data["y"].astype("int32")
        image_ok = x.ndim in (3, 4) and x.shape[1:3] == (8, 8) and (x.ndim == 3 or x.shape[3] == 1)
        if not image_ok or y.shape != x.shape[:1]:
            raise SystemExit(f"train_digits.py: error: --data {path}: x has shape {x.shape} and y {y.shape}; expected "
                             f"x (N, 8, 8) or (N, 8, 8, 1) and y (N,) with the same N.")
        if x.ndim == 3:
            x = x[..., None]
        x /= max(float(x.max()), 1.0)
    else:
        from sklearn.datasets import load_digits as sklearn_digits

        digits = sklearn_digits()
        x = (digits.images.astype("float32") / 16.0)[..., None]  # (1797, 8, 8, 1) in [0, 1]
        y = digits.target.astype("int32")
    from sklearn.model_selection import train_test_split

    return train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)


def build_cnn(num_classes: int, seed: int):
    import keras

    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Flatten(),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dropout(0.25, seed=seed),
            keras.layers.Dense(num_classes),
        ],
        name="digits_cnn",
    )


class StepTimer:
    """A Keras callback that records each training step's wall time in seconds."""

    def __new__(cls):
        import keras

        class _StepTimer(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.step_times_s = []

            def on_train_batch_begin(self, batch, logs=None):
                self._start = time.perf_counter()

            def on_train_batch_end(self, batch, logs=None):
                self.step_times_s.append(time.perf_counter() - self._start)

        return _StepTimer()


def median_step_s(model, dataset, *, steps: int) -> float:
    """The median wall time of `steps` model.fit steps, in seconds (one extra first step is run and dropped)."""
    timer = StepTimer()
    model.fit(dataset, epochs=1, steps_per_epoch=steps + 1, shuffle=False, verbose=0, callbacks=[timer])
    return statistics.median(timer.step_times_s[1:])


def interleaved_step_times(measures, *, total_steps: int) -> dict[str, list[float]]:
    """Median step times (seconds) of several configurations, measured side by side in rotating short rounds.

    `measures` maps a name to a function `measure(steps) -> median step time in seconds` (it pins what it measures,
    e.g. a fixed split). `total_steps` steps per configuration are cut into up to 6 rounds of at least 5 steps; each
    round measures every configuration back to back and the order rotates from round to round (with two
    configurations: which goes first alternates), so a change in the host's load between rounds hits all the
    configurations of a round alike.

    Returns:
        {name: one median step time per round, in round order}.
    """
    names = list(measures)
    rounds = max(1, min(6, total_steps // 5))
    steps = max(1, total_steps // rounds)
    times_s = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times_s[name].append(measures[name](steps))
    return times_s


def fastest_card(strategy, global_batch_size: int) -> tuple[int, str]:
    """(replica index, why) of the card with the highest throughput on the whole global batch.

    Emulated devices: the emulator's own figures (the catalog's modelled step time at B, what the logical device
    waits for), which a busy host does not distort. Real devices: the calibrated cost models at B. Without either
    (real devices and --no-auto-balance) the first device, and the reason says so.
    """
    B, R = global_batch_size, strategy.num_replicas_in_sync
    emulator, cost_models = strategy.emulator, strategy.cost_models
    if emulator is not None and emulator.workload is not None:
        names = [spec.name for spec in emulator.specs]
        times_s = [emulator.step_time_s(i, B) for i in range(R)]
        source = "the emulated catalog figures"
    elif cost_models is not None:
        names = list(strategy.compute_devices)
        times_s = [m.predict_step_time_s(B) for m in cost_models]
        source = "the calibrated cost models"
    else:
        return 0, "no cost models to compare (real devices, --no-auto-balance): the first device"
    index = min(range(R), key=lambda i: times_s[i])
    figures = ", ".join(f"{n} {B / t:.0f}" for n, t in zip(names, times_s))
    return index, f"highest throughput at B={B} by {source} (examples/s: {figures})"


def fastest_alone_model(strategy, model, index: int, build):
    """A model on the strategy's compute device `index` alone: a second HeteroCentralStorageStrategy in this
    process over that one device (same parameter device; emulated: the same card with the main emulator's
    workload and time scale, so the emulated times compare), `build()`'s architecture with `model`'s weights,
    compiled as `compile_model` compiles the main one. No other replica is in its step."""
    import warnings

    import hetero_cs
    from hetero_cs.emulation import Emulator

    main = strategy.emulator
    emulator = None
    if main is not None:
        emulator = Emulator([main.specs[index].name], workload=main.workload, time_scale=main.time_scale)
    with warnings.catch_warnings():  # one compute device: "nothing to balance" is the point here
        warnings.filterwarnings("ignore", message=".*nothing to balance.*")
        alone = hetero_cs.HeteroCentralStorageStrategy(
            [strategy.compute_devices[index]], strategy.parameter_device, emulate=emulator, auto_balance=False,
            rebalance=False, profile_cache=False)
    with alone.scope():
        twin = build()
        compile_model(twin)
    twin.set_weights(model.get_weights())
    return twin


def fits_alone(model, dataset) -> str | None:
    """Runs two steps of `model` (the fastest card alone) on the whole global batch: None when they ran, else why
    not (the whole batch can be more than one card's memory). Also traces its step before the timed rounds."""
    from hetero_cs.devices.device_errors import is_out_of_memory

    try:
        model.fit(dataset, epochs=1, steps_per_epoch=2, shuffle=False, verbose=0)
    except Exception as exc:  # only out of memory is expected here; anything else is a bug to show
        cause = exc  # the strategy wraps a replica's error (ReplicaStepError) and chains the original
        while cause is not None and not is_out_of_memory(cause):
            cause = cause.__cause__
        if cause is None:
            raise
        return f"the whole global batch does not fit in its memory ({str(exc).splitlines()[0][:300]})"
    return None


def theoretical_speedup_vs_fastest(cost_models, plan_sizes, index: int, global_batch_size: int) -> float | None:
    """The fastest card's predicted step on the whole batch over the plan's predicted makespan (its slowest card's
    step), from the cost models (None without them). At a balanced plan, where every card finishes together, that is
    the sum of the cards' throughputs over the fastest card's; a plan that is not balanced (the even split, while
    the guard still tries the solved one) reads what the models predict for it, below 1.0 where it is slower."""
    if cost_models is None:
        return None
    makespan_s = max(m.predict_step_time_s(b) for m, b in zip(cost_models, plan_sizes) if b > 0)
    return cost_models[index].predict_step_time_s(global_batch_size) / makespan_s


def compile_model(model) -> None:
    import keras

    model.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )


def guard_outcome(strategy, *, against_alone: bool = False) -> str:
    """'kept' or 'reverted' (the guard's last decision on a proposed plan, or with ``against_alone`` its last check
    of the plan against the fastest card alone), 'trying' mid-trial, 'none' when it never decided; for the check,
    'replanned' when the card alone was kept but a later re-plan brought other cards back."""
    guard = strategy.balancer.guard
    if guard.in_trial and guard.against_alone == against_alone:
        return "trying"
    decisions = [d for d in guard.decisions if d.against_alone == against_alone]
    if not decisions:
        return "none"
    last = decisions[-1]
    plan = strategy.balancer.plan
    if against_alone and last.kept and plan is not None and (
            tuple(plan.per_replica_batch_sizes) != last.candidate_per_replica_batch_sizes):
        return "replanned"
    return last.outcome


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("hetero_cs").setLevel(logging.INFO)
    logging.getLogger("calibration").setLevel(logging.INFO)

    from hetero_cs.cli import start_tensorflow_quietly

    start_tensorflow_quietly(args.verbose)  # TensorFlow's C++ start-up lines only with --verbose
    import tensorflow as tf

    from hetero_cs import emulation

    gpus = tf.config.list_physical_devices("GPU")  # does not initialise the devices
    emulate = None
    if args.emulate and args.emulate.lower() != "none":
        emulate = [name.strip() for name in args.emulate.split(",") if name.strip()]
    elif args.emulate is None and len(gpus) < 2:
        emulate = DEFAULT_EMULATION.split(",")
    if emulate:
        emulation.setup_logical_devices(emulate)  # before TensorFlow initialises

    import keras

    import hetero_cs
    from hetero_cs.devices import discover_devices, format_device_table

    keras.utils.set_random_seed(args.seed)
    x_train, x_test, y_train, y_test = load_digits(args.data, args.seed)
    num_classes = int(max(y_train.max(), y_test.max())) + 1

    strategy = hetero_cs.HeteroCentralStorageStrategy(emulate=emulate, auto_balance=not args.no_auto_balance)
    print("== devices")
    emulated_as = dict(zip(strategy.compute_devices, emulate or []))
    devices = [dataclasses.replace(d, emulated_as=emulated_as.get(d.name)) for d in discover_devices()]
    print(format_device_table(devices))
    print(f"replicas: {list(strategy.compute_devices)}, parameter device: {strategy.parameter_device}")

    with strategy.scope():
        model = build_cnn(num_classes, args.seed)
        compile_model(model)

    B = args.global_batch_size
    train = (
        tf.data.Dataset.from_tensor_slices((x_train, y_train))
        .shuffle(len(x_train), seed=args.seed, reshuffle_each_iteration=True)
        .batch(B)
    )
    print(f"\n== training: {len(x_train)} train / {len(x_test)} test examples, global batch {B}, {args.epochs} epochs")
    print("(model.fit calibrates on the first global batch, then solves the plan)" if not args.no_auto_balance else "")
    started = time.perf_counter()
    # shuffle=False: the dataset shuffles itself each epoch (Keras ignores `shuffle` for a tf.data.Dataset).
    model.fit(train, epochs=args.epochs, shuffle=False, verbose=2 if not sys.stdout.isatty() else 1)
    train_s = time.perf_counter() - started

    final_plan = strategy.plan  # the summary line reports this plan
    print("\n== batch plan in use at the end of training")
    print(final_plan)
    guard = guard_outcome(strategy)
    alone_check = guard_outcome(strategy, against_alone=True)
    for decision in strategy.balancer.guard.decisions:
        alone = " (the fastest card alone)" if decision.against_alone else ""
        after = "" if decision.next_trial_step is None else f"; no new trial before step {decision.next_trial_step}"
        print(f"guard: {decision.outcome} {list(decision.candidate_per_replica_batch_sizes)}{alone} against "
              f"{list(decision.incumbent_per_replica_batch_sizes)} (candidate/incumbent makespan "
              f"{decision.median_ratio:.3f} over {decision.num_pairs} paired steps: {decision.reason}){after}")

    _, test_accuracy = model.evaluate(x_test, y_test, batch_size=B, verbose=0)
    print(f"\n== test accuracy: {test_accuracy:.4f} on {len(x_test)} held-out examples")

    # Throughput: the plan in use beside the even split and beside the fastest card alone on the whole batch,
    # interleaved in one run (this machine is noisy). Full global batches only: examples/s = B / median step time.
    logging.getLogger("hetero_cs").setLevel(logging.WARNING)  # the plan flips on purpose below
    repeated = train.unbatch().repeat().batch(B, drop_remainder=True)
    R = strategy.num_replicas_in_sync
    plan_sizes = list(final_plan.per_replica_batch_sizes)
    fastest, why_fastest = fastest_card(strategy, B)
    fastest_name = emulate[fastest] if emulate else strategy.compute_devices[fastest]
    print(f"\n== the fastest card alone: {fastest_name} ({strategy.compute_devices[fastest]}), {why_fastest}; it "
          f"trains the whole global batch of {B} on its own, in a second strategy over that one device")
    twin = fastest_alone_model(strategy, model, fastest, lambda: build_cnn(num_classes, args.seed))

    def pinned(shares):
        def measure(steps: int) -> float:
            strategy.set_batch_split(list(shares))  # pinned: no re-plan or guard trial while measuring
            return median_step_s(model, repeated, steps=steps)

        return measure

    measures = {"plan": pinned(plan_sizes)}
    plan_is_even = final_plan.per_replica_batch_sizes == hetero_cs.even_batch_split(B, R)
    if not plan_is_even:  # else (--no-auto-balance, one device, or devices alike) the plan is the even split
        measures["even"] = pinned([1] * R)
    alone_error = fits_alone(twin, repeated)
    if alone_error is None:
        measures["fastest"] = lambda steps: median_step_s(twin, repeated, steps=steps)
    else:
        print(f"the fastest card alone: not measured - {alone_error}")
    note = " (the plan in use is the even split)" if plan_is_even else ""
    print(f"== measuring examples/s: {' vs '.join(measures)}{note}, {args.timing_steps} steps each, in rotating "
          f"rounds ...")
    times_s = interleaved_step_times(measures, total_steps=args.timing_steps)
    strategy.set_batch_split(None)  # back to the auto-balanced plan that was in force
    plan_times_s, fastest_times_s = times_s["plan"], times_s.get("fastest")
    even_times_s = times_s.get("even", plan_times_s)
    plan_eps, even_eps = B / statistics.median(plan_times_s), B / statistics.median(even_times_s)
    fastest_eps = B / statistics.median(fastest_times_s) if fastest_times_s else None
    # Each speedup is the median over rounds of that round's ratio: paired, so load that changes between rounds
    # cancels.
    speedup = statistics.median([e / p for p, e in zip(plan_times_s, even_times_s)])
    vs_fastest_rounds = [f / p for p, f in zip(plan_times_s, fastest_times_s or [])]
    speedup_vs_fastest = statistics.median(vs_fastest_rounds) if vs_fastest_rounds else None
    plan = final_plan
    theoretical = plan.predicted_speedup_vs_even  # None without cost models (--no-auto-balance)
    theoretical_vs_fastest = None  # n/a when the fastest card cannot hold the whole batch
    if alone_error is None:
        theoretical_vs_fastest = theoretical_speedup_vs_fastest(strategy.cost_models, plan_sizes, fastest, B)
    label = "auto_balance" if not args.no_auto_balance else "even split (--no-auto-balance)"
    print("\n== throughput (from the median step time)")
    print(f"{label:>32}: {plan_eps:9.1f} examples/s")
    print(f"{'even split':>32}: {even_eps:9.1f} examples/s")
    if fastest_eps is not None:
        print(f"{f'{fastest_name} alone, whole batch':>32}: {fastest_eps:9.1f} examples/s")
    predicted = f"{theoretical:.2f}x" if theoretical else "n/a without calibration"
    even_rounds = ", ".join(f"{e / p:.2f}" for p, e in zip(plan_times_s, even_times_s))
    print(f"{'speedup vs even':>32}: {speedup:9.2f}x (predicted by the plan: {predicted}; median of "
          f"{len(plan_times_s)} paired round(s): {even_rounds})")
    predicted = f"{theoretical_vs_fastest:.2f}x" if theoretical_vs_fastest else "n/a without calibration"
    if speedup_vs_fastest is not None:
        print(f"{'speedup vs the fastest alone':>32}: {speedup_vs_fastest:9.2f}x (all {R} cards vs {fastest_name} "
              f"alone; theoretical from the cost models, {fastest_name}'s step at B over the plan's makespan: "
              f"{predicted}; median of {len(plan_times_s)} paired round(s): "
              f"{', '.join(f'{r:.2f}' for r in vs_fastest_rounds)})")

    calibration = strategy.calibration
    cached = calibration is not None and calibration.from_cache
    calibration_s = calibration.wall_time_s if calibration is not None and not cached else 0.0
    summary = {
        "test_accuracy": f"{test_accuracy:.4f}",
        "speedup_vs_even": f"{speedup:.3f}",
        "predicted_speedup": f"{theoretical:.3f}" if theoretical else "n/a",
        "speedup_vs_fastest": f"{speedup_vs_fastest:.3f}" if speedup_vs_fastest is not None else "n/a",
        "theoretical_speedup_vs_fastest": f"{theoretical_vs_fastest:.3f}" if theoretical_vs_fastest else "n/a",
        "fastest": fastest_name,
        "fastest_examples_per_s": f"{fastest_eps:.1f}" if fastest_eps is not None else "n/a",
        "examples_per_s": f"{plan_eps:.1f}",
        "even_examples_per_s": f"{even_eps:.1f}",
        "plan": "/".join(str(b) for b in plan.per_replica_batch_sizes),
        "guard": guard,
        "alone_check": alone_check,
        "devices": ",".join(emulate) if emulate else ",".join(strategy.compute_devices),
        "emulated": str(bool(emulate)).lower(),
        "calibration_s": f"{calibration_s:.2f}",  # time spent calibrating in this run
        "calibration_cached": str(cached).lower(),
        "train_s": f"{train_s:.1f}",
        "epochs": str(args.epochs),
    }
    print(" ".join(f"{k}={v}" for k, v in summary.items()))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as exc:  # a clear one-line message for hetero_cs' own errors, the traceback otherwise
        from hetero_cs.errors import HeteroCSError

        if not isinstance(exc, HeteroCSError):
            raise
        if "--traceback" in sys.argv[1:]:
            raise
        print(f"train_digits.py: error: {exc}", file=sys.stderr)
        if exc.__cause__ is not None:  # e.g. the TensorFlow error behind a ReplicaStepError
            print("(add --traceback to see the error it was raised from)", file=sys.stderr)
        sys.exit(2)
