"""Several emulated unlike workers on loopback: balanced vs even split under HeteroMultiWorkerMirroredStrategy.

    python benchmarks/multiworker.py [--emulate A10,T4,P100] [--steps 80] [--global-batch-size 2048] [--control]
    python benchmarks/multiworker.py --emulate A10+T4,P100+T4 ...     # 2 workers of 2 replicas each

Runs the same Keras ``fit`` twice as N worker processes on 127.0.0.1 (``hetero_cs.launch``), each worker emulating
its catalog devices, one replica per device (real compute on this CPU plus the named device's modelled step
time): once with an even split (``auto_balance=False``), once with ``auto_balance=True`` (calibration on probe
steps, the chief's plan, the guard). Prints, from the chief:

* ``speedup_vs_even``: median even-split step time / median balanced step time (the last ``--measure`` steps of
  each run, wall time between step ends), beside ``theoretical_speedup``: the emulated even-split makespan / the
  emulated optimal makespan (the emulator's own step-time model, solved with ``solve_batch_split``), and
  ``fraction_of_theoretical`` = their ratio (goal >= 0.95).
* ``all_reduce_share``: 1 - (emulated makespan of the plan served) / (measured step time) in the balanced run: the
  part of a step that is not the slowest replica's compute, i.e. the all-reduces, the plan agreement and Keras.
* ``bound_with_even_runs_fixed_cost``: the even run's step beyond its emulated makespan is work no split shortens;
  with it added to both sides the most balancing can give is (even step) / (optimal makespan + that work). Printed
  beside the theoretical speedup (which leaves it out), not instead of it.
* ``emulation_check``: per replica, its median measured step time / its emulated step time for its slice (1.0 =
  the emulated device is reproduced; above 1 when real compute or CPU contention exceeds the emulated time).
* ``measured_on_final_plan``: the share of the measured balanced steps that were served the final plan (below 1
  when the guard's trial, which serves the even split beside the candidate, or a re-plan reaches into the window:
  raise ``--steps``).
* ``interleaved_speedup_vs_even``: side by side in the balanced run itself. After ``--steps``, the chief alternates
  the even split and the plan auto_balance found for ``--interleave-steps`` steps (``balancer.set_batch_split``,
  agreed like any plan; a block ends once ``--interleave-block`` steps were cut with its split); the ratio of the
  median step on each (steps classified by the split they were cut with, so the steps a hold kept on the old split
  count for it). The same processes, the same load, the same collectives: this is the figure to trust on a shared
  machine, where separate runs drift by a few percent; ``interleaved_fraction_of_theoretical`` divides it by the
  theoretical speedup. The cycle also runs the fastest card alone (the whole batch on the replica with the shortest
  emulated step at B, every other replica idle: it skips its pass and joins the all-reduce with zeros), giving
  ``speedup_vs_fastest`` (median step alone / median step on the plan, side by side) beside
  ``theoretical_speedup_vs_fastest`` (the emulated fastest-alone makespan / the emulated optimal makespan).
* With ``--control``, a third run with the balanced run's final split fixed (``batch_split``: no calibration,
  guard or agreement): ``control_speedup_vs_even`` and ``auto_vs_control`` (control step / balanced step; 1.0 =
  auto-balancing costs nothing beyond the split it finds).
* ``agreed_steps_held_steps``: on the chief, the balanced run's steps that ran the plan agreement and those that
  kept the split agreed before (every step agrees while calibrating and deciding; then one in N).
* With ``--max-batch-sizes`` (each replica's memory cap, as ``max_batch_sizes=`` on real cards), or ``--memory-mix``
  (benchmarks/memory.py's cards and compute-heavy workload: an A10 whose emulated memory holds 16 examples beside a
  T4 and a P100 holding 64, caps from the emulated memory; use ``--global-batch-size 128``): slices past a cap
  run as micro-batches within it in every run. The emulated makespans then price them so (each micro-batch one
  emulated step), and the interleaving also serves the best split within the caps (no micro-batch anywhere), giving
  ``speedup_vs_capped`` (median capped step / median step on the plan, side by side) beside
  ``theoretical_speedup_vs_capped`` (the emulated capped optimum / the emulated micro-batched optimum).

Timings are EMULATED; this machine's CPU cores are shared by all workers. Not a test: it prints ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def _worker(args) -> int:
    import logging

    import hetero_cs

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("hetero_cs").setLevel(logging.INFO if args.verbose else logging.WARNING)

    caps = _caps(args.max_batch_sizes)
    emulate = None
    if args.memory_mix:  # benchmarks/memory.py's emulated cards: caps from their emulated memory
        from benchmarks.memory import _emulator

        emulate = _emulator()
    if args.mode.startswith("fixed:"):  # the control: auto_balance's final split, fixed (no agreement, no probes)
        strategy = hetero_cs.HeteroMultiWorkerMirroredStrategy(
            batch_split=[float(b) for b in args.mode[len("fixed:"):].split(",")], max_batch_sizes=caps,
            emulate=emulate)
    else:
        strategy = hetero_cs.HeteroMultiWorkerMirroredStrategy(auto_balance=args.mode == "auto",
                                                               max_batch_sizes=caps, emulate=emulate)
    import keras
    import numpy as np
    import tensorflow as tf

    B = args.global_batch_size
    rng = np.random.RandomState(0)
    x = rng.normal(size=(B, 784)).astype("float32")
    y = rng.randint(0, 10, size=(B,)).astype("int64")
    interleaved = args.interleave_steps if args.mode == "auto" else 0
    dataset = tf.data.Dataset.from_tensors((x, y)).repeat(args.steps + interleaved)
    with strategy.scope():
        model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(256, activation="relu"),
                                  keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)])
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    ends, samples, splits, agreed = [], [], [], []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            ends.append(time.perf_counter())
            splits.append(strategy.last_split)
            agreed.append(strategy.agreement_counts[0])
            sample = strategy.balancer.monitor.last_step()
            if sample is not None and (not samples or samples[-1].step != sample.step):
                samples.append(sample)

    R = strategy.num_replicas_in_sync
    emulator = strategy.emulator
    from hetero_cs.planning.micro_batches import micro_batched_curves

    class Emulated:  # a replica's emulated step (one pass of b examples), from the emulator's own model
        def __init__(self, i):
            self.i = i

        def predict_step_time_s(self, b):
            return emulator.step_time_s(self.i, int(b), step=0) if b > 0 else 0.0

    def in_force():  # the caps in force (given, or from the emulated memory once fit started)
        return strategy.micro_batching.max_batch_sizes

    found = {}  # the chief's: the plan auto_balance found, and the even split, as served in the interleaved steps

    class Interleave(keras.callbacks.Callback):
        """After args.steps, the chief cycles through the even split, the found plan and the fastest card alone
        (the whole batch on it, every other replica idle): each block lasts until args.interleave_block steps were
        cut with its split (a switch reaches the workers at the next agreement, so a hold can keep the old split
        for a few steps)."""

        def __init__(self):
            super().__init__()
            self.target, self.served = None, 0
            self.order = ["even", "plan", "alone"]

        def on_train_batch_begin(self, batch, logs=None):
            if batch < args.steps:
                return
            if self.target is None:
                found["plan"] = tuple(strategy.plan.per_replica_batch_sizes)
                fastest = min(range(R), key=lambda i: strategy.emulator.step_time_s(i, B, step=0))
                found["fastest_replica"] = fastest
                self.shares = {"even": [1.0] * R, "plan": list(found["plan"]),
                               "alone": [1.0 if i == fastest else 0.0 for i in range(R)]}
                if in_force() is not None:  # the best split within the caps: one pass per slice, no micro-batch
                    self.order.append("capped")
                    within = hetero_cs.solve_batch_split([Emulated(i) for i in range(R)], B,
                                                         max_batch_sizes=in_force())
                    self.shares["capped"] = list(within.per_replica_batch_sizes)
                self._switch("even")
                return
            self.served += strategy.last_split == self.target
            if self.served >= args.interleave_block:
                self._switch(self.order[(self.order.index(self.name) + 1) % len(self.order)])

        def _switch(self, name):
            strategy.balancer.set_batch_split(self.shares[name])
            self.name, self.target, self.served = name, tuple(strategy.plan.per_replica_batch_sizes), 0
            found[name] = self.target

    callbacks = [Clock()] + ([Interleave()] if interleaved and strategy.is_chief else [])
    model.fit(dataset, epochs=1, verbose=0, callbacks=callbacks)
    if not strategy.is_chief:
        return 0
    step_s = [b - a for a, b in zip(ends, ends[1:])]  # step_s[j]: the duration of step j + 1
    measured = step_s[args.steps - 1 - args.measure:args.steps - 1]  # the last args.measure steps before interleaving
    final_splits = splits[args.steps - args.measure:args.steps]
    sizes = list(found["plan"] if interleaved else strategy.plan.per_replica_batch_sizes)
    even = list(hetero_cs.even_batch_split(B, R))
    side_by_side = {}
    if interleaved:
        for name in ("even", "plan", "alone", "capped"):
            split = found.get(name)
            side_by_side[name] = [] if split is None else [
                t for t, cut in zip(step_s[args.steps:], splits[args.steps + 1:]) if cut == tuple(split)]

    # With caps, a slice past one runs as micro-batches, each one emulated step.
    caps = in_force()
    curves = [Emulated(i) for i in range(R)] if caps is None else micro_batched_curves(
        [Emulated(i) for i in range(R)], caps)
    optimal = hetero_cs.solve_batch_split(curves, B)
    capped = None if caps is None else hetero_cs.solve_batch_split([Emulated(i) for i in range(R)], B,
                                                                   max_batch_sizes=caps)
    even_makespan = max(curves[i].predict_step_time_s(b) for i, b in enumerate(even))
    served_makespan = max(curves[i].predict_step_time_s(b) for i, b in enumerate(sizes))
    recent = [s for s in samples[-args.measure:] if list(s.per_replica_batch_sizes) == sizes]
    check = []
    for i in range(R):
        times = [s.per_replica_step_times_s[i] for s in recent]
        check.append(statistics.median(times) / curves[i].predict_step_time_s(sizes[i]) if times else None)
    result = {
        "mode": args.mode,
        "emulate": [spec.name for spec in emulator.specs],
        "plan": sizes,
        "median_step_s": statistics.median(measured),
        "even_makespan_emulated_s": even_makespan,
        "optimal_makespan_emulated_s": optimal.predicted_makespan_s,
        "optimal_plan": list(optimal.per_replica_batch_sizes),
        "served_makespan_emulated_s": served_makespan,
        "fastest_replica": found.get("fastest_replica"),
        "fastest_alone_makespan_emulated_s": (curves[found["fastest_replica"]].predict_step_time_s(B)
                                              if "fastest_replica" in found else None),
        "capped_makespan_emulated_s": None if capped is None else capped.predicted_makespan_s,
        "caps": caps,
        "emulation_check": check,
        # Of the measured steps, how many were served the final plan (the rest: the guard's trial still serving
        # the even split beside it, or a re-plan). Below 1, the window includes the plan's search.
        "measured_on_final_plan": sum(split == tuple(sizes) for split in final_splits) / args.measure,
        # The interleaved steps (auto only): every step's time, by the split it was cut with.
        "interleaved_step_s": side_by_side,
        # Steps that ran the plan agreement / steps that kept the split agreed before (auto_balance only).
        "agreement_counts": list(strategy.agreement_counts),
        # For a closer look (not printed): every step's wall time, and whether it ran the agreement.
        "step_s": step_s,
        "step_agreed": [b > a for a, b in zip(agreed, agreed[1:])],
    }
    Path(args.out).write_text(json.dumps(result))
    return 0


def _caps(text):
    """``--max-batch-sizes`` as a list (None: no caps)."""
    if not text:
        return None
    return [None if c.strip() == "n" else int(c) for c in text.split(",")]


def _launch(args, mode: str, out: Path) -> dict:
    from hetero_cs.launch import Launch, parse_emulate

    emulate = parse_emulate(args.emulate, len(args.emulate.split(",")))
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--mode", mode, "--out", str(out),
               "--steps", str(args.steps), "--measure", str(args.measure),
               "--global-batch-size", str(args.global_batch_size), "--interleave-steps", str(args.interleave_steps),
               "--interleave-block", str(args.interleave_block)] + (["--verbose"] if args.verbose else []) + (
                  ["--max-batch-sizes", args.max_batch_sizes] if args.max_batch_sizes else []) + (
                  ["--memory-mix"] if args.memory_mix else [])
    with open(os.devnull, "w") as quiet:
        output = None if args.verbose else quiet
        status = Launch(command, num_workers=len(emulate), emulate=emulate, output=output).run()
    if status != 0:
        raise SystemExit(f"the {mode} run failed with status {status} (rerun with --verbose)")
    return json.loads(out.read_text())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--emulate", default="A10,T4,P100",
                        help="each worker's catalog devices, comma-separated; several per worker joined by + "
                             "(2-3 workers advised)")
    parser.add_argument("--steps", type=int, default=80, help="training steps of each run (one global batch each)")
    parser.add_argument("--measure", type=int, default=30, help="the last of each run's --steps that are measured")
    parser.add_argument("--global-batch-size", type=int, default=2048,
                        help="B; at small B this model's emulated step is mostly fixed overhead and shows little gain")
    parser.add_argument("--interleave-steps", type=int, default=108,
                        help="after --steps, the balanced run cycles through the even split, its plan and the fastest "
                             "card alone for this many "
                             "steps (0: off)")
    parser.add_argument("--interleave-block", type=int, default=12,
                        help="steps cut with one split before the interleaving switches to the other")
    parser.add_argument("--max-batch-sizes", default=None,
                        help="each replica's memory cap in examples, comma-separated (n: none), e.g. 256,n,n: slices "
                             "past a cap run as micro-batches; the interleaving adds the best split within the caps")
    parser.add_argument("--memory-mix", action="store_true",
                        help="benchmarks/memory.py's emulated cards and compute-heavy workload (caps from emulated "
                             "memory: A10 16, T4 64, P100 64 examples); pair with --global-batch-size 128")
    parser.add_argument("--json", default=None, help="also write the summary to this JSON file")
    parser.add_argument("--keep-steps", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--control", action="store_true",
                        help="a third run with auto_balance's final split fixed (batch_split): what the agreement, "
                             "calibration and guard cost beside the same split")
    parser.add_argument("--verbose", action="store_true", help="show the workers' output")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="auto", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(args)
    with tempfile.TemporaryDirectory() as tmp:
        even = _launch(args, "even", Path(tmp) / "even.json")
        auto = _launch(args, "auto", Path(tmp) / "auto.json")
        if args.keep_steps:
            Path(args.keep_steps).write_text(json.dumps({"even": even, "auto": auto}))
        control = None
        if args.control:
            control = _launch(args, "fixed:" + ",".join(str(b) for b in auto["plan"]), Path(tmp) / "control.json")
    speedup = even["median_step_s"] / auto["median_step_s"]
    theoretical = auto["even_makespan_emulated_s"] / auto["optimal_makespan_emulated_s"]
    summary = {
        "emulate": auto["emulate"],
        "global_batch_size": args.global_batch_size,
        "plan": auto["plan"],
        "even_step_ms": even["median_step_s"] * 1e3,
        "balanced_step_ms": auto["median_step_s"] * 1e3,
        "speedup_vs_even": speedup,
        "theoretical_speedup": theoretical,
        "fraction_of_theoretical": speedup / theoretical,
        "even_makespan_emulated_ms": auto["even_makespan_emulated_s"] * 1e3,
        "optimal_makespan_emulated_ms": auto["optimal_makespan_emulated_s"] * 1e3,
        "optimal_plan_emulated": auto["optimal_plan"],
        "served_makespan_emulated_ms": auto["served_makespan_emulated_s"] * 1e3,
        # What the split cannot shorten: the even run's step beyond its emulated makespan (all-reduces, agreement,
        # Keras), paid by both runs. With it, the most balancing can give is (even + fixed) / (optimal + fixed).
        "bound_with_even_runs_fixed_cost": (even["median_step_s"]) / (
            auto["optimal_makespan_emulated_s"] + even["median_step_s"] - auto["even_makespan_emulated_s"]),
        "all_reduce_share": 1.0 - auto["served_makespan_emulated_s"] / auto["median_step_s"],
        "emulation_check": auto["emulation_check"],
        "measured_on_final_plan": auto["measured_on_final_plan"],
        "agreed_steps_held_steps": auto["agreement_counts"],
    }
    interleaved = auto["interleaved_step_s"]
    if interleaved:
        even_s, plan_s = interleaved["even"], interleaved["plan"]
        summary["interleaved_steps_even_plan"] = [len(even_s), len(plan_s)]
        if even_s and plan_s:
            summary["interleaved_speedup_vs_even"] = statistics.median(even_s) / statistics.median(plan_s)
            summary["interleaved_fraction_of_theoretical"] = summary["interleaved_speedup_vs_even"] / theoretical
        alone_s = interleaved.get("alone", [])
        summary["interleaved_steps_alone"] = len(alone_s)
        if alone_s and plan_s and auto["fastest_alone_makespan_emulated_s"]:
            theoretical_fastest = auto["fastest_alone_makespan_emulated_s"] / auto["optimal_makespan_emulated_s"]
            summary["fastest_card"] = auto["emulate"][auto["fastest_replica"]]
            summary["speedup_vs_fastest"] = statistics.median(alone_s) / statistics.median(plan_s)
            summary["theoretical_speedup_vs_fastest"] = theoretical_fastest
            summary["speedup_vs_fastest_fraction_of_theoretical"] = summary["speedup_vs_fastest"] / theoretical_fastest
        capped_s = interleaved.get("capped", [])
        if capped_s and plan_s and auto["capped_makespan_emulated_s"]:
            summary["caps"] = auto["caps"]
            summary["interleaved_steps_capped"] = len(capped_s)
            summary["speedup_vs_capped"] = statistics.median(capped_s) / statistics.median(plan_s)
            summary["theoretical_speedup_vs_capped"] = (auto["capped_makespan_emulated_s"]
                                                       / auto["optimal_makespan_emulated_s"])
            summary["speedup_vs_capped_fraction_of_theoretical"] = (summary["speedup_vs_capped"]
                                                                   / summary["theoretical_speedup_vs_capped"])
        if not (even_s and plan_s):
            print(f"no interleaved figure: {len(even_s)} steps on the even split and {len(plan_s)} on the plan in "
                  f"--interleave-steps {args.interleave_steps} (the holds between agreements are long at short steps: "
                  f"raise --interleave-steps)")
    if control is not None:
        summary["control_speedup_vs_even"] = even["median_step_s"] / control["median_step_s"]
        summary["auto_vs_control"] = control["median_step_s"] / auto["median_step_s"]
    workers = args.emulate.split(",")
    print(f"timings are EMULATED ({' | '.join(w.strip() for w in workers)}: {len(workers)} workers of "
          f"{len(auto['emulate']) // len(workers)} replica(s) each, on loopback)")
    for key, value in summary.items():
        print(f"{key}={value}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
