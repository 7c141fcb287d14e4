"""The one module that touches private TensorFlow and Keras internals.

Stock ``CentralStorageStrategy`` under Keras 3 is wrong or crashes in several places (see the README's "What
hetero_cs fixes"). Each fix below is reached only through objects that belong to a
:class:`~hetero_cs.HeteroCentralStorageStrategy`: a patched Keras function first checks that the current strategy
(or the variable's strategy) is one of ours and otherwise calls the original unchanged, so plain Keras and every
other strategy behave exactly as before. Patches are installed once, when the first strategy is constructed.

Every use of a private name is commented with why it is needed and what it relies on; the versions this was
checked against are TensorFlow 2.21 and Keras 3.15.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import types
from collections.abc import Callable
from typing import Any

import tensorflow as tf

# Private: the extended class behind CentralStorageStrategy. Subclassing it is the only way to change how variables
# are created and how replica functions are called without rewriting the strategy.
from tensorflow.python.distribute import parameter_server_strategy  # noqa: E402

from hetero_cs.engine import training

logger = logging.getLogger(__name__)

_install_lock = threading.Lock()
_installed = False

STRATEGY_MARKER = "_is_hetero_central_storage_strategy"


def is_hetero_strategy(strategy: Any) -> bool:
    """True when ``strategy`` is a HeteroCentralStorageStrategy (checked by marker to avoid an import cycle)."""
    return bool(getattr(strategy, STRATEGY_MARKER, False))


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
       packed global batch among its arguments (see :func:`distribute_on_host`) is cut into the replicas' slices.
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
        strategy = self._container_strategy()
        args, kwargs, batch_leaves = strategy._unpack_inputs(args, kwargs)  # noqa: SLF001
        wrapped = strategy._wrap_replica_fn(fn, args, kwargs, batch_leaves)  # noqa: SLF001
        return super()._call_for_each_replica(wrapped, args, kwargs)

    @property
    def input_device(self) -> str:
        """The host device that runs the input pipeline and cuts each global batch."""
        # Private: _worker_device is where CentralStorageStrategy itself places its input iterators (this host's
        # CPU); there is no public name for it.
        return self._worker_device


def distribute_on_host(strategy, dataset):
    """A distributed dataset whose every element goes whole to the host, as one value (not one per replica).

    ``dataset`` yields packed global batches (hetero_cs.engine.input_slicing); the strategy cuts each into the replicas'
    slices inside the step. Every leaf of an element arrives as a per-replica value with a single component,
    which is how the strategy recognises a packed batch (any other per-replica value has one per replica).
    """
    # Private: tf.distribute builds its distributed datasets from InputWorkers (input device -> fed devices) and
    # input_util; the public experimental_distribute_dataset would feed R devices with R elements. Here one input
    # device (the host) is fed one element per global batch. The options ask for a plain tf.data iterator on the
    # host (PER_REPLICA without fetching to a device) instead of a MultiDeviceIterator, whose per-device prefetch
    # thread has nothing to move here (the pipeline ends in its own prefetch). Together this makes the input path
    # cheaper than stock CentralStorageStrategy's rebatch (benchmarks/overhead.py).
    from tensorflow.python.distribute import input_lib, input_util
    from tensorflow.python.distribute import values as values_lib

    host = strategy.extended.input_device
    workers = input_lib.InputWorkers([(host, (host,))])
    options = tf.distribute.InputOptions(
        experimental_fetch_to_device=False,
        experimental_replication_mode=tf.distribute.InputReplicationMode.PER_REPLICA,
    )
    context = tf.distribute.InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=1)
    distributed = input_util.get_distributed_datasets_from_function(
        lambda _: dataset, workers, [context], strategy, options=options
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
    """The components of a per-replica value (one per replica, or one for a packed global batch leaf), else None."""
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


def _patch_loss_scaling() -> None:
    # keras.src.losses.loss.scale_loss_for_distribution multiplies every replica's mean loss by 1/num_replicas
    # (and unscale_loss_for_distribution undoes it for the logged loss). Both are looked up as module attributes at
    # call time (by Loss.__call__ via reduce_values, the TF trainer and compile_utils), so replacing the module
    # attributes reaches every caller. Under our strategy the factor is b_i / B instead.
    from keras.src.losses import loss as loss_module

    original_scale = loss_module.scale_loss_for_distribution
    original_unscale = loss_module.unscale_loss_for_distribution

    @functools.wraps(original_scale)
    def scale_loss_for_distribution(value):
        if current_hetero_strategy() is not None and training.current_replica_step().global_batch_size is not None:
            return value * training.replica_weight(value.dtype)
        return original_scale(value)

    @functools.wraps(original_unscale)
    def unscale_loss_for_distribution(value):
        if current_hetero_strategy() is not None and training.current_replica_step().global_batch_size is not None:
            # divide_no_nan: a 0-example replica logs 0 (with sample weight 0), never NaN.
            return tf.math.divide_no_nan(value, training.replica_weight(value.dtype))
        return original_unscale(value)

    loss_module.scale_loss_for_distribution = scale_loss_for_distribution
    loss_module.unscale_loss_for_distribution = unscale_loss_for_distribution


def _patch_variable_assign_add() -> None:
    # Keras' Variable.assign_add(v) is assign(self + v). On a SUM-aggregated central variable in replica context,
    # each replica's `old + d_i` is then summed: new = N*old + sum(d_i), so metrics and the logged loss drift from
    # step 2 on. tf.Variable's native assign_add aggregates the deltas instead: new = old + sum(d_i).
    from keras.src.backend.tensorflow import core

    def _route(original: Callable, native_name: str):
        @functools.wraps(original)
        def method(self, value):
            inner = _central_in_replica_context(self)
            if inner is not None:
                return getattr(inner, native_name)(_behind_barrier(value, inner.dtype))
            return original(self, value)

        return method

    core.Variable.assign_add = _route(core.Variable.assign_add, "assign_add")
    core.Variable.assign_sub = _route(core.Variable.assign_sub, "assign_sub")

    # Many Keras metrics (TruePositives, Precision, Recall, AUC, IoU, R2Score, ...) accumulate with
    # assign(self.var + delta) instead, the pattern Keras' Metric docstring shows. On a SUM-aggregated central
    # variable in replica context that gives N*old + sum(d_i). When the assigned value is visibly `var + delta` in
    # the graph, it becomes assign_add(delta): new = old + sum(d_i). Any other assign (setting the state to this
    # batch's statistic, or to 0) keeps the SUM semantics, sum_i v_i, which is right for additive statistics.
    # Eager values carry no graph: there the accumulate form is assumed (every built-in metric uses it).
    original_assign = core.Variable.assign

    @functools.wraps(original_assign)
    def assign(self, value):
        inner = _central_in_replica_context(self)
        aggregation = getattr(inner, "aggregation", None)
        if aggregation == tf.VariableAggregation.SUM and (tf.executing_eagerly() or _adds_to(value, inner)):
            delta = tf.cast(value, inner.dtype) - inner.read_value()
            return core.Variable.assign_add(self, delta)  # routed above: aggregated deltas, behind the barrier
        if aggregation == tf.VariableAggregation.NONE:
            # A trainable variable (aggregation NONE) assigned in replica context: Keras' optimizer applies weight
            # constraints (kernel_constraint=MaxNorm, ...) this way after the update, and every replica computes the
            # same value from the same central variable. Stock CentralStorageStrategy raises "You must specify an
            # aggregation method"; here replica 0's value is written once, behind the failure barrier.
            value = _behind_barrier(value, inner.dtype)
            return tf.distribute.get_replica_context().merge_call(_assign_first_replica, args=(inner, value))
        return original_assign(self, value)

    core.Variable.assign = assign


def _central_in_replica_context(variable):
    """The central variable behind Keras ``variable`` when it is one of our strategy's, written in replica context
    outside Keras' stateless scope (the case the patches above reroute); else None."""
    inner = getattr(variable, "_value", None)
    if (
        inner is not None
        and tf.distribute.in_cross_replica_context() is False
        and is_hetero_strategy(getattr(inner, "_distribute_strategy", None))
        and not _in_keras_stateless_scope()
    ):
        return inner
    return None


def _behind_barrier(value, dtype):
    """``value`` cast to ``dtype``, computed only once every replica's gradients exist (the failure barrier).

    Writes that need no other replica (the ONLY_FIRST_REPLICA iteration counter, a constraint written from replica
    0) would otherwise run as soon as their replica is done, even when another replica's part of the step fails.
    """
    value = tf.cast(value, dtype)
    step = training.current_replica_step()
    if step is not None and step.barrier:
        with tf.control_dependencies(step.barrier):
            value = tf.identity(value)
    return value


def _assign_first_replica(strategy, variable, value):
    """Cross-replica: writes replica 0's value to the central variable."""
    first = strategy.experimental_local_results(value)[0]
    return strategy.extended.update(variable, lambda var, v: var.assign(v), args=(first,), group=True)


def _in_keras_stateless_scope() -> bool:
    # Keras' stateless API (metric.stateless_update_state, ...) records assignments instead of applying them; the
    # Variable methods check this scope first, so the rerouting above must step aside in it.
    from keras.src.backend.common.stateless_scope import in_stateless_scope

    return in_stateless_scope()


def _adds_to(value, variable) -> bool:
    """True when graph tensor ``value`` is ``variable + something`` (through casts and identities)."""
    op = getattr(value, "op", None)
    if op is None:
        return False
    handles = {id(h) for h in _handles(variable)}

    def skip(o):
        while o.type in ("Identity", "Cast") and o.inputs:
            o = o.inputs[0].op
        return o

    op = skip(op)
    if op.type not in ("AddV2", "Add"):
        return False
    for operand in op.inputs:
        read = skip(operand.op)
        if read.type == "ReadVariableOp" and _captures_one_of(read.inputs[0], handles):
            return True
    return False


def _captures_one_of(tensor, handle_ids: set) -> bool:
    """True when ``tensor`` is one of the handles, or a function graph's capture of one (through nested graphs)."""
    for _ in range(16):  # nesting depth bound
        if tensor is None:
            return False
        if id(tensor) in handle_ids:
            return True
        # FuncGraph.captures: (outer tensor, placeholder inside the function) pairs.
        captures = getattr(tensor.graph, "captures", ())
        tensor = next((outer for outer, inner in captures if inner is tensor), None)
    return False


def _handles(variable) -> list:
    """The resource handles a read of ``variable`` may use in the current graph (its own, or its wrapped one's)."""
    found = []
    for candidate in (variable, getattr(variable, "_v", None)):  # _v: the variable an AggregatingVariable wraps
        handle = getattr(candidate, "handle", None)
        if handle is not None:
            found.append(handle)
    return found


def _patch_optimizer() -> None:
    # Keras' TF optimizer clips (clipnorm, global_clipnorm, clipvalue) each replica's gradient before the sum,
    # which is not the clipping of the full-batch gradient. Under our strategy clipping is skipped in replica
    # context and applied to the all-reduced (summed) gradient inside _all_reduce_sum_gradients, the last place
    # in replica context before the merge. The same place gives the strategy the moment a replica's gradients
    # are ready (per-replica timing and emulated device time).
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    original_clip = TFOptimizer._clip_gradients  # noqa: SLF001
    original_all_reduce = TFOptimizer._all_reduce_sum_gradients  # noqa: SLF001

    @functools.wraps(original_clip)
    def _clip_gradients(self, grads):
        if current_hetero_strategy() is not None and not getattr(_clip_state, "active", False):
            return grads
        return original_clip(self, grads)

    @functools.wraps(original_all_reduce)
    def _all_reduce_sum_gradients(self, grads_and_vars):
        strategy = current_hetero_strategy()
        if strategy is None or tf.distribute.get_replica_context() is None:
            return original_all_reduce(self, grads_and_vars)
        grads_and_vars = list(grads_and_vars)
        grads = strategy._on_replica_gradients([g for g, _ in grads_and_vars])  # noqa: SLF001
        grads_and_vars = list(zip(grads, [v for _, v in grads_and_vars]))
        # The barrier: a token on the parameter device that exists once every replica's gradients do. Writes
        # that need no other replica (the iteration counter) wait for it through a control edge, which moves no
        # data. Waiting on the summed gradients instead would make every replica fetch its own copy of the whole
        # summed gradient, which nothing else reads: 2-3 % of a 5 ms CPU step in benchmarks/overhead.py (step
        # only), and a host-to-device copy of the whole gradient per replica on GPUs.
        # The variable updates (cross-replica, in _distributed_tf_update_step) wait for it too: an update needs
        # only its own summed gradient, which may exist before another replica's backward pass fails.
        local = [g for g, _ in grads_and_vars if g is not None]
        if local:
            token = tf.distribute.get_replica_context().merge_call(_all_replicas_done, args=(local,))
            training.current_replica_step().barrier[:] = [token]
            _barrier_state.token = token
        reduced = original_all_reduce(self, grads_and_vars)
        _clip_state.active = True
        try:
            clipped = original_clip(self, [g for g, _ in reduced])
        finally:
            _clip_state.active = False
        return list(zip(clipped, [v for _, v in reduced]))

    original_update_step = TFOptimizer._distributed_tf_update_step  # noqa: SLF001
    original_decay = TFOptimizer._apply_weight_decay  # noqa: SLF001

    @functools.wraps(original_decay)
    def _apply_weight_decay(self, variables):
        # Decoupled weight decay (AdamW, or any optimizer given weight_decay) is applied before the gradients are
        # summed, so it would run even when a replica's step fails. Under our strategy it is deferred to the update
        # merge below, where it runs first (the same order as in one device's step), behind the barrier.
        if self.weight_decay is not None and current_hetero_strategy() is not None:
            _barrier_state.decay = (self, list(variables))
            return None
        return original_decay(self, variables)

    @functools.wraps(original_update_step)
    def _distributed_tf_update_step(self, distribution, grads_and_vars, learning_rate):
        # Cross-replica (merge_call), in the thread that runs the merge. The token is from this step's graph only.
        token, decay = _barrier_state.token, _barrier_state.decay
        _barrier_state.token = _barrier_state.decay = None
        if not is_hetero_strategy(distribution):
            return original_update_step(self, distribution, grads_and_vars, learning_rate)
        current_graph = tf.compat.v1.get_default_graph()
        # Eager steps have no graph (and run in order): nothing to wait for.
        barrier = [token] if getattr(token, "graph", None) is current_graph and not tf.executing_eagerly() else []
        with tf.control_dependencies(barrier):
            if decay is not None and decay[0] is self:
                _weight_decay_cross_replica(self, distribution, decay[1])
            return original_update_step(self, distribution, grads_and_vars, learning_rate)

    original_apply_gradients = TFOptimizer.apply_gradients

    @functools.wraps(original_apply_gradients)
    def apply_gradients(self, grads_and_vars):
        # Keras' gradient accumulation keeps one accumulator per variable and adds to it inside a cond; under a
        # central-storage strategy that fails in graph mode and, eagerly, adds each replica's unreduced gradient.
        if getattr(self, "gradient_accumulation_steps", None) and is_hetero_strategy(tf.distribute.get_strategy()):
            from hetero_cs.errors import ConfigError

            raise ConfigError(
                f"Optimizer gradient_accumulation_steps={self.gradient_accumulation_steps} is not supported under "
                f"HeteroCentralStorageStrategy. Use a global batch that many times larger instead, where the devices' "
                f"memory allows it."
            )
        return original_apply_gradients(self, grads_and_vars)

    TFOptimizer.apply_gradients = apply_gradients
    TFOptimizer._clip_gradients = _clip_gradients  # noqa: SLF001
    TFOptimizer._all_reduce_sum_gradients = _all_reduce_sum_gradients  # noqa: SLF001
    TFOptimizer._distributed_tf_update_step = _distributed_tf_update_step  # noqa: SLF001
    TFOptimizer._apply_weight_decay = _apply_weight_decay  # noqa: SLF001


_clip_state = threading.local()
# The barrier token of the step being traced, handed from the replica threads to the merge that applies the update.
# Not thread-local: replicas run in their own threads, the merge in the thread that called strategy.run.
_barrier_state = types.SimpleNamespace(token=None, decay=None)


def _weight_decay_cross_replica(optimizer, distribution, variables) -> None:
    # Keras' TFOptimizer._apply_weight_decay, minus its maybe_merge_call (we are already in the merge): the same
    # decoupled decay, variable by variable, on the parameter device. _use_weight_decay is Keras' own exclusion
    # list (exclude_from_weight_decay).
    from keras.src import backend

    def weight_decay_fn(variable):
        if optimizer._use_weight_decay(variable):  # noqa: SLF001
            lr = tf.cast(optimizer.learning_rate, variable.dtype)
            wd = tf.cast(optimizer.weight_decay, variable.dtype)
            variable.assign_sub(variable * wd * lr)

    for variable in variables:
        if isinstance(variable, backend.Variable):
            variable = variable.value
        distribution.extended.update(variable, weight_decay_fn, group=False)


def _all_replicas_done(strategy, per_replica_grads):
    """Cross-replica: a scalar on the parameter device that is computed after every replica's every gradient."""
    local = [t for value in per_replica_grads for t in strategy.experimental_local_results(value)]
    deps = tf.nest.flatten(local, expand_composites=True)  # IndexedSlices (embedding gradients) -> their tensors
    with tf.device(strategy.parameter_device), tf.control_dependencies(deps):
        return tf.identity(tf.constant(0, tf.int32))


def _patch_seed_generator() -> None:
    # With ONLY_FIRST_REPLICA seed state every replica would draw the same dropout / noise seed within a step, so
    # the masks of different slices would be identical (correlated). Folding the replica id into the drawn seed
    # gives each replica its own stream; the state itself still advances once per call.
    from keras.src.random.seed_generator import SeedGenerator

    original_next = SeedGenerator.next

    @functools.wraps(original_next)
    def next_seed(self, ordered=True):
        seed = original_next(self, ordered=ordered)
        step = training.current_replica_step()
        if step is not None and step.replica_id and current_hetero_strategy() is not None:
            offset = tf.constant([step.replica_id * 1_000_003, 0], dtype=seed.dtype)
            seed = seed + offset
        return seed

    SeedGenerator.next = next_seed


def _patch_fit() -> None:
    # Model.fit is the one entry point that knows both the model and the data: under our strategy it gets a
    # callback that calibrates on the first global batch (auto_balance), and reports per-replica step times, the
    # straggler wait and the plan in the logs. Other strategies are untouched.
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    original_fit = TensorFlowTrainer.fit
    signature = inspect.signature(original_fit)

    @functools.wraps(original_fit)
    def fit(self, *args, **kwargs):
        strategy = getattr(self, "_distribute_strategy", None)
        if not is_hetero_strategy(strategy):
            return original_fit(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        callbacks = bound.arguments.get("callbacks")
        bound.arguments["callbacks"] = strategy._fit_callbacks(self, callbacks)  # noqa: SLF001
        strategy._input_error = None  # noqa: SLF001
        try:
            return original_fit(*bound.args, **bound.kwargs)
        except StopIteration as exc:
            # Keras lets the distributed iterator's StopIteration escape when the dataset has no batch at all.
            from hetero_cs.errors import InputError

            raise InputError(
                "model.fit got no batches: the dataset is empty. Check the dataset (e.g. a take(0), a filter that "
                "drops everything, or fewer examples than one batch with drop_remainder=True)."
            ) from exc
        except tf.errors.OpError as exc:
            replica_error = strategy._replica_step_error(exc)  # noqa: SLF001
            if replica_error is None:
                raise
            raise replica_error from exc

    TensorFlowTrainer.fit = fit


def _patch_evaluate_and_predict() -> None:
    # A bad batch is found inside the input pipeline (a tf.numpy_function), so TensorFlow reports it as an
    # InvalidArgumentError around our message. fit re-raises the library's own error (above); evaluate and predict
    # do the same here. Other strategies are untouched.
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    def reraise_input_errors(original: Callable) -> Callable:
        @functools.wraps(original)
        def method(self, *args, **kwargs):
            strategy = getattr(self, "_distribute_strategy", None)
            if not is_hetero_strategy(strategy):
                return original(self, *args, **kwargs)
            strategy._input_error = None  # noqa: SLF001
            try:
                return original(self, *args, **kwargs)
            except tf.errors.OpError as exc:
                input_error, strategy._input_error = strategy._input_error, None  # noqa: SLF001
                if input_error is None:
                    raise
                raise input_error from exc

        return method

    TensorFlowTrainer.evaluate = reraise_input_errors(TensorFlowTrainer.evaluate)
    TensorFlowTrainer.predict = reraise_input_errors(TensorFlowTrainer.predict)


def all_sublayers(model) -> list:
    """The model and every layer inside it, nested models and layers held as attributes included."""
    # Private: Keras 3's _flatten_layers is the only walk that reaches sublayers kept as plain attributes of a
    # subclassed layer; `model.layers` lists only the top level. Used to count a model's FLOPs for emulation.
    if hasattr(model, "_flatten_layers"):
        return list(model._flatten_layers(include_self=True, recursive=True))  # noqa: SLF001
    layers, stack = [], [model]  # public fallback for Keras versions without it
    while stack:
        layer = stack.pop()
        layers.append(layer)
        stack.extend(getattr(layer, "layers", []))
    return layers


def layer_build_shapes(layer) -> dict | None:
    """The input shapes a layer was built with ({argument name: shape}), or None."""
    # Private: a layer inside a subclassed model has no symbolic `output`; the shapes its build() received are the
    # only record of what it computes on (used to count its FLOPs for emulation).
    return getattr(layer, "_build_shapes_dict", None)


def install() -> None:
    """Installs the dispatching patches once per process (thread-safe, idempotent)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        _patch_loss_scaling()
        _patch_variable_assign_add()
        _patch_optimizer()
        _patch_seed_generator()
        _patch_fit()
        _patch_evaluate_and_predict()
        _installed = True
        logger.debug("hetero_cs: Keras patches installed (they act only under HeteroCentralStorageStrategy)")
