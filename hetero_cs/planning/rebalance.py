"""When to re-plan the batch split during training: deadband and cooldown (pure).

The policy compares, under the same up-to-date per-replica cost models (from ``StepTimeMonitor``), the predicted
makespan of the plan in use with that of the optimal plan, and switches only when

* the predicted relative gain (current - new) / current exceeds ``deadband`` - also in the worst case within
  ``noise_sigmas`` standard errors of each replica's estimated speed (``StepTimeMonitor.relative_standard_errors``),
* at least ``cooldown_steps`` steps have passed since the last switch,
* the window holds at least ``min_samples`` steps, and
* the new split differs from the current one.

Why the noise margin. A deadband on the point estimate alone does not stop oscillation: the current plan's
predicted makespan is the *largest* of R noisy per-replica estimates, while the re-solved plan equalises them, so
noise alone predicts a gain of about max_i e_i - mean_i e_i. With 10 % uniform timing noise a 16-step window median
is off by ~2.5 % per replica, and in simulation (R = 2-4, 300 steps) the point-estimate rule re-planned 2-10 times
on steady devices and cycled A -> B -> A in 10 of 400 runs. Evaluating the current plan at levels (1 - z u_i) and
the new one at (1 + z u_i), z = 1.5, left no cycle in 1,400 runs and at most one switch after the initial
correction in all but 2, while a device slowed 2x still lost work 9-10 steps after the change (half the window)
in 98 % of 500 runs, and after at most 15. z = 2 made recovery from a slowdown sluggish (for R = 4 the gain of
moving work back is only ~10 %); z = 1 cycled again.

The property tests check this through ``hetero_cs.planning.simulation.simulate_training`` (noisy steady devices: the initial correction plus at
most one refinement, never A -> B -> A; a device slowed 2x: work moves off it within min_samples + window / 2
steps, and the plan ends within 10 % of the optimum after it recovers).

A plan that violates a memory cap is replaced at once, regardless of deadband and cooldown.

This module is pure: it imports neither TensorFlow nor pynvml.
"""

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence

from hetero_cs.planning.choice import _violates
from hetero_cs.planning.cost_model import CostModel
from hetero_cs.errors import ConfigError
from hetero_cs.planning.monitor import StepTimeMonitor
from hetero_cs.planning.plan import BatchPlan, _is_int, check_range
from hetero_cs.planning.solver import solve_batch_split

logger = logging.getLogger(__name__)

REPLANNED = "replanned"
COOLDOWN = "cooldown"
TOO_FEW_SAMPLES = "too_few_samples"
BELOW_DEADBAND = "below_deadband"
BALANCED = "balanced"
UNCHANGED = "unchanged"
WITHIN_NOISE = "within_noise"
NOT_DUE = "not_due"

# Lower bound of a level factor 1 - noise_sigmas * u when u is so large that the factor would not be positive.
_MIN_LEVEL_FACTOR = 1e-6


@dataclasses.dataclass(frozen=True)
class RebalancePolicy:
    """How eagerly to re-plan during training.

    Attributes:
        deadband: In [0, 1). Minimum predicted relative makespan gain, (current - new) / current, for a switch.
            0.05 means the new plan must be predicted more than 5 % faster per step.
        cooldown_steps: >= 0. Steps after a switch before another is considered; lets the window fill with
            samples taken under the new plan.
        min_samples: >= 1. Complete steps the monitor's window must hold before any decision.
        multiple_of: >= 1. Every slice of a new plan is a multiple of this (passed to the solver).
        min_batch_size: >= 0. Smallest slice of a new plan (passed to the solver); 0 lets a replica sit out. A
            global batch B < R * min_batch_size is re-planned with B // R instead (some replicas then sit out).
        noise_sigmas: >= 0. When the caller passes each replica's relative standard error u_i (from
            ``StepTimeMonitor.relative_standard_errors``), the gain must exceed the deadband even in the worst
            case within noise_sigmas standard errors: the current plan is evaluated with every replica's level
            scaled by (1 - noise_sigmas * u_i), the new plan with (1 + noise_sigmas * u_i). 0 disables this.
        check_interval_steps: >= 1. When > 1, after a look at step s, calls before step s + check_interval_steps
            return at once (outcome "not_due"); 1 looks at every call. A look fits the monitor's models and solves
            a split: about 0.4 ms of host CPU for R = 3, which is 8 % of a 5 ms step but nothing beside a 100 ms one. Looking every k steps
            delays a reaction by at most k - 1 steps. A memory-cap violation is acted on at any call.

    Raises:
        ConfigError: If a field is out of range or of the wrong type.
    """

    deadband: float = 0.05
    cooldown_steps: int = 20
    min_samples: int = 5
    multiple_of: int = 1
    min_batch_size: int = 1
    noise_sigmas: float = 1.5
    check_interval_steps: int = 1

    def __post_init__(self) -> None:
        check_range("deadband", self.deadband, 0, 1, hint="a relative makespan gain; 0.05 = 5 %")
        check_range("noise_sigmas", self.noise_sigmas, 0, hint="standard errors; the default is 1.5")
        for name, minimum in (("cooldown_steps", 0), ("min_samples", 1), ("multiple_of", 1), ("min_batch_size", 0),
                              ("check_interval_steps", 1)):
            check_range(name, getattr(self, name), minimum, integer=True)


@dataclasses.dataclass(frozen=True)
class RebalanceDecision:
    """What one ``Rebalancer.propose`` call decided, and why.

    Attributes:
        step: The step passed to ``propose``.
        outcome: One of "replanned", "cooldown", "too_few_samples", "below_deadband", "within_noise" (the
            point gain exceeds the deadband, its worst case within noise_sigmas standard errors does not),
            "unchanged" (the optimal split under the models is the current one), "not_due" (fewer than
            policy.check_interval_steps steps since the last look), "balanced" (every replica's predicted time
            under the current plan is within the deadband of the makespan, so no split can gain more than the
            deadband: not solved).
        old_per_replica_batch_sizes: The current plan's slices, shape [R].
        new_per_replica_batch_sizes: The optimal slices under the models, shape [R]; None when not solved
            (cooldown, too few samples, not due, balanced).
        current_makespan_s: The current plan's makespan predicted by the models; None when the models were not
            evaluated (cooldown, too few samples, not due).
        new_makespan_s: The optimal plan's predicted makespan; None when not solved.
        predicted_gain: (current_makespan_s - new_makespan_s) / current_makespan_s; None when not solved.
        worst_case_gain: The gain with the current plan evaluated at levels (1 - z u_i) and the new plan at
            (1 + z u_i) (z = policy.noise_sigmas, u_i the relative standard errors); equals predicted_gain when
            no errors were given; None when not solved. A switch needs worst_case_gain > deadband.
        forced: True when the current plan violated a memory cap, which overrides deadband and cooldown.
    """

    step: int
    outcome: str
    old_per_replica_batch_sizes: tuple[int, ...]
    new_per_replica_batch_sizes: tuple[int, ...] | None = None
    current_makespan_s: float | None = None
    new_makespan_s: float | None = None
    predicted_gain: float | None = None
    worst_case_gain: float | None = None
    forced: bool = False


class Rebalancer:
    """Decides, step by step, whether to switch to a better batch split.

    Not thread-safe: call it from the one thread that drives training. State: the step of the last switch, the
    last decision and the list of switches.

    Args:
        policy: Deadband, cooldown, minimum samples and slice constraints.
        max_batch_sizes: Per-replica memory caps in examples, shape [R] (a None entry: that replica has no cap);
            None means no cap. Every new plan respects them; a current plan that exceeds one is replaced at once.

    Raises:
        ConfigError: If policy is not a RebalancePolicy or a cap is negative.

    Examples:
        Calibration found two alike replicas; in training, replica 1 runs 1.2x slower:

        >>> from hetero_cs.planning.cost_model import LinearCostModel
        >>> from hetero_cs.planning.solver import plan_from_split
        >>> calibrated = [LinearCostModel(0.0, 0.001), LinearCostModel(0.0, 0.001)]
        >>> plan, monitor = plan_from_split([50, 50]), StepTimeMonitor(2)
        >>> rebalancer = Rebalancer(RebalancePolicy(deadband=0.05, cooldown_steps=20, min_samples=5))
        >>> for step in range(5):  # once per completed step, after every replica called monitor.record
        ...     monitor.record(0, 50, 0.050)
        ...     monitor.record(1, 50, 0.060)
        ...     plan = rebalancer.propose_from_monitor(monitor, plan, base_models=calibrated) or plan
        >>> plan.per_replica_batch_sizes  # 60 ms -> 55 ms, logged at INFO
        (55, 45)
    """

    def __init__(self, policy: RebalancePolicy | None = None, *, max_batch_sizes: Sequence[int | None] | None = None):
        policy = RebalancePolicy() if policy is None else policy
        if not isinstance(policy, RebalancePolicy):
            raise ConfigError(f"policy must be a RebalancePolicy. Received: policy={policy!r}.")
        if max_batch_sizes is not None:
            if any(m is not None and (not _is_int(m) or m < 0) for m in max_batch_sizes):
                raise ConfigError("max_batch_sizes must hold non-negative integers (examples per replica) or None (no "
                                  f"cap). Received: max_batch_sizes={list(max_batch_sizes)!r}.")
            max_batch_sizes = tuple(None if m is None else int(m) for m in max_batch_sizes)
        self._policy = policy
        self._max_batch_sizes = max_batch_sizes
        self._last_look_step: int | None = None
        self._last_step: int | None = None
        self._last_decision: RebalanceDecision | None = None
        self._switches: list[RebalanceDecision] = []

    @property
    def policy(self) -> RebalancePolicy:
        """The policy in use."""
        return self._policy

    @property
    def last_decision(self) -> RebalanceDecision | None:
        """The decision of the last ``propose`` call (None before the first)."""
        return self._last_decision

    @property
    def switches(self) -> tuple[RebalanceDecision, ...]:
        """Every decision that switched plans, oldest first (bounded in practice by the cooldown)."""
        return tuple(self._switches)

    def propose(self, step: int, current_plan: BatchPlan, cost_models: Sequence[CostModel], *,
                num_samples: int | None = None,
                relative_standard_errors: Sequence[float] | None = None) -> BatchPlan | None:
        """Returns a better plan for current_plan.global_batch_size, or None to keep the current one.

        Solves the optimal split under cost_models (``solve_batch_split`` with the policy's constraints and the
        caps), predicts the current split's makespan under the same models, and returns the new plan only if the
        predicted relative gain exceeds the deadband - also in the worst case within policy.noise_sigmas standard
        errors when relative_standard_errors is given -, the cooldown has passed and the split differs. A current
        split over a memory cap is replaced whatever the gain or cooldown. Each switch is logged at INFO.

        Args:
            step: Index of the training step (non-decreasing across calls), e.g. the number of steps completed.
            current_plan: The plan in use.
            cost_models: Up-to-date per-replica models, length R (``StepTimeMonitor.updated_cost_models``).
            num_samples: Complete steps in the monitor's window (``StepTimeMonitor.num_samples``); below
                policy.min_samples nothing is decided. None skips this check.
            relative_standard_errors: u_i >= 0 per replica, length R, the relative standard error of each
                model's level (``StepTimeMonitor.relative_standard_errors``); None treats the models as exact.

        Returns:
            The new BatchPlan (its predicted times are under cost_models), or None.

        Raises:
            ConfigError: If step is negative or earlier than a previous call's, cost_models, the errors or the caps
                do not have one entry per replica of current_plan, or an error is negative or not finite.
            InfeasiblePlanError: From the solver, if no split satisfies the caps and policy constraints (a global
                batch below R * policy.min_batch_size is not such a case: see RebalancePolicy.min_batch_size).
        """
        if len(cost_models) != len(current_plan.per_replica_batch_sizes):
            raise ConfigError(
                f"cost_models must hold one model per replica of current_plan. Received: "
                f"len(cost_models)={len(cost_models)}, current slices={list(current_plan.per_replica_batch_sizes)}.")
        return self._propose(step, current_plan, lambda: cost_models, lambda _: relative_standard_errors, num_samples)

    def propose_from_monitor(self, monitor: StepTimeMonitor, current_plan: BatchPlan, *,
                             base_models: Sequence[CostModel] | None = None) -> BatchPlan | None:
        """``propose`` with the step, sample count, cost models and their errors read from a monitor.

        The monitor's models are computed only when a decision is due (not during cooldown). This is the call to
        make once per completed step.

        Args:
            monitor: The monitor the replicas report to; step = monitor.completed_steps.
            current_plan: The plan in use.
            base_models: Calibrated per-replica models (length R), or None (see
                ``StepTimeMonitor.updated_cost_models``).

        Returns:
            The new BatchPlan, or None to keep the current one.

        Raises:
            ConfigError: As ``propose``, or if the monitor's replica count differs from current_plan's.
        """
        if monitor.num_replicas != len(current_plan.per_replica_batch_sizes):
            raise ConfigError("The monitor and current_plan disagree on the replica count. Received: "
                              f"monitor.num_replicas={monitor.num_replicas}, current "
                              f"slices={list(current_plan.per_replica_batch_sizes)}.")

        return self._propose(monitor.completed_steps, current_plan, lambda: monitor.updated_cost_models(base_models),
                             monitor.relative_standard_errors, monitor.num_samples)

    def _propose(self, step: int, current_plan: BatchPlan, get_models: Callable[[], Sequence[CostModel]],
                 get_errors: Callable[[Sequence[CostModel]], Sequence[float] | None],
                 num_samples: int | None) -> BatchPlan | None:
        if not _is_int(step) or step < 0:
            raise ConfigError(f"step must be a non-negative integer. Received: step={step!r}.")
        if self._last_step is not None and step < self._last_step:
            raise ConfigError(f"step must not decrease between calls. Received: step={step} after "
                              f"step={self._last_step}. Use a new Rebalancer when step counting restarts.")
        old_sizes = tuple(int(b) for b in current_plan.per_replica_batch_sizes)
        caps = self._max_batch_sizes
        if caps is not None and len(caps) != len(old_sizes):
            raise ConfigError("max_batch_sizes must hold one cap per replica of current_plan. Received: "
                              f"max_batch_sizes={list(caps)}, current slices={list(old_sizes)}.")
        self._last_step = int(step)
        forced = _violates(old_sizes, caps)
        if not forced:
            interval = self._policy.check_interval_steps
            if interval > 1 and self._last_look_step is not None and step - self._last_look_step < interval:
                self._last_decision = RebalanceDecision(step, NOT_DUE, old_sizes)
                return None
            self._last_look_step = int(step)
            if num_samples is not None and num_samples < self._policy.min_samples:
                self._last_decision = RebalanceDecision(step, TOO_FEW_SAMPLES, old_sizes)
                return None
            if self._switches and step - self._switches[-1].step < self._policy.cooldown_steps:
                self._last_decision = RebalanceDecision(step, COOLDOWN, old_sizes)
                return None

        cost_models = get_models()
        # Every replica counts, an idle one (b_i = 0) with t_i(0), as in plan_from_split and solve_batch_split.
        current_times_s = [float(m.predict_step_time_s(b)) for m, b in zip(cost_models, old_sizes)]
        current_s = max(current_times_s)
        deadband = float(self._policy.deadband)
        if not forced and 0 < current_s < math.inf and min(current_times_s) >= (1.0 - deadband) * current_s:
            # No split can gain more than the deadband: to finish a fraction g > deadband earlier, every replica
            # (each already within the deadband of the makespan) would have to shed examples, and the slices still
            # sum to B. So the decision is known without solving (which costs most of a look).
            self._last_decision = RebalanceDecision(step, BALANCED, old_sizes, current_makespan_s=current_s)
            return None
        if (errors := get_errors(cost_models)) is not None:
            errors = [float(u) for u in errors]
            if len(errors) != len(old_sizes) or not all(0 <= u < math.inf for u in errors):
                raise ConfigError(f"relative_standard_errors must hold one finite value >= 0 per replica. Received: "
                                  f"relative_standard_errors={errors}, num_replicas={len(old_sizes)}.")
        # A global batch smaller than R * min_batch_size is legal (a small B, or a last partial batch): the strategy
        # already cuts it with some replicas idle, so the re-planner lowers the smallest slice to B // R rather than
        # make it infeasible (B = 2 on R = 3 with the default min_batch_size=1 re-plans with 0).
        B = current_plan.global_batch_size
        new_plan = solve_batch_split(cost_models, B, max_batch_sizes=caps, multiple_of=self._policy.multiple_of,
                                     min_batch_size=min(self._policy.min_batch_size, B // len(old_sizes)))
        new_sizes = tuple(int(b) for b in new_plan.per_replica_batch_sizes)
        new_makespan_s = new_plan.predicted_makespan_s
        gain = _relative_gain(current_s, new_makespan_s)
        z = float(self._policy.noise_sigmas)  # (>= 0: the worst case is the point estimate without errors)
        worst_case_gain = gain if errors is None or not z > 0 or not any(u > 0 for u in errors) else _relative_gain(
            _makespan_s(old_sizes, cost_models, [max(1.0 - z * u, _MIN_LEVEL_FACTOR) for u in errors]),
            _makespan_s(new_sizes, cost_models, [1.0 + z * u for u in errors]))
        outcome = (UNCHANGED if new_sizes == old_sizes else REPLANNED if forced or worst_case_gain > deadband
                   else WITHIN_NOISE if gain > deadband else BELOW_DEADBAND)
        self._last_decision = decision = RebalanceDecision(
            step, outcome, old_sizes, new_sizes, current_s, new_makespan_s, gain, worst_case_gain, forced)
        if outcome != REPLANNED:
            return None
        self._switches.append(decision)
        logger.info("re-planned at step %d: %s -> %s, predicted makespan %.3f ms -> %.3f ms (gain %.1f %%)%s", step,
                    list(old_sizes), list(new_sizes), current_s * 1e3, new_makespan_s * 1e3, gain * 100,
                    " (the old plan exceeded a memory cap)" if forced else "")
        return new_plan


def _makespan_s(sizes: Sequence[int], cost_models: Sequence[CostModel], level_factors: Sequence[float]) -> float:
    """max_i f_i * t_i(b_i) in seconds: the split's makespan under the models, each level scaled by f_i.

    Every replica counts, an idle one (b_i = 0) with t_i(0), as in plan_from_split and solve_batch_split.
    """
    return max(f * float(m.predict_step_time_s(int(b))) for m, b, f in zip(cost_models, sizes, level_factors))


def _relative_gain(current_s: float, new_s: float) -> float:
    """(current - new) / current makespan; 0 when current is not a positive finite time."""
    return (current_s - new_s) / current_s if current_s > 0 and math.isfinite(current_s) else 0.0
