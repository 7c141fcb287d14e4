"""Private touch of Keras' BatchNormalization: in training, the statistics of the global batch, on every split.

Part of :mod:`hetero_cs.engine._compat`, the one place of private TensorFlow/Keras touches.

One device normalises a training batch by the mean and variance of the whole batch. Under a strategy, Keras'
default ``BatchNormalization(synchronized=False)`` normalises each replica's slice by the slice's own statistics:
that is not the single-device step on any uneven split (and not on an even one either), and a replica with 0
examples (a 0 share, or a last batch smaller than the replica count) computes 0 / 0, which turns the layer's
weights and moving statistics into NaN after one step. ``synchronized=True`` all-reduces the statistics, but
computes the variance as E[x^2] - E[x]^2, and Keras ignores it for masked inputs.

Under hetero_cs's strategies, inside a replica step, every BatchNormalization layer in training takes the global
batch's statistics the way one device computes them (:func:`global_moments`): the mean from the all-reduced sums
and counts, then the variance from the all-reduced sums of squared deviations from that mean (two passes, as
``tf.nn.moments`` on one device); with a mask, Keras' own masked formula over the whole batch's unmasked entries.
A replica with 0 examples contributes 0 to every sum and takes the global statistics like the others: never NaN.
It costs two all-reduces of per-channel vectors per layer and step, through the parameter device.
"""

import tensorflow as tf

from hetero_cs.engine._compat.loss_reader import all_reduced_sum
from hetero_cs.engine._compat.context import note_for_micro_batches
from hetero_cs.engine._compat.losses import weighted_step
from hetero_cs.engine._compat.symbols import patch


def global_moments(inputs, axes, mask=None, epsilon: float = 1e-7):
    """The mean and variance of ``inputs`` over ``axes`` across every replica's slice of the step's global batch.

    Called in replica context. Float16 / bfloat16 inputs are reduced in float32 and the results cast back (clipped
    to the dtype's range), as Keras' own ``moments`` does.

    Args:
        inputs: This replica's slice, ``[b_i, ...]``.
        axes: The reduction axes (BatchNormalization's ``_reduction_axes``; axis 0 among them).
        mask: None, or a boolean mask of ``inputs``' shape without its last axis (Keras' masked BatchNormalization).
        epsilon: Added to the masked count, as Keras' masked formula does.

    Returns:
        ``(mean, variance)``, each of the kept axes' shape (squeezed), in ``inputs``' dtype.
    """
    dtype = inputs.dtype
    x = tf.cast(inputs, tf.float32) if dtype in (tf.float16, tf.bfloat16) else inputs
    weights = tf.ones_like(x) if mask is None else tf.cast(
        tf.broadcast_to(tf.expand_dims(mask, -1), tf.shape(x)), x.dtype)
    local = [tf.reduce_sum(x * weights, axes, keepdims=True), tf.reduce_sum(weights, axes, keepdims=True)]
    total, count = all_reduced_sum(local)
    if mask is not None:
        count = count + tf.cast(epsilon, x.dtype)
    mean = tf.math.divide_no_nan(total, count) if mask is None else total / count
    squares = all_reduced_sum(tf.reduce_sum(tf.square(x - mean) * weights, axes, keepdims=True))
    variance = tf.math.divide_no_nan(squares, count) if mask is None else squares / count
    mean, variance = tf.squeeze(mean, axes), tf.squeeze(variance, axes)
    if x.dtype != dtype:
        mean, variance = (tf.cast(tf.clip_by_value(v, dtype.min, dtype.max), dtype) for v in (mean, variance))
    return mean, variance


def patch_batch_normalization() -> None:
    # BatchNormalization._moments is where Keras computes a training batch's statistics (its call then normalises
    # by them and updates the moving statistics). Under our strategies, in a replica step that knows its global
    # batch, it returns the global batch's statistics instead (module docstring); elsewhere Keras' own runs.
    from keras.src import backend
    from keras.src.layers.normalization.batch_normalization import BatchNormalization

    @patch(BatchNormalization, "_moments")
    def _moments(original, self, inputs, mask):
        if weighted_step() is None or tf.distribute.get_replica_context() is None:
            return original(self, inputs, mask)
        note_for_micro_batches("batch_norm")  # micro-batches would each normalise by their own statistics
        return global_moments(inputs, self._reduction_axes, mask, epsilon=backend.epsilon())  # noqa: SLF001
