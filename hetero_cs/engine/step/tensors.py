"""Small tensor helpers of the strategy: batch sizes of (ragged) components, the largest slice, the first batch."""

import numpy as np
import tensorflow as tf

from hetero_cs.errors import InputError


def leading_dim(tensor, dtype=tf.int32) -> tf.Tensor:
    """The batch size (a scalar of ``dtype``) of a tensor or ragged tensor."""
    return tensor.nrows(out_type=dtype) if isinstance(tensor, tf.RaggedTensor) else tf.shape(tensor, out_type=dtype)[0]


def dense_part(tensor):
    """A dense tensor holding ``tensor``'s data (a ragged tensor's flat values), e.g. to anchor a clock stamp on."""
    return tensor.flat_values if isinstance(tensor, tf.RaggedTensor) else tensor


def leading_dim_value(value) -> int:
    shape = np.shape(value)  # its .shape (a TensorShape, a NumPy shape), else the array's it converts to
    if len(shape) == 0:
        raise InputError(f"A batch component has no batch dimension (shape={tuple(shape)}); batch the data first.")
    return int(shape[0])


def largest(slices):
    """The slice with the most examples where that is known without running anything, else the first one."""
    known = [s.shape[0] if s.shape.rank and s.shape[0] is not None else -1 for s in slices]
    return slices[int(np.argmax(known))]


def known_unequal_shapes(components) -> bool:
    """True when every component's shape is fully known and they are not all equal (uneven eager slices)."""
    shapes = [getattr(c, "shape", None) for c in components]
    return all(s is not None and s.is_fully_defined() for s in shapes) and len({tuple(s.as_list()) for s in shapes}) > 1


def first_batch(data):
    if isinstance(data, tf.data.Dataset):
        for element in data.take(1):
            return element
        raise InputError("The dataset is empty; calibration needs one global batch.")
    if isinstance(data, (tuple, list)) and data:
        return tuple(data)
    raise InputError(
        f"Calibration needs a tf.data.Dataset of global batches or one batch (x, y); got {type(data).__name__}.")
