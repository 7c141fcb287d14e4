"""The fastest-card-alone figures of the main job and of benchmarks/balance.py (pure: fake emulators and strategies).

The measurements themselves need TensorFlow and time; run `python examples/train_digits.py` and
`python benchmarks/balance.py` (docs/main_job.md, benchmarks/README.md).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

from hetero_cs.planning.cost_model import LinearCostModel

from benchmarks import _fastest  # the repository's benchmarks: importable through tests/conftest.py

ROOT = Path(__file__).resolve().parents[2]


def _load_train_digits():
    spec = importlib.util.spec_from_file_location("train_digits_under_test", ROOT / "examples" / "train_digits.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


train_digits = _load_train_digits()


class FakeEmulator:
    """Linear true profiles t_i(b) = a_i + c_i * b (b > 0), as the catalog's emulated times are."""

    def __init__(self, names, fixed_s, per_example_s):
        self.specs = tuple(SimpleNamespace(name=n) for n in names)
        self.fixed_s, self.per_example_s = fixed_s, per_example_s
        self.workload = object()
        self.num_replicas = len(names)

    def step_time_s(self, replica_id, batch_size, *, step=None):
        return 0.0 if batch_size == 0 else self.fixed_s[replica_id] + self.per_example_s[replica_id] * batch_size


# A card that is quick on small slices (low fixed cost) but slow per example, beside the reverse: at B=1000 the
# second has the higher throughput, at B=10 the first.
EMULATOR = FakeEmulator(["P100", "A10"], fixed_s=[0.001, 0.010], per_example_s=[2e-4, 1e-4])


def test_the_fastest_card_is_the_one_with_the_highest_throughput_on_the_whole_batch():
    assert _fastest.fastest_replica(EMULATOR, 1000) == 1
    assert _fastest.fastest_replica(EMULATOR, 10) == 0


def test_the_benchmark_theoretical_value_is_the_fastest_step_at_b_over_the_ideal_makespan():
    figures = _fastest.fastest_figures(EMULATOR, 1000, ideal_makespan_s=0.080)
    assert figures["fastest"] == "A10" and figures["fastest_replica"] == 1
    assert figures["fastest_alone_makespan_s"] == pytest.approx(0.110)
    assert figures["theoretical_speedup_vs_fastest"] == pytest.approx(0.110 / 0.080)


@pytest.mark.parametrize("alone_s, noise, met", [(0.105, False, True), (0.101, False, False), (0.101, True, True),
                                                  (0.099, True, False)])
def test_the_measured_figures_and_the_goals(alone_s, noise, met):
    record = {"configs": {"hetero_auto": {"median_step_s": 0.100}, "fastest_alone": {"median_step_s": alone_s}}}
    figures = {"fastest": "A10", "fastest_replica": 0, "fastest_alone_makespan_s": 0.1,
               "theoretical_speedup_vs_fastest": 1.08}
    _fastest.add_figures(record, figures, noise=noise)
    assert record["speedup_vs_fastest"] == pytest.approx(alone_s / 0.100)
    assert record["speedup_vs_fastest_fraction_of_theoretical"] == pytest.approx(alone_s / 0.100 / 1.08)
    assert record["fastest_goals_met"] is met  # >= 1.0 always; >= 0.95 x theoretical unless noisy
    assert record["fastest"] == "A10"


def test_the_main_job_theoretical_value_is_the_fastest_cards_step_over_the_plans_makespan():
    models = [LinearCostModel(0.010, 1e-4), LinearCostModel(0.001, 2e-4), LinearCostModel(0.002, 5e-4)]
    plan = [700, 300, 0]  # an idle card sets no step time
    assert train_digits.theoretical_speedup_vs_fastest(models, plan, 0, 1000) == pytest.approx(0.110 / 0.080)
    # An unbalanced plan (the even split while the guard still tries another) reads below 1.0 where the models
    # predict it slower than the card alone; the sum of throughputs (1.61 here) would call it faster.
    even = [334, 333, 333]
    assert train_digits.theoretical_speedup_vs_fastest(models, even, 0, 1000) == pytest.approx(0.110 / 0.1685)
    assert train_digits.theoretical_speedup_vs_fastest(None, plan, 0, 1000) is None


def test_the_main_job_picks_the_card_by_the_emulator_else_the_cost_models_else_says_why_not():
    emulated = SimpleNamespace(num_replicas_in_sync=2, emulator=EMULATOR, cost_models=None,
                               compute_devices=("/device:CPU:1", "/device:CPU:2"))
    index, why = train_digits.fastest_card(emulated, 1000)
    assert index == 1 and "emulated catalog figures" in why and "A10 9091" in why
    real = SimpleNamespace(num_replicas_in_sync=2, emulator=None, compute_devices=("/gpu:0", "/gpu:1"),
                           cost_models=[LinearCostModel(0.001, 2e-4), LinearCostModel(0.010, 1e-4)])
    index, why = train_digits.fastest_card(real, 1000)
    assert index == 1 and "calibrated cost models" in why
    none = SimpleNamespace(num_replicas_in_sync=2, emulator=None, cost_models=None,
                           compute_devices=("/gpu:0", "/gpu:1"))
    index, why = train_digits.fastest_card(none, 1000)
    assert index == 0 and "the first device" in why


def test_the_main_job_measures_every_configuration_in_each_round_in_a_rotating_order():
    calls = []

    def measure(name):
        def run(steps):
            calls.append((name, steps))
            return {"plan": 0.08, "even": 0.1, "fastest": 0.09}[name]

        return run

    times = train_digits.interleaved_step_times({n: measure(n) for n in ("plan", "even", "fastest")}, total_steps=30)
    assert times == {"plan": [0.08] * 6, "even": [0.1] * 6, "fastest": [0.09] * 6}
    firsts = [calls[3 * r][0] for r in range(6)]
    assert firsts == ["plan", "even", "fastest", "plan", "even", "fastest"]
    assert all(steps == 5 for _, steps in calls)


def test_the_summary_says_replanned_when_the_card_alone_was_kept_and_later_cards_came_back():
    from hetero_cs.planning.guard import GuardDecision

    def decision(candidate, outcome, against_alone):
        return GuardDecision(step=1, outcome=outcome, incumbent_per_replica_batch_sizes=(600, 400),
                             candidate_per_replica_batch_sizes=candidate, num_pairs=3, median_ratio=0.5,
                             p_value=None, reason="", against_alone=against_alone)

    def strategy(plan, decisions):
        guard = SimpleNamespace(in_trial=False, against_alone=False, decisions=decisions)
        return SimpleNamespace(balancer=SimpleNamespace(guard=guard, plan=SimpleNamespace(
            per_replica_batch_sizes=plan)))

    kept_alone = [decision((600, 400), "kept", False), decision((1000, 0), "kept", True)]
    assert train_digits.guard_outcome(strategy((1000, 0), kept_alone), against_alone=True) == "kept"
    assert train_digits.guard_outcome(strategy((601, 399), kept_alone), against_alone=True) == "replanned"
    assert train_digits.guard_outcome(strategy((601, 399), kept_alone)) == "kept"
    assert train_digits.guard_outcome(strategy((600, 400), kept_alone[:1]), against_alone=True) == "none"
