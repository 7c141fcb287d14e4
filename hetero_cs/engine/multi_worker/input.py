"""The input side of :class:`~hetero_cs.HeteroMultiWorkerMirroredStrategy`: distributed datasets and ``strategy.run``.

Every worker reads every global batch whole, once, on its host (the worker's CPU): an element of a distributed
dataset holds each component once (a per-replica value with a single component), not one copy per local replica.
``strategy.run`` decides the step's split in cross-replica context (agreed by the cluster, or from ``B`` alone),
cuts each batch component on the host into this worker's local replicas' slices (replica ``i`` takes examples
``[sum(b_<i), sum(b_<=i))``, ``i`` in task-index then local order) and hands each replica only its slice
``[b_i, ...]`` as a per-replica value. So a replica's device receives ``b_i`` examples, never the global batch:
host-to-device bytes and device memory for the input scale with ``b_i``, not ``B``.
"""

import tensorflow as tf

from hetero_cs.engine import _compat, arguments
from hetero_cs.engine.step import replica_state, tensors
from hetero_cs.engine.step.input_slicing import is_unbatched_marker
from hetero_cs.errors import ConfigError, InputError


class MultiWorkerInput:
    """Mixin of HeteroMultiWorkerMirroredStrategy (before MultiWorkerMirroredStrategy in its bases): its input.

    Reads the strategy's ``_num_local``, ``_first_replica``, ``_timing``, ``_balancer`` and ``_step_sizes``.
    """

    # ----------------------------------------------------------------------------------------------------------
    # Input: every worker reads every global batch whole, once, on its host (the cut happens in the step)
    # ----------------------------------------------------------------------------------------------------------
    def experimental_distribute_dataset(self, dataset, options=None):
        """Distributes a dataset of *global* batches: every worker iterates all of it, unsharded, on its host.

        Each element stays whole on the worker's CPU, once (not one copy per local replica); ``strategy.run`` cuts
        it there and hands each local replica only its own slice, so every example is used exactly once over the
        cluster. Every worker must iterate the same data in the same order (the same dataset, the same shuffle
        seed). ``options`` (``tf.distribute.InputOptions``) are accepted for compatibility; their device-placement
        and per-replica buffer settings do not apply to this host-side cut and are ignored with a warning.

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
        shard. Each element stays on the worker's CPU, once; ``strategy.run`` cuts it (see
        :meth:`experimental_distribute_dataset`).
        """
        context = tf.distribute.InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=1)
        source = dataset_fn(context)
        if not isinstance(source, tf.data.Dataset):
            raise InputError(f"dataset_fn must return a tf.data.Dataset; got {type(source).__name__}.")
        arguments.warn_unused_input_options(options)
        # One element per global batch on the worker's host (a per-replica value of a single component per leaf),
        # where tf.distribute would fetch one per local replica to its device.
        distributed = _compat.distribute_on_host(self, source, source=source, host=self._input_host)
        self._balancer.start_new_input()
        return distributed

    @property
    def _input_host(self) -> str:
        """This worker's CPU, where its input pipeline runs and its global batches are cut."""
        spec = tf.DeviceSpec.from_string(self.extended.worker_devices[0])
        return spec.replace(device_type="CPU", device_index=0).to_string()

    # ----------------------------------------------------------------------------------------------------------
    # Replica steps
    # ----------------------------------------------------------------------------------------------------------
    def run(self, fn, args=(), kwargs=None, options=None):
        """``Strategy.run`` whose replica function receives only its slice of every rank >= 1 tensor argument.

        Every tensor argument of rank >= 1 is taken as part of the global batch (all with the same leading size
        ``B``): an element of this strategy's distributed datasets, a plain tensor, or a per-replica value holding
        the global batch once per local replica. The split of the step is decided here, in cross-replica context
        (agreed by the cluster with auto_balance), and each component is cut where it lives (the worker's CPU for
        a dataset's element) into this worker's replicas' slices; replica ``i``'s function receives ``[b_i, ...]``.
        Scalars and variables pass unchanged. Inside ``fn``, :func:`hetero_cs.current_global_batch_size` is ``B``
        and :func:`hetero_cs.replica_weight` is ``b_i / B``.

        Raises:
            InputError: A ``tf.SparseTensor`` argument, or a per-replica argument whose number of components is
                neither 1 nor the worker's local replicas.
            ConfigError: Emulated devices in a custom loop before ``strategy.prepare_emulation(model)``.
        """
        custom_loop = not _compat.in_keras_entry_point()
        if custom_loop and self._emulator is not None and self._emulator.workload is None and \
                any(held is not None and held is not _UNBATCHED
                    for held in map(self._global_batch, tf.nest.flatten((args, kwargs)))):
            raise ConfigError(
                "Emulated devices need the model's size before the first step of a custom loop: call "
                "strategy.prepare_emulation(model) once, with the built model, before the first strategy.run "
                "(model.fit, evaluate and predict do it for you).")
        args, kwargs, step = self._cut_inputs(args, kwargs or {})
        if custom_loop and step is not None:  # a batch was cut: caps given for fit do not apply here (said once)
            self._micro_slices.note_custom_loop()
        wrapped = (_compat.clone_function(fn, self._wrap_replica_fn(fn.python_function, step))
                   if _compat.is_tf_function(fn) else self._wrap_replica_fn(fn, step))
        return super().run(wrapped, args=args, kwargs=kwargs, options=options)

    def _cut_inputs(self, args, kwargs):
        """``(args, kwargs, step)``: every global-batch leaf replaced by a per-replica value of this worker's
        replicas' slices, cut by the split this step decides now; ``step`` is ``(sizes, B, start_stamp, row leaves)``
        (int32 ``[R]``, int32 scalar, float64 scalar or None, the indices of the flattened arguments cut), or None when no argument holds a batch."""
        flat = tf.nest.flatten((args, kwargs))
        batches = {}  # leaf index -> the global batch once (a tensor), or once per local replica (a tuple)
        for i, leaf in enumerate(flat):
            held = self._global_batch(leaf)
            if held is _UNBATCHED:  # a scalar or "no data" held once: every replica receives it as it is
                flat[i] = _compat.components(leaf)[0]
            elif held is not None:
                batches[i] = held
        if not batches:
            return (*tf.nest.pack_sequence_as((args, kwargs), flat), None)
        first = next(iter(batches.values()))
        host = self._input_host
        with tf.device(host):
            global_batch_size = tensors.leading_dim(first[0] if isinstance(first, tuple) else first)
        sizes = self._step_sizes(global_batch_size)  # decided before any replica starts
        with tf.device(host):
            start = None
            if self._timing:
                from hetero_cs.devices.step_clock import tie_to_stamp, wall_clock_stamp

                start = wall_clock_stamp(sizes)  # the split is known: this worker's replicas' step starts
                sizes = tie_to_stamp(sizes, start)  # and their slices are cut after the stamp (never before it)
            ends = tf.cumsum(sizes)
            starts = ends - sizes
        for i, held in batches.items():
            slices = []
            for k, replica in enumerate(range(self._first_replica, self._first_replica + self._num_local)):
                component = held[k] if isinstance(held, tuple) else held
                # Where it lives: the host for a dataset's element, and for a tensor whose device is not known (a
                # symbolic tensor not yet placed) or a ragged one.
                with tf.device((getattr(component, "device", "") if isinstance(component, tf.Tensor) else "") or host):
                    slices.append(component[starts[replica]:ends[replica]])
            flat[i] = _compat.per_replica(slices)
        return (*tf.nest.pack_sequence_as((args, kwargs), flat), (sizes, global_batch_size, start, frozenset(batches)))

    def _global_batch(self, leaf):
        """What a ``run`` argument leaf holds: the global batch once (a tensor), once per local replica (a tuple of
        them), ``_UNBATCHED`` for a single-component per-replica value that is no batch, or None (passes as is)."""
        if isinstance(leaf, tf.Variable):
            return None
        parts = _compat.components(leaf)
        if parts is None:  # a plain value
            return leaf if _is_batched(leaf) else None
        if not parts or isinstance(parts[0], tf.Variable):
            return None
        if len(parts) == 1:  # an element of our distributed datasets: the global batch, once, on the host
            return parts[0] if _is_batched(parts[0]) else _UNBATCHED
        if len(parts) != self._num_local:
            raise InputError(
                f"strategy.run got a per-replica argument of {len(parts)} components; this worker runs "
                f"{self._num_local} replicas. Pass global batches: an element of this strategy's distributed "
                f"dataset, a tensor, or a per-replica value with the global batch once per local replica.")
        return tuple(parts) if _is_batched(parts[0]) else None

    def _wrap_replica_fn(self, fn, step=None):
        """``fn`` run under its :class:`~hetero_cs.engine.step.replica_state.ReplicaStep` (b_i, B, the step's start stamp);
        ``step`` comes from :meth:`_cut_inputs` (None: no batch, ``fn`` runs as it is)."""
        if step is None:
            return fn
        sizes, global_batch_size, start, row_leaves = step
        entry_point = _compat.keras_entry_point()  # this thread's; the replica functions run in threads of their own

        def replica_fn(*call_args, **call_kwargs):
            from hetero_cs.engine._compat.batch_flow import BatchFlow, seed_replica_step

            replica_id = _compat.replica_id_in_sync_group(tf.distribute.get_replica_context())
            replica_step = replica_state.ReplicaStep(
                replica_id=replica_id, device=self.extended.worker_devices[replica_id - self._first_replica],
                batch_size=sizes[replica_id], global_batch_size=global_batch_size, start_stamp=start,
                flow=BatchFlow(replica_id))
            seed_replica_step(replica_step, [v for i, v in enumerate(tf.nest.flatten((call_args, call_kwargs)))
                                             if i in row_leaves])
            with replica_state.replica_step(replica_step):
                outputs = fn(*call_args, **call_kwargs)
                if entry_point is None:
                    return outputs  # a custom loop's: the user reduces them
                from hetero_cs.engine._compat.loss_reader import check_predictions, shares_of_logs

                return (check_predictions(replica_step, outputs) if entry_point == "predict"
                        else shares_of_logs(replica_step, outputs, keep_replicated=True))

        return replica_fn


_UNBATCHED = object()  # _global_batch's answer for a per-replica value of one component that holds no batch


def _is_batched(value) -> bool:
    if isinstance(value, tf.SparseTensor):
        raise InputError(
            "HeteroMultiWorkerMirroredStrategy cuts every batch component along its first axis, which a "
            "tf.SparseTensor does not support here. Convert it with tf.sparse.to_dense in the dataset.")
    return not is_unbatched_marker(value) and (
        isinstance(value, tf.RaggedTensor) or (tf.is_tensor(value) and value.shape.rank != 0))
