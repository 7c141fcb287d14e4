"""The chief's planner of the multi-worker strategy: probe splits, the fit, then the Balancer (no TensorFlow)."""

import math
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetero_cs.engine.multi_worker.cluster_planner import PROBE_FACTORS, WARMUP_STEPS, ClusterPlanner
from hetero_cs.planning.balancer import Balancer
from hetero_cs.planning.cost_model import LinearCostModel
from hetero_cs.planning.sampling import AGREEMENT_COST_S, MAX_AGREEMENT_INTERVAL_STEPS, TIMING_BUDGET


def _emulated_times(sizes, seconds_per_example=(1e-4, 4e-4, 2e-4), overhead_s=0.01):
    return [overhead_s + c * b for c, b in zip(seconds_per_example, sizes)]


def test_the_planner_imports_without_tensorflow():
    import subprocess

    code = (
        "import sys; sys.modules['tensorflow'] = None; sys.modules['keras'] = None\n"
        "from hetero_cs.engine.multi_worker.cluster_planner import ClusterPlanner; print('ok')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "ok", result.stderr


@given(B=st.integers(min_value=3, max_value=4096), R=st.integers(min_value=2, max_value=8))
@settings(max_examples=60, deadline=None)
def test_every_served_split_sums_to_the_batch_and_probes_vary_each_replica(B, R):
    planner = ClusterPlanner(Balancer(R, guard=False), calibrate=True)
    seen = [set() for _ in range(R)]
    for _ in range(WARMUP_STEPS + 6):
        sizes, _ = planner.sizes(B)
        assert sum(sizes) == B and len(sizes) == R and min(sizes) >= 0
        for i, b in enumerate(sizes):
            seen[i].add(b)
    if B >= 4 * R:  # enough examples that 0.5x, 1x and 1.5x of a share differ
        assert all(len(s) >= 2 for s in seen)


def test_probes_then_fit_then_the_balancer_serves_the_solved_plan(caplog):
    caplog.set_level("INFO", logger="hetero_cs.engine.multi_worker.cluster_planner")
    R, B = 3, 600
    balancer = Balancer(R, guard=False, rebalance=False)
    planner = ClusterPlanner(balancer, calibrate=True)
    served = []
    for step in range(WARMUP_STEPS + 6 + 2):
        sizes, index = planner.sizes(B)
        served.append(sizes)
        planner.report(index, _emulated_times(sizes))
    assert not planner.calibrating
    assert served[0] == (200, 200, 200)  # the warm-up step (tracing) is even
    assert len(set(served[WARMUP_STEPS:WARMUP_STEPS + 6])) > 1  # probes
    # The fitted models are the emulated lines, so the plan is the minimum-makespan split of those lines.
    plan = balancer.plan.per_replica_batch_sizes
    assert served[-1] == plan
    times = _emulated_times(plan)
    assert max(times) - min(times) < 4e-4 + 1e-12  # finish together within one example of the slowest
    assert plan[0] > plan[2] > plan[1]
    # The fit is logged in calibration's one printed form (a = overhead, c = per example; the emulated lines).
    assert ("replica 0: a=10.000 ms c=0.1000 ms/ex; replica 1: a=10.000 ms c=0.4000 ms/ex; "
            "replica 2: a=10.000 ms c=0.2000 ms/ex") in caplog.text, caplog.text


def test_untimed_reports_are_ignored_and_a_partial_batch_is_not_a_probe():
    planner = ClusterPlanner(Balancer(2, guard=False), calibrate=True)
    planner.sizes(100)  # warm-up, sets the reference size
    sizes, index = planner.sizes(37)  # a partial batch: the Balancer's plan for 37
    assert sum(sizes) == 37
    planner.report(index, [0.0, 0.0])  # not timed (e.g. an evaluate step): nothing recorded
    assert planner.calibrating


def test_without_calibration_the_balancer_serves_from_the_first_step():
    balancer = Balancer(2, auto_balance=False)
    planner = ClusterPlanner(balancer, calibrate=False)
    assert planner.sizes(7)[0] == (4, 3)
    assert planner.sizes(7)[1] == 1


def test_probe_factors_cover_below_and_above_the_even_share():
    assert min(PROBE_FACTORS) < 1.0 < max(PROBE_FACTORS)
    with pytest.raises(ValueError, match="probe_steps"):
        ClusterPlanner(Balancer(2), calibrate=True, probe_steps=2)


@pytest.mark.parametrize("B", [1, 2, 3, 5])
def test_a_global_batch_too_small_to_probe_every_replica_keeps_the_even_split(B):
    # Regression: B=1 on 6 replicas gave probe steps with 0-example slices, and the fit raised ConfigError in the
    # chief's input pipeline (which ended every worker).
    R = 6 if B < 5 else 3
    balancer = Balancer(R, guard=False)
    planner = ClusterPlanner(balancer, calibrate=True)
    for _ in range(WARMUP_STEPS + 6 + 2):
        sizes, index = planner.sizes(B)
        assert sum(sizes) == B
        planner.report(index, _emulated_times(sizes, seconds_per_example=(1e-4,) * R))
    assert not planner.calibrating


def test_every_step_agrees_while_calibrating_and_deciding_then_one_in_n():
    # The chief's hold: 0 (agree next step too) through the warm-up, the probes and the guard's trial, while the
    # monitor's window fills; then N - 1 with N the smallest interval whose agreement costs <= 1 % of the step.
    R, B = 3, 600
    balancer = Balancer(R, rebalance=True)
    planner = ClusterPlanner(balancer, calibrate=True)
    holds = []
    for _ in range(WARMUP_STEPS + 6 + 40):
        sizes, index = planner.sizes(B)
        holds.append(planner.hold_steps())
        planner.report(index, _emulated_times(sizes))
    assert holds[:WARMUP_STEPS + 6] == [0] * (WARMUP_STEPS + 6)  # calibrating
    assert balancer.last_guard_decision is not None and not balancer.guard.in_trial
    makespan = balancer.monitor.last_step().makespan_s  # 44 ms: 8 ms / 1 % of it -> one agreement in 19 steps
    expected = math.ceil(AGREEMENT_COST_S / (TIMING_BUDGET * makespan)) - 1
    assert 1 <= expected < MAX_AGREEMENT_INTERVAL_STEPS
    assert holds[-1] == expected
    first_hold = next(i for i, h in enumerate(holds) if h > 0)
    assert first_hold > WARMUP_STEPS + 6 + 3  # the guard's trial (several steps) agreed every step
    assert all(h > 0 for h in holds[first_hold:])


def test_a_guard_trial_started_by_a_replan_makes_every_step_agree_again():
    R, B = 3, 600
    balancer = Balancer(R, rebalance=True)
    planner = ClusterPlanner(balancer, calibrate=True)
    for _ in range(WARMUP_STEPS + 6 + 40):
        sizes, index = planner.sizes(B)
        planner.report(index, _emulated_times(sizes))
    assert planner.hold_steps() > 0
    # The chief's re-plan (here: new models as a re-plan would bring, tried by the guard) needs every step's times.
    balancer.set_cost_models([LinearCostModel(0.01, c) for c in (4e-4, 1e-4, 2e-4)], trial=True)
    planner.sizes(B)
    assert balancer.guard.in_trial and planner.hold_steps() == 0


def test_without_a_measured_step_every_step_agrees():
    # A fixed split is never timed: no makespan is known, so nothing sizes a hold and every step agrees.
    balancer = Balancer(2, shares=[3, 1])
    planner = ClusterPlanner(balancer, calibrate=False)
    assert planner.sizes(8)[0] == (6, 2)
    assert not balancer.samples_needed() and planner.hold_steps() == 0


def test_times_of_a_step_cut_otherwise_than_served_are_dropped():
    # Within a hold, a last partial batch is cut in proportion to the held split; its times reach the chief with
    # the agreement after it, paired with the split that agreement served, and must not be read as that split's.
    balancer = Balancer(2, auto_balance=False, rebalance=False)
    planner = ClusterPlanner(balancer, calibrate=False)
    sizes, index = planner.sizes(100)
    planner.report(index, [0.05, 0.05], slice_sizes=[30, 29])  # a held batch of 59
    assert balancer.monitor.num_samples == 0
    sizes, index = planner.sizes(100)
    planner.report(index, [0.05, 0.05], slice_sizes=sizes)
    assert balancer.monitor.num_samples == 1


def _micro_batched_times(sizes, caps, per_step_s=(0.004, 0.002), per_example_s=(1e-4, 4e-4)):
    """Each replica's slice as near-equal micro-batches within its cap, each one step of its line, back to back."""
    from hetero_cs.planning.cost_model import near_equal_micro_batches

    return [sum(a + c * m for m in near_equal_micro_batches(b, cap))
            for b, cap, a, c in zip(sizes, caps, per_step_s, per_example_s)]


def test_micro_batched_probes_fit_each_cards_own_line_and_plans_price_micro_batches():
    # Replica 0 is 4x faster per example but holds 8 examples at once. Its probes run 2-6 micro-batches; the fit takes
    # each probe's mean micro-batch, so it finds the card's own line (a per-step fixed cost, then a slope), and the
    # plans give it more than its cap, priced as micro-batches back to back.
    from hetero_cs.planning.cost_model import MicroBatchedCostModel

    R, B, caps = 2, 64, [8, None]
    balancer = Balancer(R, guard=False, rebalance=False)
    planner = ClusterPlanner(balancer, calibrate=True)
    planner.set_memory_caps(caps, micro_batched=True)
    assert balancer.max_batch_sizes == [None, None]  # only a cap of 0 would bind a split
    for _ in range(WARMUP_STEPS + 6 + 1):
        sizes, index = planner.sizes(B)
        planner.report(index, _micro_batched_times(sizes, caps))
    models = balancer.calibrated_models
    assert isinstance(models[0], MicroBatchedCostModel) and models[0].max_micro_batch_size == 8
    assert models[0].base.predict_step_time_s(8) == pytest.approx(0.004 + 8e-4, rel=0.05)
    assert not isinstance(models[1], MicroBatchedCostModel)
    first = balancer.plan.per_replica_batch_sizes[0]
    assert first > 8  # past its cap: micro-batched
    best = min(range(B + 1), key=lambda b: max(_micro_batched_times([b, B - b], caps)))
    assert max(_micro_batched_times([first, B - first], caps)) == pytest.approx(
        max(_micro_batched_times([best, B - best], caps)), rel=0.05)


def test_capped_probes_stay_within_the_caps_and_a_card_that_holds_none_takes_none():
    R, B, caps = 3, 60, [0, 25, None]
    balancer = Balancer(R, guard=False, rebalance=False)
    planner = ClusterPlanner(balancer, calibrate=True)
    planner.set_memory_caps(caps, micro_batched=False)
    for _ in range(WARMUP_STEPS + 6 + 1):
        sizes, index = planner.sizes(B)
        assert sum(sizes) == B and sizes[0] == 0 and sizes[1] <= 25, sizes
        planner.report(index, _emulated_times(sizes))
    assert not planner.calibrating and balancer.max_batch_sizes == caps
    assert balancer.plan.per_replica_batch_sizes[0] == 0


def test_micro_batched_caps_of_zero_keep_that_card_out():
    R, B, caps = 2, 40, [0, 4]
    balancer = Balancer(R, guard=False, rebalance=False)
    planner = ClusterPlanner(balancer, calibrate=True)
    planner.set_memory_caps(caps, micro_batched=True)
    for _ in range(WARMUP_STEPS + 6 + 1):
        sizes, index = planner.sizes(B)
        assert sizes == (0, 40), sizes
        idle_s = 1e-4  # a replica with no micro-batch still reports its (short) step
        planner.report(index, [t or idle_s for t in _micro_batched_times(sizes, [1, 4])])
    assert not planner.calibrating
    assert balancer.plan.per_replica_batch_sizes == (0, 40)


def test_a_card_capped_far_below_its_share_is_probed_around_its_cap_to_find_its_fixed_cost():
    # Cap 4 against an even share of 16: probes at 0.5-1.5x the share would all run micro-batches of about 4, and the
    # fit could not tell the per-micro-batch fixed cost (40 ms here) from the per-example cost. Probes around the cap
    # give micro-batches of distinct sizes, and the fit finds both.
    R, B, caps = 2, 32, [4, None]
    balancer = Balancer(R, guard=False, rebalance=False)
    planner = ClusterPlanner(balancer, calibrate=True)
    planner.set_memory_caps(caps, micro_batched=True)
    served = []
    for _ in range(WARMUP_STEPS + 6 + 1):
        sizes, index = planner.sizes(B)
        served.append(sizes)
        planner.report(index, _micro_batched_times(sizes, caps, per_step_s=(0.040, 0.040),
                                                   per_example_s=(0.001, 0.004)))
    probes = served[WARMUP_STEPS:WARMUP_STEPS + 6]
    assert {p[0] for p in probes} <= set(range(1, 8)), probes  # about 0.5, 1 and 1.5 times the cap
    base = balancer.calibrated_models[0].base
    assert base.predict_step_time_s(0) == pytest.approx(0.040, rel=0.05)  # the fixed cost a micro-batch pays
    assert base.predict_step_time_s(4) == pytest.approx(0.044, rel=0.05)


@given(B=st.integers(min_value=1, max_value=2048),
       caps=st.lists(st.one_of(st.none(), st.integers(min_value=0, max_value=300)), min_size=2, max_size=5))
@settings(max_examples=120, deadline=None)
def test_micro_batched_probe_splits_sum_to_the_batch_and_leave_cards_that_hold_none_out(B, caps):
    if all(cap == 0 for cap in caps):
        return
    planner = ClusterPlanner(Balancer(len(caps), guard=False), calibrate=True)
    planner.set_memory_caps(caps, micro_batched=True)
    for _ in range(WARMUP_STEPS + 6):
        sizes, _ = planner.sizes(B)
        assert sum(sizes) == B and min(sizes) >= 0, (sizes, caps)
        assert all(b == 0 for b, cap in zip(sizes, caps) if cap == 0), (sizes, caps)
