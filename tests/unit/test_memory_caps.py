"""Memory caps after out-of-memory steps (pure): how they fall, how they grow back, and the Balancer's re-plan."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetero_cs import ConfigError, InfeasiblePlanError, LinearCostModel, solve_batch_split
from hetero_cs.planning.balancer import Balancer
from hetero_cs.planning.memory_caps import CapChange, MemoryCaps, MemoryRecoveryPolicy
from hetero_cs.planning.monitor import StepTimeMonitor

MODELS = [LinearCostModel(1e-3, 1e-4), LinearCostModel(1e-3, 4e-4), LinearCostModel(1e-3, 3e-4)]


# ------------------------------------------------------------------------------------------------ MemoryCaps


def test_a_failed_slice_backs_off_by_the_factor_when_nothing_smaller_succeeded():
    caps = MemoryCaps(3)
    caps.reset([None, 64, None])
    caps.record_success((40, 40, 40))
    change = caps.record_out_of_memory(1, 40)
    assert change == CapChange(1, 64, 20, "out_of_memory", 40)
    assert caps.caps == [None, 20, None]
    assert "cap 64 -> 20 (out of memory at 40 examples)" in change.describe()


def test_a_failed_slice_falls_to_the_largest_smaller_slice_that_succeeded_recently():
    caps = MemoryCaps(2, MemoryRecoveryPolicy(recent_steps=3))
    for sizes in [(10, 22), (10, 30), (10, 35), (10, 36)]:  # 22 left the window of the last 3
        caps.record_success(sizes)
    assert caps.record_out_of_memory(1, 36).new_cap == 35
    assert caps.record_out_of_memory(1, 35).new_cap == 30  # 36 and 35 are not smaller
    assert caps.record_out_of_memory(1, 30).new_cap == 15  # nothing smaller: back-off


def test_a_cap_never_rises_on_an_out_of_memory_step_and_reaches_zero():
    caps = MemoryCaps(2)
    caps.reset([8, None])
    caps.record_success((8, 8))
    assert caps.record_out_of_memory(0, 100).new_cap == 8  # a slice above the cap (prefetched) keeps the cap
    assert caps.record_out_of_memory(0, 1).new_cap == 0  # not even one example fits


def test_caps_grow_back_slowly_never_above_the_calibrated_cap():
    policy = MemoryRecoveryPolicy(grow_after_steps=3, growth_factor=1.5)
    caps = MemoryCaps(2, policy)
    caps.reset([None, 40])
    caps.record_out_of_memory(1, 32)  # -> 16
    grown = []
    for _ in range(12):
        grown.extend(c.new_cap for c in caps.record_success((50, caps.caps[1])))
    assert grown == [24, 36, 40]  # every 3rd step, x1.5, then the calibrated cap (the lowered cap is lifted)
    assert caps.caps == [None, 40] and not caps.lowered


def test_growth_adds_at_least_one_example_and_a_cap_reaching_the_batch_is_lifted():
    caps = MemoryCaps(2, MemoryRecoveryPolicy(grow_after_steps=1, growth_factor=1.01))
    caps.record_out_of_memory(0, 3)  # -> 1
    assert [c.new_cap for c in caps.record_success((1, 9), 10)] == [2]
    sizes = []
    while caps.caps[0] is not None:
        for change in caps.record_success((caps.caps[0], 1), 10):
            sizes.append(change.new_cap)
    assert sizes == [3, 4, 5, 6, 7, 8, 9, None]  # +1 each step (1.01 rounds up to +1), then lifted at B=10
    assert caps.caps == [None, None]


def test_a_grown_cap_that_fails_falls_back_and_waits_twice_as_long():
    caps = MemoryCaps(2, MemoryRecoveryPolicy(grow_after_steps=2, growth_factor=2.0, max_grow_after_steps=8))
    caps.record_out_of_memory(1, 20)  # -> 10
    waits = []
    for _ in range(4):
        steps = 0
        while True:
            steps += 1
            if caps.record_success((5, caps.caps[1])):
                break
        waits.append(steps)
        assert caps.caps[1] == 20
        assert caps.record_out_of_memory(1, 20).new_cap == 10  # 10 succeeded recently
    assert waits == [2, 4, 8, 8]  # doubled after each failed probe, up to max_grow_after_steps


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"backoff_factor": 1.0}, "backoff_factor=1.0 must be a number in"),
        ({"growth_factor": 1.0}, "growth_factor=1.0 must be a finite number > 1"),
        ({"max_retries": 0}, "max_retries=0 must be an int >= 1"),
        ({"grow_after_steps": 10, "max_grow_after_steps": 5}, "max_grow_after_steps=5 must be >= grow_after_steps=10"),
    ],
)
def test_policy_rejects_bad_values(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        MemoryRecoveryPolicy(**kwargs)


def test_record_out_of_memory_rejects_bad_arguments():
    caps = MemoryCaps(2)
    with pytest.raises(ConfigError, match=r"replica_id=2 must be an int in \[0, 2\)"):
        caps.record_out_of_memory(2, 4)
    with pytest.raises(ConfigError, match="an empty slice cannot"):
        caps.record_out_of_memory(0, 0)


# ------------------------------------------------------------------------------------------------ Balancer


def balancer(**kwargs):
    b = Balancer(3, rebalance=False, guard=False, **kwargs)
    b.set_cost_models(MODELS, reference_batch_size=120)
    return b


def test_recover_from_oom_lowers_the_cap_and_solves_the_optimum_within_the_new_caps():
    b = balancer()
    before = b.plan.per_replica_batch_sizes
    plan, change = b.recover_from_oom(1, before[1], 120)
    assert change.new_cap == before[1] // 2
    assert plan is b.plan and plan.per_replica_batch_sizes[1] <= change.new_cap
    assert sum(plan.per_replica_batch_sizes) == 120
    optimum = solve_batch_split(MODELS, 120, max_batch_sizes=[None, change.new_cap, None], min_batch_size=1)
    assert plan.predicted_makespan_s <= optimum.predicted_makespan_s * 1.02
    assert b.max_batch_sizes == [None, change.new_cap, None]


def test_recover_from_oom_abandons_a_guard_trial_and_drops_partial_monitor_steps():
    b = Balancer(3, rebalance=False, guard=True)
    b.serve(120)
    b.set_cost_models(MODELS, trial=True)
    assert b.guard.in_trial
    b.record_step_time(0, 40, 0.01)  # the failed step: replicas 0 and 2 reported, replica 1 did not
    b.record_step_time(2, 40, 0.01)
    plan, _ = b.recover_from_oom(1, 40, 120)
    assert not b.guard.in_trial and b.serve(120) == plan
    for i, size in enumerate(plan.per_replica_batch_sizes):  # the retry pairs into one complete step
        b.record_step_time(i, size, 0.01)
    assert b.monitor.completed_steps == 1
    assert b.monitor.last_step().per_replica_batch_sizes == plan.per_replica_batch_sizes


def test_recover_from_oom_with_fixed_shares_or_the_even_split_moves_the_excess_by_share():
    even = Balancer(3, auto_balance=False, rebalance=False, guard=False)
    even.plan_for(30)
    plan, _ = even.recover_from_oom(1, 10, 30)
    assert plan.per_replica_batch_sizes == (13, 5, 12) or plan.per_replica_batch_sizes == (12, 5, 13)
    shares = Balancer(3, shares=[2.0, 1.0, 1.0], rebalance=False, guard=False)
    shares.plan_for(40)  # 20, 10, 10
    plan, _ = shares.recover_from_oom(0, 20, 40)  # cap 10: the other 10 go to replicas 1 and 2 alike
    assert plan.per_replica_batch_sizes == (10, 15, 15)
    zero_share = Balancer(3, shares=[1.0, 1.0, 0.0], rebalance=False, guard=False)
    zero_share.plan_for(20)  # 10, 10, 0
    plan, _ = zero_share.recover_from_oom(1, 10, 20)  # a 0 share stays 0: replica 0 takes the rest
    assert plan.per_replica_batch_sizes == (15, 5, 0)


def test_recover_from_oom_raises_infeasible_when_the_caps_cannot_hold_the_batch():
    b = Balancer(2, rebalance=False, guard=False)
    b.set_cost_models(MODELS[:2], max_batch_sizes=[10, 10], reference_batch_size=20)
    with pytest.raises(InfeasiblePlanError):
        b.recover_from_oom(0, 10, 20)
    assert b.max_batch_sizes == [5, 10]  # the lowered cap stays: the error is the caller's to report


def test_record_step_success_grows_a_cap_and_replans():
    b = balancer(memory_policy=MemoryRecoveryPolicy(grow_after_steps=2, growth_factor=2.0))
    full = b.plan.per_replica_batch_sizes
    plan, change = b.recover_from_oom(0, full[0], 120)
    assert b.record_step_success(plan.per_replica_batch_sizes) == []
    grown = b.record_step_success(plan.per_replica_batch_sizes)
    assert [c.reason for c in grown] == ["grow"] and grown[0].new_cap == 2 * change.new_cap
    assert b.plan.per_replica_batch_sizes[0] > plan.per_replica_batch_sizes[0]
    assert b.plan.per_replica_batch_sizes[0] <= grown[0].new_cap


def test_set_cost_models_resets_lowered_caps_to_the_calibrated_ones():
    b = balancer()
    b.recover_from_oom(2, 30, 120)
    b.set_cost_models(MODELS, max_batch_sizes=[None, None, 90])
    assert b.max_batch_sizes == [None, None, 90] and list(b.memory_caps.history) == []


@settings(max_examples=60, deadline=None)
@given(
    slopes=st.lists(st.integers(1, 9), min_size=2, max_size=3),
    overheads=st.lists(st.integers(0, 5), min_size=3, max_size=3),
    global_batch_size=st.integers(6, 24),
    failing=st.integers(0, 2),
)
def test_property_the_recovered_plan_is_an_optimal_split_within_the_new_caps(
    slopes, overheads, global_batch_size, failing
):
    R = len(slopes)
    failing %= R
    models = [LinearCostModel(a * 1e-3, c * 1e-4) for a, c in zip(overheads, slopes)]
    b = Balancer(R, rebalance=False, guard=False)
    b.set_cost_models(models, reference_batch_size=global_batch_size)
    failed = b.plan.per_replica_batch_sizes[failing]
    if failed == 0:
        return
    try:
        plan, change = b.recover_from_oom(failing, failed, global_batch_size)
    except InfeasiblePlanError:
        assert sum(c for c in b.max_batch_sizes if c is not None) < global_batch_size or R == 1
        return
    sizes = plan.per_replica_batch_sizes
    assert sum(sizes) == global_batch_size
    assert sizes[failing] <= change.new_cap < failed
    caps = b.max_batch_sizes
    # Brute force over every split within the caps with >= 1 example each (the solver's min_batch_size), but none on
    # a card whose cap fell to 0 (it sits out).
    best = min(
        max(m.predict_step_time_s(x) for m, x in zip(models, split))
        for split in itertools.product(*(range(0 if c == 0 else 1, (c if c is not None else global_batch_size) + 1)
                                         for c in caps))
        if sum(split) == global_batch_size
    )
    assert plan.predicted_makespan_s <= best * 1.02 + 1e-12


def test_monitor_abandon_open_steps_keeps_complete_steps_and_realigns_replicas():
    monitor = StepTimeMonitor(2)
    monitor.record(0, 4, 0.1)
    monitor.record(1, 4, 0.2)
    monitor.record(0, 4, 0.1)  # replica 1 failed this step
    monitor.abandon_open_steps()
    monitor.record(1, 2, 0.3)
    monitor.record(0, 6, 0.1)
    assert monitor.completed_steps == 2
    assert monitor.last_step().per_replica_batch_sizes == (6, 2)


def test_an_excluded_replica_keeps_a_cap_of_0_through_caps_set_without_cost_models():
    # The multi-worker strategy sets caps before it has cost models (Balancer.set_max_batch_sizes): a replica set
    # aside before that must not get a cap back (regression: the caps were stored as given).
    balancer = Balancer(3, rebalance=False, guard=False, idle_replicas_free=True, auto_balance=False)
    plan, _ = balancer.exclude_replica(1, 30, 90)
    assert plan.per_replica_batch_sizes[1] == 0
    balancer.set_max_batch_sizes([64, 64, None])
    assert balancer.max_batch_sizes == [64, 0, None]
    assert balancer.plan_for(90).per_replica_batch_sizes[1] == 0


def test_an_excluded_replica_keeps_a_cap_of_0_through_successes_and_new_cost_models():
    balancer = Balancer(3, rebalance=False, guard=False, idle_replicas_free=True)
    balancer.set_cost_models([LinearCostModel(1e-3, 1e-3)] * 3, reference_batch_size=90)
    plan, change = balancer.exclude_replica(1, 30, 90)
    assert plan.per_replica_batch_sizes == (45, 0, 45)
    assert (change.reason, change.old_cap, change.new_cap) == ("excluded", None, 0)
    assert "excluded: its device failed" in change.describe()
    for _ in range(200):  # a lowered cap would grow back after 50 successes; an excluded one never does
        assert balancer.record_step_success(plan.per_replica_batch_sizes) == []
    balancer.set_cost_models([LinearCostModel(1e-3, 1e-3)] * 3, max_batch_sizes=[None, 64, None])
    assert balancer.plan_for(90).per_replica_batch_sizes[1] == 0
    assert balancer.plan_for(7).per_replica_batch_sizes[1] == 0
    assert balancer.memory_caps.excluded == (1,)
    balancer.exclude_replica(0, 45, 90)
    with pytest.raises(InfeasiblePlanError):  # none left
        balancer.exclude_replica(2, 90, 90)
