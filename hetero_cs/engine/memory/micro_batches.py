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

How the sub-steps run. With an overlapped plan (:func:`hetero_cs.planning.plan_overlapped_micro_batches`) the
sub-steps are traced into one call (or a few, ``MicroBatchPlan.calls``; :class:`SubStepTrace`), and within a call each
card runs its micro-batches back to back: its
next one waits for its previous one only, the host sums each sub-step's gradients while the cards go on, and the
update branch of each sub-step is fixed while tracing. Otherwise each sub-step is one call of the traced train step,
ending at a barrier, with the host state saying which sub-step it is.

What a sub-step costs: the replicas' per-step fixed cost again (parameters to the cards, gradients back), and on the
host a gradient sum into the accumulators. The calibrated cost models hold the first; the second is small beside it.
A failed sub-step applies nothing and the accumulators are zeroed, so a failed step leaves the model and optimizer
as they were. An out-of-memory sub-step is recovered by :mod:`hetero_cs.engine.memory.oom_recovery` like any step; a
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
from hetero_cs.engine.step.input_slicing import is_unbatched_marker
from hetero_cs.engine.memory.micro_batch_trials import OverlapTrials
from hetero_cs.engine.step.model_state import restore, saved_state
from hetero_cs.engine.step.sub_steps import SparseSum, SubStepTrace, current_sub_step, tracing_sub_step
from hetero_cs.errors import ConfigError, DeviceFaultError, InfeasiblePlanError, MicroBatchError, StepOOMError
from hetero_cs.planning.choice import choose_plan
from hetero_cs.planning.micro_batches import (
    MicroBatchPlan,
    capacity_of,
    plan_micro_batches,
    plan_overlapped_micro_batches,
    prefer_overlapped,
)

logger = logging.getLogger("hetero_cs.engine.central_storage")

#: How many sub-steps of one step may fail out of memory before the step gives up (each failure lowers a cap).
_MAX_SUB_STEP_FAILURES = 32

#: How many traced overlapped calls (shapes of calls: each sub-step's active replicas) a strategy keeps; a step made
#: of more distinct calls than this would trace some again at every step.
_MAX_TRACED_CALLS = 64

BATCH_NORM = "batch_norm"
NORMALISED_LOSS = "normalised_loss"
LAYER_STATE = "layer_state"
_WHY = {
    BATCH_NORM: "BatchNormalization in training normalises each micro-batch by its own statistics (one device "
                "normalises by the whole batch's) and updates its moving statistics once per micro-batch",
    LAYER_STATE: "a layer sets its own non-trainable state in training ({paths}), which micro-batches would each "
                 "set from their own examples, once per micro-batch",
    NORMALISED_LOSS: "a loss normalised by the batch (a mask, or reduction='mean_with_sample_weight') would divide "
                     "each micro-batch by its own count",
}


def validate_setting(micro_batches) -> None:
    """Raises ConfigError unless ``micro_batches`` is None, True or False."""
    if micro_batches is not None and not isinstance(micro_batches, bool):
        raise ConfigError(
            f"micro_batches must be None (micro-batch where it is exact and helps), True (also accept "
            f"per-micro-batch statistics: BatchNormalization's on one machine, a layer's own state on both "
            f"strategies) or False (never). Received: micro_batches={micro_batches!r}.")


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
        self._state_paths: set[str] = set()  # the layer state variables behind LAYER_STATE
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
        # Measured per overlapped call: wall time minus the cards' predicted makespan (counted once per step).
        self._step_overheads: collections.deque = collections.deque(maxlen=32)
        # (id(model), each sub-step's active replicas, applies) -> (model ref, the traced call), least recent first
        self._overlapped_functions: collections.OrderedDict = collections.OrderedDict()
        self.overlapped_steps = 0
        self.fallbacks = 0
        self._call_cache: dict = {}  # (plan, model) -> its overlapped calls; B -> its int32 tensor
        self._barrier_steps = 0
        self._micro_times: list = []  # (replica, examples, seconds, micro-batches) reported during an overlapped call
        self._barrier_of: dict = {}  # id(overlapped plan) -> (it, the plan it replaced)
        self._trials = OverlapTrials()
        self.last_run_as_planned = True  # whether the last step ran as its plan said (no fallback, no refusal)
        import weakref

        self._warm_functions: weakref.WeakSet = weakref.WeakSet()  # overlapped calls traced and run once

    def __deepcopy__(self, memo: dict) -> "MicroBatching":
        import weakref

        # A copy traces its own overlapped calls (a traced function and its tensors are not copied).
        memo[id(self._overlapped_functions)] = collections.OrderedDict()
        memo[id(self._warm_functions)] = weakref.WeakSet()
        memo[id(self._call_cache)] = {}
        memo[id(self._barrier_of)] = {}
        memo[id(self._trials)] = OverlapTrials()
        return super().__deepcopy__(memo)

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

    def plan_for(self, global_batch_size: int, *, cost_models=None, max_batch_sizes=None,
                 overlapped: bool = True) -> MicroBatchPlan:
        """The sub-steps for a global batch of this size under the balancer's models and caps (or those given).

        ``overlapped=False``: only sub-steps with a barrier each (an eager step, ``run_eagerly=True``, has no traced
        call to overlap them in).

        Raises:
            MicroBatchError: No replica can hold one example.
        """
        balancer = self._strategy.balancer
        models = cost_models if cost_models is not None else balancer._cost_models  # noqa: SLF001 - idle-free ones
        caps = max_batch_sizes if max_batch_sizes is not None else balancer.max_batch_sizes
        overhead = self.sub_step_overhead_s()
        key = (int(global_batch_size), None if models is None else tuple(id(m) for m in models),
               None if caps is None else tuple(caps), balancer.shares, overhead, self.step_overhead_s(), overlapped)
        with self._lock:
            cached = self._plans.get(key)
        if cached is not None:
            return cached[1]
        def solve(b: int):
            return self.plan_for_sub_step(b, cost_models=models, max_batch_sizes=caps)

        with self._lock:
            incumbent = self._in_use.get(int(global_batch_size))
        try:
            plan = plan_micro_batches(int(global_batch_size), solve, capacity=capacity_of(caps),
                                      sub_step_overhead_s=overhead, incumbent_sub_steps=incumbent)
            overlapped = self._overlapped_plan(int(global_batch_size), models, caps, plan) if overlapped else None
        except InfeasiblePlanError as exc:
            raise MicroBatchError(f"{exc} Memory caps now: {caps} examples per replica.") from exc
        with self._lock:
            if len(self._plans) > 64:
                self._plans.clear()
                self._barrier_of.clear()
            if overlapped is not None:  # what it replaces, for the guard's side-by-side trial (plan_to_run)
                self._barrier_of[id(overlapped)] = (overlapped, plan)
                plan = overlapped
            self._plans[key] = (models, plan)  # the models stay referenced: their ids in the key stay theirs
            if cost_models is None and max_batch_sizes is None:  # the balancer's: this K is now in use
                self._in_use[int(global_batch_size)] = plan.num_sub_steps
        return plan

    def plan_after_failure(self, global_batch_size: int, *, overlapped: bool = True) -> MicroBatchPlan:
        """The sub-steps for a batch whose one step failed out of memory even after its retries: :meth:`plan_for`'s,
        or, where the caps still claim to hold the batch (a replica no failure capped yet; caps lowered by halving
        are upper bounds), sub-steps of at most half the batch, which the sub-step loop cuts finer if they fail."""
        plan = self.plan_for(global_batch_size, overlapped=overlapped)
        if plan.num_sub_steps > 1 or global_batch_size < 2:
            return plan
        return plan_micro_batches(int(global_batch_size), self.plan_for_sub_step, capacity=global_batch_size // 2,
                                  sub_step_overhead_s=self.sub_step_overhead_s())

    def plan_to_run(self, global_batch_size: int, *, overlapped: bool = True) -> MicroBatchPlan:
        """The plan ``model.fit``'s next step of this size runs: :meth:`plan_for`'s, except while the guard tries
        an overlapped plan against the plan it replaces, side by side, or after it reverted one
        (:mod:`hetero_cs.engine.memory.micro_batch_trials`). Report the step with :meth:`observe_run`."""
        balancer = self._strategy.balancer
        if overlapped and self.setting is not False:
            # A card held at its cap whose models went stale (it drifted, then recovered): measured models may
            # bring its micro-batches back (hetero_cs.planning.balancer_micro).
            balancer.consider_micro_batched_models(int(global_batch_size))
        plan = self.plan_for(global_batch_size, overlapped=overlapped)
        if not plan.overlapped or not balancer.guard_enabled:
            return plan
        with self._lock:
            entry = self._barrier_of.get(id(plan))
        if entry is None or entry[0] is not plan:
            return plan
        models, caps = balancer._cost_models, balancer.max_batch_sizes  # noqa: SLF001 - those plan_for used
        key = (int(global_batch_size), tuple(id(m) for m in models or ()), None if caps is None else tuple(caps))
        return self._trials.choose(key, plan, entry[1], balancer.guard.policy, pin=models)

    def observe_run(self, plan: MicroBatchPlan, seconds: float) -> None:
        """A step that :meth:`plan_to_run` served took ``seconds`` of wall clock (host work included)."""
        self._trials.observe(plan, seconds, as_planned=self.last_run_as_planned)

    @property
    def trial_decisions(self) -> list:
        """The guard's decisions on overlapped plans tried side by side, oldest first (GuardDecision)."""
        return list(self._trials.decisions)

    def _overlapped_plan(self, global_batch_size: int, models, caps, barrier_plan: MicroBatchPlan):
        """The overlapped plan for this batch when it is predicted faster than ``barrier_plan`` (the sub-steps with a
        barrier each, or the one step that fits) by ``MIN_PREDICTED_GAIN``, else None.

        Needs the calibrated models and balancing (fixed shares or an even split keep sub-steps cut by the shares),
        and some card with a cap (an uncapped card runs its share in one micro-batch)."""
        balancer = self._strategy.balancer
        if (models is None or caps is None or balancer.shares is not None or not balancer.auto_balance
                or balancer.num_replicas < 2 or all(cap is None for cap in caps)):
            return None
        single = barrier_plan.single_step_makespan_s
        if barrier_plan.num_sub_steps == 1:
            single = barrier_plan.predicted_makespan_s
        plan = plan_overlapped_micro_batches(global_batch_size, models, caps, single_step_makespan_s=single,
                                             host_overhead_s=self.step_overhead_s())
        chosen = prefer_overlapped(barrier_plan, plan)
        return chosen if chosen is plan else None

    def step_overhead_s(self) -> float:
        """The host's measured time per overlapped call beyond the cards' predicted makespan (median of the last
        32 calls, rounded to 0.5 ms; 0 until 5 were measured), in seconds."""
        with self._lock:
            samples = list(self._step_overheads)
        if len(samples) < 5:
            return 0.0
        return round(statistics.median(samples) * 2000) / 2000

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
        capacity = capacity_of(max_batch_sizes)
        if plan.overlapped and (capacity is None or global_batch_size <= capacity):
            return global_batch_size  # its sub-steps are not steps anything else runs; the batch fits one step
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
        sub_step = current_sub_step()
        if sub_step is not None:
            return tf.cast(sub_step.global_batch_size, step_batch_size.dtype)
        if not self._armed:
            return step_batch_size
        full = tf.cast(self._state[0], step_batch_size.dtype)
        return tf.where(full > 0, full, step_batch_size)

    def update_branch(self):
        """In a traced step's host update: an int32 scalar, 0 for an ordinary step, 1 for a sub-step that only
        accumulates, 2 for the last sub-step (which applies the sum); None when not armed. In an overlapped call's
        sub-step, the Python int 1 or 2 (known while tracing: its update takes no branch, so nothing of it looks
        like a write of the weights that the next sub-step's reads would wait for)."""
        sub_step = current_sub_step()
        if sub_step is not None:
            return 2 if sub_step.last else 1
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
        again while it is traced, and its first micro-batched step checks it again; overlapped calls are traced
        again too."""
        self._found = set()
        self._state_paths = set()
        self._checked = False
        with self._lock:
            self._overlapped_functions.clear()
            self._call_cache.clear()

    def note(self, finding: str) -> None:
        """Called while a step is traced: ``finding`` (BATCH_NORM, NORMALISED_LOSS) is in this model's step."""
        self._found.add(finding)

    def note_layer_state(self, path: str) -> None:
        """Called while a step is traced: a layer sets its non-trainable variable ``path`` in a replica step
        (BatchNormalization's moving statistics are BATCH_NORM's)."""
        if str(path).endswith(("moving_mean", "moving_variance")):
            return
        self._found.add(LAYER_STATE)
        self._state_paths.add(str(path))

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
        self.last_run_as_planned = True  # until a refusal or a fallback says otherwise
        refusal = self._refusal()
        if refusal is not None:
            return self._one_step_instead(step, data, plan, refusal)
        if plan.overlapped:
            return self._run_overlapped(model, step, data, plan)
        return self._run_sub_steps(model, step, data, plan)

    def _run_sub_steps(self, model, step, data, plan: MicroBatchPlan):
        """Runs ``plan``'s sub-steps one call each (a barrier at the end of each); see :meth:`run`."""
        B = plan.global_batch_size
        checking = not self._checked
        warm = self._barrier_steps > 0  # the first such step traces: its time is not the host's time per sub-step
        saved = saved_state(model) if checking else None
        sizes = list(plan.sub_step_sizes)
        if not checking:
            self._log_plan(plan)
        start, j, failures = 0, 0, 0
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
                    failures += 1
                    if now is not None and now < size:
                        continue  # the lowered caps cannot hold this sub-step: cut it finer, above
                    if size == 1 or failures > _MAX_SUB_STEP_FAILURES:
                        raise
                    # Every retry lowered a cap, and the caps still claim to hold it: those are upper bounds
                    # (halved after a failure), not sizes known to fit. Cut it in two.
                    sizes[j:j + 1] = _equal(size, 2)
                    continue
                self.sub_steps += 1
                predicted = plan.sub_step_plans[j].predicted_makespan_s if j < plan.num_sub_steps else None
                if warm and predicted is not None and size == plan.sub_step_sizes[j]:
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
        self._barrier_steps += 1
        return outputs

    def _run_overlapped(self, model, step, data, plan: MicroBatchPlan):
        """Runs ``plan``'s sub-steps in traced calls of up to ``SUB_STEPS_PER_CALL``, each card's micro-batches back
        to back within a call.

        A call traces Keras' train step once per sub-step into one graph (:class:`SubStepTrace`): sub-step ``j``
        cuts ``plan``'s ``j``-th slice sizes, runs only its active replicas, weighs every loss by ``b_ij / B``, and
        adds its summed gradient to the host's sums, except the step's last, which applies them. A card's next
        micro-batch waits for its previous one only, so no card waits for another between its micro-batches, and
        the host adds each sub-step's gradients while the cards go on; a call ends at a barrier.

        When anything in a call fails (out of memory, a failing card, any error), everything the step changed is put
        back (the non-trained and metric variables, the optimizer's iteration count, the gradient sums), and the
        batch runs again as sub-steps with a barrier each, one call per sub-step, where out-of-memory recovery and
        failover handle each sub-step (:meth:`_run_sub_steps`); an error there is raised as it is.
        """
        from hetero_cs.engine.step.model_state import saved_state as save

        B = plan.global_batch_size
        calls = self._overlapped_calls(model, plan)
        if not self._checked:
            function, rows, cuts, _ = calls[0]
            function.get_concrete_function(rows(data), cuts, self._batch_size_tensor(B))  # found while tracing
            self._checked = True
            refusal = self._refusal()
            if refusal is not None:
                return self._one_step_instead(step, data, plan, refusal)
        self._log_plan(plan)
        optimizer = getattr(model, "optimizer", None)
        iterations = None if optimizer is None else _compat.iteration_counter(optimizer)
        saved = save(model, extra=() if iterations is None else (iterations,))
        with self._lock:
            self._micro_times = []
        started = time.perf_counter()
        warm = all(function in self._warm_functions for function, *_ in calls)
        try:
            for function, rows, cuts, _ in calls:
                outputs = function(rows(data), cuts, self._batch_size_tensor(B))  # returns once the call ran
                self._warm_functions.add(function)
        except Exception as exc:  # noqa: BLE001 - every failure is undone, then the barrier path decides
            self._zero()
            restore(saved)
            self.fallbacks += 1
            self.last_run_as_planned = False
            logger.info("hetero_cs: the overlapped micro-batched step failed (%s: %s); running this batch of %d "
                        "examples as sub-steps with a barrier each.", type(exc).__name__,
                        str(exc).strip().splitlines()[0][:200] if str(exc).strip() else "", B)
            barrier = plan_micro_batches(
                B, self.plan_for_sub_step, capacity=capacity_of(self._strategy.balancer.max_batch_sizes),
                sub_step_overhead_s=self.sub_step_overhead_s())
            # Even one sub-step runs through the sub-step loop: one that runs out of memory again, beyond what the
            # lowered caps hold, is cut finer there instead of failing the step.
            return self._run_sub_steps(model, step, data, barrier)
        except BaseException:
            self._zero()
            restore(saved)
            raise
        predicted = plan.predicted_makespan_s
        if warm and predicted is not None:  # a call's first run traces: its time is not the host's
            with self._lock:
                self._step_overheads.append(max(0.0, (time.perf_counter() - started - predicted) / len(calls)
                                                + plan.sub_step_overhead_s))
        self.overlapped_steps += 1
        self.micro_batched_steps += 1
        self.sub_steps += plan.num_sub_steps
        self._report_micro_batch_times(plan)  # the monitor's step; a card that drifted is planned again
        # Each card's micro-batches fitted: a lowered memory cap may grow back, as after any step that fitted.
        recovery = getattr(self._strategy, "_step_recovery", None)
        for change in self._strategy.balancer.record_step_success(plan.micro_batch_sizes):
            if recovery is not None:
                recovery._note(change)  # noqa: SLF001 - logged and written back as the recovery's own changes
        return outputs

    def _record_micro_batches(self, replica_id: int, examples: int, seconds: float, count: int) -> None:
        """Called from TensorFlow threads during an overlapped call: ``count`` micro-batches of ``replica_id`` ran
        ``examples`` examples in ``seconds`` (see :class:`SubStepTrace`)."""
        with self._lock:
            self._micro_times.append((int(replica_id), int(examples), float(seconds), int(count)))

    def _report_micro_batch_times(self, plan: MicroBatchPlan) -> None:
        """Hands the step's per-card times (kept by :meth:`_record_micro_batches`) to the balancer as one step."""
        with self._lock:
            reports, self._micro_times = self._micro_times, []
        if not reports:
            return
        R = self._strategy.balancer.num_replicas
        sizes, times, counts = [0] * R, [0.0] * R, [0] * R
        for replica, examples, seconds, count in reports:
            sizes[replica] += examples
            times[replica] += seconds
            counts[replica] += count
        if sizes != list(plan.per_replica_batch_sizes):  # a report missing (a sampled step): nothing to pair
            return
        self._strategy.balancer.record_micro_batched_step(sizes, times, counts)

    def _batch_size_tensor(self, global_batch_size: int):
        value = self._call_cache.get(("B", global_batch_size))
        if value is None:
            value = self._call_cache[("B", global_batch_size)] = tf.constant(global_batch_size, tf.int32)
        return value

    def _overlapped_calls(self, model, plan: MicroBatchPlan) -> list:
        """``(traced call, rows of the batch it takes, its cut [k, R], sub-steps)`` per call of ``plan``'s step."""
        import numpy as np

        key = ("calls", plan, id(model))
        found = self._call_cache.get(key)
        if found is not None:
            return found
        calls, start = [], 0
        parts = plan.calls
        for index, part in enumerate(parts):
            size = sum(p.global_batch_size for p in part)
            function = self._overlapped_function(model, part, applies=index == len(parts) - 1)
            cuts = tf.constant(np.asarray([p.per_replica_batch_sizes for p in part], np.int64))
            whole = len(parts) == 1
            rows = (lambda data: data) if whole else (lambda data, a=start, b=start + size: _rows(data, a, b))
            calls.append((function, rows, cuts, part))
            start += size
        if len(self._call_cache) > 64:
            self._call_cache.clear()
        self._call_cache[key] = calls
        return calls

    def plan_for_sub_step(self, size: int, *, cost_models=None, max_batch_sizes=None):
        """The plan of one sub-step of ``size`` examples within the caps (the barrier path's), under the balancer's
        models and caps or those given."""
        balancer = self._strategy.balancer
        models = cost_models if cost_models is not None else balancer._cost_models  # noqa: SLF001 - idle-free ones
        caps = max_batch_sizes if max_batch_sizes is not None else balancer.max_batch_sizes
        return choose_plan(size, balancer.num_replicas, shares=balancer.shares, auto_balance=balancer.auto_balance,
                           cost_models=models, max_batch_sizes=caps, log_ties=False, idle_free=True)

    def _overlapped_function(self, model, sub_step_plans, *, applies: bool):
        """The traced overlapped call for ``model`` and these sub-steps' shape (how many, each one's active replicas,
        whether the call applies the sums); called as ``function(rows, cuts, B)``."""
        R = self._strategy.balancer.num_replicas
        actives = tuple(
            None if all(b > 0 for b in p.per_replica_batch_sizes)
            else tuple(i for i, b in enumerate(p.per_replica_batch_sizes) if b > 0)
            for p in sub_step_plans)
        key = (id(model), actives, applies)
        with self._lock:
            found = self._overlapped_functions.get(key)
            if found is not None and found[0]() is model:
                self._overlapped_functions.move_to_end(key)
                return found[1]
        import weakref

        strategy = self._strategy
        K = len(actives)
        # Each card's micro-batches in this call: which sub-steps it is active in (fixed by the traced shape).
        active_in = {i: [j for j in range(K) if actives[j] is None or i in actives[j]] for i in range(R)}
        last_of = {i: js[-1] for i, js in active_in.items() if js}
        counts = {i: len(js) for i, js in active_in.items() if js}
        record = self._record_micro_batches if strategy._timing_enabled else None  # noqa: SLF001

        def overlapped_call(data, cuts, global_batch_size):
            ends: dict = {}
            stamps: dict = {}
            chain_starts: dict = {}
            with tf.device(strategy._parameter_device):  # noqa: SLF001 - host scalars, read by the host's clock
                chain_sizes = {i: tf.reduce_sum(tf.reshape(cuts, [K, R])[:, i]) for i in last_of}
            start = tf.constant(0, tf.int64)
            outputs = None
            for j in range(K):
                size = tf.reduce_sum(cuts[j])
                rows = _rows(data, start, start + size)
                start = start + size
                sub_step = SubStepTrace(j, K, global_batch_size, tf.reshape(cuts[j], [R]), actives[j], ends, stamps,
                                        applies=applies, last_of=last_of, counts=counts, chain_sizes=chain_sizes,
                                        chain_starts=chain_starts, record=record)
                with tracing_sub_step(sub_step):
                    outputs = strategy.run(model.train_step, args=(rows,))
                    outputs = _compat.reduced_step_outputs(outputs, strategy)
            return outputs

        function = tf.function(overlapped_call, autograph=False, reduce_retracing=True)
        with self._lock:
            while len(self._overlapped_functions) >= _MAX_TRACED_CALLS:  # the least recently used goes
                self._overlapped_functions.popitem(last=False)
            self._overlapped_functions[key] = (weakref.ref(model), function)
        return function

    def run_inference(self, step, data, *, predicting: bool):
        """Runs an evaluation or prediction batch larger than the training caps hold as sub-steps within them.

        An inference step keeps no activations for a backward pass, so the training caps are a safe bound for it.
        Evaluation weighs every sub-step's loss by ``b_ij / B`` of the whole batch (its metrics add up, as over
        replicas); prediction concatenates the sub-steps' outputs in order. Returns the last sub-step's logs, or the
        whole batch's predictions.

        Raises:
            MicroBatchError: An evaluation whose loss is normalised by the batch (see the module docstring).
        """
        from hetero_cs.engine._compat import global_batch_size_of

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

    def _why(self, finding: str) -> str:
        return _WHY[finding].format(paths=", ".join(sorted(self._state_paths)[:4]))

    def _refusal(self) -> str | None:
        found = set(self._found)
        if self.setting is True:
            accepted = sorted(found & {BATCH_NORM, LAYER_STATE})
            found -= {BATCH_NORM, LAYER_STATE}
            if accepted and ("approximation", tuple(accepted)) not in self._logged:
                self._logged.add(("approximation", tuple(accepted)))
                logger.warning("hetero_cs: micro_batches=True: %s; this model's micro-batched steps approximate one "
                               "device's step there (everything else stays exact).",
                               "; ".join(self._why(f) for f in accepted))
        return "; ".join(self._why(f) for f in sorted(found)) or None

    def _one_step_instead(self, step, data, plan: MicroBatchPlan, refusal: str):
        self.last_run_as_planned = False
        caps = self._strategy.balancer.max_batch_sizes
        capacity = capacity_of(caps)
        if capacity is not None and plan.global_batch_size > capacity:
            known = sum(self._strategy.balancer.memory_caps.known_to_fit())  # caps lowered by halving: upper bounds
            advice = f"Use a global batch of at most {known}" if known else "Use a smaller global batch"
            raise MicroBatchError(
                f"A global batch of {plan.global_batch_size} examples does not fit the devices' memory in one step "
                f"(memory caps {caps} examples per replica, {capacity} in all), and micro-batches cannot keep "
                f"this model's step exact: {refusal}. {advice}"
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
