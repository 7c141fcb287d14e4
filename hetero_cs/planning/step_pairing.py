"""Pairing per-replica step reports into steps, also across a step that failed part-way (pure).

Every replica reports each training step once: its slice size and its step time. :class:`StepPairing` groups
those reports into steps for :class:`hetero_cs.planning.monitor.StepTimeMonitor` (which holds its lock around
every call). Two ways to tell which step a report belongs to:

* **by step key** (``step_key`` given): every replica of one step reports the same key, any hashable value the
  step's replicas share and no other step has. The central-storage engine passes the step's clock start, one
  stamp taken once per step and read by every replica. A step that failed in some replica leaves a partial
  step behind; it is dropped as soon as a replica that has not reported it reports a later step (a replica
  reports its steps in order, so it will never report that one), and a late report of a dropped or completed
  step is ignored. Nothing the failure left behind is paired with another step's reports.
* **by order** (no key): the k-th report of replica i belongs to step k, replicas in any order. Exact as long as
  every replica reports every step; a step that failed after some replicas reported it shifts the pairing by
  one step until :meth:`StepPairing.abandon_open_steps` (or a step reported with a key) lines the replicas up.

Both kinds share one step index space, increasing in the order steps begin: a step reported with a key gets the
next index after every step begun so far, and completing it lines the by-order counters up behind it. A complete
step becomes a :class:`StepSample` (its times, its straggler statistics and, once the engine reports the step's end,
its host tail).

This module is pure: it imports neither TensorFlow nor pynvml.
"""

import collections
import dataclasses
import logging
import math
from collections.abc import Hashable, Sequence

# The monitor's logger: users filter one name for every message about step times.
logger = logging.getLogger("hetero_cs.planning.monitor")


class PendingStep:
    """One step being reported: what its replicas sent so far (each list has shape [R]).

    Attributes:
        index: The step's index (see the module docstring), >= 0.
        batch_sizes: b_i, examples in each replica's slice (0 where not yet reported).
        step_times_s: t_i in seconds (0.0 where not yet reported; may hold an invalid time, see ``valid``).
        reported: Whether each replica has reported.
        valid: False once any report of the step carried an invalid time (NaN, infinite or negative).
    """

    __slots__ = ("index", "batch_sizes", "step_times_s", "reported", "valid")

    def __init__(self, index: int, num_replicas: int):
        self.index = index
        self.batch_sizes = [0] * num_replicas
        self.step_times_s = [0.0] * num_replicas
        self.reported = [False] * num_replicas
        self.valid = True

    def add(self, replica_id: int, batch_size: int, step_time_s: float, valid: bool) -> bool:
        """Adds one replica's report; returns whether the step is now complete."""
        self.batch_sizes[replica_id] = batch_size
        self.step_times_s[replica_id] = step_time_s
        self.reported[replica_id] = True
        self.valid = self.valid and valid
        return all(self.reported)


class StepPairing:
    """Groups per-replica reports into steps (not thread-safe: the caller holds a lock around every call).

    Args:
        num_replicas: R >= 1 (validated by the caller).
        max_pending: Incomplete steps of each kind kept before the oldest is dropped (a replica that never
            reports), >= 1.
    """

    def __init__(self, num_replicas: int, *, max_pending: int):
        self._num_replicas = num_replicas
        self._max_pending = max_pending
        self._warned_dropped = False  # logged once per pairing, also across reset()
        self._warned_duplicate = False
        self.reset()

    def reset(self) -> None:
        """Forgets every report and pending step; indices restart at 0."""
        self._next_step = [0] * self._num_replicas  # by order: per replica, the step its next report belongs to
        self._pending: dict[int, PendingStep] = {}  # by order: step index -> step, in index order
        self._first_open_step = 0  # by order: reports for earlier (dropped) steps are discarded
        self._keyed: dict[Hashable, PendingStep] = {}  # by key: key -> step, in the order the steps began
        # Keys of steps completed or dropped lately: a late report of one is ignored, not taken as a new step.
        self._closed_keys: collections.deque = collections.deque(maxlen=2 * self._max_pending)
        self._next_keyed_index = 0

    def add(self, replica_id: int, batch_size: int, step_time_s: float, valid: bool,
            step_key: Hashable | None = None) -> PendingStep | None:
        """Adds one report (arguments validated by the caller); returns the step it completed, if any."""
        if step_key is not None:
            return self._add_by_key(replica_id, batch_size, step_time_s, valid, step_key)
        step = self._next_step[replica_id]
        self._next_step[replica_id] = step + 1
        if step < self._first_open_step:
            return None  # its step was dropped as incomplete
        entry = self._pending.get(step)
        if entry is None:
            entry = self._pending[step] = PendingStep(step, self._num_replicas)
            while len(self._pending) > self._max_pending:
                self._first_open_step = self._drop_oldest(self._pending) + 1
        return self._pending.pop(step) if entry.add(replica_id, batch_size, step_time_s, valid) else None

    def abandon_open_steps(self) -> None:
        """Drops every incomplete step and lines the by-order counters up (complete steps are not affected)."""
        self._line_up(max(max(self._next_step), self._next_keyed_index))
        self._closed_keys.extend(self._keyed)
        self._keyed.clear()

    # ------------------------------------------------------------------------------------------------------------
    def _add_by_key(self, replica_id: int, batch_size: int, step_time_s: float, valid: bool,
                    key: Hashable) -> PendingStep | None:
        if key in self._closed_keys:
            return None  # a late report of a step already completed or dropped
        # Earlier steps this replica has not reported failed in it (it reports its steps in order): drop them.
        for older_key in list(self._keyed):
            if older_key == key:
                break
            if not self._keyed[older_key].reported[replica_id]:
                self._closed_keys.append(older_key)
                logger.debug("Dropping step %d: replica %d reported a later step without it (a failed step).",
                             self._keyed.pop(older_key).index, replica_id)
        entry = self._keyed.get(key)
        if entry is None:
            index = max(max(self._next_step), self._next_keyed_index)
            self._next_keyed_index = index + 1
            entry = self._keyed[key] = PendingStep(index, self._num_replicas)
            while len(self._keyed) > self._max_pending:
                self._closed_keys.append(self._drop_oldest(self._keyed))
        elif entry.reported[replica_id]:
            if not self._warned_duplicate:
                self._warned_duplicate = True
                logger.warning("Ignoring a second report of replica %d for one step (step_key=%r): a step key must be "
                               "shared by the replicas of one step and by no other step.", replica_id, key)
            return None
        if not entry.add(replica_id, batch_size, step_time_s, valid):
            return None
        del self._keyed[key]
        self._closed_keys.append(key)
        # Every replica has reported this step: reports without a key continue behind it, lined up.
        self._line_up(max(max(self._next_step), entry.index + 1))
        return entry

    def _line_up(self, step: int) -> None:
        """Every replica's next report without a key belongs to ``step``; incomplete steps before it are dropped."""
        self._next_step = [step] * self._num_replicas
        self._pending = {k: v for k, v in self._pending.items() if k >= step}
        self._first_open_step = max(self._first_open_step, step)

    def _drop_oldest(self, pending: dict) -> Hashable:
        """Drops the oldest step of ``pending`` (by order or by key: a replica never reported it); returns its key."""
        key = next(iter(pending))
        step = pending.pop(key)
        if not self._warned_dropped:
            self._warned_dropped = True
            logger.warning("Dropping incomplete step %d: replicas %s have not reported it while others are %d steps "
                           "ahead. Every replica must call record() once per step, also with a 0-example slice.",
                           step.index, [i for i, done in enumerate(step.reported) if not done], self._max_pending)
        return key


@dataclasses.dataclass(frozen=True)
class StepSample:
    """One complete training step as the replicas reported it.

    Attributes:
        step: 0-based index of the step, increasing in the order steps began (the k-th report of every replica
            belongs to step k when reports carry no step key; see :mod:`hetero_cs.planning.step_pairing`).
        per_replica_batch_sizes: b_i, examples in each replica's slice, shape [R].
        per_replica_step_times_s: t_i, each replica's step time in seconds, shape [R], finite and >= 0.
        makespan_s: The step's time: ``replica_makespan_s`` (max_i t_i, set by the slowest replica) plus
            ``host_tail_s``, what the guard judges and the fit logs show (``makespan_ms``).
        straggler_replica: argmax_i t_i (the lowest replica id on ties).
        straggler_wait_s: mean over the working replicas of (makespan_s - t_i): how long the average replica sat
            waiting for the straggler (the straggler itself counts with 0). 0 for a perfectly balanced step. A
            replica left idle by the plan (b_i = 0 and t_i = 0: it ran nothing) is not a working replica.
        total_idle_s: sum over the working replicas of (makespan_s - t_i), device-seconds wasted waiting.
        balance_efficiency: mean_i t_i / max_i t_i over the working replicas, in (0, 1]; 1 means every replica
            finished together. 1.0 when every time is 0.
        host_tail_s: Seconds from the last replica's gradients reaching the parameter device to the end of the
            host's work on the step (the gradient sum and the optimizer update), >= 0; 0.0 until the engine
            reports the step's end (:meth:`StepTimeMonitor.record_step_end`), and for steps it cannot pair.
        per_replica_micro_batches: k_i, how many micro-batches replica i ran its b_i examples in, one after
            another (t_i is their total), shape [R]; None when every replica ran one step (the usual case).

    Example: times [0.10, 0.20, 0.30] s give makespan 0.30 s, straggler 2, waits [0.20, 0.10, 0] s,
    straggler_wait_s 0.10 s, total_idle_s 0.30 s, balance_efficiency 0.2 / 0.3 = 0.667.
    """

    step: int
    per_replica_batch_sizes: tuple[int, ...]
    per_replica_step_times_s: tuple[float, ...]
    makespan_s: float
    straggler_replica: int
    straggler_wait_s: float
    total_idle_s: float
    balance_efficiency: float
    host_tail_s: float = 0.0
    per_replica_micro_batches: tuple[int, ...] | None = None

    @property
    def replica_makespan_s(self) -> float:
        """max_i t_i: when the slowest replica's gradients reached the parameter device, from the step's start."""
        return max(self.per_replica_step_times_s)

    def with_step_end(self, step_time_s: float) -> "StepSample":
        """This sample with the host tail of a whole step of ``step_time_s`` seconds (start to the update's end)."""
        tail_s = max(0.0, float(step_time_s) - self.replica_makespan_s)
        return dataclasses.replace(self, host_tail_s=tail_s, makespan_s=self.replica_makespan_s + tail_s)

    @classmethod
    def from_times(cls, step: int, batch_sizes: Sequence[int], step_times_s: Sequence[float],
                   micro_batches: Sequence[int] | None = None) -> "StepSample":
        """Builds a sample, computing the straggler statistics from the per-replica times (shape [R]).

        Plain Python over R values: it runs in a step's host callback, beside the replicas' compute, where numpy's
        calls on a few values cost several times as much (about 160 us a step, measured on a 2-core host)."""
        times = tuple(float(t) for t in step_times_s)
        sizes = tuple(int(b) for b in batch_sizes)
        makespan_s = max(times)
        # An idle replica (0 examples, 0 s: it ran nothing) does not wait for the straggler; it is left out of the
        # straggler statistics. A replica that ran a 0-example slice took time, and counts.
        working = [t for b, t in zip(sizes, times) if b > 0 or t > 0] or list(times)  # (none worked: all count)
        waits_s = [makespan_s - t for t in working]
        return cls(step=int(step), per_replica_batch_sizes=sizes, per_replica_step_times_s=times,
                   makespan_s=makespan_s, straggler_replica=times.index(makespan_s),
                   straggler_wait_s=math.fsum(waits_s) / len(waits_s), total_idle_s=math.fsum(waits_s),
                   balance_efficiency=math.fsum(working) / len(working) / makespan_s if makespan_s > 0 else 1.0,
                   per_replica_micro_batches=None if micro_batches is None else tuple(int(k) for k in micro_batches))
