"""Per-replica memory caps that follow out-of-memory steps down and grow back slowly (pure).

A calibrated memory cap (the largest slice that fitted while calibrating) can be wrong at run time: another process
takes memory, the allocator fragments, a batch holds longer sequences. When a replica's step runs out of memory,
:class:`MemoryCaps` lowers that replica's cap:

* to the largest slice that replica completed among its last ``recent_steps`` successful steps, if one is
  smaller than the slice that failed (a size known to fit, e.g. before a re-plan grew the slice);
* else to ``floor(failed * backoff_factor)`` (0.5 by default: a drop to half the memory is recovered by one retry,
  to a quarter by two). Such a cap is an upper bound, not a size known to fit (:meth:`MemoryCaps.known_to_fit`).

A lowered cap grows back slowly, so that memory freed later (the other process ended) is used again: after
``grow_after_steps`` consecutive successful steps of that replica, its cap grows by ``growth_factor`` (at least one
example), never above the calibrated cap; a lowered cap that reaches the global batch size (or the calibrated cap)
is lifted. Growing is a probe: if the grown cap runs out of memory, the cap falls back (to the slice that last
fitted) and that replica waits twice as long before growing again (up to ``max_grow_after_steps``), so a device
whose memory stays short costs one failed step per doubling interval, not one per ``grow_after_steps``.

This module is pure: it imports neither TensorFlow nor pynvml. It is not thread-safe on its own: the
:class:`~hetero_cs.planning.balancer.Balancer` calls it under its lock.
"""

import collections
import dataclasses
import math
from collections.abc import Sequence

from hetero_cs.errors import ConfigError
from hetero_cs.planning.plan import check_range


HISTORY_LENGTH = 256
"""How many cap changes ``MemoryCaps.history`` keeps (the oldest are dropped), so a long run does not grow it."""


@dataclasses.dataclass(frozen=True)
class MemoryRecoveryPolicy:
    """How caps fall after an out-of-memory step and grow back.

    Attributes:
        backoff_factor: In (0, 1): a failed slice of b examples caps the replica at floor(b * backoff_factor) when
            no smaller slice succeeded recently. Default 0.5.
        max_retries: Retries of one global batch after out-of-memory steps, >= 1, before the step fails with
            :class:`hetero_cs.errors.StepOOMError`. Default 4.
        recent_steps: >= 1, how many of a replica's last successful slices count as "succeeded recently".
            Default 16.
        grow_after_steps: >= 1, consecutive successful steps of a replica before its lowered cap grows. Default 50.
        growth_factor: > 1, how much a lowered cap grows at a time (at least one example). Default 1.25.
        max_grow_after_steps: >= grow_after_steps, the longest wait before growing after repeated failed probes.
            Default 6400.
    """

    backoff_factor: float = 0.5
    max_retries: int = 4
    recent_steps: int = 16
    grow_after_steps: int = 50
    growth_factor: float = 1.25
    max_grow_after_steps: int = 6400

    def __post_init__(self) -> None:
        if not (isinstance(self.backoff_factor, (int, float)) and 0.0 < self.backoff_factor < 1.0):
            raise ConfigError(
                f"MemoryRecoveryPolicy.backoff_factor={self.backoff_factor!r} must be a number in (0, 1), e.g. 0.5.")
        if not (isinstance(self.growth_factor, (int, float)) and 1.0 < self.growth_factor < math.inf):
            raise ConfigError(
                f"MemoryRecoveryPolicy.growth_factor={self.growth_factor!r} must be a finite number > 1, e.g. 1.25.")
        for name in ("max_retries", "recent_steps", "grow_after_steps", "max_grow_after_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"MemoryRecoveryPolicy.{name}={value!r} must be an int >= 1.")
        if self.max_grow_after_steps < self.grow_after_steps:
            raise ConfigError(f"MemoryRecoveryPolicy.max_grow_after_steps={self.max_grow_after_steps} must be >= "
                              f"grow_after_steps={self.grow_after_steps}.")


@dataclasses.dataclass(frozen=True)
class CapChange:
    """One change of one replica's memory cap.

    Attributes:
        replica_id: The replica.
        old_cap: Its cap before, in examples (None: uncapped).
        new_cap: Its cap after (None: uncapped again).
        reason: ``"out_of_memory"`` (a step failed with a slice of ``batch_size`` examples), ``"grow"``, or
            ``"excluded"`` (its device failed: the cap stays 0, see :meth:`MemoryCaps.exclude`).
        batch_size: The slice that failed (out_of_memory, excluded), or the largest recent success (grow).
    """

    replica_id: int
    old_cap: int | None
    new_cap: int | None
    reason: str
    batch_size: int

    def describe(self) -> str:
        """One line, e.g. ``"replica 1: cap 40 -> 20 (out of memory at 40 examples)"``."""
        if self.reason == "excluded":
            return (f"replica {self.replica_id}: cap {self.old_cap} -> 0 (excluded: its device failed with a slice of "
                    f"{self.batch_size} examples)")
        why = (f"out of memory at {self.batch_size} examples" if self.reason == "out_of_memory"
               else f"grown after successful steps; largest recent slice {self.batch_size}")
        return f"replica {self.replica_id}: cap {self.old_cap} -> {self.new_cap} ({why})"


class MemoryCaps:
    """The per-replica caps in force: the calibrated ones, lowered by out-of-memory steps, grown back slowly.

    Args:
        num_replicas: R >= 1.
        policy: The policy; None for the defaults.

    Examples:
        >>> caps = MemoryCaps(2)
        >>> caps.reset([None, 64])
        >>> caps.record_success((30, 30))
        []
        >>> caps.record_out_of_memory(1, 30).new_cap   # no smaller slice succeeded: 30 * 0.5
        15
        >>> caps.caps
        [None, 15]
    """

    def __init__(self, num_replicas: int, policy: MemoryRecoveryPolicy | None = None) -> None:
        check_range("num_replicas", num_replicas, 1, integer=True)
        self._num_replicas = num_replicas
        self.policy = policy or MemoryRecoveryPolicy()
        self._excluded: list[int] = []  # kept by reset: a failed card does not come back with new cost models
        self.reset(None)

    def reset(self, base_caps: Sequence[int | None] | None) -> None:
        """Starts over from the calibrated caps (None entries or None: uncapped); forgets every lowered cap."""
        R = self._num_replicas
        self._base: list[int | None] = [None] * R if base_caps is None else list(base_caps)
        self._lowered: list[int | None] = [None] * R
        self._recent = [collections.deque(maxlen=self.policy.recent_steps) for _ in range(R)]
        self._since_change = [0] * R
        self._grow_after = [self.policy.grow_after_steps] * R
        self._grown = [False] * R  # the cap in force was reached by growing (an OOM there was a failed probe)
        self.history: collections.deque[CapChange] = collections.deque(maxlen=HISTORY_LENGTH)

    @property
    def caps(self) -> list[int | None]:
        """The caps in force, in examples, shape [R] (None: uncapped)."""
        return [self._cap(i) for i in range(self._num_replicas)]

    def known_to_fit(self) -> list[int]:
        """Per replica, the most examples known to fit its memory, shape [R]: a calibrated cap (measured) or a lowered
        cap that a step then held, else the largest slice it completed recently (0 when none). A cap lowered by
        halving after an out-of-memory step is only an upper bound until a step fits it; an uncapped replica counts
        its largest recent slice."""
        # (a lowered cap that no step held yet is above every slice done: those say what fits)
        return [cap if cap is not None and (lowered is None or done >= cap) else done
                for cap, lowered, done in zip(self.caps, self._lowered, (max(r, default=0) for r in self._recent))]

    @property
    def lowered(self) -> bool:
        """True while some replica's cap is below its calibrated cap."""
        return any(c is not None for c in self._lowered)

    @property
    def excluded(self) -> tuple[int, ...]:
        """The replicas set aside for good because their device failed, in the order they were (cap 0)."""
        return tuple(self._excluded)

    def exclude(self, replica_id: int, batch_size: int = 0) -> CapChange:
        """Sets ``replica_id`` aside for good: its cap becomes 0 and never grows back (its device failed).

        Args:
            replica_id: In [0, R).
            batch_size: Its slice in the step that failed, in examples (for the record).

        Raises:
            ConfigError: If ``replica_id`` is out of range.
        """
        old = self._cap(self._checked_replica(replica_id))
        if replica_id not in self._excluded:
            self._excluded.append(replica_id)
        return self._noted(CapChange(replica_id, old, 0, "excluded", int(batch_size)))

    def _checked_replica(self, replica_id: int) -> int:
        if isinstance(replica_id, bool) or not isinstance(replica_id, int) or not 0 <= replica_id < self._num_replicas:
            raise ConfigError(f"replica_id={replica_id!r} must be an int in [0, {self._num_replicas}).")
        return replica_id

    def _cap(self, replica_id: int) -> int | None:
        if replica_id in self._excluded:
            return 0
        return min((c for c in (self._base[replica_id], self._lowered[replica_id]) if c is not None), default=None)

    def record_out_of_memory(self, replica_id: int, batch_size: int) -> CapChange:
        """Lowers ``replica_id``'s cap after its step ran out of memory with a slice of ``batch_size`` examples.

        Returns:
            The change (new_cap < batch_size; 0 when even one example did not fit).

        Raises:
            ConfigError: If ``replica_id`` is out of range or ``batch_size`` is not an int >= 1.
        """
        self._checked_replica(replica_id)
        check_range("batch_size", batch_size, 1, integer=True,
                    hint="the slice that ran out of memory; an empty slice cannot")
        old = self._cap(replica_id)
        smaller = [b for b in self._recent[replica_id] if b < batch_size]
        # Slices as large as the one that failed no longer fit (memory shrank): forgotten.
        self._recent[replica_id] = collections.deque(smaller, maxlen=self.policy.recent_steps)
        new = max(smaller) if smaller else int(math.floor(batch_size * self.policy.backoff_factor))
        new = new if old is None else min(new, old)
        if self._grown[replica_id]:  # a grown cap failed: probe less often
            self._grow_after[replica_id] = min(2 * self._grow_after[replica_id], self.policy.max_grow_after_steps)
        self._grown[replica_id] = False
        self._lowered[replica_id] = new
        self._since_change[replica_id] = 0
        return self._noted(CapChange(replica_id, old, new, "out_of_memory", batch_size))

    def record_success(self, per_replica_batch_sizes: Sequence[int],
                       global_batch_size: int | None = None) -> list[CapChange]:
        """Notes one successful step; returns the caps that grew (usually none).

        Args:
            per_replica_batch_sizes: The slices of the step, shape [R].
            global_batch_size: The reference global batch B, if known: a lowered cap that grows to B or more (it
                can no longer bind) is lifted.
        """
        changes = []
        for i, b in enumerate(per_replica_batch_sizes):
            if b > 0:
                self._recent[i].append(int(b))
            if self._lowered[i] is None or i in self._excluded:
                continue
            self._since_change[i] += 1
            if self._since_change[i] < self._grow_after[i]:
                continue
            old = self._cap(i)
            grown = max(old + 1, int(math.ceil(old * self.policy.growth_factor)))
            limit = self._base[i] if self._base[i] is not None else global_batch_size
            back_to_base = limit is not None and grown >= limit  # (the global batch, without a calibrated cap)
            self._lowered[i], self._grown[i] = (None, False) if back_to_base else (grown, True)
            self._since_change[i] = 0
            changes.append(self._noted(CapChange(i, old, self._cap(i), "grow", max(self._recent[i], default=0))))
        return changes

    def _noted(self, change: CapChange) -> CapChange:
        """``change``, added to :attr:`history`."""
        self.history.append(change)
        return change
