"""Benchmark: a long fit with re-balancing and probes of idle cards - traces, memory and the cost of a probe step.

What it measures. ``model.fit`` trains the benchmarks' CNN (B = 256) for ``--steps`` steps (default 2,000) with
``HeteroCentralStorageStrategy(auto_balance=True, rebalance=True)`` on an emulated mix (default A10,T4,P100) at an
emulated step of ``--target-ms`` (10 ms). From ``--slow-at`` (300) until ``--recover-at`` (1,200) the emulator's drift
makes one card (``--slow-replica``, default 1, the T4) ``--factor`` (4x) slower: the re-planner leaves it out, and
every 40 steps a probe times it on one example, in a step of its own beside training. Timings are EMULATED (real
compute on logical CPU devices plus waits for the named devices' times; the library only sees measured wall times).

It reports:

* ``retraces``: how often fit traced its train step again (logged by the library at INFO: once per set of active
  replicas its plans run), and the sets of active replicas plans used;
* ``rss_mb``: the process's resident memory after steps 200, 1,000 and the last; ``rss_growth_after_200`` =
  (last - step 200) / step 200 (goal < 0.05);
* ``probe_step_over_plain``: the median wall time of the steps with a probe (one started in the step or running
  at its start or end) over the median of the plain steps of the same plan, from step 200 on (goal <= 1.5);
  ``first_probe_step_ms``: the step that started the first probe, which traces the card's probe step in fit's
  thread. ``probe_modelled_over_plain`` is what the emulator's models make the same steps: 1.0 for probes beside
  training, the probed card's own time for one example (its fixed cost, times the drift) over the plan's step for a
  probe in the step (3.75x here); ``probe_over_modelled`` (the first over the second, per probe) is what the library
  adds.

``--xla`` compiles with ``jit_compile=True`` (XLA per replica). ``--quick``: 600 steps, slow in [200, 450).

    python benchmarks/long_run.py [--steps 2000] [--target-ms 10] [--xla] [--json F] [--quick]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _common  # noqa: E402
from benchmarks._common import log  # noqa: E402

RSS_GROWTH_GOAL = 0.05
PROBE_COST_GOAL = 1.5


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="benchmarks/long_run.py", description=__doc__.split("\n\n")[0],
                                     epilog="Timings are emulated (see the module docstring).")
    parser.add_argument("--mix", default="A10,T4,P100", help="device mix (default A10,T4,P100)")
    parser.add_argument("--global-batch-size", type=int, default=256, help="B (default 256)")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 2000; quick 600)")
    parser.add_argument("--target-ms", type=float, default=10.0, help="emulated even-split step (default 10 ms)")
    parser.add_argument("--slow-replica", type=int, default=1, help="the card that slows down (default 1)")
    parser.add_argument("--factor", type=float, default=4.0, help="its slow-down (default 4)")
    parser.add_argument("--slow-at", type=int, default=None, help="step it slows down (default 300; quick 200)")
    parser.add_argument("--recover-at", type=int, default=None, help="step it recovers (default 1200; quick 450)")
    parser.add_argument("--xla", action="store_true", help="compile(jit_compile=True): XLA per replica")
    parser.add_argument("--quick", action="store_true", help="600 steps")
    parser.add_argument("--json", type=Path, default=None, help="write the results to this JSON file")
    args = parser.parse_args(argv)
    args.steps = args.steps or (600 if args.quick else 2000)
    args.slow_at = args.slow_at if args.slow_at is not None else (200 if args.quick else 300)
    args.recover_at = args.recover_at if args.recover_at is not None else (450 if args.quick else 1200)
    if not 200 < args.steps or not 0 <= args.slow_at < args.recover_at <= args.steps:
        parser.error("need --steps > 200 and 0 <= --slow-at < --recover-at <= --steps")
    args.names = _common.parse_mix(args.mix)
    return args


def rss_mb() -> float:
    """The process's resident memory now, MB (Linux /proc; NaN elsewhere)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6
    except (OSError, ValueError, IndexError):
        return float("nan")


class _Retraces(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.steps: list[int] = []
        self.step = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "tracing the train step again" in record.getMessage():
            self.steps.append(self.step)


def main(argv: list[str] | None = None, *, keep_alive: list | None = None) -> int:
    """Runs the benchmark; returns 0 (the goals are reported, not enforced)."""
    args = parse_args(argv)
    started_s = time.perf_counter()
    _common.quiet_libraries()
    os.environ["HETERO_CS_EMULATION_TARGET_MAKESPAN_MS"] = f"{args.target_ms:g}"
    devices = _common.setup_devices(args.names)  # before TensorFlow initialises
    import keras

    from hetero_cs import HeteroCentralStorageStrategy
    from hetero_cs.emulation import Drift, Emulator

    B = args.global_batch_size
    log(f"hetero_cs long-run benchmark - {_common.EMULATED_NOTE}")
    log(f"   model.fit, CNN, B={B}, mix {_common.mix_label(args.names)}, {args.steps} steps of ~{args.target_ms:g} ms; "
        f"replica {args.slow_replica} x{args.factor:g} slower in steps [{args.slow_at}, {args.recover_at}); "
        f"XLA per replica {'on' if args.xla else 'off'}")
    emulator = Emulator(args.names, drift=[Drift(args.slow_replica, args.factor, args.slow_at, args.recover_at)])
    strategy = HeteroCentralStorageStrategy(devices, emulate=emulator, profile_cache=False)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = _common.build_model("cnn")
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=_common.loss_function(), jit_compile=args.xla)
    retraces = _Retraces()
    logging.getLogger("hetero_cs").addHandler(retraces)
    logging.getLogger("hetero_cs").setLevel(logging.INFO)
    for handler in logging.getLogger().handlers:  # the library's INFO lines stay out of the output
        handler.setLevel(logging.WARNING)
    wall_s: list[float] = []
    sizes: list[tuple[int, ...] | None] = []
    probes: list[bool] = []
    first_probe_ms: list[float] = []
    rss: dict[int, float] = {}
    changes: list = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.start_s = time.perf_counter()
            self.probes = strategy.balancer.probes
            self.probing = strategy._idle_probes.running  # noqa: SLF001 - a probe beside training runs now

        def on_train_batch_end(self, batch, logs=None):
            wall_s.append(time.perf_counter() - self.start_s)
            sample = strategy.monitor.last_step()
            sizes.append(tuple(sample.per_replica_batch_sizes) if sample is not None else None)
            started = strategy.balancer.probes > self.probes
            if started and not first_probe_ms:
                first_probe_ms.append(wall_s[-1] * 1e3)
            probes.append(started or self.probing or strategy._idle_probes.running)  # noqa: SLF001
            retraces.step = len(wall_s)
            if len(wall_s) % 10 == 0 or len(wall_s) in (1, args.steps):
                rss[len(wall_s)] = rss_mb()
            if len(wall_s) > 1 and sizes[-1] != sizes[-2] and not probes[-1] and not probes[-2]:
                changes.append((len(wall_s), sizes[-1]))
            if len(wall_s) in (200, 1000, args.steps) or len(wall_s) % 250 == 0:
                plan = list(strategy.plan.per_replica_batch_sizes)
                log(f"   step {len(wall_s):>5}: rss {rss[len(wall_s)]:.0f} MB, median of the last 50 steps "
                    f"{statistics.median(wall_s[-50:]) * 1e3:.1f} ms, plan {plan}, retraces so far {len(retraces.steps)}")

    dataset = _common.batch_dataset(_common.synthetic_batch("cnn", B))
    model.fit(dataset, epochs=1, steps_per_epoch=args.steps, verbose=0, callbacks=[Record()])
    if keep_alive is not None:
        keep_alive.append([strategy, model, dataset])

    # Probe steps against the plain steps of the plan they probed (the step before each probe ran it), from step 200.
    def modelled_s(split, step):
        return max(emulator.step_time_s(i, b, step=step) for i, b in enumerate(split))

    probe_s, plain_s, modelled = [], [], []
    for t in range(200, len(wall_s)):
        if probes[t] and sizes[t - 1] is not None and sizes[t] is not None:
            plain = [wall_s[u] for u in range(max(200, t - 20), t) if not probes[u] and sizes[u] == sizes[t - 1]]
            if plain:
                probe_s.append(wall_s[t])
                plain_s.append(statistics.median(plain))
                modelled.append(modelled_s(sizes[t], t) / modelled_s(sizes[t - 1], t))
    ratios = [p / q for p, q in zip(probe_s, plain_s)]
    results: dict[str, Any] = {
        "emulated": True, "note": _common.EMULATED_NOTE, "mix": _common.mix_label(args.names), "xla": args.xla,
        "steps": args.steps, "target_ms": args.target_ms, "global_batch_size": B,
        "drift": {"replica_id": args.slow_replica, "factor": args.factor, "from_step": args.slow_at,
                  "until_step": args.recover_at},
        "retraces": len(retraces.steps), "retrace_steps": retraces.steps,
        "traced_sets": [list(s) for s in strategy._active_sets.for_trace(training=True)],  # noqa: SLF001
        "rss_mb": {str(k): v for k, v in sorted(rss.items())},
        "split_changes": changes,
        "probes": strategy.balancer.probes, "steps_with_probes": sum(probes),
        "first_probe_step_ms": first_probe_ms[0] if first_probe_ms else None,
        "probe_step_over_plain": statistics.median(ratios) if ratios else None,
        "probe_modelled_over_plain": statistics.median(modelled) if modelled else None,
        # What the library adds to a probe step: its wall ratio over what the emulator's models make it.
        "probe_over_modelled": statistics.median(r / m for r, m in zip(ratios, modelled)) if ratios else None,
        "median_step_ms": statistics.median(wall_s[200:]) * 1e3,
    }
    first, last = rss.get(200), rss.get(args.steps)
    results["rss_growth_after_200"] = (last - first) / first if first and last else None
    results["goals"] = {"rss_growth_after_200": RSS_GROWTH_GOAL, "probe_step_over_plain": PROBE_COST_GOAL}
    log("\n== results (timings EMULATED; wall clock of this host, which other work shares)")
    log(f"   retraces {results['retraces']} (at steps {retraces.steps}); sets plans used {results['traced_sets']}")
    log(f"   rss {first:.0f} MB at step 200, {last:.0f} MB at step {args.steps}: growth "
        f"{results['rss_growth_after_200'] * 100:+.1f} % (goal < {RSS_GROWTH_GOAL * 100:.0f} %)")
    if ratios:
        log(f"   {len(ratios)} probe steps: median {results['probe_step_over_plain']:.2f}x the plain step of their "
            f"plan (goal <= {PROBE_COST_GOAL}); the emulator's models alone give "
            f"{results['probe_modelled_over_plain']:.2f}x, so the library's own part is "
            f"{results['probe_over_modelled']:.2f}x")
    if first_probe_ms:
        log(f"   {results['probes']} probes; the step of the first (it traces the probe step): "
            f"{first_probe_ms[0]:.0f} ms")
    log(f"   median step from step 200: {results['median_step_ms']:.1f} ms; wall time "
        f"{time.perf_counter() - started_s:.0f} s")
    if args.json is not None:
        _common.write_json(args.json, results)
        log(f"   JSON: {args.json}")
    return 0


if __name__ == "__main__":
    _objects: list = []
    _common.exit_now(main(keep_alive=_objects))
