"""Private touch of ``tf.GradientTape.gradient``: a loss the user reduces on their own gives its exact share.

Part of :mod:`hetero_cs.engine._compat`, the one place of private TensorFlow/Keras touches.

A ``train_step`` override or a custom loop may compute its loss without a Keras loss object or ``compute_loss``:
``loss = tf.reduce_mean(tf.square(y - model(x)))``, then ``tape.gradient(loss, model.trainable_variables)``. Under
our strategies that mean is over the replica's slice, and the host sums the replicas' gradients: summed unweighted,
the slices' means count ``sum_i mean_i`` where one device takes the mean over the whole batch.

So when a replica step takes the gradient of a floating target with respect to variables, the loss reader
(:func:`hetero_cs.engine._compat.loss_reader.gradient_terms`) rebuilds this replica's share of the target from
tensors the tape recorded (a mean over the batch weighed ``b_i / B``, a sum kept, a term of the weights alone
weighed ``b_i / B``, a masked ratio divided by the whole batch's denominator, ``tf.stop_gradient`` kept) and the
gradient is taken of those tensors with the share's output gradients, so no op is added to the forward pass.
Anything it cannot prove exact is refused with :class:`~hetero_cs.errors.LossPatternError`, naming the op.

Left as TensorFlow computes it: a target that is a share already or holds one value per example (its gradient is
that of its sum, which the replicas add up exactly), gradients with respect to tensors only (a gradient penalty's
inner tape), the gradient calls ``tape.jacobian`` makes, and eager values, which have no graph to read
(``run_eagerly=True``: a WARNING says so once, unless the step's loss went through Keras' own weighting). A loss that
needs weighing, differentiated with respect to variables and tensors in one call, is refused.
"""

import logging
import threading

import tensorflow as tf

from hetero_cs.engine._compat.loss_reader import _is_share, gradient_terms
from hetero_cs.engine._compat.context import set_locally
from hetero_cs.engine._compat.losses import weighted_step
from hetero_cs.engine._compat.symbols import patch
from hetero_cs.errors import LossPatternError

logger = logging.getLogger("hetero_cs.engine.central_storage")

_state = threading.local()  # .in_jacobian: tape.jacobian's own gradient calls; .warned_eager


def patch_gradient_tape() -> None:
    # tf.GradientTape.gradient is public API; it is wrapped (not replaced) and acts only inside a replica step of
    # our strategies that knows its global batch. Keras' own train_step differentiates compute_loss's result, a
    # share, which the wrapper leaves as it is. jacobian and batch_jacobian call gradient on slices of their target
    # (per-example gradients): those calls are TensorFlow's own.
    @patch(tf.GradientTape, "gradient")
    def gradient(original, self, target, sources, output_gradients=None, unconnected_gradients=None, **kwargs):
        if unconnected_gradients is not None:
            kwargs["unconnected_gradients"] = unconnected_gradients
        step = weighted_step()
        if step is not None and not getattr(_state, "in_jacobian", False):
            weighted = weighted_terms(step, target, sources, output_gradients)
            if weighted is not None:
                terms, coefficients = weighted
                return original(self, terms, sources, output_gradients=coefficients, **kwargs)
        return original(self, target, sources, output_gradients=output_gradients, **kwargs)

    for name in ("jacobian", "batch_jacobian"):
        patch(tf.GradientTape, name)(_outside_weighting)


def _outside_weighting(original, self, target, sources, *args, **kwargs):
    if (original.__name__ == "jacobian" and isinstance(target, tf.Tensor) and target.shape.rank == 0
            and weighted_step() is not None):
        # The jacobian of a scalar is its gradient, in the sources' shapes: weighed as a gradient is.
        unconnected = kwargs.get("unconnected_gradients", tf.UnconnectedGradients.NONE)
        return self.gradient(target, sources, unconnected_gradients=unconnected)
    with set_locally(_state, in_jacobian=True):
        return original(self, target, sources, *args, **kwargs)


def _is_variable(source) -> bool:
    from keras.src.backend.common.variables import Variable

    return isinstance(source, (tf.Variable, Variable))


def weighted_terms(step, target, sources, output_gradients=None):
    """``(tensors, output gradients)`` whose gradient is this replica's share of ``target``'s, or None when
    ``target`` needs no weighting (a share or per-example values already, or a gradient with respect to tensors).

    Raises:
        LossPatternError: The target is not provably linear in per-example values (see the module docstring), or
            the sources mix variables and tensors.
    """
    flat_sources = tf.nest.flatten(sources)
    if not flat_sources or not any(_is_variable(s) for s in flat_sources):
        return None
    targets = list(target) if isinstance(target, (list, tuple)) else [target]
    if not targets or not all(isinstance(t, tf.Tensor) and t.dtype.is_floating for t in targets):
        return None
    if tf.executing_eagerly():
        # Said once, and not when Keras' own weighting ran in this step (its loss, maybe loss-scaled).
        if not (any(_is_share(step, t) for t in targets) or step.loss_terms or getattr(_state, "warned_eager", False)):
            _state.warned_eager = True
            logger.warning(
                "hetero_cs: a loss of your own is differentiated in a replica step run eagerly (run_eagerly=True, or "
                "strategy.run outside tf.function). Without a graph hetero_cs cannot read it, and the replicas' "
                "gradients are summed as TensorFlow does: exact for a sum over the batch divided by the global batch, "
                "not for a mean over each slice. Trace the step (run_eagerly=False, @tf.function), or reduce with "
                "tf.nn.compute_average_loss(per_example, global_batch_size=hetero_cs.current_global_batch_size()).")
        return None
    # One output gradient (or None) per target.
    given = list(output_gradients) if isinstance(output_gradients, (list, tuple)) else [output_gradients]
    terms = gradient_terms(step, targets, given if len(given) == len(targets) else [None] * len(targets),
                           what="the loss differentiated in this replica step")
    if terms is None:
        return None
    if not all(_is_variable(s) for s in flat_sources):
        raise LossPatternError(
            "This gradient is taken with respect to variables and tensors in one call, of a loss whose terms "
            "hetero_cs weighs by b_i / B for the variables (the host sums the replicas' gradients). Take the "
            "variables' gradient and the tensors' gradient in separate calls (a persistent tape).")
    return terms
