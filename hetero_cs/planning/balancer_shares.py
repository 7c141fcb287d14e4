"""The Balancer's fixed shares: set them, or go back to the auto-balanced plan that was in force (pure).

Part of :class:`hetero_cs.planning.balancer.Balancer` (a base class of it, in its own module for size). This module
imports neither TensorFlow nor pynvml.
"""

from __future__ import annotations

from collections.abc import Sequence

from hetero_cs.errors import BatchSplitError
from hetero_cs.planning.plan import ordered_values, split_by_shares


class FixedShares:
    """Methods of :class:`~hetero_cs.planning.balancer.Balancer` (which holds the state they use, under its lock).

    Examples:
        >>> from hetero_cs.planning.balancer import Balancer
        >>> balancer = Balancer(3, rebalance=False, guard=False)
        >>> balancer.plan_for(12).per_replica_batch_sizes
        (4, 4, 4)
        >>> balancer.set_batch_split([2, 1, 1])
        >>> balancer.plan.per_replica_batch_sizes
        (6, 3, 3)
    """

    def set_batch_split(self, shares: Sequence[float] | None) -> None:
        """Fixes the relative shares (one per replica) from now on; None returns to auto-balance / even.

        Returning to auto-balance restores the plan that was in force before the shares were set (a plan the guard
        kept or reverted to stays as it was) when the global batch is the same; otherwise the split is solved anew.
        A failure (e.g. shares the split cannot use) leaves everything as it was.
        """
        if shares is not None:
            split_by_shares(0, shares)  # BatchSplitError for values that are not shares
            shares = list(ordered_values(shares))
            if len(shares) != self._num_replicas:
                raise BatchSplitError(f"shares must hold one share per replica ({self._num_replicas}). Received: "
                                      f"{len(shares)} shares {shares!r}.")
        with self._lock:
            if shares is None and self._shares is None:
                return  # already auto-balanced (or even): nothing changes, a running trial goes on
            previous = (self._shares, self._auto_plan, dict(self._plans_by_batch), dict(self._in_force_by_size))
            try:
                if shares is not None and self._shares is None:
                    self._auto_plan = self._plan  # the plan to come back to
                self._shares = None if shares is None else tuple(float(s) for s in shares)
                B, restored = self._reference_batch_size, self._auto_plan if shares is None else None
                if restored is not None and restored.global_batch_size != B:
                    restored = None  # the auto-balanced plan of another global batch: solved anew
                plan = restored if restored is not None or B is None else self._solve(B)
                self._forget_plans()
                if restored is not None:
                    self._auto_plan = None
                if plan is not None:
                    self._commit(plan)
            except Exception:
                self._shares, self._auto_plan, self._plans_by_batch, self._in_force_by_size = previous
                raise
