"""Measuring devices for calibration: warm-up and memory caps per device, then timing all devices interleaved.

``_DeviceCalibration`` holds one device's probe, its probe sizes that fit, its memory cap and its timed samples.
``_time_interleaved`` times every device round-robin (see ``calibration.calibrate``'s module docstring for why);
``_time_together`` runs the cards at the solved plan all at once, as a training step runs them, and measures how
much they slow each other down.
"""

import logging
import statistics
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from calibration import fit as fit_lib
from calibration import probe as probe_lib
from calibration import timing
from calibration.result import DeviceProfile
from hetero_cs.planning.cost_model import OutOfMemoryCostModel
from hetero_cs.errors import CalibrationError, HeteroCSError

logger = logging.getLogger("calibration.calibrate")  # the messages users filter on

NOISE_LIMIT = 0.10
"""A device's timing noise (median over its probe sizes of MAD / median) above which its trials are repeated."""

MAX_TIMING_ROUNDS = 3
"""Rounds of ``trials`` interleaved timings at most; after the last, calibration goes on and says so."""

MISSED_SHAPE_ERROR = 0.05
"""A device's fit whose largest error at its probed sizes is above this (the curve is not monotone there), or that
is piecewise (not a line), may miss the curve between its probes: it is probed again where the plan operates."""

MAX_REFIT_ROUNDS = 3
"""Rounds of probing at the plan's slices and refitting at most (a non-monotone curve can move the plan each time)."""

CONTENTION_ROUNDS = 3
"""Timed rounds of the concurrent probe (after one untimed round), each one step per card alone, then all at once."""


class _DeviceCalibration:
    """Calibrates one device: warm-up and memory cap first, then timed samples taken when the caller says."""

    def __init__(self, probe: Any, *, cap: int | None, memory_limit_bytes: int | None, warmup_steps: int,
                 emulated_as: str | None = None) -> None:
        self.probe = probe
        self.emulated_as = emulated_as  # the catalog device this one plays, or None
        self.label = probe.device if emulated_as is None else f"{probe.device} (emulated {emulated_as})"
        self.cap = cap
        self.memory_limit_bytes = memory_limit_bytes
        self.warmup_steps = warmup_steps
        self.sizes: list[int] = []  # the probe sizes that fit, increasing
        self.samples_s: dict[int, list[float]] = {}
        self.peaks_bytes: list[tuple[int, int]] = []
        self.out_of_memory_at: list[int] = []  # the sizes tried when not even one example fits (cap 0)
        self.fit: fit_lib.FitResult | None = None
        self.anchor: int | None = None  # the plan's slice the fit passes through (fit_cost_model's anchor)

    def _warm(self, batch_size: int) -> None:
        """Untimed steps at batch_size (the first traces the step) with the peak memory recorded."""
        self.probe.reset_peak_memory()
        self.probe.time_step(batch_size, warmup_steps=max(self.warmup_steps - 1, 0), trials=1)
        peak_bytes = self.probe.peak_memory_bytes()
        if peak_bytes is not None:
            self.peaks_bytes.append((batch_size, peak_bytes))

    def prepare(self, sizes: Sequence[int], on_warm: Callable[[int], None] = lambda batch_size: None) -> None:
        """Warms every size up in increasing order, stopping at the first out-of-memory, then finds the cap."""
        for batch_size in sizes:
            if self._out_of_memory(batch_size, self._warm) is not None:
                logger.info("%s: out of memory at batch_size=%d", self.probe.device, batch_size)
                self._find_cap(batch_size)
                break
            self.sizes.append(batch_size)
            on_warm(batch_size)
        self.samples_s = {b: [] for b in self.sizes}

    def _out_of_memory(self, batch_size: int, run: Callable[[int], Any]) -> Exception | None:
        """Runs ``run(batch_size)``; returns TensorFlow's error when the device ran out of memory (in any form a GPU
        raises it in: hetero_cs.devices.device_errors), else None; any other failure raises a CalibrationError."""
        import tensorflow as tf
        from hetero_cs.devices.device_errors import is_out_of_memory

        try:
            run(batch_size)
        except HeteroCSError:
            raise
        except tf.errors.OpError as exc:
            if not is_out_of_memory(exc):  # names the data when the batch's values are at fault
                raise self.probe.step_error(exc, batch_size) from exc
            return exc
        except (ValueError, TypeError) as exc:  # an op's error is probe.step_error's (above)
            root = exc  # raised while tracing the step, e.g. Keras' "No loss to compute" under a traced "in user code:"
            while root.__cause__ is not None:
                root = root.__cause__
            lines = [line.strip() for line in str(root).splitlines() if line.strip()] or [repr(root)]
            detail = (lines[-1] if lines[0] == "in user code:" else lines[0]).removeprefix(f"{type(root).__name__}: ")
            raise CalibrationError(f"The probe step could not be built on device={self.probe.device!r}: "
                                   f"{type(root).__name__}: {detail.rstrip('.')}. Calibration times a step of the "
                                   "model's compiled loss: check that the model is compiled with a loss and accepts "
                                   "the sample batch (model(x, training=True) and its loss), or give the split "
                                   "yourself (batch_split=[...], or auto_balance=False for an even split).") from exc
        return None

    def _fits(self, batch_size: int) -> bool:
        """Runs one step (the memory cap's search); False if the device ran out of memory."""
        if self._out_of_memory(batch_size, self.probe.run_step) is None:
            return True
        logger.info("%s: batch_size=%d does not fit in memory", self.probe.device, batch_size)
        return False

    def time_once(self, batch_size: int) -> None:
        """One timed step at batch_size (a size that fits), appended to its samples."""
        # the caller holds preserved_model_state around the whole calibration
        self._after_warm_up(batch_size, lambda b: self.samples_s[b].append(self.probe.run_step(b)))

    def _after_warm_up(self, batch_size: int, run: Callable[[int], Any]) -> None:
        """``run(batch_size)`` at a size that fitted before: running out of memory now is another process's doing."""
        if (exc := self._out_of_memory(batch_size, run)) is not None:
            raise CalibrationError(f"device={self.probe.device!r} ran batch_size={batch_size} during warm-up but ran "
                                   "out of memory when timing it. Another process may be using the device's memory; "
                                   "pass max_batch_sizes=[...] to cap it explicitly.") from exc

    def relative_noise(self) -> float:
        """Median over sizes of MAD / median of the timed samples (0.02 = 2 %); 0 before any sample."""
        stats = [timing.summarize_trials(samples) for samples in self.samples_s.values() if samples]
        ratios = sorted(s.mad_s / s.median_s for s in stats if s.median_s > 0)
        return float(ratios[len(ratios) // 2]) if ratios else 0.0

    def profile(self) -> DeviceProfile:
        """Summarises the samples, fits the cost model and returns the device's profile."""
        stats = [timing.summarize_trials(self.samples_s[b]) for b in self.sizes]
        if self.cap == 0:  # nothing fitted, nothing timed (no sizes, no samples): the device sits idle
            cost_model, fit_error = OutOfMemoryCostModel(), 0.0
        else:
            self.fit = fit_lib.fit_cost_model(self.sizes, [s.median_s for s in stats], anchor_batch_size=self.anchor)
            cost_model, fit_error = self.fit.cost_model, self.fit.fit_error
        return DeviceProfile(device=self.probe.device, cost_model=cost_model, max_batch_size=self.cap,
                             fit_error=fit_error, probe_batch_sizes=tuple(self.sizes),
                             median_step_times_s=tuple(s.median_s for s in stats), mad_s=tuple(s.mad_s for s in stats),
                             emulated_as=self.emulated_as, relative_noise=self.relative_noise())

    def probe_at(self, batch_size: int, largest: int) -> list[int]:
        """Anchors the fit at the plan's slice ``batch_size`` and warms the sizes around it (up to ``largest``, the
        global batch) not probed yet, when the fit may miss the curve there (MISSED_SHAPE_ERROR); returns those sizes
        ([] and no anchor otherwise)."""
        if batch_size in (0, self.anchor) or self.fit is None or (
                self.fit.kind == "linear" and self.fit.fit_error <= MISSED_SHAPE_ERROR):
            return []
        self.anchor = batch_size
        top = largest if self.cap is None else min(self.cap, largest)
        new = [b for b in timing.operating_batch_sizes(batch_size, max_batch_size=top) if b not in self.samples_s]
        for b in new:
            self._warm(b)
            self.samples_s[b] = []
        self.sizes = sorted(self.samples_s)
        return new

    def _find_cap(self, failed_size: int) -> None:
        """After an OOM at failed_size: bounded search for the largest size that fits; it becomes the cap."""
        device = self.probe.device
        if self.sizes:
            largest_fitting = self.sizes[-1]
        elif failed_size > 1 and self._fits(1):
            largest_fitting = 1
        else:
            # Not even one example fits: the device sits idle (cap 0) and the others train. calibrate() raises
            # CalibrationOOMError when this is true of every device.
            self.cap = 0
            self.out_of_memory_at = sorted({1, failed_size})
            logger.warning("%s cannot hold one example of this model (out of memory at batch_sizes=%s): it gets no "
                           "examples (memory cap 0). A smaller model or mixed precision may let it take part.",
                           device, self.out_of_memory_at)
            return
        guess = probe_lib.extrapolate_memory_cap(self.peaks_bytes, memory_limit_bytes=self.memory_limit_bytes)
        cap = probe_lib.search_memory_cap(self._fits, largest_fitting=largest_fitting, smallest_failing=failed_size,
                                          first_guess=guess)
        logger.info("%s: memory cap max_batch_size=%d (out of memory at %d)", device, cap, failed_size)
        self.cap = cap if self.cap is None else min(self.cap, cap)
        if not self.sizes or cap > self.sizes[-1]:
            self._after_warm_up(cap, self._warm)
            self.sizes.append(cap)


def _time_interleaved(calibrations: Sequence[_DeviceCalibration], trials: int,
                      tick: Callable[[], None] = lambda: None,
                      sizes: Sequence[Sequence[int]] | None = None) -> list[float]:
    """Times every device at every size (or at ``sizes``, one list per device), round-robin, ``trials`` times,
    repeating (bounded) while it is too noisy.

    One pass visits size j on device 0, 1, ..., R-1 before size j + 1, and the device order rotates from pass to
    pass, so a change in the host's load (another process, a throttling card) hits every device and size alike
    instead of one device's whole calibration. Returns each device's relative noise.
    """
    R = len(calibrations)
    timed = [list(c.sizes if sizes is None else sizes[i]) for i, c in enumerate(calibrations)]
    for round_index in range(MAX_TIMING_ROUNDS):
        for trial in range(trials):
            offset = (round_index * trials + trial) % R
            for j in range(max(map(len, timed), default=0)):
                for i in ((offset + k) % R for k in range(R)):
                    if j < len(timed[i]):
                        calibrations[i].time_once(timed[i][j])
                        tick()
        noise = [c.relative_noise() for c in calibrations]
        worst = max(range(R), key=lambda i: noise[i])
        if noise[worst] <= NOISE_LIMIT:
            break
        noisiest = (noise[worst] * 100, calibrations[worst].probe.device)
        if round_index + 1 < MAX_TIMING_ROUNDS:
            logger.warning("Calibration: timing noise %.0f %% on %s exceeds %.0f %% (the host or device is busy); "
                           "repeating the trials (round %d of at most %d).", *noisiest, NOISE_LIMIT * 100,
                           round_index + 2, MAX_TIMING_ROUNDS)
        else:
            logger.warning("Calibration: timing noise is still %.0f %% on %s after %d rounds; the devices may be "
                           "ranked wrongly. The plan will be measured against the even split before it is kept; "
                           "calibrate again on a quieter machine for a better plan.", *noisiest, MAX_TIMING_ROUNDS)
    return noise


def _refit_at_plan(calibrations: Sequence[_DeviceCalibration], profiles: list[DeviceProfile], plan: Any,
                   solve: Callable[[list], Any], *, trials: int) -> tuple[list[DeviceProfile], Any]:
    """Probes each device whose fit may miss its curve around the plan's slice, refits it through the time measured
    there, and solves again, until the plan's slices are probed (at most MAX_REFIT_ROUNDS rounds).

    Returns the profiles and the plan (None when ``solve`` finds none)."""
    for _ in range(MAX_REFIT_ROUNDS):
        anchors = [c.anchor for c in calibrations]
        new = [c.probe_at(b, plan.global_batch_size) for c, b in zip(calibrations, plan.per_replica_batch_sizes)]
        if anchors == [c.anchor for c in calibrations]:
            break
        logger.info("Calibration: probing the plan's slices %s again at %s and refitting",
                    list(plan.per_replica_batch_sizes), new)
        _time_interleaved(calibrations, trials, sizes=new)
        profiles = [c.profile() for c in calibrations]
        plan = solve(profiles)
        if plan is None:
            break
    return profiles, plan


def _time_together(calibrations: Sequence[_DeviceCalibration], sizes: Sequence[int]) -> tuple[float, ...]:
    """Contention factors: how much slower each card's step at its slice of ``sizes`` is when every card with
    examples steps at once (as in a training step) than when it steps alone, one per card (1.0 for an idle one).

    Each round times every working card alone at its slice, then all of them at once (threads that start together
    behind a barrier); the first round is untimed (new slice sizes). A card's factor is the median of its times
    together over the median of its times alone (at least 1: cards that run together never help each other), so
    a change in the host's load between rounds hits both alike. On this probe the cards contend for whatever they
    share: host cores and threads, PCIe lanes behind one switch, host memory bandwidth.
    """
    working = [i for i, b in enumerate(sizes) if b > 0]
    timed: list[tuple[dict[int, float], dict[int, float]]] = []  # per round: each card's seconds alone, together
    for _ in range(CONTENTION_ROUNDS + 1):
        alone = {i: calibrations[i].probe.run_step(int(sizes[i])) for i in working}
        barrier = threading.Barrier(len(working))

        def together(i: int) -> float:
            barrier.wait()
            return calibrations[i].probe.run_step(int(sizes[i]))

        with ThreadPoolExecutor(len(working), thread_name_prefix="hetero_cs_contention") as pool:
            timed.append((alone, dict(zip(working, pool.map(together, working)))))  # a step's error is raised here
    timed = timed[1:]  # the first round is untimed
    return tuple(max(1.0, statistics.median(t[i] for _, t in timed) / statistics.median(a[i] for a, _ in timed))
                 if i in working else 1.0 for i in range(len(calibrations)))
