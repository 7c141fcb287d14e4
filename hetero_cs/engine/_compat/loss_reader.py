"""The strict loss reader: a replica's exact share of a value one device computes from the whole batch, or a refusal.

Part of :mod:`hetero_cs.engine._compat`, the one place of private TensorFlow/Keras touches (it re-emits graph ops
through ``tf.raw_ops`` and reads the graph).

Replica ``i`` holds ``b_i`` of the ``B`` examples and the host sums what the replicas give, so each replica must
give its *share* of every value one device computes from the whole batch: shares that add up to one device's value,
and whose gradients add up to one device's gradient. :func:`share_of` reads how a value was computed and builds
that share; whatever it cannot prove exact it refuses with :class:`~hetero_cs.errors.LossPatternError` (or its
subclass :class:`~hetero_cs.errors.BatchCouplingError` when examples meet), naming the op and the fix. What it
accepts:

* a value hetero_cs made a share already (a Keras loss reduced under the strategy, ``compute_loss``);
* a sum over the examples (``tf.reduce_sum`` along the batch axis of per-example values): the replicas' sums add
  up, kept as it is;
* a mean over the examples: weighed ``b_i / B`` (its rows are a fixed number per example), or, for rows the data
  picked (``tf.boolean_mask``, ``tf.gather(x, tf.where(...))``), weighed by this replica's rows over all replicas'
  rows (an all-reduced count);
* a value that does not depend on the batch (a regularization term of the weights): weighed ``b_i / B``, so it
  counts once;
* linear combinations of these with factors that do not depend on the batch (a loss weight, even a trainable one),
  ``tf.stop_gradient`` of them (no gradient, as on one device), and a value divided by
  ``strategy.num_replicas_in_sync`` (one device divides by 1);
* a ratio of two such values, ``sum(loss * mask) / sum(mask)``: the denominator is all-reduced, so every replica
  divides by the whole batch's, and the quotient rule's second term is kept for a denominator with a gradient.

Refused: a non-linear function of a batch aggregate (``tf.sqrt`` of a mean, a product of two means, a maximum over
the batch), and any value whose per-example inputs mix examples (:mod:`hetero_cs.engine._compat.batch_flow`).
"""

import dataclasses
import weakref

import tensorflow as tf

from hetero_cs.engine.step import replica_state
from hetero_cs.engine._compat.batch_flow import BatchFlow, flow_of
from hetero_cs.engine._compat.batch_kinds import COUNT, MIXED, REP, ROWS, SHAPE, axes
from hetero_cs.engine._compat.context import note_for_micro_batches
from hetero_cs.errors import BatchCouplingError, LossPatternError

GLOBAL, SHARE = "global", "share"

# Ops through which a value stays linear in its data inputs (a slice of its inputs: the first, all, all but the last,
# the second and third). The other inputs (axes, shapes, indices, a condition) must not depend on the batch.
_LINEAR = {
    **dict.fromkeys(("Identity", "Snapshot", "EnsureShape", "CheckNumerics", "CheckNumericsV2", "Cast", "StopGradient",
                     "Neg", "Sum", "Mean", "Reshape", "ExpandDims", "Squeeze", "Transpose", "StridedSlice", "Slice",
                     "GatherV2", "Tile", "BroadcastTo", "ZerosLike"), slice(0, 1)),
    **dict.fromkeys(("Add", "AddV2", "AddN", "Sub", "Pack"), slice(None)), "ConcatV2": slice(None, -1),
    "Select": slice(1, 3), "SelectV2": slice(1, 3),
}
_OPAQUE = frozenset({"PartitionedCall", "StatefulPartitionedCall", "If", "StatelessIf", "While", "StatelessWhile",
                     "Case", "StatelessCase", "PyFunc", "PyFuncStateless", "EagerPyFunc"})
_MAX_DEPTH = 200  # a loss is a short expression above its reductions; deeper means something unexpected


@dataclasses.dataclass
class _Reading:
    """One reading of a value: the step, the flow, the tape recording the re-emitted ops and the leaves seen."""

    step: object
    flow: BatchFlow
    tape: object = None
    leaves: list = dataclasses.field(default_factory=list)
    memo: dict = dataclasses.field(default_factory=dict)


def share_of(step, value, *, what: str = "the loss"):
    """This replica's share of one device's ``value`` (see the module docstring), a tensor of ``value``'s shape.

    Raises:
        LossPatternError: The value is not provably linear in per-example values with a known normaliser.
        BatchCouplingError: Its per-example inputs mix examples across the batch.
    """
    if tf.executing_eagerly():  # no graph to read: a value of hetero_cs's is a share, any other a slice mean
        return value if _is_share(step, value) else _weigh(value)
    return _as_share(*_read(_Reading(step, flow_of(step)), value, what, 0))


def shares_of_logs(step, outputs, *, keep_replicated: bool = False):
    """A Keras step's outputs with every floating scalar (a logged value) made this replica's share of one device's:
    summed over the replicas (``reduce_per_replica``, patched), they log what one device logs.

    ``keep_replicated``: leave values that do not depend on the batch as they are (the multi-worker strategy, whose
    metric results each replica reads from its own metric state: the reduction sums that state over the cluster).
    """

    def share(value):
        if not (isinstance(value, tf.Tensor) and value.shape.rank == 0 and value.dtype.is_floating):
            return value
        if tf.executing_eagerly():
            return share_of(step, value, what="a logged value the train or test step returns")
        if keep_replicated and flow_of(step).kind(value).what == REP:
            return value
        shared = share_of(step, value, what=f"a logged value the train or test step returns ({value.name})")
        _log_shares.setdefault(shared.graph, set()).add(shared.name)
        return shared

    return tf.nest.map_structure(share, outputs)


# graph -> names of the log shares made in it. Names, not tensors: a tensor holds its graph, and a value that holds
# its key would keep every traced step's graph alive (measured: +17 MB per model trained in one process).
_log_shares: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def is_log_share(tensor) -> bool:
    """True for a tensor :func:`shares_of_logs` made (a logged value, given as this replica's share)."""
    return not tf.executing_eagerly() and tensor.name in _log_shares.get(tensor.graph, ())


def check_predictions(step, outputs):
    """``outputs`` of a ``predict`` step, each refused unless it holds one row per example (one device's predictions
    are then the replicas' put together in order).

    Raises:
        BatchCouplingError: An output is computed from several examples together (the op is named).
    """
    if tf.executing_eagerly():
        return outputs
    flow = flow_of(step)
    for value in (v for v in tf.nest.flatten(outputs) if isinstance(v, tf.Tensor) and v.shape.rank != 0):
        kind = flow.kind(value)
        if kind.what == REP or kind.what == ROWS and kind.tag is not None and kind.tag.ordered:
            continue
        reason = kind.reason if kind.what == MIXED else (
            "its rows are concatenated along the batch axis, in another order than one device's"
            if kind.what == ROWS else "is computed from the whole slice together")
        raise BatchCouplingError(
            f"hetero_cs cannot split this model's predictions ({value.name}): {reason}, so the replicas' rows "
            f"would not be one device's on the whole batch. Compute each example's prediction from that example "
            f"alone, or predict on one device.")
    return outputs


def gradient_terms(step, targets, output_gradients, *, what: str = "the loss"):
    """``(tensors, output_gradients)`` whose gradient is this replica's share of ``targets``' gradient, or None when
    the targets need no weighting (each is a share already, or one value per example: their sums add up).

    The tensors are ones the caller's tape recorded (so no op is added to the forward pass); each one's output
    gradient is what the share's gradient takes from it, found by differentiating the share rebuilt from them.
    """
    flow = flow_of(step)
    weighed = [not (_is_share(step, target) or flow.kind(target).what == ROWS) for target in targets]
    if not any(weighed):
        return None
    with tf.GradientTape(watch_accessed_variables=False, persistent=False) as tape:
        reading, total = _Reading(step, flow, tape), []
        for target, outer, read in zip(targets, output_gradients, weighed):
            share = _as_share(*_read(reading, target, what, 0)) if read else _leaf(reading, target)
            if outer is not None:
                share = share * tf.stop_gradient(tf.cast(outer, share.dtype))
            total.append(tf.reduce_sum(tf.cast(share, tf.float32)))
        combined = tf.add_n(total)
    leaves = list({id(t): t for t in reading.leaves}.values())
    adjoints = tape.gradient(combined, leaves, unconnected_gradients=tf.UnconnectedGradients.ZERO)
    return leaves, [tf.cast(a, t.dtype) for a, t in zip(adjoints, leaves)]


# ---------------------------------------------------------------------------------------------------------------
def _is_share(step, value) -> bool:
    try:
        return value.ref() in step.loss_terms
    except (AttributeError, TypeError):
        return False


def _leaf(reading, tensor):
    if reading.tape is not None:
        reading.tape.watch(tensor)
        reading.leaves.append(tensor)
    return tensor


def _weigh(value, weight=None):
    """``value * b_i / B``, and 0 (never NaN) for a 0-example replica, whose own mean of nothing is NaN."""
    weight = replica_state.replica_weight(value.dtype) if weight is None else weight
    return tf.where(weight > 0, value * tf.cast(weight, value.dtype), tf.zeros_like(value))


def _as_share(mode, tensor):
    return tensor if mode == SHARE else _weigh(tensor)


def _read(reading, tensor, what: str, depth: int):
    """``(mode, tensor)``: GLOBAL, a value equal to one device's; SHARE, this replica's share of it."""
    key = tensor.ref()
    if key not in reading.memo:
        if depth > _MAX_DEPTH:
            raise _refusal(what, tensor.op, "is too deep an expression above the batch's reductions to read")
        reading.memo[key] = _read_uncached(reading, tensor, what, depth)
    return reading.memo[key]


def _read_uncached(reading, tensor, what, depth):
    step, flow = reading.step, reading.flow
    if _is_share(step, tensor):
        return SHARE, _leaf(reading, tensor)
    kind = flow.kind(tensor)
    if kind.what == MIXED:
        raise BatchCouplingError(
            f"hetero_cs cannot split {what}: its {kind.reason}, so each replica's part would not add up to one "
            f"device's value on the whole batch. Where examples do meet (pairs, in-batch negatives, a batch "
            f"statistic), train this model on one device.")
    if kind.what in (REP, COUNT):  # COUNT: a slice's number of rows, and the replicas' counts add up
        return GLOBAL if kind.what == REP else SHARE, _leaf(reading, tensor)
    if kind.what == ROWS:
        raise LossPatternError(
            f"{what} ({tensor.name}) holds one value per example where hetero_cs expects a value reduced over the "
            f"batch. Reduce it with tf.reduce_mean or tf.reduce_sum over the batch axis.")
    op = tensor.op
    if op.type in ("Sum", "Mean", "Prod") and _reduces_rows(flow, op):
        return _atom(reading, op, tensor, what)
    if op.type == "L2Loss" and flow.kind(op.inputs[0]).what == ROWS:
        return SHARE, _leaf(reading, tensor)  # half the sum of squares over the batch: the replicas' parts add up
    if op.type in ("Mul", "MulNoNan", "RealDiv", "Div", "DivNoNan"):  # a product or a quotient
        return (_product if op.type.startswith("Mul") else _quotient)(reading, op, tensor, what, depth)
    linear = _LINEAR.get(op.type)
    if linear is None and op.type in _OPAQUE:
        raise LossPatternError(
            f"hetero_cs cannot split {what}: it is computed inside a {op.type} op ({op.name!r}: a nested tf.function, "
            f"tf.cond, tf.while_loop or tf.py_function around the loss), whose result hetero_cs cannot rebuild as "
            f"each replica's share. Compute the loss directly in the step (call the loss function without its own "
            f"@tf.function: the step is traced already), or return per-example losses and reduce them with "
            f"tf.nn.compute_average_loss(per_example, global_batch_size=hetero_cs.current_global_batch_size()).")
    if linear is None:
        raise _refusal(what, op, "is not linear in the examples' values")
    data = set(range(len(op.inputs))[linear])
    inputs, modes = list(op.inputs), []
    for index, inner in enumerate(op.inputs):
        if index not in data:
            if flow.kind(inner).what != REP:
                raise _refusal(what, op, f"takes its {_ordinal(index)} input from the examples' values")
            continue
        mode, inputs[index] = _read(reading, inner, what, depth + 1)
        modes.append(mode)
    if all(mode == GLOBAL for mode in modes):
        return GLOBAL, _leaf(reading, tensor)
    for index, mode in zip(sorted(data), modes):
        inputs[index] = _as_share(mode, inputs[index])
    return SHARE, _rebuilt(reading, tensor, inputs)


def _reduces_rows(flow, op) -> bool:
    kind = flow.kind(op.inputs[0])
    if kind.what == SHAPE:
        return op.type == "Prod"  # the product of a shape: a count of elements, which add up over the replicas
    reduced = axes(op.inputs[1], op.inputs[0].shape.rank) if kind.what == ROWS else None
    return reduced is not None and kind.axis in reduced


def _atom(reading, op, tensor, what):
    """A reduction over the batch axis of per-example values: a sum (kept), a mean (weighed), or refused."""
    flow, kind = reading.flow, reading.flow.kind(op.inputs[0])
    if op.type == "Prod" and kind.what != SHAPE:
        raise _refusal(what, op, "multiplies values over the batch")
    leaf = _leaf(reading, tensor)
    if op.type in ("Sum", "Prod"):  # a sum, or the product of a shape (a count of elements): the replicas' add up
        return SHARE, leaf
    if flow.rows_proportional(kind):
        return SHARE, _weigh(leaf)
    # Rows the data picked: this replica's share of the mean is its rows' sum over all replicas' rows.
    note_for_micro_batches("normalised_loss")  # each micro-batch would have its own normaliser
    rows = tf.cast(tf.size(op.inputs[0]), tensor.dtype) / tf.cast(tf.maximum(tf.size(tensor), 1), tensor.dtype)
    total = all_reduced_sum(tf.stop_gradient(rows))
    return SHARE, tf.where(rows > 0, leaf * tf.math.divide_no_nan(rows, total), tf.zeros_like(leaf))


def _product(reading, op, tensor, what, depth):
    a, b = op.inputs
    for factor, other in ((a, b), (b, a)):
        if factor.ref() in reading.step.weights:  # value * hetero_cs.replica_weight(): the user weighed it already
            if _read(reading, other, what, depth + 1)[0] == GLOBAL or _is_weighed_mean(reading.flow, other):
                return SHARE, _leaf(reading, tensor)
            raise _refusal(what, op, "multiplies a value that is already a share by replica_weight() again")
    (mode_a, share_a), (mode_b, share_b) = _read(reading, a, what, depth + 1), _read(reading, b, what, depth + 1)
    if mode_a == GLOBAL and mode_b == GLOBAL:
        return GLOBAL, _leaf(reading, tensor)
    if SHARE in (mode_a, mode_b) and GLOBAL in (mode_a, mode_b):
        return SHARE, _rebuilt(reading, tensor, [share_a, share_b])
    raise _refusal(what, op, "multiplies two values computed from the batch (not linear: one device would multiply "
                             "the whole batch's values)")


def _is_weighed_mean(flow, tensor) -> bool:
    op = tensor.op
    while op.type in ("Identity", "Cast") and op.inputs:
        op = op.inputs[0].op
    return op.type == "Mean" and _reduces_rows(flow, op) and flow.rows_proportional(flow.kind(op.inputs[0]))


def _quotient(reading, op, tensor, what, depth):
    numerator, denominator = op.inputs
    mode_n, share_n = _read(reading, numerator, what, depth + 1)
    if _is_one_on_one_device(reading.step, denominator):
        # x / strategy.num_replicas_in_sync (the stock idiom for an even split), or x / the replica's weight b_i / B
        # (Keras' logged loss, unscaled: a per-output loss tracker's value): one device divides by 1.
        return SHARE, _as_share(mode_n, share_n)
    mode_d, share_d = _read(reading, denominator, what, depth + 1)
    counted = reading.flow.kind(denominator)
    if counted.what == COUNT and counted.tag is not None and counted.tag.root == reading.flow.batch.root:
        # Divided by a number of rows that is a fixed multiple of the slice's examples (Keras' mean: a sum over the
        # number of values): one device divides by that number over the whole batch, count * B / b_i.
        weight = replica_state.replica_weight(tensor.dtype)
        return SHARE, tf.math.divide_no_nan(_as_share(mode_n, share_n) * weight, tf.cast(share_d, tensor.dtype))
    if mode_d == GLOBAL:
        return (GLOBAL, _leaf(reading, tensor)) if mode_n == GLOBAL else \
            (SHARE, _rebuilt(reading, tensor, [share_n, share_d]))
    # A ratio of batch aggregates (sum(loss * mask) / sum(mask)): one device divides the whole batch's numerator by
    # the whole batch's denominator. Both are all-reduced (without gradient), every replica divides its numerator's
    # share by the global denominator, and the quotient rule's term for the denominator is added with value 0.
    note_for_micro_batches("normalised_loss")  # each micro-batch would have its own normaliser
    dtype = tensor.dtype
    share_n, share_d = tf.cast(_as_share(mode_n, share_n), dtype), tf.cast(share_d, dtype)
    if mode_n == GLOBAL:
        total_d, total_n = all_reduced_sum(tf.stop_gradient(share_d)), tf.stop_gradient(tf.cast(numerator, dtype))
    else:
        total_n, total_d = tf.unstack(all_reduced_sum(tf.stop_gradient(tf.stack([share_n, share_d]))))
    first = tf.math.divide_no_nan(share_n, total_d)
    second = tf.math.divide_no_nan(total_n, tf.square(total_d)) * (share_d - tf.stop_gradient(share_d))
    return SHARE, first - second


def _is_one_on_one_device(step, tensor) -> bool:
    """Whether ``tensor`` is ``strategy.num_replicas_in_sync`` (``B / b_i``) or the replica's weight (``b_i / B``)
    of this step, as it is or cast: a factor that is 1 on one device."""
    marked = step.replica_counts | step.weights
    while tensor.ref() not in marked and tensor.op.type in ("Identity", "Cast") and tensor.op.inputs:
        tensor = tensor.op.inputs[0]
    return tensor.ref() in marked


def all_reduced_sum(values):
    """``values`` summed over the replicas of the step (in replica context), told to this replica step's batch-flow
    analysis as the same on every replica and on one device."""
    summed = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, values)
    step = replica_state.current_replica_step()
    if step is not None and step.flow is not None:
        step.flow.seed_replicated(summed)
    return summed


def _rebuilt(reading, tensor, inputs):
    """``tensor``'s op on ``inputs`` (same dtypes): ``tensor`` itself when they are its own and no tape records the
    reading, else the op again, with its own attributes."""
    op = tensor.op
    unchanged = reading.tape is None and all(new is old for new, old in zip(inputs, op.inputs))
    return tensor if unchanged else _REEMIT[op.type](op, inputs)


def _attr(op, name, default=None):
    return op.get_attr(name) if name in op.node_def.attr else default


_REEMIT = {
    **dict.fromkeys(("Identity", "Snapshot", "EnsureShape", "CheckNumerics", "CheckNumericsV2"),
                    lambda op, x: tf.identity(x[0])), "Cast": lambda op, x: tf.cast(x[0], op.outputs[0].dtype),
    "StopGradient": lambda op, x: tf.stop_gradient(x[0]), "Neg": lambda op, x: tf.negative(x[0]),
    "ZerosLike": lambda op, x: tf.zeros_like(x[0]), "AddN": lambda op, x: tf.add_n(list(x)),
    "Add": lambda op, x: tf.add(*x), "AddV2": lambda op, x: tf.add(*x), "Sub": lambda op, x: tf.subtract(*x),
    "Mul": lambda op, x: tf.multiply(*x), "MulNoNan": lambda op, x: tf.math.multiply_no_nan(*x),
    "RealDiv": lambda op, x: tf.math.divide(*x), "Div": lambda op, x: tf.math.divide(*x),
    "DivNoNan": lambda op, x: tf.math.divide_no_nan(*x), "Slice": lambda op, x: tf.slice(*x),
    "Sum": lambda op, x: tf.reduce_sum(*x, keepdims=_attr(op, "keep_dims", False)),
    "Mean": lambda op, x: tf.reduce_mean(*x, keepdims=_attr(op, "keep_dims", False)),
    "Pack": lambda op, x: tf.stack(list(x), axis=_attr(op, "axis", 0)),
    "Reshape": lambda op, x: tf.reshape(*x), "ExpandDims": lambda op, x: tf.expand_dims(*x),
    "Transpose": lambda op, x: tf.transpose(*x), "Tile": lambda op, x: tf.tile(*x),
    "BroadcastTo": lambda op, x: tf.broadcast_to(*x), "SelectV2": lambda op, x: tf.where(*x),
    "Squeeze": lambda op, x: tf.squeeze(x[0], axis=list(_attr(op, "squeeze_dims", [])) or None),
    "StridedSlice": lambda op, x: tf.raw_ops.StridedSlice(input=x[0], begin=x[1], end=x[2], strides=x[3], **{
        f"{mask}_mask": _attr(op, f"{mask}_mask") for mask in ("begin", "end", "ellipsis", "new_axis", "shrink_axis")}),
    "GatherV2": lambda op, x: tf.gather(x[0], x[1], axis=x[2], batch_dims=_attr(op, "batch_dims", 0)),
    "Select": lambda op, x: tf.raw_ops.Select(condition=x[0], x=x[1], y=x[2]),
    "ConcatV2": lambda op, x: tf.concat(list(x[:-1]), axis=x[-1]),
}


def _ordinal(index: int) -> str:
    return ("first", "second", "third", "fourth")[index] if index < 4 else f"input {index}"


def _refusal(what: str, op, why: str) -> LossPatternError:
    return LossPatternError(
        f"hetero_cs cannot split {what}: its {op.type} op {op.name!r} {why}. Each replica must give its share of one "
        f"device's value, and hetero_cs accepts only sums and means over the batch of per-example values, values "
        f"that do not depend on the batch, linear combinations of these with factors that do not depend on the "
        f"batch, and a ratio of two such values (sum(loss * mask) / sum(mask)). " + (
            "Log it with a Keras metric instead (its state is reduced over the replicas), e.g. "
            "keras.metrics.Mean or a metric of your own." if "logged value" in what else
            "Write the loss in those forms: e.g. a mean of per-example losses instead of its square root (log "
            "tf.sqrt of it as a metric), or return per-example losses and let a Keras loss reduce them."))
