"""Drift of one emulated device over a range of steps: slower, with less memory, failing or lost (pure).

``Drift(replica_id=1, factor=2.0, from_step=200)`` makes replica 1's emulated device twice as slow from its step
200 (thermal throttling); ``Drift(replica_id=1, from_step=20, memory_bytes=48_000_000)`` leaves it only 48 MB from
its step 20, as when another process takes the rest of the device's memory. ``Drift(replica_id=1, from_step=20,
fails=True)`` makes its steps fail with a device error from step 20 (an uncorrectable ECC error, say), and
``Drift(replica_id=1, from_step=20, lost=True)`` ends the process at that step the way a sticky CUDA error does.
The :class:`~hetero_cs.emulation.Emulator` applies them. This module imports neither TensorFlow nor pynvml.
"""

import dataclasses
import math

from hetero_cs.devices.catalog import _is_int, _is_real
from hetero_cs.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Drift:
    """A change of one emulated device's speed, memory or health over a range of steps.

    For the replica's steps in [from_step, until_step) it runs ``factor`` times slower (factor < 1: faster) and,
    when ``memory_bytes`` is set, has only that much device memory (a slice needing more raises the same
    ``tf.errors.ResourceExhaustedError`` a GPU raises). Overlapping drifts of one replica multiply their factors;
    of their memory limits the smallest applies.

    With ``fails=True`` each training step of the replica in that range fails with a device error, as a GPU's
    does: TensorFlow reports it as ``tf.errors.UnknownError`` whose text holds ``CUDA_ERROR_ECC_UNCORRECTABLE`` and
    names the replica's device (:class:`hetero_cs.errors.EmulatedDeviceError` inside the step). A failed attempt
    counts as one of the replica's steps, so ``until_step=from_step + 1`` is a fault that a retry survives. With
    ``lost=True`` the replica's step ``from_step`` ends the process as a sticky CUDA error does: a line on standard
    error names the card (``hetero_cs emulation: lost replica=<i> (<name>) ...``), then the process aborts
    (SIGABRT). Both apply to training steps only (an idle replica runs no step, so it never fails).

    Attributes:
        replica_id: The replica that drifts, >= 0.
        factor: Slow-down factor, finite and > 0 (2.0 = twice as slow). Optional (1.0) when memory_bytes is given.
        from_step: First affected step of that replica (its own step counter: the steps it completed; a step
            that ran out of memory on it is retried as the same step), >= 0.
        until_step: First step no longer affected (> from_step), or None for "until the end".
        memory_bytes: Device memory left to the replica in those steps, bytes (int >= 1), or None (unchanged).
        fails: Every training step of the replica in those steps fails with a device error (bool).
        lost: The replica's step ``from_step`` aborts the process (bool; ``until_step`` must be None).

    Raises:
        ConfigError: If a field is out of range, both ``fails`` and ``lost`` are set, ``lost`` has an until_step,
            or none of factor, memory_bytes, fails and lost is given.
    """

    replica_id: int
    factor: float | None = None
    from_step: int = 0
    until_step: int | None = None
    memory_bytes: int | None = None
    fails: bool = False
    lost: bool = False

    def __post_init__(self) -> None:
        for name in ("fails", "lost"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"Drift.{name}={getattr(self, name)!r} must be True or False.")
        if self.fails and self.lost:
            raise ConfigError(f"Drift(replica_id={self.replica_id}) sets both fails=True and lost=True: a lost card "
                              "ends the process at its first step, so give one of them (fails=True: its steps fail; "
                              "lost=True: the process aborts).")
        if self.lost and self.until_step is not None:
            raise ConfigError(
                f"Drift(replica_id={self.replica_id}, lost=True) has until_step={self.until_step!r}: a lost card "
                "ends the process at from_step, so leave until_step=None (use fails=True for a fault that ends).")
        if not _is_int(self.replica_id) or self.replica_id < 0:
            raise ConfigError(f"Drift.replica_id={self.replica_id!r} must be an int >= 0.")
        if self.memory_bytes is not None and (not _is_int(self.memory_bytes) or self.memory_bytes < 1):
            raise ConfigError(
                f"Drift.memory_bytes={self.memory_bytes!r} must be None or an int >= 1 (bytes left to the device).")
        if self.factor is None:
            if self.memory_bytes is None and not (self.fails or self.lost):
                raise ConfigError(f"Drift(replica_id={self.replica_id}) changes nothing: give factor= (2.0 = twice as "
                                  "slow), memory_bytes= (device memory left), fails=True (its steps fail) or lost=True "
                                  "(the process aborts).")
            object.__setattr__(self, "factor", 1.0)
        if not (_is_real(self.factor) and math.isfinite(self.factor) and self.factor > 0):
            raise ConfigError(f"Drift.factor={self.factor!r} must be a finite number > 0 (2.0 = twice as slow).")
        if not _is_int(self.from_step) or self.from_step < 0:
            raise ConfigError(f"Drift.from_step={self.from_step!r} must be an int >= 0.")
        if self.until_step is not None and (not _is_int(self.until_step) or self.until_step <= self.from_step):
            raise ConfigError(
                f"Drift.until_step={self.until_step!r} must be None or an int > from_step={self.from_step}.")

    def applies(self, step: int) -> bool:
        """Whether this drift affects ``step`` (in [from_step, until_step))."""
        return step >= self.from_step and (self.until_step is None or step < self.until_step)

    def describe(self) -> str:
        """E.g. ``"x2 steps [200, end)"``, ``"48 MB steps [20, 60)"`` or ``"fails steps [5, 6)"``."""
        parts = [] if self.factor == 1.0 and (self.memory_bytes is not None or self.fails or self.lost) \
            else [f"x{self.factor:g}"]
        if self.memory_bytes is not None:
            parts.append(f"{self.memory_bytes / 1e6:.4g} MB")
        if self.fails:
            parts.append("fails")
        if self.lost:
            return " ".join([*parts, f"lost at step {self.from_step}"])
        end = "end" if self.until_step is None else self.until_step
        return f"{' '.join(parts)} steps [{self.from_step}, {end})"
