"""Private touches of Keras' train step: each replica's forward and backward pass as one function of the weights.

Part of :mod:`hetero_cs.engine._compat`, the one place of private TensorFlow/Keras touches.

Keras' TensorFlow ``train_step`` runs the forward pass, the loss, the tape and the optimizer (whose gradient
all-reduce is a cross-replica merge) in one Python function. Cut at the all-reduce, the replica's own part, the
forward pass, the loss and the gradient, becomes one function of the weights, which serves two uses:

* XLA per replica (``compile(jit_compile=True)``, both strategies): that function is compiled with XLA on the
  replica's device (:mod:`hetero_cs.engine.replica_xla`: what applies when, and why the weights go in as inputs);
* idle replicas under the multi-worker strategy: a replica whose slice holds 0 examples skips that function
  (``tf.cond``) and hands zeros to the all-reduce, which every replica of every worker must still join
  (:mod:`hetero_cs.engine.idle_replicas`).
"""

from __future__ import annotations

import functools
import logging

import tensorflow as tf

from hetero_cs.engine import idle_replicas, replica_xla, training
from hetero_cs.engine._compat import symbols
from hetero_cs.engine._compat.distribute import is_hetero_strategy
from hetero_cs.engine._compat.multi_worker import is_multi_worker_strategy

logger = logging.getLogger(__name__)


def keras_train_step():
    """``train_step`` as a model class inherits it from Keras (hetero_cs's dispatch below, once installed)."""
    return symbols.require("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer").train_step


def _patch_train_step() -> None:
    # Under our strategies, inside a replica step of a model compiled with XLA per replica
    # (hetero_cs.engine.replica_xla.applies), or of one whose idle replicas skip their pass under the multi-worker
    # strategy (hetero_cs.engine.idle_replicas.multi_worker_skips), Keras' train step runs cut (_cut_step);
    # elsewhere Keras' own runs.
    TensorFlowTrainer = symbols.require("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer")
    original = TensorFlowTrainer.train_step

    @functools.wraps(original)
    def train_step(self, data):
        step = training.current_replica_step()
        strategy = getattr(self, "_distribute_strategy", None)
        if step is None or step.global_batch_size is None or not _ours(strategy) or not self.trainable_weights:
            return original(self, data)
        jit = replica_xla.applies(self)
        skip = is_multi_worker_strategy(strategy) and idle_replicas.multi_worker_skips(self)
        if not (jit or skip):
            return original(self, data)
        outputs = _cut_step(self, data, step, jit=jit, skip_when_empty=skip)
        return original(self, data) if outputs is None else outputs

    TensorFlowTrainer.train_step = train_step

    # Keras resolves compile(jit_compile="auto") to False under every tf.distribute strategy. Under our strategies
    # it resolves as it would for one device (Keras' own rule: a device other than the CPU is
    # present and every layer supports XLA). Private: Trainer._resolve_auto_jit_compile is that rule; it reads
    # self._distribute_strategy, which the model has, so the strategy is hidden from it for the call.
    Trainer = symbols.require("keras.src.trainers.trainer", "Trainer")
    original_resolve = Trainer._resolve_auto_jit_compile  # noqa: SLF001

    @functools.wraps(original_resolve)
    def _resolve_auto_jit_compile(self):
        strategy = getattr(self, "_distribute_strategy", None)
        if not _ours(strategy):
            return original_resolve(self)
        self._distribute_strategy = None  # noqa: SLF001
        try:
            return original_resolve(self)
        finally:
            self._distribute_strategy = strategy  # noqa: SLF001

    Trainer._resolve_auto_jit_compile = _resolve_auto_jit_compile  # noqa: SLF001


def _ours(strategy) -> bool:
    return is_hetero_strategy(strategy) or is_multi_worker_strategy(strategy)


def _cut_step(model, data, step, *, jit: bool, skip_when_empty: bool):
    """Keras' ``train_step`` for one replica, its forward pass, loss and gradient one function of the weights; None
    when the model turned out not to allow it (then the caller runs Keras' own; a message said why).

    The same operations in the same order as Keras' TensorFlow ``train_step``: the forward pass, ``_compute_loss``
    (weighted ``b_i / B`` by hetero_cs's patches), the logged loss, ``optimizer.scale_loss``, the gradient of the
    scaled loss, ``apply_gradients``, ``compute_metrics``. The first three and the gradient run in the function; it
    takes every weight as an input, read here on the replica's device, because XLA cannot read a variable on the
    parameter device (under the multi-worker strategy the read is the replica's own mirrored copy). State the forward
    pass writes (a seed generator's state, a layer's moving statistics) is written back after it, in replica context,
    as the plain step writes it.

    Args:
        jit: Compile the function with XLA.
        skip_when_empty: Run it only when this replica's slice holds examples; an empty slice gives zero gradients,
            a zero loss share, empty predictions and no state written.
    """
    # Private: Keras' own helpers of its train_step (unpacking, the loss tracker, the logged loss's unscaling,
    # _call_has_training_arg, _compute_loss) and its StatelessScope, the scope Keras' stateless_call uses to run a
    # model on given weight values and record the state it writes instead of writing it.
    from keras.src import tree
    from keras.src.backend.common.stateless_scope import StatelessScope
    from keras.src.losses import loss as loss_module
    from keras.src.trainers.data_adapters import data_adapter_utils

    from hetero_cs.engine._compat.losses import _register, weighing_in_compiled_replica_step

    x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
    trainable = list(model.trainable_variables)
    non_trainable = list(model.non_trainable_variables)
    # Keras' loss trackers (per-output losses) are updated inside _compute_loss. They are sums (Mean, Sum: total and
    # count only ever grow by assign_add), so they go in as zeros and what the function adds comes out exactly, to be
    # added to the variables after it, as the plain step adds it (aggregated across replicas).
    known = {id(v) for v in trainable + non_trainable}
    metric_state = [v for v in model.metrics_variables if id(v) not in known]
    additive = {id(v) for metric in model.metrics if isinstance(metric, _additive_metrics())
                for v in metric.variables}
    optimizer = model.optimizer
    # optimizer.scale_loss multiplies by the loss scale (a variable on the parameter device) under
    # LossScaleOptimizer and returns the loss itself otherwise: the scale goes in as an input too.
    unit = tf.ones((), tf.float32)
    scale = None if optimizer is None else optimizer.scale_loss(unit)
    scale = None if scale is unit else tf.convert_to_tensor(scale)
    written: list[int] = []
    added: list[int] = []

    def hetero_cs_replica_forward_backward(weights, state, scale, x, y, sample_weight):
        zeros = [tf.zeros(v.shape, v.dtype) for v in metric_state]
        mapping = list(zip(trainable, weights)) + list(zip(non_trainable, state)) + list(zip(metric_state, zeros))
        with StatelessScope(state_mapping=mapping, collect_losses=True) as scope, \
                weighing_in_compiled_replica_step():
            with tf.GradientTape() as tape:
                tape.watch(weights)
                y_pred = model(x, training=True) if model._call_has_training_arg else model(x)  # noqa: SLF001
                loss = model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,  # noqa: SLF001
                                           training=True)
                scaled = loss if scale is None else loss * tf.cast(scale, loss.dtype)
            gradients = tape.gradient(scaled, weights)
            new_state = [scope.get_current_value(variable) for variable in non_trainable]
            sums = [scope.get_current_value(variable) for variable in metric_state]
        # The scope answers a variable's mapped value until something assigns it a new one.
        written[:] = [i for i, (value, given) in enumerate(zip(new_state, state)) if value is not given]
        added[:] = [i for i, (value, given) in enumerate(zip(sums, zeros)) if value is not given]
        return y_pred, loss, gradients, [new_state[i] for i in written], [sums[i] for i in added]

    function = tf.function(hetero_cs_replica_forward_backward, jit_compile=jit, autograph=False)
    # One function per replica and trace: its captures (this replica's b_i, B) are this replica's own.
    weights = [tf.convert_to_tensor(variable) for variable in trainable]
    state = [tf.convert_to_tensor(variable) for variable in non_trainable]
    arguments = (weights, state, scale, x, y, sample_weight)
    try:
        concrete = function.get_concrete_function(*arguments)  # traced here, called below
    except RuntimeError as exc:
        if "merge_call" not in str(exc):
            raise
        # An all-reduce across replicas inside the forward pass or the loss: a masked loss, or one reduced with
        # "mean_with_sample_weight", normalised by the whole global batch (hetero_cs.engine._compat.losses); a
        # layer of the user's own that all-reduces. No per-replica function can hold it.
        _fall_back(model, jit, skip_when_empty,
                   "the forward pass or the loss all-reduces across replicas (a loss normalised by the whole global "
                   "batch's mask or sample weights, or a layer that synchronises replicas)")
        return None
    other = [metric_state[i].path for i in added if id(metric_state[i]) not in additive]
    if other:
        _fall_back(model, jit, skip_when_empty,
                   f"the loss updates metric state that is not a sum ({', '.join(other[:3])})")
        return None
    empty = _empty_outputs(concrete.structured_outputs, weights, state, written) if skip_when_empty else None
    if skip_when_empty and empty is None:
        idle_replicas.multi_worker_fall_back(model, "a prediction's shape beyond the batch dimension is not known "
                                                    "while tracing, so an idle replica has no empty one to give")
        skip_when_empty = False
        if not jit:
            return None
    if jit:
        replica_xla.note_compiled(model)
        logger.debug("hetero_cs: replica %d's forward pass, loss and gradient are compiled with XLA on %s.",
                     step.replica_id, step.device)
    if skip_when_empty:
        y_pred, loss, gradients, new_state, sums = tf.cond(
            step.batch_size > 0, lambda: function(*arguments), empty)
    else:
        y_pred, loss, gradients, new_state, sums = function(*arguments)
    _register(step, loss)  # a b_i / B share, as _compute_loss's own result is
    for i, value in zip(written, new_state):
        non_trainable[i].assign(value)
    for i, value in zip(added, sums):
        metric_state[i].assign_add(value)
    model._loss_tracker.update_state(  # noqa: SLF001
        loss_module.unscale_loss_for_distribution(loss),
        sample_weight=tf.shape(next(i for i in tree.flatten(x) if i is not None))[0])
    model.optimizer.apply_gradients(zip(gradients, trainable))
    return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


def _empty_outputs(outputs, weights, state, written):
    """A function giving what the replica's pass gives for 0 examples, or None when a shape is not known.

    ``outputs`` is the traced pass's ``(y_pred, loss, gradients, new_state, sums)``: predictions get 0 rows, the loss
    and every gradient and sum are zeros (a sparse gradient: no rows), and the state written is the state given.
    """
    y_pred, loss, gradients, _, sums = outputs
    leaves = tf.nest.flatten(y_pred)
    if not all(t.shape.rank is not None and t.shape[1:].is_fully_defined() for t in leaves):
        return None

    def zero_gradient(gradient, weight):
        if gradient is None:
            return None
        if isinstance(gradient, tf.IndexedSlices):
            dense_shape = gradient.dense_shape.dtype if gradient.dense_shape is not None else tf.int32
            return tf.IndexedSlices(tf.zeros([0, *weight.shape[1:]], gradient.values.dtype),
                                    tf.zeros([0], gradient.indices.dtype), tf.constant(weight.shape, dense_shape))
        return tf.zeros(weight.shape, gradient.dtype)

    def empty():
        return (tf.nest.map_structure(lambda t: tf.zeros([0, *t.shape[1:]], t.dtype), y_pred),
                tf.zeros([], loss.dtype), [zero_gradient(g, w) for g, w in zip(gradients, weights)],
                [state[i] for i in written],
                [tf.zeros(t.shape, t.dtype) for t in sums])

    return empty


def _fall_back(model, jit: bool, skip_when_empty: bool, reason: str) -> None:
    if jit:
        replica_xla.fall_back(model, f"{reason}, which a per-replica XLA function cannot hold")
    if skip_when_empty:
        idle_replicas.multi_worker_fall_back(model, reason)


def _additive_metrics() -> tuple:
    # Private: keras.src.metrics.reduction_metrics holds Keras' Sum and Mean (loss trackers and every
    # MeanMetricWrapper included), whose update_state only adds to their state (assign_add).
    from keras.src.metrics.reduction_metrics import Mean, Sum

    return (Sum, Mean)
