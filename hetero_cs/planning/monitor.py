"""Per-replica step timing: straggler statistics and robust per-replica speed estimates (pure).

The strategy reports, for every training step, each replica's slice size and how long that replica took
(``StepTimeMonitor.record``). The monitor pairs the reports of every replica into steps (by the step key the
engine passes, else the k-th report of every replica into step k; see :mod:`hetero_cs.planning.step_pairing`),
keeps the last ``window_steps`` complete steps, and derives from that window

* what the last step cost: its makespan, which replica was the straggler and how long the others waited
  (``last_step``);
* each replica's throughput (``per_replica_throughput_examples_per_s``);
* each replica's updated cost model (``updated_cost_models``), the input of the re-balance policy, and how
  precisely the window pins each model's level (``relative_standard_errors``), its noise margin.

Every estimate is a median over the window, so a few outlying steps (a garbage collection, a co-tenant burst)
move it little and multiplicative noise averages out; memory stays bounded by the window.

This module is pure: it imports neither TensorFlow nor pynvml.
"""

import collections
import logging
import math
import threading
from collections.abc import Hashable, Sequence

import numpy as np

from hetero_cs._copying import DeepcopiedWithNewLocks
from hetero_cs.planning.cost_model import CostModel, ScaledCostModel
from hetero_cs.planning.plan import _is_int, check_range
from hetero_cs.planning.robust_stats import _fit_linear_model, _median, _shift_start, median_and_error
from hetero_cs.planning.step_pairing import StepPairing, StepSample  # noqa: F401 - StepSample re-exported
from hetero_cs.errors import CalibrationError, ConfigError

logger = logging.getLogger(__name__)

# Incomplete steps kept beyond the window before the oldest is dropped (a replica that never reports).
_EXTRA_PENDING_STEPS = 64


class StepTimeMonitor(DeepcopiedWithNewLocks):
    """Collects per-replica step times and turns them into robust per-replica estimates.

    Thread-safe: ``record`` may be called concurrently from TF executor threads, one call per replica per training
    step, replicas in any order. A report with a ``step_key`` belongs to the step of that key; a report without one
    belongs to step k when it is replica i's k-th. A step is complete when every replica has recorded it. Every
    replica must record every step, also one whose slice is 0 examples (report its time, or 0.0) - otherwise no
    step completes. With keys, a step that failed part-way (some replicas reported it, others never will) is
    dropped once a replica that has not reported it reports a later step; without keys, call
    :meth:`abandon_open_steps` after such a step, or later steps pair reports of different steps.

    A report whose time is NaN, infinite or negative is ignored with one logged warning per monitor: it still
    counts for step pairing and completes its step, but that step enters neither the window nor ``last_step``.

    Plan changes do not need ``reset``: every estimate is per replica and scale-free (a ratio to the base cost
    model, or a fit over slice sizes), so samples taken at the old slice sizes stay valid as long as the devices
    did not change, and keeping them means the next decision does not wait for a fresh window. Call ``reset``
    when the old samples no longer describe the devices (another model, new calibration).

    Args:
        num_replicas: R >= 1, the number of replicas reporting.
        window_steps: >= 1, how many of the most recent complete steps the estimates use. A step change in a
            device's speed moves the estimate after SHIFT_STEPS (4) steps once the shift is clear (see
            ``robust_stats.SHIFT_THRESHOLD``), else after window_steps // 2 + 1 steps (the median).

    Raises:
        ConfigError: If num_replicas or window_steps is not a positive integer.

    Examples:
        >>> monitor = StepTimeMonitor(2, window_steps=8)
        >>> monitor.record(1, 16, 0.75)
        >>> monitor.record(0, 16, 0.25)
        >>> monitor.last_step().straggler_wait_s   # ((0.75 - 0.25) + (0.75 - 0.75)) / 2
        0.25
    """

    def __init__(self, num_replicas: int, *, window_steps: int = 16):
        for name, value in (("num_replicas", num_replicas), ("window_steps", window_steps)):
            if not _is_int(value) or value < 1:
                raise ConfigError(f"{name} must be a positive integer. Received: {name}={value!r}.")
        self._num_replicas = int(num_replicas)
        self._window_steps = int(window_steps)
        self._lock = threading.Lock()
        self._warned_invalid = False  # Each warning is logged once per monitor, also across reset().
        # Incomplete steps kept beyond the window before the oldest is dropped (a replica that never reports).
        self._pairing = StepPairing(self._num_replicas, max_pending=self._window_steps + _EXTRA_PENDING_STEPS)
        self._reset_locked()

    def _reset_locked(self) -> None:
        self._step_of_key: collections.OrderedDict = collections.OrderedDict()  # key -> step, while in the window
        self._pairing.reset()
        self._completed_steps = 0
        self._window: collections.deque[StepSample] = collections.deque(maxlen=self._window_steps)
        # Per replica, (base model, corrected model) of its last correction from samples: a replica the plan leaves
        # idle has no samples in the window, and keeps the speed last measured instead of its base model.
        self._last_correction: dict[int, tuple[CostModel, CostModel]] = {}
        self._probe_samples: dict[int, tuple[int, float]] = {}  # an idle replica's last probe: (b, seconds)

    @property
    def num_replicas(self) -> int:
        """R, the number of replicas."""
        return self._num_replicas

    @property
    def window_steps(self) -> int:
        """The window length in complete steps."""
        return self._window_steps

    @property
    def completed_steps(self) -> int:
        """Steps every replica has reported since construction or ``reset`` (with or without valid times)."""
        with self._lock:
            return self._completed_steps

    @property
    def num_samples(self) -> int:
        """Complete, valid steps in the window now, in [0, window_steps]; compare with a policy's min_samples."""
        with self._lock:
            return len(self._window)

    def record(self, replica_id: int, batch_size: int, step_time_s: float, *, step_key: Hashable | None = None,
               idle_replicas: Sequence[int] = ()) -> None:
        """Records one replica's step (and, in the same call, the step of each replica it left idle).

        Args:
            replica_id: In [0, R).
            batch_size: b_i >= 0, examples in this replica's slice for this step.
            step_time_s: Seconds this replica took for its step; NaN, infinite or negative values are ignored
                (one warning per monitor) but still pair into their step.
            step_key: None to pair by order (the k-th report of each replica is step k), or a hashable value
                that every replica of this step reports and no other step has (the engine passes the step's
                clock start, in seconds); keyed steps stay paired across a step that failed part-way.
            idle_replicas: Replicas of this step with no examples: each reports 0 examples in 0 s here, as its own
                call would (one call, not one per replica, from the step's host callback).

        Raises:
            ConfigError: If a replica id is out of range, batch_size is negative or not an integer, or step_key is
                not hashable.
        """
        for idle in idle_replicas:
            check_range("idle_replicas", idle, 0, self._num_replicas, integer=True)
        check_range("replica_id", replica_id, 0, self._num_replicas, integer=True)
        if not _is_int(batch_size) or batch_size < 0:
            raise ConfigError(f"batch_size must be a non-negative integer (examples in the replica's slice). "
                              f"Received: batch_size={batch_size!r} for replica_id={replica_id}.")
        try:
            hash(step_key)
        except TypeError:
            raise ConfigError(f"step_key must be hashable (a value every replica of the step shares). Received: "
                              f"step_key={step_key!r} of type {type(step_key).__name__}.") from None
        step_time_s = _seconds(step_time_s)
        valid = math.isfinite(step_time_s) and step_time_s >= 0.0
        with self._lock:
            if not valid and not self._warned_invalid:
                self._warned_invalid = True
                logger.warning("Ignoring an invalid step time (step_time_s=%r, replica_id=%d); a step time must be "
                               "finite and >= 0. Steps with invalid times are left out of the statistics; further ones "
                               "are not reported.", step_time_s, replica_id)
            for idle in idle_replicas:
                self._add_locked(int(idle), 0, 0.0, True, step_key)
            self._add_locked(int(replica_id), int(batch_size), step_time_s, valid, step_key)

    def _add_locked(self, replica_id: int, batch_size: int, step_time_s: float, valid: bool, step_key) -> None:
        """One replica's report into its step's pairing; a step complete with it goes into the window."""
        if (done := self._pairing.add(replica_id, batch_size, step_time_s, valid, step_key)) is None:
            return
        self._completed_steps += 1
        if done.valid:
            self._window.append(StepSample.from_times(done.index, done.batch_sizes, done.step_times_s))
            if step_key is not None:
                self._step_of_key[step_key] = done.index
                while len(self._step_of_key) > self._window_steps:
                    self._step_of_key.popitem(last=False)

    def record_probe(self, replica_id: int, batch_size: int, step_time_s: float) -> None:
        """Records a probe of a replica the plan leaves idle, timed off the step's path (it pairs with no step).

        Until the replica has steps in the window again, :meth:`updated_cost_models` takes its model as its base
        model at the probe's level, ``step_time_s / base.predict_step_time_s(batch_size)``.

        Args:
            replica_id: In [0, R).
            batch_size: b >= 1, the probe's examples.
            step_time_s: Seconds the probe took; a time that is not finite and positive is ignored.

        Raises:
            ConfigError: If replica_id is out of range or batch_size is not an integer >= 1.
        """
        check_range("replica_id", replica_id, 0, self._num_replicas, integer=True)
        check_range("batch_size", batch_size, 1, integer=True)
        if math.isfinite(step_time_s := _seconds(step_time_s)) and step_time_s > 0:
            with self._lock:
                self._probe_samples[int(replica_id)] = (int(batch_size), step_time_s)

    def record_micro_batched_step(self, batch_sizes: Sequence[int], step_times_s: Sequence[float],
                                  micro_batches: Sequence[int]) -> None:
        """Records a whole micro-batched step at once: replica i ran ``b_i`` examples as ``k_i`` micro-batches, one
        after another, in ``t_i`` seconds in all.

        The step's figures (makespan, straggler wait) are those of the whole step; its speed estimates use each
        replica's mean micro-batch, ``b_i / k_i`` examples in ``t_i / k_i`` seconds, one step of the replica's cost
        model (a micro-batch pays the per-step fixed cost again).

        Args:
            batch_sizes: b_i >= 0 per replica, shape [R].
            step_times_s: t_i >= 0 per replica, seconds, shape [R] (0 for a replica with no micro-batch).
            micro_batches: k_i >= 1 for b_i > 0 (0 or 1 where b_i = 0), shape [R].

        Raises:
            ConfigError: If a sequence's length is not R, or a value is out of range.
        """
        R = self._num_replicas
        try:
            sizes, times, counts = (list(batch_sizes), [float(t) for t in step_times_s], list(micro_batches))
        except (TypeError, ValueError):
            sizes = times = counts = None
        if (sizes is None or not len(sizes) == len(times) == len(counts) == R
                or any(not _is_int(v) or v < 0 for v in sizes + counts)
                or any(b > 0 and k < 1 for b, k in zip(sizes, counts)) or not all(0 <= t < math.inf for t in times)):
            raise ConfigError(
                f"A micro-batched step needs, per replica (R={R}), its examples b_i >= 0, its time t_i >= 0 in "
                f"seconds and its micro-batch count k_i >= 1 where b_i > 0. Received: batch_sizes={batch_sizes!r}, "
                f"step_times_s={step_times_s!r}, micro_batches={micro_batches!r}.")
        key = object()  # this step's own key: its reports pair with nothing else
        with self._lock:
            done = None
            for i in range(R):  # under this step's own key, the last of its replicas' reports completes it
                done = self._pairing.add(i, int(sizes[i]), times[i], True, key) or done
            self._completed_steps += 1
            self._window.append(StepSample.from_times(
                done.index, done.batch_sizes, done.step_times_s, micro_batches=[max(1, int(k)) for k in counts]))

    def record_step_end(self, step_key: Hashable, step_time_s: float) -> None:
        """Records when the host's work on a step ended: its gradient sum and optimizer update.

        The step's sample (the one whose replicas reported with this ``step_key``) then carries ``host_tail_s``
        and a ``makespan_s`` that includes it. A key of no step in the window (a step not timed, one that failed,
        one already gone from the window) or an invalid time is ignored.

        Args:
            step_key: The step's key, as its replicas reported it (:meth:`record`).
            step_time_s: Seconds from the step's start to the end of its update, on the replicas' clock.
        """
        if not (math.isfinite(step_time_s := _seconds(step_time_s)) and step_time_s >= 0.0):
            return
        with self._lock:
            try:
                index = self._step_of_key.pop(step_key)
            except (KeyError, TypeError):
                return
            # The newest sample of that step (there is at most one).
            position = next((p for p in range(len(self._window) - 1, -1, -1) if self._window[p].step == index), None)
            if position is not None:
                self._window[position] = self._window[position].with_step_end(step_time_s)

    def last_step(self) -> StepSample | None:
        """The most recent complete step with valid times, or None before there is one."""
        with self._lock:
            return self._window[-1] if self._window else None

    def window(self) -> tuple[StepSample, ...]:
        """The complete, valid steps in the window, oldest first (at most window_steps)."""
        with self._lock:
            return tuple(self._window)

    def abandon_open_steps(self) -> None:
        """Drops every incomplete step and lines the replicas up again, after a step that failed part-way.

        A replica that failed (e.g. out of memory) never reports that step while others may have: without this,
        its next report without a step key would pair with the others' reports of the failed step (reports with
        step keys need no call, see :meth:`record`). Complete steps are kept.
        """
        with self._lock:
            self._pairing.abandon_open_steps()

    def reset(self) -> None:
        """Forgets every report, pending step and the window; step pairing restarts at step 0."""
        with self._lock:
            self._reset_locked()

    def _window_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """Batch sizes and times of the window, each of shape [S, R] (S = samples in the window), per step of the
        replicas' cost models: a micro-batched step counts with each replica's mean micro-batch (b/k, t/k)."""
        samples = self.window()
        R = self._num_replicas  # (reshaped: an empty window is [0, R] too)
        sizes = np.array([s.per_replica_batch_sizes for s in samples], dtype=np.float64).reshape(-1, R)
        times_s = np.array([s.per_replica_step_times_s for s in samples], dtype=np.float64).reshape(-1, R)
        counts = np.array([s.per_replica_micro_batches or (1,) * R for s in samples], dtype=np.float64).reshape(-1, R)
        # A mean micro-batch of b/k examples is not an integer in general; the models are evaluated at its
        # rounded size (micro-batches of near-equal sizes differ by one example at most).
        return np.rint(sizes / counts), times_s / counts

    def per_replica_throughput_examples_per_s(self) -> np.ndarray:
        """Each replica's median of b_i / t_i over the window's steps where it had b_i > 0 and t_i > 0.

        Returns:
            Float array of shape [R], examples per second; NaN for a replica without such a step in the window.
        """
        sizes, times_s = self._window_arrays()
        usable = (sizes > 0) & (times_s > 0)  # (the median of none is NaN)
        return np.array([_median(sizes[usable[:, i], i] / times_s[usable[:, i], i]) for i in range(self._num_replicas)])

    def updated_cost_models(self, base_models: Sequence[CostModel] | None = None) -> list[CostModel]:
        """Per-replica cost models corrected by the window's observations.

        With base models (from calibration), replica i's model is ``ScaledCostModel(base_i, r_i)``. Its level is
        taken relative to the step it was measured in: with q_ki = t_i / base_i.predict_step_time_s(b_i) at window
        step k (steps where b_i > 0 and the base predicts a positive time) and g_k the geometric mean of step k's
        q_ki over its replicas, r_i = median_k(q_ki / g_k) * median_k(g_k). A factor that slowed a whole step (the
        host got busy) divides out of q / g, so it changes every r_i alike and never the split solved from them;
        only a change in the replicas' relative speeds does. It keeps the calibrated shape (fixed overhead vs
        per-example cost) and corrects the level, so a device that drifted 2x slower gets r_i ~ 2 (relative to the
        others). The noise margin (:meth:`relative_standard_errors`) stays on the absolute levels, so a busy host
        widens it and makes re-planning more cautious, never less.

        Without base models, replica i's model is fitted from its (b_i, t_i) pairs with b_i > 0: an affine
        ``LinearCostModel(a, c)`` by the Theil-Sen estimator (median of pairwise slopes, median intercept) when
        its slice sizes span at least a factor 2 and the fit has a >= 0 and c > 0; otherwise the proportional
        model ``LinearCostModel(0, median(t_i / b_i))``.

        A replica with no step with b_i > 0 in the window (one the plan left idle) takes its base model at the
        level of a probe recorded since (:meth:`record_probe`), else keeps its last correction of the same base
        model, else its base model. Without base models its speed
        is unknown; it then gets the model of the slowest known replica (the one predicting the largest time at
        the window's median positive slice), a conservative guess that gives it some work to measure.

        Args:
            base_models: None, or one cost model per replica (length R), in replica-id order.

        Returns:
            R cost models, in replica-id order.

        Raises:
            ConfigError: If base_models does not have length R.
            CalibrationError: If base_models is None and no replica has a step with b_i > 0 and t_i > 0 in the
                window (record some steps first, or pass base models).
        """
        if base_models is not None:
            self._check_one_per_replica("base_models", base_models)
            relative, common = self._relative_levels(self._levels(base_models))
            models = []
            for i, base in enumerate(base_models):
                model = self._scaled_model(base, relative[:, i], common)
                with self._lock:
                    probe = self._probe_samples.pop(i, None)  # (stale once the replica has steps again)
                if model is base and np.isnan(relative[:, i]).all() and probe is not None:
                    with np.errstate(divide="ignore", invalid="ignore"):  # (a base predicting 0 s: no level)
                        level = np.float64(probe[1]) / float(base.predict_step_time_s(probe[0]))
                    model = self._scaled_model(base, np.array([level]), np.ones(1))  # probed off the step's path
                if model is not base:
                    self._last_correction[i] = (base, model)
                elif np.isnan(relative[:, i]).all() and self._last_correction.get(i, (None,))[0] is base:
                    model = self._last_correction[i][1]  # no sample in the window (an idle replica): as last seen
                models.append(model)
            return models
        sizes, times_s = self._window_arrays()
        fitted = [_fit_linear_model(sizes[:, i], times_s[:, i]) for i in range(self._num_replicas)]
        known = [m for m in fitted if m is not None]
        if not known:
            raise CalibrationError(
                f"Cannot estimate any replica's speed: the window holds no step where a replica had a positive "
                f"slice and a positive time (num_samples={len(sizes)}). Record steps first, or pass base_models.")
        positive = sizes[sizes > 0]
        reference_batch_size = max(1, int(round(_median(positive)))) if positive.size else 1
        slowest = max(known, key=lambda m: m.predict_step_time_s(reference_batch_size))
        return [m if m is not None else slowest for m in fitted]

    def relative_standard_errors(self, cost_models: Sequence[CostModel]) -> np.ndarray:
        """How precisely the window pins each replica's speed level under the given models.

        For replica i, with q = t_i / model_i.predict_step_time_s(b_i) over the window's steps where b_i > 0 and
        the model predicts a positive time, the relative standard error of the median level is
        1.2533 * 1.4826 * MAD(q) / median(q) / sqrt(n): 1.4826 * MAD estimates the standard deviation robustly
        (consistent for normal noise), and 1.2533 / sqrt(n) is the standard error of a median of n such samples.
        Example: 10 % uniform timing noise over a 16-step window gives about 0.023.

        A replica whose speed changed inside the window (half the samples 2x slower) gets a large error until the
        window holds mostly new samples; a replica with no usable sample gets 0 (its model is taken as given).

        Args:
            cost_models: One per replica (length R), normally ``updated_cost_models(...)``.

        Returns:
            Float array of shape [R], >= 0, unitless (0.02 = 2 %).

        Raises:
            ConfigError: If cost_models does not have length R.
        """
        self._check_one_per_replica("cost_models", cost_models)
        levels = self._levels(cost_models)
        relative, _ = self._relative_levels(levels)
        result = np.zeros(self._num_replicas)
        for i in range(self._num_replicas):
            q = levels[:, i][np.isfinite(levels[:, i])]
            if not q.size:
                continue
            usable = relative[:, i][np.isfinite(relative[:, i])]
            if (recent := _shift_start(usable)) is not None and q.size == usable.size:
                q = q[recent:]  # the speed changed: only the steps since say how precisely the new level is known
            result[i] = median_and_error(q)[1]
        return result

    def _check_one_per_replica(self, name: str, models: Sequence[CostModel]) -> None:
        if len(models) != self._num_replicas:
            raise ConfigError(f"{name} must hold one cost model per replica. Received: len({name})={len(models)}, "
                              f"num_replicas={self._num_replicas}.")

    def _levels(self, cost_models: Sequence[CostModel]) -> np.ndarray:
        """q[k, i] = t_i / model_i.predict_step_time_s(b_i) at window step k, shape [S, R]; NaN where b_i = 0 or the
        model predicts no positive time (each model is evaluated once per distinct slice size)."""
        sizes, times_s = self._window_arrays()
        levels = np.full(sizes.shape, np.nan)
        with np.errstate(invalid="ignore", divide="ignore"):
            for i, model in enumerate(cost_models):
                column = sizes[:, i]
                positive = column > 0
                distinct, inverse = np.unique(column[positive], return_inverse=True)
                per_step_s = np.full(column.shape, np.nan)
                per_step_s[positive] = np.array([float(model.predict_step_time_s(int(b))) for b in distinct])[inverse]
                usable = np.isfinite(per_step_s) & (per_step_s > 0)
                levels[usable, i] = times_s[usable, i] / per_step_s[usable]
        return levels

    @staticmethod
    def _relative_levels(levels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per-step levels with the step's common mode divided out, and the common modes.

        With q = ``levels`` (:meth:`_levels`; positive levels only: a zero time says nothing about speed) and g[k]
        the geometric mean of step k's positive levels - the factor by which the whole step ran slow or fast (the
        host got busy, a garbage collection), which hits every replica alike and says nothing about their relative
        speeds - returns (q / g, g), shapes [S, R] and [S].
        """
        levels = np.where(levels > 0, levels, np.nan)
        with np.errstate(invalid="ignore", divide="ignore"):
            finite = np.isfinite(levels)
            log_levels = np.where(finite, np.log(np.where(finite, levels, 1.0)), 0.0)
            counts = finite.sum(axis=1)
            common = np.exp(np.where(counts > 0, log_levels.sum(axis=1) / np.maximum(counts, 1), 0.0))
        return levels / common[:, None], common

    @staticmethod
    def _scaled_model(base: CostModel, relative: np.ndarray, common: np.ndarray) -> CostModel:
        usable = np.isfinite(relative)
        if not usable.any():
            return base
        relative, common = relative[usable], common[usable]
        # The replica's speed changed: estimate it from the steps since.
        if (recent := _shift_start(relative)) is not None:
            relative, common = relative[recent:], common[recent:]
        factor = _median(relative) * _median(common)
        # (only zero times observed: no usable correction)
        return ScaledCostModel(base, factor) if math.isfinite(factor) and factor > 0 else base


def _seconds(value: object) -> float:
    """``value`` as a float of seconds; NaN when it is not a number (then no valid time)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan
