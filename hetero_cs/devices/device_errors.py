"""Device names (canonical, checked against TensorFlow's devices), and what a TensorFlow error says about a device:
out of memory, a hardware fault, and which replica it names.

Read from the error alone (its class and text), as a GPU raises it; NVML's evidence about a card is
:mod:`hetero_cs.devices.gpu_health`'s.

**Out of memory** (:func:`classify`): any ``ResourceExhaustedError`` (the allocator's ``"OOM when allocating tensor
... by allocator GPU_1_bfc"``, XLA's ``"Out of memory while trying to allocate N bytes"``, an emulated device's
``"Emulated out of memory: replica=<i>"``), and an ``InternalError``, ``UnknownError`` or ``InvalidArgumentError``
whose text shows one of ``OOM_FORMS``: a failed host-to-device copy (``"Dst tensor is not initialized"``), cuBLAS
or cuDNN failing to allocate, a scratch or workspace buffer, CUDA's ``CUDA_ERROR_OUT_OF_MEMORY``. Each is evidence of
an allocation that failed. A library's name is not: "Blas GEMM launch failed" or a cuDNN handle that could not be
created follow a broken driver as often as a full card, and pass on with their own type.

**A hardware fault** (:func:`device_fault`): not out of memory; raised as ``InternalError`` or ``UnknownError`` (or
an :class:`~hetero_cs.errors.EmulatedDeviceError` eagerly); its text shows one of ``DEVICE_FAULT_FORMS`` (an
uncorrectable ECC error, an illegal memory access, a launch failure, a hardware stack error, a lost GPU, a failed
sync, cuBLAS or cuDNN failing to execute: an allow-list, so codes a program or a build causes are not among them);
and neither a device-side assert (everything CUDA reports after one is the program's) nor a Python traceback (a
Python error in the step, except the emulator's fault). ``STICKY_FORMS`` break the card's CUDA context. The forms'
texts are :mod:`hetero_cs.devices.fault_texts`' (the supervisor reads them too).

**The replica blamed** (:func:`blamed_replica`), in this order:

1. an emulated device's message names its replica (``replica=<i>``);
2. the device the message names, where the memory ran out (the allocator clause ``"on <device> by allocator
   <name>"``, a failed copy's destination, the allocator's name ``GPU_1_bfc`` / ``gpu_async_1``, else the one device
   mentioned), when exactly one replica computes there; a device that runs no replica blames none, and when several
   replicas share it the op name decides;
3. a replica function that ran eagerly tagged the error (:func:`tag_replica`);
4. the op that failed: replica i's ops are ``replica_<i>/...`` for i >= 1 (also behind other scopes), the timing op
   ``end_replica_step_<i>``. Replica 0's ops carry no prefix, nor do the input pipeline's, the cut's and the host
   update's, so an op without one is replica 0's only under ``gradient_tape/``, ``compile_loss/`` or one of
   ``replica_scopes`` (``fit`` passes the model's name).

Nothing else names a replica: never replica 0 by default.
"""

import contextlib
import dataclasses
import re
from collections.abc import Sequence

import tensorflow as tf

from hetero_cs.devices.fault_texts import DEVICE_FAULT_FORMS, OOM_FORMS, PROGRAM_ASSERT, STICKY_FORMS
from hetero_cs.errors import DeviceError, EmulatedDeviceError, EmulatedOutOfMemoryError

REPLICA_ID_ATTRIBUTE = "_hetero_cs_replica_id"
"""Set on an op error raised by a replica function that ran eagerly: eager errors name no op, so no replica scope."""


def tag_replica(exc: Exception, replica_id: int) -> None:
    """Marks an error raised eagerly in replica ``replica_id``'s function (the first replica to tag it wins)."""
    if getattr(exc, REPLICA_ID_ATTRIBUTE, None) is None:
        # An exception type that takes no attributes is left as it is: the op-name path below still applies.
        with contextlib.suppress(AttributeError, TypeError):
            setattr(exc, REPLICA_ID_ATTRIBUTE, int(replica_id))


@contextlib.contextmanager
def naming_the_replica(replica_id):
    """Around a replica function: eagerly, tags an op error it raises with the replica (see :func:`tag_replica`).

    In a graph (inside tf.function) the op names carry the replica's scope and this does nothing.
    """
    try:
        yield
    except tf.errors.OpError as exc:
        if not tf.inside_function():
            tag_replica(exc, tf.get_static_value(replica_id))
        raise


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
    form = next((name for name, pattern in OOM_FORMS if pattern.search(str(exc))), None)
    if isinstance(exc, tf.errors.ResourceExhaustedError):
        return form or "resource exhausted"
    return form if isinstance(exc, _MESSAGE_CLASSES) else None


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether TensorFlow's error ``exc`` is out of memory, in any form a GPU (or an emulated device) raises."""
    return oom_form(exc) is not None


def canonical_device(name: str) -> str:
    """``/job:localhost/replica:0/task:0/device:GPU:1``, ``/gpu:1``, ``GPU:1`` -> ``/device:GPU:1``.

    Raises:
        DeviceError: ``name`` is not a non-empty string, cannot be parsed, or lacks a type or an index.
    """
    if not isinstance(name, str) or not name.strip():
        raise DeviceError(f"Device names must be non-empty strings. Received: device={name!r}.")
    text = name.strip()
    try:
        spec = tf.DeviceSpec.from_string(text if text.startswith("/") else "/device:" + text)
    except (ValueError, TypeError) as exc:
        raise DeviceError(f"Cannot parse device name={name!r}. Use names like '/device:GPU:0' or '/cpu:1'.") from exc
    if spec.device_type is None or spec.device_index is None:
        raise DeviceError(f"Device name={name!r} needs a type and an index, like '/device:GPU:0' or '/cpu:1'.")
    return f"/device:{spec.device_type.upper()}:{spec.device_index}"


def checked_device_names(names: Sequence[str], parameter_device: str, *, argument: str) -> tuple[list[str], str]:
    """``names`` (the argument called ``argument``) and ``parameter_device`` as canonical device names, each name
    once and each a device TensorFlow sees.

    Raises:
        DeviceError: A name is not a device name, ``names`` repeats a device, or TensorFlow does not see one.
    """
    devices = [canonical_device(d) for d in names]
    parameter = canonical_device(parameter_device)
    if len(set(devices)) != len(devices):
        raise DeviceError(f"{argument} repeats a device: {devices}. List each device once.")
    known = {canonical_device(d.name) for d in tf.config.list_logical_devices()}
    if unknown := [d for d in [*devices, parameter] if d not in known]:
        raise DeviceError(f"Unknown device(s) {unknown}; TensorFlow sees {sorted(known)}. On a CPU-only machine create "
                          f"logical devices first with hetero_cs.emulation.setup_logical_devices([...]) before "
                          f"TensorFlow starts, or emulate catalog cards (emulate=[...]).")
    return devices, parameter


def _device_named(text: str) -> str | None:
    """A device a message names (``text``), canonical; None where ``text`` is no device name."""
    with contextlib.suppress(DeviceError):
        return canonical_device(text)
    return None


def named_device(message: str) -> str | None:
    """The device (canonical) where the memory ran out, as the message names it; None when it names none."""
    for pattern in (_ALLOCATOR_CLAUSE, _COPY_DESTINATION):
        if (match := pattern.search(message)) and (device := _device_named(match.group(1))):
            return device
    if match := _ALLOCATOR_NAME.search(message):
        return f"/device:GPU:{match.group(2) or match.group(3)}"
    mentioned = {_device_named(m.group(1)) for m in _ANY_DEVICE.finditer(message)} - {None}
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
        return int(match.group(1)) if int(match.group(1)) < num_replicas else None
    scopes = name.split("/")[:-1]
    known = [*REPLICA_ONLY_SCOPES, *(s for s in replica_scopes if s)]
    replica_0 = any(scope == k or re.fullmatch(rf"{re.escape(k)}_\d+", scope) for scope in scopes for k in known)
    return 0 if replica_0 and num_replicas > 0 else None


def blamed_replica(exc: BaseException, compute_devices: Sequence[str],
                   replica_scopes: Sequence[str] = ()) -> tuple[int | None, str | None, str | None]:
    """``(replica_id, device, blame)`` for an out-of-memory error: see the module docstring. ``replica_id`` is None
    when nothing names a replica; ``device`` is the device the message names (canonical), or None."""
    message = str(exc)
    num_replicas = len(compute_devices)
    emulated = re.search(r"Emulated out of memory: replica=(\d+)", message)
    if emulated and int(emulated.group(1)) < num_replicas:
        return int(emulated.group(1)), compute_devices[int(emulated.group(1))], "emulated"
    if (device := named_device(message)) is not None:
        on_device = [i for i, d in enumerate(compute_devices) if _device_named(d) == device]
        if len(on_device) == 1:
            return on_device[0], device, "device"
        # Several replicas there: the op's name decides. None: the parameter device, or a device that runs no replica.
        by_name = op_name_replica(message, num_replicas, replica_scopes)
        return (by_name, device, "op name") if by_name in on_device else (None, device, None)
    tagged = getattr(exc, REPLICA_ID_ATTRIBUTE, None)  # set when the replica ran eagerly (run_eagerly=True)
    if tagged is not None and 0 <= int(tagged) < num_replicas:
        return int(tagged), compute_devices[int(tagged)], "eager replica"
    if (by_name := op_name_replica(message, num_replicas, replica_scopes)) is not None:
        return by_name, compute_devices[by_name], "op name"
    return None, None, None


def classify(exc: BaseException, compute_devices: Sequence[str],
             replica_scopes: Sequence[str] = ()) -> OutOfMemory | None:
    """An :class:`OutOfMemory` for an out-of-memory error (with the replica blamed, or None), else None."""
    if (form := oom_form(exc)) is None:
        return None
    replica_id, device, blame = blamed_replica(exc, compute_devices, replica_scopes)
    return OutOfMemory(form=form, device=device, replica_id=replica_id, blame=blame)




@dataclasses.dataclass(frozen=True)
class DeviceFault:
    """A device error read from TensorFlow's error: its form, and the replica and device it names (or None)."""

    form: str
    replica_id: int | None
    device: str | None
    sticky: bool = False


def fault_form(exc: BaseException) -> str | None:
    """The device-fault form ``exc`` shows (a name from :data:`DEVICE_FAULT_FORMS`), or None: see the module rule."""
    if isinstance(exc, EmulatedDeviceError):  # an emulated fault raised as itself by an eager step
        return "ecc"
    if not isinstance(exc, (tf.errors.InternalError, tf.errors.UnknownError)) or is_out_of_memory(exc):
        return None
    message = str(exc)
    if PROGRAM_ASSERT.search(message):
        return None
    # TensorFlow reports a Python exception raised inside a step (tf.numpy_function, tf.py_function) as UnknownError
    # with its traceback: a program error, unless it is the emulator's fault.
    if "Traceback (most recent call last)" in message:
        return "ecc" if "EmulatedDeviceError" in message else None
    return next((name for name, pattern in DEVICE_FAULT_FORMS if pattern.search(message)), None)


def device_fault(exc: BaseException, compute_devices: Sequence[str],
                 replica_scopes: Sequence[str] = ()) -> DeviceFault | None:
    """A :class:`DeviceFault` when ``exc`` is a device error (the module's rule), with the replica it names; else
    None (a program error, or out of memory)."""
    if (form := fault_form(exc)) is None:
        return None
    replica_id = getattr(exc, "replica_id", None) if isinstance(exc, EmulatedDeviceError) else None
    emulated = re.search(r"emulated device fault on replica=(\d+)", str(exc))
    if replica_id is None and emulated and int(emulated.group(1)) < len(compute_devices):
        replica_id = int(emulated.group(1))
    if replica_id is not None:
        return DeviceFault(form, replica_id, compute_devices[replica_id])
    replica_id, device, _ = blamed_replica(exc, compute_devices, replica_scopes)
    sticky = form in STICKY_FORMS and "EmulatedDeviceError" not in str(exc)
    return DeviceFault(form, replica_id, device, sticky)


def first_line(exc: BaseException, forms=DEVICE_FAULT_FORMS) -> str:
    """The line of TensorFlow's error that holds the fault's text (the first that one of ``forms``' (name, pattern)
    pairs finds, else the first line), for log lines and messages (at most 200 chars)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = next((line for line in lines if any(p.search(line) for _, p in forms)),
                lines[0] if lines else type(exc).__name__)
    # TensorFlow prefixes a replica's error with "(0) UNKNOWN:" and a Python exception's class name.
    text = re.sub(r"^(?:\(\d+\)\s+[A-Z_]+:\s*)?(?:[A-Za-z]*Error:\s*)?", "", text) or text
    return text if len(text) <= 200 else text[:197] + "..."


def op_message(message: str, exc: BaseException) -> str:
    """The failing op's own line of TensorFlow's error message ``message`` (of ``exc``), on one line."""
    lines = [line.strip() for line in message.splitlines()]
    # TensorFlow puts the op's own message on the line before "[[{{node ...}}]]".
    marker = next((i for i, line in enumerate(lines) if line.startswith("[[{{node")), None)
    if marker is not None:
        before = [line for line in lines[:marker] if line]
    else:  # eagerly: the op's own line ends in "[Op:NAME]" (Keras may wrap it in "Exception encountered ..."),
        # else the first line that is not TensorFlow's framing of it
        framing = ("Graph execution error", "Detected at", "File ")
        before = [line for line in lines if "[Op:" in line][:1] or [
            line for line in lines if line and not line.startswith(framing)][:1]
    return before[-1] if before else type(exc).__name__
