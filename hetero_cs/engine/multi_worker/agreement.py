"""How every worker of :class:`~hetero_cs.HeteroMultiWorkerMirroredStrategy` cuts each global batch alike.

With a fixed ``batch_split`` or an even split, the plan of a batch depends on its size alone, so every
worker computes the same one. With ``auto_balance`` the chief (global replica 0) decides. Before the replicas of a
step start, each worker asks its schedule whether this step agrees; if so, every replica contributes one small
vector to a single SUM all-reduce (``Strategy.reduce``, i.e. TensorFlow's collective ops over gRPC, no transport of
our own): the chief writes the split of this batch and how many following steps hold it, every replica writes the
step time it measured in its last step. So every worker adopts the chief's plan in the same step, and the chief's
:class:`~hetero_cs.planning.balancer.Balancer` (via :class:`~hetero_cs.engine.multi_worker.cluster_planner.ClusterPlanner`)
sees every replica's times. While calibrating and while the Balancer decides (a guard trial, a filling monitor
window) every step agrees; in steady state one step in N, with N chosen so the agreement costs at most 1 % of the
step (:data:`hetero_cs.planning.sampling.AGREEMENT_COST_S`); a batch of another size within a hold (a last partial
batch) is split in proportion to the held split. The split is a tensor value, never a traced constant, and the
choice to agree follows from agreed values alone: a plan change or a hold cannot retrace one worker and not
another, or run a collective on one worker only (either would mismatch the collectives and hang).
"""

import collections
import functools

import numpy as np
import tensorflow as tf

from hetero_cs.engine import _compat
from hetero_cs.engine.step.step_errors import raised_by_input_pipeline
from hetero_cs.errors import HeteroCSError, InputError
from hetero_cs.planning.plan import split_by_shares

_AGREEMENT_FIELDS = 3  # per replica in the agreement vector: the chief's split, step times, slice sizes
_MAX_REPORTED_STEPS = 100_000


def _keeping_errors(method):
    """A plan function of a step (run by ``tf.numpy_function``, whose errors TensorFlow reports as
    ``InvalidArgumentError``) that keeps the library's error it raises, so that ``fit`` raises it as itself."""
    @functools.wraps(method)
    def keeping(self, *args):
        try:
            return method(self, *args)
        except HeteroCSError as exc:
            with self._lock:
                self._plan_error = exc
            raise

    return keeping


class PlanAgreement:
    """Mixin of HeteroMultiWorkerMirroredStrategy (before MultiWorkerMirroredStrategy in its bases): the split of
    each step, the same on every worker.

    Reads the strategy's ``_agreed``, ``_first_replica``, ``_input_host``, ``_planner``, ``_balancer``,
    ``_micro_slices``, ``_lock`` and ``_ensure_time_scale``.
    """

    def _start_agreement(self) -> None:
        self._last_step: dict[int, tuple[int, float]] = {}  # this worker's replicas: (b_i, step time) of the last step
        self._served_index = -1  # the chief's index of the step being agreed (pairs reports with what was served)
        self._hold: tuple[np.ndarray, int] | None = None  # the agreed split and the steps left that keep it
        self._steps = [0, 0]  # [steps that agreed, steps that kept a held split] on this worker
        self._last_split: tuple[int, ...] | None = None
        # The chief's, per timed step: [R] seconds (bounded: evaluate and predict report too, and nobody may read).
        self._reported_step_times: collections.deque = collections.deque(maxlen=_MAX_REPORTED_STEPS)
        self._plan_error: Exception | None = None  # the library's error a step's plan function raised (fit re-raises)

    @property
    def agreement_counts(self) -> tuple[int, int]:
        """(steps that ran the plan agreement, steps that kept the split agreed before) on this worker, since the
        strategy was built; the same on every worker. (0, 0) without auto_balance."""
        with self._lock:
            return tuple(self._steps)

    def _step_sizes(self, global_batch_size):
        """The split of this global batch (int32 [R]), the same on every worker (cross-replica context).

        A fixed or even split follows from ``B`` alone, on the worker's host. With auto_balance each worker asks
        its schedule first: within a hold the chief announced at the last agreement (steps left,
        whatever their batch size), every worker keeps that split and runs no collective; otherwise every local
        replica adds its part of the agreement vector to one SUM all-reduce (``Strategy.reduce``, TensorFlow's own
        collectives) and the worker adopts the chief's split and hold. The schedule follows from agreed values
        alone, so every worker takes the same branch of the ``tf.cond`` in the same step, and both branches are
        traced everywhere (no worker retraces alone)."""
        R = self.num_replicas_in_sync
        if not self._agreed:
            with tf.device(self._input_host):
                sizes = tf.numpy_function(self._local_sizes, [global_batch_size], tf.int64, name="hetero_cs_plan")
                sizes.set_shape([R])
                return tf.cast(sizes, tf.int32)
        with self.scope():
            agree, held = tf.numpy_function(
                self._schedule, [global_batch_size], [tf.bool, tf.int64], name="hetero_cs_plan_schedule")
            agree.set_shape([])
            held.set_shape([R])

            def agreement():
                vectors = []
                for k, device in enumerate(self.extended.worker_devices):
                    with tf.device(device):
                        vector = tf.numpy_function(
                            functools.partial(self._proposal, self._first_replica + k), [global_batch_size],
                            tf.float64, name="hetero_cs_plan_proposal")
                        vector.set_shape([_AGREEMENT_FIELDS * R + 1])
                        vectors.append(vector)
                agreed = self.reduce(tf.distribute.ReduceOp.SUM, _compat.per_replica(vectors), axis=None)
                return tf.numpy_function(
                    self._adopt, [agreed, global_batch_size], tf.int64, name="hetero_cs_plan_adopt")

            sizes = tf.cond(agree, agreement, lambda: tf.identity(held))
        sizes.set_shape([R])
        return tf.cast(sizes, tf.int32)

    def _kept_plan_error(self, exc) -> Exception | None:
        """The library's error a plan function of a step raised (:func:`_keeping_errors`), if TensorFlow's ``exc``
        carries it, else None; the kept error is dropped either way (``exc=None``: only dropped)."""
        with self._lock:
            error, self._plan_error = self._plan_error, None
        return error if error is not None and exc is not None and raised_by_input_pipeline(exc, error) else None

    @_keeping_errors
    def _local_sizes(self, global_batch_size) -> np.ndarray:
        B = int(global_batch_size)
        self._micro_slices.check_batch(B)
        self._ensure_time_scale(B)
        sizes = self._balancer.plan_for(B).per_replica_batch_sizes
        self._last_split = tuple(sizes)
        return np.asarray(sizes, dtype=np.int64)

    @_keeping_errors
    def _schedule(self, global_batch_size):
        """(agree in this step?, the split of this step if held [R]).

        A hold announced by the chief covers the next steps whatever their batch size: the choice depends on agreed
        values only, so every worker makes it alike even when one reads other data than the rest (a choice made
        from the batch size would send that worker alone into the agreement's collective, and the cluster would
        hang; the agreement step after the hold catches the mismatch). A batch of another size than the held split's
        (a last partial batch) is split in proportion to it."""
        B = int(global_batch_size)
        if B < 1:
            raise InputError(
                f"An empty global batch reached HeteroMultiWorkerMirroredStrategy (global_batch_size={B}): a step "
                f"needs at least one example. Drop empty batches from the dataset (e.g. Dataset.filter on the batch "
                f"size).")
        self._micro_slices.check_batch(B)  # every worker alike, before any collective of the step
        with self._lock:
            hold = self._hold
            if hold is not None and hold[1] > 0:
                sizes = hold[0] if int(hold[0].sum()) == B else np.asarray(split_by_shares(B, hold[0]), np.int64)
                self._hold = (hold[0], hold[1] - 1)
                self._steps[1] += 1
                self._last_split = tuple(int(b) for b in sizes)
                return np.bool_(False), sizes
            self._hold = None
            self._steps[0] += 1
        return np.bool_(True), np.zeros(self.num_replicas_in_sync, dtype=np.int64)

    @_keeping_errors
    def _proposal(self, replica_id: int, global_batch_size) -> np.ndarray:
        """One replica's part of the agreement vector: [chief's split (R), step times (R), slice sizes (R), hold].

        Every replica writes the time and slice size of the last step it ran (a held step or the previous
        agreement's: the same split either way); the chief (replica 0) also writes the split and how many of the
        following steps hold it."""
        R = self.num_replicas_in_sync
        B = int(global_batch_size)
        self._ensure_time_scale(B)
        vector = np.zeros(_AGREEMENT_FIELDS * R + 1, dtype=np.float64)
        if replica_id == 0:
            vector[:R], self._served_index = self._planner.sizes(B)  # the split, and the step it is served for
            vector[-1] = self._planner.hold_steps()
        last = self._last_step.pop(replica_id, None)  # one dict operation, as in _record_step_time: atomic
        if last is not None:
            vector[2 * R + replica_id], vector[R + replica_id] = last
        return vector

    @_keeping_errors
    def _adopt(self, agreed, global_batch_size) -> np.ndarray:
        """The worker adopts the chief's split and hold; the chief's planner gets every replica's last step."""
        R = self.num_replicas_in_sync
        sizes = np.rint(agreed[:R]).astype(np.int64)
        if int(sizes.sum()) != int(global_batch_size):
            raise InputError(
                f"The workers do not read the same data: this worker's global batch has {int(global_batch_size)} "
                f"examples but the chief split {int(sizes.sum())} ({sizes.tolist()}). Every worker must iterate the "
                f"same dataset of global batches in the same order (no sharding, the same shuffle seed).")
        with self._lock:
            self._hold = (sizes, int(round(float(agreed[-1]))))
            self._last_split = tuple(int(b) for b in sizes)
        if self.is_chief and self._served_index > 0:
            # The times are those of the last step, cut by the last agreement's split (the planner's step index
            # counts agreements) unless it was a held batch of another size: the planner pairs them by slice size.
            times = [float(t) for t in agreed[R:2 * R]]
            self._planner.report(self._served_index - 1, times, slice_sizes=np.rint(agreed[2 * R:3 * R]).tolist())
            if min(times) > 0.0:
                with self._lock:
                    self._reported_step_times.append(times)
        return sizes

    def pop_reported_step_times(self) -> list[list[float]]:
        """The chief's view: every replica's step time (seconds) of each timed step since the last call, as
        reported through the agreement (empty on other workers and without auto_balance). For the epoch logs."""
        with self._lock:
            times = list(self._reported_step_times)
            self._reported_step_times.clear()
        return times

    def _record_step_time(self, replica_id: int, batch_size: int, step_time_s: float) -> None:
        self._last_step[int(replica_id)] = (int(batch_size), float(step_time_s))
