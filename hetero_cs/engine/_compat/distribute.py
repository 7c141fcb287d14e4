"""Private touches of tf.distribute: the extended object, the host-side input iterator, per-replica values.

Part of :mod:`hetero_cs.engine._compat`, the one place of private TensorFlow/Keras touches.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import tensorflow as tf

# Private: the extended class behind CentralStorageStrategy. Subclassing it is the only way to change how variables
# are created and how replica functions are called without rewriting the strategy. input_lib's distributed dataset
# is subclassed for the same reason (see _HostDistributedDataset).
from tensorflow.python.distribute import input_lib, parameter_server_strategy  # noqa: E402

from hetero_cs.engine import training
from hetero_cs.engine._compat import hooks
from hetero_cs.engine._compat.multi_worker import is_multi_worker_strategy


logger = logging.getLogger(__name__)

STRATEGY_MARKER = "_is_hetero_central_storage_strategy"


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

        cls = type(self)
        result = cls.__new__(cls)
        memo[id(self)] = result
        lifted = self._extended.__dict__.get("_hetero_lifted_functions")  # see HeteroExtended.lifted_function
        if lifted is not None:
            memo[id(lifted)] = weakref.WeakKeyDictionary()
        for value in vars(self).values():
            if isinstance(value, tf.data.Dataset):
                memo[id(value)] = value
        deepcopy_attributes(self, result, memo)
        # Private: the back-reference stock's __deepcopy__ fixes up the same way (distribute_lib.Strategy).
        result._extended._container_strategy_weakref = weakref.ref(result)  # noqa: SLF001
        return result


def is_hetero_strategy(strategy: Any) -> bool:
    """True when ``strategy`` is a HeteroCentralStorageStrategy (checked by marker to avoid an import cycle)."""
    return bool(getattr(strategy, STRATEGY_MARKER, False))


def current_weighting_strategy():
    """The current strategy if it is one of ours (central storage or multi-worker) running a replica step in this
    thread, else None: the b_i / B loss weighting applies under both."""
    if training.current_replica_step() is None:
        return None
    strategy = tf.distribute.get_strategy()
    if is_hetero_strategy(strategy) or is_multi_worker_strategy(strategy):
        return strategy
    return None


def current_hetero_strategy():
    """Returns the current strategy if it is ours and a replica step is running in this thread, else None."""
    if training.current_replica_step() is None:
        return None
    strategy = tf.distribute.get_strategy()
    return strategy if is_hetero_strategy(strategy) else None


def replica_id_in_sync_group(replica_context) -> int:
    # Private attribute: the public `replica_id_in_sync_group` is a tensor; the Python int is needed to pick the
    # replica's device, emulated profile and monitor slot while tracing. Under CentralStorageStrategy it is an int.
    return int(replica_context._replica_id_in_sync_group)  # noqa: SLF001


class HeteroExtended(parameter_server_strategy.ParameterServerStrategyExtended):
    """CentralStorageStrategy's extended object with two changes.

    1. Non-trainable variables created with aggregation NONE (Keras' BatchNormalization moving statistics,
       Dropout/GaussianNoise seed state, and any layer state written in a step) get an aggregation, because
       stock CentralStorageStrategy raises "You must specify an aggregation method to update a
       AggregatingVariable in Replica Context" on their first update with more than one replica. Integer state
       (seed counters) gets ONLY_FIRST_REPLICA (MEAN would break integer state); floating-point state gets MEAN.
    2. Every replica function is wrapped by the container strategy (per-replica slice sizes, timing), and a
       global batch among its arguments (see :func:`distribute_on_host`) is cut into the replicas' slices.
    """

    def _create_variable(self, next_creator, **kwargs):
        aggregation = kwargs.get("aggregation")
        trainable = kwargs.get("trainable", True)
        if not trainable and aggregation in (None, tf.VariableAggregation.NONE):
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
        args, kwargs, batch_leaves, timed = strategy._unpack_inputs(args, kwargs)  # noqa: SLF001
        # One handoff per call: its replica threads and this thread, which runs its merges, share it (and no
        # other call does: another model may trace its step in another thread at the same time). The patched
        # Keras hooks of this call record into its StepHooks; once traced, every hook the step needed must have run
        # (hooks.verify), else Keras changed under us: UnsupportedVersionError.
        handoff = training.StepHandoff(hooks=hooks.StepHooks())
        wrapped = strategy._wrap_replica_fn(fn, args, kwargs, batch_leaves, timed, handoff=handoff)  # noqa: SLF001
        with training.step_handoff(handoff):
            result = super()._call_for_each_replica(wrapped, args, kwargs)
        if not tf.executing_eagerly():
            hooks.verify(handoff.hooks)
        return result

    def _lifted_tf_function(self, fn):
        """For a ``tf.function`` passed to ``strategy.run``: a clone of it that runs the whole per-replica call.

        tf.distribute's ``call_for_each_replica`` (mirrored_run.py) does this for a ``tf.function``: it lifts one
        ``tf.function`` around all replicas' calls, so that sync points inside (the optimizer's gradient
        all-reduce, ``replica_context.all_reduce``) are merge calls of one graph. Our replica wrapper (slice
        sizes, timing) replaces ``fn`` by a plain closure, which would lose that: each replica thread would then
        trace its own nested function and fail with "merge_call called while defining a new graph or a
        tf.function". So the lifting happens here first, with the same rule and the same cache per function.
        """
        # Private: tf.function's class and its _clone(python_function=...), exactly as mirrored_run uses them (a
        # clone keeps the user's tf.function options: input_signature, reduce_retracing, jit_compile, ...).
        from tensorflow.python.eager import def_function

        if not isinstance(fn, def_function.Function):
            return None
        if fn._jit_compile and all(  # noqa: SLF001 - mirrored_run's rule: XLA on GPUs only keeps fn as is
            tf.DeviceSpec.from_string(d).device_type == "GPU" for d in self.worker_devices
        ):
            return None
        cache = self.__dict__.setdefault("_hetero_lifted_functions", weakref.WeakKeyDictionary())
        lifted = cache.get(fn)
        if lifted is None:
            python_function = fn.python_function
            extended = weakref.proxy(self)

            def call_every_replica(*args, **kwargs):
                return extended._call_for_each_replica(python_function, args, kwargs)  # noqa: SLF001

            lifted = fn._clone(python_function=call_every_replica)  # noqa: SLF001
            cache[fn] = lifted
        return lifted

    @property
    def input_device(self) -> str:
        """The host device that runs the input pipeline and cuts each global batch."""
        # Private: _worker_device is where CentralStorageStrategy itself places its input iterators (this host's
        # CPU); there is no public name for it.
        return self._worker_device


class _HostDistributedDataset(input_lib.DistributedDatasetsFromFunction):
    """tf.distribute's distributed dataset, whose new iterators can start where a read-ahead iterator did.

    Calibration reads the first global batch through the same pipeline before training (see
    :mod:`hetero_cs.engine._compat.input_state`); the next iterator over the same source dataset is restored from
    the state saved before that read, so training sees the data order single-device training sees.
    """

    def __init__(self, *args, source=None, first_batches=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._hetero_source_spec = None if source is None else source.element_spec
        self._hetero_source = None if source is None else weakref.ref(source)
        self._hetero_first_batches = first_batches

    def plain_iterator(self):
        """A new iterator as tf.distribute makes it (no pending state applied)."""
        return super().__iter__()

    def __iter__(self):
        iterator = super().__iter__()
        source = self.source_dataset
        if self._hetero_first_batches is not None and source is not None:
            self._hetero_first_batches.restore_next(source, iterator)
        return iterator

    @property
    def source_dataset(self):
        """The user's dataset this one packs (None when it is gone or unknown)."""
        return self._hetero_source() if self._hetero_source is not None else None

    @property
    def source_element_spec(self):
        """The element spec of the user's dataset (one global batch, before it was packed), or None."""
        return self._hetero_source_spec


def distribute_on_host(strategy, dataset, *, source=None, host=None):
    """A distributed dataset whose every element goes whole to the host, as one value (not one per replica).

    ``dataset`` yields checked global batches (hetero_cs.engine.input_slicing); the strategy cuts each into the
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


def components(value) -> tuple | None:
    """The components of a per-replica value (one per replica, or one for a global batch's leaf), else None."""
    # Private: PerReplica._values holds the components; experimental_local_results is overridden by the strategy
    # to return the unpacked slices, so it cannot be used here.
    if not isinstance(value, tf.distribute.DistributedValues):
        return None
    return tuple(getattr(value, "_values", ()))


def per_replica(components) -> Any:
    """A per-replica value holding ``components`` (one per replica, in replica order)."""
    # Private: there is no public constructor of PerReplica; tf.distribute builds them the same way from iterators.
    from tensorflow.python.distribute import values as values_lib

    return values_lib.PerReplica(tuple(components))


# --------------------------------------------------------------------------------------------------------------
# Keras patches. Each one dispatches on our strategy and otherwise calls the original.
# --------------------------------------------------------------------------------------------------------------
