"""Checking a cached calibration profile against the machine before it is trusted."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from calibration import probe as probe_lib
from calibration.result import CalibrationResult

logger = logging.getLogger("calibration.calibrate")  # the messages users filter on

CHECK_TRIALS = 3
"""Timed steps per device when a cached profile is checked against the machine."""

CHECK_TOLERANCE = 0.15
"""Largest relative difference between a device's measured and predicted step time, after dividing out the factor
all devices share (a busier or quieter host), for a cached profile to be reused; widened to 3x the profile's own
recorded noise when that is larger."""


def _cached_profile_mismatch(cached: CalibrationResult, model: Any, sample_batch: Any, *, devices: Sequence[str],
                             parameter_device: str, loss: Any, emulator: Any, global_batch_size: int) -> str | None:
    """None when a few timed steps agree with the cached profile's predictions, else a one-line reason."""
    import numpy as np

    R = len(devices)
    if cached.plan is not None and cached.plan.global_batch_size == global_batch_size:
        sizes = list(cached.plan.per_replica_batch_sizes)
    else:
        sizes = [global_batch_size // R + (1 if i < global_batch_size % R else 0) for i in range(R)]
    sizes = [max(1, b if p.max_batch_size is None else min(b, p.max_batch_size))
             for b, p in zip(sizes, cached.profiles)]
    probes = [probe_lib.DeviceProbe(model, sample_batch, device=device, parameter_device=parameter_device, loss=loss,
                                    replica_id=i, emulator=emulator) for i, device in enumerate(devices)]
    for probe, b in zip(probes, sizes):
        probe.time_step(b, warmup_steps=0, trials=1)  # traces and warms the step; not counted
    samples: list[list[float]] = [[] for _ in devices]
    for trial in range(CHECK_TRIALS):
        for k in range(R):
            i = (trial + k) % R
            samples[i].append(probes[i].run_step(sizes[i]))
    measured = np.array([float(np.median(s)) for s in samples])
    predicted = np.array([float(p.cost_model.predict_step_time_s(b)) for p, b in zip(cached.profiles, sizes)])
    if not np.all(predicted > 0) or not np.all(measured > 0):
        return None
    ratios = measured / predicted
    relative = ratios / float(np.exp(np.mean(np.log(ratios))))
    tolerance = max(CHECK_TOLERANCE, 3.0 * max(p.relative_noise for p in cached.profiles))
    off = [i for i in range(R) if abs(relative[i] - 1.0) > tolerance]
    logger.info("Cached profile check at slices %s: measured/predicted %s (shared factor %.2f)", sizes,
                [round(float(r), 3) for r in ratios], float(np.exp(np.mean(np.log(ratios)))))
    if not off:
        return None
    return "; ".join(
        f"replica {i} ({devices[i]}) took {measured[i] * 1e3:.1f} ms at batch_size={sizes[i]}, the profile predicts "
        f"{predicted[i] * 1e3:.1f} ms ({(relative[i] - 1.0) * 100:+.0f} % against the other devices, tolerance "
        f"{tolerance * 100:.0f} %)" for i in off
    )
