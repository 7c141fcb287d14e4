"""The measuring sections (a)-(d) of ``benchmarks/gpu_check.py`` and what they share (model, data, strategies).

Each ``section_*`` takes the :class:`Context` and returns ``(status, reason, figures)``; it prints its own lines.
TensorFlow is imported inside functions: the caller configures the logical devices first.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import statistics
import time
from typing import Any

from benchmarks import _common
from benchmarks import _gpu_check_trace as trace
from benchmarks._common import log, ms

NUM_CLASSES = 10
TIMING_ENV_VAR = "HETERO_CS_TIMING"


@dataclasses.dataclass
class Context:
    """What every section reads: the mode, the devices, the model's shape, the split, and shared state."""

    gpu: bool
    devices: list[str]
    split: list[int]  # the fixed uneven split of the global batch, one count per replica
    width: int
    depth: int  # hidden Dense layers
    input_dim: int
    global_batch_size: int
    small_replica: int  # the replica whose device has the least memory (the memory_limit / NAME@SIZE one)
    small_memory_mb: int | None
    steps: int  # timed steps per measurement
    rounds: int  # interleaved rounds in (c)
    seed: int = 0
    cache: dict[str, Any] = dataclasses.field(default_factory=dict)
    keep_alive: list = dataclasses.field(default_factory=list)  # TF objects freed at exit_now, not mid-run

    @property
    def kind(self) -> str:
        return "GPU" if self.gpu else "logical CPU devices, real CPU compute; (d) adds emulated memory"


def mlp_shape(params: int, *, gpu: bool) -> tuple[int, int, int]:
    """(width, hidden layers, input dim) of a Dense stack with about ``params`` parameters (4096 wide on GPUs)."""
    width = 4096 if gpu or params >= 8_000_000 else 512
    input_dim = width // 4
    per_layer = width * width + width
    first = input_dim * width + width + width * NUM_CLASSES + NUM_CLASSES
    depth = max(1, 1 + round((params - first) / per_layer))
    return width, depth, input_dim


def build_model(ctx: Context, *, seed: int | None = None) -> Any:
    import keras

    seed = ctx.seed if seed is None else seed
    init = keras.initializers.GlorotUniform
    layers = [keras.Input((ctx.input_dim,))]
    layers += [keras.layers.Dense(ctx.width, activation="relu", kernel_initializer=init(seed + i))
               for i in range(ctx.depth)]
    layers.append(keras.layers.Dense(NUM_CLASSES, kernel_initializer=init(seed + ctx.depth)))
    return keras.Sequential(layers, name="gpu_check_mlp")


def synthetic(ctx: Context, batch: int, *, seed: int = 0) -> tuple[Any, Any]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return (rng.normal(size=(batch, ctx.input_dim)).astype(np.float32),
            rng.integers(0, NUM_CLASSES, size=(batch,)).astype(np.int32))


def new_config(ctx: Context, name: str, *, fused_update: bool | None = None, timed: bool = True,
               global_batch_size: int | None = None) -> _common.Config:
    """A strategy on the fixed split, a fresh model and Adam under it, and the benchmarks' one training step."""
    import keras

    from hetero_cs import HeteroCentralStorageStrategy

    batch_size = global_batch_size or ctx.global_batch_size
    previous = os.environ.pop(TIMING_ENV_VAR, None)
    if timed:
        os.environ[TIMING_ENV_VAR] = "1"  # the monitor records every step (read when the strategy is built)
    try:
        strategy = HeteroCentralStorageStrategy(ctx.devices, batch_split=ctx.split, profile_cache=False,
                                                fused_update=fused_update)
    finally:
        os.environ.pop(TIMING_ENV_VAR, None)
        if previous is not None:
            os.environ[TIMING_ENV_VAR] = previous
    keras.utils.set_random_seed(ctx.seed)
    with strategy.scope():
        model = build_model(ctx)
        optimizer = keras.optimizers.Adam(1e-4)
        model.compile(optimizer=optimizer, loss=_common.loss_function())
    dataset = _common.batch_dataset(synthetic(ctx, batch_size, seed=ctx.seed))
    source = iter(strategy.experimental_distribute_dataset(dataset))
    step = _common.make_train_step(strategy, model, optimizer, global_batch_size=batch_size)
    config = _common.Config(name, name, step, source, monitor=strategy.monitor if timed else None,
                            strategy=strategy)
    ctx.keep_alive.append((config, model, optimizer))
    return config


def main_config(ctx: Context) -> _common.Config:
    """The timed run (a) and (b) measure: fused_update default, the fixed split, warmed up."""
    if "main" not in ctx.cache:
        config = new_config(ctx, "main")
        start_s = time.perf_counter()
        for _ in range(3):
            config.run_step()
        log(f"   main run: {ctx.devices}, split {ctx.split}, B={ctx.global_batch_size}; 3 warm-up steps "
            f"{time.perf_counter() - start_s:.1f} s (first one traces)")
        ctx.cache["main"] = config
    return ctx.cache["main"]


def profiled(ctx: Context, steps: int = 5) -> tuple[trace.TraceSummary, list[Any]]:
    """``steps`` steps of the main run under the TensorFlow profiler (once per run): the parsed trace and the
    monitor's sample of each profiled step."""
    if "trace" not in ctx.cache:
        config = main_config(ctx)
        samples: list[Any] = []
        start_s = time.perf_counter()
        logdir, _ = trace.profile_steps(config.run_step, steps,
                                        on_step=lambda _k: samples.append(config.monitor.last_step()))
        summary = trace.read_trace(logdir, len(ctx.devices))
        log(f"   profiled {steps} steps in {time.perf_counter() - start_s:.1f} s: trace {logdir}; planes "
            f"{summary.planes}; {summary.kernel_events} kernel and {summary.memcpy_events} memcpy events")
        ctx.cache["trace"] = (summary, samples)
    return ctx.cache["trace"]


def model_bytes(ctx: Context) -> dict[str, int]:
    """Bytes one step moves, from the model: parameters to every replica, gradients back, each slice's input."""
    width, depth, d = ctx.width, ctx.depth, ctx.input_dim
    params = d * width + width + (depth - 1) * (width * width + width) + width * NUM_CLASSES + NUM_CLASSES
    replicas = len(ctx.devices)
    input_bytes = ctx.global_batch_size * (d * 4 + 4)  # float32 x and int32 y, every slice once
    return {"parameters": params, "parameter_bytes": params * 4, "input_bytes": input_bytes,
            "h2d_bytes": replicas * params * 4 + input_bytes, "d2h_bytes": replicas * params * 4,
            "replicas": replicas}


def section_a(ctx: Context) -> tuple[str, str, dict]:
    """Host-to-device and device-to-host bytes per step, and the host tail."""
    expected = model_bytes(ctx)
    log(f"   from the model: {expected['parameters'] / 1e6:.2f} M parameters "
        f"({expected['parameter_bytes'] / 2**20:.1f} MiB); per step H2D = {expected['replicas']} x parameters + "
        f"input slices = {expected['h2d_bytes'] / 2**20:.1f} MiB, D2H = {expected['replicas']} x gradients = "
        f"{expected['d2h_bytes'] / 2**20:.1f} MiB")
    config = main_config(ctx)
    start = len(config.step_times_s)
    config.timed_steps(ctx.steps)
    walls = config.step_times_s[start:]
    makespans = [s.makespan_s for s in config.samples[start:] if s is not None]
    tail = [w - m for w, m in zip(walls, makespans)]
    tiny_batch = len(ctx.devices) * 2
    tiny = ctx.cache.get("tiny") or new_config(ctx, "tiny", global_batch_size=tiny_batch)
    ctx.cache["tiny"] = tiny
    for _ in range(3):
        tiny.run_step()
    tiny.timed_steps(ctx.steps)
    figures: dict[str, Any] = {"expected": expected, "median_step_s": statistics.median(walls),
                               "median_makespan_s": statistics.median(makespans) if makespans else None,
                               "host_tail_s": statistics.median(tail) if tail else None,
                               "tiny_batch": tiny_batch, "tiny_batch_step_s": tiny.median_step_s}
    log(f"   host tail = step wall time - monitor makespan (gradient sum + update on the host + dispatch): "
        f"{ms(figures['host_tail_s'])} (median of {len(tail)}; step {ms(figures['median_step_s'])}, slowest "
        f"replica {ms(figures['median_makespan_s'])})")
    log(f"   step with a {tiny_batch}-example global batch (replicas compute ~nothing; broadcast, gradient return, "
        f"sum, update, dispatch remain): {ms(tiny.median_step_s)}")
    summary, _ = profiled(ctx)
    measured = summary.median_bytes()
    figures["measured"] = measured
    if not ctx.gpu:
        return "PASS", ("CPU-only: bytes computed from the model, host tail measured; copies cannot be measured "
                        "(no MemcpyH2D/D2H events without a GPU)"), figures
    if not measured or not measured["h2d_bytes"]:
        return "FAIL", "no MemcpyH2D events with sizes in the trace (is CUPTI loaded? see the TF log)", figures
    ratios = {k: measured[f"{k}_bytes"] / expected[f"{k}_bytes"] for k in ("h2d", "d2h")}
    figures["measured_over_expected"] = ratios
    log(f"   measured in the trace (median per step): H2D {measured['h2d_bytes'] / 2**20:.1f} MiB in "
        f"{measured['h2d_copies']:.0f} copies ({ratios['h2d']:.3f} x expected), D2H "
        f"{measured['d2h_bytes'] / 2**20:.1f} MiB in {measured['d2h_copies']:.0f} copies ({ratios['d2h']:.3f} x)")
    off = [k for k, r in ratios.items() if not 0.9 <= r <= 1.5]
    if off:
        return "FAIL", f"measured bytes differ from the model's: {', '.join(f'{k} {ratios[k]:.2f}x' for k in off)}", \
            figures
    return "PASS", "measured copies within 0.9-1.5x of the model's bytes", figures


def section_b(ctx: Context) -> tuple[str, str, dict]:
    """The monitor's per-replica times against the end times in a profiler trace."""
    summary, samples = profiled(ctx)
    samples = [s for s in samples if s is not None]
    if not samples:
        return "FAIL", "the monitor recorded no step while profiling (per-replica timing off?)", {}
    if not summary.steps:
        return "FAIL", f"no '{trace.STEP_MARKER}' step markers in the trace ({summary.logdir})", {}
    rows, agree = [], True
    for i in range(len(ctx.devices)):
        monitor_s = statistics.median(s.per_replica_step_times_s[i] for s in samples)
        trace_s = summary.median_replica_end_s(i)
        row = {"replica": i, "device": ctx.devices[i], "examples": ctx.split[i], "monitor_s": monitor_s,
               "trace_end_stamp_s": summary.median_replica_end_s(i, stamp=True), "trace_end_s": trace_s,
               "difference_s": None if trace_s is None else monitor_s - trace_s}
        if trace_s is None or abs(monitor_s - trace_s) > max(1e-3, 0.2 * trace_s):
            agree = False
        rows.append(row)
    reference = {s.reference for s in summary.steps}
    log(f"   per replica, medians over {len(samples)} profiled steps, from the step's {'/'.join(sorted(reference))} "
        f"op in the trace: the monitor's time, the trace's end_replica_step op (where the monitor reads its clock) "
        f"and the last {summary.source} end")
    log(f"   {'replica':<8}{'device':<24}{'examples':>9}{'monitor':>11}{'end op':>11}{'last end':>11}"
        f"{'monitor - last end':>20}")
    for r in rows:
        diff = "-" if r["difference_s"] is None else f"{r['difference_s'] * 1e3:+.2f} ms"
        log(f"   {r['replica']:<8}{r['device']:<24}{r['examples']:>9}{ms(r['monitor_s']):>11}"
            f"{ms(r['trace_end_stamp_s']):>11}{ms(r['trace_end_s']):>11}{diff:>20}")
    figures = {"replicas": rows, "source": summary.source, "reference": sorted(reference),
               "profiled_steps": len(summary.steps),
               "step_window_s": statistics.median(s.window_s for s in summary.steps)}
    verdict = "agree within max(1 ms, 20 %)" if agree else "DISAGREE beyond max(1 ms, 20 %)"
    if not ctx.gpu:
        return "PASS", (f"CPU-only: monitor vs host op end times ({verdict}); the comparison with GPU kernel end "
                        "times needs a GPU"), figures
    if summary.kernel_events == 0:
        return "FAIL", "no GPU kernel events in the trace (is CUPTI loaded? see the TF log)", figures
    missing = [r["replica"] for r in rows if r["trace_end_s"] is None]
    if missing:
        return "FAIL", (f"no kernels attributed to replica(s) {missing} in the profiled steps (kernel events without "
                        "op names? see _gpu_check_trace.read_trace)"), figures
    return ("PASS" if agree else "FAIL"), f"monitor vs kernel end times: {verdict}", figures


def section_c(ctx: Context) -> tuple[str, str, dict]:
    """fused_update on vs off, interleaved rounds, paired median ratio."""
    configs = [new_config(ctx, "fused_on", fused_update=True, timed=False),
               new_config(ctx, "fused_off", fused_update=False, timed=False)]
    _common.run_interleaved(configs, rounds=ctx.rounds, steps_per_round=ctx.steps // 2 or 1, warmup_steps=3,
                            progress_every=max(1, ctx.rounds // 2))
    on, off = configs
    ratio = statistics.median(a / b for a, b in zip(on.round_medians_s, off.round_medians_s))
    figures = {"fused_on_median_s": on.median_step_s, "fused_off_median_s": off.median_step_s,
               "on_over_off": ratio, "rounds": ctx.rounds, "steps_per_round": ctx.steps // 2 or 1}
    log(f"   fused_update=True {ms(on.median_step_s)}, False {ms(off.median_step_s)}: on / off = {ratio:.3f} "
        f"(paired round medians; < 1 means the compiled update is faster)")
    note = "" if ratio <= 1.03 else " - the compiled update is SLOWER here"
    return "PASS", f"on / off = {ratio:.3f}{note}", figures


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def section_d(ctx: Context) -> tuple[str, str, dict]:
    """A forced out-of-memory step in model.fit: the error class, the replica blamed, the retry, training goes on."""
    import keras

    from hetero_cs import HeteroCentralStorageStrategy, MemoryRecoveryPolicy
    from hetero_cs.emulation import estimate_workload, max_examples_in_memory, slice_memory_bytes
    from hetero_cs.engine.memory import oom_recovery

    if ctx.gpu and ctx.small_memory_mb is None:
        return "SKIPPED", "no logical device with a memory_limit (run without --no-memory-limit)", {}
    keras.utils.set_random_seed(ctx.seed)
    probe = build_model(ctx)
    probe.compile(optimizer=keras.optimizers.Adam(1e-4), loss=_common.loss_function())
    probe.optimizer.build(probe.trainable_variables)
    workload = estimate_workload(probe)
    emulate, env = None, {}
    if ctx.gpu:  # a slice of twice what the estimate says fits in the memory_limit
        cap = max_examples_in_memory(workload, ctx.small_memory_mb * 2**20) or 1
        slice_size = 2 * cap
        memory = f"memory_limit {ctx.small_memory_mb} MB"
    else:  # emulated memory (NAME@SIZE) that holds 3/8 of the slice
        slice_size = ctx.global_batch_size // 2
        size = slice_memory_bytes(workload, slice_size * 3 // 8)
        emulate = ["A10"] * len(ctx.devices)
        emulate[ctx.small_replica] = f"T4@{size}B"
        memory = (f"emulated {emulate[ctx.small_replica]}, {size / 2**20:.1f} MiB: {slice_size * 3 // 8} examples by "
                  "estimate_workload")
        env = {"HETERO_CS_EMULATION_TARGET_MAKESPAN_MS": "10"}
    batch = slice_size * len(ctx.devices)
    steps = 3
    log(f"   replica {ctx.small_replica} ({ctx.devices[ctx.small_replica]}, {memory}) gets {slice_size} examples of "
        f"an even split of B={batch}; model.fit for {steps} steps, oom_recovery on")
    seen: list[tuple[str, int | None]] = []
    original = oom_recovery.classify  # what the fit's recovery asks of every failed step

    def spy(exc, *args, **kwargs):
        found = original(exc, *args, **kwargs)
        if found is not None:  # an out-of-memory error (any form), and the replica blamed for it
            seen.append((type(exc).__name__, found.replica_id))
        return found

    handler = _Records()
    engine_logger = logging.getLogger("hetero_cs.engine.central_storage")
    engine_logger.addHandler(handler)
    saved_env = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    oom_recovery.classify = spy
    try:
        strategy = HeteroCentralStorageStrategy(ctx.devices, batch_split=[1] * len(ctx.devices), emulate=emulate,
                                                profile_cache=False, oom_recovery=MemoryRecoveryPolicy(max_retries=4))
        keras.utils.set_random_seed(ctx.seed)
        with strategy.scope():
            model = build_model(ctx)
            model.compile(optimizer=keras.optimizers.Adam(1e-4), loss=_common.loss_function())
        x, y = synthetic(ctx, batch * steps, seed=1)
        start_s = time.perf_counter()
        history = model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
        fit_s = time.perf_counter() - start_s
    finally:
        oom_recovery.classify = original
        engine_logger.removeHandler(handler)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    ctx.keep_alive.append((strategy, model))
    recovery = strategy._step_recovery  # noqa: SLF001 - the counters the benchmark reads
    iterations = int(model.optimizer.iterations)
    warnings = [m for m in handler.messages if "out of memory on" in m]
    figures = {"memory": memory, "global_batch_size": batch, "slice_tried": slice_size, "steps": steps,
               "errors_seen": [{"error": e, "replica_blamed": r} for e, r in seen],
               "recoveries": recovery.recoveries, "max_retries_per_batch": recovery.max_retries_used,
               "memory_caps": strategy.balancer.max_batch_sizes, "optimizer_iterations": iterations,
               "final_loss": float(history.history["loss"][-1]), "fit_s": fit_s, "log": warnings,
               "plan_after": list(strategy.plan.per_replica_batch_sizes) if strategy.plan else None}
    for error, replica in seen:
        log(f"   error seen: {error}, replica blamed: {replica}")
    for message in warnings:
        log(f"   logged: {message}")
    log(f"   recoveries {recovery.recoveries}, most retries for one batch {recovery.max_retries_used}, caps "
        f"{figures['memory_caps']}, plan now {figures['plan_after']}; optimizer iterations {iterations} of {steps} "
        f"batches ({fit_s:.1f} s)")
    if not seen:
        return "FAIL", f"no out-of-memory error: a {slice_size}-example slice fit in {memory}", figures
    blamed_ok = all(r == ctx.small_replica for _, r in seen)
    if iterations != steps or not blamed_ok:
        return "FAIL", (f"{seen[0][0]} blamed on replicas {sorted({r for _, r in seen}, key=str)} (expected "
                        f"{ctx.small_replica}); {iterations} of {steps} steps applied"), figures
    return "PASS", (f"{seen[0][0]} on replica {ctx.small_replica}, {recovery.recoveries} retries, caps "
                    f"{figures['memory_caps']}, all {steps} steps applied"), figures
