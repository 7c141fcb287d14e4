"""Checking a cached calibration profile against the machine before it is trusted."""

import logging
from collections.abc import Callable, Sequence
from typing import Any

from calibration.result import CalibrationResult
from hetero_cs.planning.plan import even_batch_split

logger = logging.getLogger("calibration.calibrate")  # the messages users filter on

CHECK_TRIALS = 3
"""Timed steps per device when a cached profile is checked against the machine."""

CHECK_TOLERANCE = 0.15
"""Largest relative difference between a device's measured and predicted step time, after dividing out the factor
all devices share (a busier or quieter host), for a cached profile to be reused; widened to 3x the profile's own
recorded noise when that is larger."""


def _cached_profile_mismatch(cached: CalibrationResult, make_probe: Callable[[int], Any], *, devices: Sequence[str],
                             global_batch_size: int) -> str | None:
    """None when a few timed steps agree with the cached profile's predictions, else a one-line reason
    (``make_probe(i)``: the DeviceProbe of replica i, on ``devices[i]``)."""
    import numpy as np

    same_batch = cached.plan is not None and cached.plan.global_batch_size == global_batch_size
    sizes = cached.plan.per_replica_batch_sizes if same_batch else even_batch_split(global_batch_size, len(devices))
    sizes = [max(1, b if p.max_batch_size is None else min(b, p.max_batch_size))
             for b, p in zip(sizes, cached.profiles)]
    # A device that could not hold one example was not timed, and is not now: it stays idle as cached.
    timed = [i for i, p in enumerate(cached.profiles) if not p.holds_no_example]
    if len(timed) < 2:
        return None  # relative speeds need two devices
    probes = {i: make_probe(i) for i in timed}
    for i in timed:
        probes[i].time_step(sizes[i], warmup_steps=0, trials=1)  # traces and warms the step; not counted
    samples: dict[int, list[float]] = {i: [] for i in timed}
    for trial in range(CHECK_TRIALS):
        for k in range(len(timed)):
            i = timed[(trial + k) % len(timed)]
            samples[i].append(probes[i].run_step(sizes[i]))
    measured = np.array([float(np.median(samples[i])) for i in timed])
    predicted = np.array([float(cached.profiles[i].cost_model.predict_step_time_s(sizes[i])) for i in timed])
    if not np.all(predicted > 0) or not np.all(measured > 0):
        return None
    ratios = measured / predicted
    shared = float(np.exp(np.mean(np.log(ratios))))  # the factor all devices share (a busier or quieter host)
    relative = ratios / shared
    tolerance = max(CHECK_TOLERANCE, 3.0 * max(p.relative_noise for p in cached.profiles))
    off = [k for k in range(len(timed)) if abs(relative[k] - 1.0) > tolerance]
    logger.info("Cached profile check at slices %s: measured/predicted %s (shared factor %.2f)",
                [sizes[i] for i in timed], [round(float(r), 3) for r in ratios], shared)
    return "; ".join(  # None when every device agrees
        f"replica {timed[k]} ({devices[timed[k]]}) took {measured[k] * 1e3:.1f} ms at batch_size={sizes[timed[k]]}, "
        f"the profile predicts {predicted[k] * 1e3:.1f} ms ({(relative[k] - 1.0) * 100:+.0f} % against the other "
        f"devices, tolerance {tolerance * 100:.0f} %)" for k in off) or None
