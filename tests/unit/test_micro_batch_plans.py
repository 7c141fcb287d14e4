"""Micro-batched plans (pure): how many sub-steps, each cut within the caps, against brute force."""

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetero_cs import BatchPlan, ConfigError, InfeasiblePlanError, LinearCostModel, MicroBatchPlan, solve_batch_split
from hetero_cs.planning.choice import choose_plan
from hetero_cs.planning.cost_model import idle_free
from hetero_cs.planning.micro_batches import (
    MAX_EXTRA_SUB_STEPS,
    capacity_of,
    plan_micro_batches,
    plan_overlapped_micro_batches,
    SUB_STEPS_PER_CALL,
)


def solver(models, caps, *, keep_even_on_ties=True):
    """The engine's sub-step solver (choose_plan keeps the even split when the solved one is < 2 % faster), or the
    minimum-makespan solver alone."""
    models = idle_free(models)

    def solve(b):
        if not keep_even_on_ties:
            return solve_batch_split(models, b, max_batch_sizes=caps, min_batch_size=0)
        return choose_plan(b, len(models), shares=None, auto_balance=True, cost_models=models, max_batch_sizes=caps,
                           log_ties=False, idle_free=True)

    return solve


def test_a_plan_reports_each_replicas_examples_micro_batch_and_count_and_round_trips():
    plan = MicroBatchPlan((BatchPlan((16, 24, 24), 64, predicted_makespan_s=0.02),
                           BatchPlan((16, 23, 24), 63, predicted_makespan_s=0.02),
                           BatchPlan((0, 10, 0), 10, predicted_makespan_s=0.01)), single_step_makespan_s=0.1)
    assert plan.global_batch_size == 137 and plan.num_sub_steps == 3
    assert plan.per_replica_batch_sizes == (32, 57, 48)
    assert plan.micro_batch_sizes == (16, 24, 24) and plan.micro_batch_counts == (2, 3, 2)
    assert plan.predicted_makespan_s == pytest.approx(0.05)
    assert plan.predicted_speedup_vs_single_step == pytest.approx(2.0)
    assert MicroBatchPlan.from_dict(plan.to_dict()) == plan
    text = str(plan)
    assert "3 sub-steps" in text and "micro-batch" in text and "2.000x" in text


def test_bad_plans_and_arguments_are_clear_errors():
    with pytest.raises(ConfigError, match="one or more BatchPlan"):
        MicroBatchPlan(())
    with pytest.raises(ConfigError, match="replica counts"):
        MicroBatchPlan((BatchPlan((1, 1), 2), BatchPlan((1, 1, 1), 3)))
    with pytest.raises(ConfigError, match="sub_step_plans"):
        MicroBatchPlan.from_dict({"plans": []})
    solve = solver([LinearCostModel(0.001, 0.001)] * 2, [4, 4])
    with pytest.raises(ConfigError, match="global_batch_size must be an integer >= 1"):
        plan_micro_batches(0, solve, capacity=8)
    with pytest.raises(ConfigError, match="capacity must be None or an integer"):
        plan_micro_batches(8, solve, capacity=-1)
    with pytest.raises(InfeasiblePlanError, match="No replica can hold one example"):
        plan_micro_batches(8, solve, capacity=0)


def test_a_batch_that_fits_with_room_stays_one_step():
    models = [LinearCostModel(0.010, 0.001), LinearCostModel(0.010, 0.002)]
    plan = plan_micro_batches(64, solver(models, [1000, 1000]), capacity=2000)
    assert plan.num_sub_steps == 1 and plan.per_replica_batch_sizes == plan.micro_batch_sizes
    assert capacity_of([1000, None]) is None and capacity_of(None) is None and capacity_of([3, 4]) == 7


def test_a_batch_larger_than_all_caps_takes_at_least_the_fewest_sub_steps_that_fit():
    models = [LinearCostModel(0.010, 0.001)] * 3
    caps = [16, 64, 64]
    plan = plan_micro_batches(16 * 144, solver(models, caps), capacity=144)
    assert plan.num_sub_steps >= 16
    assert all(m <= c for m, c in zip(plan.micro_batch_sizes, caps))
    assert max(plan.sub_step_sizes) - min(plan.sub_step_sizes) <= 1


def test_a_fast_card_with_little_memory_gets_its_compute_back_through_sub_steps():
    # The mix: the fastest card holds 16 examples, the others 64. With a small per-step fixed cost the
    # capped single step [16, 52, 60] wastes the A10; sub-steps give it 16 examples in each.
    models = [LinearCostModel(0.0005, 0.000109), LinearCostModel(0.0005, 0.000423), LinearCostModel(0.0005, 0.000369)]
    plan = plan_micro_batches(128, solver(models, [16, 64, 64]), capacity=144)
    assert plan.num_sub_steps > 1
    assert plan.per_replica_batch_sizes[0] > 16  # more than its cap over the step
    assert plan.predicted_speedup_vs_single_step > 1.5
    # ... and with a large fixed cost per step the single step stays.
    heavy = [LinearCostModel(0.010, m.seconds_per_example) for m in models]
    assert plan_micro_batches(128, solver(heavy, [16, 64, 64]), capacity=144).num_sub_steps == 1


def test_the_sub_steps_in_use_stay_unless_another_count_is_clearly_faster():
    models = [LinearCostModel(0.0005, 0.000109), LinearCostModel(0.0005, 0.000423), LinearCostModel(0.0005, 0.000369)]
    solve = solver(models, [16, 64, 64])
    best = plan_micro_batches(128, solve, capacity=144)
    near = best.num_sub_steps - 1
    kept = plan_micro_batches(128, solve, capacity=144, incumbent_sub_steps=near)
    assert kept.predicted_makespan_s < best.predicted_makespan_s * 1.02  # 1.3 % slower than the best ...
    assert kept.num_sub_steps == near  # ... so the count in use stays
    far = plan_micro_batches(128, solve, capacity=144, incumbent_sub_steps=30)
    assert far.num_sub_steps == best.num_sub_steps  # clearly slower: replaced


def test_without_predictions_the_fewest_sub_steps_that_fit():
    def solve(b):
        return BatchPlan((b,), b)

    plan = plan_micro_batches(100, solve, capacity=30)
    assert plan.num_sub_steps == 4 and plan.sub_step_sizes == (25, 25, 25, 25)


def brute_force_equal_sub_steps(models, caps, B):
    """The best plan of near-equal sub-steps over every K the search may try, each sub-step cut by brute force."""
    capacity = sum(caps)
    k_min = math.ceil(B / capacity)
    best = math.inf
    for K in range(k_min, min(B, k_min + MAX_EXTRA_SUB_STEPS) + 1):
        q, r = divmod(B, K)
        total = 0.0
        for size, count in ((q + 1, r), (q, K - r)):
            if count == 0:
                continue
            cut = min(
                max((m.predict_step_time_s(b) if b else 0.0) for m, b in zip(models, split))
                for split in itertools.product(*(range(c + 1) for c in caps)) if sum(split) == size)
            total += count * cut
        best = min(best, total)
    return best


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0.0, 0.01), st.floats(1e-4, 5e-3)), min_size=2, max_size=3),
    st.lists(st.integers(1, 6), min_size=3, max_size=3),
    st.integers(1, 40),
)
def test_the_search_finds_the_best_near_equal_sub_steps(params, caps, B):
    models = [LinearCostModel(a, c) for a, c in params]
    caps = caps[:len(models)]
    plan = plan_micro_batches(B, solver(models, caps, keep_even_on_ties=False), capacity=sum(caps), min_gain=0.0)
    assert plan.global_batch_size == B
    assert all(m <= c for m, c in zip(plan.micro_batch_sizes, caps))
    assert plan.predicted_makespan_s == pytest.approx(brute_force_equal_sub_steps(models, caps, B), rel=1e-9)


# ----------------------------------------------------------------------------------------------------------------
# Overlapped plans: each card runs its micro-batches back to back, with no barrier between sub-steps.
# ----------------------------------------------------------------------------------------------------------------
def _overlapped_time(model, cap, b):
    """Brute force: b examples in ceil(b / cap) near-equal micro-batches, each one full step of ``model``."""
    if b == 0:
        return 0.0
    k = math.ceil(b / cap) if cap is not None else 1
    q, r = divmod(b, k)
    return r * model.predict_step_time_s(q + 1) + (k - r) * model.predict_step_time_s(q)


@settings(max_examples=60, deadline=None)
@given(
    B=st.integers(1, 60),
    replicas=st.lists(st.tuples(st.floats(0.0, 0.01), st.floats(1e-4, 5e-3), st.one_of(st.none(), st.integers(0, 12))),
                      min_size=2, max_size=3).filter(lambda r: any(c is None or c > 0 for _, _, c in r)),
)
def test_an_overlapped_plan_is_the_least_makespan_over_every_split(B, replicas):
    # Against every split of B: max_i of each card's micro-batches back to back, each within its cap.
    models = [LinearCostModel(a, c) for a, c, _ in replicas]
    caps = [cap for _, _, cap in replicas]
    plan = plan_overlapped_micro_batches(B, idle_free(models), caps, max_sub_steps=10_000)
    best = min(max(_overlapped_time(m, cap, b) for m, cap, b in zip(models, caps, split))
               for split in itertools.product(range(B + 1), repeat=len(models)) if sum(split) == B
               and all(cap is None or cap > 0 or b == 0 for cap, b in zip(caps, split)))
    assert plan.overlapped and plan.global_batch_size == B
    if plan.num_calls == 1:
        assert plan.predicted_makespan_s == pytest.approx(best, rel=1e-9, abs=1e-12)
    else:  # the calls' barriers cost something; each call holds about 1/n of every card's micro-batches
        assert plan.predicted_makespan_s >= best - 1e-12
        assert all(1 <= len(call) <= SUB_STEPS_PER_CALL for call in plan.calls)
    # Each card's micro-batches: within its cap; in each call, in its first sub-steps, largest first, near-equal.
    for i, cap in enumerate(caps):
        assert cap is None or all(p.per_replica_batch_sizes[i] <= cap for p in plan.sub_step_plans)
        for call in plan.calls:
            column = [p.per_replica_batch_sizes[i] for p in call]
            k = sum(1 for b in column if b)
            assert all(b > 0 for b in column[:k]) and column[:k] == sorted(column[:k], reverse=True)
            assert not column[:k] or column[0] - column[k - 1] <= 1


def test_an_overlapped_plan_gives_the_fast_card_with_little_memory_its_share():
    fast, slow = LinearCostModel(0.002, 0.001), LinearCostModel(0.002, 0.004)
    plan = plan_overlapped_micro_batches(96, [fast, slow], [16, 64])
    assert plan.per_replica_batch_sizes == (75, 21)
    assert plan.micro_batch_sizes == (15, 21) and plan.micro_batch_counts == (5, 1)
    assert [p.per_replica_batch_sizes for p in plan.sub_step_plans] == [(15, 21)] + [(15, 0)] * 4
    # max(5 micro-batches of 15 on the fast card, 21 examples in one step on the slow one) + the host's time
    assert plan.predicted_makespan_s == pytest.approx(max(5 * 0.017, 0.002 + 21 * 0.004))
    assert MicroBatchPlan.from_dict(plan.to_dict()) == plan
    assert "back to back" in str(plan)
    timed = plan_overlapped_micro_batches(96, [fast, slow], [16, 64], host_overhead_s=0.003)
    assert timed.predicted_makespan_s == pytest.approx(plan.predicted_makespan_s + 0.003)
    # More sub-steps than the engine allows: None (the barrier path's plan is used).
    assert plan_overlapped_micro_batches(96, [fast, slow], [16, 64], max_sub_steps=4) is None
    # More than one call holds: several calls of at most SUB_STEPS_PER_CALL sub-steps, whose barriers cost little
    # beside the same split without them (each call balanced, or every card's micro-batches spread evenly).
    big = plan_overlapped_micro_batches(2000, [fast, slow], [16, 64])
    assert big.num_calls == len(big.call_sub_steps) >= 2 and sum(big.call_sub_steps) == big.num_sub_steps
    assert all(1 <= len(call) <= SUB_STEPS_PER_CALL for call in big.calls) and big.global_batch_size == 2000
    from hetero_cs.planning.cost_model import MicroBatchedCostModel

    curves = [MicroBatchedCostModel(fast, 16), MicroBatchedCostModel(slow, 64)]
    no_barriers = solve_batch_split(curves, 2000, min_batch_size=0).predicted_makespan_s  # one call, were it possible
    assert no_barriers * (1 - 1e-9) <= big.predicted_makespan_s <= 1.1 * no_barriers
    assert MicroBatchPlan.from_dict(big.to_dict()) == big and f"in {big.num_calls} calls" in str(big)
    with pytest.raises(ConfigError, match="call_sub_steps"):
        MicroBatchPlan(big.sub_step_plans, overlapped=True, call_sub_steps=(1,))


def test_overlapped_plans_refuse_bad_input():
    fast = LinearCostModel(0.002, 0.001)
    with pytest.raises(ConfigError, match="global_batch_size must be an integer >= 1"):
        plan_overlapped_micro_batches(0, [fast, fast], [4, 4])
    with pytest.raises(ConfigError, match="one entry per replica"):
        plan_overlapped_micro_batches(8, [fast, fast], [4])
    with pytest.raises(InfeasiblePlanError, match="No replica can hold one example"):
        plan_overlapped_micro_batches(8, [fast, fast], [0, 0])


def test_a_micro_batched_cost_model_is_exact_for_lines_and_non_decreasing_for_any_curve():
    from hetero_cs.planning.cost_model import MicroBatchedCostModel, PiecewiseLinearCostModel

    line = MicroBatchedCostModel(LinearCostModel(0.010, 0.001), 16)
    assert line.predict_step_time_s(16) == pytest.approx(0.026)
    assert line.predict_step_time_s(17) == pytest.approx(2 * 0.010 + 17 * 0.001)
    assert line.micro_batches(35) == [12, 12, 11] and line.micro_batches(0) == []
    # A convex curve: two half micro-batches cost less than one full one; the model stays non-decreasing.
    convex = MicroBatchedCostModel(PiecewiseLinearCostModel((1, 8, 16), (0.001, 0.002, 0.050)), 16)
    times = [convex.predict_step_time_s(b) for b in range(0, 80)]
    assert all(b >= a for a, b in zip(times, times[1:]))
    with pytest.raises(Exception, match="max_micro_batch_size must be an integer >= 1"):
        MicroBatchedCostModel(LinearCostModel(0.01, 0.001), 0)


def test_a_flat_calibrated_line_micro_batched_stays_non_decreasing_and_solves():
    """Calibration's non-negative fit gives c = 0 on a launch-bound card; micro-batched, 2 t(10) + 7 t(9) for 83
    examples rounded one ulp above 3 t(10) + 6 t(9) for 84, and the solver refused the plan (InvalidCostModelError)."""
    from hetero_cs.planning.cost_model import MicroBatchedCostModel

    flat = MicroBatchedCostModel(LinearCostModel(0.0915, 0.0), 10)
    times = [flat.predict_step_time_s(b) for b in range(0, 600)]
    assert all(b >= a for a, b in zip(times, times[1:]))
    plan = solve_batch_split(idle_free([flat] * 3), 512, min_batch_size=0)
    assert sum(plan.per_replica_batch_sizes) == 512


def test_an_overlapped_plan_on_lines_with_a_tiny_slope_is_solved_not_a_stop_iteration():
    """Slopes a millionth of the fixed cost (a launch-bound model): float rounding left no candidate makespan holding
    B in the closed form, whose StopIteration fit took for an exhausted dataset ("the dataset is empty")."""
    models = idle_free([LinearCostModel(0.0837885875453173, 1e-07), LinearCostModel(0.08528832539122536, 1e-07),
                        LinearCostModel(0.022853792012113114, 1e-10)])
    plan = plan_overlapped_micro_batches(692, models, [14, 12, 15], single_step_makespan_s=None)
    assert plan is not None and sum(plan.per_replica_batch_sizes) == 692
