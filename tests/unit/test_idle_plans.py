"""Plans that leave cards out (pure): the solver's subsets, the severe-drift loop, probes of idle cards."""

import statistics

import pytest

from hetero_cs.planning.balancer import Balancer
from hetero_cs.planning.balancer_plans import PROBE_INTERVAL_STEPS
from hetero_cs.planning.cost_model import IdleFreeCostModel, LinearCostModel, ScaledCostModel
from hetero_cs.planning.guard import GuardPolicy
from hetero_cs.planning.monitor import StepTimeMonitor
from hetero_cs.planning.simulation import simulate_balancer
from hetero_cs.planning.solver import solve_batch_split
from hetero_cs.errors import ConfigError

# An A10-like card, and two slower ones, each with a 10 ms fixed cost per step; B = 2048.
BASE = [LinearCostModel(0.01, 3.2e-5), LinearCostModel(0.01, 3.4e-4), LinearCostModel(0.01, 3.0e-4)]
B = 2048
SLOW_AT, RECOVER_AT = 50, 125


def true_models(step):
    """Replica 1 runs 50x slower in [SLOW_AT, RECOVER_AT); an idle card costs nothing."""
    factor = 50.0 if SLOW_AT <= step < RECOVER_AT else 1.0
    return [IdleFreeCostModel(BASE[0]), IdleFreeCostModel(ScaledCostModel(BASE[1], factor)),
            IdleFreeCostModel(BASE[2])]


def optimum_s(step):
    return solve_batch_split(true_models(step), B, min_batch_size=0).predicted_makespan_s


def test_a_card_with_a_large_fixed_cost_is_left_out_and_the_plan_says_so():
    models = [LinearCostModel(0.0, 1e-4), LinearCostModel(0.0, 1e-4), LinearCostModel(0.5, 1e-5)]
    balancer = Balancer(3, rebalance=False, guard=False, idle_replicas_free=True)
    balancer.set_cost_models(models, reference_batch_size=1000)
    assert balancer.plan.per_replica_batch_sizes == (500, 500, 0)
    assert balancer.plan.predicted_makespan_s == pytest.approx(0.05)
    assert "idle replicas: [2]" in str(balancer.plan)
    # The public models are the cards' own curves (what calibration measured), not the idle pricing.
    assert balancer.cost_models == models
    # Without idle pricing (an engine whose idle replicas still run a step), every card gets an example.
    every = Balancer(3, rebalance=False, guard=False)
    every.set_cost_models(models, reference_batch_size=1000)
    assert min(every.plan.per_replica_batch_sizes) >= 1


def test_an_engine_that_learns_late_that_idle_replicas_are_free_plans_with_it_both_ways():
    # The multi-worker engine knows only once it has the model whether an idle replica skips its pass.
    models = [LinearCostModel(0.0, 1e-4), LinearCostModel(0.0, 1e-4), LinearCostModel(0.5, 1e-5)]
    balancer = Balancer(3, rebalance=False, guard=False)
    balancer.set_cost_models(models, reference_batch_size=1000)
    assert min(balancer.plan_for(1000).per_replica_batch_sizes) >= 1 and not balancer.idle_replicas_free
    balancer.set_idle_replicas_free(True)
    assert balancer.plan_for(1000).per_replica_batch_sizes == (500, 500, 0)
    assert balancer.cost_models == models  # still the cards' own curves
    assert balancer.rebalancer.policy.min_batch_size == 0
    balancer.set_idle_replicas_free(False)  # a model whose idle replicas must run (an all-reduce in its forward)
    assert min(balancer.plan_for(1000).per_replica_batch_sizes) >= 1
    assert balancer.rebalancer.policy.min_batch_size == 1


def run_severe_drift(steps=260, seed=0):
    balancer = Balancer(3, idle_replicas_free=True)
    balancer.set_cost_models(BASE, reference_batch_size=B)
    return balancer, simulate_balancer(balancer, true_models, B, steps=steps, relative_noise=0.02, seed=seed)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_card_50x_slower_is_left_out_within_10_steps_and_used_again_within_50_steps_of_its_recovery(seed):
    balancer, steps = run_severe_drift(seed=seed)
    # Within 10 steps of the slow-down every step is within 2x of the new optimum, except the probes.
    after = [s for s in steps[SLOW_AT + 10:RECOVER_AT] if s.per_replica_batch_sizes[1] != 1]
    assert all(s.true_makespan_s <= 2.0 * optimum_s(s.step) for s in after), [
        (s.step, s.per_replica_batch_sizes, s.true_makespan_s) for s in after if s.true_makespan_s > 2 * optimum_s(0)]
    assert any(s.plan_in_force[1] == 0 for s in steps[SLOW_AT:SLOW_AT + 10])
    # Probes: one example on the idle card, once per interval, never more.
    probes = [s for s in steps[SLOW_AT:RECOVER_AT] if s.per_replica_batch_sizes[1] == 1]
    assert 1 <= len(probes) <= (RECOVER_AT - SLOW_AT) // PROBE_INTERVAL_STEPS + 1
    # The whole slow phase costs less than 1.25x the optimum on average (probes and the first steps included).
    slow_phase = steps[SLOW_AT + 10:RECOVER_AT]
    assert statistics.mean(s.true_makespan_s for s in slow_phase) <= 1.25 * optimum_s(SLOW_AT)
    # After the recovery the card takes work again within 50 steps, and the plan in force ends at the optimum.
    used = next(s.step for s in steps[RECOVER_AT:] if s.per_replica_batch_sizes[1] > 1)
    assert used - RECOVER_AT <= 50
    assert balancer.plan.predicted_makespan_s == pytest.approx(optimum_s(RECOVER_AT), rel=0.05)
    assert balancer.probes >= 1


@pytest.mark.parametrize("seed", [0, 1])
def test_probes_beside_training_leave_every_step_to_the_plan_and_still_bring_the_card_back(seed):
    # The central-storage engine probes an idle card off the step's path: the step it serves runs the plan in
    # force, and the probe's time comes back through record_probe (here at once, from the true models).
    calls = []

    def prober(replicas):
        step = balancer.monitor.completed_steps  # the step being served (prefetch 0)
        calls.append((step, tuple(replicas)))
        for i in replicas:
            balancer.record_probe(i, 1, true_models(step)[i].predict_step_time_s(1))
        return True

    balancer = Balancer(3, idle_replicas_free=True, idle_prober=prober)
    balancer.set_cost_models(BASE, reference_batch_size=B)
    steps = simulate_balancer(balancer, true_models, B, steps=260, relative_noise=0.02, seed=seed)
    assert all(s.per_replica_batch_sizes == s.plan_in_force for s in steps if not s.in_trial)
    assert not any(s.per_replica_batch_sizes[1] == 1 for s in steps)  # no step gives the idle card one example
    probes = [c for c in calls if SLOW_AT <= c[0] < RECOVER_AT]
    assert 1 <= len(probes) <= (RECOVER_AT - SLOW_AT) // PROBE_INTERVAL_STEPS + 1 and {c[1] for c in probes} == {(1,)}
    assert balancer.probes == len(calls)
    # From 10 steps after the slow-down, every step is within 2x of the new optimum (no probe step in between).
    assert all(s.true_makespan_s <= 2.0 * optimum_s(s.step) for s in steps[SLOW_AT + 10:RECOVER_AT])
    used = next(s.step for s in steps[RECOVER_AT:] if s.per_replica_batch_sizes[1] > 1)
    assert used - RECOVER_AT <= 50
    assert balancer.plan.predicted_makespan_s == pytest.approx(optimum_s(RECOVER_AT), rel=0.05)


def test_an_engine_that_cannot_probe_beside_training_gets_the_probe_in_the_step():
    calls = []
    balancer = Balancer(3, idle_replicas_free=True, idle_prober=lambda replicas: calls.append(list(replicas)))
    balancer.set_cost_models(BASE, reference_batch_size=B)
    steps = simulate_balancer(balancer, true_models, B, steps=RECOVER_AT)
    in_step = [s.step for s in steps if s.per_replica_batch_sizes[1] == 1]
    assert calls and len(in_step) == len(calls) == balancer.probes  # each refusal: one probe step


def test_the_monitor_takes_an_idle_cards_speed_from_a_probe_beside_training():
    base = [LinearCostModel(0.0, 1e-3), LinearCostModel(0.005, 1e-3)]
    monitor = StepTimeMonitor(2, window_steps=4)
    for _ in range(4):
        monitor.record(0, 20, 0.020)
        monitor.record(1, 0, 0.0)
    assert monitor.updated_cost_models(base)[1] is base[1]
    monitor.record_probe(1, 1, 0.012)  # 2x its base model's 6 ms
    assert monitor.updated_cost_models(base)[1].predict_step_time_s(10) == pytest.approx(0.030)
    assert monitor.updated_cost_models(base)[1].predict_step_time_s(10) == pytest.approx(0.030)  # kept while idle
    monitor.record_probe(1, 1, float("nan"))  # no time: ignored
    assert monitor.updated_cost_models(base)[1].predict_step_time_s(10) == pytest.approx(0.030)
    for _ in range(4):  # in the plan again: its steps say its speed, a probe recorded meanwhile does not
        monitor.record(0, 10, 0.010)
        monitor.record(1, 10, 0.015)
    monitor.record_probe(1, 1, 0.6)
    assert monitor.updated_cost_models(base)[1].predict_step_time_s(10) == pytest.approx(0.015)
    for bad in ({"replica_id": 2, "batch_size": 1}, {"replica_id": 1, "batch_size": 0}):
        with pytest.raises(ConfigError, match="must be an integer"):
            monitor.record_probe(step_time_s=0.1, **bad)


def test_the_monitor_keeps_an_idle_cards_last_measured_speed():
    base = [LinearCostModel(0.0, 1e-3), LinearCostModel(0.0, 1e-3)]
    monitor = StepTimeMonitor(2, window_steps=4)
    for _ in range(4):
        monitor.record(0, 10, 0.010)
        monitor.record(1, 10, 0.200)  # 20x slower than its base model
    slow = monitor.updated_cost_models(base)[1]
    assert slow.predict_step_time_s(10) == pytest.approx(0.2, rel=1e-6)
    for _ in range(4):  # the plan leaves replica 1 idle: the window forgets its slow steps
        monitor.record(0, 20, 0.020)
        monitor.record(1, 0, 0.0)
    assert monitor.updated_cost_models(base)[1].predict_step_time_s(10) == pytest.approx(0.2, rel=1e-6)
    # Another base model (a new calibration) starts from that model, not from the old correction.
    other = [LinearCostModel(0.0, 1e-3), LinearCostModel(0.0, 2e-3)]
    assert monitor.updated_cost_models(other)[1] is other[1]


def test_the_guard_decides_at_once_when_one_plan_is_over_4x_faster():
    from hetero_cs.planning.guard import PlanGuard
    from hetero_cs.planning.plan import BatchPlan

    guard = PlanGuard()
    incumbent, candidate = BatchPlan((10, 10), 20), BatchPlan((20, 0), 20)
    guard.start(incumbent, candidate, step=0)
    decisions = []
    for step in range(1, 10):
        served = guard.plan_to_serve()
        slow = served.per_replica_batch_sizes == (10, 10)
        decision = guard.observe(served.per_replica_batch_sizes, 1.0 if slow else 0.1, step=step)
        if decision is not None:
            decisions.append((step, decision))
            break
    (step, decision), = decisions
    assert decision.kept and decision.num_pairs == 1 and "4x faster" in decision.reason
    with pytest.raises(ConfigError, match="decisive_ratio"):
        GuardPolicy(decisive_ratio=1.0)
