"""Failing cards in a training step: a device error is told from a program error, retried once, then set aside.

Old cards fail: an uncorrectable ECC error, a thermal trip, a card that falls off the bus. TensorFlow reports such a
fault in the step that met it, as ``tf.errors.InternalError`` or ``tf.errors.UnknownError`` around the driver's
text, and nothing of that step has been applied (the host's update waits for every replica's gradient; see
:mod:`hetero_cs.engine.step.step_errors`). With ``on_device_error="exclude"`` (the default), ``model.fit``
(:class:`hetero_cs.engine.memory.oom_recovery.StepRecovery`) then

1. retries the same global batch once on the same plan: a transient fault costs one step;
2. if the same replica fails again, sets it aside for good: its memory cap becomes 0
   (:meth:`hetero_cs.planning.balancer.Balancer.exclude_replica`), so every later plan gives it 0 examples and an
   idle replica runs nothing on its device; the plan is solved again from the other cards' cost models, the
   exclusion is logged (WARNING, naming the card), and the same global batch is retried on the others.

No example is lost or applied twice: the batch that failed is the batch retried. This holds only where the card's CUDA
context still works. A sticky CUDA error (:data:`~hetero_cs.devices.fault_texts.STICKY_FORMS`: an uncorrectable ECC error, an illegal address, a
launch failure, a hardware stack error, a lost card, a failed sync) breaks it: every later op on that card fails in
this process. Such an error is neither retried nor set aside: the step ends with :class:`DeviceFaultError`, and
``hetero-cs run`` decides from NVML whether the card is lost (:mod:`hetero_cs.supervisor`). In-process exclusion is
for the faults that leave the context usable (cuBLAS or cuDNN failing to execute, an emulated ``Drift(fails=True)``).
With ``on_device_error="raise"`` the first device error ends the step with :class:`hetero_cs.errors.DeviceFaultError`, as does a fault when no other
card is left.

What is a device error and which replica it names is read from the error by
:func:`hetero_cs.devices.device_errors.device_fault`. Everything else is a program error and is never taken for a
failing card (a shape error, a NaN check, a device-side assert, any Python error): it ends the step as a
:class:`~hetero_cs.errors.ReplicaStepError` naming the replica. A fault that moves from card to card after each
exclusion is not the cards': when the last card fails too, the error says so.
"""

import logging

from hetero_cs.devices.device_errors import DeviceFault, first_line
from hetero_cs.errors import ConfigError, DeviceFaultError, InfeasiblePlanError

logger = logging.getLogger("hetero_cs.engine.central_storage")  # the messages users filter on

ON_DEVICE_ERROR_CHOICES = ("exclude", "raise")


def check_setting(on_device_error: object) -> str:
    """``on_device_error`` as given, if it is ``"exclude"`` or ``"raise"``; else a ConfigError."""
    if on_device_error not in ON_DEVICE_ERROR_CHOICES or not isinstance(on_device_error, str):
        raise ConfigError(f"on_device_error must be 'exclude' (the default: a card whose step fails twice with a "
                          f"device error is set aside and the step retried on the others) or 'raise' (the error ends "
                          f"fit). Received: on_device_error={on_device_error!r}.")
    return on_device_error


class DeviceFailover:
    """The failing-card policy of one strategy's ``fit`` steps: counts faults per batch, retries, excludes.

    Args:
        strategy: The HeteroCentralStorageStrategy (its balancer, devices and emulator).
        on_device_error: ``"exclude"`` or ``"raise"``.
    """

    def __init__(self, strategy, on_device_error: str = "exclude") -> None:
        self._strategy = strategy
        self.on_device_error = check_setting(on_device_error)
        self.retries = 0  # retries after a device error, since construction
        self.exclusions: list[int] = []  # replicas set aside, in order

    def possible(self) -> bool:
        """Whether a step may meet a failing card, so that ``fit`` keeps the batch in hand (to retry it, or, with
        ``"raise"``, to put the model's statistics and metrics back before raising): on a GPU, or on emulated
        devices whose drift makes a card fail (``Drift(fails=True)``)."""
        strategy = self._strategy
        return any("GPU" in device.upper() for device in strategy.compute_devices) or bool(
            getattr(strategy.emulator, "may_fail", False))

    def card(self, replica_id: int) -> str:
        """``"/device:CPU:2 (emulated T4)"`` or ``"/device:GPU:1"``: the card, as log lines name it."""
        device, emulator = self._strategy.compute_devices[replica_id], self._strategy.emulator
        return f"{device} (emulated {emulator.specs[replica_id].name})" if emulator is not None else device

    def handle(self, fault: DeviceFault, exc: BaseException, faults: dict[int, int], failed_batch_size: int,
               global_batch_size: int):
        """Decides what follows a device error in one global batch's step: returns the plan to retry with (None:
        the same plan), or raises :class:`DeviceFaultError`.

        Args:
            fault: From :func:`device_fault`, with a replica.
            exc: TensorFlow's error.
            faults: Device errors per replica so far in this global batch (updated here).
            failed_batch_size: The replica's slice in the step that failed.
            global_batch_size: The batch to retry.
        """
        replica_id = fault.replica_id
        balancer = self._strategy.balancer
        if self.on_device_error == "raise":
            raise self.error(replica_id, exc, "on_device_error='raise'") from exc
        if fault.sticky:
            raise self.error(replica_id, exc, (
                "the error is sticky: CUDA's context on that card is broken, so nothing more runs on it in this "
                "process, and neither a retry nor the other cards can go on here. Whether the card is lost is for "
                "NVML to say (an illegal address is most often the program's): under `hetero-cs run` the script is "
                "restarted without the card only when NVML shows it lost")) from exc
        faults[replica_id] = faults.get(replica_id, 0) + 1
        if faults[replica_id] == 1:
            self.retries += 1
            balancer.serve_again()  # on the same plan, also mid-trial
            logger.warning("hetero_cs: device error on replica %d, %s (%s); retrying the same global batch once.",
                           replica_id, self.card(replica_id), first_line(exc))
            return None
        left = [i for i, cap in enumerate(balancer.memory_caps.caps) if cap != 0 and i != replica_id]
        if not left:
            raise self.error(replica_id, exc, "no other card is left to train on" + (
                " (every card failed in turn: a fault that follows the step from card to card is more likely the "
                "model's or TensorFlow's than the cards')" if self.exclusions else "")) from exc
        self.exclusions.append(replica_id)  # set aside even where the others cannot hold the batch
        try:
            plan, _ = balancer.exclude_replica(replica_id, max(1, int(failed_batch_size)), global_batch_size)
        except InfeasiblePlanError as infeasible:
            raise self.error(replica_id, exc, f"the other cards' memory caps {balancer.max_batch_sizes} cannot "
                             f"hold the batch of {global_batch_size} examples in one step ({infeasible})") from exc
        logger.warning(
            "hetero_cs: replica %d, %s, failed twice with a device error (%s): it is excluded from training (0 "
            "examples from now on, nothing runs on it). Retrying the same global batch cut %s on the other cards.",
            replica_id, self.card(replica_id), first_line(exc), list(plan.per_replica_batch_sizes))
        return plan

    def error(self, replica_id: int, exc: BaseException, why: str, *, restored: bool = True) -> DeviceFaultError:
        """The DeviceFaultError for a device error on ``replica_id`` that training does not go on from.

        ``restored``: the model's non-trained and metric variables were put back (``fit`` with the batch in hand);
        otherwise the message says that those may hold the failed step's other replicas' updates."""
        state = ("variables and optimizer state are as they were before it" if restored else
                 "the trained variables and the optimizer state are as they were before it, but BatchNormalization's "
                 "moving statistics and the metrics may hold the other replicas' part of the failed step")
        return DeviceFaultError(
            f"The training step failed with a device error on replica {replica_id}, {self.card(replica_id)} "
            f"({type(exc).__name__}: {first_line(exc)}), and training cannot go on without it: {why}. Excluded before: "
            f"{[self.card(i) for i in self.exclusions] or 'none'}. No update of this step was applied: {state}. Check "
            f"the card (nvidia-smi -q shows ECC errors and Xid events), leave it out of compute_devices (or "
            f"CUDA_VISIBLE_DEVICES), or run the script under `hetero-cs run` to restart it without the card. The "
            f"original error is chained below.", replica_id=replica_id,
            device=self._strategy.compute_devices[replica_id], excluded=tuple(self.exclusions), last_error=exc)
