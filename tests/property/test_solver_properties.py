"""Hypothesis: the solver is optimal against brute force; both paths and the greedy agree; plan invariants hold."""

import heapq
import itertools
import math
from fractions import Fraction

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from hetero_cs.planning.cost_model import IdleFreeCostModel, LinearCostModel, PiecewiseLinearCostModel, ScaledCostModel
from hetero_cs.errors import InfeasiblePlanError
from hetero_cs.planning.plan import BatchPlan, even_batch_split, split_by_shares
from hetero_cs.planning.solver import ideal_makespan_s, solve_batch_split

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
THOROUGH = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class Opaque:
    """Hides a model's type so the solver takes its generic path."""

    def __init__(self, model):
        self.model = model

    def predict_step_time_s(self, batch_size):
        return self.model.predict_step_time_s(batch_size)


class StepCostModel:
    """base_s + step_s * ceil(b / width): stepped, not piecewise linear (generic path)."""

    def __init__(self, base_s, step_s, width):
        self.base_s, self.step_s, self.width = base_s, step_s, width

    def predict_step_time_s(self, batch_size):
        return self.base_s + self.step_s * (-(-batch_size // self.width))

    def __repr__(self):
        return f"StepCostModel({self.base_s}, {self.step_s}, {self.width})"


# Small dyadic values make exact ties common, which is where tie rules and off-by-one errors hide.
linear_models = st.builds(LinearCostModel, st.sampled_from([0.0, 0.5, 1.0, 2.0]),
                          st.sampled_from([0.0, 0.125, 0.25, 0.5, 1.0, 3.0]))


@st.composite
def piecewise_models(draw):
    n = draw(st.integers(1, 4))
    sizes = sorted(draw(st.sets(st.integers(0, 45), min_size=n, max_size=n)))
    rises = draw(st.lists(st.sampled_from([0.0, 0.0, 0.5, 1.0, 2.0, 4.0]), min_size=n, max_size=n))
    return PiecewiseLinearCostModel(tuple(sizes), tuple(itertools.accumulate(rises)))


step_models = st.builds(StepCostModel, st.sampled_from([0.0, 1.0]), st.sampled_from([0.5, 1.0, 2.0]),
                        st.integers(1, 8))
scaled_models = st.builds(ScaledCostModel, st.one_of(linear_models, piecewise_models()),
                          st.sampled_from([0.5, 2.0, 3.0]))
any_models = st.one_of(linear_models, piecewise_models(), step_models, scaled_models)


@st.composite
def problems(draw, max_replicas=4, max_batch=40, models=any_models):
    R = draw(st.integers(1, max_replicas))
    B = draw(st.integers(1, max_batch))
    return {
        "models": draw(st.lists(models, min_size=R, max_size=R)),
        "B": B,
        "max_batch_sizes": draw(st.one_of(st.none(), st.lists(st.one_of(st.none(), st.integers(0, max_batch)),
                                                              min_size=R, max_size=R))),
        "min_batch_size": draw(st.sampled_from([0, 1, 2])),
        "multiple_of": draw(st.sampled_from([1, 1, 2, 3, 8])),
    }


def _solve(problem, wrap=False):
    models = [Opaque(m) for m in problem["models"]] if wrap else problem["models"]
    return solve_batch_split(models, problem["B"], max_batch_sizes=problem["max_batch_sizes"],
                             min_batch_size=problem["min_batch_size"], multiple_of=problem["multiple_of"])


def _legal_slices(problem):
    """Per replica, every legal slice under the documented rules (remainder to the first replica that admits it)."""
    models, B, k, low = problem["models"], problem["B"], problem["multiple_of"], problem["min_batch_size"]
    caps = problem["max_batch_sizes"] or [None] * len(models)
    rem = B % k
    remainder_replica = None
    if rem:
        for i, cap in enumerate(caps):
            if any(b % k == rem for b in range(low, (B if cap is None else min(cap, B)) + 1)):
                remainder_replica = i
                break
    return [[b for b in range(low, (B if cap is None else min(cap, B)) + 1)
             if b % k == (rem if i == remainder_replica else 0)] for i, cap in enumerate(caps)]


def _brute_force_makespan(problem):
    """min over every legal split of max_i t_i(b_i), or None when there is none (enumeration)."""
    options = _legal_slices(problem)
    times = [{b: m.predict_step_time_s(b) for b in opts} for m, opts in zip(problem["models"], options)]
    best = None
    for split in itertools.product(*options[:-1]):
        last = problem["B"] - sum(split)
        if last in times[-1]:
            makespan = max([t[b] for t, b in zip(times, split)] + [times[-1][last]])
            best = makespan if best is None else min(best, makespan)
    return best


def _greedy_split(problem):
    """The documented tie rule, one step at a time, starting from the smallest legal slices."""
    options = _legal_slices(problem)
    models = problem["models"]
    sizes = [opts[0] for opts in options]
    position = [0] * len(options)
    heap = [(models[i].predict_step_time_s(opts[1]), opts[1], i) for i, opts in enumerate(options) if len(opts) > 1]
    heapq.heapify(heap)
    for _ in range((problem["B"] - sum(sizes)) // problem["multiple_of"]):
        _, b, i = heapq.heappop(heap)
        sizes[i], position[i] = b, position[i] + 1
        if position[i] + 1 < len(options[i]):
            nxt = options[i][position[i] + 1]
            heapq.heappush(heap, (models[i].predict_step_time_s(nxt), nxt, i))
    return tuple(sizes)


def _continuous_ideal(problem):
    """The ideal bound by bisection on T over the integer-interpolated curves (slow, obviously right)."""
    models, B, low = problem["models"], problem["B"], problem["min_batch_size"]
    caps = [B if c is None else c for c in (problem["max_batch_sizes"] or [None] * len(models))]

    def examples(level):
        total = 0.0
        for m, cap in zip(models, caps):
            b = low
            while b < cap and m.predict_step_time_s(b + 1) <= level:
                b += 1
            total += b
            if b < cap and m.predict_step_time_s(b) <= level:
                t0, t1 = m.predict_step_time_s(b), m.predict_step_time_s(b + 1)
                total += (level - t0) / (t1 - t0)
        return total

    base = max(m.predict_step_time_s(low) for m in models)
    if examples(base) >= B:
        return base
    lo, hi = base, max(m.predict_step_time_s(B) for m in models)
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if examples(mid) >= B else (mid, hi)
    return hi


# ------------------------------------------------------------------------------------------------------ optimality
@THOROUGH
@given(problems())
def test_makespan_equals_brute_force_or_both_find_no_split(problem):
    best = _brute_force_makespan(problem)
    if best is None:
        try:
            _solve(problem)
        except InfeasiblePlanError:
            return
        raise AssertionError("the solver found a split where brute force found none")
    plan = _solve(problem)
    assert plan.predicted_makespan_s == best
    assert sum(plan.per_replica_batch_sizes) == problem["B"]


@FAST
@given(problems(max_replicas=3, max_batch=30, models=st.one_of(linear_models, scaled_models)))
def test_linear_makespan_equals_brute_force(problem):
    best = _brute_force_makespan(problem)
    assume(best is not None)
    assert _solve(problem).predicted_makespan_s == best


idle_free_models = st.builds(IdleFreeCostModel, st.one_of(linear_models, piecewise_models(), step_models,
                                                          scaled_models))


@THOROUGH
@given(problems(models=idle_free_models))
def test_plans_that_leave_cards_out_are_optimal_against_brute_force(problem):
    # An idle replica costs nothing (the central-storage engine runs nothing for it): t(0) = 0, then a jump to the
    # fixed cost at 1 example. The minimum over every subset of working cards is what brute force finds.
    best = _brute_force_makespan(problem)
    try:
        plan = _solve(problem)
    except InfeasiblePlanError:
        assert best is None
        return
    assert best is not None and math.isclose(plan.predicted_makespan_s, best, rel_tol=1e-12, abs_tol=1e-12)
    assert plan.per_replica_batch_sizes == _greedy_split(problem)


@FAST
@given(fast=st.integers(1, 4), fixed_ms=st.integers(0, 400), B=st.integers(1, 200))
def test_a_card_is_left_out_exactly_when_its_fixed_cost_exceeds_the_makespan_without_it(fast, fixed_ms, B):
    # `fast` alike cards at 1 ms per example and no fixed cost, and one card at 1 ms per example plus `fixed_ms`.
    models = [IdleFreeCostModel(LinearCostModel(0.0, 1e-3))] * fast + [
        IdleFreeCostModel(LinearCostModel(fixed_ms * 1e-3, 1e-3))]
    plan = solve_batch_split(models, B, min_batch_size=0)
    without_s = math.ceil(B / fast) * 1e-3
    if fixed_ms * 1e-3 + 1e-3 > without_s:  # even one example on the slow card ends later than the others alone
        assert plan.per_replica_batch_sizes[-1] == 0
        assert math.isclose(plan.predicted_makespan_s, without_s)
    else:
        assert plan.predicted_makespan_s <= without_s + 1e-12


@FAST
@given(problems(max_replicas=6, max_batch=300))
def test_closed_form_generic_and_greedy_give_the_same_split(problem):
    try:
        plan = _solve(problem)
    except InfeasiblePlanError:
        assume(False)
    assert _solve(problem, wrap=True).per_replica_batch_sizes == plan.per_replica_batch_sizes
    assert _greedy_split(problem) == plan.per_replica_batch_sizes


@FAST
@given(problems(max_replicas=4, max_batch=40))
def test_ideal_is_the_continuous_bound_and_below_the_makespan(problem):
    problem = {**problem, "multiple_of": 1}
    try:
        plan = _solve(problem)
    except InfeasiblePlanError:
        assume(False)
    kwargs = {"max_batch_sizes": problem["max_batch_sizes"], "min_batch_size": problem["min_batch_size"]}
    expected = _continuous_ideal(problem)
    closed = ideal_makespan_s(problem["models"], problem["B"], **kwargs)
    generic = ideal_makespan_s([Opaque(m) for m in problem["models"]], problem["B"], **kwargs)
    assert math.isclose(closed, expected, rel_tol=1e-9, abs_tol=1e-9)
    assert math.isclose(generic, expected, rel_tol=1e-9, abs_tol=1e-9)
    assert plan.ideal_makespan_s <= plan.predicted_makespan_s


# ------------------------------------------------------------------------------------------------------------ plans
finite_seconds = st.floats(min_value=0.0, max_value=1e6, allow_nan=False, allow_infinity=False)


@st.composite
def plans(draw):
    sizes = draw(st.lists(st.integers(0, 10**6), min_size=1, max_size=8).filter(lambda s: sum(s) > 0))
    optional = st.one_of(st.none(), finite_seconds)
    return BatchPlan(
        tuple(sizes), sum(sizes),
        predicted_makespan_s=draw(optional), even_split_makespan_s=draw(optional), ideal_makespan_s=draw(optional),
        predicted_step_times_s=draw(st.one_of(st.none(), st.lists(finite_seconds, min_size=len(sizes),
                                                                  max_size=len(sizes)).map(tuple))),
    )


@settings(max_examples=100, deadline=None)
@given(plans())
def test_plan_json_round_trip_is_exact(plan):
    assert BatchPlan.from_json(plan.to_json()) == plan
    assert math.isclose(math.fsum(plan.replica_weights), 1.0)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 10**6), st.lists(st.floats(0, 1e3, allow_nan=False), min_size=1, max_size=8))
def test_split_by_shares_is_within_one_of_each_quota(B, shares):
    assume(sum(shares) > 0)
    sizes = split_by_shares(B, shares)
    assert sum(sizes) == B and len(sizes) == len(shares)
    total = sum(Fraction(s) for s in shares)
    for b, s in zip(sizes, shares):
        quota = B * Fraction(s) / total
        assert math.floor(quota) <= b <= math.floor(quota) + 1
        if s == 0:
            assert b == 0
    for i, j in itertools.combinations(range(len(shares)), 2):  # a larger share never gets fewer examples
        if shares[i] >= shares[j]:
            assert sizes[i] >= sizes[j]


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 10**6), st.integers(1, 64))
def test_even_batch_split_properties(B, R):
    sizes = even_batch_split(B, R)
    assert sum(sizes) == B and len(sizes) == R
    assert max(sizes) - min(sizes) <= 1
    assert list(sizes) == sorted(sizes, reverse=True)
    assert split_by_shares(B, [1] * R) == sizes
