"""Benchmark: memory never caps compute - micro-batched steps on emulated cards with little memory.

What it measures, side by side in one run (timings are EMULATED: real compute on logical CPU devices plus waits for
the named devices' times; the library calibrates and only sees measured wall times):

(a) A mix whose fastest card has the least memory (default ``A10`` holding 16 examples beside a ``T4`` and a
    ``P100`` holding 64 each) at a global batch that fits in one step but where the A10's cap binds (default 128).
    ``model.fit`` with ``micro_batches=False`` (the capped plan) and with the default (micro-batched) run in
    alternating rounds; each round times ``--steps`` steps in steady state (wall clock from the end of the first
    step to the end of the last: every step's host work and Keras' loop included, fit's one-off setup not). Beside them, the
    theoretical maximum: the best any split can do when each card runs its examples in micro-batches of at most its
    cap, one after another, each paying the card's TRUE emulated step time (its per-step fixed cost again per
    micro-batch), with no wait between micro-batches. Goal: micro-batched / theoretical >= 0.95.
(b) A global batch 16x what the cards hold in all: it trains, and its examples/s are reported against the largest
    batch that fits in one step without micro-batches.
(c) Examples lost: the micro-batched runs of (a) and (b) are compared with single-device Keras on the same batches
    (the weights must agree to 1e-5: every example counted once); ``lost`` is 0 when they agree.

    python benchmarks/memory.py [--steps 20] [--rounds 3] [--json F] [--quick]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _common  # noqa: E402
from benchmarks._common import log  # noqa: E402

NAMES = ["A10", "T4", "P100"]
CAPS = (16, 64, 64)
ACTIVATION_BYTES = 1_000_000


def _workload():
    from hetero_cs.emulation import Workload

    # Compute-heavy examples (the per-example time dominates the per-step fixed cost), 1 MB of activations each.
    return Workload(flops_per_example=4e9, parameter_bytes=200_000, activation_bytes_per_example=ACTIVATION_BYTES)


def _emulator():
    from hetero_cs.emulation import Emulator

    workload = _workload()
    names = [f"{n}@{workload.fixed_memory_bytes + cap * ACTIVATION_BYTES}B" for n, cap in zip(NAMES, CAPS)]
    return Emulator(names, workload=workload)


def _model():
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _data(n: int):
    import numpy as np

    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 32)).astype(np.float32), rng.integers(0, 10, size=n).astype(np.int32)


class _Trainer:
    """One strategy and model; ``run(steps)`` times ``steps`` fit steps of ``global_batch_size`` examples."""

    def __init__(self, devices, global_batch_size: int, micro_batches: bool | None):
        from hetero_cs import HeteroCentralStorageStrategy

        self.strategy = HeteroCentralStorageStrategy(devices, emulate=_emulator(), profile_cache=False,
                                                     rebalance=False, guard=False, micro_batches=micro_batches)
        with self.strategy.scope():
            self.model = _model()
        self.B = global_batch_size
        self.initial = self.model.get_weights()
        # Calibration, traces, and the host time per sub-step measured (it settles the number of sub-steps).
        warmup = 8 if global_batch_size <= 4 * sum(CAPS) else 3
        self.model.fit(*_data(global_batch_size * warmup), batch_size=self.B, epochs=1, shuffle=False, verbose=0)

    def run(self, steps: int) -> float:
        """Seconds per step in steady state over ``steps >= 2`` fit steps: wall clock from the end of the first step
        to the end of the last, over ``steps - 1`` (every step's host work and Keras' loop included; fit's setup of
        the dataset and iterator, once per call, is not a per-step cost)."""
        import keras

        ends: list[float] = []

        class _StepEnds(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                ends.append(time.perf_counter())

        x, y = _data(self.B * steps)
        self.model.fit(x, y, batch_size=self.B, epochs=1, shuffle=False, verbose=0, callbacks=[_StepEnds()])
        return (ends[-1] - ends[0]) / (len(ends) - 1)


def _theoretical_s(emulator, global_batch_size: int) -> float:
    """The least makespan when every card runs micro-batches of at most its cap back to back (true times)."""

    def time_of(i: int, b: int) -> float:
        if b == 0:
            return 0.0
        k = math.ceil(b / CAPS[i])
        q, r = divmod(b, k)
        return r * emulator.step_time_s(i, q + 1, step=0) + (k - r) * emulator.step_time_s(i, q, step=0)

    def examples_within(T: float) -> int:
        total = 0
        for i in range(len(CAPS)):
            low, high = 0, global_batch_size
            while low < high:  # the most examples card i finishes within T
                mid = (low + high + 1) // 2
                low, high = (mid, high) if time_of(i, mid) <= T else (low, mid - 1)
            total += low
        return total

    low, high = 0.0, max(time_of(i, global_batch_size) for i in range(len(CAPS)))
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (low, mid) if examples_within(mid) >= global_batch_size else (mid, high)
    return high


def _exactness(trainer: _Trainer, batches: int) -> float:
    """Max |weight difference| after ``batches`` more micro-batched steps vs single-device Keras on the same data."""
    import numpy as np

    reference = _model()
    reference.set_weights(trainer.model.get_weights())
    reference.optimizer.build(reference.trainable_variables)
    start = [np.asarray(v.numpy()) for v in trainer.model.optimizer.variables]
    for variable, value in zip(reference.optimizer.variables, start):
        variable.assign(value)
    x, y = _data(trainer.B * batches)
    trainer.model.fit(x, y, batch_size=trainer.B, epochs=1, shuffle=False, verbose=0)
    reference.fit(x, y, batch_size=trainer.B, epochs=1, shuffle=False, verbose=0)
    return max(float(np.max(np.abs(a - b))) for a, b in zip(trainer.model.get_weights(), reference.get_weights()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--global-batch-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--quick", action="store_true", help="6 steps, 2 rounds (a smoke run)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.rounds = 6, 2
    devices = _common.setup_devices(NAMES)
    _common.quiet_libraries()
    log(f"memory benchmark: {', '.join(f'{n} (holds {c})' for n, c in zip(NAMES, CAPS))}; {_common.EMULATED_NOTE}")

    B = args.global_batch_size
    capped, micro = _Trainer(devices, B, False), _Trainer(devices, B, None)
    plan = micro.strategy.micro_batching.plan_for(B)
    log(f"(a) capped plan {list(capped.strategy.plan.per_replica_batch_sizes)}; micro-batched: {plan.num_sub_steps} "
        f"sub-steps, per replica examples {list(plan.per_replica_batch_sizes)}, micro-batches "
        f"{list(plan.micro_batch_sizes)} x {list(plan.micro_batch_counts)}")
    times: dict[str, list[float]] = {"capped": [], "micro": []}
    for round_ in range(args.rounds):
        for name, trainer in (("capped", capped), ("micro", micro)):
            times[name].append(trainer.run(args.steps))
        log(f"    round {round_ + 1}: capped {times['capped'][-1] * 1e3:.1f} ms/step, micro-batched "
            f"{times['micro'][-1] * 1e3:.1f} ms/step")
    theoretical = _theoretical_s(micro.strategy.emulator, B)
    capped_s, micro_s = statistics.median(times["capped"]), statistics.median(times["micro"])
    a = {"global_batch_size": B, "capped_ms": capped_s * 1e3, "micro_batched_ms": micro_s * 1e3,
         "theoretical_ms": theoretical * 1e3, "speedup_vs_capped": capped_s / micro_s,
         "fraction_of_theoretical": theoretical / micro_s, "sub_steps": plan.num_sub_steps,
         "max_weight_diff": _exactness(micro, 2)}
    log(f"(a) micro-batched vs capped: {a['speedup_vs_capped']:.3f}x; micro-batched / theoretical maximum "
        f"({a['theoretical_ms']:.1f} ms): {a['fraction_of_theoretical']:.3f} (goal >= 0.95); weights vs one device: "
        f"{a['max_weight_diff']:.1e}")

    capacity = sum(CAPS)
    huge = _Trainer(devices, 16 * capacity, None)
    fits = _Trainer(devices, capacity, False)
    huge_s = statistics.median(huge.run(max(3, args.steps // 8)) for _ in range(args.rounds))
    fits_s = statistics.median(fits.run(args.steps) for _ in range(args.rounds))
    b = {"global_batch_size": 16 * capacity, "examples_per_s": 16 * capacity / huge_s,
         "largest_fitting_batch": capacity, "largest_fitting_examples_per_s": capacity / fits_s,
         "sub_steps": huge.strategy.micro_batching.plan_for(16 * capacity).num_sub_steps,
         "max_weight_diff": _exactness(huge, 1)}
    b["ratio"] = b["examples_per_s"] / b["largest_fitting_examples_per_s"]
    log(f"(b) B={b['global_batch_size']} (16x what the cards hold) trains in {b['sub_steps']} sub-steps: "
        f"{b['examples_per_s']:.0f} examples/s vs {b['largest_fitting_examples_per_s']:.0f} at B={capacity} "
        f"without micro-batches ({b['ratio']:.3f}x); weights vs one device: {b['max_weight_diff']:.1e}")
    lost = int(a["max_weight_diff"] > 1e-5) + int(b["max_weight_diff"] > 1e-5)
    log(f"(c) examples lost: {lost}")
    if args.json:
        _common.write_json(args.json, {"emulated": True, "mix": NAMES, "caps": list(CAPS), "a": a, "b": b,
                                       "lost": lost, "fraction_of_theoretical": a["fraction_of_theoretical"]})
    return 0


if __name__ == "__main__":
    _common.exit_now(main())
