"""The minimum-makespan split of a global batch under micro-batched linear curves, in closed form (pure).

For cards whose step time is a line ``t(b) = a + c b`` with ``t(0) = 0``, a card that runs ``b`` examples as
``ceil(b / cap)`` micro-batches back to back takes ``ceil(b / cap) a + c b``; the most examples it runs within a
time ``T`` is exact, so a bisection over ``T`` finds the split that
:func:`~hetero_cs.planning.micro_batches.plan_overlapped_micro_batches` would otherwise ask the general solver for.
"""

from __future__ import annotations

import math

from hetero_cs.planning.cost_model import line_of


def _linear_split(models, caps, B: int) -> tuple[int, ...] | None:
    """The minimum-makespan split of ``B`` under micro-batched lines, in closed form (None unless every model is a
    line with a positive slope and ``t(0) = 0``): the least ``T`` at which the cards hold ``B`` examples in all,
    by bisection over the cards' own step times, each card's most examples within ``T`` exact."""
    lines = [line_of(m) for m in models]
    if any(line is None or line[1] <= 0 or not line[2] for line in lines):
        return None

    def time_of(i: int, b: int) -> float:
        if b == 0:
            return 0.0
        a, c, _ = lines[i]
        cap = caps[i]
        return (1 if cap is None else -(-b // cap)) * a + c * b

    def most_within(i: int, T: float) -> int:
        a, c, _ = lines[i]
        cap = caps[i]
        if cap is not None and cap < 1:
            return 0
        if cap is None:
            return max(0, math.floor((T - a) / c + 1e-9)) if T >= a + c else 0
        best, k_star = 0, T / (a + c * cap) if a + c * cap > 0 else 0.0
        for k in {max(1, math.floor(k_star)), max(1, math.ceil(k_star)), max(1, math.ceil(k_star) + 1)}:
            b = min(k * cap, math.floor((T - k * a) / c + 1e-9))
            if b > (k - 1) * cap:  # k micro-batches hold more than k - 1 do
                best = max(best, b)
        while best > 0 and time_of(i, best) > T:  # guard the float floor
            best -= 1
        return best

    R = len(models)
    low, high = 0.0, max(time_of(i, B) for i in range(R) if caps[i] is None or caps[i] >= 1)
    for _ in range(200):
        if high - low <= 1e-12 * max(1.0, high):
            break
        middle = (low + high) / 2
        if sum(most_within(i, middle) for i in range(R)) >= B:
            high = middle
        else:
            low = middle
    # The makespan is one card's time at some slice: the least such time that holds B (exact, not the bisection's).
    candidates = sorted({time_of(i, most_within(i, high)) for i in range(R)})
    T = next((t for t in candidates if sum(most_within(i, t) for i in range(R)) >= B), None)
    if T is None:  # a slope so small beside the fixed cost that float rounding loses examples: the solver decides
        return None
    split = [most_within(i, T) for i in range(R)]
    excess = sum(split) - B
    for i in reversed(range(R)):  # fewer examples never take longer: trim the excess from the last cards
        cut = min(excess, split[i])
        split[i] -= cut
        excess -= cut
    return tuple(split)
