"""Elements of a distributed dataset as per-replica values: their slices, reductions and gathers.

Every element of a distributed dataset is one global batch on the host, each leaf a per-replica value with a single
component holding the whole batch (see :mod:`hetero_cs.engine.step.input_slicing`). :class:`PackedBatchValues` is the part
of the strategy that turns such an element into its ``R`` slices wherever tf.distribute expects per-replica values:
``strategy.run``'s arguments (cut by the plan the step decides when it starts), ``experimental_local_results``,
``reduce`` and ``gather`` (cut by the plan in force).
"""

import numpy as np
import tensorflow as tf

from hetero_cs.engine import _compat
from hetero_cs.engine.step import tensors
from hetero_cs.engine.step.input_slicing import cut, is_unbatched_marker


class PackedBatchValues:
    """Mixin for a ``tf.distribute.Strategy`` whose distributed datasets yield whole global batches."""

    def _replica_slices(self, value, sizes=None) -> list | None:
        """The ``R`` slices of one global-batch leaf from a distributed dataset, or None for other values.

        A leaf of a distributed-dataset element holds the global batch as its one component (None for a "no data"
        leaf such as missing sample weights). With one replica every per-replica value has one component, and a
        batch is already replica 0's slice.

        Args:
            value: A leaf of a distributed dataset's element (other values give None).
            sizes: int64 ``[R]``, this step's slice sizes; None outside a step: the plan in force for the batch's
                size (it changes nothing of the plan lifecycle).
        """
        if self.num_replicas_in_sync == 1 or self.extended.active_replicas_now() is not None:
            return None  # one replica; or inside a call over some replicas, whose values have one part per replica
        parts = _compat.components(value)
        if parts is None or len(parts) != 1:
            return None
        component, R = parts[0], self.num_replicas_in_sync
        if is_unbatched_marker(component):  # None / Optional ("no sample weights"): the same for every replica
            return [component] * R
        # Outside a step: the plan in force for a batch of this size (a Python call that advances nothing).
        if sizes is None:
            sizes = tf.reshape(tf.numpy_function(
                lambda b: np.asarray(self._balancer.plan_for_inference(int(b)).per_replica_batch_sizes, dtype=np.int64),
                [tf.cast(tensors.leading_dim(component), tf.int64)], tf.int64, stateful=True), [R])
        with tf.device(self.extended.input_device):
            return cut(component, sizes, R)

    def _unpack(self, structure, created=None, sizes=None, whole=False):
        """``structure`` with every global-batch leaf replaced by a per-replica value of its ``R`` slices (``whole``:
        by the whole batch, a tensor, for a call whose one replica holds all of it).

        The new per-replica values (or whole batches) are appended to ``created`` (a list) when given.
        """

        def convert(value):
            if whole:
                parts = _compat.components(value)
                if parts is None or len(parts) != 1:
                    return value
                # Its static batch size stays where the traced call knows it (one device's step may see none, from
                # a dataset that does not say it). Keras' per-output loss trackers weigh a Mean by it: a Mean weighed
                # by a number counts one per step in our steps (_compat.losses.patch_mean_metric).
                whole_batch = parts[0]
                if created is not None and not is_unbatched_marker(whole_batch):
                    created.append(whole_batch)
                return whole_batch
            slices = self._replica_slices(value, sizes)
            if slices is None:
                return value
            unpacked = _compat.per_replica(slices)
            if created is not None and not is_unbatched_marker(slices[0]):
                created.append(unpacked)
            return unpacked

        return tf.nest.map_structure(convert, structure)

    def _unpack_inputs(self, args, kwargs, traced=None, handed=False, whole=False):
        """``strategy.run``'s arguments with every global batch replaced by per-replica slices, cut by the plan this
        step decides now (before any replica runs).

        ``traced``: the sets of active replicas the step has branches for (see
        :func:`hetero_cs.engine.step.idle_replicas.served_sizes`), or None.
        ``handed``: the step reads the sizes served before it (``PlanSlicer.handed``: model.fit's step per set).
        ``whole``: the step's one active replica gets the whole batch, uncut (its plan's set is that replica alone).

        Returns ``(args, kwargs, batch_leaves, timed, sizes)``; ``batch_leaves`` are the per-replica slices made
        here, in order; ``timed`` is a bool scalar tensor (whether to time this step) and ``sizes`` the int64
        ``[R]`` slice sizes, both None when no global batch came.
        """
        batches = self._global_batches(args, kwargs)
        if not batches:
            return args, kwargs, [], None, None
        training = not self._input_roles.inferring_now  # traced inside evaluate or predict: an inference step
        from hetero_cs.engine.step.sub_steps import current_sub_step

        sub_step = current_sub_step()
        if sub_step is not None:  # an overlapped micro-batched call's sub-step: its cut was planned before the call
            sizes, timed = sub_step.sizes, tf.constant(True)
        else:
            sizes, timed = self._slicer.step_sizes(tensors.leading_dim(_compat.components(batches[0])[0]),
                                                   training=training, traced=traced, handed=handed)
        if self.num_replicas_in_sync == 1:  # the batch is replica 0's slice; the plan is still served (a stateful op)
            return args, kwargs, [], timed, None
        created: list = []
        return (self._unpack(args, created, sizes, whole), self._unpack(kwargs or {}, created, sizes, whole), created,
                timed, sizes)

    @staticmethod
    def _global_batches(args, kwargs) -> list:
        """The global batches among ``strategy.run``'s arguments (a distributed dataset's elements)."""
        return [leaf for leaf in tf.nest.flatten((args, kwargs or {}))  # components: None for any other value
                if len(_compat.components(leaf) or ()) == 1 and not is_unbatched_marker(_compat.components(leaf)[0])]

    def _static_batch_size(self, args, kwargs) -> int | None:
        """The static size of the global batch in a traced step's arguments; None when unknown or absent."""
        dims = [_compat.components(leaf)[0].shape[0] for leaf in self._global_batches(args, kwargs)]
        return dims[0] if dims and None not in dims else None

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
        whole_mean = axis is None and str(getattr(reduce_op, "value", reduce_op)).upper() == "MEAN"  # a ReduceOp or str
        slices = self._replica_slices(value)
        if slices is not None:  # an element of a distributed dataset: reduce its per-replica slices
            if is_unbatched_marker(slices[0]):
                return slices[0]
            if whole_mean:
                return tensors.largest(slices)
            value = _compat.per_replica(slices)
        if whole_mean and isinstance(value, tf.distribute.DistributedValues) and tensors.known_unequal_shapes(
                self.experimental_local_results(value)):
            return tensors.largest(self.experimental_local_results(value))
        return super().reduce(reduce_op, value, axis=axis)

    def gather(self, value, axis):
        """Like ``tf.distribute``'s, leaf by leaf for nested values; an element of a distributed dataset gathers its
        slices back into the global batch. (Stock gather returns only part of a nested value.)"""
        gather_one = super().gather

        def gather_leaf(leaf):
            slices = self._replica_slices(leaf)
            if slices is not None and is_unbatched_marker(slices[0]):  # None / Optional: nothing to gather
                return slices[0]
            return gather_one(leaf if slices is None else _compat.per_replica(slices), axis)

        return tf.nest.map_structure(gather_leaf, value)

    # ----------------------------------------------------------------------------------------------------------
