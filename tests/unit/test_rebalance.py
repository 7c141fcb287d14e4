"""Unit tests for hetero_cs.planning.rebalance: policy validation, deadband, cooldown, caps, logging (pure, no TF)."""

from __future__ import annotations

import logging
import math

import pytest

from hetero_cs.planning.cost_model import LinearCostModel, ScaledCostModel
from hetero_cs.errors import ConfigError
from hetero_cs.planning.monitor import StepTimeMonitor
from hetero_cs.planning.solver import plan_from_split
from hetero_cs.planning.rebalance import (
    BALANCED,
    BELOW_DEADBAND,
    COOLDOWN,
    NOT_DUE,
    REPLANNED,
    TOO_FEW_SAMPLES,
    UNCHANGED,
    WITHIN_NOISE,
    RebalancePolicy,
    Rebalancer,
)
from hetero_cs.planning.simulation import simulate_training
from hetero_cs.planning.solver import solve_batch_split

# Two replicas, the second 1.2x slower per example. Even split of 100: 50 ms vs 60 ms. Optimum: [55, 45]:
# max(55 ms, 54 ms) = 55 ms, a predicted gain of 5/60 = 8.3 %.
FAST = LinearCostModel(0.0, 0.001)
SLOWER = LinearCostModel(0.0, 0.0012)
MODELS = [FAST, SLOWER]
EVEN = plan_from_split([50, 50])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"deadband": -0.01}, r"deadband must be a number in \[0, 1\).*deadband=-0.01"),
        ({"deadband": 1.0}, "deadband=1.0"),
        ({"deadband": math.nan}, "deadband=nan"),
        ({"deadband": "5%"}, "deadband='5%'"),
        ({"deadband": True}, "deadband=True"),
        ({"cooldown_steps": -1}, "cooldown_steps must be an integer >= 0. Received: cooldown_steps=-1"),
        ({"cooldown_steps": 2.5}, "cooldown_steps=2.5"),
        ({"min_samples": 0}, "min_samples must be an integer >= 1"),
        ({"multiple_of": 0}, "multiple_of must be an integer >= 1"),
        ({"min_batch_size": -1}, "min_batch_size must be an integer >= 0"),
        ({"noise_sigmas": -1.0}, r"noise_sigmas must be a finite number >= 0.*noise_sigmas=-1.0"),
        ({"noise_sigmas": math.inf}, "noise_sigmas=inf"),
        ({"check_interval_steps": 0}, "check_interval_steps must be an integer >= 1. Received: check_interval_steps=0"),
    ],
)
def test_policy_rejects_bad_values(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        RebalancePolicy(**kwargs)


def test_policy_defaults():
    policy = RebalancePolicy()
    assert (policy.deadband, policy.cooldown_steps, policy.min_samples) == (0.05, 20, 5)
    assert (policy.multiple_of, policy.min_batch_size, policy.noise_sigmas) == (1, 1, 1.5)
    assert policy.check_interval_steps == 1


def test_rebalancer_rejects_bad_policy_and_caps():
    with pytest.raises(ConfigError, match="policy must be a RebalancePolicy"):
        Rebalancer({"deadband": 0.1})
    with pytest.raises(ConfigError, match=r"max_batch_sizes=\[10, -1\]"):
        Rebalancer(RebalancePolicy(), max_batch_sizes=[10, -1])
    Rebalancer(max_batch_sizes=[10, None])  # None: that replica has no cap.


def test_gain_above_deadband_replans():
    rebalancer = Rebalancer(RebalancePolicy(deadband=0.05))
    new_plan = rebalancer.propose(7, EVEN, MODELS)
    assert new_plan is not None
    assert new_plan.per_replica_batch_sizes == (55, 45)
    decision = rebalancer.last_decision
    assert decision.outcome == REPLANNED
    assert decision.current_makespan_s == pytest.approx(0.060)
    assert decision.new_makespan_s == pytest.approx(0.055)
    assert decision.predicted_gain == pytest.approx(5 / 60)
    assert rebalancer.switches == (decision,)


def test_gain_below_deadband_keeps_the_plan():
    rebalancer = Rebalancer(RebalancePolicy(deadband=0.09))
    assert rebalancer.propose(7, EVEN, MODELS) is None
    decision = rebalancer.last_decision
    assert decision.outcome == BELOW_DEADBAND
    assert decision.new_per_replica_batch_sizes == (55, 45)
    assert decision.predicted_gain == pytest.approx(5 / 60)
    assert rebalancer.switches == ()


def test_gain_equal_to_deadband_keeps_the_plan():
    # The gain must exceed the deadband strictly.
    models = [LinearCostModel(0.0, 0.001), LinearCostModel(0.0, 0.001)]
    rebalancer = Rebalancer(RebalancePolicy(deadband=0.0))
    assert rebalancer.propose(0, EVEN, models) is None
    # Both replicas finish together: known without solving.
    assert rebalancer.last_decision.outcome == BALANCED
    assert rebalancer.last_decision.new_per_replica_batch_sizes is None
    assert rebalancer.last_decision.current_makespan_s == pytest.approx(0.050)


def test_zero_deadband_takes_any_strict_improvement():
    rebalancer = Rebalancer(RebalancePolicy(deadband=0.0))
    assert rebalancer.propose(0, plan_from_split([56, 44]), MODELS) is not None  # 56 ms -> 55 ms


def test_optimal_current_plan_is_unchanged():
    rebalancer = Rebalancer(RebalancePolicy(deadband=0.0))
    assert rebalancer.propose(3, plan_from_split([55, 45]), MODELS) is None
    assert rebalancer.last_decision.outcome == UNCHANGED


def test_cooldown_blocks_a_second_switch_until_it_has_passed():
    rebalancer = Rebalancer(RebalancePolicy(deadband=0.05, cooldown_steps=20))
    plan = rebalancer.propose(10, EVEN, MODELS)
    assert plan is not None
    drifted = [ScaledCostModel(FAST, 2.0), SLOWER]  # Replica 0 now 2x slower: a large gain is on offer.
    assert rebalancer.propose(29, plan, drifted) is None
    assert rebalancer.last_decision.outcome == COOLDOWN
    new_plan = rebalancer.propose(30, plan, drifted)
    assert new_plan is not None
    assert new_plan.per_replica_batch_sizes[0] < plan.per_replica_batch_sizes[0]
    assert [d.step for d in rebalancer.switches] == [10, 30]


def test_first_decision_has_no_cooldown_but_waits_for_min_samples():
    rebalancer = Rebalancer(RebalancePolicy(min_samples=5, cooldown_steps=100))
    assert rebalancer.propose(4, EVEN, MODELS, num_samples=4) is None
    assert rebalancer.last_decision.outcome == TOO_FEW_SAMPLES
    assert rebalancer.propose(5, EVEN, MODELS, num_samples=5) is not None


def test_looks_only_every_check_interval_steps():
    rebalancer = Rebalancer(RebalancePolicy(check_interval_steps=4))
    assert rebalancer.propose(3, EVEN, [FAST, FAST]) is None  # the first call looks
    assert rebalancer.last_decision.outcome == BALANCED
    for step in (4, 5, 6):  # the caller may skip steps (the input pipeline runs ahead of the training steps)
        assert rebalancer.propose(step, EVEN, MODELS) is None
        assert rebalancer.last_decision.outcome == NOT_DUE
        assert rebalancer.last_decision.new_per_replica_batch_sizes is None  # nothing was solved
    new_plan = rebalancer.propose(9, EVEN, MODELS)  # 6 steps after the last look
    assert new_plan is not None and new_plan.per_replica_batch_sizes == (55, 45)


def test_with_the_default_interval_every_call_looks():
    rebalancer = Rebalancer(RebalancePolicy())
    assert rebalancer.propose(3, EVEN, [FAST, FAST]) is None
    assert rebalancer.propose(3, EVEN, MODELS) is not None  # same step, new models: looked at again


def test_a_cap_violation_is_acted_on_between_checks():
    rebalancer = Rebalancer(RebalancePolicy(check_interval_steps=100), max_batch_sizes=[100, 40])
    new_plan = rebalancer.propose(7, plan_from_split([50, 50]), [FAST, FAST])
    assert new_plan is not None and new_plan.per_replica_batch_sizes == (60, 40)
    assert rebalancer.last_decision.forced


def test_new_plan_respects_caps():
    rebalancer = Rebalancer(RebalancePolicy(deadband=0.01), max_batch_sizes=[52, 100])
    new_plan = rebalancer.propose(0, EVEN, MODELS)
    assert new_plan.per_replica_batch_sizes == (52, 48)  # max(52 ms, 57.6 ms): gain 4 % instead of 8.3 %
    assert rebalancer.last_decision.predicted_gain == pytest.approx(0.04)


def test_plan_over_a_cap_is_replaced_despite_cooldown_and_deadband():
    rebalancer = Rebalancer(RebalancePolicy(deadband=0.5, cooldown_steps=1000), max_batch_sizes=[100, 40])
    assert rebalancer.propose(0, plan_from_split([40, 60]), [FAST, FAST]) is not None  # Starts the cooldown.
    # [50, 50] exceeds the cap of 40; the capped optimum [60, 40] is even slower (gain -20 %), but must be taken.
    new_plan = rebalancer.propose(1, plan_from_split([50, 50]), [FAST, FAST])
    assert new_plan is not None
    assert new_plan.per_replica_batch_sizes == (60, 40)
    assert rebalancer.last_decision.forced
    assert rebalancer.last_decision.predicted_gain == pytest.approx(-0.2)


def test_multiple_of_is_passed_to_the_solver():
    rebalancer = Rebalancer(RebalancePolicy(deadband=0.0, multiple_of=8))
    new_plan = rebalancer.propose(0, plan_from_split([48, 48]), MODELS)
    assert new_plan is not None
    assert new_plan.per_replica_batch_sizes == (56, 40)  # Not the unconstrained optimum [55, 45].


def test_gain_must_survive_the_noise_margin():
    # Current plan at levels (1 - 1.5 u), new plan at (1 + 1.5 u). u = 2 %: 0.97 * 60 ms vs 1.03 * 55 ms, a worst
    # case gain of 2.7 % < 5 %: kept. u = 0.5 %: 59.55 ms vs 55.41 ms, 7.0 % > 5 %: switched.
    policy = RebalancePolicy(deadband=0.05, noise_sigmas=1.5)
    noisy = Rebalancer(policy)
    assert noisy.propose(0, EVEN, MODELS, relative_standard_errors=[0.02, 0.02]) is None
    decision = noisy.last_decision
    assert decision.outcome == WITHIN_NOISE
    assert decision.predicted_gain == pytest.approx(5 / 60)
    assert decision.worst_case_gain == pytest.approx((0.97 * 60 - 1.03 * 55) / (0.97 * 60))
    precise = Rebalancer(policy)
    assert precise.propose(0, EVEN, MODELS, relative_standard_errors=[0.005, 0.005]) is not None
    assert precise.last_decision.worst_case_gain == pytest.approx((0.9925 * 60 - 1.0075 * 55) / (0.9925 * 60))


def test_zero_noise_sigmas_ignores_the_errors():
    rebalancer = Rebalancer(RebalancePolicy(noise_sigmas=0.0))
    assert rebalancer.propose(0, EVEN, MODELS, relative_standard_errors=[0.5, 0.5]) is not None
    assert rebalancer.last_decision.worst_case_gain == rebalancer.last_decision.predicted_gain


def test_huge_errors_block_any_switch():
    rebalancer = Rebalancer(RebalancePolicy(noise_sigmas=2.0))
    assert rebalancer.propose(0, EVEN, MODELS, relative_standard_errors=[0.9, 0.9]) is None
    assert rebalancer.last_decision.outcome == WITHIN_NOISE


@pytest.mark.parametrize("errors", [[0.01], [0.01, -0.01], [0.01, math.nan]])
def test_relative_standard_errors_are_validated(errors):
    with pytest.raises(ConfigError, match="relative_standard_errors must hold one finite value >= 0 per replica"):
        Rebalancer().propose(0, EVEN, MODELS, relative_standard_errors=errors)


def test_replan_is_logged_at_info_with_old_and_new_slices(caplog):
    with caplog.at_level(logging.INFO, logger="hetero_cs.planning.rebalance"):
        Rebalancer().propose(7, EVEN, MODELS)
    (record,) = [r for r in caplog.records if r.name == "hetero_cs.planning.rebalance"]
    assert record.levelno == logging.INFO
    assert record.getMessage() == (
        "re-planned at step 7: [50, 50] -> [55, 45], predicted makespan 60.000 ms -> 55.000 ms (gain 8.3 %)"
    )


def test_no_log_without_a_switch(caplog):
    with caplog.at_level(logging.DEBUG, logger="hetero_cs.planning.rebalance"):
        Rebalancer(RebalancePolicy(deadband=0.5)).propose(7, EVEN, MODELS)
    assert not [r for r in caplog.records if r.name == "hetero_cs.planning.rebalance"]


def test_propose_validates_arguments():
    rebalancer = Rebalancer()
    with pytest.raises(ConfigError, match=r"len\(cost_models\)=1"):
        rebalancer.propose(0, EVEN, [FAST])
    with pytest.raises(ConfigError, match="step must be a non-negative integer. Received: step=-1"):
        rebalancer.propose(-1, EVEN, MODELS)
    rebalancer.propose(10, EVEN, MODELS)
    with pytest.raises(ConfigError, match="step must not decrease.*step=9 after step=10"):
        rebalancer.propose(9, EVEN, MODELS)
    with pytest.raises(ConfigError, match=r"max_batch_sizes=\[100\]"):
        Rebalancer(max_batch_sizes=[100]).propose(0, EVEN, MODELS)


def test_propose_from_monitor_uses_the_monitor_window():
    monitor = StepTimeMonitor(2, window_steps=8)
    rebalancer = Rebalancer(RebalancePolicy(min_samples=3))
    base = [FAST, FAST]  # Calibration thought both alike; replica 1 really runs 1.2x slower.
    for step in range(3):
        monitor.record(0, 50, FAST.predict_step_time_s(50))
        monitor.record(1, 50, SLOWER.predict_step_time_s(50))
        new_plan = rebalancer.propose_from_monitor(monitor, EVEN, base_models=base)
        if step < 2:
            assert new_plan is None
            assert rebalancer.last_decision.outcome == TOO_FEW_SAMPLES
    assert new_plan is not None
    assert new_plan.per_replica_batch_sizes == (55, 45)
    assert rebalancer.last_decision.step == 3


def test_propose_from_monitor_rejects_a_replica_count_mismatch():
    with pytest.raises(ConfigError, match="monitor.num_replicas=3"):
        Rebalancer().propose_from_monitor(StepTimeMonitor(3), EVEN)


def _step_change(slow_from: int, recover_at: int | None = None, factor: float = 2.0):
    true = [LinearCostModel(0.002, 0.001), LinearCostModel(0.002, 0.001), LinearCostModel(0.004, 0.002)]

    def models_at(step: int):
        slowed = step >= slow_from and (recover_at is None or step < recover_at)
        return [ScaledCostModel(true[0], factor) if slowed else true[0], *true[1:]]

    return true, models_at


def test_simulation_reacts_to_a_slowdown_and_recovers():
    policy = RebalancePolicy()
    true, models_at = _step_change(slow_from=60, recover_at=160)
    initial = solve_batch_split(true, 120)
    trace = simulate_training(models_at, initial, steps=260, policy=policy, base_models=true, window_steps=16)
    switches = [s.step for s in trace if s.replanned]
    assert len(switches) == 2
    slow_switch, recovery_switch = switches
    assert 60 <= slow_switch <= 60 + policy.min_samples + 16 // 2
    assert trace[slow_switch + 1].per_replica_batch_sizes[0] < initial.per_replica_batch_sizes[0]
    assert 160 <= recovery_switch <= 160 + policy.min_samples + 16 // 2
    assert trace[-1].per_replica_batch_sizes == initial.per_replica_batch_sizes


def test_simulation_without_base_models_converges_near_the_optimum():
    true = [LinearCostModel(0.005, 0.001), LinearCostModel(0.005, 0.002), LinearCostModel(0.001, 0.004)]
    optimum = solve_batch_split(true, 128)
    trace = simulate_training(lambda step: true, plan_from_split([43, 43, 42]), steps=200, relative_noise=0.05)
    assert trace[-1].true_makespan_s <= 1.10 * optimum.predicted_makespan_s
    assert trace[-1].true_makespan_s < trace[0].true_makespan_s


def test_simulation_is_deterministic_for_a_seed():
    true, models_at = _step_change(slow_from=30)
    kwargs = dict(steps=80, base_models=true, relative_noise=0.1, seed=3)
    assert simulate_training(models_at, plan_from_split([40, 40, 40]), **kwargs) == simulate_training(
        models_at, plan_from_split([40, 40, 40]), **kwargs
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"steps": -1}, "steps=-1"),
        ({"steps": 1, "relative_noise": 1.0}, r"relative_noise must be in \[0, 1\)"),
        ({"steps": 1, "lognormal_sigma": -0.1}, "lognormal_sigma=-0.1"),
    ],
)
def test_simulation_validates_arguments(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        simulate_training(lambda step: MODELS, EVEN, **kwargs)


# ----------------------------------------------------------------------------------------------------------------
# A global batch smaller than R * min_batch_size
# ----------------------------------------------------------------------------------------------------------------
def test_regression_a_global_batch_smaller_than_the_replica_count_is_replanned_not_infeasible():
    # B = 2 on R = 3 with the default min_batch_size=1 raised InfeasiblePlanError a few steps into fit.
    models = [LinearCostModel(0.0, 0.004), LinearCostModel(0.0, 0.001), LinearCostModel(0.0, 0.001)]
    rebalancer = Rebalancer(RebalancePolicy(deadband=0.05))
    new_plan = rebalancer.propose(5, plan_from_split([1, 1, 0]), models)  # replica 0 is 4x slower
    assert new_plan is not None and new_plan.global_batch_size == 2
    assert new_plan.per_replica_batch_sizes[0] == 0 and sorted(new_plan.per_replica_batch_sizes) == [0, 1, 1]
    assert rebalancer.last_decision.outcome == REPLANNED


@pytest.mark.parametrize(("min_batch_size", "B", "R", "floor"), [(1, 2, 3, 0), (1, 1, 4, 0), (4, 10, 3, 3),
                                                                  (4, 12, 3, 4), (2, 100, 3, 2), (0, 2, 3, 0)])
def test_min_batch_size_is_lowered_only_when_b_is_below_r_times_it(min_batch_size, B, R, floor):
    models = [LinearCostModel(0.001 * (i + 1), 0.001 * (i + 1)) for i in range(R)]
    current = plan_from_split([B] + [0] * (R - 1))  # everything on the slowest-growing replica 0
    rebalancer = Rebalancer(RebalancePolicy(deadband=0.0, min_batch_size=min_batch_size))
    rebalancer.propose(0, current, models)
    sizes = rebalancer.last_decision.new_per_replica_batch_sizes
    assert sum(sizes) == B and min(sizes) >= floor
    assert sizes == solve_batch_split(models, B, min_batch_size=floor).per_replica_batch_sizes
