"""Micro-batched steps reach the monitor and re-plan when a card drifts (pure: injected step times)."""

import pytest

from hetero_cs.errors import ConfigError
from hetero_cs.planning.balancer import Balancer
from hetero_cs.planning.cost_model import LinearCostModel, MicroBatchedCostModel
from hetero_cs.planning.monitor import StepTimeMonitor
from hetero_cs.planning.solver import solve_batch_split

MODELS = [LinearCostModel(0.002, 1e-4), LinearCostModel(0.002, 4e-4), LinearCostModel(0.002, 4e-4)]
CAPS = [16, 64, 64]
B = 128


def chain_s(i, b, slow=1.0):
    """Replica i's true time for b examples in near-equal micro-batches within its cap, and their count."""
    if b == 0:
        return 0.0, 0
    k = -(-b // CAPS[i])
    q, r = divmod(b, k)
    return slow * (r * MODELS[i].predict_step_time_s(q + 1) + (k - r) * MODELS[i].predict_step_time_s(q)), k


def solved(models):
    micro = [MicroBatchedCostModel(m, cap) for m, cap in zip(models, CAPS)]
    return list(solve_batch_split(micro, B, min_batch_size=0).per_replica_batch_sizes)


def test_a_micro_batched_step_counts_whole_but_its_speeds_come_from_the_mean_micro_batch():
    monitor = StepTimeMonitor(3)
    times = [chain_s(i, b)[0] for i, b in enumerate([80, 24, 24])]
    monitor.record_micro_batched_step([80, 24, 24], times, [5, 1, 1])
    sample = monitor.last_step()
    assert sample.per_replica_micro_batches == (5, 1, 1)
    assert sample.makespan_s == pytest.approx(max(times))  # the step's own makespan
    models = monitor.updated_cost_models(MODELS)
    # Each card measured exactly as modelled per micro-batch: no correction, although 5 micro-batches of 16 take
    # 5 fixed costs (a one-step reading of 80 examples would call the first card 1.8x slow).
    for model, base in zip(models, MODELS):
        assert model.predict_step_time_s(16) == pytest.approx(base.predict_step_time_s(16))


@pytest.mark.parametrize("bad", [
    dict(batch_sizes=[80, 24], step_times_s=[0.1, 0.1], micro_batches=[5, 1]),  # not R values
    dict(batch_sizes=[80, 24, 24], step_times_s=[0.1, -1.0, 0.1], micro_batches=[5, 1, 1]),
    dict(batch_sizes=[80, 24, 24], step_times_s=[0.1, 0.1, 0.1], micro_batches=[0, 1, 1]),  # 80 examples in none
])
def test_a_malformed_micro_batched_step_is_refused(bad):
    with pytest.raises(ConfigError, match="A micro-batched step needs, per replica"):
        StepTimeMonitor(3).record_micro_batched_step(**bad)


def test_a_card_that_slows_down_under_micro_batches_is_planned_again():
    balancer = Balancer(3, idle_replicas_free=True)
    balancer.set_cost_models(MODELS, max_batch_sizes=CAPS, reference_batch_size=B)
    split = solved(MODELS)
    assert split[0] > CAPS[0]  # the first card runs micro-batches
    replanned_at = None
    for step in range(60):
        slow = 3.0 if step >= 10 else 1.0
        times, counts = zip(*[chain_s(i, b, slow if i == 0 else 1.0) for i, b in enumerate(split)])
        if balancer.record_micro_batched_step(split, times, counts):
            replanned_at = step if replanned_at is None else replanned_at
            split = solved(balancer._cost_models)
    assert replanned_at is not None and 10 < replanned_at <= 20
    assert balancer.micro_batched_replans == 1
    assert balancer.cost_models[0].predict_step_time_s(16) == pytest.approx(3 * MODELS[0].predict_step_time_s(16))
    assert split[0] < solved(MODELS)[0]
    # Steady again: no further re-plan.
    assert all(not balancer.record_micro_batched_step(split, *zip(*[chain_s(i, b, 3.0 if i == 0 else 1.0)
                                                                    for i, b in enumerate(split)]))
               for _ in range(30))


def test_no_re_plan_without_re_balancing_or_with_fixed_shares():
    for balancer in (Balancer(3, rebalance=False), Balancer(3, shares=[1, 1, 1])):
        balancer.set_cost_models(MODELS, max_batch_sizes=CAPS, reference_batch_size=B)
        split = [64, 32, 32]
        for _ in range(40):
            times, counts = zip(*[chain_s(i, b, 3.0 if i == 0 else 1.0) for i, b in enumerate(split)])
            assert not balancer.record_micro_batched_step(split, times, counts)
        assert balancer.monitor.last_step().per_replica_micro_batches == (4, 1, 1)


def test_a_card_held_at_its_cap_that_measures_faster_than_its_model_gets_micro_batches_again():
    # The models in force say the first card is 3x slower than it is (it drifted, then recovered): the one-step
    # plan holds it at its cap of 16, where the one-step re-planner gains nothing by moving it.
    stale = [LinearCostModel(0.006, 3e-4), MODELS[1], MODELS[2]]
    balancer = Balancer(3, idle_replicas_free=True)
    balancer.set_cost_models(MODELS, max_batch_sizes=CAPS, reference_batch_size=B)
    balancer._cost_models = stale  # as a re-plan while it drifted left them
    balancer._commit(balancer._solve(B))
    sizes = balancer.plan.per_replica_batch_sizes
    assert sizes[0] == CAPS[0]
    assert not balancer.consider_micro_batched_models(B)  # no samples yet
    for step in range(8):
        for i, b in enumerate(sizes):
            balancer.record_step_time(i, b, MODELS[i].predict_step_time_s(b), step_key=step)
    assert balancer.consider_micro_batched_models(B)
    assert balancer.micro_batched_replans == 1
    assert balancer.cost_models[0].predict_step_time_s(16) == pytest.approx(MODELS[0].predict_step_time_s(16))
    assert not balancer.consider_micro_batched_models(B)  # the models now describe the cards: nothing more


def test_models_in_force_that_predict_no_time_leave_nothing_to_compare():
    # A card held at its cap, and models in force that predict 0 s for every slice (a user's LinearCostModel(0, 0)):
    # no card's model can be compared with its measured time, so there is nothing to re-plan (before, max() of no
    # ratios raised ValueError out of the step).
    balancer = Balancer(3, idle_replicas_free=True)
    balancer.set_cost_models(MODELS, max_batch_sizes=CAPS, reference_batch_size=B)
    balancer._commit(balancer._solve(B))
    sizes = balancer.plan.per_replica_batch_sizes
    assert sizes[0] == CAPS[0]
    balancer._cost_models = [LinearCostModel(0.0, 0.0)] * 3
    for step in range(8):
        for i, b in enumerate(sizes):
            balancer.record_step_time(i, b, MODELS[i].predict_step_time_s(b), step_key=step)
    assert not balancer.consider_micro_batched_models(B)
    assert balancer.micro_batched_replans == 0
