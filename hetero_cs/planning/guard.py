"""The measured guard: a new plan stays only if it measured faster than the plan it replaces (pure).

A solved plan is a prediction. Calibration taken while the host was busy, a cost model that extrapolates badly, or
a device that changed since the profile was cached can all predict a split that is in truth slower than the one it
replaces - and then balancing loses to the even split. The guard turns "predicted faster" into "measured faster":

1. **Trial.** When a candidate plan would replace the incumbent (auto-balance's first move away from the even
   split, or a re-plan), both are served in one repeating pattern of ``pattern`` global batches: the candidate
   everywhere but the last batch of each repetition, which goes to the incumbent (default ``"CCI"``). Each
   incumbent step is paired with the candidate step just before it, so a load change on the host hits both sides of
   a pair alike and cancels in their ratio. Both sides are measured over the same number of steps (the pairs); the
   extra candidate steps are steps in force, so a good candidate is in use from the trial's first step. The
   candidate's first measured step is not used: the first step at new slice sizes pays one-time costs (kernel
   selection and autotuning for new shapes, a step traced again for a new set of idle replicas) that are no part
   of the plan's speed - one such step measured the fastest card alone 5x slower than it runs.
2. **Decision.** With paired makespan ratios ``r_k = candidate_k / incumbent_k``:

   * early keep, from ``min_pairs`` pairs on: every ``r_k < 1 - early_gain`` (clearly faster in every pair);
   * early revert, from ``min_pairs`` pairs on: every ``r_k > 1`` and ``median(r) > 1 + early_gain``;
   * at ``max_pairs`` pairs: keep iff ``median(r) < 1 - min_gain`` and the one-sided Wilcoxon signed-rank test
     on ``log r`` gives ``p < significance`` (scipy.stats.wilcoxon); when the median shows the gain but the test
     does not yet (a host whose load changes from step to step leaves noise in every pair), measure on, up to
     ``2 * max_pairs`` pairs, and decide the same way there; otherwise revert.

   "Measurably faster" is therefore both an effect (``min_gain``) and evidence (``significance``); a tie reverts.
3. **Back-off.** After a revert no new trial starts for ``backoff_steps`` steps, doubling with every consecutive
   revert up to ``max_backoff_steps``; a keep resets it, and so does a revert that comes more than
   ``max_backoff_steps`` after the previous back-off ended.
4. **The fastest card alone.** A plan that spreads the batch over several cards is also a prediction that they
   beat the fastest of them alone. Where the plan in force measures slower than predicted, or slower than the
   fastest card's predicted time alone (:mod:`hetero_cs.planning.balancer_trials` says when exactly), the owner runs
   one more trial: the fastest card alone as the candidate, the plan in force as the incumbent
   (``start(..., against_alone=True)``). The burden of proof is the plan's, since the card alone is what the
   library promises never to be slower than: the trial decides by the rules of item 2 whether the plan in force is
   measurably faster than the card alone, and only then does the plan stay (reverted); otherwise, a tie included,
   the card alone is kept and the other cards sit idle. A revert here costs no back-off (the check refuted nothing
   that was proposed). A check still undecided after ``max_trial_steps`` steps (too few pairs: its plans' sizes
   were seldom observed) reverts, as a trial does: the plan in force stays, changed on no measurement.

Which plan a step ran with is read from the sizes the step reported (``StepSample.per_replica_batch_sizes``), not
from what was served, so batches cut before a switch (an engine that cuts ahead of the step) are attributed right;
a step whose sizes match neither plan (a last partial batch) is ignored.

This module is pure: it imports neither TensorFlow nor pynvml.
"""

import dataclasses
import logging
import math
import operator
from collections.abc import Sequence

import numpy as np

from hetero_cs.errors import ConfigError
from hetero_cs.planning.plan import BatchPlan, check_range

logger = logging.getLogger(__name__)

KEPT = "kept"
REVERTED = "reverted"


@dataclasses.dataclass(frozen=True)
class GuardPolicy:
    """How a candidate plan is measured against the incumbent.

    Attributes:
        pattern: The serving pattern of one repetition: ``"C"`` candidate, ``"I"`` incumbent; at least one of each,
            and every ``"I"`` must follow a ``"C"`` (it is paired with it). Default ``"CCI"``.
        min_pairs: >= 1. Pairs before an early decision may be taken.
        max_pairs: >= min_pairs. Pairs at which the trial decides by the test.
        early_gain: In (0, 1). Early keep needs every pair this much faster (0.1 = 10 %); early revert needs the
            median this much slower.
        min_gain: In [0, 1). The median paired ratio must be below 1 - min_gain to keep at max_pairs.
        significance: In (0, 1). The one-sided Wilcoxon p-value must be below this to keep at max_pairs.
        backoff_steps: >= 0. Steps after a revert before the next trial may start; doubles per consecutive revert.
        max_backoff_steps: >= backoff_steps. The back-off's ceiling.
        max_trial_steps: >= 1. A trial that has not decided after this many recorded steps (its plans' sizes were
            never observed, e.g. only partial batches) reverts.
        decisive_ratio: > 1. Pairs in which one plan took more than this many times the other's makespan decide
            at once, from the first pair on (no host hiccup is that large, and each further pair would repeat a step
            this slow: a card that drifted 50x slower, left out by the candidate).
        alone_check_margin: >= 0 (``math.inf`` allowed). The plan in force is measured against the fastest card
            alone (see item 4 above) when its measured makespan exceeds its prediction by more than this share (or
            by more than the measurement's noise, whichever is larger; 0.05 = 5 %, the prediction error of a good
            fit), or exceeds the card's predicted time alone. ``math.inf`` never measures it on this evidence.
        alone_check_below: >= 1 (``math.inf`` allowed). A plan in force predicted less than this many times faster
            than the fastest card alone (within that card's memory) is measured against it too, whatever it
            measures; 1.0 (the default) never on the prediction alone, ``math.inf`` always.

    Raises:
        ConfigError: If a field is out of range.
    """

    pattern: str = "CCI"
    min_pairs: int = 3
    max_pairs: int = 8
    early_gain: float = 0.10
    min_gain: float = 0.01
    significance: float = 0.05
    backoff_steps: int = 50
    max_backoff_steps: int = 800
    max_trial_steps: int = 200
    decisive_ratio: float = 4.0
    alone_check_margin: float = 0.05
    alone_check_below: float = 1.0

    def __post_init__(self) -> None:
        p = self.pattern
        if not isinstance(p, str) or set(p) - {"C", "I"} or "C" not in p or "I" not in p or p[0] == "I" or "II" in p:
            raise ConfigError("pattern must be a string of 'C' (candidate) and 'I' (incumbent), starting with 'C', "
                              f"with every 'I' right after a 'C'. Received: pattern={p!r}. Example: pattern='CCI'.")
        for name, low in (("min_pairs", 1), ("backoff_steps", 0), ("max_trial_steps", 1)):
            check_range(name, getattr(self, name), low, integer=True)
        check_range("max_pairs", self.max_pairs, self.min_pairs, integer=True, hint="at least min_pairs")
        check_range("max_backoff_steps", self.max_backoff_steps, self.backoff_steps, integer=True,
                    hint="at least backoff_steps")
        check_range("decisive_ratio", self.decisive_ratio, 1, low_open=True)
        check_range("alone_check_below", self.alone_check_below, 1, high_open=False, hint="1.0 never checks a plan on "
                    "its prediction alone, math.inf checks every plan")
        check_range("alone_check_margin", self.alone_check_margin, 0, high_open=False, hint="0.05 = 5 %; math.inf "
                    "never measures the plan against the fastest card alone on its measured speed")
        check_range("early_gain", self.early_gain, 0, 1, low_open=True)
        check_range("min_gain", self.min_gain, 0, 1)
        check_range("significance", self.significance, 0, 1, low_open=True)
        if 2.0 ** -(2 * self.max_pairs) >= self.significance:
            raise ConfigError(f"With max_pairs={self.max_pairs} no test can reach significance={self.significance} "
                              f"(the smallest one-sided p-value of {2 * self.max_pairs} pairs is "
                              f"{2.0 ** -(2 * self.max_pairs):.3g}). Raise max_pairs or significance.")
        if self.max_trial_steps < (needed := math.ceil(len(p) / p.count("I")) * 2 * self.max_pairs):
            raise ConfigError(
                f"max_trial_steps={self.max_trial_steps} cannot hold a trial of up to 2 x max_pairs={self.max_pairs} "
                f"pairs with pattern={p!r} ({needed} steps). Raise max_trial_steps to at least {needed}.")


@dataclasses.dataclass(frozen=True)
class GuardDecision:
    """The end of one trial.

    Attributes:
        step: The monitor's completed-step count when the trial decided.
        outcome: ``"kept"`` (the candidate is the plan from now on) or ``"reverted"`` (the incumbent stays).
        incumbent_per_replica_batch_sizes: The plan that was in force, shape [R].
        candidate_per_replica_batch_sizes: The plan that was tried, shape [R].
        num_pairs: Paired measurements the decision used.
        median_ratio: median of candidate / incumbent makespan over the pairs (< 1: the candidate was faster);
            NaN when there were no pairs.
        p_value: The one-sided Wilcoxon p-value when the test decided, else None (an early decision or no pairs);
            for a check against the fastest card alone, that of "the plan in force is faster than the card alone".
        reason: One line for the log.
        against_alone: True when the candidate was the fastest card alone, measured against the plan in force
            (a check of the plan, not a proposal: its revert causes no back-off).
        next_trial_step: After a revert of a proposed plan, the first step at which a new trial may start (the
            back-off); None otherwise.
    """

    step: int
    outcome: str
    incumbent_per_replica_batch_sizes: tuple[int, ...]
    candidate_per_replica_batch_sizes: tuple[int, ...]
    num_pairs: int
    median_ratio: float
    p_value: float | None
    reason: str
    against_alone: bool = False
    next_trial_step: int | None = None

    @property
    def kept(self) -> bool:
        """True when the candidate became the plan."""
        return self.outcome == KEPT


class PlanGuard:
    """Runs trials of candidate plans against the incumbent and decides from paired step makespans.

    Not thread-safe: the owner (``Balancer``) serialises calls.

    Args:
        policy: The trial's pattern, decision thresholds and back-off; None for the defaults.
        quiet: Log nothing (an owner that logs its trials in its own words).

    Examples:
        >>> from hetero_cs.planning.plan import BatchPlan
        >>> guard = PlanGuard()
        >>> even, solved = BatchPlan((50, 50), 100), BatchPlan((70, 30), 100)
        >>> guard.start(even, solved, step=0)
        >>> for k in range(12):  # steps as served: C C I C C I ...; each plan's first step is a warm-up
        ...     plan = guard.plan_to_serve()
        ...     makespan_s = 0.07 if plan is solved else 0.10
        ...     decision = guard.observe(plan.per_replica_batch_sizes, makespan_s, step=k)
        >>> decision.outcome, decision.num_pairs, round(decision.median_ratio, 2)
        ('kept', 3, 0.7)
    """

    def __init__(self, policy: GuardPolicy | None = None, *, quiet: bool = False):
        policy = GuardPolicy() if policy is None else policy
        if not isinstance(policy, GuardPolicy):
            raise ConfigError(f"policy must be a GuardPolicy. Received: policy={policy!r}.")
        self._policy = policy
        self._quiet = bool(quiet)
        self._trial: _Trial | None = None
        self._consecutive_reverts = 0
        self._blocked_until_step = -1
        self._decisions: list[GuardDecision] = []

    @property
    def policy(self) -> GuardPolicy:
        """The policy in use."""
        return self._policy

    @property
    def in_trial(self) -> bool:
        """True while a candidate is being measured."""
        return self._trial is not None

    @property
    def candidate(self) -> BatchPlan | None:
        """The plan being tried, else None."""
        return None if self._trial is None else self._trial.candidate

    @property
    def last_decision(self) -> GuardDecision | None:
        """The last trial's decision (None before the first)."""
        return self._decisions[-1] if self._decisions else None

    @property
    def decisions(self) -> tuple[GuardDecision, ...]:
        """Every decision so far, oldest first."""
        return tuple(self._decisions)

    @property
    def against_alone(self) -> bool:
        """True while the running trial measures the fastest card alone against the plan in force."""
        return self._trial is not None and self._trial.against_alone

    @property
    def observed_steps(self) -> int:
        """Measured steps the running trial has taken so far (0 outside a trial)."""
        return 0 if self._trial is None else self._trial.steps

    @property
    def num_reverts(self) -> int:
        """How many trials of a proposed plan ended in a revert so far."""
        return sum(1 for d in self._decisions if not d.kept and not d.against_alone)

    @property
    def num_pairs(self) -> int:
        """The paired steps the running trial measured so far (0 outside one)."""
        return 0 if self._trial is None else len(self._trial.ratios)

    def may_start(self, step: int) -> bool:
        """True when no trial runs and the back-off after the last revert has passed at ``step``."""
        return self._trial is None and step >= self._blocked_until_step

    def start(self, incumbent: BatchPlan, candidate: BatchPlan, *, step: int, against_alone: bool = False,
              incumbent_recent_s: float | None = None) -> None:
        """Begins a trial of ``candidate`` against ``incumbent`` (same global batch size, different slices).

        ``against_alone=True`` marks ``candidate`` as the fastest card alone, checked against the plan in force:
        the decision says so, and a revert starts no back-off. ``incumbent_recent_s``: the incumbent's makespan
        measured just before the trial (seconds), or None; the incumbent's first step in the trial is a warm-up
        when it is more than ``decisive_ratio`` times that, or when it is None.

        Raises:
            ConfigError: If the plans are for different global batch sizes or replica counts, or have equal slices.
        """
        if not isinstance(incumbent, BatchPlan) or not isinstance(candidate, BatchPlan):
            raise ConfigError(
                f"A trial compares two BatchPlans. Received: incumbent={incumbent!r}, candidate={candidate!r}.")
        old, new = incumbent.per_replica_batch_sizes, candidate.per_replica_batch_sizes
        if incumbent.global_batch_size != candidate.global_batch_size or len(old) != len(new) or old == new:
            raise ConfigError(f"A trial compares two different splits of one global batch. Received: incumbent="
                              f"{list(old)}, candidate={list(new)}.")
        self._trial = _Trial(incumbent, candidate, bool(against_alone),
                             None if incumbent_recent_s is None else float(incumbent_recent_s))
        (logger.debug if self._quiet else logger.info)(
            "guard: trying %s%s against %s from step %d (pattern %s, %d-%d pairs, up to %d while the gain is not yet "
            "significant)", list(new), " (the fastest card alone)" if against_alone else "", list(old), step,
            self._policy.pattern, self._policy.min_pairs, self._policy.max_pairs, 2 * self._policy.max_pairs)

    def plan_to_serve(self) -> BatchPlan | None:
        """The plan for the next full global batch the input pipeline cuts during a trial (None outside one)."""
        if (trial := self._trial) is None:
            return None
        letter = self._policy.pattern[trial.served % len(self._policy.pattern)]
        trial.served += 1
        return trial.candidate if letter == "C" else trial.incumbent

    def observe(self, per_replica_batch_sizes: Sequence[int], makespan_s: float, *, step: int) -> GuardDecision | None:
        """Takes one measured step; returns the decision when this step ends the trial, else None.

        Args:
            per_replica_batch_sizes: The slices the step ran with, shape [R].
            makespan_s: Its makespan in seconds (max over replicas), finite and > 0 to count.
            step: The monitor's completed-step count (for the decision's record and the back-off).

        Raises:
            ConfigError: ``per_replica_batch_sizes`` is not a sequence of integers or ``makespan_s`` not a number.
        """
        try:
            sizes = tuple(operator.index(b) for b in per_replica_batch_sizes)
            makespan_s = float(makespan_s)
        except TypeError:
            raise ConfigError(
                f"observe takes the step's slices (a sequence of integers) and its makespan in seconds (a number). "
                f"Received: per_replica_batch_sizes={per_replica_batch_sizes!r}, makespan_s={makespan_s!r}.") from None
        if (trial := self._trial) is None:
            return None
        trial.steps += 1
        usable = math.isfinite(makespan_s) and makespan_s > 0
        incumbent = usable and sizes == trial.incumbent.per_replica_batch_sizes
        if usable and sizes == trial.candidate.per_replica_batch_sizes:
            if trial.candidate_warm:
                trial.pending_candidate_s = makespan_s
            trial.candidate_warm = True
        elif incumbent and not trial.incumbent_warm and (
                trial.incumbent_recent_s is None
                or makespan_s > self._policy.decisive_ratio * trial.incumbent_recent_s):
            trial.incumbent_warm = True  # a warm-up: dropped, once
        elif incumbent and trial.pending_candidate_s is not None:
            trial.incumbent_warm = True
            trial.ratios.append(trial.pending_candidate_s / makespan_s)
            trial.pending_candidate_s = None
        decision = self._decide(step)
        return None if decision is None else self._finish(decision)

    def warm_up_again(self) -> None:
        """The training step was traced again (a new set of idle replicas, micro-batches): the next step of each
        plan of a running trial pays for it, so it is a warm-up again, not a sample, and a candidate step waiting
        for its incumbent is dropped. (A fit's retrace at an epoch's start once gave one pair a 0.03 ratio, which
        kept a plan "over 4x faster" that measured 1.01-1.10x faster.)"""
        if (trial := self._trial) is not None:
            trial.candidate_warm = trial.incumbent_warm = False
            trial.incumbent_recent_s = trial.pending_candidate_s = None

    def abandon(self) -> None:
        """Ends a trial without a decision (the plans it compared are obsolete, e.g. new cost models)."""
        self._trial = None

    def _decide(self, step: int) -> GuardDecision | None:
        trial = self._trial
        ratios = np.asarray(trial.ratios, dtype=np.float64)
        # Against the card alone the burden of proof is the plan's (item 4): decided as a trial of the plan in force
        # against the card alone, whose outcome is then turned round.
        decision = self._decide_ratios(step, 1.0 / ratios if trial.against_alone else ratios)
        if trial.against_alone and decision is not None:
            alone_stays = not decision.kept
            decision = dataclasses.replace(
                decision, outcome=KEPT if alone_stays else REVERTED, median_ratio=float(np.median(ratios)),
                reason=f"the plan in force was {decision.reason}{', so the card alone stays' if alone_stays else ''}")
        if decision is None and trial.steps >= self._policy.max_trial_steps:
            median = float(np.median(ratios)) if len(ratios) else math.nan
            return self._decision(step, REVERTED, median, None, f"only {len(ratios)} pairs in {trial.steps} steps")
        return decision

    def _decide_ratios(self, step: int, ratios: np.ndarray) -> GuardDecision | None:
        """Item 2's decision on the paired ratios ``ratios`` (candidate over incumbent), or None: measure on."""
        policy = self._policy
        n = len(ratios)
        median = float(np.median(ratios)) if n else math.nan
        if n and np.all(ratios < 1.0 / policy.decisive_ratio):
            return self._decision(step, KEPT, median, None, f"over {policy.decisive_ratio:g}x faster in every pair")
        if n and np.all(ratios > policy.decisive_ratio):
            return self._decision(step, REVERTED, median, None, f"over {policy.decisive_ratio:g}x slower in every pair")
        if n >= policy.min_pairs:
            if np.all(ratios < 1.0 - policy.early_gain):
                return self._decision(step, KEPT, median, None, f"faster in every one of {n} pairs")
            if np.all(ratios > 1.0) and median > 1.0 + policy.early_gain:
                return self._decision(step, REVERTED, median, None, f"slower in every one of {n} pairs")
        if n >= policy.max_pairs:
            from scipy import stats  # (imported the first time a trial goes as far as the test)

            # The one-sided Wilcoxon signed-rank p-value for "the log ratios are centred below 0".
            log_ratios = np.log(ratios)
            p_value = float(stats.wilcoxon(log_ratios, alternative="less").pvalue) if np.any(log_ratios != 0) else 1.0
            if median < 1.0 - policy.min_gain and p_value < policy.significance:
                return self._decision(step, KEPT, median, p_value, "measurably faster")
            if median < 1.0 - policy.min_gain and n < 2 * policy.max_pairs:
                return None  # faster on the median but not yet significant (a noisy host): measure up to twice as long
            small_gain = median < 1.0 and p_value < policy.significance  # faster, measurably, by too little
            why = f"faster by {1.0 - median:.1%}, below min_gain {policy.min_gain:.0%}" if small_gain else \
                "not measurably faster"
            return self._decision(step, REVERTED, median, p_value, why)
        return None

    def _decision(self, step: int, outcome: str, median: float, p_value: float | None, why: str) -> GuardDecision:
        trial = self._trial
        return GuardDecision(
            step=int(step), outcome=outcome, incumbent_per_replica_batch_sizes=trial.incumbent.per_replica_batch_sizes,
            candidate_per_replica_batch_sizes=trial.candidate.per_replica_batch_sizes, num_pairs=len(trial.ratios),
            median_ratio=median, p_value=p_value, reason=why, against_alone=trial.against_alone)

    def _finish(self, decision: GuardDecision) -> GuardDecision:
        policy = self._policy
        if decision.kept:
            self._consecutive_reverts = 0
        elif not decision.against_alone:  # (a plan in force that beat the fastest card alone refuted nothing)
            if decision.step - self._blocked_until_step > policy.max_backoff_steps:
                self._consecutive_reverts = 0  # the last revert is long past: start the back-off from the bottom
            backoff = min(policy.backoff_steps * 2 ** self._consecutive_reverts, policy.max_backoff_steps)
            self._consecutive_reverts += 1
            self._blocked_until_step = decision.step + backoff
            decision = dataclasses.replace(decision, next_trial_step=self._blocked_until_step)
        self._decisions.append(decision)
        p_text = "" if decision.p_value is None else f", p={decision.p_value:.3g}"
        after = "" if decision.next_trial_step is None else f"; no new trial before step {decision.next_trial_step}"
        (logger.debug if self._quiet else logger.info)(
            "guard: %s %s%s (vs %s): candidate/incumbent makespan %.3f over %d pairs%s - %s%s",
            decision.outcome, list(decision.candidate_per_replica_batch_sizes),
            " (the fastest card alone)" if decision.against_alone else "",
            list(decision.incumbent_per_replica_batch_sizes), decision.median_ratio, decision.num_pairs, p_text,
            decision.reason, after)
        self.abandon()
        return decision


@dataclasses.dataclass
class _Trial:
    """What one running trial has measured so far (:meth:`PlanGuard.start`)."""

    incumbent: BatchPlan
    candidate: BatchPlan
    against_alone: bool
    # The incumbent's makespan just before the trial (s), or None. The candidate's first measured step is a warm-up,
    # not a sample: a new set of idle replicas traces the step again, and the first run of each split pays for it
    # (graph set-up; with XLA per replica, the compilation of each new slice size, measured at 24x a step). So does
    # the incumbent's first step after that trace: it is one when it is far slower than the incumbent's steps just
    # before the trial (a plan in force that turned slow is slow before the trial too), or when none was measured
    # before it (a trial right after calibration).
    incumbent_recent_s: float | None
    served: int = 0  # batches served by the pattern
    steps: int = 0  # measured steps observed
    pending_candidate_s: float | None = None  # the last candidate makespan, waiting for its incumbent
    ratios: list[float] = dataclasses.field(default_factory=list)  # candidate / incumbent makespan per pair
    candidate_warm: bool = False
    incumbent_warm: bool = False
