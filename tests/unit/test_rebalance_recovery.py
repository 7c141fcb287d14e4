"""Re-balancing recovers within 10 steps after a card slows 2x and after it recovers (pure simulation, no TF).

The mix is the re-balance benchmark's (benchmarks/rebalance.py: A10, T4, P100 on an MLP at B=2048, 150 ms steps),
its emulated cards as affine cost models: the A10 alone takes 167.5 ms, all three 150 ms at [1481, 264, 303].
"""

import statistics

import pytest

from hetero_cs.planning.balancer import Balancer
from hetero_cs.planning.cost_model import LinearCostModel, ScaledCostModel, idle_free
from hetero_cs.planning.simulation import simulate_balancer
from hetero_cs.planning.solver import solve_batch_split

B = 2048
CARDS = [LinearCostModel(0.1043, 0.03086e-3), LinearCostModel(0.1213, 0.1086e-3), LinearCostModel(0.1214, 0.0945e-3)]
SLOW_AT, RECOVER_AT, STEPS = 100, 300, 400


def true_at(step):
    factor = 2.0 if SLOW_AT <= step < RECOVER_AT else 1.0
    return idle_free([ScaledCostModel(CARDS[0], factor), CARDS[1], CARDS[2]])


def steps_to_recover(trace, start, end):
    """As the benchmark counts by the split in use: the first step from which the median of the 5 true makespans
    ending at each step stays within 10 % of the optimum until `end`, minus `start`; None if never."""
    optimum_s = solve_batch_split(true_at(start), B, min_batch_size=0).predicted_makespan_s
    recovered = None
    for t in range(start + 4, end):
        ok = statistics.median(s.true_makespan_s for s in trace[t - 4:t + 1]) <= 1.1 * optimum_s
        recovered = (t if recovered is None else recovered) if ok else None
    return None if recovered is None else recovered - start


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_card_that_recovers_is_used_again_within_10_steps_without_a_check_against_the_card_alone(seed):
    # The regression: after the A10 recovered, the re-plan back to [1482, 263, 303] was kept, and then measured
    # against the A10 alone (predicted only 1.12x faster, under the old rule's 1.25): 12 more steps, two in three on
    # the A10 alone at 167.5 ms, 12 % over the optimum. The benchmark read 22 steps (7 after the slow-down).
    balancer = Balancer(3, idle_replicas_free=True)
    balancer.set_cost_models(CARDS, trial=True, reference_batch_size=B)
    trace = simulate_balancer(balancer, true_at, B, steps=STEPS, relative_noise=0.02, common_noise_sigma=0.01,
                              seed=seed)
    slow = steps_to_recover(trace, SLOW_AT, RECOVER_AT)
    recovered = steps_to_recover(trace, RECOVER_AT, STEPS)
    assert slow is not None and slow <= 10, slow
    assert recovered is not None and recovered <= 10, recovered
    assert not any(d.against_alone for d in balancer.guard.decisions[1:]), balancer.guard.decisions
