"""Benchmark: solve_batch_split wall time for R in {2, 8, 64} replicas and B in {64, 4096, 65536} examples.

Not a test: prints a table of median solve times (and, with --json F, writes them). Cost models are illustrative
linear and piecewise-linear (flat, then rising) curves with seconds per example proportional to 1 / fp32 TFLOPS of
an A10 (31.2), T4 (8.1), P100 (9.3) or V100 (15.7) (NVIDIA datasheets), drawn with a fixed seed. "generic" hides
the model types so the solver takes its generic path (any CostModel); its column also shows the number of cost
model evaluations.

    python benchmarks/solver.py [--repeats 50] [--json out/solver.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hetero_cs.planning.cost_model import CostModel, LinearCostModel, PiecewiseLinearCostModel  # noqa: E402
from hetero_cs.planning.solver import solve_batch_split  # noqa: E402

FP32_TFLOPS = (31.2, 8.1, 9.3, 15.7)  # A10, T4, P100 (PCIe), V100 (PCIe): NVIDIA datasheets
REPLICAS = (2, 8, 64)
BATCH_SIZES = (64, 4096, 65536)


class CountingModel:
    """Wraps a cost model: hides its type (generic solver path) and counts evaluations."""

    def __init__(self, model: CostModel):
        self.model = model
        self.evaluations = 0

    def predict_step_time_s(self, batch_size: int) -> float:
        self.evaluations += 1
        return self.model.predict_step_time_s(batch_size)


def make_models(num_replicas: int, kind: str, seed: int) -> list[CostModel]:
    """Illustrative per-replica cost models (module docstring)."""
    rng = random.Random(seed)
    models: list[CostModel] = []
    for _ in range(num_replicas):
        seconds_per_example = 0.01 / rng.choice(FP32_TFLOPS) * rng.uniform(0.9, 1.1)
        overhead_s = rng.uniform(0.002, 0.008)
        if kind == "linear":
            models.append(LinearCostModel(overhead_s, seconds_per_example))
        else:  # flat up to 32 examples, then rising; a steeper stretch from 512 on
            models.append(PiecewiseLinearCostModel(
                (1, 32, 512, 4096),
                (overhead_s, overhead_s, overhead_s + 480 * seconds_per_example,
                 overhead_s + 480 * seconds_per_example + 3584 * 1.3 * seconds_per_example)))
    return models


def median_solve_s(models: list, global_batch_size: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        solve_batch_split(models, global_batch_size)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50, help="solves per cell; the median is reported")
    parser.add_argument("--seed", type=int, default=0, help="seed of the illustrative cost models")
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")

    rows = []
    header = f"{'R':>3} {'B':>6} {'linear ms':>10} {'piecewise ms':>13} {'generic ms':>11} {'evaluations':>12}"
    print(header)
    print("-" * len(header))
    for R in REPLICAS:
        for B in BATCH_SIZES:
            linear = make_models(R, "linear", args.seed)
            piecewise = make_models(R, "piecewise", args.seed)
            counting = [CountingModel(m) for m in linear]
            solve_batch_split(linear, B)  # warm-up
            row = {
                "num_replicas": R,
                "global_batch_size": B,
                "linear_median_s": median_solve_s(linear, B, args.repeats),
                "piecewise_median_s": median_solve_s(piecewise, B, args.repeats),
                "generic_median_s": median_solve_s(counting, B, args.repeats),
                "generic_evaluations": sum(m.evaluations for m in counting) // args.repeats,
            }
            rows.append(row)
            print(f"{R:>3} {B:>6} {row['linear_median_s'] * 1e3:>10.3f} {row['piecewise_median_s'] * 1e3:>13.3f} "
                  f"{row['generic_median_s'] * 1e3:>11.3f} {row['generic_evaluations']:>12}")
    target = next(r for r in rows if r["num_replicas"] == 64 and r["global_batch_size"] == 65536)
    print(f"\nR=64, B=65536: linear {target['linear_median_s'] * 1e3:.3f} ms, generic "
          f"{target['generic_median_s'] * 1e3:.3f} ms median (goal < 5 ms)")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"repeats": args.repeats, "seed": args.seed, "results": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
