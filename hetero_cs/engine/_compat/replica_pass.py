"""Private touches of Keras' train step: each replica's forward and backward pass as one function of the weights.

Part of :mod:`hetero_cs.engine._compat`, the one place of private TensorFlow/Keras touches.

Keras' TensorFlow ``train_step`` runs the forward pass, the loss, the tape and the optimizer (whose gradient
all-reduce is a cross-replica merge) in one Python function. Cut at the all-reduce, the replica's own part, the
forward pass, the loss and the gradient, becomes one function of the weights, which serves two uses:

* XLA per replica (``compile(jit_compile=True)``, both strategies): that function is compiled with XLA on the
  replica's device (:mod:`hetero_cs.engine._compat.replica_xla`: what applies when, and why the weights go in as inputs);
* idle replicas under the multi-worker strategy: a replica whose slice holds 0 examples skips that function
  (``tf.cond``) and hands zeros to the all-reduce, which every replica of every worker must still join
  (:mod:`hetero_cs.engine.step.idle_replicas`).
"""

import dataclasses
import logging

import tensorflow as tf

from hetero_cs.devices.step_clock import _probe_scalar, emulated_memory_gate, end_replica_step, tie_to_stamp
from hetero_cs.engine._compat import replica_xla, symbols
from hetero_cs.engine._compat.batch_flow import seed_replica_step
from hetero_cs.engine._compat.losses import _register, weighing_in_compiled_replica_step
from hetero_cs.engine._compat.sparse_rows import shared_rows_dense
from hetero_cs.engine.step import replica_state
from hetero_cs.engine._compat.context import is_multi_worker_strategy, is_ours, strategy_of
from hetero_cs.engine._compat.symbols import patch

logger = logging.getLogger(__name__)


def keras_trainer():
    """Keras' TensorFlow trainer class, whose methods the patches replace (Private: TensorFlowTrainer is where Keras'
    TensorFlow backend defines fit, evaluate, predict and the steps)."""
    return symbols.require("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer")


def keras_train_step():
    """``train_step`` as a model class inherits it from Keras (hetero_cs's dispatch below, once installed)."""
    return keras_trainer().train_step


def patch_train_step() -> None:
    # Under our strategies, inside a replica step of a model compiled with XLA per replica
    # (hetero_cs.engine._compat.replica_xla.applies), or of one whose idle replicas skip their pass under the multi-worker
    # strategy (hetero_cs.engine.step.replica_xla.multi_worker_skips), Keras' train step runs cut (_cut_step);
    # elsewhere Keras' own runs.
    @patch(keras_trainer(), "train_step")
    def train_step(original, self, data):
        step, strategy = replica_state.current_replica_step(), strategy_of(self)
        if step is None or step.global_batch_size is None or not is_ours(strategy) or not self.trainable_weights:
            return original(self, data)
        jit, multi_worker = replica_xla.applies(self), is_multi_worker_strategy(strategy)
        skip = multi_worker and replica_xla.multi_worker_skips(self)
        cap = strategy.micro_batching.cap_of(step.replica_id) if multi_worker else None
        # Whether this model's slices may run as micro-batches: then every replica, capped or not, traces the cut
        # step to find what keeps them within the caps, so every worker switches alike (a worker whose replicas have
        # no cap would otherwise keep the micro-batched plan and cut its batches unlike the others).
        finding = multi_worker and strategy.micro_batching.active
        outputs = _cut_step(self, data, step, jit=jit, skip_when_empty=skip, micro_cap=cap, find_micro=finding) \
            if jit or skip or cap is not None or finding else None
        return original(self, data) if outputs is None else outputs

    # Keras resolves compile(jit_compile="auto") to False under every tf.distribute strategy. Under our strategies
    # it resolves as it would for one device (Keras' own rule: a device other than the CPU is
    # present and every layer supports XLA). Private: Trainer._resolve_auto_jit_compile is that rule; it reads
    # self._distribute_strategy, which the model has, so the strategy is hidden from it for the call.
    @patch(symbols.require("keras.src.trainers.trainer", "Trainer"), "_resolve_auto_jit_compile")
    def _resolve_auto_jit_compile(original, self):
        strategy = strategy_of(self)
        if not is_ours(strategy):
            return original(self)
        self._distribute_strategy = None  # noqa: SLF001
        try:
            return original(self)
        finally:
            self._distribute_strategy = strategy  # noqa: SLF001


def patch_inference_steps() -> None:
    # Under the multi-worker strategy, a replica whose slice of an evaluate or predict batch exceeds its card's memory
    # cap runs Keras' own test_step or predict_step on each micro-batch in turn (_micro_batched_inference);
    # elsewhere Keras' own runs.
    for name in ("test_step", "predict_step"):
        patch(keras_trainer(), name)(_inference_step)


def _inference_step(original, self, data):
    step, strategy = replica_state.current_replica_step(), strategy_of(self)
    if step is None or step.global_batch_size is None or not is_multi_worker_strategy(strategy):
        return original(self, data)
    cap = strategy.micro_batching.inference_cap(self, step.replica_id)
    return original(self, _memory_checked(strategy, step, data, step.batch_size)) if cap is None else \
        _micro_batched_inference(self, original, data, step, cap, predict=original.__name__ == "predict_step")


def _micro_batched_inference(model, keras_step, data, step, cap: int, *, predict: bool):
    """Keras' ``test_step`` or ``predict_step`` (``keras_step``) for one replica's slice, run on near-equal
    micro-batches of at most ``cap`` examples one after another (``parallel_iterations=1``: one micro-batch's
    activations in memory at a time), each as a replica step of its own ``m_ij`` examples: its loss weighs
    ``m_ij / B``, its metric updates add up, and predict's outputs are put back together in order. The first
    micro-batch runs before the loop (it gives the outputs' structure; an empty slice runs it on 0 rows, as Keras'
    own step would), the rest in a ``tf.while_loop``. Returns the metrics' results once every micro-batch has updated
    them (evaluate) or every row's prediction (predict)."""
    # Private: Keras' own unpacking and packing of (x, y, sample_weight), as its test_step and predict_step unpack.
    from keras.src import tree
    from keras.src.trainers.data_adapters import data_adapter_utils

    micro = strategy_of(model).micro_batching
    if not predict and not micro.evaluates_in_micro_batches(model, lambda: _all_reduces_in_test_step(
            model, keras_step, data)):
        return keras_step(model, data)  # one pass past the cap, as every other replica's (logged once)
    x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
    count, micro_batch = _near_equal_micro_batches(step.batch_size, cap)
    count = tf.maximum(count, 1)  # an empty slice runs the first micro-batch on 0 rows

    def run(j):
        size, rows_of = micro_batch(j)
        part = data_adapter_utils.pack_x_y_sample_weight(*tree.map_structure(rows_of, (x, y, sample_weight)))
        part, inner = _memory_checked(strategy_of(model), step, part, size), dataclasses.replace(step, batch_size=size)
        seed_replica_step(inner, part)  # the batch-flow analysis: this micro-batch's rows, and its b_i
        with replica_state.replica_step(inner):
            return keras_step(model, part)

    first = run(tf.constant(0, tf.int32))
    flat = tf.nest.flatten(first)
    outputs = [array.write(0, t) for array, t in zip(_row_arrays(flat, count), flat)] if predict else flat

    def body(j, outputs):
        result = tf.nest.flatten(run(j))
        return j + 1, ([array.write(j, t) for array, t in zip(outputs, result)] if predict else result)

    _, outputs = tf.while_loop(lambda j, _: j < count, body, (tf.constant(1, tf.int32), outputs), parallel_iterations=1)
    micro.note_micro_batched_inference(model)
    if not predict:
        # Keras' own test_step returns its metrics' results: read once every micro-batch has updated them (the
        # loop's last values, which the loss reader cannot follow through a loop whose count is the slice's).
        with tf.control_dependencies(tf.nest.flatten(outputs)):
            return model.get_metrics_result()
    predictions = tf.nest.pack_sequence_as(first, [array.concat() for array in outputs])
    step.flow.seed_rows(predictions)  # the slice's rows in order, put back together from its micro-batches
    return predictions


def _memory_checked(strategy, step, data, examples):
    """``data`` made to wait for the emulated card's check that ``examples`` fit its memory in inference (as its
    training steps are checked), so an emulated card runs out of memory in evaluate and predict as a GPU would;
    ``data`` as it is on real devices."""
    emulator = strategy.emulator
    anchor = next((t for t in tf.nest.flatten(data) if tf.is_tensor(t) and t.dtype.is_numeric), None)
    if emulator is None or emulator.workload is None or anchor is None:
        return data
    gated = emulated_memory_gate(data, anchor, replica_id=step.replica_id, batch_size=examples, emulator=emulator,
                                 training=False)
    step.flow.seed_rows(gated)  # the same rows, tied to the check (which the loss reader cannot read through)
    return gated


def _all_reduces_in_test_step(model, keras_step, data) -> bool:
    """Whether Keras' ``test_step`` all-reduces inside a replica (a loss normalised by the whole global batch's mask
    or sample weights; see :func:`_cut_step`): traced in a function that never runs, so no collective runs here and
    every worker finds the same while tracing the same step."""
    def traced(data):
        replica_state.current_replica_step().flow.seed_rows(data)  # this function's inputs: the replica's slice
        return keras_step(model, data)

    return _traced(tf.function(traced, autograph=False), data) is None


def _traced(function, *arguments):
    """``function`` (a replica's pass) traced for ``arguments``, its concrete function; None when the pass
    all-reduces across replicas (TensorFlow refuses the merge_call inside a function of its own)."""
    try:
        return function.get_concrete_function(*arguments)
    except RuntimeError as exc:
        if "merge_call" not in str(exc):
            raise
        return None


def _cut_step(model, data, step, *, jit: bool, skip_when_empty: bool, micro_cap: int | None = None,
              find_micro: bool = False):
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
        micro_cap: Under the multi-worker strategy's micro-batching (:mod:`hetero_cs.engine.multi_worker.micro_batches`):
            the examples this replica's card holds at once. The slice then runs as near-equal micro-batches within
            it, one after another in a ``tf.while_loop`` (each micro-batch's loss weighs ``m_ij / B``, the state
            it writes goes on to the next), and their summed gradients go to the one all-reduce of the step.
        find_micro: The model's slices may run as micro-batches: what the traced pass shows that keeps them within
            the caps is told to the strategy (:meth:`~hetero_cs.engine.multi_worker.micro_batches.MultiWorkerMicroBatches.
            refuse`) by every replica, capped or not. With nothing else to do (no cap, XLA or skipping) the caller
            then runs Keras' own step (None).
    """
    # Private: Keras' own helpers of its train_step (unpacking, the loss tracker, the logged loss's unscaling,
    # _call_has_training_arg, _compute_loss) and its StatelessScope, the scope Keras' stateless_call uses to run a
    # model on given weight values and record the state it writes instead of writing it.
    from keras.src.backend.common.stateless_scope import StatelessScope
    # Private: keras.src.metrics.reduction_metrics holds Keras' Sum and Mean (loss trackers and every
    # MeanMetricWrapper included), whose update_state only adds to their state (assign_add).
    from keras.src.metrics.reduction_metrics import Mean, Sum
    from keras.src.trainers.data_adapters import data_adapter_utils

    x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
    trainable, non_trainable = list(model.trainable_variables), list(model.non_trainable_variables)
    # Keras' loss trackers (per-output losses) are updated inside _compute_loss. They are sums (Mean, Sum: total and
    # count only ever grow by assign_add), so they go in as zeros and what the function adds comes out exactly, to be
    # added to the variables after it, as the plain step adds it (aggregated across replicas).
    known = {id(v) for v in trainable + non_trainable}
    metric_state = [v for v in model.metrics_variables if id(v) not in known]
    additive = {id(v) for metric in model.metrics if isinstance(metric, (Sum, Mean)) for v in metric.variables}
    # optimizer.scale_loss multiplies by the loss scale (a variable on the parameter device) under
    # LossScaleOptimizer and returns the loss itself otherwise: the scale goes in as an input too.
    unit = tf.ones((), tf.float32)
    scale = None if model.optimizer is None else model.optimizer.scale_loss(unit)
    scale = None if scale is unit else tf.convert_to_tensor(scale)
    written, added = [], []  # the indices of the state variables and the metric variables the pass writes

    def hetero_cs_replica_forward_backward(weights, state, scale, x, y, sample_weight, examples):
        zeros = [tf.zeros(v.shape, v.dtype) for v in metric_state]
        mapping = list(zip(trainable, weights)) + list(zip(non_trainable, state)) + list(zip(metric_state, zeros))
        # The examples this pass holds (the slice's b_i, or a micro-batch's m_ij) weigh its share of the global batch.
        inner = dataclasses.replace(step, batch_size=examples)
        # The pass is traced in a function of its own: its batch-flow analysis is told that the function's inputs
        # hold the pass's examples (its b_i is theirs) and the weights and state, the same on every replica.
        inner.flow.seed_replicated((weights, state, scale, zeros))
        seed_replica_step(inner, (x, y, sample_weight))
        with StatelessScope(state_mapping=mapping, collect_losses=True) as scope, weighing_in_compiled_replica_step(), \
                replica_state.replica_step(inner):
            with tf.GradientTape() as tape:
                tape.watch(weights)
                y_pred = model(x, training=True) if model._call_has_training_arg else model(x)  # noqa: SLF001
                loss = model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,  # noqa: SLF001
                                           training=True)
                scaled = loss if scale is None else loss * tf.cast(scale, loss.dtype)
            gradients = [shared_rows_dense(g) for g in tape.gradient(scaled, weights)]  # rows added row by row
            new_state = [scope.get_current_value(variable) for variable in non_trainable]
            sums = [scope.get_current_value(variable) for variable in metric_state]
        # The scope answers a variable's mapped value until something assigns it a new one.
        written[:] = [i for i, (value, given) in enumerate(zip(new_state, state)) if value is not given]
        added[:] = [i for i, (value, given) in enumerate(zip(sums, zeros)) if value is not given]
        return y_pred, loss, gradients, [new_state[i] for i in written], [sums[i] for i in added]

    function = tf.function(hetero_cs_replica_forward_backward, jit_compile=jit, autograph=False)
    # One function per replica and trace: its captures (this replica's b_i, B) are this replica's own.
    weights, state = ([tf.convert_to_tensor(variable) for variable in group] for group in (trainable, non_trainable))
    arguments = (weights, state, scale, x, y, sample_weight, step.batch_size)
    concrete = _traced(function, *arguments)  # traced here, called below
    if concrete is None:
        # An all-reduce across replicas inside the forward pass or the loss: a masked loss, or one reduced with
        # "mean_with_sample_weight", normalised by the whole global batch (hetero_cs.engine._compat.losses); a
        # layer of the user's own that all-reduces. No per-replica function can hold it.
        reason = ("the forward pass or the loss all-reduces across replicas (a loss normalised by the whole global "
                  "batch's mask or sample weights, or a layer that synchronises replicas)")
        return _fall_back(model, jit, skip_when_empty, reason, refusal="NORMALISED_LOSS" if find_micro else None)
    other = [metric_state[i].path for i in added if id(metric_state[i]) not in additive]
    if other:
        return _fall_back(model, jit, skip_when_empty, f"the loss updates metric state that is not a sum "
                          f"({', '.join(other[:3])})", refusal="METRIC_STATE" if find_micro else None)
    if find_micro:
        layer_state = [non_trainable[i].path for i in written if _is_layer_state(non_trainable[i])]
        if layer_state and not strategy_of(model).micro_batching.accepts_layer_state(model, layer_state):
            micro_cap = None  # refused (logged): this slice runs in one pass, within the caps the plans now keep
    if micro_cap is None and not (jit or skip_when_empty):
        return None  # traced only to find the above: Keras' own step runs
    if micro_cap is not None:
        step, outputs = _micro_batched(model, step, concrete, function, arguments, written, micro_cap)
    else:
        empty = _empty_outputs(concrete.structured_outputs, weights, state, written) if skip_when_empty else None
        if skip_when_empty and empty is None:
            replica_xla.multi_worker_fall_back(model, "a prediction's shape beyond the batch dimension is not known "
                                                        "while tracing, so an idle replica has no empty one to give")
            skip_when_empty = False
            if not jit:
                return None
        if jit:
            replica_xla.note_compiled(model)
            logger.debug("hetero_cs: replica %d's forward pass, loss and gradient are compiled with XLA on %s.",
                         step.replica_id, step.device)
        outputs = tf.cond(step.batch_size > 0, lambda: function(*arguments), empty) if skip_when_empty \
            else function(*arguments)
    return _finish(model, step, (x, y, sample_weight), outputs, trainable, non_trainable, metric_state, written, added)


def _micro_batched(model, step, concrete, function, arguments, written, cap: int):
    """The pass of :func:`_cut_step` when the slice runs as micro-batches of at most ``cap`` examples: the replica
    step to finish it in (its micro-batches waited out their emulated time), and the pass's outputs.

    ``k = ceil(b_i / cap)`` near-equal micro-batches (:func:`hetero_cs.planning.cost_model.near_equal_micro_batches`:
    the rule the chief's plans price) run one after another (``parallel_iterations=1``: one micro-batch's
    activations in the card's memory at a time). Each is the replica's pass on its rows, weighted ``m_ij / B``; the
    state it writes (moving statistics, a seed generator's state) is the next one's input, as on one device over
    consecutive steps. Gradients, the loss share and the metric sums add up; predictions are put back together in
    order. On an emulated card each micro-batch waits out its own emulated time (and its memory is checked) before
    the next starts; the step's end then times the chain. ``b_i = 0`` runs no micro-batch.
    """
    from keras.src import tree

    weights, state, scale, x, y, sample_weight, _ = arguments
    y_pred_spec, loss_spec, gradient_spec, _, sums_spec = concrete.structured_outputs
    emulator = strategy_of(model).emulator
    emulated = emulator is not None and step.start_stamp is not None
    # The chain's clock: where the last micro-batch's emulated time ended (a constant when nothing is emulated).
    stamp = step.start_stamp if emulated else tf.zeros([], tf.float64)
    count, micro_batch = _near_equal_micro_batches(step.batch_size, cap)  # k_i: 0 for an empty slice
    predictions = _row_arrays(tf.nest.flatten(y_pred_spec), count)
    dense = [i for i, g in enumerate(gradient_spec) if g is not None and not isinstance(g, tf.IndexedSlices)]
    sparse = [i for i, g in enumerate(gradient_spec) if isinstance(g, tf.IndexedSlices)]
    sparse_parts = [tuple(_row_arrays([gradient_spec[i].values, gradient_spec[i].indices], count)) for i in sparse]

    def body(j, chain, loss, dense_sums, sparse_parts, metric_sums, written_state, predictions):
        if emulated:  # the next micro-batch starts when the last one's emulated time is over
            j = tie_to_stamp(j, chain)
        size, rows_of = micro_batch(j)
        last = dict(zip(written, written_state))  # the state the last micro-batch wrote goes on to this one
        current = [last.get(i, value) for i, value in enumerate(state)]
        pred, part_loss, grads, new_state, sums = function(
            weights, current, scale, *tree.map_structure(rows_of, (x, y, sample_weight)), size)
        if emulated:
            anchor = next(g for g in tf.nest.flatten(grads, expand_composites=True) if g is not None)
            chain = end_replica_step(chain, _probe_scalar(anchor), replica_id=step.replica_id, batch_size=size,
                                     emulator=emulator)
        dense_sums = [total + grads[i] for total, i in zip(dense_sums, dense)]
        sparse_parts = [(values.write(j, grads[i].values), indices.write(j, grads[i].indices))
                        for (values, indices), i in zip(sparse_parts, sparse)]
        metric_sums = [total + value for total, value in zip(metric_sums, sums)]
        predictions = [array.write(j, value) for array, value in zip(predictions, tf.nest.flatten(pred))]
        return j + 1, chain, loss + part_loss, dense_sums, sparse_parts, metric_sums, list(new_state), predictions

    start = (tf.constant(0, tf.int32), stamp, tf.zeros([], loss_spec.dtype),
             [tf.zeros(weights[i].shape, gradient_spec[i].dtype) for i in dense], sparse_parts,
             [tf.zeros(t.shape, t.dtype) for t in sums_spec], [state[i] for i in written], predictions)
    _, chain, loss, dense_sums, sparse_parts, sums, new_state, predictions = tf.while_loop(
        lambda j, *_: j < count, body, start, parallel_iterations=1)

    total = dict(zip(dense, dense_sums)) | {i: tf.IndexedSlices(values.concat(), indices.concat(), tf.shape(weights[i]))
                                           for i, (values, indices) in zip(sparse, sparse_parts)}
    gradients = [total.get(i, gradient) for i, gradient in enumerate(gradient_spec)]  # None: no gradient
    if emulated:  # the step's gradients leave only after the last micro-batch's emulated time
        gradients = tie_to_stamp(gradients, chain)
    y_pred = tf.nest.pack_sequence_as(y_pred_spec, [array.concat() for array in predictions])
    step.flow.seed_rows(y_pred)  # the slice's rows in order, put back together from its micro-batches
    strategy_of(model).micro_batching.note_micro_batched(model)
    # The loss is a b_i / B share: the sum of the micro-batches' m_ij / B shares.
    return dataclasses.replace(step, waited_per_micro_batch=emulated), (y_pred, loss, gradients, new_state, sums)


def _near_equal_micro_batches(batch_size, cap: int):
    """``(k, micro_batch)`` for a slice of ``batch_size`` examples (a tensor) within ``cap``: the ``k = ceil(b / cap)``
    near-equal micro-batches (0 for an empty slice) that :func:`hetero_cs.planning.cost_model.near_equal_micro_batches`
    gives the plans, and ``micro_batch(j)``: micro-batch ``j``'s size and a function that cuts a value (or None) to
    its rows."""
    # In int64: a cap from a roomy card's memory and a tiny model can exceed int32 (rows + cap - 1 would wrap to a
    # negative count, and the slice would run no micro-batch at all). The results fit int32 (at most the rows).
    rows = tf.cast(batch_size, tf.int64)
    count = (rows + (cap - 1)) // cap
    quotient = tf.cast(rows // tf.maximum(count, 1), tf.int32)
    remainder = tf.cast(rows - count * tf.cast(quotient, tf.int64), tf.int32)

    def micro_batch(j):
        begin, size = j * quotient + tf.minimum(j, remainder), quotient + tf.cast(j < remainder, tf.int32)
        return size, lambda value: None if value is None else value[begin:begin + size]

    return tf.cast(count, tf.int32), micro_batch


def _row_arrays(tensors, count) -> list:
    """One TensorArray of ``count`` parts per tensor of ``tensors``, each part some rows of it (concatenated after)."""
    return [tf.TensorArray(t.dtype, size=count, infer_shape=False, element_shape=[None, *t.shape[1:]]) for t in tensors]


def _finish(model, step, data, outputs, trainable, non_trainable, metric_state, written, added):
    """The end of the cut train step, as Keras' ``train_step`` ends: the loss share registered (weighted
    ``b_i / B``, as ``_compute_loss``'s own result is), the state and metric sums the pass wrote (``outputs``:
    ``(y_pred, loss, gradients, new_state, sums)``) put in their variables, the loss tracker, ``apply_gradients``
    (the all-reduce) and ``compute_metrics``. ``data`` is ``(x, y, sample_weight)``."""
    from keras.src import tree
    from keras.src.losses import loss as loss_module

    x, y, sample_weight = data
    y_pred, loss, gradients, new_state, sums = outputs
    _register(step, loss)
    for i, value in zip(written, new_state):
        non_trainable[i].assign(value)
    for i, value in zip(added, sums):
        metric_state[i].assign_add(value)
    model._loss_tracker.update_state(  # noqa: SLF001
        loss_module.unscale_loss_for_distribution(loss),
        sample_weight=tf.shape(next(i for i in tree.flatten(x) if i is not None))[0])
    with replica_state.replica_step(step):
        model.optimizer.apply_gradients(zip(gradients, trainable))
    return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


def _is_layer_state(variable) -> bool:
    """A non-trainable variable a layer sets from its examples in training (not BatchNormalization's moving
    statistics, which the strategy judges up front, nor a seed generator's state, which only counts draws)."""
    return not str(getattr(variable, "path", "")).endswith(("moving_mean", "moving_variance", "seed_generator_state"))


def _empty_outputs(outputs, weights, state, written):
    """A function giving what the replica's pass gives for 0 examples, or None when a shape is not known.

    ``outputs`` is the traced pass's ``(y_pred, loss, gradients, new_state, sums)``: predictions get 0 rows, the loss
    and every gradient and sum are zeros (a sparse gradient: no rows), and the state written is the state given.
    """
    y_pred, loss, gradients, _, sums = outputs
    if not all(t.shape.rank is not None and t.shape[1:].is_fully_defined() for t in tf.nest.flatten(y_pred)):
        return None

    def zero_gradient(gradient, weight):
        if gradient is None:
            return None
        if isinstance(gradient, tf.IndexedSlices):
            dense_shape = gradient.dense_shape.dtype if gradient.dense_shape is not None else tf.int32
            return tf.IndexedSlices(tf.zeros([0, *weight.shape[1:]], gradient.values.dtype),
                                    tf.zeros([0], gradient.indices.dtype), tf.shape(weight, out_type=dense_shape))
        return tf.zeros(weight.shape, gradient.dtype)

    def empty():
        return (tf.nest.map_structure(lambda t: tf.zeros([0, *t.shape[1:]], t.dtype), y_pred),
                tf.zeros([], loss.dtype), [zero_gradient(g, w) for g, w in zip(gradients, weights)],
                [state[i] for i in written], [tf.zeros(t.shape, t.dtype) for t in sums])

    return empty


def _fall_back(model, jit: bool, skip_when_empty: bool, reason: str, *, refusal: str | None) -> None:
    """Found while tracing: the replica pass cannot be cut into its own function because of ``reason``; with
    ``refusal`` (the name of one of the micro-batching's findings) the model's slices may not run as micro-batches
    either. Returns None: the cut step's result when it cannot run (Keras' own step runs)."""
    if jit:
        replica_xla.fall_back(model, f"{reason}, which a per-replica XLA function cannot hold")
    if skip_when_empty:
        replica_xla.multi_worker_fall_back(model, reason)
    if refusal is not None:
        micro = strategy_of(model).micro_batching
        micro.refuse(model, getattr(micro, refusal))
