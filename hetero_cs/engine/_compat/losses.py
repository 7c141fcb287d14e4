"""Private touches of Keras' losses and loss tracking: every replica's loss is its exact share of the global batch's.

Part of :mod:`hetero_cs.engine._compat`, the one place of private TensorFlow/Keras touches.

Replica ``i`` holds ``b_i`` of the ``B`` examples; the host sums the replicas' gradients, so each replica's loss
must be its *share*: the part of the single-device loss that its examples contribute. For a per-example mean that
is the slice mean times ``w_i = b_i / B``. Keras reduces losses in a few places, and each is made exact here:

* ``reduce_values`` (per-example losses, reduction ``"sum_over_batch_size"``): Keras' ``1 / R`` scaling becomes
  ``w_i`` (:func:`patch_loss_module`).
* A loss that returns a scalar (a loss function that reduces itself): a slice mean, weighed ``w_i``. With
  reduction ``"sum"`` or None, or with sample weights or a mask, it cannot be weighed: ``LossPatternError``.
* A mask (``mask_zero=True``, ``Masking``), and reduction ``"mean_with_sample_weight"``: the normaliser (unmasked
  count, sum of sample weights) is the whole batch's, all-reduced over the replicas, not the slice's.
* ``compute_loss``: a result that is Keras' own is already a share; an override's own scalar terms and the layers'
  ``add_loss`` values (``ops.mean`` of the batch, ``ops.sum(self.losses)``) are slice means and weigh ``w_i``, except
  terms visibly summed over the batch (``tf.reduce_sum`` along it), which are kept as they are; found through the
  graph by the loss reader (:func:`hetero_cs.engine._compat.loss_reader.share_of`).
* ``keras.metrics.Mean`` given one scalar per step without a sample weight (the loss tracker of Keras' guide, a
  per-output loss metric): a share counts as ``share / w_i`` with weight ``w_i``, any other scalar (a slice mean)
  with weight ``w_i``; over the replicas that is one value per step, as on one device.
* A loss function's scalar that is visibly a sum over the batch cannot be a slice mean: ``LossPatternError``. A
  ``compute_loss`` term or an ``add_loss`` value visibly summed over the batch is kept as the replica's part of the
  sum (:func:`_as_share`, ``_aggregate_additional_loss``).

Shares are remembered per replica step (:attr:`hetero_cs.engine.step.replica_state.ReplicaStep.loss_terms`); a value visibly
divided by the step's ``B`` (``tf.nn.compute_average_loss(..., global_batch_size=current_global_batch_size())``)
is one too.
"""

import contextlib
import numbers
import threading

import tensorflow as tf

from hetero_cs.engine.step import replica_state
from hetero_cs.engine._compat import hooks, symbols
from hetero_cs.engine._compat.context import (
    current_weighting_strategy, in_stateless_scope, is_ours, note_for_micro_batches, set_locally, strategy_of,
)
from hetero_cs.engine._compat.batch_kinds import MIXED
from hetero_cs.engine._compat.loss_reader import _is_share, _weigh, all_reduced_sum, flow_of, share_of
from hetero_cs.engine._compat.symbols import patch
from hetero_cs.engine._compat.variables import _central_in_replica_context, writing_shares
from hetero_cs.errors import BatchCouplingError, HeteroCSError, LossPatternError

_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean", "mean_with_sample_weight")
_current_loss = threading.local()  # the Loss object being called in this thread (for error messages)


def weighted_step():
    """The replica step being run when it is ours and knows its global batch (the b_i / B weighting applies)."""
    step = replica_state.current_replica_step()  # not None when one of our strategies runs a replica step
    return step if current_weighting_strategy() is not None and step.global_batch_size is not None else None


def _patch_weighted(owner, name: str):
    """Like :func:`hetero_cs.engine._compat.symbols.patch`, for a patch that acts only in a :func:`weighted_step`:
    the decorated function is called with the original and that step first; elsewhere the original runs
    unchanged."""

    def install(function):
        @patch(owner, name)
        def dispatch(original, *args, **kwargs):
            step = weighted_step()
            return original(*args, **kwargs) if step is None else function(original, step, *args, **kwargs)

        return dispatch

    return install


def _register(step, value):
    step.loss_terms.add(value.ref())
    return value


def patch_compute_average_loss() -> None:
    # tf.nn.compute_average_loss(per_example_loss) without global_batch_size takes the global batch to be the
    # replica's slice size times the replica count, so every replica's mean weighs 1/R instead of b_i/B: wrong on
    # any uneven split (and under stock strategies on a last batch that does not divide by R). Inside a replica step
    # of our strategies, which knows the step's B, the step's B is passed: the single-device mean over the global
    # batch, and a value divided by B, which the loss patches take as a share. Elsewhere TensorFlow's own runs.
    # Public TensorFlow API, patched where tf.nn exports it and in its private home module (nn_impl_distribute;
    # nn_impl in TensorFlow before 2.13 is not supported anyway), which other TensorFlow code calls.
    from tensorflow.python.ops import nn_impl_distribute

    @_patch_weighted(nn_impl_distribute, "compute_average_loss")
    def compute_average_loss(original, step, per_example_loss, sample_weight=None, global_batch_size=None):
        if global_batch_size is None:
            global_batch_size = step.global_batch_size
        return original(per_example_loss, sample_weight=sample_weight, global_batch_size=global_batch_size)

    tf.nn.compute_average_loss = compute_average_loss

    # tf.nn.scale_regularization_loss divides a term every replica adds by the replica count. A replica with 0
    # examples runs nothing under our central-storage strategy (hetero_cs.engine.step.idle_replicas), so only the active
    # replicas add it and 1/R would undercount it. Inside a replica step of our strategies the term is read as any
    # loss is: one every replica adds alike (a weight penalty) weighs b_i / B, which sums to 1 over the replicas that
    # hold the batch, idle ones or not; one computed from the slice (an activity loss in model.losses) is the
    # replica's share of one device's term (a sum over the slice as it is), as one device divides it by 1.
    @_patch_weighted(nn_impl_distribute, "scale_regularization_loss")
    def scale_regularization_loss(original, step, regularization_loss):
        return _register(step, share_of(step, tf.reduce_sum(regularization_loss),
                                        what="the term tf.nn.scale_regularization_loss scales"))

    tf.nn.scale_regularization_loss = scale_regularization_loss


def patch_loss_module() -> None:
    # keras.src.losses.loss.scale_loss_for_distribution multiplies every replica's mean loss by 1/num_replicas
    # (and unscale_loss_for_distribution undoes it for the logged loss). Both are looked up as module attributes at
    # call time (by Loss.__call__ via reduce_values, the TF trainer and compile_utils), so replacing the module
    # attributes reaches every caller. Under our strategy the factor is b_i / B instead.
    from keras.src.losses import loss as loss_module

    @_patch_weighted(loss_module, "scale_loss_for_distribution")
    def scale_loss_for_distribution(original, step, value):
        hooks.fired(hooks.LOSS_SCALE)
        return _register(step, share_of(step, value, what=f"the loss {_loss_name()}"))

    @_patch_weighted(loss_module, "unscale_loss_for_distribution")
    def unscale_loss_for_distribution(original, step, value):
        hooks.fired(hooks.LOSS_UNSCALE)
        # divide_no_nan: a 0-example replica logs 0 (with sample weight 0), never NaN.
        return tf.math.divide_no_nan(value, replica_state.replica_weight(value.dtype))

    # Loss.__call__ reduces through the module attribute reduce_weighted_values (looked up at call time), so
    # replacing it reaches every Keras loss. Loss.__call__ itself is wrapped only to name the loss in errors.
    @_patch_weighted(loss_module.Loss, "__call__")
    def call(original, step, self, y_true, y_pred, sample_weight=None):
        hooks.expect(hooks.LOSS_REDUCE, by=f"the loss {self.name!r} (Loss.__call__)")
        with set_locally(_current_loss, loss=self):
            return original(self, y_true, y_pred, sample_weight=sample_weight)

    @_patch_weighted(loss_module, "reduce_weighted_values")
    def reduce_weighted_values(original, step, values, sample_weight=None, mask=None,
                               reduction="sum_over_batch_size", dtype=None):
        from keras.src import ops

        hooks.fired(hooks.LOSS_REDUCE)
        reduction = loss_module.standardize_reduction(reduction)
        values = ops.convert_to_tensor(values, dtype=dtype)  # as Keras' own: casts to the loss's dtype
        if values.shape.rank == 0:  # a loss that reduced itself to a scalar: this replica's share (the loss reader)
            if sample_weight is not None or mask is not None:
                given = "sample weights (sample_weight or class_weight)" if sample_weight is not None else "a mask"
                raise LossPatternError(
                    f"The loss {_loss_name()} returned a scalar, but the batch has {given}. Under "
                    f"HeteroCentralStorageStrategy each replica's loss must be its share of the whole batch's loss, "
                    f"and a scalar that was reduced before the weights apply cannot be weighted per example (on one "
                    f"device the result would not be a weighted mean either). Return per-example losses (shape "
                    f"[batch, ...], e.g. without the final tf.reduce_mean) and let the loss reduction apply the "
                    f"weights.")
            return _register(step, share_of(step, values, what=f"the loss {_loss_name()}"))
        _refuse_mixed_examples(step, values, sample_weight, mask)
        # A mean whose normaliser (the unmasked count, the sum of sample weights) must be the whole batch's:
        if reduction in _MEAN_REDUCTIONS and (
                mask is not None or (reduction == "mean_with_sample_weight" and sample_weight is not None)):
            return _register(step, _globally_normalised(values, sample_weight, mask, reduction, dtype, loss_module))
        if reduction in _MEAN_REDUCTIONS and not tf.executing_eagerly() and tuple(values.shape) != (0,):
            # Keras' reduce_values weighs a mean through the module's scale_loss_for_distribution (patched).
            hooks.expect(hooks.LOSS_SCALE, by=f"reduction={reduction!r} of a Keras loss")
        result = original(values, sample_weight=sample_weight, mask=mask, reduction=reduction, dtype=dtype)
        if reduction not in (None, "none") and result.shape.rank != 0:
            # Keras returns losses of static shape (0,) unreduced (eagerly, a 0-example slice): their share is a
            # scalar 0, not an empty vector (whose mean in the loss tracker would be NaN).
            result = tf.reduce_sum(result)
        return _register(step, result)


def _loss_name() -> str:
    loss = getattr(_current_loss, "loss", None)
    name = getattr(loss, "name", None) or type(loss).__name__
    fn = getattr(loss, "fn", None)  # LossFunctionWrapper: the user's function
    return f"{name!r} ({getattr(fn, '__qualname__', fn)})" if fn is not None else repr(name)


def _refuse_mixed_examples(step, values, sample_weight, mask) -> None:
    """Refuses per-example loss values (or their weights or mask) that mix examples. Eagerly there is no graph."""
    if tf.executing_eagerly():
        return
    flow = flow_of(step)
    for name, tensor in (("values", values), ("sample weights", sample_weight), ("mask", mask)):
        if isinstance(tensor, tf.Tensor) and flow.kind(tensor).what == MIXED:
            raise BatchCouplingError(
                f"hetero_cs cannot split the loss {_loss_name()}: the {name} it reduces are not one per example "
                f"- its {flow.kind(tensor).reason} - so each replica's loss would not add up to one device's on the "
                f"whole batch. Where examples do meet (pairs, in-batch negatives, a batch statistic), train this "
                f"model on one device.")


def _globally_normalised(values, sample_weight, mask, reduction, dtype, loss_module):
    """Keras' reduce_weighted_values with the normaliser of the whole global batch (summed over the replicas).

    Masked mean (reduction "sum_over_batch_size" / "mean"): sum(loss * sample_weight * mask) / unmasked count.
    "mean_with_sample_weight": sum(loss * weight) / sum(weight), the weight being sample_weight times the mask.
    Keras divides by the slice's own count or sum; here the count or sum is all-reduced, so each replica's value
    is its share and the shares add up to the single-device loss (0 for a 0-example slice).
    """
    note_for_micro_batches("normalised_loss")  # each micro-batch would have its own normaliser
    squeeze = loss_module.squeeze_or_expand_to_same_rank
    weights = None if sample_weight is None else tf.cast(tf.convert_to_tensor(sample_weight), values.dtype)
    float_mask = None if mask is None else tf.cast(tf.convert_to_tensor(mask), values.dtype)
    if float_mask is not None and weights is not None:
        masked, weights = squeeze(float_mask, weights)
        weights = weights * masked
    elif float_mask is not None:
        weights = float_mask
    values, weights = squeeze(values, weights)
    weighted = values * weights
    numerator = tf.reduce_sum(weighted)
    if reduction == "mean_with_sample_weight":
        local_normaliser, ratio = tf.reduce_sum(weights), tf.constant(1, values.dtype)
    else:
        # Keras weighs unmasked entries total/valid and divides by the number of loss values; total/size is a
        # shape constant (1 when the mask has the loss's shape), kept as is.
        local_normaliser = tf.reduce_sum(float_mask)
        ratio = tf.math.divide_no_nan(tf.cast(tf.size(float_mask), values.dtype), tf.cast(tf.size(weighted), values.dtype))
    normaliser = all_reduced_sum(tf.stop_gradient(local_normaliser))
    return tf.math.divide_no_nan(numerator * ratio, normaliser)


def patch_compute_loss() -> None:
    # Trainer.compute_loss (Keras' own) sums shares: the compiled loss's and the scaled add_loss / regularization
    # terms; its result is remembered as a share. Trainer._compute_loss is what Keras' train_step and test_step
    # call, and compute_loss overrides of models compiled under our strategy are wrapped at compile: an override's
    # result is turned into a share there (_as_share). Other strategies call the originals.
    Trainer = symbols.require("keras.src.trainers.trainer", "Trainer")
    Loss = symbols.require("keras.src.losses.loss", "Loss")

    @patch(Trainer, "compute_loss")
    def compute_loss(original, self, *args, **kwargs):
        with _library_errors_unwrapped():
            result = original(self, *args, **kwargs)
        step = weighted_step()
        if step is not None and result is not None:
            _register(step, result)
        return result

    @_patch_weighted(Trainer, "_compute_loss")
    def _compute_loss(original, step, self, *args, **kwargs):
        # Keras' train_step and test_step log this loss through unscale_loss_for_distribution (patched).
        hooks.expect(hooks.LOSS_UNSCALE, by="Trainer._compute_loss (the logged loss)")
        with _library_errors_unwrapped():
            return _share_of(original, step, self, *args, **kwargs)

    @patch(Trainer, "compile")
    def compile(original, self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if is_ours(strategy_of(self)):
            _wrap_overrides(type(self), Trainer, "compute_loss")
            # A compiled loss class's own __call__ skips Keras' Loss.__call__, where a loss becomes a share (its
            # reduction, patched): its scalar (a slice mean) is read as a compute_loss override's terms are.
            for loss in (loss for loss in tf.nest.flatten(getattr(self, "loss", None)) if isinstance(loss, Loss)):
                _wrap_overrides(type(loss), Loss, "__call__")
        return result


@contextlib.contextmanager
def _library_errors_unwrapped():
    """Re-raises a hetero_cs error that Keras wrapped in a ValueError while computing a loss as itself.

    Keras after 3.15 (keras-nightly 3.16.0.dev, CompileLoss._call_loss) catches a ValueError from a loss and raises a
    new ValueError ("Error when computing loss for output ...") from it; a LossPatternError is a ValueError, and
    ``except hetero_cs.LossPatternError`` would no longer catch it.
    """
    try:
        yield
    except ValueError as exc:
        if isinstance(exc.__cause__, HeteroCSError) and not isinstance(exc, HeteroCSError):
            raise exc.__cause__ from None
        raise


def _wrap_overrides(cls, base, name: str) -> None:
    """Wraps every ``name`` (a model's compute_loss, a loss's __call__) that ``cls`` defines above Keras' ``base``
    (once; dispatching on our strategy): its result is read as a share (:func:`_share_of`)."""
    for owner in cls.__mro__:
        if owner is base:
            return
        override = owner.__dict__.get(name)
        if callable(override) and not getattr(override, "_hetero_cs_share", False):
            _patch_weighted(owner, name)(_share_of)._hetero_cs_share = True


def _share_of(call, step, self, *args, **kwargs):
    """``call(self, ...)`` (Keras' ``_compute_loss``, an override of ``compute_loss`` or of a loss's ``__call__``) as
    this replica's share in the weighted ``step`` (elsewhere :func:`_patch_weighted` calls ``call`` unchanged)."""
    before, name, result = len(step.loss_terms), type(self).__name__, call(self, *args, **kwargs)
    model = hasattr(self, "compute_loss")  # else a loss's own __call__: one number, or refused
    if not model and getattr(getattr(result, "shape", None), "rank", None) != 0:
        raise LossPatternError(f"The loss {name}.__call__ returned shape {getattr(result, 'shape', None)}, not one "
                               f"number: return a scalar (a mean or a sum over the batch), or override call() instead.")
    return _as_share(result, step, before, f"compute_loss of {name}" if model else f"{name}.__call__")


def _as_share(result, step, before: int, what: str):
    """A compute_loss result as this replica's share: Keras' own terms as they are, the rest weighed b_i / B."""
    if result is None or getattr(getattr(result, "shape", None), "rank", None) != 0 or _is_share(step, result):
        return result
    if tf.executing_eagerly():  # no graph to read
        if len(step.loss_terms) == before:  # nothing of Keras' weighting ran in the call: all of it is its own
            return _register(step, _weigh(result))
        raise LossPatternError(
            f"{what} returned a value that mixes Keras' own loss terms (already weighted by "
            f"hetero_cs) with terms of its own, and with run_eagerly=True the value has no graph that tells them "
            f"apart. Compile without run_eagerly=True, or return either Keras' loss alone or only your own scalar "
            f"(a mean over the batch, which hetero_cs weighs by b_i / B).")
    # Keras' own terms are shares already; the override's own (a mean, a sum, a regularization term, a masked ratio)
    # are read by the loss reader.
    return _register(step, share_of(step, result, what=f"the loss {what} returned"))


def patch_mean_metric() -> None:
    # keras.metrics.Mean.update_state(scalar) without a sample weight counts 1 per call, so R replicas would count
    # R per step and the mean would come out R times too small (Keras' guide: a Mean tracking compute_loss's
    # value in a custom train_step), or average slices unweighted (per-output loss metrics). Under our strategy
    # such a scalar counts w_i = b_i / B per replica: one per step, as on one device.
    # A sample weight that is a positive number, not a tensor, is the same in every step of a trace: Keras'
    # CompileLoss weighs each per-output loss tracker by the batch's static size (1 a step where it has none), and
    # code after Keras' own does the same (`sample_weight=x.shape[0]`). One device's steps of an epoch then all weigh
    # alike, so its mean is the mean of the steps' values. In a replica step of ours such a value counts one per step
    # too (as without a sample weight): the slices of a weighted step have no static size, and a card alone's step
    # (whole batch) may know it where one device's step does not.
    from keras.src.metrics.reduction_metrics import Mean

    @patch(Mean, "update_state")
    def update_state(original, self, values, sample_weight=None):
        if weighted_step() is not None and not in_stateless_scope() and any(
                _central_in_replica_context(v) is not None for v in self.variables):
            hooks.expect(hooks.VARIABLE_WRITE, by=f"the metric {self.name!r} (Mean.update_state)")
        if isinstance(sample_weight, numbers.Real) and sample_weight > 0 and not tf.executing_eagerly() and \
                replica_state.current_replica_step() is not None:
            sample_weight = None  # the same every step of the trace: one per step, as above (eagerly, a batch's
            # size is known in every step, partial ones too, and weighs it there as on one device)
        step = weighted_step()
        if step is None or (in_stateless_scope() and not getattr(_compiled, "replica_step", False)):
            return original(self, values, sample_weight=sample_weight)
        tensor = values if isinstance(values, tf.Tensor) else tf.convert_to_tensor(values)
        if tensor.shape.rank != 0 or sample_weight is not None and (
                tf.executing_eagerly() or not _is_share(step, tensor)):
            return original(self, values, sample_weight=sample_weight)
        share = tf.cast(share_of(step, tensor, what=f"the value given to the Mean metric {self.name!r}"), self.dtype)
        if sample_weight is None:
            # One device counts the step's value once: each replica adds its share with weight w_i (summed: the
            # value, with weight 1).
            weight, weighed = replica_state.replica_weight(self.dtype), share
        else:
            # compute_loss's value (a share) under a weight of the user's (tf.shape(x)[0], a constant): one device
            # adds value * weight to the total and the weight to the count. Each replica adds its share of the
            # weight, and its share of the value times the whole batch's weight.
            weight = tf.cast(share_of(step, tf.cast(sample_weight, self.dtype),
                                      what=f"the sample weight given to the Mean metric {self.name!r}"), self.dtype)
            weighed = share * all_reduced_sum(tf.stop_gradient(weight))
        # A replica whose weight is 0 (no examples) adds 0 with weight 0, never NaN.
        tensor = tf.where(weight != 0, tf.math.divide_no_nan(weighed, weight), tf.zeros_like(weighed))
        with writing_shares():
            return original(self, tensor, sample_weight=weight)


_compiled = threading.local()  # .replica_step: a replica's compiled forward pass is being traced (see below)


def weighing_in_compiled_replica_step():
    """Within: a Mean updated in Keras' stateless scope still counts a scalar ``w_i`` (as in the plain step).

    The cut train step (:mod:`hetero_cs.engine._compat.replica_pass`) traces the forward pass and the loss in a
    stateless scope whose recorded metric sums it adds to the central variables after; Keras' per-output loss
    trackers are updated in there, and must be weighed as in the plain step. Keras' own stateless API elsewhere is
    left as it is.
    """
    return set_locally(_compiled, replica_step=True)


def patch_layer_losses() -> None:
    # A Keras layer keeps the losses its call adds (add_loss, activity regularizers) in one list on the layer object,
    # cleared when a top-level call starts. The replicas call the same layer objects at once, in threads of their
    # own: a replica could read another's terms (measured: after a BatchNormalization, whose statistics all-reduce
    # lines the replicas up, every replica's compute_loss summed all three replicas' activity losses; the logged
    # loss was 7 % too high, the gradients right, since each tape sees its own thread only). Inside a replica step of
    # our strategies each replica keeps its own list, on its ReplicaStep; elsewhere Keras' own list is used.
    from keras import ops  # public: keras.src.backend.is_tensor is gone in keras-nightly 3.16.0.dev
    from keras.src.layers.layer import Layer

    def replica_list(layer):
        step = replica_state.current_replica_step()
        return None if step is None or in_stateless_scope() else step.layer_losses.setdefault(id(layer), [])

    @patch(Layer, "add_loss")
    def add_loss(original, self, loss):
        own = replica_list(self)
        values = tf.nest.flatten(loss)
        if own is None or not all(ops.is_tensor(value) for value in values):
            return original(self, loss)  # Keras' list, or Keras' error for a value that is not a tensor
        own.extend(values)
        return None

    @patch(Layer, "_get_own_losses")
    def _get_own_losses(original, self):
        own = replica_list(self)
        return original(self) if own is None else list(own)

    @patch(Layer, "_clear_losses")
    def _clear_losses(original, self):
        own = replica_list(self)
        if own is None:
            return original(self)
        own.clear()
        for layer in getattr(self, "_layers", ()):  # Keras' own recursion (private: its tracked sublayers)
            layer._clear_losses()  # noqa: SLF001
        return None

