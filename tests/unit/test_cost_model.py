"""Cost models: predictions, validation messages, serialisation."""

import dataclasses
import doctest
import math

import numpy as np
import pytest

from hetero_cs.planning import cost_model as cost_model_module
from hetero_cs.planning.cost_model import (
    CostModel,
    LinearCostModel,
    PiecewiseLinearCostModel,
    ScaledCostModel,
    cost_model_from_dict,
)
from hetero_cs.planning.cost_checks import check_cost_model
from hetero_cs.errors import ConfigError, InvalidCostModelError
from hetero_cs.planning.solver import solve_batch_split


class _PlainModel:
    """A cost model that is not one of the library's classes (no to_dict)."""

    def predict_step_time_s(self, batch_size):
        return 0.5 + batch_size


def test_docstring_examples_hold():
    result = doctest.testmod(cost_model_module)
    assert result.attempted > 0 and result.failed == 0


# ---------------------------------------------------------------------------------------------- LinearCostModel
def test_linear_predicts_overhead_plus_per_example_time():
    model = LinearCostModel(0.005, 0.001)
    assert model.predict_step_time_s(0) == 0.005
    assert model.predict_step_time_s(10) == pytest.approx(0.015)
    assert model.throughput_examples_per_s == pytest.approx(1000.0)


def test_linear_throughput_is_infinite_without_per_example_cost():
    assert LinearCostModel(0.01, 0.0).throughput_examples_per_s == math.inf


def test_linear_coerces_ints_to_float():
    model = LinearCostModel(1, 2)
    assert isinstance(model.fixed_overhead_s, float) and isinstance(model.seconds_per_example, float)


@pytest.mark.parametrize("field,value", [("fixed_overhead_s", -0.001), ("fixed_overhead_s", math.nan),
                                         ("seconds_per_example", math.inf), ("seconds_per_example", "1"),
                                         ("seconds_per_example", True),
                                         # an edited profile: finite, but a prediction at batch 48 overflowed
                                         ("seconds_per_example", 3.745194030963158e306), ("fixed_overhead_s", 2e6)])
def test_linear_rejects_bad_fields(field, value):
    kwargs = {"fixed_overhead_s": 0.001, "seconds_per_example": 0.001, field: value}
    with pytest.raises(InvalidCostModelError, match=rf"LinearCostModel\.{field} must be a number from 0 to 1e\+06"):
        LinearCostModel(**kwargs)


def test_linear_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        LinearCostModel(0.0, 1.0).fixed_overhead_s = 2.0  # type: ignore[misc]


@pytest.mark.parametrize("batch_size", [-1, 2.5, "8", None])
def test_predict_rejects_a_bad_batch_size(batch_size):
    with pytest.raises(ConfigError, match="batch_size must be an integer >= 0"):
        LinearCostModel(0.0, 1.0).predict_step_time_s(batch_size)


def test_predict_accepts_numpy_integers():
    assert LinearCostModel(1.0, 1.0).predict_step_time_s(np.int64(3)) == 4.0


# ------------------------------------------------------------------------------------- PiecewiseLinearCostModel
def test_piecewise_interpolates_and_extends():
    model = PiecewiseLinearCostModel((16, 64, 128), (0.010, 0.010, 0.018))
    assert model.predict_step_time_s(0) == 0.010  # constant below the first point
    assert model.predict_step_time_s(16) == 0.010
    assert model.predict_step_time_s(96) == pytest.approx(0.014)
    assert model.predict_step_time_s(128) == 0.018
    assert model.predict_step_time_s(256) == pytest.approx(0.034)  # last segment's slope, 0.008 / 64 per example


def test_piecewise_single_point_is_constant():
    model = PiecewiseLinearCostModel((8,), (0.02,))
    assert [model.predict_step_time_s(b) for b in (0, 8, 1000)] == [0.02, 0.02, 0.02]


def test_piecewise_flat_last_segment_stays_flat():
    model = PiecewiseLinearCostModel((1, 10), (0.5, 0.5))
    assert model.predict_step_time_s(10_000) == 0.5


def test_piecewise_is_non_decreasing_at_every_integer():
    model = PiecewiseLinearCostModel((0, 3, 7, 50, 51, 400), (0.1, 0.1, 0.3, 0.30000000000000004, 1.7, 9.0))
    times = [model.predict_step_time_s(b) for b in range(0, 600)]
    assert all(a <= b for a, b in zip(times, times[1:]))
    assert [model.predict_step_time_s(b) for b in model.batch_sizes] == list(model.step_times_s)


def test_piecewise_rejects_decreasing_times_naming_points_and_fix():
    with pytest.raises(InvalidCostModelError,
                       match=r"0\.02 s at batch_size=64 but 0\.018 s at batch_size=128.*isotonic fit"):
        PiecewiseLinearCostModel((32, 64, 128), (0.01, 0.02, 0.018))


def test_piecewise_rejects_unsorted_batch_sizes():
    with pytest.raises(InvalidCostModelError, match=r"batch_sizes\[0\]=64, batch_sizes\[1\]=64"):
        PiecewiseLinearCostModel((64, 64), (0.1, 0.2))


@pytest.mark.parametrize("sizes,times,match", [
    ((), (), "at least one"),
    ((1, 2), (0.1,), r"len\(batch_sizes\)=2, len\(step_times_s\)=1"),
    ((-1, 2), (0.1, 0.2), r"integers >= 0.*offending: \[-1\]"),
    ((1, 2.5), (0.1, 0.2), r"offending: \[2\.5\]"),
    ((1, 2), (0.1, math.nan), r"from 0 to 1e\+06 seconds.*\(2, nan\)"),
    ((1, 2), (0.1, 1e300), r"from 0 to 1e\+06 seconds.*\(2, 1e\+300\)"),
    ((1, 2), (-0.1, 0.2), r"\(1, -0\.1\)"),
])
def test_piecewise_rejects_invalid_points(sizes, times, match):
    with pytest.raises(InvalidCostModelError, match=match):
        PiecewiseLinearCostModel(sizes, times)


def test_piecewise_accepts_lists_and_stores_tuples():
    model = PiecewiseLinearCostModel([1, 2], [1, 2])  # type: ignore[arg-type]
    assert model.batch_sizes == (1, 2) and model.step_times_s == (1.0, 2.0)
    assert model == PiecewiseLinearCostModel((1, 2), (1.0, 2.0))
    assert hash(model) == hash(PiecewiseLinearCostModel((1, 2), (1.0, 2.0)))


# ---------------------------------------------------------------------------------------------- ScaledCostModel
def test_scaled_multiplies_the_base():
    model = ScaledCostModel(LinearCostModel(0.01, 0.001), 2.0)
    assert model.predict_step_time_s(10) == pytest.approx(0.04)


@pytest.mark.parametrize("factor", [0.0, -1.0, math.nan, math.inf])
def test_scaled_rejects_a_bad_factor(factor):
    with pytest.raises(InvalidCostModelError, match="factor must be a finite number > 0"):
        ScaledCostModel(LinearCostModel(0.0, 1.0), factor)


def test_scaled_rejects_a_base_without_predict():
    with pytest.raises(InvalidCostModelError, match="base must have a predict_step_time_s method"):
        ScaledCostModel(object(), 1.0)  # type: ignore[arg-type]


def test_scaled_to_dict_needs_a_serialisable_base():
    with pytest.raises(InvalidCostModelError, match="needs a base with to_dict"):
        ScaledCostModel(_PlainModel(), 2.0).to_dict()


# ------------------------------------------------------------------------------------------------ serialisation
@pytest.mark.parametrize("model", [
    LinearCostModel(0.0012, 3.3e-5),
    PiecewiseLinearCostModel((1, 16, 256), (0.01, 0.0100001, 0.3)),
    ScaledCostModel(PiecewiseLinearCostModel((4,), (0.2,)), 1.7),
    ScaledCostModel(ScaledCostModel(LinearCostModel(0.1, 0.2), 0.5), 3.0),
])
def test_to_dict_round_trips_through_cost_model_from_dict(model):
    data = model.to_dict()
    assert "kind" in data
    assert cost_model_from_dict(data) == model
    assert type(model).from_dict(data) == model


def test_from_dict_without_kind_is_accepted_by_the_class():
    assert LinearCostModel.from_dict({"fixed_overhead_s": 1, "seconds_per_example": 2}) == LinearCostModel(1, 2)


@pytest.mark.parametrize("data,match", [
    ({"kind": "cubic"}, r"needs 'kind' in \['linear', 'out_of_memory', 'piecewise_linear', 'scaled'\].*kind='cubic'"),
    ({"fixed_overhead_s": 1.0}, "kind=None"),
    ([1, 2], "kind=None"),
    ({"kind": "linear", "fixed_overhead_s": 1.0, "seconds_per_example": 1.0, "extra": 1},
     r"unknown=\['extra'\], missing=\[\]"),
    ({"kind": "piecewise_linear", "batch_sizes": [1]}, r"missing=\['step_times_s'\]"),
    ({"kind": "scaled", "factor": 2.0, "base": {"kind": "nope"}}, "kind='nope'"),
    ({"kind": ["linear"]}, r"kind=\['linear'\]"),  # regression: an unhashable kind raised TypeError
])
def test_cost_model_from_dict_rejects_bad_dicts(data, match):
    with pytest.raises(InvalidCostModelError, match=match):
        cost_model_from_dict(data)


def test_class_from_dict_rejects_another_kind():
    with pytest.raises(InvalidCostModelError, match="Expected kind='linear'. Received: kind='scaled'"):
        LinearCostModel.from_dict({"kind": "scaled", "fixed_overhead_s": 1.0, "seconds_per_example": 1.0})


# ---------------------------------------------------------------------------------------------- protocol, checks
def test_protocol_is_runtime_checkable():
    assert isinstance(LinearCostModel(0.0, 1.0), CostModel)
    assert isinstance(_PlainModel(), CostModel)
    assert not isinstance(object(), CostModel)


def test_check_cost_model_returns_times_in_input_order():
    times = check_cost_model(LinearCostModel(1.0, 1.0), [4, 0, 2])
    assert isinstance(times, np.ndarray) and times.tolist() == [5.0, 1.0, 3.0]


class _Decreasing:
    def predict_step_time_s(self, batch_size):
        return 10.0 - batch_size


class _ReturnsNan:
    def predict_step_time_s(self, batch_size):
        return math.nan


class _ReturnsText:
    def predict_step_time_s(self, batch_size):
        return "fast"


def test_check_cost_model_names_replica_sizes_and_values_when_decreasing():
    with pytest.raises(InvalidCostModelError,
                       match=r"cost_models\[2\] predicts a shorter step for a larger batch: "
                             r"predict_step_time_s\(1\)=9\.0 s > predict_step_time_s\(3\)=7\.0 s"):
        check_cost_model(_Decreasing(), [3, 1], replica_id=2)


@pytest.mark.parametrize("model,match", [
    (_ReturnsNan(), r"cost model\.predict_step_time_s\(4\) returned nan; step times must be finite and >= 0"),
    (_ReturnsText(), r"did not return a number"),
    (object(), "has no predict_step_time_s method"),
])
def test_check_cost_model_rejects_unusable_predictions(model, match):
    with pytest.raises(InvalidCostModelError, match=match):
        check_cost_model(model, [4])


class _Returns:
    """A cost model whose prediction is a fixed object."""

    def __init__(self, value):
        self.value = value

    def predict_step_time_s(self, batch_size):
        return self.value


NOT_NUMBERS = [("regression_numeric_string", "0.5"), ("none", None), ("list", [0.5]), ("bool", True),
               ("array_of_two", np.array([0.1, 0.2])), ("regression_one_element_array", np.array([0.5])),
               ("bytes", b"1"), ("complex", 1 + 0j)]


@pytest.mark.parametrize("value", [v for _, v in NOT_NUMBERS], ids=[n for n, _ in NOT_NUMBERS])
def test_regression_a_prediction_that_is_not_a_number_is_refused_by_the_solver_and_the_check(value):
    # solve_batch_split took float("0.5") and float(np.array([0.5])) as 0.5: a string is not a step time.
    models = [LinearCostModel(0.001, 0.001), _Returns(value)]
    with pytest.raises(InvalidCostModelError, match=r"cost_models\[1\]\.predict_step_time_s\(\d+\) did not return "
                                                    r"a number: it returned .* \(\w+\)\. A cost model returns seconds"):
        solve_batch_split(models, 8)
    with pytest.raises(InvalidCostModelError, match=r"cost_models\[1\]\.predict_step_time_s\(0\) did not return"):
        check_cost_model(models[1], [0, 1], replica_id=1)


@pytest.mark.parametrize("value", [0.5, 1, np.float32(0.5), np.float64(0.5), np.int64(1), np.array(0.5)])
def test_real_numbers_of_any_kind_are_predictions(value):
    assert solve_batch_split([_Returns(value), LinearCostModel(0.0, 0.1)], 4).global_batch_size == 4
    assert check_cost_model(_Returns(value), [0, 1]).tolist() == [float(value)] * 2


def test_an_int_too_large_for_a_float_is_not_a_finite_prediction():
    with pytest.raises(InvalidCostModelError, match=r"returned inf; step times must be finite"):
        check_cost_model(_Returns(10**400), [1])
    with pytest.raises(InvalidCostModelError, match=r"cost_models\[0\]\.predict_step_time_s\(\d+\) returned inf"):
        solve_batch_split([_Returns(10**400)], 4)
