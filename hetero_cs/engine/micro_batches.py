"""Micro-batched training steps: a global batch larger than the cards hold trains as sub-steps, exactly.

When memory caps bind, ``model.fit`` runs each global batch of ``B`` examples as ``K`` sub-steps
(:mod:`hetero_cs.planning.micro_batches` chooses ``K`` and each sub-step's cut). Each sub-step is an ordinary step of
the traced train function on ``B_j`` examples of the batch, with two differences, read by the step from a small host
variable (``[B, accumulate]``) that this module sets before each call:

* **Weights.** Every replica's loss weighs ``b_ij / B`` of the *whole* batch, not of the sub-step: the global batch
  size a replica step sees (:func:`hetero_cs.current_global_batch_size`, Keras' loss scaling, the logged loss and
  metrics) is ``B``. Over the ``K`` sub-steps the weights sum to 1, as over the replicas of one step.
* **One update.** The host sums each sub-step's summed gradient into accumulators (one host variable per trained
  variable) and applies nothing; the last sub-step adds its own gradient and runs the optimizer's update once, on
  the sum (clipping, weight decay, loss-scale judgement and the iteration count included), then zeroes them.

So one micro-batched step equals one single-device step on the whole batch, with three exceptions, which are never
silent (:meth:`MicroBatching.run`):

* BatchNormalization in training normalises each sub-step by that sub-step's statistics, and updates its moving
  statistics once per sub-step. By default such a model is not micro-batched: where one step fits, it keeps the
  capped plan (logged once); where it cannot fit, a :class:`~hetero_cs.errors.MicroBatchError` says so.
  ``micro_batches=True`` accepts the approximation (logged once).
* A loss whose normaliser is the batch's (a masked loss, reduction ``"mean_with_sample_weight"``) would divide by
  each sub-step's count: refused the same way, even with ``micro_batches=True``.
* Randomness (Dropout) draws per sub-step; as on any split, its masks are not one device's.

What a sub-step costs: the replicas' per-step fixed cost again (parameters to the cards, gradients back), and on the
host a gradient sum into the accumulators. The calibrated cost models hold the first; the second is small beside it.
A failed sub-step applies nothing and the accumulators are zeroed, so a failed step leaves the model and optimizer
as they were. An out-of-memory sub-step is recovered by :mod:`hetero_cs.engine.oom_recovery` like any step; a
sub-step that no longer fits the lowered caps is cut into smaller sub-steps.
"""

from __future__ import annotations

import collections
import logging
import math
import statistics
import threading
import time

import tensorflow as tf

from hetero_cs._copying import DeepcopiedWithNewLocks
from hetero_cs.engine import _compat
from hetero_cs.engine.input_slicing import is_unbatched_marker
from hetero_cs.engine.model_state import restore, saved_state
from hetero_cs.errors import ConfigError, DeviceFaultError, InfeasiblePlanError, MicroBatchError, StepOOMError
from hetero_cs.planning.choice import choose_plan
from hetero_cs.planning.micro_batches import MicroBatchPlan, capacity_of, plan_micro_batches

logger = logging.getLogger("hetero_cs.engine.central_storage")

BATCH_NORM = "batch_norm"
NORMALISED_LOSS = "normalised_loss"
_WHY = {
    BATCH_NORM: "BatchNormalization in training normalises each micro-batch by its own statistics (one device "
                "normalises by the whole batch's) and updates its moving statistics once per micro-batch",
    NORMALISED_LOSS: "a loss normalised by the batch (a mask, or reduction='mean_with_sample_weight') would divide "
                     "each micro-batch by its own count",
}


def validate_setting(micro_batches) -> None:
    """Raises ConfigError unless ``micro_batches`` is None, True or False."""
    if micro_batches is not None and not isinstance(micro_batches, bool):
        raise ConfigError(
            f"micro_batches must be None (micro-batch where it is exact and helps), True (also accept "
            f"BatchNormalization's per-micro-batch statistics) or False (never). Received: "
            f"micro_batches={micro_batches!r}.")


class MicroBatching(DeepcopiedWithNewLocks):
    """A strategy's micro-batching: the plans, the host state its traced steps read, and the sub-step loop.

    Args:
        strategy: The :class:`hetero_cs.HeteroCentralStorageStrategy`.
        setting: ``micro_batches``: None, True or False (see the strategy).
    """

    def __init__(self, strategy, setting: bool | None):
        validate_setting(setting)
        self._strategy = strategy
        self.setting = setting
        self._lock = threading.Lock()
        self._state = None  # int64 [2] host variable [B, accumulate]: [0, 0] outside micro-batched steps
        self._accumulators: dict = {}  # variable ref -> host variable holding the sum of the sub-steps' gradients
        self._armed = False
        self._found: set[str] = set()  # what traces found that micro-batching cannot keep exact (BATCH_NORM, ...)
        self._checked = False  # a micro-batched step ran with the findings of its trace known
        self._plans: dict = {}
        self._in_use: dict[int, int] = {}  # global batch size -> the K its steps run with
        self._logged: set = set()
        self.last_plan: MicroBatchPlan | None = None
        self.micro_batched_steps = 0
        self.sub_steps = 0
        # Measured per sub-step: wall time minus the replicas' predicted makespan (dispatch, the plan's Python call,
        # the host's gradient sum). The planner counts it once per sub-step (plan_micro_batches).
        self._overheads: collections.deque = collections.deque(maxlen=32)

    # ------------------------------------------------------------------------------------------------------------
    # Plans
    # ------------------------------------------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        """Whether fit may micro-batch at all (``micro_batches`` is not False)."""
        return self.setting is not False

    def may_apply(self) -> bool:
        """Whether some replica has a memory cap (only then can a step need or gain from sub-steps)."""
        caps = self._strategy.balancer.max_batch_sizes
        return self.enabled and caps is not None and any(cap is not None for cap in caps)

    def plan_for(self, global_batch_size: int, *, cost_models=None, max_batch_sizes=None) -> MicroBatchPlan:
        """The sub-steps for a global batch of this size under the balancer's models and caps (or those given).

        Raises:
            MicroBatchError: No replica can hold one example.
        """
        balancer = self._strategy.balancer
        models = cost_models if cost_models is not None else balancer._cost_models  # noqa: SLF001 - idle-free ones
        caps = max_batch_sizes if max_batch_sizes is not None else balancer.max_batch_sizes
        overhead = self.sub_step_overhead_s()
        key = (int(global_batch_size), None if models is None else tuple(id(m) for m in models),
               None if caps is None else tuple(caps), balancer.shares, overhead)
        with self._lock:
            cached = self._plans.get(key)
        if cached is not None:
            return cached[1]
        R = balancer.num_replicas

        def solve(b: int):
            return choose_plan(b, R, shares=balancer.shares, auto_balance=balancer.auto_balance, cost_models=models,
                               max_batch_sizes=caps, log_ties=False, idle_free=True)

        with self._lock:
            incumbent = self._in_use.get(int(global_batch_size))
        try:
            plan = plan_micro_batches(int(global_batch_size), solve, capacity=capacity_of(caps),
                                      sub_step_overhead_s=overhead, incumbent_sub_steps=incumbent)
        except InfeasiblePlanError as exc:
            raise MicroBatchError(f"{exc} Memory caps now: {caps} examples per replica.") from exc
        with self._lock:
            if len(self._plans) > 64:
                self._plans.clear()
            self._plans[key] = (models, plan)  # the models stay referenced: their ids in the key stay theirs
            if cost_models is None and max_batch_sizes is None:  # the balancer's: this K is now in use
                self._in_use[int(global_batch_size)] = plan.num_sub_steps
        return plan

    def sub_step_overhead_s(self) -> float:
        """The host's measured time per sub-step beyond the replicas' predicted makespan (median of the last 32
        sub-steps, rounded to 0.5 ms; 0 until 5 were measured), in seconds."""
        with self._lock:
            samples = list(self._overheads)
        if len(samples) < 5:
            return 0.0
        return round(statistics.median(samples) * 2000) / 2000

    def explained(self, exc: Exception, *, training: bool) -> Exception:
        """``exc`` from cutting a training step, or a MicroBatchError saying why a batch the caps cannot hold ran as
        one step (micro-batches run only in fit with steps_per_execution=1)."""
        if not (training and self.enabled and isinstance(exc, InfeasiblePlanError)) or isinstance(exc, MicroBatchError):
            return exc
        return MicroBatchError(
            f"{str(exc).strip()} Micro-batches would train this batch, but this step runs it as one step: they run "
            f"in model.fit, evaluate and predict with steps_per_execution=1 (the default), not in custom loops, "
            f"train_on_batch or with steps_per_execution > 1. Compile with steps_per_execution=1, or use a smaller "
            f"global batch.")

    def reference_batch_size(self, global_batch_size: int, cost_models, max_batch_sizes) -> int:
        """The step size the balancer plans for when calibration gives these models and caps: ``B`` itself, or the
        largest sub-step when ``B`` is micro-batched."""
        if not self.enabled or capacity_of(max_batch_sizes) is None:
            return global_batch_size
        from hetero_cs.planning.cost_model import idle_free

        plan = self.plan_for(global_batch_size, cost_models=idle_free(list(cost_models)),
                             max_batch_sizes=list(max_batch_sizes))
        return max(plan.sub_step_sizes)

    # ------------------------------------------------------------------------------------------------------------
    # What traced steps read
    # ------------------------------------------------------------------------------------------------------------
    @property
    def armed(self) -> bool:
        """True once a micro-batched step was prepared: steps traced from then on read the host state."""
        return self._armed

    def arm(self) -> None:
        """Creates the host state (once); steps traced afterwards can run as sub-steps."""
        with self._lock:
            if self._state is None:
                with tf.init_scope(), tf.device(self._strategy.parameter_device):
                    self._state = tf.Variable([0, 0], dtype=tf.int64, trainable=False,
                                              name="hetero_cs_micro_batch_state")
            self._armed = True

    def full_batch_size(self, step_batch_size):
        """In a traced step: ``B`` of the whole micro-batched step, else the step's own (``step_batch_size``)."""
        if not self._armed:
            return step_batch_size
        full = tf.cast(self._state[0], step_batch_size.dtype)
        return tf.where(full > 0, full, step_batch_size)

    def update_branch(self):
        """In a traced step's host update: an int32 scalar, 0 for an ordinary step, 1 for a sub-step that only
        accumulates, 2 for the last sub-step (which applies the sum); None when not armed."""
        if not self._armed:
            return None
        state = self._state.read_value()
        return tf.cast(tf.where(state[0] > 0, 2 - state[1], 0), tf.int32)

    def accumulators(self, variables) -> list:
        """One host variable per trained variable (zeros of its shape and dtype), created once."""
        found = []
        for variable in variables:
            key = variable.ref() if hasattr(variable, "ref") else id(variable)
            accumulator = self._accumulators.get(key)
            if accumulator is None:
                with tf.init_scope(), tf.device(self._strategy.parameter_device):
                    accumulator = tf.Variable(tf.zeros(variable.shape, variable.dtype), trainable=False,
                                              name="hetero_cs_gradient_sum")
                self._accumulators[key] = accumulator
            found.append(accumulator)
        return found

    def sparse_accumulator(self, variable, gradient) -> SparseSum:
        """The :class:`SparseSum` of a variable whose gradient is a ``tf.IndexedSlices``, created once."""
        key = ("sparse", variable.ref() if hasattr(variable, "ref") else id(variable))
        accumulator = self._accumulators.get(key)
        if accumulator is None:
            with tf.init_scope(), tf.device(self._strategy.parameter_device):
                accumulator = SparseSum(gradient.values.shape[1:], gradient.values.dtype, gradient.indices.dtype,
                                        gradient.dense_shape, rows=gradient.indices.shape[0])
            self._accumulators[key] = accumulator
        return accumulator

    def forget_findings(self) -> None:
        """A train step is about to be traced anew (another model, or a retrace): what it cannot keep exact is found
        again while it is traced, and its first micro-batched step checks it again."""
        self._found = set()
        self._checked = False

    def note(self, finding: str) -> None:
        """Called while a step is traced: ``finding`` (BATCH_NORM, NORMALISED_LOSS) is in this model's step."""
        self._found.add(finding)

    # ------------------------------------------------------------------------------------------------------------
    # The sub-step loop
    # ------------------------------------------------------------------------------------------------------------
    def run(self, model, step, data, plan: MicroBatchPlan):
        """Runs one global batch as ``plan``'s sub-steps; returns the last sub-step's outputs (the step's logs).

        Args:
            model: The Keras model being fit.
            step: ``step(batch)`` runs one step of the traced train function on a distributed element (with
                out-of-memory recovery where it is on).
            data: The global batch, a distributed element (whole per leaf).
            plan: From :meth:`plan_for`, with ``K >= 2`` sub-steps.

        Raises:
            MicroBatchError: The model cannot be micro-batched exactly (see the module docstring) and one step
                cannot hold the batch.
        """
        refusal = self._refusal()
        if refusal is not None:
            return self._one_step_instead(step, data, plan, refusal)
        B = plan.global_batch_size
        checking = not self._checked
        saved = saved_state(model) if checking else None
        sizes = list(plan.sub_step_sizes)
        if not checking:
            self._log_plan(plan)
        start, j = 0, 0
        try:
            while j < len(sizes):
                size = sizes[j]
                capacity = capacity_of(self._strategy.balancer.max_batch_sizes)
                if capacity is not None and size > capacity:  # caps fell (an out-of-memory sub-step): cut finer
                    if capacity == 0:
                        raise MicroBatchError(
                            f"No replica can hold one example any more (memory caps "
                            f"{self._strategy.balancer.max_batch_sizes}); the step of {B} examples cannot go on.")
                    sizes[j:j + 1] = _equal(size, math.ceil(size / capacity))
                    continue
                last = j == len(sizes) - 1
                self._state.assign([B, 0 if last else 1])
                started = time.perf_counter()
                try:
                    outputs = step(_rows(data, start, start + size))
                except (StepOOMError, DeviceFaultError):  # a card set aside too: its share moved to the others
                    now = capacity_of(self._strategy.balancer.max_batch_sizes)
                    if now is None or now >= size:
                        raise
                    continue  # the lowered caps cannot hold this sub-step: cut it finer, above
                self.sub_steps += 1
                predicted = plan.sub_step_plans[j].predicted_makespan_s if j < plan.num_sub_steps else None
                if self.micro_batched_steps > 0 and predicted is not None and size == plan.sub_step_sizes[j]:
                    with self._lock:  # not the first micro-batched step, which traces
                        self._overheads.append(max(0.0, time.perf_counter() - started - predicted))
                if checking:
                    checking = False
                    self._checked = True
                    refusal = self._refusal()
                    if refusal is not None:  # found while the first sub-step was traced: undo it, one step instead
                        self._zero()
                        restore(saved)
                        self._state.assign([0, 0])
                        return self._one_step_instead(step, data, plan, refusal)
                    self._log_plan(plan)
                start += size
                j += 1
        except BaseException:
            self._zero()
            raise
        finally:
            self._state.assign([0, 0])
        self.micro_batched_steps += 1
        return outputs

    def run_inference(self, step, data, *, predicting: bool):
        """Runs an evaluation or prediction batch larger than the training caps hold as sub-steps within them.

        An inference step keeps no activations for a backward pass, so the training caps are a safe bound for it.
        Evaluation weighs every sub-step's loss by ``b_ij / B`` of the whole batch (its metrics add up, as over
        replicas); prediction concatenates the sub-steps' outputs in order. Returns the last sub-step's logs, or the
        whole batch's predictions.

        Raises:
            MicroBatchError: An evaluation whose loss is normalised by the batch (see the module docstring).
        """
        from hetero_cs.engine.oom_recovery import global_batch_size_of

        B = global_batch_size_of(data)
        caps = self._strategy.balancer.max_batch_sizes
        capacity = capacity_of(caps)
        if capacity == 0:
            raise MicroBatchError(f"No replica can hold one example (memory caps {caps}).")
        sizes = _equal(B, math.ceil(B / capacity))
        outputs, start = [], 0
        try:
            for size in sizes:
                self._state.assign([B, 0])
                outputs.append(step(_rows(data, start, start + size)))
                if not predicting and NORMALISED_LOSS in self._found:
                    raise MicroBatchError(
                        f"An evaluation batch of {B} examples does not fit the training memory caps {caps} in one "
                        f"step, and in sub-steps its loss would not be exact: {_WHY[NORMALISED_LOSS]}. Evaluate with "
                        f"batch_size={capacity} or less (fit: validation_batch_size=).")
                start += size
        finally:
            self._state.assign([0, 0])
        if not predicting:
            return outputs[-1]
        return tf.nest.map_structure(lambda *parts: tf.concat(parts, 0), *outputs)

    def _refusal(self) -> str | None:
        found = set(self._found)
        if self.setting is True:
            found.discard(BATCH_NORM)
            if BATCH_NORM in self._found and "approximation" not in self._logged:
                self._logged.add("approximation")
                logger.warning("hetero_cs: micro_batches=True: %s; this model's micro-batched steps approximate one "
                               "device's step there (everything else stays exact).", _WHY[BATCH_NORM])
        return "; ".join(_WHY[f] for f in sorted(found)) or None

    def _one_step_instead(self, step, data, plan: MicroBatchPlan, refusal: str):
        caps = self._strategy.balancer.max_batch_sizes
        capacity = capacity_of(caps)
        if capacity is not None and plan.global_batch_size > capacity:
            raise MicroBatchError(
                f"A global batch of {plan.global_batch_size} examples does not fit the devices' memory in one step "
                f"(memory caps {caps} examples per replica, {capacity} in all), and micro-batches cannot keep "
                f"this model's step exact: {refusal}. Use a global batch of at most {capacity}"
                + ("" if NORMALISED_LOSS in self._found else ", or accept the approximation with "
                   "HeteroCentralStorageStrategy(..., micro_batches=True)") + ".")
        if ("kept", plan.global_batch_size) not in self._logged:
            self._logged.add(("kept", plan.global_batch_size))
            logger.info("hetero_cs: not micro-batching this model (%s): batches of %d examples keep one step within "
                        "the memory caps.", refusal, plan.global_batch_size)
        return step(data)

    def _zero(self) -> None:
        for accumulator in self._accumulators.values():
            if isinstance(accumulator, SparseSum):
                accumulator.clear()
            else:
                accumulator.assign(tf.zeros_like(accumulator))

    def _log_plan(self, plan: MicroBatchPlan) -> None:
        # Logged when the cut changes, not when only a prediction does (the measured host time moves a little).
        def cut(p):
            return None if p is None else tuple(q.per_replica_batch_sizes for q in p.sub_step_plans)

        if cut(plan) != cut(self.last_plan):
            logger.info("hetero_cs micro-batched plan:\n%s", plan)
        self.last_plan = plan


class SparseSum:
    """The sum of sparse gradients (``tf.IndexedSlices``) over sub-steps, as one device's gradient of the whole batch.

    A lookup of the batch (a row per example): host variables of unknown leading dimension hold the rows' values and
    indices so far, and :meth:`total` appends a last gradient's, in order, giving the IndexedSlices one device
    computes for the whole batch (duplicate rows included, which an update such as Adam's treats one by one). A
    lookup that does not depend on the batch (``rows`` known while tracing: a Transformer's positions) has the same
    rows in every sub-step, summed over it: their values are added row by row, as one device sums them over the batch.
    """

    def __init__(self, row_shape, dtype, index_dtype, dense_shape, rows: int | None = None):
        row_shape = tf.TensorShape(row_shape)
        self._dense_shape = dense_shape
        self.shared = rows is not None
        leading = rows if self.shared else 0
        self.values = tf.Variable(tf.zeros([leading, *row_shape.as_list()], dtype),
                                  shape=tf.TensorShape([rows, *row_shape]), trainable=False,
                                  name="hetero_cs_sparse_gradient_rows")
        self.indices = tf.Variable(tf.zeros([leading], index_dtype), shape=tf.TensorShape([rows]), trainable=False,
                                   name="hetero_cs_sparse_gradient_indices")

    def add(self, gradient):
        """Adds ``gradient``'s rows; returns the write."""
        if self.shared:
            return tf.group(self.values.assign_add(gradient.values), self.indices.assign(gradient.indices))
        return tf.group(self.values.assign(tf.concat([self.values.read_value(), gradient.values], 0)),
                        self.indices.assign(tf.concat([self.indices.read_value(), gradient.indices], 0)))

    def total(self, gradient) -> tf.IndexedSlices:
        """The rows so far with ``gradient``'s, as one ``tf.IndexedSlices``."""
        if self.shared:
            return tf.IndexedSlices(self.values.read_value() + gradient.values, gradient.indices,
                                    gradient.dense_shape)
        return tf.IndexedSlices(tf.concat([self.values.read_value(), gradient.values], 0),
                                tf.concat([self.indices.read_value(), gradient.indices], 0), gradient.dense_shape)

    def clear(self):
        """Forgets every row; returns the write."""
        if self.shared:
            return self.values.assign(tf.zeros_like(self.values))
        return tf.group(self.values.assign(self.values.read_value()[:0]),
                        self.indices.assign(self.indices.read_value()[:0]))


def _equal(size: int, parts: int) -> list[int]:
    q, r = divmod(size, parts)
    return [q + 1] * r + [q] * (parts - r)


def _rows(data, start: int, end: int):
    """Examples ``[start, end)`` of a distributed element holding whole global batches (None leaves kept)."""

    def cut(leaf):
        parts = _compat.components(leaf)
        if parts is None or len(parts) != 1 or is_unbatched_marker(parts[0]):
            return leaf
        return _compat.per_replica([parts[0][start:end]])

    return tf.nest.map_structure(cut, data, expand_composites=False)
