"""How often the balancer times a step and looks at the monitor: a share of the step's time (pure).

Timing a step and re-planning both cost host time. Both run every step when that costs under ``TIMING_BUDGET`` of
the step, else every N-th step with the smallest N that keeps it under the budget (bounded).
"""

import math

LOOK_COST_S = 5e-4
"""Host time one re-balancing look costs, seconds: about 0.5 ms for R = 3 when the replicas finish within the
deadband of each other (the monitor's models only), about 2 ms when it solves (measured on a 2-core CPU machine).

The balancer looks every N completed steps, the smallest N with LOOK_COST_S / N <= TIMING_BUDGET of the last
makespan, at most MAX_LOOK_INTERVAL_STEPS: every step beside a 40 ms step, every 8th beside a 5 ms one. A look
runs in the input pipeline, beside the step; waiting N steps delays a reaction to a drifting device by N - 1."""

MAX_LOOK_INTERVAL_STEPS = 8

TIMING_COST_S = 6e-4
"""Host time one timed step costs, seconds (0.47-0.59 ms measured by benchmarks/overhead.py for R = 3 on a 2-core
CPU machine: the clock reads and the per-replica reports). ``timing_interval_steps`` keeps it under
``TIMING_BUDGET`` of the step."""

TIMING_BUDGET = 0.01
"""Largest share of step time that steady-state timing may cost (1 %)."""

MAX_TIMING_INTERVAL_STEPS = 64
"""Steady-state timing looks at least at one step in 64."""

AGREEMENT_COST_S = 8e-3
"""Time one plan agreement of the multi-worker strategy costs a step, seconds: the chief's proposal (0.9 ms), the
agreement all-reduce (7.0 ms, waiting for the last worker to arrive included) and the adoption (0.3 ms), medians
of 30 steps with 3 emulated workers on gRPC loopback on a 2-core CPU machine (``benchmarks/multiworker.py``, the
chief instrumented). In steady state the workers agree once every N steps, the smallest N that keeps it under
``TIMING_BUDGET`` of the step, at most ``MAX_AGREEMENT_INTERVAL_STEPS``."""

MAX_AGREEMENT_INTERVAL_STEPS = 32
"""Steady-state agreement happens at least once in 32 steps (the chief sees a timed step at least that often)."""


def interval_steps(cost_s: float, makespan_s: float | None, maximum: int) -> int:
    """The smallest N >= 1 with cost_s / N <= TIMING_BUDGET * makespan_s, at most ``maximum``; 1 when the makespan
    is unknown (no step measured yet)."""
    if makespan_s is None or not makespan_s > 0:
        return 1
    return max(1, min(maximum, math.ceil(cost_s / (TIMING_BUDGET * makespan_s))))
