"""solve_batch_split: the contract every solver meets, worked examples, the tie rule, errors, evaluation counts."""

import doctest
import heapq
import math

import pytest

from hetero_cs.planning import solver as solver_module
from hetero_cs.planning.cost_model import LinearCostModel, PiecewiseLinearCostModel, ScaledCostModel
from hetero_cs.errors import ConfigError, InfeasiblePlanError, InvalidCostModelError
from hetero_cs.planning.plan import BatchPlan, even_batch_split
from hetero_cs.planning.solver import plan_from_split
from hetero_cs.planning.solver import ideal_makespan_s, solve_batch_split


class Opaque:
    """Hides a model's type so the solver takes its generic path; counts evaluations."""

    def __init__(self, model):
        self.model = model
        self.evaluations = 0

    def predict_step_time_s(self, batch_size):
        self.evaluations += 1
        return self.model.predict_step_time_s(batch_size)


class StepCostModel:
    """base_s + step_s * ceil(b / width): a stepped curve (kernels switch tile sizes), not piecewise linear."""

    def __init__(self, base_s, step_s, width):
        self.base_s, self.step_s, self.width = base_s, step_s, width

    def predict_step_time_s(self, batch_size):
        return self.base_s + self.step_s * (-(-batch_size // self.width))


class Table:
    """Step times from a table (index = batch size); for hand-made bad models."""

    def __init__(self, times):
        self.times = times

    def predict_step_time_s(self, batch_size):
        return self.times[batch_size]


def greedy_reference(cost_models, global_batch_size, *, max_batch_sizes=None, min_batch_size=1, multiple_of=1):
    """The documented greedy, one step at a time (slow but obviously right): a solver for the contract suite."""
    R, B, k = len(cost_models), global_batch_size, multiple_of
    caps = max_batch_sizes or [None] * R
    rem = B % k
    remainder_replica = None
    if rem:
        first = rem + -(-max(0, min_batch_size - rem) // k) * k
        remainder_replica = next(i for i in range(R) if caps[i] is None or first <= caps[i])
    offsets = [rem if i == remainder_replica else 0 for i in range(R)]
    sizes = [o + -(-max(0, min_batch_size - o) // k) * k for o in offsets]
    heap = [(cost_models[i].predict_step_time_s(sizes[i] + k), sizes[i] + k, i) for i in range(R)]
    heapq.heapify(heap)
    for _ in range((B - sum(sizes)) // k):
        while True:
            t, b, i = heapq.heappop(heap)
            if caps[i] is None or b <= caps[i]:
                break
        sizes[i] = b
        heapq.heappush(heap, (cost_models[i].predict_step_time_s(b + k), b + k, i))
    return plan_from_split(tuple(sizes), cost_models)


def generic_path(cost_models, global_batch_size, **kwargs):
    return solve_batch_split([Opaque(m) for m in cost_models], global_batch_size, **kwargs)


SOLVERS = {"closed_form": solve_batch_split, "generic": generic_path, "greedy_reference": greedy_reference}

A10_T4_P100 = [LinearCostModel(0.005, 0.01 / tflops) for tflops in (31.2, 8.1, 9.3)]
FLAT_THEN_RISING = [PiecewiseLinearCostModel((1, 32, 64, 256), (0.010, 0.010, 0.012, 0.040)),
                    PiecewiseLinearCostModel((1, 16, 256), (0.008, 0.008, 0.090)),
                    ScaledCostModel(PiecewiseLinearCostModel((1, 32, 64, 256), (0.010, 0.010, 0.012, 0.040)), 1.5)]

CASES = [
    # (cost models, B, solver keyword arguments)
    (A10_T4_P100, 256, {}),
    (A10_T4_P100, 7, {}),
    (A10_T4_P100, 3, {}),
    (A10_T4_P100, 256, {"max_batch_sizes": [100, None, 90]}),
    (A10_T4_P100, 256, {"multiple_of": 8}),
    (A10_T4_P100, 250, {"multiple_of": 8, "max_batch_sizes": [None, 64, 64]}),
    (A10_T4_P100, 2, {"min_batch_size": 0}),
    (FLAT_THEN_RISING, 96, {}),
    (FLAT_THEN_RISING, 600, {"max_batch_sizes": [256, 256, 256]}),
    ([LinearCostModel(0.01, 0.001)] * 5, 23, {}),
    ([LinearCostModel(0.01, 0.0)] * 4, 64, {"min_batch_size": 0}),
    ([LinearCostModel(0.0, 1.0), LinearCostModel(1000.0, 0.0)], 9, {"min_batch_size": 0}),
    ([LinearCostModel(0.02, 0.001), LinearCostModel(0.001, 0.0001)] * 4, 4096, {"multiple_of": 32}),
]
CASE_IDS = [f"case{i}" for i in range(len(CASES))]


def _makespan(models, sizes):
    return max(m.predict_step_time_s(b) for m, b in zip(models, sizes))


# ------------------------------------------------------------------------------------------------ contract suite
@pytest.mark.parametrize("solver", SOLVERS.values(), ids=SOLVERS.keys())
@pytest.mark.parametrize("models,B,kwargs", CASES, ids=CASE_IDS)
class TestContract:
    def test_slices_sum_to_the_global_batch(self, solver, models, B, kwargs):
        plan = solver(models, B, **kwargs)
        assert isinstance(plan, BatchPlan)
        assert plan.global_batch_size == B and sum(plan.per_replica_batch_sizes) == B
        assert plan.num_replicas == len(models)

    def test_slices_respect_caps_minimum_and_multiple(self, solver, models, B, kwargs):
        plan = solver(models, B, **kwargs)
        caps = kwargs.get("max_batch_sizes") or [None] * len(models)
        k = kwargs.get("multiple_of", 1)
        for b, cap in zip(plan.per_replica_batch_sizes, caps):
            assert b >= kwargs.get("min_batch_size", 1)
            assert cap is None or b <= cap
        off_grid = [i for i, b in enumerate(plan.per_replica_batch_sizes) if b % k]
        assert len(off_grid) == (0 if B % k == 0 else 1)

    def test_is_deterministic(self, solver, models, B, kwargs):
        assert solver(list(models), B, **kwargs) == solver(list(models), B, **kwargs)

    def test_never_worse_than_the_even_split_when_that_is_legal(self, solver, models, B, kwargs):
        plan = solver(models, B, **kwargs)
        even = even_batch_split(B, len(models))
        caps = kwargs.get("max_batch_sizes") or [None] * len(models)
        legal = (all(b >= kwargs.get("min_batch_size", 1) for b in even)
                 and all(c is None or b <= c for b, c in zip(even, caps))
                 and sum(b % kwargs.get("multiple_of", 1) != 0 for b in even) == 0)
        if legal:
            assert plan.predicted_makespan_s <= plan.even_split_makespan_s
        assert plan.even_split_makespan_s == _makespan(models, even)

    def test_predictions_match_the_models(self, solver, models, B, kwargs):
        plan = solver(models, B, **kwargs)
        times = tuple(m.predict_step_time_s(b) for m, b in zip(models, plan.per_replica_batch_sizes))
        assert plan.predicted_step_times_s == times
        assert plan.predicted_makespan_s == max(times)
        assert plan.ideal_makespan_s <= plan.predicted_makespan_s


@pytest.mark.parametrize("models,B,kwargs", CASES, ids=CASE_IDS)
def test_both_paths_and_the_reference_give_the_same_split(models, B, kwargs):
    splits = {name: solver(models, B, **kwargs).per_replica_batch_sizes for name, solver in SOLVERS.items()}
    assert len(set(splits.values())) == 1, splits


# ----------------------------------------------------------------------------------------------- worked examples
def test_docstring_examples_hold():
    result = doctest.testmod(solver_module)
    assert result.attempted > 0 and result.failed == 0


def test_a10_t4_p100_split_is_better_than_even():
    plan = solve_batch_split(A10_T4_P100, 256)
    assert plan.per_replica_batch_sizes == (165, 42, 49)
    assert plan.predicted_speedup_vs_even > 1.8
    assert 0.99 < plan.efficiency <= 1.0


def test_identical_replicas_get_the_even_split():
    for B in (1, 5, 64, 65):
        assert solve_batch_split([LinearCostModel(0.01, 0.001)] * 4, B, min_batch_size=0).per_replica_batch_sizes \
            == even_batch_split(B, 4)


def test_flat_curves_are_shared_round_robin_not_piled_on_replica_0():
    # Every slice costs the same (all optimal); the tie rule prefers the smaller slice, so the split stays even.
    plan = solve_batch_split([PiecewiseLinearCostModel((1, 64), (0.01, 0.01))] * 3, 60)
    assert plan.per_replica_batch_sizes == (20, 20, 20)


def test_caps_move_examples_to_the_other_replicas():
    plan = solve_batch_split(A10_T4_P100, 256, max_batch_sizes=[100, None, None])
    assert plan.per_replica_batch_sizes[0] == 100
    assert plan.predicted_makespan_s > solve_batch_split(A10_T4_P100, 256).predicted_makespan_s


def test_a_hopelessly_slow_replica_is_left_idle_with_min_batch_size_0():
    models = [LinearCostModel(0.001, 0.001), LinearCostModel(0.001, 10.0)]
    plan = solve_batch_split(models, 32, min_batch_size=0)
    assert plan.per_replica_batch_sizes == (32, 0)
    assert plan.predicted_step_times_s == (0.033, 0.001)  # the idle replica still costs t(0)


def test_idle_cost_counts_in_the_makespan():
    # Replica 1 costs 5 s even idle, so nothing beats 5 s; the greedy hands each example to the replica that
    # finishes it soonest (replica 0: 1..4 s), and replica 1 idles.
    models = [LinearCostModel(0.0, 1.0), LinearCostModel(5.0, 0.0)]
    plan = solve_batch_split(models, 4, min_batch_size=0)
    assert plan.predicted_makespan_s == 5.0
    assert plan.per_replica_batch_sizes == (4, 0)


def test_remainder_goes_to_replica_0():
    plan = solve_batch_split([LinearCostModel(0.0, 1.0)] * 3, 50, multiple_of=8)
    assert plan.per_replica_batch_sizes[0] % 8 == 50 % 8
    assert all(b % 8 == 0 for b in plan.per_replica_batch_sizes[1:])


def test_remainder_goes_to_the_first_replica_whose_cap_admits_it():
    # B % 8 = 6 and min_batch_size=1: replica 0 (cap 5) cannot hold a slice of 6 (mod 8), replica 1 can.
    plan = solve_batch_split([LinearCostModel(0.0, 1.0)] * 3, 46, multiple_of=8, max_batch_sizes=[5, None, None],
                             min_batch_size=0)
    assert plan.per_replica_batch_sizes[0] % 8 == 0
    assert plan.per_replica_batch_sizes[1] % 8 == 6


def test_single_replica_takes_everything():
    plan = solve_batch_split([LinearCostModel(0.5, 0.25)], 10)
    assert plan.per_replica_batch_sizes == (10,)
    assert plan.predicted_makespan_s == plan.ideal_makespan_s == plan.even_split_makespan_s == 3.0


def test_stepped_costs_are_solved_exactly():
    models = [StepCostModel(0.0, 1.0, 8), StepCostModel(0.0, 1.0, 3)]
    plan = solve_batch_split(models, 22)
    assert plan.predicted_makespan_s == 2.0  # (16, 6): both two steps; anything else needs three
    assert plan.per_replica_batch_sizes == (16, 6)


def test_ideal_is_the_classic_formula_for_linear_costs():
    a = [0.004, 0.001, 0.002]
    c = [1e-4, 3e-4, 2e-4]
    models = [LinearCostModel(ai, ci) for ai, ci in zip(a, c)]
    expected = (1000 + sum(ai / ci for ai, ci in zip(a, c))) / sum(1 / ci for ci in c)
    assert ideal_makespan_s(models, 1000, min_batch_size=0) == pytest.approx(expected, rel=1e-12)
    assert ideal_makespan_s([Opaque(m) for m in models], 1000, min_batch_size=0) == pytest.approx(expected, rel=1e-12)


def test_ideal_respects_the_minimum_slice():
    # With min_batch_size=0, the slow replica would idle at t(0) = 0; with 1 it must run one example (10 s).
    models = [LinearCostModel(0.0, 1.0), LinearCostModel(0.0, 10.0)]
    assert ideal_makespan_s(models, 4, min_batch_size=0) == pytest.approx(4 / 1.1)
    assert ideal_makespan_s(models, 4, min_batch_size=1) == 10.0


def test_uncertified_warm_start_falls_back_to_the_generic_selection(monkeypatch):
    # A warm start far above the optimum cannot be certified; the answer must not change.
    expected = solve_batch_split(A10_T4_P100, 256)
    monkeypatch.setattr(solver_module, "_WARM_START_MARGIN", -0.5)
    assert solve_batch_split(A10_T4_P100, 256) == expected


def test_warm_start_is_certified_when_an_idle_slice_sets_the_makespan(caplog):
    # Regression: the closed-form path once started from the ideal bound (here 2.0 s, replica 1's idle time), which
    # handed replica 2 examples that a flat replica 0 finishes sooner, failed its certificate and fell back.
    models = [LinearCostModel(1.0, 0.0), LinearCostModel(2.0, 0.0), LinearCostModel(1.5, 1e-4)]
    with caplog.at_level("DEBUG", logger="hetero_cs.planning.solver"):
        plan = solve_batch_split(models, 4096)
    assert plan.per_replica_batch_sizes == (4094, 1, 1)
    assert plan.predicted_makespan_s == 2.0
    assert "not certified" not in caplog.text


# ------------------------------------------------------------------------------------------- evaluation counting
@pytest.mark.parametrize("R,B", [(8, 4096), (64, 65536)])
def test_generic_path_evaluates_each_model_o_log_b_times(R, B):
    models = [Opaque(LinearCostModel(0.001 * (1 + i % 5), 1e-5 * (1 + i % 7))) for i in range(R)]
    plan = solve_batch_split(models, B)
    evaluations = sum(m.evaluations for m in models)
    assert evaluations <= 3 * R * math.log2(B), evaluations
    assert plan.per_replica_batch_sizes == solve_batch_split([m.model for m in models], B).per_replica_batch_sizes


# ------------------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("B", [0, -3, 2.0, True])
def test_global_batch_size_must_be_a_positive_integer(B):
    with pytest.raises(ConfigError, match=r"global_batch_size must be an integer >= 1. Received: global_batch_size="):
        solve_batch_split(A10_T4_P100, B)


@pytest.mark.parametrize("kwargs,match", [
    ({"min_batch_size": -1}, "min_batch_size must be an integer >= 0"),
    ({"multiple_of": 0}, "multiple_of must be an integer >= 1"),
    ({"max_batch_sizes": [1, 2]}, r"len\(max_batch_sizes\)=2 but there are R=3 cost models"),
    ({"max_batch_sizes": [1, 2.5, None]}, r"max_batch_sizes\[1\] must be an integer in \[0, 2\*\*63\) .* or None"),
    # A negative cap was an InfeasiblePlanError whose fix (min_batch_size=0) was already the value in force.
    ({"max_batch_sizes": [-1, None, None]}, r"max_batch_sizes\[0\] must be an integer in \[0, 2\*\*63\) .* Received: "
                                            r"max_batch_sizes\[0\]=-1"),
    ({"max_batch_sizes": 8}, "sequence of R=3 caps"),
])
def test_bad_arguments_are_config_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        solve_batch_split(A10_T4_P100, 64, **kwargs)


def test_empty_cost_models_is_a_config_error():
    with pytest.raises(ConfigError, match="cost_models is empty: give one cost model per replica"):
        solve_batch_split([], 8)


def test_an_object_without_predict_is_an_invalid_cost_model():
    with pytest.raises(InvalidCostModelError, match=r"cost_models\[1\] has no predict_step_time_s method"):
        solve_batch_split([LinearCostModel(0.0, 1.0), "T4"], 8)


def test_batch_larger_than_the_caps_lists_each_cap_and_the_fix():
    with pytest.raises(InfeasiblePlanError,
                       match=r"global_batch_size=100 exceeds the total capacity: max_batch_sizes=\[32, 32, 16\] sum "
                             r"to 80 \(replica 0: 32, replica 1: 32, replica 2: 16\)\. Lower the global batch size "
                             r"to at most 80"):
        solve_batch_split(A10_T4_P100, 100, max_batch_sizes=[32, 32, 16])


def test_batch_smaller_than_the_minimum_slices():
    with pytest.raises(InfeasiblePlanError, match=r"global_batch_size=2 is less than num_replicas=3 x "
                                                  r"min_batch_size=1 = 3.*Pass min_batch_size=0"):
        solve_batch_split(A10_T4_P100, 2)


def test_cap_below_the_minimum_slice():
    with pytest.raises(InfeasiblePlanError, match=r"max_batch_sizes\[1\]=1 below min_batch_size=2"):
        solve_batch_split(A10_T4_P100, 64, max_batch_sizes=[None, 1, None], min_batch_size=2)


def test_multiple_of_that_no_split_can_meet():
    with pytest.raises(InfeasiblePlanError, match=r"smallest legal slices \[8, 8, 8\] sum to 24 > 16"):
        solve_batch_split(A10_T4_P100, 16, multiple_of=8)
    assert solve_batch_split(A10_T4_P100, 20, multiple_of=8).per_replica_batch_sizes == (4, 8, 8)
    with pytest.raises(InfeasiblePlanError, match=r"max_batch_sizes\[0\]=7 admits no slice that is a multiple of "
                                                  r"multiple_of=8"):
        solve_batch_split(A10_T4_P100, 64, multiple_of=8, max_batch_sizes=[7, None, None])
    with pytest.raises(InfeasiblePlanError, match=r"largest legal slices \[8, 8, 16\] sum to 32"):
        solve_batch_split(A10_T4_P100, 40, multiple_of=8, max_batch_sizes=[15, 15, 16])
    with pytest.raises(InfeasiblePlanError, match=r"slice of 4 \(mod 8\), at least 4 examples, but every cap is "
                                                  r"smaller"):
        solve_batch_split(A10_T4_P100, 4, multiple_of=8, max_batch_sizes=[3, 3, 3], min_batch_size=0)


@pytest.mark.parametrize("bad,match", [
    (Table([math.nan] * 100), r"cost_models\[1\]\.predict_step_time_s\(\d+\) returned nan"),
    (Table([-1.0] * 100), r"cost_models\[1\]\.predict_step_time_s\(\d+\) returned -1\.0"),
    (Table([math.inf] * 100), r"returned inf"),
    (Table([]), r"cost_models\[1\]\.predict_step_time_s\(\d+\) failed"),
])
def test_unusable_predictions_name_the_replica(bad, match):
    with pytest.raises(InvalidCostModelError, match=match):
        solve_batch_split([LinearCostModel(0.0, 1.0), bad], 40)


def test_decreasing_cost_names_the_replica_sizes_and_values():
    decreasing = Table([10.0 - 0.1 * b for b in range(100)])
    with pytest.raises(InvalidCostModelError, match=r"cost_models\[1\] predicts a shorter step for a larger batch: "
                                                    r"predict_step_time_s\(\d+\)=[\d.]+ s > "
                                                    r"predict_step_time_s\(\d+\)=[\d.]+ s.*isotonic fit"):
        solve_batch_split([LinearCostModel(0.0, 1.0), decreasing], 40)


def test_ideal_makespan_checks_its_arguments():
    with pytest.raises(InfeasiblePlanError, match="exceeds the total capacity"):
        ideal_makespan_s(A10_T4_P100, 100, max_batch_sizes=[1, 1, 1])
    with pytest.raises(ConfigError, match="cost_models is empty"):
        ideal_makespan_s([], 1)
