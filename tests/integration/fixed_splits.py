"""Strategies with fixed shares for the oracle tests (test_exact_patterns, test_real_workloads): one per replica count
for the whole process, re-split with ``set_batch_split`` for each test."""

from hetero_cs import HeteroCentralStorageStrategy

_STRATEGIES: dict[int, HeteroCentralStorageStrategy] = {}


def strategy_for(shares) -> HeteroCentralStorageStrategy:
    """The strategy over ``len(shares)`` logical CPUs (``/cpu:1`` on), split by ``shares`` from now on."""
    num_replicas = len(shares)
    if num_replicas not in _STRATEGIES:
        devices = [f"/cpu:{i}" for i in range(1, num_replicas + 1)]
        _STRATEGIES[num_replicas] = HeteroCentralStorageStrategy(
            devices, auto_balance=False, rebalance=False, batch_split=list(shares), profile_cache=False)
    strategy = _STRATEGIES[num_replicas]
    strategy.set_batch_split(list(shares))
    return strategy
