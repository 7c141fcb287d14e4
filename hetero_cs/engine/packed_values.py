"""Elements of a distributed dataset as per-replica values: their slices, reductions and gathers.

Every element of a distributed dataset is one packed global batch on the host (``[R, (b_i), ...]`` per component,
see :mod:`hetero_cs.engine.input_slicing`). :class:`PackedBatchValues` is the part of the strategy that turns
such an element into its ``R`` slices wherever tf.distribute expects per-replica values: ``strategy.run``'s
arguments, ``experimental_local_results``, ``reduce`` and ``gather``.
"""

from __future__ import annotations

import tensorflow as tf

from hetero_cs.engine import _compat, tensors
from hetero_cs.engine.input_slicing import is_unbatched_marker, unpack as unpack_slices
from hetero_cs.errors import InputError


class PackedBatchValues:
    """Mixin for a ``tf.distribute.Strategy`` whose distributed datasets yield packed global batches."""

    def _replica_slices(self, value) -> list | None:
        """The ``R`` slices of one packed global-batch leaf from a distributed dataset, or None for other values."""
        if self.num_replicas_in_sync == 1:
            return None  # one replica: the batch is not packed, it is already replica 0's slice
        parts = _compat.components(value)
        if parts is None or len(parts) != 1:
            return None
        packed = parts[0]
        R = self.num_replicas_in_sync
        if is_unbatched_marker(packed):  # None / Optional ("no sample weights"): the same for every replica
            return [packed] * R
        rows = packed.shape[0] if isinstance(packed, tf.RaggedTensor) else None
        if not isinstance(packed, tf.RaggedTensor) or (rows is not None and rows != R):
            made_for = f" (it was cut for {rows} replicas: another strategy's dataset?)" if rows is not None else ""
            raise InputError(
                f"Got a per-replica value with 1 component{made_for}, but this strategy has R={R} replicas. Pass "
                f"elements of this strategy's experimental_distribute_dataset(...), or per-replica values made by "
                f"its experimental_distribute_values_from_function."
            )
        with tf.device(self.extended.input_device):
            return unpack_slices(packed, R)

    def _unpack(self, structure, created=None):
        """``structure`` with every packed global-batch leaf replaced by a per-replica value of its ``R`` slices.

        The new per-replica values are appended to ``created`` (a list) when given.
        """

        def convert(value):
            slices = self._replica_slices(value)
            if slices is None:
                return value
            unpacked = _compat.per_replica(slices)
            if created is not None and not is_unbatched_marker(slices[0]):
                created.append(unpacked)
            return unpacked

        return tf.nest.map_structure(convert, structure)

    def _unpack_inputs(self, args, kwargs):
        """``strategy.run``'s arguments with every packed global batch replaced by per-replica slices.

        Returns ``(args, kwargs, batch_leaves)``; ``batch_leaves`` are the per-replica slices made here, in order.
        """
        created: list = []
        return self._unpack(args, created), self._unpack(kwargs or {}, created), created

    def experimental_local_results(self, value):
        """Like ``tf.distribute``'s; an element of a distributed dataset gives its ``R`` per-replica slices.

        For a nested element such as ``(features, labels)`` the result is a tuple of ``R`` such structures, replica
        ``i``'s holding its slice of every component.
        """
        return super().experimental_local_results(self._unpack(value))  # the strategy's own

    def reduce(self, reduce_op, value, axis=None):
        """Reduces per-replica values across replicas, leaf by leaf for nested values.

        Stock CentralStorageStrategy returns replica 0's value for ``MEAN`` of a tuple or dict (and raises for
        ``SUM``); here each leaf is reduced on its own.

        With uneven slices, average per-example quantities by weight, not per replica. Worked number: slices
        ``[7, 3]`` whose mean losses are 1.0 and 0.0 have the full-batch mean 0.7, but ``reduce("MEAN", loss,
        axis=None)`` gives 0.5. Compute each replica's loss with ``tf.nn.compute_average_loss(per_example_loss,
        global_batch_size=B)`` (0.7 and 0.0) and reduce with ``"SUM"``: 0.7. ``axis=0`` reduces per example and is
        exact as is. ``MEAN`` with ``axis=None`` of an element of a distributed dataset, or of values whose shapes
        differ between replicas (slices of a data batch), has no element-wise mean; it returns the largest replica's
        value, which is what Keras needs when it infers input shapes from a distributed batch.
        """
        if tf.nest.is_nested(value) and not isinstance(value, tf.distribute.DistributedValues):
            return tf.nest.map_structure(lambda v: self.reduce(reduce_op, v, axis=axis), value)
        if value is None:  # e.g. the missing sample weights of an (x, y, None) batch
            return None
        op = reduce_op if isinstance(reduce_op, str) else reduce_op.value
        slices = self._replica_slices(value)
        if slices is not None:  # an element of a distributed dataset: reduce its per-replica slices
            if is_unbatched_marker(slices[0]):
                return slices[0]
            if axis is None and str(op).upper() == "MEAN":
                return tensors.largest(slices)
            value = _compat.per_replica(slices)
        if (
            axis is None
            and str(op).upper() == "MEAN"
            and isinstance(value, tf.distribute.DistributedValues)
            and tensors.known_unequal_shapes(self.experimental_local_results(value))
        ):
            return tensors.largest(self.experimental_local_results(value))
        return super().reduce(reduce_op, value, axis=axis)

    def gather(self, value, axis):
        """Like ``tf.distribute``'s, leaf by leaf for nested values; an element of a distributed dataset gathers its
        slices back into the global batch. (Stock gather returns only part of a nested value.)"""
        gather_one = super().gather

        def gather_leaf(leaf):
            slices = self._replica_slices(leaf)
            if slices is None:
                return gather_one(leaf, axis)
            if is_unbatched_marker(slices[0]):  # None / Optional: nothing to gather
                return slices[0]
            return gather_one(_compat.per_replica(slices), axis)

        return tf.nest.map_structure(gather_leaf, value)

    # ----------------------------------------------------------------------------------------------------------
