"""Private touches of tf.distribute: the extended object, the host-side input iterator, per-replica values.

Part of :mod:`hetero_cs.engine._compat`, the one place of private TensorFlow/Keras touches.
"""

import functools
import logging
import threading
import weakref
from typing import Any

import tensorflow as tf

# Private: the extended class behind CentralStorageStrategy. Subclassing it is the only way to change how variables
# are created and how replica functions are called without rewriting the strategy. input_lib's distributed dataset
# is subclassed for the same reason (see _HostDistributedDataset).
from tensorflow.python.distribute import input_lib, parameter_server_strategy  # noqa: E402

from hetero_cs.engine.step import idle_replicas
from hetero_cs.engine.step import replica_state
from hetero_cs.engine._compat import hooks
from hetero_cs.engine._compat.context import components, per_replica, set_locally
from hetero_cs.engine.step.step_errors import CROSS_REPLICA_SCOPE


logger = logging.getLogger(__name__)

class DeepcopiedStrategy:
    """Mixin for our strategies: ``copy.deepcopy`` copies as stock ``tf.distribute.Strategy.__deepcopy__`` does.

    Stock deep-copies every attribute (the ``extended`` object with its devices included) and points the copy's
    ``extended`` back at the copy. Ours hold locks (the strategy's, the Balancer's, the emulator's ...), which
    ``copy.deepcopy`` cannot copy: each gets a new lock (:mod:`hetero_cs._copying`). A dataset the strategy
    keeps (the one fit last iterated) is shared, not copied: a ``tf.data.Dataset`` is an immutable description
    that cannot be deep-copied. The extended object's cache of lifted ``tf.function`` clones is not copied (they
    call the original's extended object); the copy builds its own on first use.
    """

    def __deepcopy__(self, memo: dict) -> Any:
        from hetero_cs._copying import deepcopy_attributes

        memo[id(self)] = result = type(self).__new__(type(self))
        # See HeteroExtended._lifted_tf_function and HeteroExtended._call_active: each starts afresh in the copy.
        fresh_state = {"_hetero_lifted_functions": weakref.WeakKeyDictionary, "_hetero_active": threading.local}
        memo.update({id(held): fresh() for name, fresh in fresh_state.items()
                     if (held := self._extended.__dict__.get(name)) is not None})
        memo.update({id(value): value for value in vars(self).values() if isinstance(value, tf.data.Dataset)})
        deepcopy_attributes(self, result, memo)
        # Private: the back-reference stock's __deepcopy__ fixes up the same way (distribute_lib.Strategy).
        result._extended._container_strategy_weakref = weakref.ref(result)  # noqa: SLF001
        return result


class ReplicaCount(int):
    """``strategy.num_replicas_in_sync`` of our strategies: an ``int`` that, converted to a float tensor inside a
    replica step, is ``B / b_i`` for that replica, marked for the loss reader: ``loss / strategy.num_replicas_in_sync``
    (the stock idiom for an even split, whose replicas' values add up to one device's ``loss / 1``) is then this
    replica's exact share on any split, in value and gradient (:mod:`hetero_cs.engine._compat.loss_reader`)."""


class ReplicaCountStrategy:
    """Mixin of our strategies: ``num_replicas_in_sync`` is a :class:`ReplicaCount`."""

    @property
    def num_replicas_in_sync(self) -> int:
        # Private: the count tf.distribute.Strategy.num_replicas_in_sync itself returns. A replica that holds the
        # whole global batch (ReplicaStep.whole_batch) runs as one device's step: one replica in sync.
        whole = getattr(replica_state.current_replica_step(), "whole_batch", False)
        return ReplicaCount(1 if whole else self._extended._num_replicas_in_sync)  # noqa: SLF001


def register_replica_count_conversion() -> None:
    """Converts a :class:`ReplicaCount` to a constant tensor, marked in the replica step that converts it."""

    def convert(value, dtype=None, name=None, as_ref=False):
        del as_ref
        step = replica_state.current_replica_step()
        if step is None or step.global_batch_size is None or tf.executing_eagerly() or dtype is None or \
                not tf.as_dtype(dtype).is_floating:
            return tf.constant(int(value), dtype=dtype, name=name)
        # In a replica step, as a float: B / b_i, so that x / num_replicas_in_sync is this replica's share of one
        # device's x / 1 in value too (an idle replica's: 0), and the loss reader reads the division as that.
        tensor = tf.math.divide_no_nan(tf.cast(step.global_batch_size, dtype), tf.cast(step.batch_size, dtype))
        step.replica_counts.add(tensor.ref())
        return tensor

    # Private: the registry's internal entry point; the public one refuses subclasses of Python numbers (whose own
    # conversion runs at priority 0, so this one at -1 runs first), and the
    # protocol method __tf_tensor__ is not given the dtype an arithmetic op asks for (loss / R would be int32).
    from tensorflow.python.framework import tensor_conversion_registry

    tensor_conversion_registry.register_tensor_conversion_function_internal(ReplicaCount, convert, priority=-1)


class HeteroExtended(parameter_server_strategy.ParameterServerStrategyExtended):
    """CentralStorageStrategy's extended object with two changes.

    1. Non-trainable variables created with aggregation NONE (Keras' BatchNormalization moving statistics,
       Dropout/GaussianNoise seed state, and any layer state written in a step) get an aggregation, because
       stock CentralStorageStrategy raises "You must specify an aggregation method to update a
       AggregatingVariable in Replica Context" on their first update with more than one replica. Integer state
       (seed counters) gets ONLY_FIRST_REPLICA (MEAN would break integer state); floating-point state gets MEAN.
    2. Every replica function is wrapped by the container strategy (per-replica slice sizes, timing), and a
       global batch among its arguments (see :func:`distribute_on_host`) is cut into the replicas' slices.
    3. A step runs only the replicas its cut gives examples: one branch per set of active replicas that plans use,
       picked when the step starts, or a step traced for one set (``idle_replicas.StepPerSet``, model.fit's
       train step) (:mod:`hetero_cs.engine.step.idle_replicas`); ``worker_devices``,
       ``_get_replica_id_in_sync_group`` and the reductions answer for the active replicas while such a call runs.
    """

    def _create_variable(self, next_creator, **kwargs):
        if not kwargs.get("trainable", True) and kwargs.get("aggregation") in (None, tf.VariableAggregation.NONE):
            dtype = kwargs.get("dtype")
            initial_value = kwargs.get("initial_value")
            if dtype is None and initial_value is not None and not callable(initial_value):
                dtype = getattr(initial_value, "dtype", None)
            is_float = dtype is None or tf.as_dtype(dtype).is_floating
            kwargs["aggregation"] = tf.VariableAggregation.MEAN if is_float else tf.VariableAggregation.ONLY_FIRST_REPLICA
        return super()._create_variable(next_creator, **kwargs)

    def _call_for_each_replica(self, fn, args, kwargs):
        lifted = self._lifted_tf_function(fn)
        if lifted is not None:
            return lifted(*(args or ()), **(kwargs or {}))
        strategy = self._container_strategy()
        R = len(self._compute_devices)
        per_set = idle_replicas.set_of_traced_step()
        if per_set is not None and not tf.executing_eagerly():  # fit's step for one set: its sizes were served
            active, whole = per_set
            unpacked = strategy._unpack_inputs(args, kwargs, handed=True, whole=whole)  # noqa: SLF001
            args, kwargs, batch_leaves, timed, sizes = unpacked
            return self._call_active(fn, args, kwargs, batch_leaves, timed, None if sizes is None else active,
                                     whole=whole and sizes is not None)
        # In a graph: one branch per set of active replicas that plans use, picked when the step starts
        # (hetero_cs.engine.step.idle_replicas); branch 0 runs every replica. Eagerly the sizes are known.
        sets, supersets = None, strategy._input_roles.keras_loop_now  # noqa: SLF001
        if not tf.executing_eagerly() and R > 1:
            training_step = not strategy._input_roles.inferring_now  # noqa: SLF001
            if not supersets:  # a custom loop: traced once, before any of its plans is served
                static = strategy._static_batch_size(args, kwargs)  # noqa: SLF001 - None: any size
                supersets = idle_replicas.anticipate_custom_loop(strategy, training=training_step, batch_size=static)
            sets = strategy._active_sets.for_trace(training=training_step)  # noqa: SLF001
        # In Keras' own loops, which trace their step again when a new set appears, a plan whose set has no branch
        # here runs as a traced superset for that one step (idle_replicas.served_sizes); in a custom loop under
        # fixed shares or the even split too, in every step (its zeros come from rounding). A custom loop's step
        # under auto-balance runs its idle replicas on 0-example slices in branch 0 (exact), rather than give an
        # example to a card the plan left out, maybe one far slower.
        traced = sets if sets is not None and supersets else None
        args, kwargs, batch_leaves, timed, sizes = strategy._unpack_inputs(args, kwargs, traced=traced)  # noqa: SLF001
        if sizes is None or R == 1:
            return self._call_active(fn, args, kwargs, batch_leaves, timed, None)
        from hetero_cs.engine.step.sub_steps import current_sub_step

        sub_step = current_sub_step()
        if sub_step is not None:  # an overlapped call's sub-step: its active replicas are known while it is traced
            return self._call_active(fn, args, kwargs, batch_leaves, timed, sub_step.active)
        if tf.executing_eagerly():  # the sizes are known: run the active replicas only
            active = tuple(i for i, b in enumerate(sizes.numpy()) if b > 0)
            return self._call_active(fn, args, kwargs, batch_leaves, timed, None if len(active) == R else active,
                                     sizes=sizes.numpy())
        if not sets:
            return self._call_active(fn, args, kwargs, batch_leaves, timed, None)
        template = {}

        def branch(active):
            def call():
                result = self._call_active(fn, args, kwargs, batch_leaves, timed, active)
                if active is None:
                    template["structure"] = result
                else:
                    tf.nest.assert_same_structure(template["structure"], result, expand_composites=True)
                flat = tf.nest.flatten(result, expand_composites=True)
                template.setdefault("static", [not isinstance(v, (tf.Tensor, tf.Operation)) for v in flat])
                return [v for v in flat if isinstance(v, tf.Tensor)]
            return call

        index = idle_replicas.branch_index(sizes, sets, R)
        outputs = tf.switch_case(index, [branch(None)] + [branch(s) for s in sets], name="hetero_cs_active_replicas")
        structure = template["structure"]
        flat = tf.nest.flatten(structure, expand_composites=True)
        tensors = iter(outputs if isinstance(outputs, (list, tuple)) else [outputs])
        merged = [v if static else next(tensors) for v, static in zip(flat, template["static"])]
        return tf.nest.pack_sequence_as(structure, merged, expand_composites=True)

    def _call_active(self, fn, args, kwargs, batch_leaves, timed, active, sizes=None, whole=False):
        """One ``strategy.run`` call over the replicas in ``active`` (None: all of them); ``whole``: its one
        replica holds the whole global batch (``batch_leaves``) and runs as one device's step."""
        strategy = self._container_strategy()
        # One handoff per call: its replica threads and this thread, which runs its merges, share it (and no
        # other call does: another model may trace its step in another thread at the same time). The patched
        # Keras hooks of this call record into its StepHooks; once traced, every hook the step needed must have run
        # (hooks.verify), else Keras changed under us: UnsupportedVersionError.
        handoff = replica_state.StepHandoff(hooks=hooks.StepHooks())
        wrapped = strategy._wrap_replica_fn(fn, args, kwargs, batch_leaves, timed, handoff=handoff,  # noqa: SLF001
                                            scope_replica=active is not None, whole=whole)
        R = len(self._compute_devices)
        with replica_state.step_handoff(handoff):
            if active is None:
                result = super()._call_for_each_replica(wrapped, args, kwargs)
            else:
                idle = [i for i in range(R) if i not in active]
                if idle_replicas.set_of_traced_step() is not None:  # fit's step per set (its counters: StepPerSet)
                    handoff.idle_reports = tuple(idle)
                else:
                    idle_replicas.report_idle_replicas(
                        idle, handoff.start_stamp, record=strategy._record_step_time  # noqa: SLF001
                        if handoff.start_stamp is not None else None, emulator=strategy._emulator,  # noqa: SLF001
                        host=strategy._parameter_device)  # noqa: SLF001
                sub = functools.partial(idle_replicas.subset_per_replica, active=active, num_replicas=R,
                                        components=components, per_replica=per_replica)
                # Within: this thread's call_for_each_replica starts threads for the active replicas only. Private:
                # mirrored_run's _call_for_each_replica starts one thread per device of worker_devices (read once, in
                # this thread, when the call starts) and asks _get_replica_id_in_sync_group(index) for each thread's
                # replica id; both are answered from this thread's active set, so the threads run on the active
                # replicas' devices with their own replica ids. Merges run in this thread too: while the call lasts,
                # a per-replica value here has one component per active replica, which must not be taken for a
                # packed global batch (PackedBatchValues).
                with set_locally(self._hetero_active_state(), active=tuple(active)):
                    result = super()._call_for_each_replica(wrapped, sub(args), sub(kwargs or {}))
                result = idle_replicas.expand_outputs(
                    result, active, R, keras_step=strategy._input_roles.keras_loop_now,  # noqa: SLF001
                    host=strategy._parameter_device, components=components, per_replica=per_replica,  # noqa: SLF001
                    sizes=sizes)
        if not tf.executing_eagerly():
            hooks.verify(handoff.hooks)
        return result

    def _hetero_active_state(self):
        return self.__dict__.setdefault("_hetero_active", threading.local())

    def active_replicas_now(self):
        """The replica ids of the ``strategy.run`` call this thread is running over a subset, or None."""
        return getattr(self._hetero_active_state(), "active", None)

    def _as_distributed(self, value):
        # With one active replica, mirrored_run hands merges that replica's value as it is (regroup of one value),
        # and stock reduces refuse a SUM of a value that is not per-replica while num_replicas_in_sync > 1. It is
        # the one active replica's value: a per-replica value of one component.
        active = self.active_replicas_now()
        if active is not None and len(active) == 1 and isinstance(value, (tf.Tensor, tf.IndexedSlices)):
            return per_replica((value,))
        return value

    # The reductions run in the merge call, under the name scope of the first replica's thread: replica 0's ops
    # carry no replica prefix either, so an error in a reduction (the replicas' values disagree in shape, say) would
    # be blamed on replica 0. Their ops sit under CROSS_REPLICA_SCOPE, which the step's error reads
    # (hetero_cs.engine.step.step_errors).
    def _reduce_to(self, reduce_op, value, destinations, options):
        with tf.name_scope(CROSS_REPLICA_SCOPE):
            return super()._reduce_to(reduce_op, self._as_distributed(value), destinations, options)

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        pairs = [(self._as_distributed(value), destinations) for value, destinations in value_destination_pairs]
        with tf.name_scope(CROSS_REPLICA_SCOPE):
            return super()._batch_reduce_to(reduce_op, pairs, options)

    @property
    def worker_devices(self):
        active = self.active_replicas_now()
        return self._compute_devices if active is None else tuple(self._compute_devices[i] for i in active)

    def _get_replica_id_in_sync_group(self, replica_id):
        active = self.active_replicas_now()
        return replica_id if active is None else active[replica_id]

    def _lifted_tf_function(self, fn):
        """For a ``tf.function`` passed to ``strategy.run``: a clone of it that runs the whole per-replica call.

        tf.distribute's ``call_for_each_replica`` (mirrored_run.py) does this for a ``tf.function``: it lifts one
        ``tf.function`` around all replicas' calls, so that sync points inside (the optimizer's gradient
        all-reduce, ``replica_context.all_reduce``) are merge calls of one graph. Our replica wrapper (slice
        sizes, timing) replaces ``fn`` by a plain closure, which would lose that: each replica thread would then
        trace its own nested function and fail with "merge_call called while defining a new graph or a
        tf.function". So the lifting happens here first, with the same cache per function.
        """
        if not is_tf_function(fn):
            return None
        cache = self.__dict__.setdefault("_hetero_lifted_functions", weakref.WeakKeyDictionary())
        lifted = cache.get(fn)
        if lifted is None:
            python_function = fn.python_function
            extended = weakref.proxy(self)

            def call_every_replica(*args, **kwargs):
                return extended._call_for_each_replica(python_function, args, kwargs)  # noqa: SLF001

            lifted = clone_function(fn, call_every_replica)
            if fn._jit_compile:  # noqa: SLF001
                # A replica function compiled with XLA as a whole (a custom loop's tf.function(jit_compile=True))
                # would read the variables on the parameter device, which XLA cannot, and its optimizer all-reduces
                # in a merge call, which XLA cannot hold (mirrored_run keeps such a function per replica only on
                # GPUs, with mirrored variables). The clone runs without XLA, with a warning (Keras' fit compiles
                # each replica's forward and backward pass: hetero_cs.engine._compat.replica_xla). Private: _jit_compile
                # is the option _clone copies.
                lifted._jit_compile = None  # noqa: SLF001
                _note_uncompiled()
            cache[fn] = lifted
        return lifted

    @property
    def input_device(self) -> str:
        """The host device that runs the input pipeline and cuts each global batch."""
        # Private: _worker_device is where CentralStorageStrategy itself places its input iterators (this host's
        # CPU); there is no public name for it.
        return self._worker_device


@functools.cache
def _note_uncompiled() -> None:
    """Warns once that a custom loop's ``tf.function(jit_compile=True)`` replica function runs without XLA."""
    logger.warning(
        "hetero_cs: strategy.run of a tf.function(jit_compile=True) runs its replica function without XLA under "
        "HeteroCentralStorageStrategy: XLA cannot read the variables on the parameter device, nor hold the "
        "optimizer's all-reduce. model.fit with compile(jit_compile=True) compiles each replica's forward and "
        "backward pass; the optimizer's update is compiled already (fused_update).")



def is_tf_function(fn) -> bool:
    """Whether ``fn`` is a ``tf.function``."""
    from tensorflow.python.eager import def_function  # Private: tf.function's class, as mirrored_run checks it.

    return isinstance(fn, def_function.Function)


def clone_function(fn, python_function):
    """A clone of the ``tf.function`` ``fn`` running ``python_function``, with fn's options (input_signature,
    reduce_retracing, jit_compile, ...).

    tf.distribute's mirrored_run lifts one ``tf.function`` around every replica's call when ``strategy.run`` gets a
    ``tf.function``; the strategy wraps the replica function (slices, weights, timing), and a plain closure would
    lose that lifting (each replica thread would then fail with "merge_call called while defining a new graph").
    """
    # Private: tf.function's _clone(python_function=...), exactly as mirrored_run uses it.
    return fn._clone(python_function=python_function)  # noqa: SLF001


class _HostDistributedDataset(input_lib.DistributedDatasetsFromFunction):
    """tf.distribute's distributed dataset, whose new iterators can start where a read-ahead iterator did.

    Calibration reads the first global batch through the same pipeline before training (see
    :mod:`hetero_cs.engine._compat.input_state`); the next iterator over the same source dataset is restored from
    the state saved before that read, so training sees the data order single-device training sees.
    """

    def __init__(self, *args, source=None, first_batches=None, **kwargs):
        super().__init__(*args, **kwargs)
        # The element spec of the user's dataset (one global batch, before it was packed), or None.
        self.source_element_spec = None if source is None else source.element_spec
        self._hetero_source = None if source is None else weakref.ref(source)
        self._hetero_first_batches = first_batches

    def plain_iterator(self):
        """A new iterator as tf.distribute makes it (no pending state applied)."""
        return super().__iter__()

    def __iter__(self):
        iterator = super().__iter__()
        if self._hetero_first_batches is not None:  # (restore_next ignores an unknown source)
            self._hetero_first_batches.restore_next(self.source_dataset, iterator)
        return iterator

    @property
    def source_dataset(self):
        """The user's dataset this one packs (None when it is gone or unknown)."""
        return self._hetero_source() if self._hetero_source is not None else None


def distribute_on_host(strategy, dataset, *, source=None, host=None):
    """A distributed dataset whose every element goes whole to the host, as one value (not one per replica).

    ``dataset`` yields checked global batches (hetero_cs.engine.step.input_slicing); the strategy cuts each into the
    replicas' slices when the step starts. Every leaf of an element arrives as a per-replica value with a single
    component, which is how the strategy recognises a global batch (any other per-replica value has one per replica).
    ``source`` is the user's dataset that ``dataset`` checks: an iterator over it started by calibration's read
    (``strategy._first_batches``) is continued from there. ``host`` is the device that iterates it (default:
    ``strategy.extended.input_device``, the central-storage strategy's; the multi-worker strategy gives its worker's
    CPU).
    """
    # Private: tf.distribute builds its distributed datasets from InputWorkers (input device -> fed devices) and
    # input_util; the public experimental_distribute_dataset would feed R devices with R elements. Here one input
    # device (the host) is fed one element per global batch. The options ask for a plain tf.data iterator on the
    # host (PER_REPLICA without fetching to a device) instead of a MultiDeviceIterator, whose per-device prefetch
    # thread has nothing to move here (the pipeline ends in its own prefetch). Together this makes the input path
    # cheaper than stock CentralStorageStrategy's rebatch (benchmarks/overhead.py).
    from tensorflow.python.distribute import values as values_lib

    host = strategy.extended.input_device if host is None else host
    workers = input_lib.InputWorkers([(host, (host,))])
    options = tf.distribute.InputOptions(
        experimental_fetch_to_device=False,
        experimental_replication_mode=tf.distribute.InputReplicationMode.PER_REPLICA,
    )
    context = tf.distribute.InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=1)
    # input_util.get_distributed_datasets_from_function builds the same object (TF2), after checking options that
    # are fixed here.
    distributed = _HostDistributedDataset(
        workers, strategy, input_contexts=[context], dataset_fn=lambda _: dataset, options=options,
        source=source, first_batches=getattr(strategy, "_first_batches", None),
    )
    if strategy.num_replicas_in_sync > 1:
        # Private: the distributed dataset describes an element as one component per compute device (its spec is
        # built from strategy.extended.worker_devices), but ours have one component. Iterators copy this spec, and
        # loops over iterator.get_next_as_optional() (Keras' steps_per_execution > 1) need the true one. The
        # batch dimension is left open, as tf.distribute does where partial batches are handled.
        def one_component(spec):
            try:
                spec = spec._unbatch()._batch(None)  # noqa: SLF001 - TypeSpec batching, as input_lib does
            except (ValueError, AttributeError, NotImplementedError):
                pass  # not batchable (e.g. an Optional): as it is
            return values_lib.PerReplicaSpec(spec)

        distributed._element_spec = tf.nest.map_structure(one_component, dataset.element_spec)  # noqa: SLF001
    return distributed


