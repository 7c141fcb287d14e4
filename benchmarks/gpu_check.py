"""The first thing to run on a machine with GPUs: one command, independent sections, a PASS/FAIL/SKIPPED line each.

A Dense stack (4096 wide, 37.8 M parameters on GPUs by default) trains with HeteroCentralStorageStrategy on a
fixed uneven split (3:1 of the global batch) over two replicas:

  (a) host-to-device and device-to-host bytes per step, computed from the model (parameters broadcast to every
      replica, gradients back, each slice's input) and measured from MemcpyH2D/MemcpyD2H events in a TensorFlow
      profiler trace; the host tail (step wall time minus the monitor's slowest replica) and a step on a tiny batch;
  (b) the monitor's per-replica step times against the last kernel end per replica in the same trace;
  (c) fused_update=True against False, interleaved rounds, the median of paired round ratios;
  (d) a forced out-of-memory step in model.fit (a logical GPU with a memory_limit): the error class, the replica
      blamed, the retried split, and that training went on;
  (e) pytest tests/gpu in a subprocess with NVIDIA_TF32_OVERRIDE=0 (run first, before this process holds GPUs).

Devices, decided before TensorFlow starts: with two or more GPUs, GPU:0 and GPU:1 (GPU:1 gets the memory_limit, and
the smaller share); with one GPU, two logical GPUs on it, a large one and a small one with the memory_limit, so
there are two replicas on one card; with no GPU, two logical CPU devices (CPU:0 keeps the variables), a much smaller
model, and (d) on emulated memory ("T4@<size>"): the script says so and runs the parts a CPU can.

    python benchmarks/gpu_check.py --json gpu_check.json
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _common  # noqa: E402  (imports no TensorFlow)
from benchmarks._common import log  # noqa: E402

SECTIONS = {
    "a": "bytes per step (H2D/D2H) and the host tail",
    "b": "monitor per-replica times vs the profiler trace",
    "c": "fused_update on vs off",
    "d": "forced out-of-memory: error, replica blamed, retry",
    "e": "tests/gpu with TF32 off",
}
CPU_ONLY_NOTE = "CPU-only: no GPU found; running the CPU-possible parts with emulated devices"
SPLIT = [3, 1]  # replica 0 (the large device) gets 3/4 of every global batch, replica 1 (the small one) 1/4


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="benchmarks/gpu_check.py", description=__doc__.split("\n\n")[0],
                                     epilog="Sections: " + "; ".join(f"{k}: {v}" for k, v in SECTIONS.items()),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help="comma-separated sections to run (default a,b,c,d,e)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures to this JSON file")
    parser.add_argument("--budget-s", type=float, default=280.0,
                        help="wall-clock budget (default 280 s): a section not started by then is SKIPPED")
    parser.add_argument("--params", type=int, default=None,
                        help="model parameters, about (default 40,000,000 on GPUs: 37.8 M, 1,000,000 CPU-only)")
    parser.add_argument("--global-batch-size", type=int, default=None, help="B (default 1024 on GPUs, 256 CPU-only)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per measurement (default 20)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="interleaved rounds in (c) (default 8 on GPUs, 10 CPU-only)")
    parser.add_argument("--small-gpu-mb", type=int, default=1024,
                        help="memory_limit of the small (memory-limited) logical GPU, MB (default 1024)")
    parser.add_argument("--large-gpu-mb", type=int, default=None,
                        help="one GPU only: memory_limit of the large logical GPU, MB (default: 80 %% of the card "
                             "minus the small one, from NVML; 16384 when NVML cannot say)")
    parser.add_argument("--no-memory-limit", action="store_true",
                        help="GPUs: set no memory_limit (section d is then SKIPPED)")
    parser.add_argument("--tests-timeout-s", type=float, default=150.0,
                        help="timeout of the tests/gpu subprocess in (e) (default 150 s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and synthetic data")
    args = parser.parse_args(argv)
    chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown or not chosen:
        parser.error(f"--sections takes letters from {','.join(SECTIONS)}; got {args.sections!r}")
    args.sections = [s for s in SECTIONS if s in chosen]
    for name in ("params", "global_batch_size", "steps", "rounds", "small_gpu_mb", "large_gpu_mb"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1; got {value}")
    for name in ("budget_s", "tests_timeout_s"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be a number of seconds > 0; got {getattr(args, name)}")
    if args.json is not None:  # found out now, not after the sections ran
        folder = args.json.resolve().parent
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            parser.error(f"--json {args.json}: cannot write in {folder} (no such folder, or not writable)")
    return args


def run_tests(timeout_s: float, *, gpu: bool) -> tuple[str, str, dict]:
    """(e): ``pytest tests/gpu`` in a subprocess with NVIDIA_TF32_OVERRIDE=0; pass/fail/skip counts."""
    env = dict(os.environ, NVIDIA_TF32_OVERRIDE="0", PYTHONPATH=os.pathsep.join(
        p for p in (str(_common.REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p))
    command = [sys.executable, "-m", "pytest", "tests/gpu", "-q", "-rs", "-p", "no:cacheprovider"]
    log(f"   {' '.join(command[2:])} (NVIDIA_TF32_OVERRIDE=0, timeout {timeout_s:.0f} s)")
    try:
        done = subprocess.run(command, cwd=_common.REPO_ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return "FAIL", f"tests/gpu did not finish within {timeout_s:.0f} s (--tests-timeout-s)", {}
    lines = (done.stdout + done.stderr).strip().splitlines()
    summary = next((line for line in reversed(lines) if re.search(r"\d+ (passed|failed|skipped|error)", line)), "")
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", summary)}
    for line in lines[-12:]:
        log(f"   | {line}")
    figures = {"returncode": done.returncode, "counts": counts, "summary": summary.strip("= ")}
    failed = counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0)
    if failed or done.returncode not in (0, 5):
        return "FAIL", f"tests/gpu: {figures['summary'] or 'exit status ' + str(done.returncode)}", figures
    if not gpu:
        return "SKIPPED", f"no GPU: tests/gpu ran and skipped ({figures['summary']})", figures
    if not counts.get("passed"):
        return "FAIL", f"a GPU is here but no test passed ({figures['summary']})", figures
    return "PASS", f"TF32 off: {figures['summary']}", figures


def card_memory_mb() -> int | None:
    """Total memory of the first visible GPU from NVML, MB (None without NVML or with CUDA_VISIBLE_DEVICES set)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES"):
        return None  # NVML ignores CUDA_VISIBLE_DEVICES: its index 0 may be another card
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total // 2**20)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no driver, no package: fall back to the default
        return None


def setup_devices(args: argparse.Namespace, gpus: list) -> dict[str, Any]:
    """Configures the logical devices (before TensorFlow starts); returns the compute devices and what was set."""
    import tensorflow as tf

    if not gpus:
        devices = _common.setup_devices(["CPU"] * len(SPLIT))
        return {"devices": devices, "small_memory_mb": None,
                "setup": f"logical CPU devices: /device:CPU:0 keeps the variables, {devices} compute"}
    small = None if args.no_memory_limit else args.small_gpu_mb
    config = tf.config.LogicalDeviceConfiguration
    if len(gpus) == 1:
        total = card_memory_mb()
        large = args.large_gpu_mb or (int(0.8 * total) - args.small_gpu_mb if total else 16384)
        tf.config.set_logical_device_configuration(
            gpus[0], [config(memory_limit=large), config(memory_limit=args.small_gpu_mb)])
        small = args.small_gpu_mb
        setup = (f"one GPU split into two logical GPUs: GPU:0 memory_limit {large} MB, GPU:1 memory_limit {small} MB"
                 + (" (--no-memory-limit cannot apply: the split needs limits)" if args.no_memory_limit else ""))
    else:
        tf.config.set_visible_devices(gpus[:len(SPLIT)], "GPU")  # the others stay free (no memory taken there)
        tf.config.experimental.set_memory_growth(gpus[0], True)
        if small is None:
            tf.config.experimental.set_memory_growth(gpus[1], True)
            setup = f"{len(gpus)} GPUs, GPU:0 and GPU:1 used (the others hidden), memory growth, no memory_limit"
        else:
            tf.config.set_logical_device_configuration(gpus[1], [config(memory_limit=small)])
            setup = (f"{len(gpus)} GPUs, GPU:0 and GPU:1 used (the others hidden); GPU:1 memory_limit {small} MB "
                     "(the small replica)")
    devices = [d.name for d in tf.config.list_logical_devices("GPU")][:len(SPLIT)]
    return {"devices": devices, "small_memory_mb": small, "setup": setup}


def run_section(key: str, function, results: dict, deadline_s: float, *args: Any) -> None:
    """Runs one section, catching its own exception; prints and records its status, reason and time."""
    log(f"\n== ({key}) {SECTIONS[key]}")
    start_s = time.perf_counter()
    if start_s > deadline_s:
        status, reason, figures = "SKIPPED", "the --budget-s wall-clock budget was spent before it started", {}
    else:
        try:
            status, reason, figures = function(*args)
        except Exception as exc:  # noqa: BLE001 - a section's failure must not stop the others
            traceback.print_exc(limit=8)
            status, reason, figures = "FAIL", f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}", {}
    seconds = time.perf_counter() - start_s
    results[key] = {"title": SECTIONS[key], "status": status, "reason": reason, "seconds": seconds, **figures}
    log(f"   ({key}) {status}: {reason}  [{seconds:.1f} s]")


def main(argv: list[str] | None = None, *, keep_alive: list | None = None) -> int:
    """Runs the chosen sections; returns 1 when a section FAILed, else 0."""
    args = parse_args(argv)
    start_s = time.perf_counter()
    deadline_s = start_s + args.budget_s
    _common.quiet_libraries()
    import tensorflow as tf  # listing physical devices does not start the runtime: logical devices can follow

    gpus = tf.config.list_physical_devices("GPU")
    gpu = bool(gpus)
    log("hetero_cs gpu_check: " + (f"{len(gpus)} GPU(s) found: {[g.name for g in gpus]}" if gpu else CPU_ONLY_NOTE))
    log(f"   TensorFlow {tf.__version__}, sections {','.join(args.sections)}, budget {args.budget_s:.0f} s")
    results: dict[str, Any] = {}
    if "e" in args.sections:  # first, while no GPU memory is held by this process
        run_section("e", lambda: run_tests(min(args.tests_timeout_s, max(10.0, deadline_s - time.perf_counter())),
                                           gpu=gpu), results, deadline_s)
    setup = setup_devices(args, gpus)
    from benchmarks import _gpu_check_sections as sections

    params = args.params or (40_000_000 if gpu else 1_000_000)
    width, depth, input_dim = sections.mlp_shape(params, gpu=gpu)
    ctx = sections.Context(gpu=gpu, devices=setup["devices"], split=list(SPLIT), width=width, depth=depth,
                           input_dim=input_dim, global_batch_size=args.global_batch_size or (1024 if gpu else 256),
                           small_replica=len(SPLIT) - 1, small_memory_mb=setup["small_memory_mb"],
                           steps=args.steps or 20, rounds=args.rounds or (8 if gpu else 10),
                           seed=args.seed)
    ctx.split = [ctx.global_batch_size * s // sum(SPLIT) for s in SPLIT]
    ctx.split[0] += ctx.global_batch_size - sum(ctx.split)
    if keep_alive is not None:
        keep_alive.append(ctx.keep_alive)
    model = sections.model_bytes(ctx)
    log(f"   {setup['setup']}")
    log(f"   compute devices {ctx.devices} ({ctx.kind}); model: Dense {input_dim}-" + f"{width}-" * depth +
        f"{sections.NUM_CLASSES} (ReLU, Adam), {model['parameters'] / 1e6:.2f} M parameters; fixed split "
        f"{ctx.split} of B={ctx.global_batch_size}")
    for key in ("a", "b", "c", "d"):
        if key in args.sections:
            run_section(key, getattr(sections, f"section_{key}"), results, deadline_s, ctx)
    wall_s = time.perf_counter() - start_s
    failed = [k for k in SECTIONS if results.get(k, {}).get("status") == "FAIL"]
    log(f"\n== summary ({'GPU' if gpu else CPU_ONLY_NOTE}; {wall_s:.0f} s of a {args.budget_s:.0f} s budget)")
    for key in SECTIONS:
        if key in results:
            r = results[key]
            log(f"   ({key}) {r['status']:<8}{r['seconds']:6.1f} s  {SECTIONS[key]}: {r['reason']}")
    report = {"gpu": gpu, "mode": "gpu" if gpu else "cpu-only (emulated devices)", "physical_gpus": len(gpus),
              "tensorflow": tf.__version__, "setup": setup, "model": {**model, "width": width, "depth": depth,
                                                                      "input_dim": input_dim},
              "split": ctx.split, "global_batch_size": ctx.global_batch_size, "wall_s": wall_s,
              "failed": failed, "sections": results}
    if args.json is not None:
        _common.write_json(args.json, report)
        log(f"   JSON: {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    _objects: list = []
    _common.exit_now(main(keep_alive=_objects))
