"""Drift of one emulated device over a range of steps: slower (thermal throttling) or with less memory (pure).

``Drift(replica_id=1, factor=2.0, from_step=200)`` makes replica 1's emulated device twice as slow from its step
200; ``Drift(replica_id=1, from_step=20, memory_bytes=48_000_000)`` leaves it only 48 MB from its step 20, as
when another process takes the rest of the device's memory. The :class:`~hetero_cs.emulation.Emulator` applies
both. This module imports neither TensorFlow nor pynvml.
"""

from __future__ import annotations

import dataclasses
import math

from hetero_cs.devices.catalog import _is_real
from hetero_cs.errors import ConfigError


def _is_plain_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class Drift:
    """A change of one emulated device's speed or memory over a range of steps.

    For the replica's steps in [from_step, until_step) it runs ``factor`` times slower (factor < 1: faster) and,
    when ``memory_bytes`` is set, has only that much device memory (a slice needing more raises the same
    ``tf.errors.ResourceExhaustedError`` a GPU raises). Overlapping drifts of one replica multiply their factors;
    of their memory limits the smallest applies.

    Attributes:
        replica_id: The replica that drifts, >= 0.
        factor: Slow-down factor, finite and > 0 (2.0 = twice as slow). Optional (1.0) when memory_bytes is given.
        from_step: First affected step of that replica (its own step counter: the steps it completed; a step
            that ran out of memory on it is retried as the same step), >= 0.
        until_step: First step no longer affected (> from_step), or None for "until the end".
        memory_bytes: Device memory left to the replica in those steps, bytes (int >= 1), or None (unchanged).

    Raises:
        ConfigError: If a field is out of range, or neither factor nor memory_bytes is given.
    """

    replica_id: int
    factor: float | None = None
    from_step: int = 0
    until_step: int | None = None
    memory_bytes: int | None = None

    def __post_init__(self) -> None:
        if not _is_plain_int(self.replica_id) or self.replica_id < 0:
            raise ConfigError(f"Drift.replica_id={self.replica_id!r} must be an int >= 0.")
        if self.memory_bytes is not None and (not _is_plain_int(self.memory_bytes) or self.memory_bytes < 1):
            raise ConfigError(
                f"Drift.memory_bytes={self.memory_bytes!r} must be None or an int >= 1 (bytes left to the device).")
        if self.factor is None:
            if self.memory_bytes is None:
                raise ConfigError(
                    f"Drift(replica_id={self.replica_id}) changes nothing: give factor= (2.0 = twice as slow) or "
                    "memory_bytes= (device memory left), or both.")
            object.__setattr__(self, "factor", 1.0)
        if not (_is_real(self.factor) and math.isfinite(self.factor) and self.factor > 0):
            raise ConfigError(f"Drift.factor={self.factor!r} must be a finite number > 0 (2.0 = twice as slow).")
        if not _is_plain_int(self.from_step) or self.from_step < 0:
            raise ConfigError(f"Drift.from_step={self.from_step!r} must be an int >= 0.")
        if self.until_step is not None and (not _is_plain_int(self.until_step) or self.until_step <= self.from_step):
            raise ConfigError(
                f"Drift.until_step={self.until_step!r} must be None or an int > from_step={self.from_step}.")

    def applies(self, step: int) -> bool:
        """Whether this drift affects ``step`` (in [from_step, until_step))."""
        return step >= self.from_step and (self.until_step is None or step < self.until_step)

    def describe(self) -> str:
        """E.g. ``"x2 steps [200, end)"`` or ``"48 MB steps [20, 60)"``."""
        parts = [] if self.factor == 1.0 and self.memory_bytes is not None else [f"x{self.factor:g}"]
        if self.memory_bytes is not None:
            parts.append(f"{self.memory_bytes / 1e6:.4g} MB")
        end = "end" if self.until_step is None else self.until_step
        return f"{' '.join(parts)} steps [{self.from_step}, {end})"
