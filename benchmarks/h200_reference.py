"""Prints how hetero_cs's models hold against ResNet-50 steps measured on one real H200 (no GPU needed).

tests/data/h200_resnet50.json holds the readings (PyTorch on one real H200, see the file's "what": TensorFlow could not
run there). Two tables:

* **What-if.** ``hetero_cs.devices.what_if.what_if(["H200"], b)`` for ResNet-50 (the catalog's H200, the workload's
  FLOPs and bytes), beside the measured step plus the measured copies of the parameters to the card and back (a
  hetero_cs step makes both; the PyTorch step did not), per mode: fp32 (TF32 off), tf32 (TensorFlow's default) and
  bf16 (``mixed_bfloat16``: half-size activations).
* **Fit.** ``calibration.fit_cost_model`` at the default probe sizes for B = 256 (1, 4, 16, 64, 256), its error at
  every measured size; then, at each size b as the slice a plan gives the card, the refit that calibration makes
  there (b and its neighbours probed, the fit held to the time at b), its error at b and, in brackets, its largest
  error between b / 1.25 and 1.25 b (where a plan solved again may move the slice; the measured curve is taken
  linear between measured sizes there).

    python benchmarks/h200_reference.py
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from calibration.fit import fit_cost_model  # noqa: E402
from calibration.timing import operating_batch_sizes, probe_batch_sizes  # noqa: E402
from hetero_cs.devices.what_if import DEFAULT_WORKLOAD, what_if  # noqa: E402

READINGS = json.loads((Path(__file__).resolve().parents[1] / "tests" / "data" / "h200_resnet50.json").read_text())


def _interpolated(curve: dict[int, float], b: int) -> float:
    """The measured time at b, linear between measured sizes (the neighbours of a slice need not be measured)."""
    low = max(s for s in curve if s <= b)
    high = min(s for s in curve if s >= b)
    return curve[low] if low == high else curve[low] + (curve[high] - curve[low]) * (b - low) / (high - low)


def main() -> int:
    copies_ms = sum(READINGS["pinned_copy_of_resnet50_parameters"][way]["ms"] for way in ("h2d", "d2h"))
    workloads = {"fp32": dataclasses.replace(DEFAULT_WORKLOAD, tensor_float_32=False), "tf32": DEFAULT_WORKLOAD,
                 "bf16": dataclasses.replace(DEFAULT_WORKLOAD, compute_dtype="bfloat16",
                                             activation_bytes_per_example=DEFAULT_WORKLOAD.activation_bytes_per_example
                                             // 2)}
    curves = {mode: {int(b): t / 1e3 for b, t in curve.items()}
              for mode, curve in READINGS["resnet50_train_step_ms"].items()}
    print(f"What-if vs measured + copies ({copies_ms:.2f} ms), ms (error):")
    for mode, curve in curves.items():
        cells = []
        for b, t in curve.items():
            predicted = what_if(["H200"], b, workloads[mode])["predicted_step_s"]
            error = predicted / (t + copies_ms / 1e3) - 1
            cells.append(f"{b}: {predicted * 1e3:.0f}/{t * 1e3 + copies_ms:.0f} ({error:+.0%})")
        print(f"  {mode}: " + ", ".join(cells))
    print("Fit at the default probes (1, 4, 16, 64, 256): error at each measured size; refit at b as the plan's slice:")
    for mode, curve in curves.items():
        sizes = probe_batch_sizes(256)
        default = fit_cost_model(list(sizes), [curve[b] for b in sizes]).cost_model
        refit = []
        for b in curve:
            around = operating_batch_sizes(b, max_batch_size=256)
            probes = sorted(set(sizes) | set(around))
            model = fit_cost_model(probes, [_interpolated(curve, s) for s in probes], anchor_batch_size=b).cost_model
            worst = max(range(around[0], around[-1] + 1),
                        key=lambda s: abs(model.predict_step_time_s(s) / _interpolated(curve, s) - 1))
            refit.append(f"{model.predict_step_time_s(b) / curve[b] - 1:+.0%} "
                         f"({model.predict_step_time_s(worst) / _interpolated(curve, worst) - 1:+.0%} at {worst})")
        print(f"  {mode} default: " + ", ".join(f"{b}: {default.predict_step_time_s(b) / t - 1:+.0%}"
                                               for b, t in curve.items()))
        print(f"  {mode} refit:   " + ", ".join(f"{b}: {e}" for b, e in zip(curve, refit)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
