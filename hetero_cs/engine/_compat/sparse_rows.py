"""Sparse gradients (an Embedding's ``tf.IndexedSlices``) over replicas and micro-batches: rows from the batch are
concatenated, as one device has them; rows looked up without the batch (a Transformer's positions) are added row by
row, as one device sums them over the batch."""

import tensorflow as tf


def shared_rows_dense(gradient):
    """Under the multi-worker strategy: an Embedding's sparse gradient whose rows do not come from the batch, as a
    dense tensor; any other gradient as it is.

    Such a lookup (a Transformer's positions, ``Embedding(T, D)(arange(T))``) has indices computed from constants and
    shapes alone (its row count known while tracing, or T read from a batch padded to its own length) and one row
    per looked-up index, summed over the slice; one device's has the same rows summed over the whole
    batch, and an optimizer that squares rows (Adam) squares those sums. TensorFlow's all-reduce of
    ``tf.IndexedSlices`` concatenates the replicas' rows, and so would adding micro-batches' rows end to end: each
    part of a row would be squared apart (measured: 7e-2 off one device after 4 Adam steps). Dense, the parts add
    row by row (rows nobody looked up are zeros, as they are absent from one device's update), and an idle replica
    adds zeros of the same shape. A lookup of the batch (a row per example, the count unknown while tracing) stays
    sparse: its concatenation is one device's gradient.
    """
    if isinstance(gradient, tf.IndexedSlices) and _rows_not_from_the_batch(gradient.indices):
        return tf.convert_to_tensor(gradient)
    return gradient


_SHAPE_OPS = frozenset({"Const", "Shape", "ShapeN", "Size", "Rank"})


def _rows_not_from_the_batch(indices) -> bool:
    """Whether a sparse gradient's row indices do not come from the batch's values: a count known while tracing,
    or (a sequence padded to its batch's own length: ``arange(T)`` with T read from the batch's shape) computed
    from constants and shapes alone. Read from the graph of the replica step; False where it cannot be read."""
    if indices.shape.rank != 1:
        return False
    if indices.shape[0] is not None:
        return True
    if not hasattr(indices, "op"):  # an eager tensor: its history is gone
        return False
    seen, pending = set(), [indices.op]
    while pending:
        op = pending.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        if op.type in _SHAPE_OPS:
            continue
        if not op.inputs or len(seen) > 200:  # a placeholder, the batch, a variable, or too far to read
            return False
        pending.extend(t.op for t in op.inputs)
    return True


def shared_rows_sum(strategy, per_replica_grad, device):
    """The sum over the replicas of an Embedding's sparse gradient whose rows do not come from the batch, or None.

    One device's gradient of a lookup that does not depend on the batch - a Transformer's positions,
    ``Embedding(T, D)(arange(T))`` - has one row per looked-up index, summed over the whole batch; an optimizer that
    squares rows (Adam) squares those sums. Each replica computes the same rows, summed over its slice, so the
    replicas' values are added row by row. TensorFlow's sum of ``tf.IndexedSlices`` concatenates them instead, which
    suits a lookup of the batch (one device also has a row per example there) but would hand Adam each replica's
    part of a row to square apart (measured: 1e-2 off one device after 4 Adam steps). A lookup of the batch has indices
    read from the batch's values; this one's come from constants and shapes. Replicas that looked up
    other indices after all (a lookup that depends on the replica) fail the step with an InvalidArgumentError rather
    than add unlike rows.
    """
    if not isinstance(per_replica_grad, tf.distribute.DistributedValues):
        return None
    parts = strategy.experimental_local_results(per_replica_grad)
    first = parts[0]
    if len(parts) < 2 or not all(isinstance(p, tf.IndexedSlices) for p in parts):
        return None
    if not all(_rows_not_from_the_batch(p.indices) for p in parts) or any(
            p.indices.shape[0] != first.indices.shape[0] for p in parts):
        return None  # rows from the batch: TensorFlow's concatenation is one device's gradient
    with tf.device(device):
        checks = [tf.debugging.assert_equal(
            p.indices, first.indices, message="hetero_cs: the replicas looked up different rows of an Embedding "
            "whose lookup does not depend on the batch; their sparse gradients cannot be added row by row")
            for p in parts[1:]]
        with tf.control_dependencies(checks):
            return tf.IndexedSlices(tf.add_n([p.values for p in parts]), tf.identity(first.indices), first.dense_shape)
