"""Benchmark: how close ``hetero-cs plan --devices``'s what-if predictions come to measured runs (emulated devices).

For each mix, in a child process of its own (logical devices are configured once per process):

* **Predicted.** :func:`hetero_cs.devices.what_if.what_if` on the mix's catalog names and the workload, times the
  emulator's time scale: the plan (examples and micro-batches per card, idle cards) and the step time it predicts.
* **Measured.** ``model.fit`` under ``HeteroCentralStorageStrategy(emulate=Emulator(mix, workload=...))``: the
  library calibrates the emulated cards, solves its own plan, then trains ``--steps`` steps, timed by the wall clock
  (host work, dispatch and waits included), over ``--rounds`` rounds; the median is reported.

Figures per mix: ``step_ratio`` = measured / predicted step; ``plan_moved`` = the examples the calibrated plan places
on other cards than the what-if's (half the L1 distance of the two splits), as a share of ``B``; ``same_idle`` and
``same_sub_steps`` compare which cards sit idle and the number of sub-steps.

What this does and does not measure. An emulated card waits for the time the same catalog model gives
(:func:`hetero_cs.devices.emulation.emulated_step_time_s`), so here the what-if's card model is exact by
construction: the gap measured is what the what-if leaves out (the host's time per step and per sub-step, the
framework's own per-step costs, calibration's fitted curves against the true ones, real compute showing through).
How far real cards are from their published figures needs real GPUs, and is not measured here.

    python benchmarks/what_if_accuracy.py [--steps 20] [--rounds 3] [--json F] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _common  # noqa: E402
from benchmarks._common import log  # noqa: E402

GLOBAL_BATCH_SIZE = 128
ACTIVATION_BYTES = 1_000_000
MIXES = {
    "A10,T4,P100": ["A10", "T4", "P100"],
    "A10,T4": ["A10", "T4"],
    "A10,T4,P100,CPU": ["A10", "T4", "P100", "CPU"],
    "A10 holding 16,T4,P100 (micro-batches)": ["A10@16", "T4", "P100"],
}


def _workload():
    from hetero_cs.emulation import Workload

    # Compute-heavy examples (the per-example time dominates the fixed cost per step), 1 MB of activations each.
    return Workload(flops_per_example=4e9, parameter_bytes=200_000, activation_bytes_per_example=ACTIVATION_BYTES)


def _names(mix: list[str]) -> list[str]:
    """Catalog names; ``NAME@<examples>`` becomes a memory override that holds that many examples."""
    workload = _workload()
    names = []
    for name in mix:
        base, _, examples = name.partition("@")
        names.append(f"{base}@{workload.fixed_memory_bytes + int(examples) * ACTIVATION_BYTES}B" if examples else base)
    return names


def _child(mix: list[str], steps: int, rounds: int) -> dict[str, Any]:
    """Runs in the mix's own process: the what-if and the measured run, as a JSON-ready dict."""
    names = _names(mix)
    devices = _common.setup_devices(names)
    import keras
    import numpy as np

    from hetero_cs import HeteroCentralStorageStrategy
    from hetero_cs.devices.what_if import what_if
    from hetero_cs.emulation import Emulator

    emulator = Emulator(names, workload=_workload())
    strategy = HeteroCentralStorageStrategy(devices, emulate=emulator, profile_cache=False, rebalance=False,
                                            guard=False)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(10)])
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    B = GLOBAL_BATCH_SIZE
    rng = np.random.default_rng(0)

    def data(n):
        return rng.normal(size=(n, 32)).astype(np.float32), rng.integers(0, 10, size=n).astype(np.int32)

    model.fit(*data(B * 8), batch_size=B, epochs=1, shuffle=False, verbose=0)  # calibration, traces, settling
    measured = []
    for _ in range(rounds):
        x, y = data(B * steps)
        start = time.perf_counter()
        model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
        measured.append((time.perf_counter() - start) / steps)
    predicted = what_if(names, B, _workload())
    micro = strategy.micro_batching.last_plan
    used = micro if micro is not None and strategy.micro_batching.micro_batched_steps else None
    split = list(used.per_replica_batch_sizes) if used is not None else list(strategy.plan.per_replica_batch_sizes)
    sub_steps = used.num_sub_steps if used is not None else 1
    predicted_s = predicted["predicted_step_s"] * emulator.time_scale
    moved = sum(abs(a - b) for a, b in zip(split, predicted["per_replica_batch_sizes"])) / 2
    return {
        "mix": mix, "global_batch_size": B, "time_scale": emulator.time_scale,
        "predicted_split": predicted["per_replica_batch_sizes"], "measured_split": split,
        "predicted_sub_steps": predicted["sub_steps"], "measured_sub_steps": sub_steps,
        "predicted_idle": predicted["idle"], "measured_idle": [i for i, b in enumerate(split) if b == 0],
        "predicted_step_s": predicted_s, "measured_step_s": statistics.median(measured),
        "measured_step_s_rounds": measured,
        "step_ratio": statistics.median(measured) / predicted_s,
        "plan_moved": moved / B,
        "same_idle": predicted["idle"] == [i for i, b in enumerate(split) if b == 0],
        "same_sub_steps": predicted["sub_steps"] == sub_steps,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round (default 20)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per mix (default 3; the median)")
    parser.add_argument("--quick", action="store_true", help="5 steps, 1 round: a smoke run, not figures to quote")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.rounds < 1:
        parser.error(f"--steps and --rounds must be >= 1; got {args.steps} and {args.rounds}")
    if args.quick:
        args.steps, args.rounds = 5, 1
    if args.child is not None:
        print("RESULT " + json.dumps(_child(args.child.split(","), args.steps, args.rounds)))
        return 0
    results = []
    start = time.perf_counter()
    for label, mix in MIXES.items():
        log(f"-- {label}")
        done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", ",".join(mix),
                               "--steps", str(args.steps), "--rounds", str(args.rounds)],
                              capture_output=True, text=True, check=False, cwd=_common.REPO_ROOT)
        line = next((row for row in done.stdout.splitlines() if row.startswith("RESULT ")), None)
        if done.returncode != 0 or line is None:
            log(done.stderr[-3000:])
            log(f"the run for {label} failed (exit status {done.returncode})")
            return 1
        result = json.loads(line[len("RESULT "):])
        result["label"] = label
        results.append(result)
        log(f"   what-if {result['predicted_split']} in {result['predicted_sub_steps']} sub-step(s), "
            f"{result['predicted_step_s'] * 1e3:.1f} ms; calibrated {result['measured_split']} in "
            f"{result['measured_sub_steps']}, measured {result['measured_step_s'] * 1e3:.1f} ms "
            f"(rounds {', '.join(f'{s * 1e3:.1f}' for s in result['measured_step_s_rounds'])})")
        log(f"   step_ratio {result['step_ratio']:.3f}  plan_moved {result['plan_moved']:.3f}  "
            f"same_idle {result['same_idle']}  same_sub_steps {result['same_sub_steps']}")
    if args.json is not None:
        _common.write_json(args.json, {"results": results})
        log(f"JSON: {args.json}")
    log(f"wall time {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
