"""The plan lifecycle with injected step times: guard, re-planning, common-mode load, serving (no TensorFlow)."""

import statistics

import pytest

from hetero_cs.errors import ConfigError, InvalidCostModelError
from hetero_cs.planning.balancer import Balancer
from hetero_cs.planning.cost_model import LinearCostModel, ScaledCostModel
from hetero_cs.planning.simulation import simulate_balancer
from hetero_cs.planning.solver import solve_batch_split

B = 2048
# A10 + T4 + P100-like curves: a fixed overhead and unlike per-example costs.
TRUE = [LinearCostModel(0.02, 1e-4), LinearCostModel(0.02, 4e-4), LinearCostModel(0.02, 3e-4)]
EVEN = (683, 683, 682)


def balanced(**kwargs):
    balancer = Balancer(3, **kwargs)
    balancer.set_cost_models(TRUE, trial=True, reference_batch_size=B)
    return balancer


def test_a_calibrated_plan_is_tried_against_the_even_split_and_kept_when_faster():
    balancer = balanced()
    assert balancer.plan.per_replica_batch_sizes == EVEN  # in force until the trial decides
    assert balancer.guard.in_trial
    trace = simulate_balancer(balancer, lambda step: TRUE, B, steps=30, relative_noise=0.02)
    solved = solve_batch_split(TRUE, B).per_replica_batch_sizes
    decision = balancer.last_guard_decision
    assert decision.kept and decision.candidate_per_replica_batch_sizes == solved
    assert balancer.plan.per_replica_batch_sizes == solved
    assert trace[0].per_replica_batch_sizes == solved  # the candidate is served from the trial's first batch
    assert all(s.per_replica_batch_sizes == solved for s in trace[15:])


def test_a_calibration_that_lies_is_reverted_to_the_even_split():
    """Calibrated on a busy host: the profile says replica 0 is fast, but the devices are in truth alike."""
    alike = [LinearCostModel(0.02, 2e-4)] * 3
    balancer = balanced()
    trace = simulate_balancer(balancer, lambda step: alike, B, steps=40, relative_noise=0.02)
    decision = balancer.last_guard_decision
    assert decision.outcome == "reverted" and decision.median_ratio > 1.2
    assert balancer.plan.per_replica_batch_sizes == EVEN
    # After the decision, every full batch runs the even split (no re-plan while the back-off lasts).
    assert all(s.per_replica_batch_sizes == EVEN for s in trace[decision.step + 3:])
    assert not balancer.rebalancer.switches


def test_guard_false_and_trial_false_commit_at_once():
    solved = solve_batch_split(TRUE, B).per_replica_batch_sizes
    unguarded = balanced(guard=False)
    assert unguarded.plan.per_replica_batch_sizes == solved and not unguarded.guard.in_trial
    user_set = Balancer(3)
    user_set.set_cost_models(TRUE, reference_batch_size=B)  # trial=False: models a user set on purpose
    assert user_set.plan.per_replica_batch_sizes == solved


def test_a_trial_waits_for_the_first_batch_when_the_size_is_not_known_yet():
    balancer = Balancer(3)
    balancer.set_cost_models(TRUE, trial=True)
    assert balancer.plan is None
    first = balancer.serve(B)
    assert balancer.guard.in_trial and balancer.plan.per_replica_batch_sizes == EVEN
    assert first.per_replica_batch_sizes == balancer.guard.candidate.per_replica_batch_sizes


def test_a_busy_host_alone_causes_no_replan():
    """Every step's load is shared by all replicas (lognormal sigma 0.3: steps 0.5x-2x as long); nothing moves."""
    balancer = balanced()
    simulate_balancer(balancer, lambda step: TRUE, B, steps=300, relative_noise=0.02, common_noise_sigma=0.3, seed=3)
    assert balancer.last_guard_decision.kept  # the initial move off the even split
    assert not balancer.rebalancer.switches


def test_a_device_that_slows_2x_loses_work_within_10_steps():
    balancer = balanced()
    slow_from = 100

    def true_at(step):
        return [TRUE[0], ScaledCostModel(TRUE[1], 2.0) if step >= slow_from else TRUE[1], TRUE[2]]

    trace = simulate_balancer(balancer, true_at, B, steps=160, relative_noise=0.05)
    optimum_s = solve_batch_split(true_at(slow_from), B).predicted_makespan_s
    # Recovered: the trailing median of 5 steps' true makespans is within 10 % of the new optimum, and stays.
    recovered = None
    for t in range(slow_from + 4, len(trace)):
        ok = statistics.median(s.true_makespan_s for s in trace[t - 4:t + 1]) <= 1.1 * optimum_s
        recovered = (t if recovered is None else recovered) if ok else None
    assert recovered is not None and recovered - slow_from <= 10
    assert balancer.last_guard_decision.kept
    assert balancer.plan.per_replica_batch_sizes[1] < solve_batch_split(TRUE, B).per_replica_batch_sizes[1]


def test_a_partial_last_batch_gets_its_own_plan_and_does_not_disturb_the_trial():
    balancer = balanced()
    partial = balancer.serve(100)
    assert sum(partial.per_replica_batch_sizes) == 100
    assert balancer.guard.in_trial and balancer.plan.global_batch_size == B


def test_an_inference_batch_larger_than_the_training_batch_leaves_training_plans_alone():
    """Regression (fit's validation_data batched larger than training): the validation size became the reference size,
    so training batches were then solved as partial batches, outside the guard's trial."""
    balancer = balanced()
    for _ in range(3):
        assert balancer.serve(B).global_batch_size == B
    candidate, incumbent = balancer.guard.candidate, balancer.plan
    validation = balancer.serve(4 * B, training=False)
    assert sum(validation.per_replica_batch_sizes) == 4 * B
    assert balancer.reference_batch_size == B and balancer.plan is incumbent
    assert balancer.guard.in_trial and balancer.guard.candidate is candidate
    served = [balancer.serve(B).per_replica_batch_sizes for _ in range(3)]  # the trial's pattern goes on
    assert set(served) <= {candidate.per_replica_batch_sizes, incumbent.per_replica_batch_sizes}
    assert balancer.serve(B, training=False) is balancer.plan  # the reference size: the plan in force


def test_an_inference_batch_is_split_without_the_training_caps_when_they_cannot_hold_it(caplog):
    """Regression: evaluate/predict batches were solved within the caps of a training step (InfeasiblePlanError)."""
    balancer = Balancer(3, rebalance=False, guard=False)
    balancer.set_cost_models(TRUE, max_batch_sizes=[100, 100, 100], reference_batch_size=240)
    within = balancer.serve(150, training=False)  # the caps hold it: within them
    assert sum(within.per_replica_batch_sizes) == 150 and max(within.per_replica_batch_sizes) <= 100
    with caplog.at_level("INFO", logger="hetero_cs"):
        above = balancer.serve(600, training=False)
    assert sum(above.per_replica_batch_sizes) == 600
    assert above.per_replica_batch_sizes == solve_batch_split(TRUE, 600).per_replica_batch_sizes
    assert any("without them" in r.getMessage() for r in caplog.records)
    assert balancer.plan.global_batch_size == 240 and balancer.reference_batch_size == 240
    assert balancer.serve(600, training=False) is above  # kept per size
    balancer.set_batch_split([1, 1, 1])  # the shares changed: solved again, by the shares
    assert balancer.serve(600, training=False).per_replica_batch_sizes == (200, 200, 200)


def test_timing_is_due_every_step_while_deciding_then_sampled():
    balancer = balanced()
    assert balancer.timing_due()  # a trial is running
    simulate_balancer(balancer, lambda step: TRUE, B, steps=40)
    assert not balancer.guard.in_trial
    # Steps of ~170 ms: timing costs far less than 1 % of a step, so every step stays timed.
    assert balancer.timing_interval_steps() == 1
    short = [LinearCostModel(0.001, 1e-6)] * 3
    quick = Balancer(3, guard=False)
    quick.set_cost_models(short, reference_batch_size=B)
    simulate_balancer(quick, lambda step: short, B, steps=20)
    assert quick.timing_interval_steps() > 1  # ~2.4 ms steps: time one in a few


def test_serve_again_repeats_the_plan_served_last_and_takes_no_turn_of_a_trial():
    plain, again = balanced(), balanced()
    assert plain.guard.in_trial
    served = [plain.serve(B) for _ in range(4)]
    first = again.serve(B)
    again.serve_again()  # a retry of the same batch after a device error
    assert again.serve(B) is first
    assert [first, *(again.serve(B) for _ in range(3))] == served  # the trial's turns go on as without the retry
    again.serve_again()
    assert again.serve(B // 2).global_batch_size == B // 2  # another size: served as usual
    assert again.serve(B) == plain.serve(B)  # and the request is gone
    again.serve_again()
    again.set_batch_split([1, 0, 1])  # a new plan in force (a card set aside after its second fault)
    assert again.serve(B).per_replica_batch_sizes[1] == 0  # the retry runs it, not the plan served before


def test_samples_are_needed_during_a_trial_and_while_the_window_fills_only():
    balancer = balanced()
    assert balancer.guard.in_trial and balancer.samples_needed()
    simulate_balancer(balancer, lambda step: TRUE, B, steps=40)
    assert not balancer.guard.in_trial and not balancer.samples_needed()
    assert not Balancer(3, shares=[2, 1, 1]).samples_needed()  # nothing is decided from times


def test_fixed_shares_and_even_split_need_no_timing():
    fixed = Balancer(3, shares=[2, 1, 1])
    assert fixed.serve(B).per_replica_batch_sizes == (1024, 512, 512)
    assert not fixed.timing_needed and not fixed.timing_due()
    even = Balancer(3, auto_balance=False)
    assert even.serve(B).per_replica_batch_sizes == EVEN and not even.timing_needed


def test_a_failed_set_cost_models_leaves_the_balancer_as_it_was():
    balancer = balanced(guard=False)
    plan = balancer.plan

    class NaNModel:
        def predict_step_time_s(self, batch_size):
            return float("nan")

    with pytest.raises(InvalidCostModelError):
        balancer.set_cost_models([*TRUE[:2], NaNModel()])
    with pytest.raises(ConfigError, match="one cost model per replica"):
        balancer.set_cost_models(TRUE[:2])
    assert balancer.plan is plan and balancer.cost_models == TRUE


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "8"])
def test_serve_and_plan_for_reject_a_bad_global_batch_size(bad):
    balancer = Balancer(2)
    with pytest.raises(ConfigError, match="global_batch_size"):
        balancer.serve(bad)
    with pytest.raises(ConfigError, match="global_batch_size"):
        balancer.plan_for(bad)


def test_clearing_fixed_shares_restores_the_plan_the_guard_left_in_force():
    """Regression: the main job measures the even split with set_batch_split([1, 1, 1]) and then clears it; a plan
    the guard had reverted must not come back as the solved (unmeasured) plan."""
    alike = [LinearCostModel(0.02, 2e-4)] * 3
    balancer = balanced()
    simulate_balancer(balancer, lambda step: alike, B, steps=40, relative_noise=0.02)
    assert balancer.last_guard_decision.outcome == "reverted"
    balancer.set_batch_split([1, 1, 1])
    balancer.set_batch_split([2, 1, 1])
    assert balancer.plan.per_replica_batch_sizes == (1024, 512, 512)
    balancer.set_batch_split(None)
    assert balancer.plan.per_replica_batch_sizes == EVEN


def test_a_trial_that_is_never_timed_keeps_the_candidate_with_a_warning(caplog):
    """A custom loop without a Keras optimizer reports no step times; the guard cannot measure and gives up."""
    balancer = balanced()
    simulate_balancer(balancer, lambda step: TRUE, B, steps=30)  # a first, measured trial (kept)
    alike = [LinearCostModel(0.02, 2e-4)] * 3
    balancer.set_cost_models(alike[:1] + TRUE[1:], trial=True, reference_batch_size=B)
    assert balancer.guard.in_trial
    with caplog.at_level("WARNING", logger="hetero_cs"):
        for _ in range(3 * balancer.guard.policy.max_trial_steps + 1):
            balancer.serve(B)  # served, never recorded
    assert not balancer.guard.in_trial
    assert any("no step of the trial was timed" in r.getMessage() for r in caplog.records)


def test_a_guard_verdict_survives_an_input_of_another_batch_size():
    """Regression: after a revert, a validation input batched differently made the reverted plan come back unmeasured."""
    wrong = [LinearCostModel(0.0, 1e-3), LinearCostModel(0.0, 3e-3)]
    truth = LinearCostModel(0.0, 1e-3)
    balancer = Balancer(2, rebalance=False)
    balancer.set_cost_models(wrong, trial=True, reference_batch_size=100)
    simulate_balancer(balancer, lambda step: [truth, truth], 100, steps=40)
    assert balancer.last_guard_decision.outcome == "reverted" and balancer.plan.per_replica_batch_sizes == (50, 50)
    balancer.start_new_input()
    balancer.serve(64)  # another input, another size
    balancer.start_new_input()
    assert balancer.serve(100).per_replica_batch_sizes == (50, 50) and not balancer.guard.in_trial


def test_bad_reference_batch_size_and_bad_shares_leave_the_balancer_as_it_was():
    models = [LinearCostModel(0.0, 1e-3), LinearCostModel(0.0, 3e-3)]
    balancer = Balancer(2, guard=False, rebalance=False)
    balancer.set_cost_models(models, reference_batch_size=100)
    for bad in (0, -5, 2.7, "100", True):
        with pytest.raises(ConfigError, match="reference_batch_size"):
            balancer.set_cost_models(models, reference_batch_size=bad)
    assert balancer.reference_batch_size == 100 and balancer.plan.global_batch_size == 100
    with pytest.raises(Exception):
        balancer.set_batch_split([1, -1])
    assert balancer.shares is None and balancer.serve(100).per_replica_batch_sizes == (75, 25)


class _Jump:
    """t(b) = c * b, plus `extra_s` once b exceeds `above` (a device that falls off a cliff past a size)."""

    def __init__(self, seconds_per_example, above=None, extra_s=0.0):
        self.c, self.above, self.extra_s = seconds_per_example, above, extra_s

    def predict_step_time_s(self, batch_size):
        return self.c * batch_size + (self.extra_s if self.above is not None and batch_size > self.above else 0.0)


def test_a_reverted_replan_restores_the_models_the_plan_in_force_was_made_with():
    # Replica 0 measures 1.5x slower than calibrated, so the re-planner moves work to replica 1 - which in truth is
    # much slower past 50 examples: the guard reverts, and the models that predicted the re-plan are dropped.
    calibrated = [LinearCostModel(0.0, 1e-3), LinearCostModel(0.0, 1e-3)]
    truth = [_Jump(1.5e-3), _Jump(1e-3, above=50, extra_s=0.1)]
    balancer = Balancer(2, auto_balance=True, rebalance=True)
    balancer.set_cost_models(calibrated, trial=False, reference_batch_size=100)
    simulate_balancer(balancer, lambda step: truth, 100, steps=60, prefetch=1)
    assert balancer.rebalancer.switches  # it did re-plan
    decision = balancer.last_guard_decision
    assert decision is not None and decision.outcome == "reverted"
    assert balancer.plan.per_replica_batch_sizes == (50, 50)
    assert balancer.cost_models is calibrated or list(balancer.cost_models) == calibrated
    assert balancer.plan.predicted_makespan_s == pytest.approx(0.050)  # under the calibrated models, not 0.075


@pytest.mark.parametrize("shares", [[1], [1, 1, 1, 1], "ab", [1, "x", 1]])
def test_set_batch_split_refuses_shares_that_are_not_one_number_per_replica(shares):
    from hetero_cs.errors import BatchSplitError

    balancer = balanced()
    before = balancer.plan
    with pytest.raises(BatchSplitError):
        balancer.set_batch_split(shares)
    assert balancer.plan is before and balancer.shares is None


def test_set_cost_models_refuses_something_that_is_not_a_sequence_of_models():
    with pytest.raises(ConfigError, match="one cost model per replica"):
        Balancer(2).set_cost_models(None)
