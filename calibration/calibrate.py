"""calibrate(): times every compute device on the real model's step, fits cost models, solves a plan.

Phase 1, one device at a time (replica i is devices[i]): geometric probe batch sizes up to the global batch (or the
device's cap), warm-up steps at each (the first traces the step), and on GPUs a memory cap found from peak memory
and a bounded search that recovers from out-of-memory errors. Phase 2 times the devices *interleaved*: each pass
runs one step per (size, device), devices round-robin within a size, the device order rotating between passes, so a
change in the host's load hits every device alike instead of skewing one device's whole profile. Samples are
summarised by median and MAD after outlier rejection; each device's relative noise (median MAD / median) is kept
in its profile, and while any device is noisier than NOISE_LIMIT the passes repeat (at most MAX_TIMING_ROUNDS
rounds, logged). Then a monotone cost-model fit per device, and a plan; where a fit may miss its curve (not a
line, or not monotone at the probes: real GPUs at small batches), the slices the plan gives are probed too, the fit
is made to pass through them, and the plan is solved again (``_refit_at_plan``). Until then devices never run
concurrently, so they never compete for host cores or the PCIe bus; a training step runs them together. So
calibration ends with one concurrent probe: every card the plan gives examples steps at its slice, all at once,
against the same step alone (``_time_together``); each card's cost model is scaled by how much slower it ran beside
the others (``CalibrationResult.contention_factors``), and the plan is solved again. The model is left exactly as
it was (see calibration.probe).
"""

import dataclasses
import itertools
import logging
import math
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from calibration import probe as probe_lib
from calibration import timing
from calibration.result import CalibrationResult
from calibration.cache_check import _cached_profile_mismatch
from calibration.device_timing import _DeviceCalibration, _refit_at_plan, _time_interleaved, _time_together
from calibration.store import ProfileStore, profile_key
from hetero_cs.errors import (CalibrationError, CalibrationOOMError, ConfigError, DeviceError, InfeasiblePlanError,
                              ProfileCacheError)
from hetero_cs.planning.plan import BatchPlan, check_range

__all__ = ["calibrate"]

logger = logging.getLogger(__name__)

DEFAULT_NUM_PROBES = 5
"""Probe sizes per device when probe_batch_sizes is None (geometric from 1 to the largest size)."""


def _check_devices(devices: Sequence[str], parameter_device: str) -> tuple[list[str], str]:
    from hetero_cs.devices.device_errors import checked_device_names  # imports TensorFlow

    if isinstance(devices, str) or not devices:
        raise DeviceError(f"devices must be a non-empty sequence of device names, e.g. ['/device:GPU:0', "
                          f"'/device:GPU:1']. Received: devices={devices!r}.")
    return checked_device_names(devices, parameter_device, argument="devices")


def _gpu_facts() -> dict[str, Any]:
    """DeviceInfo per GPU name from hetero_cs.devices (NVML), or {} when unavailable."""
    try:
        from hetero_cs.devices import discover_devices

        return {info.name: info for info in discover_devices() if info.device_type == "GPU"}
    except Exception as exc:  # noqa: BLE001 - facts are optional: the cache key and memory cap degrade gracefully.
        logger.info("GPU facts unavailable (%s); using TensorFlow device names only.", exc)
        return {}


def _device_ids(devices: Sequence[str], emulator: Any, gpu_facts: dict[str, Any]) -> list[str]:
    ids = []
    for i, device in enumerate(devices):
        parts = [device]
        if (info := gpu_facts.get(device)) is not None:
            parts.append(f"{info.description}|{info.uuid or ''}|{info.memory_total_bytes or ''}")
        if emulator is not None:
            parts.append(f"emulated={emulator.specs[i].name}@time_scale={emulator.time_scale:.9g}"
                         f"@memory_bytes={emulator.specs[i].memory_bytes}")
        ids.append("|".join(parts))
    return ids


def _check_positive_int(name: str, value: Any, *, minimum: int = 1) -> int:
    check_range(name, value, minimum, integer=True)  # ConfigError "{name} must be an integer >= {minimum}. ..."
    return int(value)


def _positive_ints(name: str, value: Any, *, example: str, none_allowed: bool = False) -> list[int | None]:
    """``value`` as a list of ints >= 1 (None entries kept where ``none_allowed``)."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__") or not (values := list(value)):
        raise ConfigError(f"{name} must be a non-empty sequence of ints >= 1, e.g. {example}. Received: "
                          f"{name}={value!r}.")
    return [None if v is None and none_allowed else _check_positive_int(f"{name}[{i}]", v)
            for i, v in enumerate(values)]


def _device_probe_sizes(requested: Sequence[int] | None, global_batch_size: int, cap: int | None) -> tuple[int, ...]:
    largest = global_batch_size if cap is None else min(cap, global_batch_size)
    if requested is None:
        return timing.probe_batch_sizes(largest, num=DEFAULT_NUM_PROBES)
    return tuple(sorted({int(b) for b in requested if int(b) <= largest})) or (largest,)


def _solve(result: CalibrationResult, global_batch_size: int) -> BatchPlan | None:
    from hetero_cs.planning.cost_model import idle_free
    from hetero_cs.planning.solver import solve_batch_split

    try:
        # As the strategies plan: a replica with 0 examples runs nothing (t(0) = 0), so a card may be left out
        # where that is faster (hetero_cs.engine.step.idle_replicas).
        return solve_batch_split(idle_free(result.cost_models), global_batch_size,
                                 max_batch_sizes=list(result.max_batch_sizes), min_batch_size=0)
    except InfeasiblePlanError as exc:
        # The strategies train such a batch as micro-batches (sub-steps within the caps); say so, not "failed".
        warnings.warn(f"Calibration finished, but no plan fits the whole global batch in one step: {exc} "
                      f"HeteroCentralStorageStrategy trains such batches as micro-batches within the caps by "
                      f"default; with micro_batches=False, fit stops at them with InfeasiblePlanError.", stacklevel=3)
        return None


def calibrate(model: Any, sample_batch: Any, *, devices: Sequence[str], parameter_device: str = "/device:CPU:0",
              global_batch_size: int | None = None, emulator: Any = None,
              probe_batch_sizes: Sequence[int] | None = None, warmup_steps: int = 2, trials: int = 5,
              max_batch_sizes: Sequence[int | None] | None = None, store: ProfileStore | None | bool = None,
              run_plan: Callable[[BatchPlan], float] | None = None, progress: bool = True,
              loss: Callable[..., Any] | None = None, check_cached: bool = True) -> CalibrationResult:
    """Times each compute device on the model's real step, fits its cost model, and solves a batch split.

    The probe step (broadcast from parameter_device, forward with training=True, loss, backward, gradient return)
    runs warmup_steps untimed times at each probe batch size of each device, then `trials` timed times at each,
    interleaved across devices (repeated up to MAX_TIMING_ROUNDS rounds while a device's noise exceeds
    NOISE_LIMIT); the median times are fitted by calibration.fit.fit_cost_model. On GPUs, an out-of-memory
    error at a probe size triggers a bounded search for the largest size that fits (the device's cap); CPU devices
    are capped only by max_batch_sizes. Then solve_batch_split gives the plan for global_batch_size.

    Results are cached (see calibration.store) under a key of the device ids (and emulated names and time scale),
    the model fingerprint, the input signature with global_batch_size, probe sizes and caps, and tf.__version__.

    Args:
        model: A built Keras model, compiled unless `loss` is given. Its variables may be those of a
            CentralStorageStrategy. It is not changed (non-trainable and metric variables are restored).
        sample_batch: (x, y) or (x, y, sample_weight), arrays or tensors with n >= 1 examples; probes larger than n
            repeat examples (step time does not depend on the values).
        devices: Compute devices in replica order, e.g. ["/device:GPU:0", "/device:GPU:1"], length R >= 1.
        parameter_device: Where the central variables live and gradients return.
        global_batch_size: B, examples per optimizer step; None means n.
        emulator: A hetero_cs.emulation.Emulator with R devices; replica i's steps then wait as long as its
            emulated device would take. If it has no workload, estimate_workload(model) is set on it.
        probe_batch_sizes: Sizes to probe on every device (sizes above a device's cap or B are dropped); None means
            5 geometric sizes from 1 to min(B, cap), and then, where a device's fit misses its curve, the slices the
            plan gives it and their neighbours (``_refit_at_plan``); given sizes are the only ones probed.
        warmup_steps: Untimed steps per size, >= 0 (the first one also traces the step function).
        trials: Timed steps per size, >= 1.
        max_batch_sizes: Per-replica caps in examples (None entries: no user cap), shape [R]; None for none.
        store: A ProfileStore; None means ProfileStore() (the default directory); False disables caching.
        run_plan: Optional callable that runs one training step with the plan and returns its wall time in seconds;
            called once to report measured against predicted makespan.
        progress: Show keras.utils.Progbar bars: the warm-up (one tick per size and device), then the timing
            (one tick per timed step).
        loss: callable(y_true, y_pred[, sample_weight]); None uses the model's compiled loss.
        check_cached: Before trusting a cached profile, time CHECK_TRIALS steps per device at the cached plan's
            slices (interleaved) and compare them with the profile's predictions; when the devices' relative speeds
            differ by more than the tolerance (see _cached_profile_mismatch), log why and recalibrate (the cache
            entry is replaced). A host that is uniformly busier or quieter than at calibration is not a mismatch.

    Returns:
        A CalibrationResult with one DeviceProfile per device, the plan (None, with a warning, when the caps cannot
        hold B) and, with run_plan, the measured makespan.

    Raises:
        DeviceError: If a device name cannot be parsed, is unknown to TensorFlow or is repeated.
        ConfigError: If an argument is out of range or the emulator's replica count differs from len(devices).
        CalibrationOOMError: If every device runs out of memory even at batch size 1 (one that does sits idle:
            its profile's cap is 0).
        CalibrationError: If the model has no loss, or a step fails.

    Examples:
        >>> names = setup_logical_devices(["A10", "T4", "P100"])  # before TF initialises
        >>> emulator = Emulator(["A10", "T4", "P100"])
        >>> result = calibrate(model, (x, y), devices=names, emulator=emulator, store=False)
        >>> print(result.format_table())
    """
    import keras
    import tensorflow as tf

    devices, parameter_device = _check_devices(devices, parameter_device)
    num_replicas = len(devices)
    if global_batch_size is None:
        global_batch_size = probe_lib.sample_batch_size(sample_batch)
    global_batch_size = _check_positive_int("global_batch_size", global_batch_size)
    warmup_steps = _check_positive_int("warmup_steps", warmup_steps, minimum=0)
    trials = _check_positive_int("trials", trials)
    caps: list[int | None] = [None] * num_replicas if max_batch_sizes is None else _positive_ints(
        "max_batch_sizes", max_batch_sizes, example="[64, None] (None: no cap)", none_allowed=True)
    if len(caps) != num_replicas:
        raise ConfigError(f"max_batch_sizes needs one entry per device. Received: len(max_batch_sizes)={len(caps)}, "
                          f"len(devices)={num_replicas}.")
    if probe_batch_sizes is not None:
        probe_batch_sizes = _positive_ints("probe_batch_sizes", probe_batch_sizes, example="[1, 4, 16, 64]")
    if emulator is not None:
        if emulator.num_replicas != num_replicas:
            raise ConfigError(f"The emulator has num_replicas={emulator.num_replicas} but len(devices)={num_replicas}; "
                              "give one catalog name per compute device.")
        if emulator.workload is None:
            from calibration.workload import estimate_workload

            emulator.set_workload(estimate_workload(model))

    if store is None or store is True:
        store = ProfileStore()
    elif store is not False and not isinstance(store, ProfileStore):
        raise ConfigError(f"store must be a ProfileStore, None or False. Received: store={store!r}.")
    gpu_facts = _gpu_facts() if any(":GPU:" in d for d in devices) else {}

    def make_probe(i: int) -> Any:  # probe_lib.DeviceProbe is looked up when called (a test replaces it)
        return probe_lib.DeviceProbe(model, sample_batch, device=devices[i], parameter_device=parameter_device,
                                     loss=loss, replica_id=i, emulator=emulator)

    key = None
    if store is not False:
        signature = (f"{probe_lib.input_signature(sample_batch)}|global_batch_size={global_batch_size}"
                     f"|probe_batch_sizes={None if probe_batch_sizes is None else sorted(set(probe_batch_sizes))}"
                     f"|max_batch_sizes={caps}|parameter_device={parameter_device}")
        key = profile_key(device_ids=_device_ids(devices, emulator, gpu_facts),
                          model_fingerprint=probe_lib.model_fingerprint(model), input_signature=signature,
                          tf_version=tf.__version__, dtype_policy=probe_lib.dtype_policy_name(model))
        cached = store.load(key)
        if cached is not None and cached.devices == tuple(devices):
            mismatch = None
            if check_cached:
                with probe_lib.preserved_model_state(model):
                    mismatch = _cached_profile_mismatch(cached, make_probe, devices=devices,
                                                        global_batch_size=global_batch_size)
            if mismatch is None:
                logger.info("Calibration profile cache hit (%s)%s; skipping calibration.", store.path(key),
                            ", checked against a few timed steps" if check_cached else "")
                return _with_measurement(dataclasses.replace(cached, from_cache=True, cache_key=key), run_plan)
            logger.warning("The cached calibration profile %s no longer fits this machine: %s. Recalibrating.",
                           store.path(key), mismatch)
        else:
            logger.info("Calibration profile cache miss; calibrating %d device(s).", num_replicas)

    start_s = time.perf_counter()
    sizes_per_device = [_device_probe_sizes(probe_batch_sizes, global_batch_size, cap) for cap in caps]
    # Keras' own progress bar, as in model.fit: a live bar on a terminal, one line per phase when the output goes
    # to a file or pipe. Phase 1 warms every probe size up and finds memory caps, one device after another; phase
    # 2 times all devices interleaved.
    verbose = (1 if sys.stdout.isatty() else 2) if progress else 0
    with probe_lib.preserved_model_state(model):
        calibrations = []
        # A heading above each bar, as model.fit prints "Epoch 1/5", where the INFO log lines that say the same
        # ("Warming up replica i ...", "Timing N device(s) interleaved ...") are not shown.
        headings = (verbose and not logger.isEnabledFor(logging.INFO)
                    and keras.config.is_interactive_logging_enabled())  # else the bars go to absl logging
        if headings:
            print(f"hetero_cs calibration: warming up {num_replicas} device(s) at their probe batch sizes", flush=True)
        warm_bar = keras.utils.Progbar(sum(len(s) for s in sizes_per_device), verbose=verbose, unit_name="size")
        for replica_id, (device, sizes) in enumerate(zip(devices, sizes_per_device)):
            probe = make_probe(replica_id)
            limit_bytes = probe.memory_limit_bytes() or getattr(gpu_facts.get(device), "memory_total_bytes", None)
            calibration = _DeviceCalibration(probe, cap=caps[replica_id], memory_limit_bytes=limit_bytes,
                                             warmup_steps=warmup_steps,
                                             emulated_as=None if emulator is None else emulator.specs[replica_id].name)
            logger.info("Warming up replica %d, %s, at probe_batch_sizes=%s", replica_id, calibration.label,
                        list(sizes))
            calibration.prepare(sizes, on_warm=lambda b: warm_bar.add(1, [("batch_size", b)]))
            calibrations.append(calibration)
        if all(c.cap == 0 for c in calibrations):
            raise CalibrationOOMError(
                "No device can hold one example of this model: " + "; ".join(
                    f"device={c.probe.device!r} ran out of memory at batch_sizes={c.out_of_memory_at}, the "
                    f"smallest tried (probe_batch_sizes={list(sizes)})"
                    for c, sizes in zip(calibrations, sizes_per_device))
                + ". Use a smaller model (or mixed precision), or devices with more memory. (A global batch larger "
                "than the devices hold trains as micro-batches; one example per device is the least that can run.)"
            )
        warmed = sum(len(c.sizes) for c in calibrations)
        if warmed < warm_bar.target:  # an out-of-memory cut the warm-up short
            warm_bar.update(warm_bar.target, finalize=True)
        logger.info("Timing %d device(s) interleaved: %d trials at each of their probe sizes", num_replicas, trials)
        if headings:
            print(f"hetero_cs calibration: timing {num_replicas} device(s) interleaved, {trials} trial(s) per probe "
                  f"batch size", flush=True)
        time_bar = keras.utils.Progbar(warmed * trials, verbose=verbose, unit_name="step")
        steps = itertools.count(1)

        def tick() -> None:
            if (step := next(steps)) <= time_bar.target:  # repeated rounds (noise) run past the bar's target
                time_bar.update(step)

        _time_interleaved(calibrations, trials, tick=tick)
        profiles = [calibration.profile() for calibration in calibrations]
        for replica_id, (calibration, profile) in enumerate(zip(calibrations, profiles)):
            logger.info("Calibrated replica %d, %s: %s, max_batch_size=%s, fit_error=%.1f%%, noise=%.1f%%", replica_id,
                        calibration.label, profile.describe_cost_model(), profile.max_batch_size,
                        profile.fit_error * 100, profile.relative_noise * 100)
        result = CalibrationResult(profiles=tuple(profiles), wall_time_s=0.0, emulated=emulator is not None)
        result = dataclasses.replace(result, plan=_solve(result, global_batch_size))
        # where a fit misses its curve: probe the plan's slices
        if result.plan is not None and probe_batch_sizes is None:
            profiles, plan = _refit_at_plan(
                calibrations, profiles, result.plan,
                lambda models: _solve(dataclasses.replace(result, profiles=tuple(models)), global_batch_size),
                trials=trials)
            result = dataclasses.replace(result, profiles=tuple(profiles), plan=plan)
        if result.plan is not None and sum(b > 0 for b in result.plan.per_replica_batch_sizes) > 1:
            # the cards side by side, as a training step runs them; then the plan again
            factors = _time_together(calibrations, result.plan.per_replica_batch_sizes)
            logger.info("Calibration: all cards at once at %s took %s their time alone; solving the plan again.",
                        list(result.plan.per_replica_batch_sizes), ", ".join(f"x{f:.3f}" for f in factors))
            result = dataclasses.replace(result, contention_factors=factors)
            result = dataclasses.replace(result, plan=_solve(result, global_batch_size))
    result = dataclasses.replace(result, wall_time_s=time.perf_counter() - start_s)
    # DEBUG: the table every caller prints or logs next (CalibrationResult.format_table) opens with the same line.
    logger.debug("Calibration of %d device(s) took %.2f s%s.", num_replicas, result.wall_time_s,
                " (emulated timings)" if emulator is not None else "")
    if key is not None:
        try:
            store.save(key, result)
            result = dataclasses.replace(result, cache_key=key)
        except ProfileCacheError as exc:
            warnings.warn(f"Calibration result not cached: {exc}", stacklevel=2)
    return _with_measurement(result, run_plan)


def _with_measurement(result: CalibrationResult, run_plan: Callable[[BatchPlan], float] | None) -> CalibrationResult:
    """Calls run_plan once with the plan and records its measured makespan."""
    if run_plan is None or result.plan is None:
        return result
    measured_s = float(run_plan(result.plan))
    if not (math.isfinite(measured_s) and measured_s >= 0):
        raise CalibrationError(f"run_plan must return a step time in seconds >= 0. Received: {measured_s!r}.")
    predicted_s = result.plan.predicted_makespan_s or float("nan")
    logger.info("Plan %s: predicted makespan %.4f s, measured %.4f s (measured/predicted %.3f)",
                list(result.plan.per_replica_batch_sizes), predicted_s, measured_s, measured_s / predicted_s)
    return dataclasses.replace(result, measured_makespan_s=measured_s)
