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
sub-steps are traced into one call (or a few) in which each card runs its micro-batches back to back
(:mod:`hetero_cs.engine.memory.overlapped_calls`). Otherwise each sub-step is one call of the traced train step,
ending at a barrier, with the host state (:mod:`hetero_cs.engine.memory.micro_batch_state`) saying which sub-step it
is.

What a sub-step costs: the replicas' per-step fixed cost again (parameters to the cards, gradients back), and on the
host a gradient sum into the accumulators. The calibrated cost models hold the first; the second is small beside it.
A failed sub-step applies nothing and the accumulators are zeroed, so a failed step leaves the model and optimizer
as they were. An out-of-memory sub-step is recovered by :mod:`hetero_cs.engine.memory.oom_recovery` like any step; a
sub-step that no longer fits the lowered caps is cut into smaller sub-steps.
"""

import collections
import logging
import math
import statistics
import time

import tensorflow as tf

from hetero_cs._copying import DeepcopiedWithNewLocks
from hetero_cs.engine._compat import global_batch_size_of
from hetero_cs.engine.memory.micro_batch_state import NORMALISED_LOSS, _WHY, MicroBatchState
from hetero_cs.engine.memory.micro_batch_trials import OverlapTrials
from hetero_cs.engine.memory.overlapped_calls import OverlappedCalls, rows_of
from hetero_cs.engine.step.model_state import restore, saved_state
from hetero_cs.errors import DeviceFaultError, InfeasiblePlanError, MicroBatchError, StepOOMError
from hetero_cs.planning.choice import choose_plan
from hetero_cs.planning.micro_batches import (
    MicroBatchPlan, capacity_of, plan_micro_batches, plan_overlapped_micro_batches, prefer_overlapped)
from hetero_cs.planning.plan import even_batch_split

logger = logging.getLogger("hetero_cs.engine.central_storage")

#: How many sub-steps of one step may fail out of memory before the step gives up (each failure lowers a cap).
_MAX_SUB_STEP_FAILURES = 32


class MicroBatching(MicroBatchState, OverlappedCalls, DeepcopiedWithNewLocks):
    """A strategy's micro-batching: the plans, the host state its traced steps read, and the sub-step loop.

    Args:
        strategy: The :class:`hetero_cs.HeteroCentralStorageStrategy`.
        setting: ``micro_batches``: None, True or False (see the strategy).
    """

    def __init__(self, strategy, setting: bool | None):
        super().__init__(strategy, setting)  # the host state (hetero_cs.engine.memory.micro_batch_state)
        self._plans: dict = {}
        self._in_use: dict[int, int] = {}  # global batch size -> the K its steps run with
        self.last_plan: MicroBatchPlan | None = None
        self.micro_batched_steps = 0
        # Measured per sub-step: wall time minus the replicas' predicted makespan (dispatch, the plan's Python call,
        # the host's gradient sum). The planner counts it once per sub-step (plan_micro_batches).
        self._overheads: collections.deque = collections.deque(maxlen=32)
        # Measured per overlapped call: wall time minus the cards' predicted makespan (counted once per step).
        self._step_overheads: collections.deque = collections.deque(maxlen=32)
        # (id(model), each sub-step's active replicas, applies) -> (model ref, the traced call), least recent first
        self._overlapped_functions: collections.OrderedDict = collections.OrderedDict()
        self.overlapped_steps, self.fallbacks = 0, 0  # steps run overlapped; overlapped calls that failed
        self._call_cache: dict = {}  # (plan, id(model)) -> its overlapped calls
        self._micro_times: list = []  # (replica, examples, seconds, micro-batches) reported during an overlapped call
        self._trials = OverlapTrials()
        self.last_run_as_planned = True  # whether the last step ran as its plan said (no fallback, no refusal)

    def __deepcopy__(self, memo: dict) -> "MicroBatching":
        # A copy traces its own overlapped calls (a traced function and its tensors are not copied).
        for cache in (self._overlapped_functions, self._call_cache):
            memo[id(cache)] = type(cache)()
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

    def _models_and_caps(self, cost_models=None, max_batch_sizes=None) -> tuple:
        """The cost models and caps given, or the balancer's (its idle-free models) for those not given."""
        balancer = self._strategy.balancer
        return (cost_models if cost_models is not None else balancer._cost_models,  # noqa: SLF001 - idle-free ones
                max_batch_sizes if max_batch_sizes is not None else balancer.max_batch_sizes)

    def plan_for(self, global_batch_size: int, *, cost_models=None, max_batch_sizes=None,
                 overlapped: bool = True) -> MicroBatchPlan:
        """The sub-steps for a global batch of this size under the balancer's models and caps (or those given).

        ``overlapped=False``: only sub-steps with a barrier each (an eager step, ``run_eagerly=True``, has no traced
        call to overlap them in).

        Raises:
            MicroBatchError: No replica can hold one example.
        """
        return self._plan_and_replaced(global_batch_size, cost_models, max_batch_sizes, overlapped)[0]

    def _plan_and_replaced(self, global_batch_size: int, cost_models, max_batch_sizes, overlapped: bool) -> tuple:
        """:meth:`plan_for`'s plan, the plan an overlapped one replaces (for the guard's side-by-side trial,
        :meth:`plan_to_run`; None for any other plan), the trial's key (``B``, the models' ids, the caps) and the
        models."""
        B = int(global_batch_size)
        models, caps = self._models_and_caps(cost_models, max_batch_sizes)
        overhead = self._overhead_s(self._overheads)
        key = (B, None if models is None else tuple(id(m) for m in models), None if caps is None else tuple(caps),
               self._strategy.balancer.shares, overhead, self._overhead_s(self._step_overheads), overlapped)
        with self._lock:
            cached, incumbent = self._plans.get(key), self._in_use.get(B)
        if cached is not None:
            return cached
        try:
            plan = plan_micro_batches(
                B, lambda b: self.plan_for_sub_step(b, cost_models=models, max_batch_sizes=caps),
                capacity=capacity_of(caps), sub_step_overhead_s=overhead, incumbent_sub_steps=incumbent)
            overlapped = self._overlapped_plan(B, models, caps, plan) if overlapped else None
        except InfeasiblePlanError as exc:
            raise MicroBatchError(f"{exc} Memory caps now: {caps} examples per replica.") from exc
        # An overlapped plan replaces the plan of sub-steps with a barrier each (or of one step).
        replaced, plan = (plan, overlapped) if overlapped is not None else (None, plan)
        with self._lock:
            if len(self._plans) > 64:
                self._plans.clear()
            # The models stay referenced: their ids in the key stay theirs.
            entry = self._plans[key] = (plan, replaced, key[:3], models)
            if cost_models is None and max_batch_sizes is None:  # the balancer's: this K is now in use
                self._in_use[B] = plan.num_sub_steps
        return entry

    def plan_after_failure(self, global_batch_size: int, *, overlapped: bool = True) -> MicroBatchPlan:
        """The sub-steps for a batch whose one step failed out of memory even after its retries: :meth:`plan_for`'s,
        or, where the caps still claim to hold the batch (a replica no failure capped yet; caps lowered by halving
        are upper bounds), sub-steps of at most half the batch, which the sub-step loop cuts finer if they fail."""
        plan = self.plan_for(global_batch_size, overlapped=overlapped)
        if plan.num_sub_steps > 1 or global_batch_size < 2:
            return plan
        return plan_micro_batches(int(global_batch_size), self.plan_for_sub_step, capacity=global_batch_size // 2,
                                  sub_step_overhead_s=self._overhead_s(self._overheads))

    def plan_to_run(self, global_batch_size: int, *, overlapped: bool = True) -> MicroBatchPlan:
        """The plan ``model.fit``'s next step of this size runs: :meth:`plan_for`'s, except while the guard tries
        an overlapped plan against the plan it replaces, side by side, or after it reverted one
        (:mod:`hetero_cs.engine.memory.micro_batch_trials`). Report the step with :meth:`observe_run`."""
        balancer = self._strategy.balancer
        if overlapped and self.setting is not False:
            # A card held at its cap whose models went stale (it drifted, then recovered): measured models may
            # bring its micro-batches back (hetero_cs.planning.balancer_memory).
            balancer.consider_micro_batched_models(int(global_batch_size))
        plan, replaced, key, models = self._plan_and_replaced(global_batch_size, None, None, overlapped)
        if replaced is None or not balancer.guard_enabled:
            return plan
        return self._trials.choose(key, plan, replaced, balancer.guard.policy, pin=models)

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
        single = (barrier_plan.predicted_makespan_s if barrier_plan.num_sub_steps == 1
                  else barrier_plan.single_step_makespan_s)
        plan = plan_overlapped_micro_batches(global_batch_size, models, caps, single_step_makespan_s=single,
                                             host_overhead_s=self._overhead_s(self._step_overheads))
        chosen = prefer_overlapped(barrier_plan, plan)
        return chosen if chosen is plan else None

    def _overhead_s(self, samples: collections.deque) -> float:
        """The host's measured time beyond the predicted makespan, in seconds: per overlapped call beyond the cards'
        (``samples`` ``_step_overheads``), or per sub-step beyond the replicas' (``_overheads``); the median of the
        last 32 calls or sub-steps, rounded to 0.5 ms; 0 until 5 were measured."""
        with self._lock:
            samples = list(samples)
        return round(statistics.median(samples) * 2000) / 2000 if len(samples) >= 5 else 0.0

    def explained(self, exc: Exception, *, training: bool) -> Exception:
        """``exc`` from cutting a training step, or a MicroBatchError saying why a batch the caps cannot hold ran as
        one step (micro-batches run only in fit with steps_per_execution=1)."""
        if not (training and self.enabled and isinstance(exc, InfeasiblePlanError)) or isinstance(exc, MicroBatchError):
            return exc
        return MicroBatchError(
            f"{str(exc).strip()} Micro-batches would train this batch, but this step runs it as one step: they run "
            f"in model.fit, evaluate and predict with steps_per_execution=1 (the default, train_on_batch included), "
            f"not in custom loops or with steps_per_execution > 1. Compile with steps_per_execution=1, or use a smaller "
            f"global batch.")

    def reference_batch_size(self, global_batch_size: int, cost_models, max_batch_sizes) -> int:
        """The step size the balancer plans for when calibration gives these models and caps: ``B`` itself, or the
        largest sub-step when ``B`` is micro-batched."""
        capacity = capacity_of(max_batch_sizes)
        if not self.enabled or capacity is None:
            return global_batch_size
        from hetero_cs.planning.cost_model import idle_free

        plan = self.plan_for(global_batch_size, cost_models=idle_free(list(cost_models)),
                             max_batch_sizes=list(max_batch_sizes))
        # An overlapped plan's sub-steps are not steps anything else runs: where the batch fits one step, it is B.
        return global_batch_size if plan.overlapped and global_batch_size <= capacity else max(plan.sub_step_sizes)

    def forget_findings(self) -> None:
        """A train step is about to be traced anew (another model, or a retrace): what it cannot keep exact is found
        again while it is traced, and its first micro-batched step checks it again; overlapped calls are traced
        again too."""
        self._found, self._paths, self._checked = set(), set(), False
        with self._lock:
            self._overlapped_functions.clear()
            self._call_cache.clear()

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
        return (self._run_overlapped if plan.overlapped else self._run_sub_steps)(model, step, data, plan)

    def _run_sub_steps(self, model, step, data, plan: MicroBatchPlan):
        """Runs ``plan``'s sub-steps one call each (a barrier at the end of each); see :meth:`run`."""
        B = plan.global_batch_size
        checking = not self._checked
        # The first such step traces: its time is not the host's time per sub-step.
        warm = self.micro_batched_steps > self.overlapped_steps  # steps with a barrier per sub-step ran before
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
                    sizes[j:j + 1] = even_batch_split(size, math.ceil(size / capacity))
                    continue
                self._state.assign([B, 0 if j == len(sizes) - 1 else 1])  # the last sub-step applies the sum
                started = time.perf_counter()
                try:
                    outputs = step(rows_of(data, start, start + size))
                except (StepOOMError, DeviceFaultError):  # a card set aside too: its share moved to the others
                    now = capacity_of(self._strategy.balancer.max_batch_sizes)
                    failures += 1
                    # Where the lowered caps cannot hold this sub-step, it is cut finer above. Otherwise every retry
                    # lowered a cap, and the caps still claim to hold it: those are upper bounds (halved after a
                    # failure), not sizes known to fit. Cut it in two.
                    if now is None or now >= size:
                        if size == 1 or failures > _MAX_SUB_STEP_FAILURES:
                            raise
                        sizes[j:j + 1] = even_batch_split(size, 2)
                    continue
                predicted = plan.sub_step_plans[j].predicted_makespan_s if j < plan.num_sub_steps else None
                if warm and predicted is not None and size == plan.sub_step_sizes[j]:
                    with self._lock:  # not the first micro-batched step, which traces
                        self._overheads.append(max(0.0, time.perf_counter() - started - predicted))
                if checking:
                    checking, self._checked = False, True
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

    def plan_for_sub_step(self, size: int, *, cost_models=None, max_batch_sizes=None):
        """The plan of one sub-step of ``size`` examples within the caps (the barrier path's), under the balancer's
        models and caps or those given."""
        balancer = self._strategy.balancer
        models, caps = self._models_and_caps(cost_models, max_batch_sizes)
        return choose_plan(size, balancer.num_replicas, shares=balancer.shares, auto_balance=balancer.auto_balance,
                           cost_models=models, max_batch_sizes=caps, log_ties=False, idle_free=True)

    def run_inference(self, step, data, *, predicting: bool):
        """Runs an evaluation or prediction batch larger than the training caps hold as sub-steps within them.

        An inference step keeps no activations for a backward pass, so the training caps are a safe bound for it.
        Evaluation weighs every sub-step's loss by ``b_ij / B`` of the whole batch (its metrics add up, as over
        replicas); prediction concatenates the sub-steps' outputs in order. Returns the last sub-step's logs, or the
        whole batch's predictions.

        Raises:
            MicroBatchError: An evaluation whose loss is normalised by the batch (see the module docstring).
        """
        B = global_batch_size_of(data)
        caps = self._strategy.balancer.max_batch_sizes
        capacity = capacity_of(caps)
        if capacity == 0:
            raise MicroBatchError(f"No replica can hold one example (memory caps {caps}).")
        sizes = even_batch_split(B, math.ceil(B / capacity))
        outputs, start = [], 0
        try:
            for size in sizes:
                self._state.assign([B, 0])
                outputs.append(step(rows_of(data, start, start + size)))
                if not predicting and NORMALISED_LOSS in self._found:
                    raise MicroBatchError(
                        f"An evaluation batch of {B} examples does not fit the training memory caps {caps} in one "
                        f"step, and in sub-steps its loss would not be exact: {_WHY[NORMALISED_LOSS]}. Evaluate with "
                        f"batch_size={capacity} or less (fit: validation_batch_size=).")
                start += size
        finally:
            self._state.assign([0, 0])
        return tf.nest.map_structure(lambda *parts: tf.concat(parts, 0), *outputs) if predicting else outputs[-1]

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
        self._log_once(("kept", plan.global_batch_size), logging.INFO, "hetero_cs: not micro-batching this model "
                       "(%s): batches of %d examples keep one step within the memory caps.", refusal,
                       plan.global_batch_size)
        return step(data)

    def _log_plan(self, plan: MicroBatchPlan) -> None:
        # Logged when the cut changes, not when only a prediction does (the measured host time moves a little).
        def cut(p):
            return None if p is None else tuple(q.per_replica_batch_sizes for q in p.sub_step_plans)

        if cut(plan) != cut(self.last_plan):
            logger.info("hetero_cs micro-batched plan:\n%s", plan)
        self.last_plan = plan
