"""Out-of-memory recovery inside a training step: re-plan within lower caps and retry the same global batch.

When one replica's step runs out of memory (a GPU's ``tf.errors.ResourceExhaustedError``, or any other form a GPU
raises it in - a failed host-to-device copy, cuBLAS or cuDNN failing to allocate -, or an emulated device whose memory
the slice exceeds; :mod:`hetero_cs.devices.device_errors` reads which and on which replica), nothing of that step has been
applied: the optimizer's update waits for every
replica's gradients (see :mod:`hetero_cs.engine.step.step_errors`). :class:`StepRecovery` then

1. asks the :class:`~hetero_cs.planning.balancer.Balancer` to lower that replica's cap and re-solve the plan
   within the caps (:meth:`~hetero_cs.planning.balancer.Balancer.recover_from_oom`);
2. runs the same step again on the *same* global batch, which the step cuts when it starts by the plan in force
   then (the element holds the whole batch on the host and keeps its type spec: the step's ``tf.function`` is not
   retraced), at most ``MemoryRecoveryPolicy.max_retries`` times, then raises
   :class:`hetero_cs.errors.StepOOMError` naming the device, the caps tried and what to do.

An out-of-memory error that names no replica (its device runs no replica, e.g. the parameter device, or it names
no device and no replica's op) raises :class:`hetero_cs.errors.StepOOMError` with ``replica_id=None`` at once: no
replica is blamed by default. A device error (a failing card, not out of memory) is retried once and its card then
set aside (:mod:`hetero_cs.engine.faults.failover`). Any other error passes through unchanged.

Every example of the batch is used exactly once: the batch that failed is the batch retried, and the data iterator
is not advanced. Each cap change is logged (logger ``hetero_cs.engine.central_storage``, WARNING for a drop, INFO
for growth), counted in the fit logs (:class:`hetero_cs.engine.callbacks.BalanceCallback`) and written back to
the profile cache entry the calibration came from, so the next run starts from the lower cap.
"""

import logging
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from hetero_cs.devices.device_errors import OutOfMemory, classify, device_fault
from hetero_cs.devices.workload import max_examples_in_memory
from hetero_cs.engine._compat import global_batch_size_of
from hetero_cs.engine.faults.failover import DeviceFailover
from hetero_cs.engine.step.model_state import restore, saved_state
from hetero_cs.engine.step.step_errors import replica_step_error, xla_compile_error
from hetero_cs.errors import EmulatedDeviceError, EmulatedOutOfMemoryError, InfeasiblePlanError, StepOOMError

logger = logging.getLogger("hetero_cs.engine.central_storage")  # the messages users filter on

_NO_EXAMPLE = "that replica had no example in this step, so a lower cap cannot help (something else holds its memory)"


def unblamed_oom_error(oom: OutOfMemory, exc: Exception, *, parameter_device: str | None = None,
                       global_batch_size: int | None = None) -> StepOOMError:
    """The StepOOMError for an out-of-memory error that names no replica (``replica_id`` None): what it named, why no
    replica was blamed and what to do."""
    if oom.device is not None:
        where = (f"on {oom.device}, the parameter device (it holds the variables and applies the update), "
                 if oom.device == parameter_device else f"on {oom.device}, which runs no replica, ")
        why = f"It ran out of memory {where}so no replica's slice is to blame and no cap was lowered."
        fix = ("Free that device's memory (another process may hold it), or choose another parameter_device (the "
               "default host memory, '/device:CPU:0', holds the most)." if oom.device == parameter_device else
               "Free that device's memory (another process may hold it).")
    else:
        why = ("The error names no device and no replica's op, so hetero_cs cannot tell which replica's slice to "
               "shrink and blames none (it does not guess replica 0).")
        fix = ("Run once with TF_CPP_MIN_LOG_LEVEL=0: TensorFlow's allocator logs the device it ran out on ('Allocator "
               "(GPU_<n>_bfc) ran out of memory ...'). Then free that device's memory (another process may hold it), "
               "set memory growth (tf.config.experimental.set_memory_growth) so processes sharing a GPU do not "
               "take it all, use a smaller global batch size or model, or leave the device out of compute_devices.")
    return StepOOMError(
        f"The training step ran out of memory ({oom.form}: {type(exc).__name__}) and could not be recovered. {why} "
        f"No update of this step was applied: variables and optimizer state are as they were before it. {fix} The "
        f"original error is chained below.",
        replica_id=None, device=oom.device, global_batch_size=global_batch_size, last_error=exc)


class StepRecovery:
    """Runs one training step on one global batch, retrying it within lower caps after an out-of-memory error.

    Args:
        strategy: The HeteroCentralStorageStrategy (its balancer, devices and profile cache).
    """

    def __init__(self, strategy, *, always: bool = False, memory: bool = True,
                 on_device_error: str = "exclude") -> None:
        self._strategy = strategy
        self._always = bool(always)
        self.memory_recovery = bool(memory)  # False: out-of-memory errors pass through (oom_recovery=False)
        self.failover = DeviceFailover(strategy, on_device_error)  # failing cards (hetero_cs.engine.faults.failover)
        self._possible_by_size: dict[int | None, bool] = {}
        self.recoveries = 0  # retries after an out-of-memory step, since construction
        self.max_retries_used = 0  # the most retries one global batch needed

    def armed(self) -> bool:
        """Whether ``fit`` keeps each batch in hand for a retry (reads it before the step, ~1 ms of host time).

        Always with ``oom_recovery=True`` or a policy; by default only where a step can run out of memory: on a GPU,
        or on an emulated device whose least memory (its size, a ``NAME@SIZE`` override or a ``Drift``'s
        ``memory_bytes``) cannot hold a slice of the whole global batch. Decided once per global batch size. Also
        where a card may fail and ``on_device_error="exclude"`` (:meth:`DeviceFailover.possible`).
        """
        if self.failover.possible() or (self.memory_recovery and self._always):
            return True
        if not self.memory_recovery:
            return False
        strategy, B = self._strategy, self._strategy.balancer.reference_batch_size
        if B not in self._possible_by_size:
            self._possible_by_size[B] = _out_of_memory_possible(strategy.compute_devices, strategy.emulator, B)
        return self._possible_by_size[B]

    def run(self, step: Callable[[Any], Any], data: Any, *, replica_scopes: Sequence[str] = (),
            model: Any = None, training: bool = True) -> Any:
        """``step(data)``, retried on the same global batch (re-cut by the new plan) after an out-of-memory step
        or, in training, a device error (:mod:`hetero_cs.engine.faults.failover`).

        ``replica_scopes``: name scopes only replicas' ops run under (``fit`` passes the model's name), for blame
        by op name (:mod:`hetero_cs.devices.device_errors`). ``model``: the Keras model being fit; its non-trained and
        metric variables, which the replicas of a failed attempt may have updated before one of them failed (a
        BatchNormalization's moving statistics, the loss tracker), are put back before each retry, so an evaluation
        also counts each example once. Other errors pass through unchanged.

        ``training`` False: an evaluation or prediction batch. The replica blamed gets a lower cap
        (:meth:`~hetero_cs.planning.balancer.Balancer.lower_cap`, shared with training: an inference slice that does
        not fit would not fit a training step either), and the whole batch runs again: cut within the new caps, or
        as sub-steps within them when they cannot hold it in one step (``step`` decides;
        :meth:`hetero_cs.engine.memory.micro_batches.MicroBatching.run_inference`).

        Raises:
            StepOOMError: Still out of memory after ``max_retries`` retries, the caps cannot hold the batch, the
                replica blamed had no example, or the error names no replica (``replica_id`` None).
        """
        strategy = self._strategy
        balancer = strategy.balancer
        global_batch_size = global_batch_size_of(data)
        if training and (global_batch_size is None or len(strategy.compute_devices) == 1):
            return step(data)  # one replica: nothing to move elsewhere
        kind = "training" if training else "evaluation or prediction"
        retries = balancer.memory_caps.policy.max_retries
        tried: dict[int, list[int]] = {}
        faults: dict[int, int] = {}  # device errors per replica in this batch (hetero_cs.engine.faults.failover)
        attempt = 0
        saved = saved_state(model) if model is not None else None
        while True:
            try:
                outputs = step(data)
            except (tf.errors.OpError, EmulatedOutOfMemoryError, EmulatedDeviceError) as exc:  # eager: as themselves
                restore(saved)  # whatever follows (a retry, sub-steps, the error) starts from the state before
                fault = device_fault(exc, strategy.compute_devices, replica_scopes) if training else None
                if fault is not None and fault.replica_id is not None:
                    sizes = strategy._slicer.last_step_sizes()  # noqa: SLF001
                    self.failover.handle(fault, exc, faults, sizes[fault.replica_id], global_batch_size)
                    continue  # the same batch, on the same plan once, then on the others
                # The replica an out-of-memory error blames, and its slice in the attempt that failed.
                oom = classify(exc, strategy.compute_devices, replica_scopes) if self.memory_recovery else None
                if oom is None:
                    raise  # not out of memory, or recovery off: a shape error, a failed input pipeline, ... as it is
                if oom.replica_id is None:
                    raise unblamed_oom_error(oom, exc, parameter_device=strategy.parameter_device,
                                             global_batch_size=global_batch_size) from exc
                replica_id = oom.replica_id
                size = strategy._slicer.last_step_sizes()[replica_id]  # noqa: SLF001 - the cut the attempt started with
                tried.setdefault(replica_id, []).append(size)
                if size == 0:
                    raise self._error(replica_id, tried, global_batch_size, exc, _NO_EXAMPLE, step=kind) from exc
                if training:
                    try:  # the cap falls even when this was the last retry: what follows (sub-steps) starts from it
                        plan, change = balancer.recover_from_oom(replica_id, size, global_batch_size)
                    except InfeasiblePlanError:
                        self._note(balancer.memory_caps.history[-1])
                        why = f"the caps now {balancer.max_batch_sizes} cannot hold the batch in one step"
                        raise self._error(replica_id, tried, global_batch_size, exc, why) from exc
                    retry = list(plan.per_replica_batch_sizes)
                    if attempt == retries:
                        self._note(change)
                if attempt == retries:
                    raise self._error(replica_id, tried, global_batch_size, exc,
                                      f"it still ran out of memory after {retries} retries", step=kind) from exc
                if not training:  # an inference batch is cut again when it runs
                    change, retry = balancer.lower_cap(replica_id, size), []
                self.recoveries += 1
                attempt += 1
                if training:
                    self.max_retries_used = max(self.max_retries_used, attempt)
                self._note(change, retry=retry)
                continue  # the retried step cuts the batch by the plan in force now (the guard's trial is over)
            if training:
                for change in balancer.record_step_success(strategy._slicer.last_step_sizes()):  # noqa: SLF001
                    self._note(change)
            return outputs

    def _note(self, change, retry: list[int] | None = None) -> None:
        device = self._strategy.compute_devices[change.replica_id]
        if retry == []:  # an inference batch: cut again when it runs
            logger.warning("hetero_cs: out of memory on %s in an evaluation or prediction step: %s; retrying the same "
                           "batch within the new caps.", device, change.describe())
        elif retry is not None:
            logger.warning("hetero_cs: out of memory on %s: %s; retrying the same global batch cut %s.",
                           device, change.describe(), retry)
        else:
            logger.info("hetero_cs: memory cap on %s: %s.", device, change.describe())
        self._strategy._write_back_caps()  # noqa: SLF001 - the profile cache entry the plan came from

    def _error(self, replica_id: int, tried: dict, global_batch_size: int, exc: Exception, why: str,
               step: str = "training") -> StepOOMError:
        caps_tried, device = tried[replica_id], self._strategy.compute_devices[replica_id]
        known = self._strategy.balancer.memory_caps.known_to_fit()
        return StepOOMError(
            f"The {step} step ran out of memory on replica {replica_id} ({device}) and could not be recovered: "
            f"{why}. Slices tried on that replica: caps_tried={caps_tried} examples, global_batch_size="
            f"{global_batch_size}, caps now {self._strategy.balancer.max_batch_sizes} (a cap lowered by an "
            f"out-of-memory step is an upper bound; known to fit: {known} examples, {sum(known)} in all). "
            + ("No update of this step was applied: variables and optimizer state are as they were before it. "
               if step == "training" else "The metrics are as they were before this batch. ")
            + "Free that device's memory (another process may hold it), use a smaller "
            + ("global batch size" if step == "training" else
               "batch_size in evaluate or predict (in fit: validation_batch_size)")
            + " or model, or leave the device out of compute_devices. The original error is chained below.",
            replica_id=replica_id, device=device, caps_tried=tuple(caps_tried),
            global_batch_size=global_batch_size, last_error=exc)


def _out_of_memory_possible(compute_devices: Sequence[str], emulator: Any, global_batch_size: int | None) -> bool:
    """True on a GPU; on emulated devices, when some replica's least memory cannot hold ``global_batch_size``
    examples (or the size or the model is not known yet); False on plain CPU devices, whose memory is the host's."""
    if any("GPU" in device.upper() for device in compute_devices):
        return True
    if emulator is None:
        return False
    if global_batch_size is None or getattr(emulator, "workload", None) is None:
        return True
    fits = [max_examples_in_memory(emulator.workload, emulator.lowest_memory_bytes(i))
            for i in range(len(compute_devices))]
    return any(examples is not None and examples < global_batch_size for examples in fits)


def strategy_step_error(strategy, exc: Exception, replica_scopes=(), kind: str = "training"):
    """The library's error for TensorFlow's ``exc`` from one of ``strategy``'s steps, or None.

    That is the input pipeline's own error if it is what failed, a ConfigError if XLA could not compile the fused
    update or a replica's forward and backward pass, a StepOOMError for an out-of-memory error that names no
    replica, a DeviceFaultError for a device error (:mod:`hetero_cs.engine.faults.failover`) that names one, else a
    ReplicaStepError naming the replica (an out-of-memory error's by :mod:`hetero_cs.devices.device_errors`).
    ``replica_scopes``: name scopes only replicas' ops run under (``fit`` passes the model's name).
    """
    known = strategy._input_error_raised(exc) or xla_compile_error(exc)  # noqa: SLF001
    if known is not None:
        return known
    oom = classify(exc, strategy.compute_devices, replica_scopes)
    if oom is not None and oom.replica_id is None:
        return unblamed_oom_error(oom, exc, parameter_device=strategy.parameter_device)
    fault = device_fault(exc, strategy.compute_devices, replica_scopes)
    if fault is not None and fault.replica_id is not None:  # a failing card, not retried here: a DeviceFaultError
        recovery = getattr(strategy, "_step_recovery", None)
        failover = recovery.failover if recovery is not None else DeviceFailover(strategy, "raise")
        why = ("this step was not run by model.fit with the batch in hand (a custom loop, "
               "steps_per_execution > 1 or one replica), so it was not retried")
        return failover.error(fault.replica_id, exc, why, restored=False)
    return replica_step_error(
        exc, compute_devices=strategy.compute_devices, plan=strategy.plan,
        empty_slice_plan=strategy._empty_slices.last_plan,  # noqa: SLF001
        replica_id=oom.replica_id if oom is not None else None, kind=kind,
        failed_sizes=strategy._slicer.last_step_sizes())  # noqa: SLF001
