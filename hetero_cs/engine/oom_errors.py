"""Which TensorFlow errors are out of memory, and which replica ran out: read from the error alone.

A GPU runs out of memory in more shapes than ``tf.errors.ResourceExhaustedError``. :func:`classify` recognises

* any ``ResourceExhaustedError``: the allocator's ``"OOM when allocating tensor with shape[...] and type float on
  /job:localhost/replica:0/task:0/device:GPU:1 by allocator GPU_1_bfc"``, XLA's ``"Out of memory while trying to
  allocate N bytes"``, an emulated device's ``"Emulated out of memory: replica=<i>"``;
* an ``InternalError``, ``UnknownError`` or ``InvalidArgumentError`` (TensorFlow reports a Python exception raised in
  a ``tf.numpy_function`` as Unknown or InvalidArgument around its text) whose message shows one of the
  out-of-memory forms of :data:`OOM_FORMS`: a failed host-to-device copy (``"Dst tensor is not initialized"``, in
  eager mode inside ``"Failed copying input tensor from <host> to <device> in order to run <op>"``), cuBLAS or cuDNN
  failing to allocate (``CUBLAS_STATUS_ALLOC_FAILED``, ``CUDNN_STATUS_ALLOC_FAILED``), a scratch or workspace buffer
  that could not be allocated, CUDA's own ``cudaErrorMemoryAllocation`` / ``CUDA_ERROR_OUT_OF_MEMORY``, or the
  allocator's ``"ran out of memory trying to allocate"`` and ``"failed to allocate memory"``.

Each is evidence of an allocation that failed. A library's name is not: "Blas GEMM launch failed", a cuDNN or cuBLAS
handle that could not be created (``CUDNN_STATUS_NOT_INITIALIZED``, "Failed to get convolution algorithm") follow a
broken driver or build as often as a full card, and taking them for out of memory would halve a healthy card's cap
down to 0; they pass on with their own type. Any other error (a shape error, a failed copy for another reason, a
device-side assert) is not out of memory either.

Blame, in this order (:func:`blamed_replica`):

1. an emulated device's message names its replica (``replica=<i>``);
2. the device the message names - where the memory ran out: the device of the allocator clause (``"on <device> by
   allocator <name>"``), the destination of a failed copy (``"to <device> in order to run"``), the allocator's
   name alone (``GPU_1_bfc`` and ``gpu_async_1`` -> GPU:1; ``gpu_async`` counts the physical GPU, the same number
   unless virtual devices split a GPU), or failing those the one device the message mentions
   (``/device:GPU:1``, ``/gpu:1``) - is the compute device of exactly one replica: that replica. A device that
   runs no replica (the parameter device, another GPU) blames no replica. When several replicas share that device,
   the op name below decides among them;
3. a replica function that ran eagerly tagged the error with its replica id;
4. the op that failed (``[[{{node NAME}}]]``, else ``node NAME``): TensorFlow names replica i's ops
   ``replica_<i>/...`` for i >= 1 (also behind other scopes, e.g. ``gradient_tape/replica_1/...``); the timing op
   ``end_replica_step_<i>`` is replica i's. Replica 0's ops carry no prefix - but so do the ops that run outside
   the replicas: the input pipeline, the batch cut, the gradient aggregation and the optimizer's update on the
   parameter device (merge calls run in replica 0's name scope). So an op without a prefix is taken as replica 0's
   only when it is known to be a replica's op: under ``gradient_tape/`` or ``compile_loss/`` (a Keras train step's
   gradients and loss, formed in the replicas only) or under one of ``replica_scopes`` (``fit`` passes the model's
   name: its forward pass runs in the replicas only; TensorFlow may uniquify it to ``<name>_<n>``).

Nothing else names a replica: :func:`blamed_replica` returns None, never replica 0 by default.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import tensorflow as tf

from hetero_cs.engine.step_errors import REPLICA_ID_ATTRIBUTE
from hetero_cs.errors import EmulatedOutOfMemoryError

# (name, pattern) of each out-of-memory form an Internal/Unknown/InvalidArgument error may carry; the first match
# names the form. A ResourceExhaustedError is out of memory whatever its text.
OOM_FORMS: tuple[tuple[str, re.Pattern], ...] = tuple(
    (name, re.compile(pattern, flags))
    for name, pattern, flags in (
        ("emulated", r"Emulated out of memory: replica=\d+", 0),
        ("allocator", r"\bOOM when allocating tensor", 0),
        ("allocator", r"ran out of memory trying to allocate", re.IGNORECASE),
        ("xla", r"Out of memory while trying to allocate", re.IGNORECASE),
        ("host-to-device copy", r"Dst tensor is not initialized", 0),
        ("cublas", r"CUBLAS_STATUS_ALLOC_FAILED", 0),
        ("cudnn", r"CUDNN_STATUS_ALLOC_FAILED", 0),
        ("scratch", r"Failed to allocate (?:\S+ )?(?:scratch|workspace)", re.IGNORECASE),
        ("cuda", r"cudaErrorMemoryAllocation|CUDA_ERROR_OUT_OF_MEMORY|CUDA error: out of memory", 0),
        ("allocator", r"failed to allocate (?:device )?memory", re.IGNORECASE),
    )
)

_MESSAGE_CLASSES = (tf.errors.InternalError, tf.errors.UnknownError, tf.errors.InvalidArgumentError)

# A full or short device name: /job:localhost/replica:0/task:0/device:GPU:1, /device:GPU:1, /gpu:1, GPU:1 after "on".
_DEVICE = r"(?:/job:[\w-]+(?:/replica:\d+)?(?:/task:\d+)?)?/(?:device:)?(?:[A-Za-z_]+):\d+"
_ALLOCATOR_CLAUSE = re.compile(rf"\bon ({_DEVICE}) by allocator (\S+)")
_COPY_DESTINATION = re.compile(rf"Failed copying input tensor from \S+ to ({_DEVICE}) in order to run")
_ALLOCATOR_NAME = re.compile(r"\b(GPU_(\d+)_bfc|gpu_async_(\d+))\b")
_ANY_DEVICE = re.compile(rf"(?<![\w.:-])({_DEVICE})\b")
_NODE = (re.compile(r"\[\[\{\{node ([^}\s]+)\}\}\]\]"), re.compile(r"node (\S+)"))
REPLICA_ONLY_SCOPES = ("gradient_tape", "compile_loss")


@dataclasses.dataclass(frozen=True)
class OutOfMemory:
    """An out-of-memory error read: its form, the device it names (canonical, or None) and the replica blamed.

    ``blame`` says what named the replica: ``"emulated"``, ``"device"``, ``"eager replica"``, ``"op name"``, or
    None when nothing did (``replica_id`` is then None).
    """

    form: str
    device: str | None
    replica_id: int | None
    blame: str | None


def oom_form(exc: BaseException) -> str | None:
    """The out-of-memory form ``exc`` shows (a name from :data:`OOM_FORMS`, or "resource exhausted"), or None."""
    if isinstance(exc, EmulatedOutOfMemoryError):  # an emulated device's, raised as itself by an eager step
        return "emulated"
    if not isinstance(exc, tf.errors.OpError):
        return None
    message = str(exc)
    form = next((name for name, pattern in OOM_FORMS if pattern.search(message)), None)
    if isinstance(exc, tf.errors.ResourceExhaustedError):
        return form or "resource exhausted"
    return form if isinstance(exc, _MESSAGE_CLASSES) else None


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether TensorFlow's error ``exc`` is out of memory, in any form a GPU (or an emulated device) raises."""
    return oom_form(exc) is not None


def canonical(device: str) -> str | None:
    """``/job:localhost/replica:0/task:0/device:GPU:1``, ``/gpu:1``, ``GPU:1`` -> ``/device:GPU:1``; else None."""
    text = device.strip()
    if not text.startswith("/"):
        text = "/device:" + text
    try:
        spec = tf.DeviceSpec.from_string(text)
    except (ValueError, TypeError):
        return None
    if spec.device_type is None or spec.device_index is None:
        return None
    return f"/device:{spec.device_type.upper()}:{spec.device_index}"


def named_device(message: str) -> str | None:
    """The device (canonical) where the memory ran out, as the message names it; None when it names none."""
    for pattern in (_ALLOCATOR_CLAUSE, _COPY_DESTINATION):
        match = pattern.search(message)
        if match and canonical(match.group(1)):
            return canonical(match.group(1))
    match = _ALLOCATOR_NAME.search(message)
    if match:
        return f"/device:GPU:{match.group(2) or match.group(3)}"
    mentioned = {canonical(m.group(1)) for m in _ANY_DEVICE.finditer(message)} - {None}
    return mentioned.pop() if len(mentioned) == 1 else None


def op_name_replica(message: str, num_replicas: int, replica_scopes: Sequence[str] = ()) -> int | None:
    """The replica whose op failed, read from the op's name (rule 4 of the module docstring), or None."""
    node = next((m for m in (p.search(message) for p in _NODE) if m), None)
    if node is None or "Iterator" in node.group(1):
        return None  # no op named, or the input pipeline's
    name = node.group(1)
    match = (re.search(r"(?:^|/)hetero_replica_(\d+)/", name) or re.search(r"(?:^|/)replica_(\d+)/", name)
             or re.search(r"end_replica_step_(\d+)", name))
    if match:
        replica_id = int(match.group(1))
        return replica_id if 0 <= replica_id < num_replicas else None
    scopes = name.split("/")[:-1]
    known = [*REPLICA_ONLY_SCOPES, *(s for s in replica_scopes if s)]
    if any(scope == k or re.fullmatch(rf"{re.escape(k)}_\d+", scope) for scope in scopes for k in known):
        return 0 if num_replicas > 0 else None
    return None


def blamed_replica(exc: BaseException, compute_devices: Sequence[str],
                   replica_scopes: Sequence[str] = ()) -> tuple[int | None, str | None, str | None]:
    """``(replica_id, device, blame)`` for an out-of-memory error: see the module docstring. ``replica_id`` is None
    when nothing names a replica; ``device`` is the device the message names (canonical), or None."""
    message = str(exc)
    num_replicas = len(compute_devices)
    emulated = re.search(r"Emulated out of memory: replica=(\d+)", message)
    if emulated:
        replica_id = int(emulated.group(1))
        if 0 <= replica_id < num_replicas:
            return replica_id, compute_devices[replica_id], "emulated"
    device = named_device(message)
    if device is not None:
        on_device = [i for i, d in enumerate(compute_devices) if canonical(d) == device]
        if len(on_device) == 1:
            return on_device[0], device, "device"
        if not on_device:
            return None, device, None  # the parameter device, or a device that runs no replica
        by_name = op_name_replica(message, num_replicas, replica_scopes)
        return (by_name, device, "op name") if by_name in on_device else (None, device, None)
    tagged = getattr(exc, REPLICA_ID_ATTRIBUTE, None)  # set when the replica ran eagerly (run_eagerly=True)
    if tagged is not None and 0 <= int(tagged) < num_replicas:
        return int(tagged), compute_devices[int(tagged)], "eager replica"
    by_name = op_name_replica(message, num_replicas, replica_scopes)
    if by_name is not None:
        return by_name, compute_devices[by_name], "op name"
    return None, None, None


def classify(exc: BaseException, compute_devices: Sequence[str],
             replica_scopes: Sequence[str] = ()) -> OutOfMemory | None:
    """An :class:`OutOfMemory` for an out-of-memory error (with the replica blamed, or None), else None."""
    form = oom_form(exc)
    if form is None:
        return None
    replica_id, device, blame = blamed_replica(exc, compute_devices, replica_scopes)
    return OutOfMemory(form=form, device=device, replica_id=replica_id, blame=blame)
