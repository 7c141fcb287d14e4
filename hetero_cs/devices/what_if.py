"""What-if planning from catalog figures: which split, micro-batches and speedup a mix of cards would give (pure).

``hetero-cs plan --devices A10,T4,P100 [--add V100] [--drop P100] --global-batch-size B`` answers without the
hardware and without a profile. Each card's step time is the emulation model's
(:func:`hetero_cs.devices.workload.emulated_step_time_s`: the catalog's peak FLOP/s of the rate TensorFlow runs the
model at on that card - TF32 for float32 on Ampere and newer unless ``tensor_float_32=False`` - at the default
efficiency, the layers' memory traffic at the card's bandwidth, its PCIe link, a fixed cost per step and per layer),
its memory cap the examples its catalog memory holds
(:func:`hetero_cs.devices.workload.max_examples_in_memory`, or a ``NAME@SIZE`` override); the plan is what the
strategies would solve from such models (idle-free: a card may be left out; micro-batched where the caps bind). The
figures are predictions from published peak figures, not measurements: calibration on the real cards replaces them.

Pure Python: no TensorFlow.
"""

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

from hetero_cs.devices.catalog import DeviceSpec, get_device_spec
from hetero_cs.devices.workload import Workload, emulated_step_time_s, max_examples_in_memory
from hetero_cs.errors import ConfigError, InfeasiblePlanError, MicroBatchError
from hetero_cs.planning.cost_model import LinearCostModel, idle_free
from hetero_cs.planning.micro_batches import (
    MicroBatchPlan, capacity_of, plan_micro_batches, plan_overlapped_micro_batches, prefer_overlapped)
from hetero_cs.planning.plan import even_batch_split
from hetero_cs.planning.solver import solve_batch_split

DEFAULT_WORKLOAD = Workload(flops_per_example=7_715_946_496, parameter_bytes=102_334_368,
                            optimizer_bytes=2 * 102_334_368, activation_bytes_per_example=148_480_848,
                            non_trainable_bytes=212_480, layers=176)
"""ResNet-50 on 224x224x3 images in float32 (TF32 where a card has it, TensorFlow's default), trained with Adam: the
figures ``hetero_cs.devices.workload.estimate_workload(keras.applications.ResNet50(weights=None))`` gives (Keras
3.15; 7.7 GFLOP per example forward, two per multiply-add, as He et al. 2016 count 3.8e9 multiply-adds; 25.6 M
parameters; 176 leaf layers), plus Adam's two slots per parameter."""


@dataclasses.dataclass(frozen=True)
class CatalogCostModel:
    """A card's step time from its catalog figures (a cost model: ``predict_step_time_s(b)`` in seconds)."""

    spec: DeviceSpec
    workload: Workload

    def predict_step_time_s(self, batch_size: int) -> float:
        return emulated_step_time_s(self.spec, int(batch_size), self.workload)


def _as_line(model):
    """The catalog model as the :class:`LinearCostModel` it is (a fixed cost plus a cost per example), so that the
    planners take their closed-form paths (a batch of a million examples plans in milliseconds); as it is if not."""
    c = model.predict_step_time_s(2) - model.predict_step_time_s(1)
    a = model.predict_step_time_s(1) - c  # from one example on (an idle card's 0 is the planners' own rule)
    far = model.predict_step_time_s(65536)
    return model if a < 0 or c <= 0 or abs(far - (a + 65536 * c)) > 1e-9 * max(1.0, far) else LinearCostModel(a, c)


def mix(devices: Sequence[str], *, add: Sequence[str] = (), drop: Sequence[str] = ()) -> list[str]:
    """``devices`` plus ``add``, minus one card per ``drop`` name (the last one of that name).

    Raises:
        ConfigError: A ``drop`` name is not in the mix, or nothing is left.
    """
    names = list(devices) + list(add)
    for name in drop:
        if not (matches := [i for i, n in enumerate(names) if n.upper() == name.upper()]):
            raise ConfigError(f"--drop {name}: no such card in the mix {names}. Drop one of the names listed.")
        del names[matches[-1]]
    if not names:
        raise ConfigError("The mix is empty after --drop; keep at least one card.")
    return names


def what_if(devices: Sequence[str], global_batch_size: int, workload: Workload = DEFAULT_WORKLOAD) -> dict[str, Any]:
    """The plan a mix of catalog cards would run for a global batch, with its speedups (see the module docstring).

    Args:
        devices: Catalog names, one per card (``"A10"``, ``"T4@8GB"``, ...).
        global_batch_size: ``B >= 1``.
        workload: The model's figures (default: :data:`DEFAULT_WORKLOAD`).

    Returns:
        A JSON-ready dict: ``devices``, ``global_batch_size``, ``predicted_step_s``, ``examples_per_s``,
        ``per_replica_batch_sizes``, ``micro_batch_sizes``, ``micro_batch_counts``, ``sub_steps``,
        ``memory_caps`` (examples per card), ``idle`` (indices of cards left out), ``sub_step_batch_sizes`` (each
        sub-step's cut, shape [K][R]), ``sub_step_busy_s`` (each card's predicted time in each sub-step, seconds,
        shape [K][R]: a sub-step lasts its row's maximum, the others wait), ``predicted_busy_s`` (their sum per
        card, shape [R]), ``overlapped`` (each card's micro-batches back to back within a call, as the engine runs
        an overlapped plan: then a call, not a sub-step, lasts its slowest card's sum) and ``call_sub_steps`` (the
        sub-steps of each such call, or None), ``even_split_step_s`` (the even split
        over every card, in as few equal sub-steps as the smallest card's memory needs; None when a card holds no
        example), ``speedup_vs_even`` (None then too), ``fastest_card``,
        ``fastest_card_step_s`` and ``speedup_vs_fastest`` (all cards against the fastest card alone on the whole
        batch, micro-batched where its memory requires), ``compute_rates`` (per card, the rate its step is
        predicted at: "tf32", "fp32", "fp16" or "bf16"), ``peak_tflops`` (that rate's peak per card) and
        ``predicted_from: "catalog"`` (predictions from published figures: neither measured nor emulated).

    Raises:
        UnknownEmulatedDeviceError: A name is not in the catalog.
        ConfigError: ``B`` is not an integer >= 1.
        MicroBatchError: No card can hold one example.
    """
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise ConfigError(f"global_batch_size must be an integer >= 1. Received: {global_batch_size!r}.")
    specs = [get_device_spec(name) for name in devices]
    models = idle_free([_as_line(CatalogCostModel(spec, workload)) for spec in specs])
    caps = [max_examples_in_memory(workload, spec.memory_bytes) for spec in specs]
    plan = _micro_plan(models, caps, global_batch_size)
    B, R = global_batch_size, len(specs)
    # The step of the even split over every card, in as few equal sub-steps as the smallest card's memory needs (each
    # sub-step cut evenly: what stock central storage would run, micro-batched); None when a card holds nothing.
    smallest = min((cap for cap in caps if cap is not None), default=None)
    sub_steps = 1 if not smallest else max(1, math.ceil(B / (R * smallest)))
    even_s = None if smallest == 0 else sum(
        max(model.predict_step_time_s(b) for model, b in zip(models, even_batch_split(size, R)))
        for size in even_batch_split(B, sub_steps))
    alone = {i: _micro_plan([models[i]], [caps[i]], B).predicted_makespan_s for i in range(R)
             if caps[i] is None or caps[i] > 0}
    fastest = min(alone, key=alone.get)
    step_s = plan.predicted_makespan_s
    busy = [[model.predict_step_time_s(b) for model, b in zip(models, p.per_replica_batch_sizes)]
            for p in plan.sub_step_plans]
    return {
        "devices": [spec.name for spec in specs],
        "global_batch_size": B,
        "predicted_step_s": step_s,
        "examples_per_s": B / step_s,
        "per_replica_batch_sizes": list(plan.per_replica_batch_sizes),
        "micro_batch_sizes": list(plan.micro_batch_sizes),
        "micro_batch_counts": list(plan.micro_batch_counts),
        "sub_steps": plan.num_sub_steps,
        "memory_caps": caps,
        "idle": [i for i, k in enumerate(plan.micro_batch_counts) if k == 0],
        "sub_step_batch_sizes": [list(p.per_replica_batch_sizes) for p in plan.sub_step_plans],
        "sub_step_busy_s": busy,
        "predicted_busy_s": [sum(row[i] for row in busy) for i in range(R)],
        "overlapped": plan.overlapped,
        "call_sub_steps": [len(call) for call in plan.calls] if plan.overlapped else None,
        "even_split_step_s": even_s,
        "speedup_vs_even": None if even_s is None else even_s / step_s,
        "fastest_card": specs[fastest].name,
        "fastest_card_step_s": alone[fastest],
        "speedup_vs_fastest": alone[fastest] / step_s,
        "compute_rates": [spec.rate_name(workload.compute_dtype, tf32=workload.tensor_float_32) for spec in specs],
        "peak_tflops": [spec.peak_tflops(workload.compute_dtype, tf32=workload.tensor_float_32) for spec in specs],
        "predicted_from": "catalog",
    }


def _micro_plan(models, caps, global_batch_size: int) -> MicroBatchPlan:
    """The plan the engine would choose: sub-steps with a barrier each (or one step), or, with two or more cards,
    the overlapped plan where it is predicted faster (:func:`~hetero_cs.planning.micro_batches.prefer_overlapped`)."""
    solve = functools.partial(solve_batch_split, models, max_batch_sizes=caps, min_batch_size=0)  # solve(b)
    try:
        barrier = plan_micro_batches(global_batch_size, solve, capacity=capacity_of(caps))
        if len(models) < 2 or all(cap is None for cap in caps):
            return barrier
        single = barrier.predicted_makespan_s if barrier.num_sub_steps == 1 else barrier.single_step_makespan_s
        overlapped = plan_overlapped_micro_batches(global_batch_size, models, caps, single_step_makespan_s=single)
        return prefer_overlapped(barrier, overlapped)
    except InfeasiblePlanError as exc:
        raise MicroBatchError(f"{exc} Memory caps: {caps} examples per card.") from exc


def format_what_if(result: dict[str, Any]) -> str:
    """A table of :func:`what_if`'s result, one line per card, then the step and the speedups."""
    lines = [f"What-if plan (PREDICTED from catalog figures, not measured) for {', '.join(result['devices'])}, "
             f"global batch {result['global_batch_size']}:",
             f"{'card':>4}  {'device':<16} {'peak TF':>10}  {'examples':>8}  {'micro-batch':>11}  {'count':>5}  "
             f"{'memory cap':>10}"]
    for i, name in enumerate(result["devices"]):
        count = result["micro_batch_counts"][i]
        micro = "idle" if count == 0 else str(result["micro_batch_sizes"][i])
        cap = result["memory_caps"][i]
        rate = f"{result['peak_tflops'][i]:.1f} {result['compute_rates'][i]}"
        lines.append(f"{i:>4}  {name:<16} {rate:>10}  {result['per_replica_batch_sizes'][i]:>8}  {micro:>11}  "
                     f"{count:>5}  {'none' if cap is None else cap:>10}")
    even, K = result["speedup_vs_even"], result["sub_steps"]
    if result["overlapped"]:
        calls = len(result["call_sub_steps"])
        how = (f"in {K} sub-steps, each card's micro-batches back to back"
               + ("" if calls == 1 else f" (in {calls} calls, each ending at a barrier)"))
    else:
        how = "in one step" if K == 1 else f"in {K} sub-steps, each ending at a barrier (all wait for the slowest)"
    lines += [
        f"predicted step: {result['predicted_step_s'] * 1e3:.2f} ms {how}, {result['examples_per_s']:.0f} examples/s",
        f"speedup vs the even split: {'n/a (a card holds no example)' if even is None else f'{even:.3f}x'}",
        f"speedup vs the fastest card alone ({result['fastest_card']}): {result['speedup_vs_fastest']:.3f}x"]
    if result["idle"]:
        lines.append(f"left out (idle): cards {result['idle']}; the others finish sooner without them")
    return "\n".join(lines)
