"""The multi-worker strategy's micro-batched slices, pure parts: caps, the micro-batch rule, the plan shown."""

import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetero_cs.errors import ConfigError
from hetero_cs.planning.balancer import Balancer
from hetero_cs.planning.cost_model import LinearCostModel, MicroBatchedCostModel, near_equal_micro_batches
from hetero_cs.planning.micro_batches import MicroBatchPlan
from hetero_cs.planning.plan import BatchPlan


def test_the_module_imports_without_tensorflow():
    import subprocess

    code = ("import sys; sys.modules['tensorflow'] = None; sys.modules['keras'] = None\n"
            "import hetero_cs.engine.multi_worker.micro_batches; print('ok')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "ok", result.stderr


@given(b=st.integers(min_value=0, max_value=5000), cap=st.integers(min_value=1, max_value=300))
@settings(max_examples=200, deadline=None)
def test_micro_batches_are_near_equal_within_the_cap_and_the_cost_model_prices_the_same_ones(b, cap):
    parts = near_equal_micro_batches(b, cap)
    assert sum(parts) == b and len(parts) == -(-b // cap)
    assert all(1 <= m <= cap for m in parts) and (not parts or max(parts) - min(parts) <= 1)
    assert parts == sorted(parts, reverse=True)
    assert parts == MicroBatchedCostModel(LinearCostModel(0.01, 0.001), cap).micro_batches(b)


def test_no_cap_is_one_pass():
    assert near_equal_micro_batches(7, None) == [7] and near_equal_micro_batches(0, None) == []


def test_the_plan_of_slices_shows_each_replicas_micro_batches_and_their_predicted_chain():
    models = [LinearCostModel(0.002, 0.001), LinearCostModel(0.001, 0.004)]
    plan = MicroBatchPlan.of_slices(BatchPlan((10, 3), 13), [4, None], models)
    assert plan.per_replica_batch_sizes == (10, 3)
    assert plan.micro_batch_sizes == (4, 3) and plan.micro_batch_counts == (3, 1)
    assert [p.per_replica_batch_sizes for p in plan.sub_step_plans] == [(4, 3), (3, 0), (3, 0)]
    # Replica 0: 3 steps of its line (4, 3, 3 examples); replica 1: one step of 3. The chain, not the sum of maxima.
    assert plan.predicted_makespan_s == pytest.approx(max(3 * 0.002 + 0.010, 0.001 + 0.012))
    assert "micro-batch" in str(plan)


def test_the_plan_of_slices_shows_a_card_that_holds_none_taking_none():
    plan = MicroBatchPlan.of_slices(BatchPlan((6, 0), 6), [4, 0])
    assert plan.micro_batch_counts == (2, 0) and plan.per_replica_batch_sizes == (6, 0)


def test_the_plan_of_slices_refuses_examples_on_a_card_that_holds_none():
    with pytest.raises(ConfigError, match="max_batch_sizes"):
        MicroBatchPlan.of_slices(BatchPlan((2, 3), 5), [0, None])


@pytest.mark.parametrize("caps, match", [
    ("4,4", "one memory cap per replica"),
    ([4], "num_replicas_in_sync=2"),
    ([4, -1], "not allowed"),
    ([4, 2.5], "not allowed"),
    ([True, 4], "not allowed"),
])
def test_max_batch_sizes_that_are_not_one_cap_per_replica_are_config_errors(caps, match):
    from hetero_cs.engine.multi_worker.micro_batches import checked_caps

    with pytest.raises(ConfigError, match=match):
        checked_caps(caps, 2)


def test_checked_caps_keeps_none_entries():
    from hetero_cs.engine.multi_worker.micro_batches import checked_caps

    assert checked_caps([None, 0, 7], 3) == [None, 0, 7] and checked_caps(None, 3) is None


def test_balancer_caps_without_models_move_the_even_split_within_them():
    balancer = Balancer(3)
    balancer.set_max_batch_sizes([2, None, 10])
    sizes = balancer.plan_for(30).per_replica_batch_sizes
    assert sizes[0] <= 2 and sizes[2] <= 10 and sum(sizes) == 30
    with pytest.raises(ConfigError):
        balancer.set_max_batch_sizes([1, 2])


@pytest.mark.parametrize("cap", [0, -3, 2.5, "4"])
def test_a_micro_batch_cap_below_one_is_an_error_not_a_division_by_zero(cap):
    from hetero_cs.errors import InvalidCostModelError

    with pytest.raises(InvalidCostModelError, match="integer >= 1"):
        near_equal_micro_batches(10, cap)


def test_numpy_caps_are_taken_as_ints():
    import numpy as np

    from hetero_cs.engine.multi_worker.micro_batches import checked_caps

    assert checked_caps(np.array([4, 8]), 2) == [4, 8]
    assert checked_caps([np.int64(4), None], 2) == [4, None]


def _micro(setting=None, given=None, restart=None):
    from types import SimpleNamespace

    from hetero_cs.engine.multi_worker.micro_batches import MultiWorkerMicroBatches

    return MultiWorkerMicroBatches(SimpleNamespace(emulator=None), setting, given, restart_caps=restart)


def test_caps_from_a_restart_lower_the_given_caps_entry_by_entry():
    micro = _micro(given=[8, None, 6], restart=[None, 4, 9])
    assert micro.known_caps == [8, 4, 6]
    assert [micro.inference_cap(None, i) for i in range(3)] == [8, 4, 6]
    assert _micro(restart=[None, 0]).inference_cap(None, 1) is None  # a card that takes no example: one (empty) pass
    assert _micro().known_caps is None and _micro().inference_cap(None, 0) is None


def test_inference_slices_run_as_micro_batches_unless_switched_off_or_evaluate_all_reduces_in_the_step():
    micro = _micro(given=[4, 4])
    assert micro.runs_micro_batches(None, "predict") and micro.runs_micro_batches(None, "evaluate")
    assert not micro.runs_micro_batches(None, "fit")  # fit decides at fit, for the model it prepared
    model = object()
    assert not micro.evaluates_in_micro_batches(model, lambda: True)
    assert not micro.runs_micro_batches(model, "evaluate") and micro.runs_micro_batches(model, "predict")
    assert micro.evaluates_in_micro_batches(object(), lambda: False)
    off = _micro(setting=False, given=[4, 4])
    assert off.inference_cap(None, 0) is None and not off.runs_micro_batches(None, "predict")
