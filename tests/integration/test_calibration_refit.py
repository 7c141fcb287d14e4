"""Calibration probes where the plan operates and refits there, on the curves measured on a real H200.

The probe stands in for calibration.probe.DeviceProbe: its step takes the time tests/data/h200_resnet50.json gives
for that slice (PyTorch's ResNet-50 step on one H200, linear between the measured sizes). TF32's small-batch curve is
not monotone (21.5 ms on 1 example, 15.6 ms on 16), so the fit at the default probe sizes misses it by up to ~30 %
between 8 and 32 examples; probing the plan's slices and refitting puts each card's model within 10 % where the plan
runs it.
"""

import json
import pathlib

import numpy as np
import pytest

from calibration.device_timing import _DeviceCalibration, _refit_at_plan, _time_interleaved
from calibration.timing import probe_batch_sizes
from hetero_cs.planning.cost_model import idle_free
from hetero_cs.planning.solver import solve_batch_split

CURVES_MS = json.loads((pathlib.Path(__file__).parents[1] / "data" / "h200_resnet50.json").read_text())[
    "resnet50_train_step_ms"]


def step_time_s(mode: str, batch_size: int) -> float:
    sizes = sorted(int(b) for b in CURVES_MS[mode])
    return float(np.interp(batch_size, sizes, [CURVES_MS[mode][str(b)] for b in sizes])) / 1e3


class CurveProbe:
    """A device whose step on b examples takes the H200's measured time for b (no TensorFlow, no waiting)."""

    tracks_memory = False

    def __init__(self, mode: str) -> None:
        self.mode, self.device = mode, f"/device:GPU:{mode}"

    def run_step(self, batch_size: int) -> float:
        return step_time_s(self.mode, batch_size)

    def time_step(self, batch_size: int, *, warmup_steps: int, trials: int) -> list[float]:
        return [self.run_step(batch_size)] * trials

    def reset_peak_memory(self) -> None:
        pass

    def peak_memory_bytes(self) -> None:
        return None


def solve(profiles, global_batch_size):
    return solve_batch_split(idle_free([p.cost_model for p in profiles]), global_batch_size, min_batch_size=0)


def calibrate_on_curves(modes, global_batch_size, *, refit=True):
    """What calibrate() does, on curve probes: warm-up, interleaved timing, fits, plan, and the refit at the plan."""
    calibrations = [_DeviceCalibration(CurveProbe(m), cap=None, memory_limit_bytes=None, warmup_steps=1)
                    for m in modes]
    for calibration in calibrations:
        calibration.prepare(probe_batch_sizes(global_batch_size, num=5))
    _time_interleaved(calibrations, trials=1)
    profiles = [c.profile() for c in calibrations]
    plan = solve(profiles, global_batch_size)
    if refit:
        profiles, plan = _refit_at_plan(calibrations, profiles, plan, lambda p: solve(p, global_batch_size),
                                        trials=1)
    return profiles, plan


def operating_error(modes, global_batch_size, *, refit=True) -> float:
    """Largest relative error of a card's model at the slice the plan gives it."""
    profiles, plan = calibrate_on_curves(modes, global_batch_size, refit=refit)
    return max(abs(p.cost_model.predict_step_time_s(b) / step_time_s(m, b) - 1.0)
               for p, m, b in zip(profiles, modes, plan.per_replica_batch_sizes) if b > 0)


MIXES = [("tf32", "tf32"), ("tf32", "fp32"), ("bf16", "bf16"), ("bf16", "tf32"), ("fp32", "fp32")]


@pytest.mark.parametrize("modes", MIXES, ids="+".join)
def test_the_refit_predicts_every_card_within_10_percent_where_the_plan_runs_it(modes):
    errors = {B: operating_error(modes, B) for B in range(8, 257, 8)}
    assert max(errors.values()) <= 0.10, {B: f"{e:.0%}" for B, e in errors.items() if e > 0.10}


def test_regression_the_default_probes_missed_the_tf32_dip_by_30_percent():
    # Two H200s in TF32, 32 examples: each runs 16, where the curve dips to 15.6 ms below its 21.5 ms at one
    # example; the fit at the default probe sizes (1, 2, 6, 13, 32) pools the dip with the slower sizes.
    assert operating_error(("tf32", "tf32"), 32, refit=False) > 0.25
    assert operating_error(("tf32", "tf32"), 32) <= 0.10


def test_a_line_that_fits_is_not_probed_again():
    # fp32 is a line within 5 % at the default probes: calibration adds no probe, so its cost does not grow.
    profiles, _ = calibrate_on_curves(("fp32",), 256)
    assert profiles[0].probe_batch_sizes == probe_batch_sizes(256, num=5)
