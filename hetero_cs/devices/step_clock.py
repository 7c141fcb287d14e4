"""In-graph step timing: wall-clock stamps and the end of a replica's step, with emulated device time.

These ops let a replica's step time be measured (and, on emulated devices, stretched to the named device's time)
inside the training graph without serialising the replicas: the clock is read by stateless ``tf.numpy_function``
calls tied into the data path. The strategy, the calibration probe and the benchmarks use them; the delay they
wait for comes from :class:`hetero_cs.emulation.Emulator`.
"""

import contextlib
import operator
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from hetero_cs.devices.emulation import Emulator


def _probe_scalar(anchor: Any) -> tf.Tensor:
    """A float64 scalar that depends on ``anchor``'s data (0.0 for an empty tensor), so it is not constant-folded."""
    flat = tf.reshape(anchor, [-1])[:1]  # at most one element: cheap, and a 0-element slice gives 0.0.
    if flat.dtype == tf.string:
        return tf.cast(tf.reduce_sum(tf.strings.length(flat)), tf.float64)
    if flat.dtype.is_complex:
        flat = tf.math.real(flat)
    return tf.reduce_sum(tf.cast(flat, tf.float64))


def _host_scalar(fn: Callable[..., Any], inputs: list, name: str, *, stateful: bool = False) -> tf.Tensor:
    """``fn(*inputs)`` run on the host by a ``tf.numpy_function``, as a float64 scalar tensor."""
    value = tf.numpy_function(fn, inputs, tf.float64, stateful=stateful, name=name)
    value.set_shape([])
    return value


def wall_clock_stamp(anchor: Any) -> tf.Tensor:
    """``time.perf_counter()`` taken once ``anchor`` has been computed, as a float64 scalar tensor.

    A stateless ``tf.numpy_function`` fed a data-dependent scalar of ``anchor``: stateless so that tf.function does
    not chain it with the other replicas' stamps (``tf.timestamp`` would serialise them), data-dependent so that it
    is not constant-folded. Keep the result in the data path or it is pruned (``end_replica_step`` consumes it).
    TF may run the stamp after work that merely shares its input; to stamp before the work starts, feed the work
    ``tie_to_stamp(inputs, stamp)``.

    Args:
        anchor: Any tensor (any shape, may be empty); the stamp is taken after it is ready.

    Returns:
        A float64 scalar, seconds on the ``time.perf_counter`` clock.
    """
    return _host_scalar(lambda _probe: np.float64(time.perf_counter()), [_probe_scalar(anchor)], "wall_clock_stamp")


def end_replica_step(start_stamp: Any, anchor: Any, *, replica_id: int, batch_size: Any,
                     emulator: Emulator | None = None, record: Callable[..., None] | None = None,
                     advance: bool = True, keyed: bool = False) -> tf.Tensor:
    """Ends one replica's step: waits out the emulated device time, reports the step, returns the end stamp.

    One stateless ``tf.numpy_function`` that runs once ``anchor`` is ready. With an emulator it sleeps until
    ``start_stamp + emulator.delay_s(replica_id, b)``, so the replica's wall time from start to end matches the
    emulated device (the real compute counts toward it; if the real compute was longer, nothing is added). Then it
    calls ``record(replica_id, b, elapsed_s)`` (with ``keyed``: ``record(replica_id, b, elapsed_s,
    step_key=start_s)``). A slice that does not fit the emulated device's memory fails the
    step here with ``tf.errors.ResourceExhaustedError`` (see ``Emulator.check_memory``), after the real compute.

    Keep the result in the data path: ``grads = tie_to_stamp(grads, end)``. A control dependency alone is not
    enough: Grappler's dependency optimizer turns a stateless op whose outputs feed only control edges into a
    NoOp, so ``with tf.control_dependencies([end]): tf.identity(g)`` silently skips the wait and the record
    (measured on TF 2.21 inside tf.function).

    Args:
        start_stamp: float64 scalar from ``wall_clock_stamp`` at the start of the step; negative: an emulated step
            that is not timed (``sampled_wall_clock_stamp(..., emulated=True)``), which waits from the stamp's
            magnitude and calls no ``record``.
        anchor: A tensor computed at the end of the replica's work (e.g. a gradient), or None when the call is
            made under ``tf.control_dependencies`` on that work (control inputs of this op itself are kept; it is
            only a stamp whose *output* feeds nothing but control edges that Grappler drops).
        replica_id: The replica, in [0, R).
        batch_size: Examples in the replica's slice (int scalar tensor or int), >= 0.
        emulator: Supplies the emulated step time; None to only time the step.
        record: Called as ``record(replica_id, batch_size, elapsed_s)`` from a TF thread (must be thread-safe).
        advance: True for training steps (``emulator.delay_s``: drift at the replica's step counter, which then
            advances); False for probes that are not training steps (``emulator.step_time_s``: counter unchanged).
        keyed: ``start_stamp`` is the step's one clock start, the same tensor in every replica of the step: it is
            passed to ``record`` as ``step_key`` (seconds, float), so the reports pair by step even after a step
            that failed in some replica (:class:`hetero_cs.planning.monitor.StepTimeMonitor`).

    Returns:
        A float64 scalar: the end stamp on the ``time.perf_counter`` clock (negated for a negative start).
    """
    replica_id = operator.index(replica_id)  # a Python or numpy int, fixed at trace time

    def _end(start: Any, _probe: Any, size: Any) -> Any:
        # A negative start: an emulated step not timed (sampled_wall_clock_stamp): it waits, and reports nothing.
        start_s, examples = float(start), int(size)
        timed, start_s = start_s >= 0.0, abs(start_s)
        if emulator is not None:
            # An emulated device whose memory the slice exceeds raises EmulatedOutOfMemoryError (a MemoryError),
            # which TensorFlow reports as tf.errors.ResourceExhaustedError, as a GPU would.
            if not advance:
                emulator.check_memory(replica_id, examples)
            target_s = (emulator.delay_s(replica_id, examples) if advance
                        else emulator.step_time_s(replica_id, examples))
            remaining_s = start_s + target_s - time.perf_counter()
            if remaining_s > 0:
                time.sleep(remaining_s)
        end_s = time.perf_counter()
        if record is not None and timed:
            record(replica_id, examples, end_s - start_s, **({"step_key": start_s} if keyed else {}))
        return np.float64(end_s if timed else -end_s)  # a micro-batch chained after it is not timed either

    # With anchor=None the caller orders the op after the work with tf.control_dependencies around this call; the
    # start stamp (a run-time value) keeps it from being constant-folded.
    probe = tf.constant(0.0, tf.float64) if anchor is None else _probe_scalar(anchor)
    return _host_scalar(_end, [tf.cast(start_stamp, tf.float64), probe, tf.cast(batch_size, tf.int64)],
                        f"end_replica_step_{replica_id}")


def stamp_step_end(start_stamp: Any, after: Sequence[Any], *, record: Callable[[float, float], None],
                   sampled: bool = False) -> None:
    """Reports when the host's work on a step ended: ``record(start_s, elapsed_s)`` once every op of ``after`` ran.

    Called in cross-replica context where the optimizer's update is built, with reads of the updated variables as
    ``after`` (a read of a variable runs after the writes to it that were built before it). One stateful
    ``tf.numpy_function`` on the host; on a sampled step that is not timed (a negative ``start_stamp``) it does not
    run.

    Args:
        start_stamp: The step's float64 start stamp (:func:`wall_clock_stamp` or :func:`sampled_wall_clock_stamp`).
        after: Tensors or ops that exist once the host's work on the step is done.
        record: Called as ``record(start_s, elapsed_s)`` from a TF thread (``start_s`` keys the step).
        sampled: Whether ``start_stamp`` is negative on untimed steps.
    """

    def _end(start: Any) -> Any:
        start_s = float(start)
        if start_s >= 0.0:
            record(start_s, time.perf_counter() - start_s)
        return np.float64(0.0)

    def stamp():
        return _host_scalar(_end, [tf.cast(start_stamp, tf.float64)], "end_host_step", stateful=True)

    with tf.control_dependencies(list(after)):
        _if_timed(start_stamp, stamp) if sampled else stamp()


def emulated_memory_gate(structure: Any, anchor: Any, *, replica_id: int, batch_size: Any,
                         emulator: Emulator, training: bool = True) -> Any:
    """``structure`` (a replica's inputs) made to wait for a check that its slice fits the emulated device.

    A stateless ``tf.numpy_function`` (fed ``anchor``'s data, so it is not constant-folded) calls
    ``emulator.check_memory(replica_id, b)``; a slice too large raises ``EmulatedOutOfMemoryError`` (a
    MemoryError), which TensorFlow reports as ``tf.errors.ResourceExhaustedError``, naming the replica. The check's
    result is tied into every numeric tensor of ``structure`` (:func:`tie_to_stamp`, values unchanged), so nothing
    of the replica's step is computed before it passed.

    Args:
        structure: A nest of the replica's inputs.
        anchor: A tensor of the replica's slice (any shape).
        replica_id: The replica, in [0, R).
        batch_size: Examples in the slice (int scalar tensor).
        emulator: The emulator whose memory model applies.
        training: Whether the step trains (False: an evaluate or predict step, which needs less memory).

    Returns:
        ``structure``, same values, tied to the check.
    """
    replica_id = operator.index(replica_id)

    def _check(size: Any, _probe: Any) -> Any:
        emulator.check_memory(replica_id, int(size), training=training)
        return np.float64(0.0)

    return tie_to_stamp(structure, _host_scalar(_check, [tf.cast(batch_size, tf.int64), _probe_scalar(anchor)],
                                                f"emulated_memory_check_{replica_id}"))


def tie_to_stamp(structure: Any, stamp: Any) -> Any:
    """Makes every numeric tensor of ``structure`` depend on ``stamp`` through data, values unchanged.

    Each tensor t becomes ``t - zero`` where ``zero = cast(is_nan(stamp))`` is a 0 computed at run time, which
    Grappler cannot fold; ``t - (+0)`` equals t bit for bit (signed zeros, inf and NaN included; subnormals are
    flushed to zero, as by every TF CPU kernel). Use it instead of
    ``tf.control_dependencies`` (which does not keep a stateless stamp op alive, see ``end_replica_step``), e.g.
    ``grads = tie_to_stamp(grads, end)`` so the gradients leave the replica only after its emulated step ended.
    Costs one element-wise subtraction per tensor.

    Args:
        structure: A nest of tensors, ``tf.IndexedSlices`` (their values are tied) and None; non-numeric tensors
            (bool, string) are returned as they are, so at least one numeric tensor must be present for the tie.
        stamp: A float64 scalar from ``wall_clock_stamp`` or ``end_replica_step``.

    Returns:
        The same nest, the same dtypes, shapes and values.
    """
    zero = tf.cast(tf.math.is_nan(stamp), tf.float64)

    def tie(value: Any) -> Any:
        if isinstance(value, tf.IndexedSlices):
            return tf.IndexedSlices(tie(value.values), value.indices, value.dense_shape)
        if not isinstance(value, (tf.Tensor, tf.Variable)) and not tf.is_tensor(value):
            return value  # None, or not a tensor
        dtype = tf.as_dtype(value.dtype)
        if not (dtype.is_floating or dtype.is_integer or dtype.is_complex):
            return value
        return value - tf.cast(zero, dtype)

    return tf.nest.map_structure(tie, structure)


def _if_timed(start_stamp: Any, fn: Callable[[], Any]) -> tf.Tensor:
    """``fn()`` on a timed step (``start_stamp >= 0``), else 0.0, in the graph."""
    return tf.cond(start_stamp >= 0.0, fn, lambda: tf.constant(0.0, tf.float64))


def sampled_wall_clock_stamp(anchor: Any, timed: Any, *, emulated: bool = False) -> tf.Tensor:
    """``wall_clock_stamp(anchor)`` when ``timed`` (a bool scalar tensor), else -1.0 without reading the clock.

    ``emulated``: the clock is read on every step, since an emulated step waits from it whether it is timed or not
    (:func:`end_replica_step`); an untimed step's stamp is then the clock's negative. Either way a negative stamp
    says "not timed": nothing reports the step.
    """
    if emulated:
        def signed(is_timed: Any, _probe: Any) -> Any:
            now = time.perf_counter()
            return np.float64(now if is_timed else -now)

        return _host_scalar(signed, [timed, _probe_scalar(anchor)], "wall_clock_stamp")
    return tf.cond(timed, lambda: wall_clock_stamp(anchor), lambda: tf.constant(-1.0, tf.float64))


def finish_replica_step(grads: Sequence[Any], start_stamp: Any, *, replica_id: int, batch_size: Any,
                        emulator: Emulator | None = None, record: Callable[..., None] | None = None,
                        sampled: bool = False, host_device: str | None = None, keyed: bool = False,
                        end_stamps: list | None = None) -> list:
    """Ends a replica's training step once its gradients are ready, and returns gradients that wait for it.

    Runs :func:`end_replica_step` after every gradient (a control edge from each): it waits out the emulated device
    time and reports the step time to ``record``. Its end stamp is tied into the smallest gradient with
    :func:`tie_to_stamp` (one element-wise op; every value unchanged), so the step, whose update needs every
    gradient, cannot finish before.

    Args:
        grads: The replica's gradients (tensors, ``tf.IndexedSlices`` or None), at least one not None.
        start_stamp: float64 scalar from :func:`wall_clock_stamp` when the replica's slice arrived.
        replica_id, batch_size, emulator, record, keyed: As for :func:`end_replica_step`.
        sampled: ``start_stamp`` came from :func:`sampled_wall_clock_stamp`: a negative stamp (an untimed step)
            skips the end stamp and the report; with an emulator, whose wait runs every step, only the report.
        host_device: Where the gradients go (the parameter device): they are copied there first and the step ends
            when the copies exist (kernel completion on a GPU); the copies are returned. None: the step ends when
            the gradients exist on the replica's device, and they are returned where they are.
        end_stamps: A list the end stamp (float64 scalar tensor) is appended to, or None.

    Returns:
        The gradients, in order, one of them tied to the end of the step.
    """
    if not (present := [g for g in grads if g is not None]):
        return list(grads)
    with contextlib.ExitStack() as placement:
        if host_device is not None:
            # The replica's step ends when its gradients are in host memory: a copy from a GPU is enqueued on the
            # device's stream after the kernels that computed the gradient, and the host ops below consume the
            # copies, so the end stamp runs only once those kernels have completed (on the host's clock, the clock
            # calibration reads too). These copies are the transfer the host's gradient sum needs anyway.
            placement.enter_context(tf.device(host_device))
            grads = [None if g is None else tf.nest.map_structure(tf.identity, g, expand_composites=True)
                     for g in grads]
            present = [g for g in grads if g is not None]

        # A control edge from every gradient: no ops per gradient (an anchor summing one element of each cost 4 ops
        # per gradient per replica per step).
        def end():
            return end_replica_step(start_stamp, None, replica_id=replica_id, batch_size=batch_size,
                                    emulator=emulator, record=record, keyed=keyed)

        with tf.control_dependencies(tf.nest.flatten(present, expand_composites=True)):
            end = _if_timed(start_stamp, end) if sampled and emulator is None else end()
        sizes = [g.shape.num_elements() if g is not None and g.shape.is_fully_defined() else None for g in grads]
        known = [(n, i) for i, n in enumerate(sizes) if n is not None]  # the smallest gradient is tied
        index = min(known)[1] if known else next(i for i, g in enumerate(grads) if g is not None)
        tied = [tie_to_stamp(g, end) if i == index else g for i, g in enumerate(grads)]
        if end_stamps is not None:
            end_stamps.append(end)
    return tied
