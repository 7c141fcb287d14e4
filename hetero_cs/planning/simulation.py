"""Closed-loop simulation of online re-balancing with synthetic step times (pure: no TensorFlow, no sleeping).

``simulate_training`` drives a :class:`~hetero_cs.planning.monitor.StepTimeMonitor` and a
:class:`~hetero_cs.planning.rebalance.Rebalancer` with step times drawn from true cost models and multiplicative
noise, so the policy's behaviour (how many re-plans on steady devices, how fast work moves off a device that slowed)
is a deterministic function of a seed. The property tests and ``benchmarks/rebalance.py``'s reasoning use it.
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hetero_cs.errors import ConfigError
from hetero_cs.planning.cost_model import CostModel
from hetero_cs.planning.monitor import StepTimeMonitor
from hetero_cs.planning.plan import BatchPlan, check_range
from hetero_cs.planning.rebalance import RebalancePolicy, Rebalancer


@dataclasses.dataclass(frozen=True)
class SimulatedStep:
    """One step of ``simulate_training``.

    Attributes:
        step: 0-based step index.
        per_replica_batch_sizes: The slices this step ran with, shape [R].
        makespan_s: The observed (noisy) makespan, max_i of the noisy per-replica times.
        true_makespan_s: The noise-free makespan of these slices under the step's true models.
        replanned: True if the rebalancer switched plans after this step (the next step runs the new plan).
    """

    step: int
    per_replica_batch_sizes: tuple[int, ...]
    makespan_s: float
    true_makespan_s: float
    replanned: bool


def simulate_training(true_models_at_step: Callable[[int], Sequence[CostModel]], initial_plan: BatchPlan, *, steps: int,
                      policy: RebalancePolicy | None = None, base_models: Sequence[CostModel] | None = None,
                      window_steps: int = 16, max_batch_sizes: Sequence[int | None] | None = None,
                      relative_noise: float = 0.0, lognormal_sigma: float = 0.0, seed: int = 0) -> list[SimulatedStep]:
    """Drives a StepTimeMonitor and a Rebalancer with synthetic step times (no TensorFlow, no sleeping).

    At each step, replica i's observed time is true_models_at_step(step)[i].predict_step_time_s(b_i) times a
    multiplicative noise factor U(1 - relative_noise, 1 + relative_noise) * exp(N(0, lognormal_sigma^2)); after
    recording all replicas, the rebalancer may switch plans for the next step.

    Args:
        true_models_at_step: step -> the devices' true cost models at that step (length R); drift is a model
            that changes with the step.
        initial_plan: The plan the simulation starts with.
        steps: >= 0, steps to simulate.
        policy: Re-balance policy; None means the defaults.
        base_models: Calibrated models given to ``StepTimeMonitor.updated_cost_models``; None fits from the window.
        window_steps: The monitor's window.
        max_batch_sizes: Memory caps for the rebalancer, shape [R], or None.
        relative_noise: In [0, 1), half-width of the uniform multiplicative noise.
        lognormal_sigma: >= 0, sigma of the lognormal multiplicative noise.
        seed: Seed of the noise generator (numpy default_rng); equal arguments give equal results.

    Returns:
        One SimulatedStep per step.

    Raises:
        ConfigError: If steps, relative_noise or lognormal_sigma is out of range.

    Examples:
        Replica 1 runs 2x slower from step 100; the switch comes once the shift is clear (SHIFT_STEPS, 4 slow
        steps), not after the 9 slow steps a median over the 16-step window would need:

        >>> from hetero_cs.planning.cost_model import LinearCostModel, ScaledCostModel
        >>> from hetero_cs.planning.solver import plan_from_split
        >>> fast = LinearCostModel(0.0, 0.001)
        >>> slow_from_100 = lambda step: [fast, ScaledCostModel(fast, 2.0) if step >= 100 else fast]
        >>> trace = simulate_training(slow_from_100, plan_from_split([32, 32]), steps=200, base_models=[fast, fast])
        >>> [(s.step, trace[s.step + 1].per_replica_batch_sizes) for s in trace if s.replanned]
        [(103, (43, 21))]
    """
    check_range("steps", steps, 0, integer=True)
    if not (0.0 <= relative_noise < 1.0):
        raise ConfigError(f"relative_noise must be in [0, 1). Received: relative_noise={relative_noise!r}.")
    check_range("lognormal_sigma", lognormal_sigma, 0)
    rng = np.random.default_rng(seed)
    plan = initial_plan
    num_replicas = len(plan.per_replica_batch_sizes)
    monitor = StepTimeMonitor(num_replicas, window_steps=window_steps)
    rebalancer = Rebalancer(policy, max_batch_sizes=max_batch_sizes)
    trace: list[SimulatedStep] = []
    for step in range(steps):
        sizes = tuple(int(b) for b in plan.per_replica_batch_sizes)
        true_times_s = np.array([float(m.predict_step_time_s(b)) for m, b in zip(true_models_at_step(step), sizes)])
        noise = rng.uniform(1.0 - relative_noise, 1.0 + relative_noise, num_replicas)
        times_s = true_times_s * (noise * np.exp(rng.normal(0.0, lognormal_sigma, num_replicas)))
        for replica_id in rng.permutation(num_replicas):  # Any report order, as from executor threads.
            monitor.record(int(replica_id), sizes[replica_id], float(times_s[replica_id]))
        new_plan = rebalancer.propose_from_monitor(monitor, plan, base_models=base_models)
        trace.append(SimulatedStep(step, sizes, float(times_s.max()), float(true_times_s.max()), new_plan is not None))
        plan = new_plan or plan
    return trace


@dataclasses.dataclass(frozen=True)
class BalancedStep:
    """One step of ``simulate_balancer``.

    Attributes:
        step: 0-based step index.
        per_replica_batch_sizes: The slices this step ran with (served ``prefetch`` steps earlier), shape [R].
        plan_in_force: ``Balancer.plan``'s slices when the step ran, shape [R].
        makespan_s: The observed (noisy) makespan.
        true_makespan_s: The noise-free makespan of these slices under the step's true models.
        in_trial: True while the guard was trying a candidate.
    """

    step: int
    per_replica_batch_sizes: tuple[int, ...]
    plan_in_force: tuple[int, ...]
    makespan_s: float
    true_makespan_s: float
    in_trial: bool


def simulate_balancer(balancer: Any, true_models_at_step: Callable[[int], Sequence[CostModel]], global_batch_size: int,
                      *, steps: int, prefetch: int = 0, relative_noise: float = 0.0, common_noise_sigma: float = 0.0,
                      contention: float = 1.0, seed: int = 0) -> list[BalancedStep]:
    """Drives a :class:`~hetero_cs.planning.balancer.Balancer` as an engine would, with synthetic step times.

    Each step, the engine asks ``balancer.serve(B)`` for the slices of a batch that runs ``prefetch`` steps later
    (0, the default, is what the central-storage engine does: it decides each step's cut when the step starts; an
    engine that cut ahead of the step, in a prefetching input pipeline, is ``prefetch >= 1``); when a batch runs,
    replica i reports
    ``true_i(b_i) * c_k * u_ki``: c_k = exp(N(0, common_noise_sigma^2)) is shared by every replica of step k (the
    whole host got busier or quieter) and u_ki ~ U(1 - relative_noise, 1 + relative_noise) is the replica's own
    noise. Every step is timed. Cards that work together contend for the host (its cores, PCIe lanes, memory
    bandwidth), which calibration, timing each card on its own, does not see: in a step where two or more replicas
    have examples, each of them takes ``contention`` times its true time.

    Args:
        balancer: The Balancer under test (its monitor receives the reports).
        true_models_at_step: step -> the devices' true cost models at that step (length R).
        global_batch_size: B, the size of every batch.
        steps: >= 0, steps to simulate.
        prefetch: >= 0, batches cut ahead of the step that runs them (0: when the step starts).
        relative_noise: In [0, 1), per-replica multiplicative noise half-width.
        common_noise_sigma: >= 0, sigma of the per-step common-mode lognormal factor.
        contention: >= 1, the factor on every working replica's time in a step where two or more work.
        seed: numpy default_rng seed; equal arguments give equal results.

    Returns:
        One BalancedStep per step.

    Raises:
        ConfigError: If an argument is out of range, or ``true_models_at_step`` returns a number of models other
            than the balancer's replica count.
    """
    check_range("steps", steps, 0, integer=True)
    check_range("prefetch", prefetch, 0, integer=True)
    check_range("relative_noise", relative_noise, 0, 1)
    check_range("common_noise_sigma", common_noise_sigma, 0)
    check_range("contention", contention, 1)
    rng = np.random.default_rng(seed)
    queue = [balancer.serve(global_batch_size) for _ in range(prefetch)]
    trace: list[BalancedStep] = []
    for step in range(steps):
        queue.append(balancer.serve(global_batch_size))
        sizes = tuple(int(b) for b in queue.pop(0).per_replica_batch_sizes)
        true_models = true_models_at_step(step)
        if len(true_models) != len(sizes):
            raise ConfigError(
                f"true_models_at_step({step}) returned {len(true_models)} cost models for {len(sizes)} replicas. "
                f"Return one true cost model per replica of the balancer (num_replicas={len(sizes)}).")
        true_s = np.array([float(m.predict_step_time_s(b)) for m, b in zip(true_models, sizes)])
        true_s = true_s * (contention if sum(1 for b in sizes if b > 0) > 1 else 1.0)  # cards that work together
        common = float(np.exp(rng.normal(0.0, common_noise_sigma)))
        times_s = true_s * common * rng.uniform(1.0 - relative_noise, 1.0 + relative_noise, len(sizes))
        in_force = balancer.plan
        trace.append(BalancedStep(
            step, sizes, tuple(in_force.per_replica_batch_sizes) if in_force is not None else sizes,
            float(times_s.max()), float(true_s.max()), balancer.guard.in_trial))
        for replica_id in rng.permutation(len(sizes)):
            balancer.record_step_time(int(replica_id), sizes[replica_id], float(times_s[replica_id]))
    return trace
