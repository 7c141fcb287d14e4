"""Private touch of ``tf.GradientTape.gradient``: a loss the user reduces to a mean on their own is weighed b_i / B.

Part of :mod:`hetero_cs.engine._compat`, the one place of private TensorFlow/Keras touches.

A ``train_step`` override or a custom loop may compute its loss without a Keras loss object or ``compute_loss``:
``loss = tf.reduce_mean(tf.square(y - model(x)))`` (or ``keras.ops.mean``), then
``tape.gradient(loss, model.trainable_variables)`` and ``optimizer.apply(...)``. Under our strategies that mean is
over the replica's slice, and the host sums the replicas' gradients: summed unweighted, the slices' means count
``sum_i mean_i`` where one device takes the mean over the whole batch (measured before this patch: a weight of 0.20
against 0.14 on one device, split [7, 3, 0]).

So when a replica step takes the gradient of a scalar loss (or a list of them) with respect to variables, the loss is
read as a linear combination of terms (:func:`hetero_cs.engine._compat.graph_patterns.linear_terms`; constant
factors such as ``0.5 *`` or ``/ GLOBAL_BATCH`` are part of the combination), and each term must be one of:

* a term hetero_cs already weighted (a Keras loss, ``compute_loss``, ``compute_average_loss``, a value divided by
  the step's ``B``), or a scalar computed from one (``LossScaleOptimizer.scale_loss``): kept as it is;
* a sum over the batch, ``tf.reduce_sum`` (``keras.ops.sum``) of the slice along its batch axis: kept as it is, since
  the replicas' sums add up to the batch's sum;
* a mean over the batch, ``tf.reduce_mean`` (``keras.ops.mean``) along the batch axis: weighed ``w_i = b_i / B``;
* a term that does not depend on the batch at all (a regularization term computed from the weights, which every
  replica adds): weighed ``w_i``, which sums to 1 over the replicas, as the term counts once on one device.

Anything else (``tf.nn.l2_loss`` of residuals, ``tf.norm``, ``einsum``, a term computed
inside a nested ``tf.function``, a ``tf.cond`` or a ``tf.py_function``) could be a mean or a sum and is refused with
:class:`~hetero_cs.errors.LossPatternError`, naming the op and the forms understood. The gradient is then taken of
the weighted combination (the tape's own ``output_gradients``, one per term), so no op is added to the forward pass.
A product of a term with a scalar that does not depend on the batch (``optimizer.scale_loss``, a loss weight kept in a
variable) is read as that term with the scalar in its coefficient.

Left as TensorFlow computes it: a target that is not a scalar (its gradient is the gradient of its sum, which the
replicas add up exactly), gradients with respect to tensors only (a gradient penalty's inner tape), the gradient
calls ``tape.jacobian`` makes, and eager values, which have no graph to read (``run_eagerly=True``: a WARNING says so
once, unless the step's loss went through Keras' own weighting). A loss that needs weighing, differentiated with
respect to variables and tensors in one call, is refused.
"""

from __future__ import annotations

import functools
import logging
import threading

import tensorflow as tf

from hetero_cs.engine import training
from hetero_cs.engine._compat.graph_patterns import linear_terms, means_over_batch, sums_over_batch
from hetero_cs.engine._compat.losses import _is_share, weighted_step
from hetero_cs.errors import LossPatternError

logger = logging.getLogger("hetero_cs.engine.central_storage")

# Ops whose output hetero_cs cannot see into (function calls, control flow, Python): a loss term they return could be
# a slice mean or a share.
_OPAQUE_OPS = frozenset({"PartitionedCall", "StatefulPartitionedCall", "If", "StatelessIf", "While",
                         "StatelessWhile", "Case", "StatelessCase", "PyFunc", "PyFuncStateless", "EagerPyFunc"})
_PASS_THROUGH = ("Identity", "Cast", "StopGradient")
_MAX_SCALAR_OPS = 64  # bound on the scalar ops searched for a weighted term (a loss scale is one product away)
_MAX_INDEPENDENCE_OPS = 4096  # bound on the ops searched to show a term does not depend on the batch
_state = threading.local()  # .in_jacobian: tape.jacobian's own gradient calls; .warned_eager


def _patch_gradient_tape() -> None:
    # tf.GradientTape.gradient is public API; it is wrapped (not replaced) and acts only inside a replica step of
    # our strategies that knows its global batch. Keras' own train_step differentiates compute_loss's result, a
    # share, which the wrapper leaves as it is. jacobian and batch_jacobian call gradient on slices of their target
    # (per-example gradients): those calls are TensorFlow's own.
    original = tf.GradientTape.gradient

    @functools.wraps(original)
    def gradient(self, target, sources, output_gradients=None, unconnected_gradients=None, **kwargs):
        if unconnected_gradients is not None:
            kwargs["unconnected_gradients"] = unconnected_gradients
        step = weighted_step()
        if step is not None and not getattr(_state, "in_jacobian", False):
            weighted = weighted_terms(step, target, sources, output_gradients)
            if weighted is not None:
                terms, coefficients = weighted
                return original(self, terms, sources, output_gradients=coefficients, **kwargs)
        return original(self, target, sources, output_gradients=output_gradients, **kwargs)

    tf.GradientTape.gradient = gradient
    tf.GradientTape.batch_jacobian = _outside_weighting(tf.GradientTape.batch_jacobian)
    tf.GradientTape.jacobian = _outside_weighting(tf.GradientTape.jacobian, scalar_is_gradient=True)


def _outside_weighting(method, scalar_is_gradient=False):
    @functools.wraps(method)
    def wrapped(self, target, sources, *args, **kwargs):
        if (scalar_is_gradient and isinstance(target, tf.Tensor) and target.shape.rank == 0
                and weighted_step() is not None):
            # The jacobian of a scalar is its gradient, in the sources' shapes: weighed as a gradient is.
            unconnected = kwargs.get("unconnected_gradients", tf.UnconnectedGradients.NONE)
            return self.gradient(target, sources, unconnected_gradients=unconnected)
        previous = getattr(_state, "in_jacobian", False)
        _state.in_jacobian = True
        try:
            return method(self, target, sources, *args, **kwargs)
        finally:
            _state.in_jacobian = previous

    return wrapped


def _is_variable(source) -> bool:
    from keras.src.backend.common.variables import Variable

    return isinstance(source, (tf.Variable, Variable))


def weighted_terms(step, target, sources, output_gradients=None):
    """``(terms, coefficients)`` whose weighted sum is this replica's share of ``target``, or None when ``target``
    needs no weighting (a share or a sum over the batch already, not a scalar, with respect to tensors only).

    Raises:
        LossPatternError: A term cannot be read (see the module docstring), or the sources mix variables and
            tensors.
    """
    flat_sources = tf.nest.flatten(sources)
    if not flat_sources or not any(_is_variable(s) for s in flat_sources):
        return None
    targets = list(target) if isinstance(target, (list, tuple)) else [target]
    if not targets or not all(isinstance(t, tf.Tensor) for t in targets):
        return None
    for t in targets:
        if t.shape.rank is None and _producer(t).type in _OPAQUE_OPS:
            raise _opaque_error(_producer(t).type)
        if t.shape.rank != 0 or not t.dtype.is_floating:
            return None
    if tf.executing_eagerly():
        _warn_eager_once(step, targets)
        return None
    gradients = _output_gradients(targets, output_gradients)
    terms = []
    for t, outer in zip(targets, gradients):
        found = [(1.0, t)] if _is_share(step, t) else linear_terms(t, lambda x: _is_share(step, x))
        if found is None:
            raise _unreadable_error("a combination of too many terms")
        terms.extend((coeff, term, outer) for coeff, term in found)
    terms, kinds = _read(step, terms)
    if all(kind == "keep" for kind in kinds):
        return None
    for kind, (_, term, _) in zip(kinds, terms):
        if kind == "opaque":
            raise _opaque_error(_producer(term).type)
        if kind == "unknown":
            raise _unreadable_error(f"a term computed by {_producer(term).type} ({term.name})")
    if not all(_is_variable(s) for s in flat_sources):
        raise LossPatternError(
            "This gradient is taken with respect to variables and tensors in one call, of a loss whose terms "
            "hetero_cs weighs by b_i / B for the variables (the host sums the replicas' gradients). Take the "
            "variables' gradient and the tensors' gradient in separate calls (a persistent tape).")
    weight = training.replica_weight(targets[0].dtype)
    tensors, coefficients = [], []
    for kind, (coeff, term, outer) in zip(kinds, terms):
        scale = tf.cast(coeff, term.dtype)
        if kind == "weigh":
            # A 0-example replica's own mean of nothing is NaN; its coefficient is 0, and so is its gradient.
            scale = tf.where(weight > 0, scale * tf.cast(weight, term.dtype), tf.zeros_like(scale))
        if outer is not None:
            scale = scale * tf.cast(outer, term.dtype)
        tensors.append(term)
        coefficients.append(tf.broadcast_to(scale, tf.shape(term)))
    return tensors, coefficients


def _output_gradients(targets, output_gradients) -> list:
    """One output gradient (or None) per target."""
    if output_gradients is None:
        return [None] * len(targets)
    given = list(output_gradients) if isinstance(output_gradients, (list, tuple)) else [output_gradients]
    return given if len(given) == len(targets) else [None] * len(targets)


def _read(step, terms):
    """``terms`` with products by a scalar that does not depend on the batch (a loss scale, a loss weight kept in a
    variable) opened up: the scalar joins the coefficient. Returns the terms and their kinds."""
    queue, read, kinds = list(terms), [], []
    while queue:
        coeff, term, outer = queue.pop()
        kind = _kind(step, term)
        split = _scalar_factor(term) if kind == "unknown" else None
        inner = None if split is None else linear_terms(split[1], lambda x: _is_share(step, x))
        if inner is None:
            read.append((coeff, term, outer))
            kinds.append(kind)
            continue
        queue.extend((coeff * split[0] * c, t, outer) for c, t in inner)
    return read, kinds


def _scalar_factor(term):
    """``(factor, other)`` when ``term`` is ``factor * other`` or ``other / divisor`` (``factor = 1 / divisor``) of
    scalars, the factor independent of the batch and the other not; else None."""
    op = _producer(term)
    if len(op.inputs) != 2 or any(t.shape.rank != 0 for t in op.inputs):
        return None
    a, b = op.inputs
    if op.type == "Mul":
        for factor, other in ((a, b), (b, a)):
            if _independent_of_the_batch(factor) and not _independent_of_the_batch(other):
                return tf.cast(factor, term.dtype), other
    elif op.type in ("RealDiv", "DivNoNan") and _independent_of_the_batch(b) and not _independent_of_the_batch(a):
        return tf.math.reciprocal(tf.cast(b, term.dtype)), a
    return None


def _kind(step, term) -> str:
    """"keep" (a share, or a sum over the batch), "weigh" (a mean over the batch, or independent of the batch),
    "opaque" (computed by an op hetero_cs cannot see into) or "unknown"."""
    if _is_share(step, term) or _from_a_share(step, term) or sums_over_batch(term):
        return "keep"
    if means_over_batch(term) or _independent_of_the_batch(term):
        return "weigh"
    return "opaque" if _producer(term).type in _OPAQUE_OPS else "unknown"


def _producer(tensor):
    op = tensor.op
    while op.type in _PASS_THROUGH and op.inputs:
        op = op.inputs[0].op
    return op


def _independent_of_the_batch(value) -> bool:
    """True when no tensor ``value`` is computed from has an unknown leading (batch) dimension: a term computed from
    the weights only (a regularization term). Bounded; False when the bound is reached or an op is opaque."""
    stack, seen = [value], set()
    while stack:
        tensor = stack.pop()
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        if len(seen) > _MAX_INDEPENDENCE_OPS:
            return False
        if tensor.dtype != tf.resource and tensor.shape.rank != 0 and (
                tensor.shape.rank is None or tensor.shape[0] is None):
            return False
        if tensor.op.type in _OPAQUE_OPS or tensor.op.type == "Placeholder" and tensor.dtype != tf.resource:
            return False  # a function's input (a captured tensor of unknown origin) is not known to be the weights
        stack.extend(tensor.op.inputs)
    return True


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


_FORMS = ("Under HeteroCentralStorageStrategy the host sums the replicas' gradients, so each replica's loss must be "
          "its share of the batch's: hetero_cs reads a loss you reduce yourself as a sum of terms, and understands "
          "tf.reduce_mean / keras.ops.mean along the batch axis (weighed b_i / B), tf.reduce_sum / keras.ops.sum "
          "along it (kept: the replicas' sums add up), terms computed from the weights only (weighed b_i / B: "
          "counted once), Keras losses and compute_loss, each possibly times a constant.")


def _unreadable_error(what: str) -> LossPatternError:
    return LossPatternError(
        f"The loss differentiated in this replica step holds {what}, which hetero_cs cannot tell to be a mean or a "
        f"sum over the batch. {_FORMS} Write the loss in those forms (e.g. tf.reduce_mean(tf.square(y - y_pred)) "
        f"instead of tf.nn.l2_loss or tf.norm, a constant weight instead of a variable one), or return per-example "
        f"losses and reduce them with tf.nn.compute_average_loss(per_example, "
        f"global_batch_size=hetero_cs.current_global_batch_size()).")


def _opaque_error(op_type: str) -> LossPatternError:
    return LossPatternError(
        f"The loss differentiated in this replica step is computed inside a {op_type} op (a nested tf.function, "
        f"tf.cond or tf.py_function around the loss), whose inside hetero_cs cannot read. {_FORMS} Compute the loss "
        f"directly in the step (call the loss function without its own @tf.function: the step is traced already), "
        f"or return per-example losses and reduce them with tf.nn.compute_average_loss(per_example, "
        f"global_batch_size=hetero_cs.current_global_batch_size()).")


def _warn_eager_once(step, targets) -> None:
    if any(_is_share(step, t) for t in targets) or step.loss_terms or getattr(_state, "warned_eager", False):
        return  # Keras' own weighting ran in this step (its loss, maybe loss-scaled)
    _state.warned_eager = True
    logger.warning(
        "hetero_cs: a loss of your own is differentiated in a replica step run eagerly (run_eagerly=True, or "
        "strategy.run outside tf.function). Without a graph hetero_cs cannot read it, and the replicas' gradients "
        "are summed as TensorFlow does: exact for a sum over the batch divided by the global batch, not for a mean "
        "over each slice. Trace the step (run_eagerly=False, @tf.function), or reduce with "
        "tf.nn.compute_average_loss(per_example, global_batch_size=hetero_cs.current_global_batch_size()).")
