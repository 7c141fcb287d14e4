"""The exception tree of hetero_cs.

Every error the library raises on purpose derives from :class:`HeteroCSError` and also from a builtin exception,
so callers can catch either ``HeteroCSError`` or the builtin they already handle (``ValueError``,
``RuntimeError``, ...). Messages say what was wrong, the values as ``name=value``, and the fix; the same data is
kept on attributes where a caller might act on it.
"""



class HeteroCSError(Exception):
    """Base of every error hetero_cs raises on purpose.

    Keyword arguments set the attributes a subclass declares (as class attributes, which are their defaults), e.g.
    ``StepOOMError(message, replica_id=1)``; any other keyword is a TypeError.
    """

    def __init__(self, *args, **attributes):
        super().__init__(*args)
        for name, value in attributes.items():
            if not hasattr(type(self), name) or hasattr(Exception, name):
                raise TypeError(f"{type(self).__name__} has no attribute {name!r} to set")
            setattr(self, name, value)


class ConfigError(HeteroCSError, ValueError):
    """An argument, environment variable or config file holds a value hetero_cs cannot use."""

class LossPatternError(ConfigError):
    """A loss or metric pattern whose share of the global batch hetero_cs cannot infer (see the message's fix).

    A :class:`ConfigError`, so ``except hetero_cs.ConfigError`` (or ``ValueError``) catches it too.
    """


class BatchCouplingError(LossPatternError):
    """A loss, a logged value or a prediction computed from several examples together (a matrix of examples by
    examples, a batch statistic subtracted from each example, rows picked by position): a split cannot reproduce
    one device's value, so the program is refused before its first update. The message names the op.

    A :class:`LossPatternError`, so ``except hetero_cs.LossPatternError`` (or ``ValueError``) catches it too.
    """


class MicroBatchError(ConfigError):
    """A global batch cannot be micro-batched: no replica can hold one example, or the model's step cannot stay
    exact over micro-batches and one step does not fit (see :mod:`hetero_cs.engine.memory.micro_batches`).

    A :class:`ConfigError`, so ``except hetero_cs.ConfigError`` (or ``ValueError``) catches it too.
    """


class UnsupportedVersionError(ConfigError):
    """The installed TensorFlow / Keras no longer has, or no longer calls, a private part hetero_cs patches.

    Raised when the patches are installed (a private symbol is gone) or at the end of the first traced step (a
    patched Keras/TensorFlow hook that this step needed did not run, so clipping, weight decay, loss scaling or the
    exact b_i / B weighting would silently be missing). The message names what is missing, the installed versions
    and the supported range (``hetero_cs._supported``); the fix is to install a supported pair. A
    :class:`ConfigError`, so ``except hetero_cs.ConfigError`` (or ``ValueError``) catches it too.
    """


class InvalidCostModelError(HeteroCSError, ValueError):
    """A cost model predicted NaN, a negative time, or a time that decreases with batch size."""


class InfeasiblePlanError(HeteroCSError, ValueError):
    """No per-replica split satisfies the global batch size, the memory caps and the minimum slice size."""


class BatchSplitError(HeteroCSError, ValueError):
    """A fixed ``batch_split`` has the wrong length, negative shares, or only zero shares."""


class DeviceError(HeteroCSError, ValueError):
    """A device name is empty, unknown to TensorFlow, repeated, or used both for compute and parameters."""


class UnknownEmulatedDeviceError(HeteroCSError, ValueError, KeyError):
    """An emulated device name is not in the emulation catalog.

    An invalid argument value, so a ValueError like the other argument errors; also a KeyError (a failed catalog
    lookup), as it always was.
    """

    def __str__(self) -> str:  # KeyError would otherwise repr() the message (quotes and escaped newlines).
        return str(self.args[0]) if self.args else ""


class UnsupportedPrecisionError(HeteroCSError, ValueError):
    """A device cannot compute in the model's dtype policy (``mixed_bfloat16`` on a T4, P100 or V100).

    Attributes: ``device`` (the device or catalog name), ``compute_dtype`` (e.g. ``"bfloat16"``).
    """

    device: str | None = None
    compute_dtype: str | None = None


class EmulationError(HeteroCSError, RuntimeError):
    """Emulated devices could not be set up (for example, TensorFlow was already initialised)."""


class CalibrationError(HeteroCSError, RuntimeError):
    """Calibration could not measure a device."""


class CalibrationOOMError(CalibrationError, MemoryError):
    """A device ran out of memory at every probe batch size."""


class StepOOMError(HeteroCSError, MemoryError):
    """A training step ran out of memory on one replica after every bounded retry with a lower cap.

    No update of that step was applied. Attributes: ``replica_id``, ``device``, ``caps_tried`` (the replica's
    slices, in examples, in the order they were tried), ``global_batch_size`` and ``last_error`` (TensorFlow's
    error of the last attempt, also chained as ``__cause__``).
    """

    replica_id: int | None = None
    device: str | None = None
    caps_tried: tuple = ()
    global_batch_size: int | None = None
    last_error: BaseException | None = None


class EmulatedOutOfMemoryError(HeteroCSError, MemoryError):
    """An emulated replica's slice needs more memory than its emulated device has.

    Raised inside the step, where TensorFlow reports it as ``tf.errors.ResourceExhaustedError`` (what a GPU raises).
    Attributes: ``replica_id``, ``needed_bytes``, ``memory_bytes``.
    """

    replica_id: int | None = None
    needed_bytes: int | None = None
    memory_bytes: int | None = None


class EmulatedDeviceError(HeteroCSError, RuntimeError):
    """An emulated replica's device failed (a :class:`~hetero_cs.emulation.Drift` with ``fails=True``).

    Raised inside the step, where TensorFlow reports it as ``tf.errors.UnknownError`` around its text, which holds
    CUDA's ``CUDA_ERROR_ECC_UNCORRECTABLE`` and the device, as a real card's fault does. Attributes: ``replica_id``,
    ``device_name`` (the catalog name) and ``step`` (the replica's step that failed).
    """

    replica_id: int | None = None
    device_name: str | None = None
    step: int | None = None


class ProfileCacheError(HeteroCSError, ValueError):
    """A profile cache file is corrupt, has unknown keys, or belongs to another model or device."""


class InputError(HeteroCSError, ValueError):
    """A dataset element cannot be split into per-replica slices (for example, it has no batch dimension)."""


class NotInReplicaStepError(HeteroCSError, RuntimeError):
    """A replica-step accessor was called outside a replica function of HeteroCentralStorageStrategy."""


class ReplicaStepError(HeteroCSError, RuntimeError):
    """A training step failed inside one replica; the model and optimizer state were left as they were."""

    replica_id: int | None = None
    device: str | None = None


class DeviceFaultError(ReplicaStepError):
    """A replica's device failed (a device error, not out of memory) and training could not go on without it.

    Raised with ``on_device_error="raise"``, or when no card is left to set the failing one aside for (see
    :mod:`hetero_cs.engine.faults.failover`). No update of the failed step was applied. Attributes: ``replica_id``,
    ``device``, ``excluded`` (the replicas set aside before, in order) and ``last_error`` (TensorFlow's error, also
    chained as ``__cause__``).
    """

    excluded: tuple = ()
    last_error: BaseException | None = None


class WorkerLostError(HeteroCSError, RuntimeError):
    """A multi-worker step failed because another worker stopped answering (crashed, killed, or cut off)."""
