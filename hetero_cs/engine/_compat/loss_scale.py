"""Private touches of Keras' LossScaleOptimizer: dynamic loss scaling judged on the summed gradient, on the host.

Part of :mod:`hetero_cs.engine._compat`, the one place of private TensorFlow/Keras touches.

Keras 3's ``LossScaleOptimizer`` (``compile`` wraps the optimizer in it under ``mixed_float16``) does not work under
central storage: its TensorFlow path puts the inner optimizer's update, which all-reduces the gradients through a
merge call, inside a ``cond`` in replica context, which tf.distribute cannot run ("merge_call called while defining
a new graph"). Under ``MirroredStrategy`` it also judges finiteness on one replica's *local* gradients, before the
all-reduce, so an overflow in another replica's slice is applied.

Under our strategy one optimizer step with loss scaling runs as follows (one device's step is the oracle):

1. Each replica's loss was multiplied by the scale (``optimizer.scale_loss``, a read of the central scale); its
   gradients go to the inner optimizer unchanged, through the usual exact path (the failure barrier, per-replica
   timing, the SUM all-reduce on the host).
2. In the cross-replica update, once, on the parameter device: ``finite`` = every summed gradient is finite; the
   summed gradients are divided by the scale, then clipped (the inner optimizer's clipnorm etc.), exactly as one
   device unscales and clips its whole-batch gradient.
3. ``finite`` gates the whole update (weight decay, every variable's update and its slots) in one ``cond``; the
   inner optimizer's iteration counter adds ``finite`` (1 or 0) instead of 1.
4. The scale and its counter are updated once, on the parameter device, with Keras' rule: a non-finite step halves
   the scale and resets the counter; ``dynamic_growth_steps`` finite steps in a row double it.

Metrics and the logged loss are updated on a skipped step as on one device (Keras' train step updates them before
and regardless of the optimizer).
"""

import tensorflow as tf

from hetero_cs.engine.step import replica_state
from hetero_cs.engine._compat import hooks
from hetero_cs.engine._compat.context import current_hetero_strategy
from hetero_cs.engine._compat.symbols import patch

# What the replica threads and the thread that runs the merge share lives on the step's replica_state.StepHandoff (one
# per strategy.run call, so a model tracing in another thread cannot take it): ``loss_scale_pending`` is
# (loss-scale optimizer, graph) while a replica step applies gradients through it; ``loss_scale_finite`` is (inner
# optimizer, bool tensor, graph) once the update merge has judged the step.


def _current_graph():
    """The graph being traced, or None when executing eagerly (eager steps run one after another)."""
    return None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()


def _noted_in_this_graph(field: str):
    """The step handoff's ``field`` (a tuple whose last item is its graph) when it was noted in the graph being
    traced (or eagerly, when executing eagerly), else None."""
    noted = getattr(replica_state.current_step_handoff(), field, None)  # (None without a handoff)
    return noted if noted is not None and noted[-1] is _current_graph() else None


def pending_scaler(inner_optimizer):
    """The LossScaleOptimizer that is applying gradients through ``inner_optimizer`` in this step, else None."""
    pending = _noted_in_this_graph("loss_scale_pending")
    return pending[0] if pending and getattr(pending[0], "inner_optimizer", None) is inner_optimizer else None


def iterations_increment(variable, value):
    """``value`` times this step's finiteness when ``variable`` is the iteration counter of an inner optimizer
    whose step was judged by :func:`apply_or_skip` in this graph; ``value`` unchanged otherwise."""
    judged = _noted_in_this_graph("loss_scale_finite")
    if judged is None or variable is not getattr(judged[0], "_iterations", None):
        return value
    return value * tf.cast(judged[1], value.dtype)  # (inner optimizer, finite, graph)


def patch_loss_scale_optimizer() -> None:
    # LossScaleOptimizer._tf_apply is the TensorFlow path of LossScaleOptimizer.apply (the base apply_gradients
    # calls apply). Under our strategy, in replica context, it hands the (scaled) gradients to the inner optimizer
    # directly and marks the step as loss-scaled; the finiteness check, unscaling and the gated update then happen
    # once in the inner optimizer's cross-replica update (apply_or_skip). Anything else runs Keras' own code.
    from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer

    @patch(LossScaleOptimizer, "_tf_apply")
    def _tf_apply(original, self, grads, trainable_variables=None):
        handoff = replica_state.current_step_handoff()
        if current_hetero_strategy() is None or tf.distribute.in_cross_replica_context() or handoff is None:
            return original(self, grads, trainable_variables)
        hooks.fired(hooks.LOSS_SCALE_APPLY)
        handoff.loss_scale_pending = (self, _current_graph())
        self.inner_optimizer.apply(grads, trainable_variables=trainable_variables)
        return None

    @patch(LossScaleOptimizer, "apply")
    def apply(original, self, grads, trainable_variables=None):
        # Public entry of every loss-scaled step: records that this step needs both halves above (hooks.verify).
        if current_hetero_strategy() is not None and not tf.distribute.in_cross_replica_context():
            hooks.expect(hooks.LOSS_SCALE_APPLY, hooks.LOSS_SCALE_HOST, by="LossScaleOptimizer.apply")
        return original(self, grads, trainable_variables)


def _divide(grad, scale):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values / tf.cast(scale, grad.values.dtype), grad.indices, grad.dense_shape)
    return grad / tf.cast(scale, grad.dtype)


def apply_or_skip(scaler, inner, distribution, grads_and_vars, *, clip, update):
    """Cross-replica (the inner optimizer's update merge): one loss-scaled step, judged on the summed gradient.

    Args:
        scaler: The ``LossScaleOptimizer`` (its ``dynamic_scale``, ``step_counter``, ``dynamic_growth_steps``).
        inner: Its inner optimizer, whose update this is.
        distribution: Our strategy.
        grads_and_vars: (summed scaled gradient, variable) pairs, gradients as all-reduced values.
        clip: ``clip(grads) -> grads``: the inner optimizer's clipping of the unscaled summed gradients.
        update: ``update(grads_and_vars)``: the inner optimizer's whole host update (cross-replica): deferred
            decoupled weight decay first, then every variable's update.

    Returns:
        The finiteness of the step, a bool scalar tensor on the parameter device.
    """
    handoff = replica_state.current_step_handoff()
    if handoff is not None:
        handoff.loss_scale_pending = None  # consumed: this step's update is the one the replicas marked
    hooks.fired(hooks.LOSS_SCALE_HOST)
    # One replica's copy of each all-reduced (identical on every replica) gradient; plain tensors as they are.
    pairs = [(distribution.experimental_local_results(g)[0] if isinstance(g, tf.distribute.DistributedValues) else g, v)
             for g, v in grads_and_vars]
    with tf.device(distribution.parameter_device):
        present = [g.values if isinstance(g, tf.IndexedSlices) else g for g, _ in pairs if g is not None]
        finite = tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(values)) for values in present])) \
            if present else tf.constant(True)
        scale = tf.identity(scaler.dynamic_scale.value)
        counter = tf.identity(scaler.step_counter.value)
        unscaled = clip([None if g is None else _divide(g, scale) for g, _ in pairs])

    def apply_step():
        update(list(zip(unscaled, [v for _, v in pairs])))
        return tf.constant(True)

    tf.cond(finite, apply_step, lambda: tf.constant(False))
    if handoff is not None:
        handoff.loss_scale_finite = (inner, finite, _current_graph())
    with tf.device(distribution.parameter_device):
        growth_steps = tf.cast(scaler.dynamic_growth_steps, counter.dtype)
        grow = tf.logical_and(finite, tf.equal(counter, growth_steps - 1))
        new_counter = tf.where(tf.logical_and(finite, tf.logical_not(grow)), counter + 1, tf.zeros_like(counter))
        new_scale = tf.where(grow, scale * 2.0, tf.where(finite, scale, scale * 0.5))
    for variable, value in ((scaler.step_counter, new_counter), (scaler.dynamic_scale, new_scale)):
        distribution.extended.update(variable.value, lambda var, x: var.assign(x), args=(value,), group=False)
    return finite
