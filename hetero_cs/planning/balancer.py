"""The plan lifecycle: cost models -> plan -> measured steps -> re-plan -> guarded switch (pure).

``Balancer`` is the one object every engine (central storage, several machines) talks to about the split. It owns

* how the split is chosen: fixed shares, the even split, or auto-balance (solve the minimum-makespan split from
  per-replica cost models, keep the even split when the solved one is predicted less than ``min_predicted_gain``
  faster);
* the plan in force for the reference (full) global batch and the plans of other sizes (a last partial batch is
  split by a plan solved for its own size);
* the :class:`~hetero_cs.planning.monitor.StepTimeMonitor` the replicas report step times to, the
  :class:`~hetero_cs.planning.rebalance.Rebalancer` that proposes re-plans from it, and the
  :class:`~hetero_cs.planning.guard.PlanGuard` that keeps a proposed plan only if it measured faster
  (:mod:`hetero_cs.planning.balancer_trials`);
* when per-replica timing is worth its cost (``timing_due``): every step while a decision needs samples, else
  one step in ``timing_interval_steps``;
* the memory caps in force, lowered after an out-of-memory step and grown back slowly (``recover_from_oom``,
  ``record_step_success``; :mod:`hetero_cs.planning.balancer_memory`).

An engine calls ``serve(B)`` for every global batch it cuts (when the step starts, before any replica runs),
``record_step_time`` from each replica's step, and reads ``plan``; ``on_plan`` tells it when the plan in force
changes. Thread-safe: one lock serialises every call.

This module is pure: it imports neither TensorFlow nor pynvml.
"""

import dataclasses
import math
import threading
from collections.abc import Callable, Hashable, Sequence

from hetero_cs.errors import ConfigError
from hetero_cs.planning.cost_checks import check_cost_model
from hetero_cs.planning.cost_model import CostModel, idle_free, without_idle_pricing
from hetero_cs.planning.guard import GuardDecision, GuardPolicy, PlanGuard
from hetero_cs.planning.monitor import StepTimeMonitor
from hetero_cs.planning.choice import choose_plan
from hetero_cs.planning.balancer_memory import MemoryRecovery
from hetero_cs.planning.balancer_plans import OtherPlans
from hetero_cs.planning.balancer_trials import GuardTrials
from hetero_cs.planning.memory_caps import MemoryCaps, MemoryRecoveryPolicy
from hetero_cs.planning.plan import BatchPlan, _checked_global_batch_size, check_range
from hetero_cs.planning.rebalance import RebalancePolicy, Rebalancer
from hetero_cs.planning.sampling import LOOK_COST_S, MAX_LOOK_INTERVAL_STEPS, MAX_TIMING_INTERVAL_STEPS, TIMING_COST_S
from hetero_cs.planning.sampling import interval_steps
from hetero_cs.planning._curves import _checked_caps


class Balancer(GuardTrials, MemoryRecovery, OtherPlans):
    """Chooses, serves, watches and re-plans the per-replica split of every global batch.

    Args:
        num_replicas: R >= 1.
        auto_balance: Solve the split from cost models (True) or split evenly (False); ignored with ``shares``.
        rebalance: Re-plan from measured step times (only with auto_balance).
        shares: Fixed relative shares per replica (validated by the caller), or None.
        guard: Keep a calibrated or re-planned split only if it measured faster than the one it replaces (only
            with auto_balance). See :mod:`hetero_cs.planning.guard`.
        rebalance_policy: The re-balancer's policy; None for the defaults. The balancer itself looks only every
            few steps when steps are short (``LOOK_COST_S``).
        guard_policy: The guard's policy; None for the defaults.
        on_plan: Called with the new plan (under the lock) whenever the plan in force for the reference size
            changes; e.g. to publish it to a graph cache.
        memory_policy: How memory caps fall after an out-of-memory step and grow back (:meth:`recover_from_oom`);
            None for the defaults.
        idle_replicas_free: The engine runs nothing for a replica with 0 examples (central storage does): the cost
            models are taken as :class:`~hetero_cs.planning.cost_model.IdleFreeCostModel` (``t(0) = 0``), and plans
            and re-plans leave a card out wherever that is predicted faster. False (the multi-worker engine): every
            replica pays its fixed cost, and solved plans give every replica at least one example when B >= R.
        on_trial: Called with the candidate (under the lock) when a guard trial starts, before it is served.
        idle_prober: How the engine probes cards the plan leaves idle off the step's path: called (under the lock)
            with the replica ids due a probe, it starts a timed step of one example on each, beside training and
            changing nothing, whose times come back through :meth:`record_probe`; it returns False when it cannot
            (then the step served gives each of them one example). None: the steps probe them
            (:mod:`hetero_cs.planning.balancer_plans`).

    Examples:
        >>> from hetero_cs.planning.cost_model import LinearCostModel
        >>> balancer = Balancer(2, auto_balance=True, rebalance=False, guard=False)
        >>> balancer.serve(100).per_replica_batch_sizes            # no cost models yet: even
        (50, 50)
        >>> balancer.set_cost_models([LinearCostModel(0.0, 1e-3), LinearCostModel(0.0, 3e-3)])
        >>> balancer.plan.per_replica_batch_sizes
        (75, 25)
    """

    def __init__(self, num_replicas: int, *, auto_balance: bool = True, rebalance: bool = True,
                 shares: Sequence[float] | None = None, guard: bool = True,
                 rebalance_policy: RebalancePolicy | None = None, guard_policy: GuardPolicy | None = None,
                 on_plan: Callable[[BatchPlan], None] | None = None, memory_policy: MemoryRecoveryPolicy | None = None,
                 idle_replicas_free: bool = False, on_trial: Callable[[BatchPlan], None] | None = None,
                 idle_prober: Callable[[Sequence[int]], bool] | None = None):
        self._memory = MemoryCaps(num_replicas, memory_policy)  # (ConfigError unless num_replicas is an int >= 1)
        self._num_replicas = num_replicas
        self._lock = threading.RLock()
        self._shares = None if shares is None else tuple(float(s) for s in shares)
        self._auto_balance, self._rebalance, self._guard_enabled = bool(auto_balance), bool(rebalance), bool(guard)
        # An engine that runs nothing for an idle replica (central storage): 0 examples cost 0 s, so solved plans
        # and re-plans leave a card out wherever that is predicted faster (IdleFreeCostModel).
        self._idle_free = bool(idle_replicas_free)
        self._rebalance_policy = rebalance_policy or RebalancePolicy(min_batch_size=0 if self._idle_free else 1)
        self._rebalance_policy_given = rebalance_policy is not None
        self._on_plan, self._on_trial, self._idle_prober = on_plan, on_trial, idle_prober
        self._calibrated_models: list[CostModel] | None = None
        self._cost_models: list[CostModel] | None = None
        self._max_batch_sizes: list[int | None] | None = None
        self._plan: BatchPlan | None = None
        self._plans_by_batch: dict[int, BatchPlan] = {}
        # The plan in force for every reference size seen under the current models: a verdict of the guard (kept or
        # reverted) for one input survives an input of another size in between (e.g. a validation set).
        self._in_force_by_size: dict[int, BatchPlan] = {}
        self._reference_batch_size: int | None = None
        self._monitor = StepTimeMonitor(num_replicas)
        self._rebalancer = Rebalancer(self._rebalance_policy)
        self._guard = PlanGuard(guard_policy)
        self._served = 0  # global batches served: steady-state timing picks every N-th
        self._last_worked: dict[int, int] = {}  # probes: replica -> the served count when it last had examples
        self._probe_due = False  # the batch just served is a probe: time it
        self._last_served: BatchPlan | None = None  # the training plan the last serve returned
        self._again: BatchPlan | None = None  # served next, as it is (serve_again)
        self._probes = 0
        self._alone_checked: set[tuple[int, ...]] = set()  # splits in force checked against the card alone
        self._contention_factors = [1.0] * num_replicas  # set_cost_models: each card beside the others
        self._micro_rebalancer: Rebalancer | None = None  # the watch over micro-batched steps (balancer_memory)
        self._micro_rebalancer_caps: list | None = None
        self._micro_replans = 0
        self._auto_plan: BatchPlan | None = None  # the auto-balanced plan in force when fixed shares were set
        self._trial_on_first_batch = False  # set_cost_models(trial=True) before the reference size was known
        self._handled_steps = 0
        self._models_before_replan: list[CostModel] | None = None  # restored when the guard reverts a re-plan
        self._last_looks = {"plan": -(10**9), "micro": -(10**9)}  # the completed steps at the last looks
        self._observed_step = -1  # the last monitor step fed to the guard
        self._trial_served = 0
        # plan_for_inference's plans by size, until what they were solved under changes (_forget_plans, _commit).
        self._inference_plans: dict[int, BatchPlan] = {}

    # ------------------------------------------------------------------------------------------------------------
    # State
    # ------------------------------------------------------------------------------------------------------------
    @property
    def num_replicas(self) -> int:
        """R, the number of replicas."""
        return self._num_replicas

    @property
    def plan(self) -> BatchPlan | None:
        """The plan in force for the reference (full) global batch; None before the first global batch is seen.

        During a guard trial this is the incumbent; the candidate becomes the plan only when the guard keeps it."""
        return self._plan

    @property
    def shares(self) -> tuple[float, ...] | None:
        """The fixed relative shares, or None."""
        return self._shares

    @property
    def auto_balance(self) -> bool:
        """True when the split is solved from cost models (no fixed shares)."""
        return self._auto_balance and self._shares is None

    @property
    def rebalance_enabled(self) -> bool:
        """True when measured step times may change the plan during training."""
        return self._rebalance and self.auto_balance

    @property
    def guard_enabled(self) -> bool:
        """True when a new auto-balanced plan must measure faster before it is kept."""
        return self._guard_enabled and self.auto_balance

    @property
    def timing_needed(self) -> bool:
        """True when this balancer uses measured step times at all (re-balancing or the guard)."""
        return self.rebalance_enabled or self.guard_enabled

    @property
    def monitor(self) -> StepTimeMonitor:
        """The per-replica step-time statistics."""
        return self._monitor

    @property
    def rebalancer(self) -> Rebalancer:
        """The re-balancer (its ``last_decision`` and ``switches`` say what it did)."""
        return self._rebalancer

    @property
    def guard(self) -> PlanGuard:
        """The guard (``in_trial``, ``candidate``, ``last_decision``)."""
        return self._guard

    @property
    def last_guard_decision(self) -> GuardDecision | None:
        """The guard's last decision, or None before the first."""
        return self._guard.last_decision

    @property
    def cost_models(self) -> list[CostModel] | None:
        """Per-replica cost models behind the plan (calibrated, then updated online), or None."""
        return None if self._cost_models is None else [without_idle_pricing(m) for m in self._cost_models]

    @property
    def calibrated_models(self) -> list[CostModel] | None:
        """The cost models as calibrated or set, before online updates; None before either."""
        return None if self._calibrated_models is None else [without_idle_pricing(m) for m in self._calibrated_models]

    @property
    def max_batch_sizes(self) -> list[int | None] | None:
        """Per-replica memory caps in examples (None entries: uncapped), or None."""
        return None if self._max_batch_sizes is None else list(self._max_batch_sizes)

    @property
    def reference_batch_size(self) -> int | None:
        """The largest global batch seen since the input started, whose plan is :attr:`plan`."""
        return self._reference_batch_size

    # ------------------------------------------------------------------------------------------------------------
    # Changing the models or the split
    # ------------------------------------------------------------------------------------------------------------
    @property
    def idle_replicas_free(self) -> bool:
        """True when the engine runs nothing for a replica with 0 examples, so plans may leave cards out."""
        return self._idle_free

    def set_idle_replicas_free(self, free: bool) -> None:
        """Tells the Balancer whether the engine now runs nothing for a replica with 0 examples.

        The multi-worker engine knows it only once it has the model (a replica skips its forward and backward pass
        where the model allows it: :mod:`hetero_cs.engine.step.idle_replicas`). Cost models set already are priced
        again (0 examples cost 0 s, or their fixed cost) and the plan is solved again at once; the
        default re-balance policy's smallest slice follows (0, or 1).

        Raises:
            ConfigError: As :meth:`set_cost_models`, when the models set cannot be priced again.
        """
        free = bool(free)
        with self._lock:
            if free == self._idle_free:
                return
            self._idle_free = free
            if not self._rebalance_policy_given:
                self._rebalance_policy = dataclasses.replace(self._rebalance_policy, min_batch_size=0 if free else 1)
                self._rebalancer = Rebalancer(self._rebalance_policy, max_batch_sizes=self._max_batch_sizes)
            if self._cost_models is not None:
                self._set_models_again(self._max_batch_sizes)

    def set_max_batch_sizes(self, max_batch_sizes: Sequence[int | None] | None) -> None:
        """Sets the per-replica memory caps (examples per step, None entries: uncapped) without new cost models.

        For an engine that learns the caps before it has cost models (the multi-worker strategy, which calibrates
        during training): the even split, fixed shares and probe splits are moved within them from the next plan
        on. With cost models set, they are solved again under the caps at once (no guard trial).

        Raises:
            ConfigError: Not one cap per replica, or a cap that is not an integer >= 0 or None.
            InfeasiblePlanError: With cost models set, the caps cannot hold the reference global batch.
        """
        caps = None if max_batch_sizes is None else _checked_caps(list(max_batch_sizes), self._num_replicas, 0)
        with self._lock:
            if self._cost_models is not None:
                self._set_models_again(caps)
                return
            self._memory.reset(caps)
            # A replica set aside after a device failure keeps its cap of 0.
            self._apply_memory_caps(self._memory.caps if self._memory.excluded else caps)

    def _set_models_again(self, max_batch_sizes: list[int | None] | None) -> None:
        """The models in force priced again and solved again under ``max_batch_sizes``, at once (no guard trial)."""
        self.set_cost_models([without_idle_pricing(m) for m in self._cost_models], max_batch_sizes=max_batch_sizes,
                             reference_batch_size=self._reference_batch_size, trial=False,
                             contention_factors=self._contention_factors)

    def set_cost_models(self, cost_models: Sequence[CostModel], *, max_batch_sizes: Sequence[int | None] | None = None,
                        trial: bool = False, reference_batch_size: int | None = None,
                        contention_factors: Sequence[float] | None = None) -> None:
        """Replaces the per-replica cost models (and memory caps) and re-solves the plan.

        Args:
            cost_models: One per replica, in replica-id order.
            max_batch_sizes: Per-replica caps in examples (None entries: uncapped), shape [R], or None.
            trial: With the guard on, try the solved plan against the plan in force before keeping it
                (calibration results); False commits it at once (models a user set on purpose).
            reference_batch_size: The full global batch size, if known before the first batch is served.
            contention_factors: Per replica, >= 1: how much slower its step runs beside the other cards than
                alone, already in ``cost_models`` (calibration's concurrent probe); a card's time alone is its
                model's over its factor (:meth:`fastest_alone_plan`). None: 1.0 each.

        Raises:
            ConfigError: Wrong number of cost models or caps.
            InvalidCostModelError: A model predicts NaN, a negative time or a decreasing curve.
            InfeasiblePlanError: The caps cannot hold the reference global batch.
        """
        if cost_models is None or isinstance(cost_models, (str, bytes)) or not hasattr(cost_models, "__iter__"):
            raise ConfigError(f"cost_models must be a sequence of one cost model per replica. Received: "
                              f"cost_models={cost_models!r}.")
        models = list(cost_models)
        R = self._num_replicas
        if len(models) != R:
            raise ConfigError(
                f"Need one cost model per replica: got {len(models)} for R={R}. Pass them in replica-id order.")
        caps = None if max_batch_sizes is None else _checked_caps(max_batch_sizes, R, 0)
        if excluded := self._memory.excluded:  # cards whose device failed stay out (cap 0) with new models
            caps = [0 if i in excluded else cap for i, cap in enumerate(caps or [None] * R)]
        if reference_batch_size is not None:
            check_range("reference_batch_size", reference_batch_size, 1, integer=True,
                        hint="the full global batch, or None")
        for i, model in enumerate(models):
            check_cost_model(model, [0, 1], replica_id=i)
        if self._idle_free:
            models = idle_free(models)
        factors = [1.0] * R if contention_factors is None else [float(f) for f in contention_factors]
        if len(factors) != R or not all(1.0 <= f < math.inf for f in factors):
            raise ConfigError(f"contention_factors must hold one finite number >= 1 per replica (R={R}). "
                              f"Received: contention_factors={contention_factors!r}.")
        with self._lock:
            # Solve with the new models before changing anything, so a failure leaves everything as it was.
            B = self._reference_batch_size
            B = B if reference_batch_size is None else max(B or 0, int(reference_batch_size))
            plan = None if B is None else self._solve(B, cost_models=models, max_batch_sizes=caps, log_ties=True)
            self._calibrated_models, self._cost_models = list(models), list(models)
            self._contention_factors, self._reference_batch_size = factors, B
            self._memory.reset(caps)
            self._apply_memory_caps(caps)
            self._alone_checked.clear()  # new cost models: every plan may be checked again
            self._trial_on_first_batch = trial if plan is None else False  # else solved when the first batch arrives
            if plan is not None:
                self._adopt(plan, trial=trial)

    def start_new_input(self) -> None:
        """A new input's first global batch sets the reference size of :attr:`plan` again."""
        with self._lock:
            self._reference_batch_size = None

    # ------------------------------------------------------------------------------------------------------------
    # Serving and watching
    # ------------------------------------------------------------------------------------------------------------
    def plan_for(self, global_batch_size: int) -> BatchPlan:
        """The plan in force for a global batch of ``global_batch_size`` examples (solved once, then cached).

        The largest size seen becomes the reference whose plan is :attr:`plan`; a last partial batch ``B' < B``
        gets a plan solved for ``B'``. It does not advance a guard trial (see :meth:`serve`), but a size larger than
        the reference becomes the new reference, as when an input's first batch arrives.

        Raises:
            ConfigError: ``global_batch_size`` is not an integer >= 1.
        """
        b = _checked_global_batch_size(global_batch_size, allow_zero=False)
        with self._lock:
            self._reference_batch_size = max(self._reference_batch_size or 0, b)  # the largest size seen
            plan = self._plans_by_batch.get(b)
            if plan is None:
                plan = self._solve(b)
                if b == self._reference_batch_size and b in self._in_force_by_size:
                    plan = self._in_force_by_size[b]  # the plan in force (a guarded one may differ from a solve)
                self._plans_by_batch[b] = plan
            if b == self._reference_batch_size and plan is not self._plan:
                if self._trial_on_first_batch and self.guard_enabled:
                    self._trial_on_first_batch = False
                    self._adopt(plan, trial=True)
                    return self._plans_by_batch[b]
                self._commit(plan)
            return plan

    def serve(self, global_batch_size: int, *, training: bool = True) -> BatchPlan:
        """The plan to cut the next global batch of ``global_batch_size`` examples with.

        Called once per global batch, when its step starts. For a training batch it first
        processes the steps measured since the last call (guard trial, re-balancing), then returns the plan in
        force - or, during a guard trial, the candidate or the incumbent by the trial's pattern. An evaluation or
        prediction batch (``training=False``) gets :meth:`plan_for_inference` and changes nothing of training's
        plans.

        Raises:
            ConfigError: ``global_batch_size`` is not an integer >= 1.
            InfeasiblePlanError: From re-planning, if no split satisfies the caps.
        """
        if not training:
            return self.plan_for_inference(global_batch_size)
        b = _checked_global_batch_size(global_batch_size, allow_zero=False)
        with self._lock:
            again, self._again = self._again, None
            if again is not None and again.global_batch_size == b:
                return again
            self._served += 1
            if self.timing_needed:
                self._process_measurements()
            plan = self.plan_for(b)
            if self._guard.in_trial and b == self._guard.candidate.global_batch_size:
                plan = self._serve_trial()
            elif b == self._reference_batch_size and plan is self._plan:
                plan = self._maybe_probe(plan)  # the plan in force for a full batch: now and then a probe of it
            self._last_served = plan
            return plan

    def step_traced_again(self) -> None:
        """Called before the first step of a training step function traced again: the steps measured so far are
        fed to a running guard trial first, then each of its plans' next step is a warm-up (PlanGuard.warm_up_again)."""
        with self._lock:
            self._process_measurements()
            self._guard.warm_up_again()

    def record_step_time(self, replica_id: int, batch_size: int, step_time_s: float, *,
                         step_key: Hashable | None = None, idle_replicas: Sequence[int] = ()) -> None:
        """One replica's measured step, keyed by its step when ``step_key`` is given, with the reports of the
        replicas it left idle (see StepTimeMonitor.record)."""
        self._monitor.record(replica_id, batch_size, step_time_s, step_key=step_key, idle_replicas=idle_replicas)

    def record_probe(self, replica_id: int, batch_size: int, step_time_s: float) -> None:
        """A probe of an idle replica, timed off the step's path (``idle_prober``; StepTimeMonitor.record_probe)."""
        self._monitor.record_probe(replica_id, batch_size, step_time_s)

    def timing_due(self) -> bool:
        """Whether the step just served should be timed: always while a trial or the re-balancer needs samples.

        In steady state, one served batch in :meth:`timing_interval_steps`; an engine reads this once per served
        batch, right after :meth:`serve`, for the step that batch runs in."""
        with self._lock:
            if not self.timing_needed:
                return False
            probe, self._probe_due = self._probe_due, False  # the step just served gives a left-out card one example
            return self.samples_needed() or probe or self._served % self.timing_interval_steps() == 0

    def samples_needed(self) -> bool:
        """True while a decision waits for every step's times: a guard trial runs, or the monitor's window holds
        fewer than the re-balancer's ``min_samples`` steps (and something uses timing at all)."""
        with self._lock:
            return self.timing_needed and (
                self._guard.in_trial or self._monitor.num_samples < self._rebalance_policy.min_samples)

    def timing_interval_steps(self) -> int:
        """How many steps per timed step in steady state: the smallest N with TIMING_COST_S / N <= 1 % of the
        last measured makespan, in [1, MAX_TIMING_INTERVAL_STEPS]; 1 until a step was measured."""
        sample = self._monitor.last_step()
        return interval_steps(TIMING_COST_S, sample and sample.makespan_s, MAX_TIMING_INTERVAL_STEPS)

    def _look_due(self, kind: str) -> bool:
        """Whether a look of ``kind`` ("plan": re-plan or check against the card alone; "micro": micro-batched
        steps) is due, ``interval_steps(LOOK_COST_S, ...)`` steps after the last; it then counts as taken."""
        completed, sample = self._monitor.completed_steps, self._monitor.last_step()
        if completed - self._last_looks[kind] < interval_steps(LOOK_COST_S, sample and sample.makespan_s,
                                                               MAX_LOOK_INTERVAL_STEPS):
            return False
        self._last_looks[kind] = completed
        return True

    # ------------------------------------------------------------------------------------------------------------
    # Internals (called with the lock held)
    # ------------------------------------------------------------------------------------------------------------
    def _solve(self, global_batch_size: int, **given) -> BatchPlan:
        """``choose_plan`` under the shares, models and caps in force, or the ``given`` ones (its keywords); a tie is
        logged at INFO for the reference size (not a last partial batch)."""
        arguments = dict(shares=self._shares, auto_balance=self._auto_balance, cost_models=self._cost_models,
                         max_batch_sizes=self._max_batch_sizes, idle_free=self._idle_free,
                         log_ties=self._reference_batch_size in (None, global_batch_size))
        return choose_plan(global_batch_size, self._num_replicas, **{**arguments, **given})

    def _forget_plans(self) -> None:
        """What the plans were solved under changed: a running trial ends and every size is solved again."""
        self._guard.abandon()
        self._models_before_replan = None
        self._plans_by_batch.clear()
        self._in_force_by_size.clear()
        self._inference_plans.clear()

    def _commit(self, plan: BatchPlan) -> None:
        changed = plan != self._plan
        self._plan, self._again = plan, None  # a retry after a plan change runs the new plan (serve_again)
        self._inference_plans.clear()  # (also when the models behind an equal plan changed: a refuted re-plan)
        # Plans for other (partial-batch) sizes came from the same models only if this plan did: dropped.
        self._plans_by_batch = {plan.global_batch_size: plan}
        self._in_force_by_size[plan.global_batch_size] = plan
        if changed and self._on_plan is not None:
            self._on_plan(plan)

    def _process_measurements(self) -> None:
        """Feeds the steps measured since the last call to the guard, then lets the re-balancer look."""
        completed = self._monitor.completed_steps
        if completed <= self._handled_steps:
            return
        self._handled_steps = completed
        if self._guard.in_trial:
            self._observe_trial(completed)
            return
        if not self._look_due("plan"):
            return
        new_plan = None
        if (self.rebalance_enabled and self._plan is not None and self._cost_models is not None
                and (not self.guard_enabled or self._guard.may_start(completed))):
            new_plan = self._rebalancer.propose_from_monitor(
                self._monitor, self._plan, base_models=self._calibrated_models)
        if new_plan is None:  # a drifting card is re-planned first; then the plan in force vs the card alone
            self._maybe_check_alone()
            return
        forced = self._rebalancer.last_decision is not None and self._rebalancer.last_decision.forced
        self._forget_plans()  # (no trial runs here)
        self._models_before_replan = None if forced else self._cost_models
        self._cost_models = self._monitor.updated_cost_models(self._calibrated_models)
        self._adopt(new_plan, trial=not forced)

