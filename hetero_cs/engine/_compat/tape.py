"""Private touch of ``tf.GradientTape.gradient``: a loss the user reduces to a mean on their own is weighed b_i / B.

Part of :mod:`hetero_cs.engine._compat`, the one place of private TensorFlow/Keras touches.

A ``train_step`` override or a custom loop may compute its loss without a Keras loss object or ``compute_loss``:
``loss = tf.reduce_mean(tf.square(y - model(x)))`` (or ``keras.ops.mean``), then
``tape.gradient(loss, model.trainable_variables)`` and ``optimizer.apply(...)``. Under our strategies that mean is
over the replica's slice, and the host sums the replicas' gradients: summed unweighted, the slices' means count
``sum_i mean_i`` where one device takes the mean over the whole batch (measured before this patch: a weight of 0.20
against 0.14 on one device, split [7, 3, 0]).

So when a replica step takes the gradient of a scalar with respect to variables, the scalar is read as a linear
combination of terms (:func:`hetero_cs.engine._compat.graph_patterns.linear_terms`):

* a term hetero_cs already weighted (a Keras loss, ``compute_loss``, ``compute_average_loss``, a value divided by
  the step's ``B``), or a scalar computed from one (``LossScaleOptimizer.scale_loss``): as it is;
* a term that is visibly a sum over the batch (``tf.reduce_sum`` of per-example values, possibly divided by a
  constant global batch size, TensorFlow's older custom-loop idiom): as it is, since the replicas' sums add up to
  the batch's sum;
* any other scalar term (a mean over the slice, a regularization term every replica adds): weighed ``w_i = b_i / B``,
  which sums to 1 over the replicas, as the same term counts once on one device.

The gradient is then taken of that weighted combination (the tape's own ``output_gradients``, one per term), so no
op is added to the forward pass. Left as TensorFlow computes it: a target that is not a scalar (its gradient is the
gradient of its sum, which the replicas add up exactly), a gradient with respect to tensors rather than variables
(a gradient penalty's inner tape, say), a call that passes ``output_gradients``, and eager values, which have no
graph to read (``run_eagerly=True``: documented). A term computed inside a nested ``tf.function``, a ``tf.cond`` or a
``tf.py_function`` cannot be read either, and is refused with :class:`~hetero_cs.errors.LossPatternError`.
"""

from __future__ import annotations

import functools

import tensorflow as tf

from hetero_cs.engine import training
from hetero_cs.engine._compat.graph_patterns import linear_terms, sums_over_batch
from hetero_cs.engine._compat.losses import _is_share, weighted_step
from hetero_cs.errors import LossPatternError

# Ops whose output hetero_cs cannot see into (function calls, control flow, Python): a loss term they return could be
# a slice mean or a share. They are refused rather than guessed.
_OPAQUE_OPS = frozenset({"PartitionedCall", "StatefulPartitionedCall", "If", "StatelessIf", "While",
                         "StatelessWhile", "Case", "StatelessCase", "PyFunc", "PyFuncStateless", "EagerPyFunc"})
_MAX_SCALAR_OPS = 64  # bound on the scalar ops searched for a weighted term (a loss scale is one product away)


def _patch_gradient_tape() -> None:
    # tf.GradientTape.gradient is public API; it is wrapped (not replaced) and acts only inside a replica step of
    # our strategies that knows its global batch. Keras' own train_step differentiates compute_loss's result, a
    # share, which the wrapper leaves as it is.
    original = tf.GradientTape.gradient

    @functools.wraps(original)
    def gradient(self, target, sources, output_gradients=None, unconnected_gradients=None, **kwargs):
        if unconnected_gradients is not None:
            kwargs["unconnected_gradients"] = unconnected_gradients
        step = weighted_step()
        if step is not None and output_gradients is None and _all_variables(sources):
            weighted = weighted_terms(step, target)
            if weighted is not None:
                terms, coefficients = weighted
                return original(self, terms, sources, output_gradients=coefficients, **kwargs)
        return original(self, target, sources, output_gradients=output_gradients, **kwargs)

    tf.GradientTape.gradient = gradient


def _all_variables(sources) -> bool:
    """True when every source is a variable (a model's weights), not a tensor such as a gradient penalty's input."""
    flat = tf.nest.flatten(sources)
    return bool(flat) and all(isinstance(s, tf.Variable) or _is_keras_variable(s) for s in flat)


def _is_keras_variable(value) -> bool:
    from keras.src.backend.common.variables import Variable

    return isinstance(value, Variable)


def weighted_terms(step, target):
    """``(terms, coefficients)`` whose weighted sum is this replica's share of ``target``, or None when ``target``
    needs no weighting (it is a share already, a sum over the batch, not a scalar, or eager)."""
    if not isinstance(target, tf.Tensor) or target.shape.rank != 0 or not target.dtype.is_floating:
        return None
    if _is_share(step, target):
        return None
    terms = linear_terms(target, lambda t: _is_share(step, t))
    if terms is None:
        return None
    own = [(coeff, t) for coeff, t in terms if not _kept_as_is(step, t)]
    if not own:
        return None
    opaque = [t for _, t in own if t.op.type in _OPAQUE_OPS]
    if opaque:
        raise LossPatternError(
            f"The loss differentiated in this replica step is computed inside a {opaque[0].op.type} op (a nested "
            f"tf.function, tf.cond or tf.py_function around the loss), whose inside hetero_cs cannot read. Under "
            f"the strategy each replica's gradient must be its share of the batch's: a mean over the replica's "
            f"slice is weighed b_i / B, while a share or a sum over the batch is not, and this value could be "
            f"either. Compute the loss directly in the step (call the loss function without its own "
            f"@tf.function: the step is traced already), or return per-example losses and reduce them with "
            f"tf.nn.compute_average_loss(per_example, global_batch_size=hetero_cs.current_global_batch_size()).")
    weight = training.replica_weight(target.dtype)
    # A 0-example replica's own mean of nothing is NaN; tf.where gives it a coefficient of 0 and a gradient of 0.
    tensors, coefficients = [], []
    for coeff, t in terms:
        tensors.append(t)
        scale = tf.cast(coeff, t.dtype)
        if not _kept_as_is(step, t):
            scale = tf.where(weight > 0, scale * tf.cast(weight, t.dtype), tf.zeros_like(scale))
        coefficients.append(tf.broadcast_to(scale, tf.shape(t)))
    return tensors, coefficients


def _kept_as_is(step, term) -> bool:
    """A term whose replicas' values add up to the single-device value already: a share, a value computed from
    a share by scalar ops (a loss scale), or a sum over the batch."""
    return _is_share(step, term) or _from_a_share(step, term) or sums_over_batch(term)


def _from_a_share(step, term) -> bool:
    """True when a scalar op chain leads from a share to ``term`` (``loss * loss_scale``), searched through scalar
    tensors only: a reduction of a batch (a mean) ends the search."""
    stack, visited = [term], 0
    while stack and visited < _MAX_SCALAR_OPS:
        visited += 1
        tensor = stack.pop()
        if tensor is not term and _is_share(step, tensor):
            return True
        stack.extend(t for t in tensor.op.inputs if t.shape.rank == 0 and t.dtype.is_floating)
    return False
