"""Emulated accelerators: delay injection on logical CPU devices, from the catalog's figures.

An emulated replica runs the real computation on a logical CPU device (``/device:CPU:1`` ...) and then waits until
its step has taken as long as the named device would take for its slice of the batch
(:func:`hetero_cs.devices.workload.emulated_step_time_s`: a fixed cost per step and per layer, compute at a stated
efficiency of the rate TensorFlow runs the model's dtype at on that card - TF32 for float32 on Ampere and newer -,
the layers' memory traffic, and the parameter broadcast and the gradient return over the device's PCIe link). This
lets the whole calibrate -> solve -> train -> monitor -> re-balance loop run on a CPU-only machine. Calibration and
the monitor measure wall time only; they never read this catalog.

Emulated memory: each device has its catalog memory (or the ``NAME@SIZE`` override, e.g. ``"T4@48MB"``), which a
:class:`Drift` with ``memory_bytes`` lowers for a range of steps. A replica whose slice needs more than that
(:func:`hetero_cs.devices.workload.slice_memory_bytes`: weights, gradients, optimizer variables and activations)
fails its step with :class:`hetero_cs.errors.EmulatedOutOfMemoryError`, a ``MemoryError``, which TensorFlow turns
into the ``tf.errors.ResourceExhaustedError`` a GPU raises.

The catalog itself is :mod:`hetero_cs.devices.catalog`, drift :mod:`hetero_cs.devices.drift`, the model's workload
:mod:`hetero_cs.devices.workload`. This module is pure (``Emulator``): it imports neither
TensorFlow nor pynvml (``setup_logical_devices``, in :mod:`hetero_cs.devices.logical`, imports TensorFlow inside its
own), so ``import hetero_cs.emulation`` never loads TensorFlow. The waits are inserted into the training graph by
:mod:`hetero_cs.devices.step_clock`.

All times produced here are emulated, not measured; every human-readable output says so.
"""

import dataclasses
import logging
import math
import os
import sys
import threading
from collections.abc import Iterable, Sequence

from hetero_cs._copying import DeepcopiedWithNewLocks
from hetero_cs.devices.catalog import (
    MAX_EMULATED_MAKESPAN_S, MAX_TIME_SCALE, TIME_SCALE_ENV_VAR, DeviceSpec, _float_or, _is_int, _is_real,
    get_device_spec)
from hetero_cs.devices.drift import Drift
from hetero_cs.devices.workload import Workload, emulated_step_time_s, max_examples_in_memory, slice_memory_bytes
from hetero_cs.errors import ConfigError, EmulatedDeviceError, EmulatedOutOfMemoryError, EmulationError

__all__ = ["Drift", "Emulator", "Workload", "emulated_step_time_s"]

logger = logging.getLogger(__name__)


def _even_split(global_batch_size: int, num_replicas: int) -> list[int]:
    """As hetero_cs.planning.plan.even_batch_split, without NumPy (this module imports none)."""
    base, extra = divmod(global_batch_size, num_replicas)
    return [base + (1 if i < extra else 0) for i in range(num_replicas)]


class Emulator(DeepcopiedWithNewLocks):
    """Emulated step times for a set of replicas, one catalog device each; safe to call from several threads.

    The emulated step time of replica i on b examples at its step s is
    ``time_scale * drift_factor(i, s) * emulated_step_time_s(spec_i, b, workload)``. ``time_scale`` stretches all
    devices alike (ratios between devices are kept) so that emulated waits dominate the real CPU compute of a small
    model; it comes from the ``time_scale`` argument, else the environment variable
    ``HETERO_CS_EMULATION_TIME_SCALE``, else ``calibrate_time_scale``, else 1.0.

    Args:
        device_names: Catalog names, one per replica in replica-id order (length R >= 1); ``NAME@SIZE`` overrides
            a device's memory, e.g. ``"T4@48MB"`` (see :func:`hetero_cs.devices.catalog.get_device_spec`).
        workload: The model's Workload; may be set later with ``set_workload``.
        time_scale: Fixed multiplier of all emulated times, in (0, MAX_TIME_SCALE] (1000); None to take it from the
            environment or from ``calibrate_time_scale``.
        drift: Speed and memory changes per replica (:class:`Drift`).

    Raises:
        UnknownEmulatedDeviceError: If a name is not in the catalog.
        ConfigError: If ``device_names`` is empty or not a sequence, ``time_scale`` (or the environment variable) is
            not a number in (0, MAX_TIME_SCALE], ``drift`` is not a sequence of Drift, or a drift names a replica
            >= R.

    Examples:
        >>> emulator = Emulator(["A10", "T4"], workload=Workload(4e5, 800_000))
        >>> scale = emulator.calibrate_time_scale(256)  # the slower T4 at 128 examples -> ~0.05 s
        >>> emulator.delay_s(0, 128) < emulator.delay_s(1, 128)
        True
    """

    def __init__(self, device_names: Sequence[str], *, workload: Workload | None = None,
                 time_scale: float | None = None, drift: Sequence[Drift] = ()) -> None:
        if isinstance(device_names, (str, bytes)) or not isinstance(device_names, Iterable) or not (
                names := list(device_names)):
            raise ConfigError(
                f"device_names={device_names!r} must be a non-empty sequence of catalog names, e.g. ['A10', 'T4'].")
        self._specs = tuple(get_device_spec(name) for name in names)
        num_replicas = len(self._specs)
        if isinstance(drift, (Drift, str, bytes)) or not isinstance(drift, Iterable):
            raise ConfigError(f"drift must be a sequence of Drift instances. Received: drift={drift!r}. Wrap a single "
                              f"drift in a list: drift=[Drift(replica_id=1, factor=2.0, from_step=200)].")
        self._drift = tuple(drift)
        for item in self._drift:
            if not isinstance(item, Drift):
                raise ConfigError(f"drift entries must be Drift instances; received: {item!r}.")
            if item.replica_id >= num_replicas:
                raise ConfigError(f"Drift replica_id={item.replica_id} but there are num_replicas={num_replicas} (ids "
                                  f"0..{num_replicas - 1}); fix the drift's replica_id.")
        if workload is not None:
            self._check_workload(workload)
        self._lock = threading.Lock()
        # _time_scale_source: what fixed the scale (the argument or the environment), for messages
        self._time_scale, self._time_scale_source = 1.0, None
        if time_scale is not None:
            self.fix_time_scale(time_scale, "time_scale")
        elif raw := os.environ.get(TIME_SCALE_ENV_VAR, "").strip():
            # text that is not a number is refused with the text by _check_scale
            self.fix_time_scale(_float_or(raw, raw), f"{TIME_SCALE_ENV_VAR}={raw!r}")
        self._workload = workload
        self._steps = [0] * num_replicas

    @staticmethod
    def _check_scale(value: float, label: str) -> float:
        if not _is_real(value) or not math.isfinite(value) or not 0 < value <= MAX_TIME_SCALE:
            raise ConfigError(f"{label} (value {value!r}) must be a finite number > 0, e.g. 1.0 for real time, and at "
                              f"most MAX_TIME_SCALE={MAX_TIME_SCALE:g} (there the emulated launch overhead alone takes "
                              f"0.5 s per step).")
        return float(value)

    @property
    def specs(self) -> tuple[DeviceSpec, ...]:
        """The emulated devices, in replica-id order."""
        return self._specs

    @property
    def num_replicas(self) -> int:
        """R, the number of emulated replicas."""
        return len(self._specs)

    @property
    def time_scale(self) -> float:
        """The multiplier applied to every emulated time."""
        with self._lock:
            return self._time_scale

    @property
    def workload(self) -> Workload | None:
        """The current Workload, or None if not set yet."""
        with self._lock:
            return self._workload

    @property
    def steps_done(self) -> tuple[int, ...]:
        """Steps each replica has taken (``delay_s`` calls), in replica-id order."""
        with self._lock:
            return tuple(self._steps)

    def _check_workload(self, workload: Workload) -> None:
        if not isinstance(workload, Workload):
            raise ConfigError(f"workload must be a Workload; received: {workload!r}.")
        for spec in self._specs:  # a device without the workload's arithmetic (bf16 on a T4) is refused here
            spec.peak_tflops(workload.compute_dtype)

    def set_workload(self, workload: Workload) -> None:
        """Sets the Workload used by every later time query.

        Raises:
            UnsupportedPrecisionError: If a device has no arithmetic in the workload's compute dtype (bf16: T4,
                P100, V100).
        """
        self._check_workload(workload)
        with self._lock:
            self._workload = workload

    def advance_to(self, step: int) -> None:
        """Sets every replica's step counter to ``step`` (>= 0), e.g. when training resumes from a checkpoint."""
        self._check_step(step, none_allowed=False)
        with self._lock:
            self._steps = [step] * len(self._specs)

    def skip_step(self, replica_ids: Sequence[int]) -> None:
        """Advances the step counters of replicas a step leaves idle, as ``delay_s(i, 0)`` does (0 examples: 0 s,
        no memory, nothing fails), without its computation: one lock for the step's idle replicas.

        Raises:
            ConfigError: If a replica id is not in [0, R).
        """
        for i in replica_ids:
            self._check_replica(i)
        with self._lock:
            for i in replica_ids:
                self._steps[i] += 1

    def calibrate_time_scale(self, global_batch_size: int, *, target_makespan_s: float = 0.05) -> float:
        """Chooses ``time_scale`` so the slowest replica's step at an even split takes ~``target_makespan_s``.

        A scale fixed by the constructor argument or the environment variable is kept, but checked: it may not
        stretch the even-split step beyond MAX_EMULATED_MAKESPAN_S (5 s).

        Args:
            global_batch_size: B >= 1, split evenly across the R replicas for this purpose.
            target_makespan_s: Emulated makespan wanted at the even split, in seconds, in
                (0, MAX_EMULATED_MAKESPAN_S]. Keep it well above the real per-replica compute so the emulated ratios
                between devices dominate.

        Returns:
            The time_scale now in force.

        Raises:
            ConfigError: If an argument is out of range, or a fixed scale makes the even-split step longer than
                MAX_EMULATED_MAKESPAN_S (the message names the argument or environment variable).
            EmulationError: If no Workload has been set (and the scale is not fixed).
        """
        if not _is_int(global_batch_size) or global_batch_size < 1:
            raise ConfigError(
                f"global_batch_size={global_batch_size!r} must be an int >= 1 (examples per optimizer step).")
        global_batch_size = int(global_batch_size)
        if not (_is_real(target_makespan_s) and math.isfinite(target_makespan_s)
                and 0 < target_makespan_s <= MAX_EMULATED_MAKESPAN_S):
            raise ConfigError(f"target_makespan_s={target_makespan_s!r} must be a finite number of seconds > 0, e.g. "
                              f"0.05, and at most MAX_EMULATED_MAKESPAN_S={MAX_EMULATED_MAKESPAN_S:g}.")
        with self._lock:
            if self._time_scale_source is not None and self._workload is None:
                return self._time_scale  # nothing to check it against yet
            workload = self._require_workload()
            split = _even_split(global_batch_size, len(self._specs))
            makespan_s = max(emulated_step_time_s(spec, b, workload) for spec, b in zip(self._specs, split))
            if self._time_scale_source is not None:  # fixed: it may not stretch the step beyond the longest
                if self._time_scale * makespan_s > MAX_EMULATED_MAKESPAN_S:
                    raise ConfigError(
                        f"{self._time_scale_source} (value {self._time_scale:g}) stretches this model's emulated "
                        f"even-split step at global_batch_size={global_batch_size} to "
                        f"{self._time_scale * makespan_s:.3g} s, above MAX_EMULATED_MAKESPAN_S="
                        f"{MAX_EMULATED_MAKESPAN_S:g} s. Use at most {MAX_EMULATED_MAKESPAN_S / makespan_s:.3g} (e.g. "
                        f"{target_makespan_s / makespan_s:.3g} for a {target_makespan_s * 1e3:g} ms step), or leave it "
                        f"unset and the scale is chosen for you.")
                return self._time_scale
            self._time_scale = target_makespan_s / makespan_s
            logger.info("Emulation time_scale=%.4g (even-split makespan %.4g s emulated -> %.4g s).",
                        self._time_scale, makespan_s, target_makespan_s)
            return self._time_scale

    def _require_workload(self) -> Workload:
        if self._workload is None:
            raise EmulationError("The emulator has no Workload. Pass workload= to Emulator(...) or call "
                                 "emulator.set_workload(estimate_workload(model)).")
        return self._workload

    def _check_replica(self, replica_id: int) -> None:
        if isinstance(replica_id, bool) or not isinstance(replica_id, int) or not 0 <= replica_id < len(self._specs):
            raise ConfigError(f"replica_id={replica_id!r} must be an int in [0, {len(self._specs)}) for "
                              f"num_replicas={len(self._specs)}.")

    @staticmethod
    def _check_step(step: int | None, *, none_allowed: bool = True) -> None:
        if not (step is None and none_allowed) and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ConfigError(f"step={step!r} must be {'None or ' if none_allowed else ''}an int >= 0.")

    def _step_time_locked(self, replica_id: int, batch_size: int, step: int) -> float:
        base_s = emulated_step_time_s(self._specs[replica_id], batch_size, self._require_workload())
        return self._time_scale * math.prod(d.factor for d in self._drift if d.replica_id == replica_id
                                            and d.applies(step)) * base_s

    def step_time_s(self, replica_id: int, batch_size: int, *, step: int | None = None) -> float:
        """Emulated step time of a replica, without advancing anything.

        Args:
            replica_id: In [0, R).
            batch_size: Examples in the slice, >= 0 (0 -> 0 s: the replica idles).
            step: The replica's step whose drift applies; None for its next step.

        Returns:
            Seconds (already multiplied by time_scale and drift).

        Raises:
            ConfigError: If an argument is out of range.
            EmulationError: If no Workload has been set.
        """
        self._check_replica(replica_id)
        self._check_step(step)
        with self._lock:
            return self._step_time_locked(replica_id, batch_size, self._steps[replica_id] if step is None else step)

    def fix_time_scale(self, value: float, source: str) -> None:
        """Fixes ``time_scale`` to ``value`` (``calibrate_time_scale`` then keeps it), e.g. the scale the profiles
        of a run before a restart were timed at; ``source`` names it in messages.

        Raises:
            ConfigError: ``value`` is not a number in (0, MAX_TIME_SCALE].
        """
        value = self._check_scale(value, source)
        with self._lock:
            self._time_scale, self._time_scale_source = value, source

    def without(self, replicas: Sequence[int]) -> "Emulator":
        """A new Emulator without the cards at positions ``replicas`` (a restart without a lost card).

        The others keep their order, their workload and a time scale fixed by an argument or the environment; their
        drifts follow them (replica ids renumbered); the drifts of the cards left out are dropped.

        Raises:
            ConfigError: A position out of range, or every card left out.
        """
        drop = set(replicas)
        if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(self._specs) for i in drop):
            raise ConfigError(f"Positions to leave out must be ints in [0, {len(self._specs)}). Received: "
                              f"{sorted(drop, key=str)!r}.")
        if not (keep := [i for i in range(len(self._specs)) if i not in drop]):
            raise ConfigError(f"Leaving out {sorted(drop)} leaves no card of {[s.name for s in self._specs]}.")
        drift = [dataclasses.replace(d, replica_id=keep.index(d.replica_id)) for d in self._drift
                 if d.replica_id in keep]
        return Emulator([self._specs[i].name for i in keep], workload=self._workload,
                        time_scale=self._time_scale if self._time_scale_source == "time_scale" else None, drift=drift)

    @property
    def may_fail(self) -> bool:
        """Whether a :class:`Drift` makes some replica's steps fail or its card lost (``fails`` or ``lost``)."""
        return any(d.fails or d.lost for d in self._drift)

    def _check_health_locked(self, replica_id: int, step: int) -> None:
        """Raises (``fails``) or aborts the process (``lost``) when a drift says the card fails at ``step``."""
        name = self._specs[replica_id].name
        for item in (d for d in self._drift if d.replica_id == replica_id):
            if item.lost and step >= item.from_step:
                # What a sticky CUDA error does: TensorFlow logs the driver's error, then the process aborts.
                sys.stderr.write(f"hetero_cs emulation: lost replica={replica_id} ({name}) at its step {step}: "
                                 f"CUDA_ERROR_ECC_UNCORRECTABLE: uncorrectable ECC error encountered (emulated sticky "
                                 f"CUDA error); the process aborts\n")
                sys.stderr.flush()
                os.abort()
            if item.fails and item.applies(step):
                self._steps[replica_id] = step + 1  # a failed attempt counts: a fault over one step is survived
                raise EmulatedDeviceError(
                    f"CUDA_ERROR_ECC_UNCORRECTABLE: uncorrectable ECC error encountered: emulated device fault on "
                    f"replica={replica_id} ({name}) at its step {step} (a Drift with fails=True).",
                    replica_id=replica_id, device_name=name, step=step)

    def delay_s(self, replica_id: int, batch_size: int) -> float:
        """Emulated time of the replica's next step (drift at its step counter); then advances that counter.

        A card that a :class:`Drift` makes fail at this step raises :class:`EmulatedDeviceError` (the counter
        advances: the attempt counts), and one it makes lost aborts the process. The step's memory is checked next
        (see :meth:`check_memory`); a step that runs out of memory raises without advancing the counter (the
        replica did not complete it; its retry is the same step).

        Args:
            replica_id: In [0, R).
            batch_size: Examples in the slice, >= 0.

        Returns:
            Seconds the replica's step should take in all (real compute included).

        Raises:
            EmulatedDeviceError: The card fails at this step (a Drift with ``fails=True``).
            EmulatedOutOfMemoryError: The slice needs more memory than the device has at this step.
        """
        self._check_replica(replica_id)
        with self._lock:
            step = self._steps[replica_id]
            if batch_size > 0:
                self._check_health_locked(replica_id, step)
            self._check_memory_locked(replica_id, batch_size, step)
            value = self._step_time_locked(replica_id, batch_size, step)
            self._steps[replica_id] = step + 1
            return value

    def memory_bytes(self, replica_id: int, *, step: int | None = None) -> int:
        """Device memory of a replica at a step: its catalog size (or ``NAME@SIZE`` override), lowered by drift.

        Args:
            replica_id: In [0, R).
            step: The replica's step; None for its next step.
        """
        self._check_replica(replica_id)
        with self._lock:
            return self._memory_locked(replica_id, self._steps[replica_id] if step is None else step)

    def lowest_memory_bytes(self, replica_id: int) -> int:
        """The least device memory the replica ever has: its catalog size (or override), or a drift's lower limit.

        Args:
            replica_id: In [0, R).
        """
        self._check_replica(replica_id)
        return self._memory_locked(replica_id, None)

    def max_batch_size(self, replica_id: int, *, step: int | None = None) -> int | None:
        """The largest slice that fits the replica's memory at a step (0: none fits; None: unbounded).

        Raises:
            EmulationError: If no Workload has been set.
        """
        memory = self.memory_bytes(replica_id, step=step)
        return max_examples_in_memory(self.workload or self._require_workload(), memory)

    def check_memory(self, replica_id: int, batch_size: int, *, step: int | None = None, training: bool = True) -> None:
        """Raises if a slice of ``batch_size`` examples does not fit the replica's memory at a step.

        What the slice needs is :func:`hetero_cs.devices.workload.slice_memory_bytes` of the Workload, for a
        training step or (``training=False``) an inference step.

        Raises:
            EmulatedOutOfMemoryError: It does not fit (a MemoryError; inside a TensorFlow step it becomes
                ``tf.errors.ResourceExhaustedError``, as on a GPU). The message names the replica, the bytes needed
                and the bytes the device has.
            EmulationError: If no Workload has been set.
        """
        self._check_replica(replica_id)
        with self._lock:
            self._check_memory_locked(replica_id, batch_size, self._steps[replica_id] if step is None else step,
                                      training=training)

    def _memory_locked(self, replica_id: int, step: int | None) -> int:
        """The replica's memory at ``step`` (None: the least it ever has)."""
        limits = [d.memory_bytes for d in self._drift
                  if d.replica_id == replica_id and d.memory_bytes is not None and (step is None or d.applies(step))]
        return min([self._specs[replica_id].memory_bytes, *limits])

    def _check_memory_locked(self, replica_id: int, batch_size: int, step: int, *, training: bool = True) -> None:
        needed = slice_memory_bytes(self._require_workload(), batch_size, training=training)
        available = self._memory_locked(replica_id, step)
        if needed > available:
            raise EmulatedOutOfMemoryError(
                f"Emulated out of memory: replica={replica_id} ({self._specs[replica_id].name}) needs "
                f"{needed} bytes for a slice of batch_size={batch_size} at its step {step}, but the device has "
                f"memory_bytes={available}. Give it a smaller slice (max_batch_sizes), or more memory "
                f"(the NAME@SIZE override or the Drift's memory_bytes).",
                replica_id=replica_id, needed_bytes=needed, memory_bytes=available)

    def describe(self, global_batch_size: int | None = None) -> list[str]:
        """Lines of a table of the emulated replicas; the header says the times are emulated.

        Args:
            global_batch_size: If given (and a Workload is set), each row shows the replica's emulated step time
                at an even split of this batch.
        """
        with self._lock:
            workload, scale = self._workload, self._time_scale
            split = (_even_split(global_batch_size, len(self._specs))
                     if global_batch_size and workload is not None else None)
            dtype, tf32 = ("float32", True) if workload is None else (workload.compute_dtype, workload.tensor_float_32)
            width = max([6] + [len(spec.name) for spec in self._specs])  # "T4@48MB" is wider than "A10"
            lines = [f"EMULATED devices (times below are emulated, not measured; time_scale={scale:.4g})",
                     f"{'replica':>7}  {'device':<{width}} {'peak TF':>10} {'PCIe':>9}  {'step (even split)':>18}  "
                     f"drift"]
            for i, spec in enumerate(self._specs):
                link = "host" if spec.pcie_generation is None else f"gen{spec.pcie_generation} x{spec.pcie_lanes}"
                step_text = "-" if split is None else (
                    f"{self._step_time_locked(i, split[i], self._steps[i]) * 1e3:.3f} ms ({split[i]})")
                drift_text = ", ".join(d.describe() for d in self._drift if d.replica_id == i) or "-"
                rate = f"{spec.peak_tflops(dtype, tf32=tf32):.1f} {spec.rate_name(dtype, tf32=tf32)}"
                lines.append(f"{i:>7}  {spec.name:<{width}} {rate:>10} {link:>9}  {step_text:>18}  {drift_text}")
        return lines
