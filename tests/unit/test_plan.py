"""BatchPlan invariants and serialisation; the fixed splitting rules; plan_from_split."""

import dataclasses
import doctest
import json
import math

import numpy as np
import pytest

from hetero_cs.planning import plan as plan_module
from hetero_cs.planning.cost_model import LinearCostModel
from hetero_cs.errors import BatchSplitError, ConfigError, InvalidCostModelError
from hetero_cs.planning.plan import BatchPlan, even_batch_split, split_by_shares
from hetero_cs.planning.solver import plan_from_split


def _full_plan() -> BatchPlan:
    return BatchPlan((160, 48, 48), 256, predicted_makespan_s=0.0101, even_split_makespan_s=0.0155,
                     ideal_makespan_s=0.0100, predicted_step_times_s=(0.0101, 0.0099, 0.0095))


def test_docstring_examples_hold():
    result = doctest.testmod(plan_module)
    assert result.attempted > 0 and result.failed == 0


# ----------------------------------------------------------------------------------------------------- BatchPlan
def test_sizes_must_sum_to_the_global_batch():
    with pytest.raises(ConfigError, match=r"per_replica_batch_sizes=\(3, 4\) sum to 7, not global_batch_size=8"):
        BatchPlan((3, 4), 8)


@pytest.mark.parametrize("sizes,match", [
    ((), "non-empty sequence"),
    ("34", "non-empty sequence"),
    ((3, -1), r"integers >= 0.*\(1, -1\)"),
    ((3, 1.0), r"integers >= 0.*\(1, 1\.0\)"),
    ((True, 1), r"\(0, True\)"),
])
def test_sizes_must_be_non_negative_integers(sizes, match):
    with pytest.raises(ConfigError, match=match):
        BatchPlan(sizes, 2)


@pytest.mark.parametrize("global_batch_size", [0, -4, 4.0])
def test_global_batch_size_must_be_positive(global_batch_size):
    with pytest.raises(ConfigError, match="global_batch_size must be an integer > 0"):
        BatchPlan((0, 0), global_batch_size)


@pytest.mark.parametrize("name,value", [("predicted_makespan_s", -1.0), ("even_split_makespan_s", math.nan),
                                        ("ideal_makespan_s", math.inf), ("predicted_makespan_s", "1")])
def test_figures_must_be_finite_non_negative_seconds(name, value):
    with pytest.raises(ConfigError, match=rf"BatchPlan\.{name} must be None or a finite number of seconds"):
        BatchPlan((1, 1), 2, **{name: value})


def test_step_times_need_one_per_replica():
    with pytest.raises(ConfigError, match="one time per replica"):
        BatchPlan((1, 1), 2, predicted_step_times_s=(0.1,))


def test_plan_normalises_types():
    plan = BatchPlan([1, 2], 3, predicted_makespan_s=1, predicted_step_times_s=[1, 0])  # type: ignore[arg-type]
    assert plan.per_replica_batch_sizes == (1, 2)
    assert plan.predicted_makespan_s == 1.0 and isinstance(plan.predicted_makespan_s, float)
    assert plan.predicted_step_times_s == (1.0, 0.0)


def test_plan_accepts_numpy_arrays():
    plan = BatchPlan(np.array([3, 5]), np.int64(8), predicted_step_times_s=np.array([0.1, 0.2]))
    assert plan == BatchPlan((3, 5), 8, predicted_step_times_s=(0.1, 0.2))
    assert type(plan.per_replica_batch_sizes[0]) is int and type(plan.global_batch_size) is int


def test_plan_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        _full_plan().global_batch_size = 3  # type: ignore[misc]


def test_derived_figures():
    plan = _full_plan()
    assert plan.num_replicas == 3
    assert plan.replica_weights == (0.625, 0.1875, 0.1875)
    assert math.fsum(plan.replica_weights) == 1.0
    assert plan.predicted_speedup_vs_even == pytest.approx(0.0155 / 0.0101)
    assert plan.efficiency == pytest.approx(0.0100 / 0.0101)


def test_derived_figures_are_none_without_predictions():
    plan = BatchPlan((2, 2), 4)
    assert plan.predicted_speedup_vs_even is None and plan.efficiency is None
    zero = BatchPlan((2, 2), 4, predicted_makespan_s=0.0, even_split_makespan_s=0.0, ideal_makespan_s=0.0)
    assert zero.predicted_speedup_vs_even is None and zero.efficiency is None


@pytest.mark.parametrize("plan", [_full_plan(), BatchPlan((0, 5), 5), BatchPlan((7,), 7, ideal_makespan_s=0.1)])
def test_json_round_trip_is_exact(plan):
    assert BatchPlan.from_json(plan.to_json()) == plan
    assert BatchPlan.from_dict(plan.to_dict()) == plan
    assert json.loads(plan.to_json())["per_replica_batch_sizes"] == list(plan.per_replica_batch_sizes)


def test_from_dict_accepts_only_the_required_keys():
    assert BatchPlan.from_dict({"per_replica_batch_sizes": [1, 2], "global_batch_size": 3}) == BatchPlan((1, 2), 3)


@pytest.mark.parametrize("data,match", [
    ({"per_replica_batch_sizes": [1], "global_batch_size": 1, "makespan": 1.0}, r"unknown=\['makespan'\]"),
    ({"per_replica_batch_sizes": [1]}, r"missing=\['global_batch_size'\]"),
    ([1, 2], "needs a mapping"),
])
def test_from_dict_rejects_bad_dicts(data, match):
    with pytest.raises(ConfigError, match=match):
        BatchPlan.from_dict(data)


def test_from_json_rejects_text_that_is_not_json():
    with pytest.raises(ConfigError, match="needs a JSON object written by to_json"):
        BatchPlan.from_json("{not json")


def test_str_is_a_readable_table():
    text = str(_full_plan())
    lines = text.splitlines()
    assert lines[0] == "BatchPlan: global_batch_size=256 on 3 replicas"
    assert lines[1].split() == ["replica", "slice", "weight", "predicted", "step", "ms"]
    assert lines[2].split() == ["0", "160", "0.6250", "10.100"]
    assert "predicted makespan: 10.100 ms" in text
    assert "even split makespan: 15.500 ms" in text
    assert "ideal makespan: 10.000 ms" in text
    assert "predicted speedup vs even: 1.535x" in text
    assert "efficiency (ideal / predicted): 0.990" in text
    assert "n/a" in str(BatchPlan((1, 1), 2))


# --------------------------------------------------------------------------------------------- fixed split rules
@pytest.mark.parametrize("B,R,expected", [(10, 4, (3, 3, 2, 2)), (8, 4, (2, 2, 2, 2)), (2, 3, (1, 1, 0)),
                                          (0, 2, (0, 0)), (5, 1, (5,))])
def test_even_batch_split(B, R, expected):
    assert even_batch_split(B, R) == expected


@pytest.mark.parametrize("B,R,match", [(-1, 2, "global_batch_size must be an integer >= 0"),
                                       (4, 0, "num_replicas must be an integer >= 1"),
                                       (4.0, 2, "global_batch_size=4.0")])
def test_even_batch_split_rejects_bad_arguments(B, R, match):
    with pytest.raises(ConfigError, match=match):
        even_batch_split(B, R)


@pytest.mark.parametrize("B,shares,expected", [
    (10, [2, 1, 1], (5, 3, 2)),  # quotas 5, 2.5, 2.5: the tie goes to the lower index
    (10, [0.5, 0.25, 0.25], (5, 3, 2)),
    (7, [1, 0, 1], (4, 0, 3)),
    (3, [1, 1, 1, 1], (1, 1, 1, 0)),
    (100, [1 / 3, 1 / 3, 1 / 3], (34, 33, 33)),
    (0, [1, 2], (0, 0)),
])
def test_split_by_shares(B, shares, expected):
    assert split_by_shares(B, shares) == expected


@pytest.mark.parametrize("shares,match", [
    ([], "non-empty sequence of numbers"),
    ([1, -1], r"finite numbers >= 0.*\(1, -1\)"),
    ([1, math.nan], r"\(1, nan\)"),
    ([1, math.inf], r"\(1, inf\)"),
    (["1"], r"\(0, '1'\)"),
    ([0, 0.0], r"shares are all zero: shares=\[0, 0\.0\].*\[1\] \* num_replicas"),
])
def test_split_by_shares_rejects_bad_shares(shares, match):
    with pytest.raises(BatchSplitError, match=match):
        split_by_shares(8, shares)


# ----------------------------------------------------------------------------------------------- plan_from_split
def test_plan_from_split_without_models_has_no_predictions():
    plan = plan_from_split((3, 5))
    assert plan == BatchPlan((3, 5), 8)


def test_plan_from_split_with_models_fills_every_figure():
    models = [LinearCostModel(0.0, 0.001), LinearCostModel(0.0, 0.003)]
    plan = plan_from_split((2, 2), models)
    assert plan.predicted_step_times_s == (0.002, 0.006)
    assert plan.predicted_makespan_s == 0.006
    assert plan.even_split_makespan_s == 0.006
    assert plan.ideal_makespan_s == pytest.approx(0.003)  # x = (3, 1)
    assert plan.efficiency == pytest.approx(0.5)


def test_plan_from_split_ideal_respects_caps():
    models = [LinearCostModel(0.0, 0.001), LinearCostModel(0.0, 0.003)]
    plan = plan_from_split((2, 2), models, max_batch_sizes=[2, None])
    assert plan.ideal_makespan_s == pytest.approx(0.006)
    assert plan.efficiency == pytest.approx(1.0)


def test_plan_from_split_checks_lengths_and_slices():
    with pytest.raises(ConfigError, match=r"len\(cost_models\)=1, per_replica_batch_sizes=\(1, 1\)"):
        plan_from_split((1, 1), [LinearCostModel(0.0, 1.0)])
    with pytest.raises(ConfigError, match="integers >= 0"):
        plan_from_split((1, -1), [LinearCostModel(0.0, 1.0)] * 2)


def test_plan_from_split_rejects_a_bad_model():
    class Negative:
        def predict_step_time_s(self, batch_size):
            return -1.0

    with pytest.raises(InvalidCostModelError, match=r"cost_models\[1\]\.predict_step_time_s\(1\) returned -1\.0"):
        plan_from_split((1, 1), [LinearCostModel(0.0, 1.0), Negative()])


@pytest.mark.parametrize("shares,match", [
    ({1, 2, 3}, r"shares=\{1, 2, 3\} \(a set, which has no replica order\)"),
    (frozenset({1, 2}), r"\(a frozenset, which has no replica order\)"),
    ({"a": 2, "b": 1}, r"shares=\{'a': 2, 'b': 1\} \(a dict, which has no replica order\)"),
    ({"a": 2, "b": 1}.values(), r"\(a dict_values, not a sequence: make it a list\)"),
    ((s for s in [2, 1]), r"\(a generator, not a sequence: make it a list\)"),
])
def test_regression_unordered_shares_are_refused_not_reordered(shares, match):
    # split_by_shares(10, {3, 1, 2}) used to split (2, 3, 5): the set's iteration order, not the order written.
    with pytest.raises(BatchSplitError, match=match):
        split_by_shares(10, shares)


@pytest.mark.parametrize("shares,match", [
    ([10**400, 1], r"shares must be finite numbers >= 0.*\(offending \(replica, share\): \[\(0, 1000"),
    ([1e308, 1e308, 1], r"shares sum to more than a float holds: shares=\[1e\+308, 1e\+308, 1\]\. Only their ratios"),
    ([10**5000, 1], r"too large to print"),
])
def test_regression_huge_shares_are_a_batch_split_error_not_an_overflow_error(shares, match):
    with pytest.raises(BatchSplitError, match=match):
        split_by_shares(10, shares)


def test_ordered_sequences_and_large_finite_shares_are_accepted():
    assert split_by_shares(10, range(1, 3)) == split_by_shares(10, (1, 2)) == (3, 7)
    assert split_by_shares(10, [1e308, 1e-308]) == (10, 0)
    assert split_by_shares(4, [10**300, 10**300]) == (2, 2)
