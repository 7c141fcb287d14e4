"""The input side of :class:`~hetero_cs.HeteroMultiWorkerMirroredStrategy`: distributed datasets and ``strategy.run``.

Every worker reads every global batch whole; inside ``strategy.run`` each replica cuts its own slice by the split of
the step (see :mod:`hetero_cs.engine.multi_worker`).
"""

from __future__ import annotations

import tensorflow as tf

from hetero_cs.engine import _compat, tensors, training
from hetero_cs.errors import InputError


class MultiWorkerInput:
    """Mixin of HeteroMultiWorkerMirroredStrategy (before MultiWorkerMirroredStrategy in its bases): its input."""

    # ----------------------------------------------------------------------------------------------------------
    # Input: every worker reads every global batch whole (the cut happens in the step)
    # ----------------------------------------------------------------------------------------------------------
    def experimental_distribute_dataset(self, dataset, options=None):
        """Distributes a dataset of *global* batches: every worker iterates all of it, unsharded.

        Each element goes whole to each local replica, which cuts its own slice inside ``strategy.run``; every
        example is used exactly once over the cluster. Every worker must iterate the same data in the same order
        (the same dataset, the same shuffle seed).

        Raises:
            InputError: ``dataset`` is not a ``tf.data.Dataset``.
        """
        if not isinstance(dataset, tf.data.Dataset):
            raise InputError(f"experimental_distribute_dataset needs a tf.data.Dataset; got {type(dataset).__name__}.")
        return self.distribute_datasets_from_function(lambda _: dataset, options)

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        """Like tf.distribute's, but ``dataset_fn``'s dataset yields global batches, read whole on every worker.

        ``dataset_fn`` is called once per worker with an ``InputContext`` of one pipeline and one replica, so
        ``input_context.get_per_replica_batch_size(B)`` returns ``B``: batch by the global batch size and do not
        shard.
        """
        context = tf.distribute.InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=1)
        source = dataset_fn(context)
        if not isinstance(source, tf.data.Dataset):
            raise InputError(f"dataset_fn must return a tf.data.Dataset; got {type(source).__name__}.")
        local = self._num_local
        dataset = source
        if local > 1:  # one copy of each global batch per local replica (element k goes to local replica k mod n)
            dataset = dataset.flat_map(lambda *e: tf.data.Dataset.from_tensors(e if len(e) > 1 else e[0]).repeat(local))
        distributed = super().distribute_datasets_from_function(lambda _: dataset, options)
        _compat.mark_distributed_dataset(distributed, source)
        self._balancer.start_new_input()
        return distributed

    # ----------------------------------------------------------------------------------------------------------
    # Replica steps
    # ----------------------------------------------------------------------------------------------------------
    def run(self, fn, args=(), kwargs=None, options=None):
        """``Strategy.run`` whose replica function sees only its slice of every rank >= 1 tensor argument.

        Every tensor argument of rank >= 1 is taken as part of the global batch (all with the same leading size
        ``B``) and cut along its first axis; scalars pass unchanged. Inside ``fn``,
        :func:`hetero_cs.current_global_batch_size` is ``B`` and :func:`hetero_cs.replica_weight` is ``b_i / B``.
        """
        sizes = None
        if self._agreed:
            batched = [v for v in tf.nest.flatten((args, kwargs or {})) if _is_batched(_first_local(self, v))]
            if batched:  # the split is agreed here, in cross-replica context, before the replicas start
                sizes = self._agreed_sizes(tensors.leading_dim(_first_local(self, batched[0])))
        if _compat.is_tf_function(fn):
            wrapped = _compat.clone_function(fn, self._wrap_replica_fn(fn.python_function, sizes))
        else:
            wrapped = self._wrap_replica_fn(fn, sizes)
        return super().run(wrapped, args=args, kwargs=kwargs, options=options)

    def _wrap_replica_fn(self, fn, agreed_sizes=None):
        strategy = self

        def replica_fn(*call_args, **call_kwargs):
            context = tf.distribute.get_replica_context()
            replica_id = _compat.replica_id_in_sync_group(context)
            flat = tf.nest.flatten((call_args, call_kwargs))
            batched = [i for i, t in enumerate(flat) if _is_batched(t)]
            if not batched:
                return fn(*call_args, **call_kwargs)
            global_batch_size = tensors.leading_dim(flat[batched[0]])
            sizes = strategy._local_step_sizes(global_batch_size) if agreed_sizes is None else agreed_sizes
            offset = tf.reduce_sum(sizes[:replica_id])
            batch_size = sizes[replica_id]
            start = None
            if strategy._timing:
                from hetero_cs.engine.step_timing import tie_to_stamp, wall_clock_stamp

                start = wall_clock_stamp(sizes)  # the split is known: this replica's step starts
                sizes = tie_to_stamp(sizes, start)  # and its work waits for the stamp (never runs before it)
                offset, batch_size = tf.reduce_sum(sizes[:replica_id]), sizes[replica_id]
            for i in batched:
                flat[i] = _cut(flat[i], offset, batch_size)
            call_args, call_kwargs = tf.nest.pack_sequence_as((call_args, call_kwargs), flat)
            step = training.ReplicaStep(
                replica_id=replica_id, device=strategy.extended.worker_devices[replica_id - strategy._first_replica],
                batch_size=batch_size, global_batch_size=global_batch_size, start_stamp=start,
            )
            with training.replica_step(step):
                return fn(*call_args, **call_kwargs)

        return replica_fn

    def _local_step_sizes(self, global_batch_size):
        """Fixed or even split: the split of this global batch (int32 [R]) from ``B`` alone, the same everywhere."""
        sizes = tf.numpy_function(self._local_sizes, [global_batch_size], tf.int64, name="hetero_cs_plan")
        sizes.set_shape([self.num_replicas_in_sync])
        return tf.cast(sizes, tf.int32)


def _is_batched(value) -> bool:
    if isinstance(value, tf.SparseTensor):
        raise InputError(
            "HeteroMultiWorkerMirroredStrategy cuts every batch component along its first axis, which a "
            "tf.SparseTensor does not support here. Convert it with tf.sparse.to_dense in the dataset."
        )
    if isinstance(value, tf.RaggedTensor):
        return True
    return tf.is_tensor(value) and value.shape.rank != 0


def _first_local(strategy, value):
    """A distributed value's first local component (the value itself when it is not distributed)."""
    return strategy.experimental_local_results(value)[0]


def _cut(value, offset, size):
    """Examples [offset, offset + size) of a batch component (a view for dense tensors)."""
    return value[offset:offset + size]
