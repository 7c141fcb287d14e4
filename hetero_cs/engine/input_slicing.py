"""The input pipeline that cuts every global batch by the plan, and the unpacking of the cut inside the step.

``PlanSlicer.pack(dataset)`` keeps one element per global batch but packs every component ``t`` (``B`` examples
along axis 0) as a ``tf.RaggedTensor`` of ``R`` rows whose row lengths are the plan's per-replica batch sizes:
``[R, (b_i), ...]``, with ``t`` itself as the values (no copy). The strategy hands that element to the replicas
whole, on the host, and :func:`unpack` cuts it into replica ``i``'s slice (examples ``[sum(b_<i), sum(b_<=i))``)
inside the step, with one ``split`` op.

Why this shape. Stock ``CentralStorageStrategy`` re-batches each global batch into ``R`` pipeline elements and feeds
them to the replicas one by one. Producing ``R`` elements of plan-dependent sizes in ``tf.data`` needs a
``flat_map`` (one small dataset per batch), which costs about 0.2 ms of host CPU per batch more than stock's
``rebatch``; one packed element per batch, read by a plain iterator on the host, costs less than stock
(``benchmarks/overhead.py``).

Where the slice sizes come from. The plan is Python state of the strategy (it is solved, changed by calibration and
re-balanced online), so the pipeline asks Python for the sizes of a global batch through ``tf.numpy_function``.
That call costs about 0.2 ms of host CPU. When the plan does not change online (re-balancing off), the slicer keeps
the current plan in a small host variable, ``[B, b_0, ..., b_{R-1}]``, and a batch of exactly ``B`` examples reads
its sizes from there inside the graph; any other batch (the first one, a last partial batch, mismatched
components) still goes to Python, which validates it, solves its plan and raises the library's errors.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import tensorflow as tf

from hetero_cs._copying import DeepcopiedWithNewLocks
from hetero_cs.errors import InputError
from hetero_cs.planning.plan import BatchPlan

_UNSET = -1


def unpack(packed, num_replicas: int) -> list:
    """Replica slices of one packed component: ``[R, (b_i), ...]`` -> ``R`` tensors of ``[b_i, ...]``.

    Args:
        packed: A component of an element of :meth:`PlanSlicer.pack`: a ``tf.RaggedTensor`` whose rows are the
            replicas' slices (with ``R = 1``, the component as it is).
        num_replicas: ``R``, the number of rows.

    Returns:
        A list of ``R`` tensors (``tf.RaggedTensor`` where the dataset's own component is ragged).
    """
    if num_replicas == 1:
        return [packed]
    if isinstance(packed.values, tf.RaggedTensor):
        return [packed[i] for i in range(num_replicas)]
    return tf.split(packed.values, packed.row_lengths(), num=num_replicas)


def is_unbatched_marker(spec_or_value) -> bool:
    """True for a component that stands for "no data" and is handed to every replica as it is.

    That is None (tf.data's NoneTensorSpec, e.g. the missing sample weights of ``(x, y, None)``) and
    ``tf.experimental.Optional`` (what Keras makes of None in some of its data adapters).
    """
    # NoneTensorSpec has no public name.
    return spec_or_value is None or type(spec_or_value).__name__ == "NoneTensorSpec" or isinstance(
        spec_or_value, (tf.OptionalSpec, tf.experimental.Optional)
    )


class PlanSlicer(DeepcopiedWithNewLocks):
    """Cuts global batches into plan-sized slices for ``R`` replicas.

    Args:
        num_replicas: ``R`` >= 1.
        slice_sizes: The Python path, called from the pipeline with every component's leading dimension (numpy int64
            scalars) of one global batch; returns the ``R`` per-replica batch sizes (int64, summing to the batch
            size) or raises.
        device: Where the cached plan lives (the parameter device: host memory).
        cacheable: Whether the plan may be cached in the graph. False when the plan must be looked at for every
            batch (online re-balancing runs its check there).
    """

    def __init__(
        self,
        num_replicas: int,
        slice_sizes: Callable[..., np.ndarray],
        *,
        device: str,
        cacheable: bool,
    ):
        self._num_replicas = int(num_replicas)
        self._slice_sizes = slice_sizes
        self._lock = threading.Lock()
        self._published: tuple[int, ...] = (_UNSET,) * (self._num_replicas + 1)
        self._cache = None
        if cacheable:
            # Created outside any strategy scope and tf.function: a plain host variable, not a mirrored one.
            with tf.init_scope(), tf.device(device):
                self._cache = tf.Variable(
                    self._published, dtype=tf.int64, trainable=False, name="hetero_cs_plan_cache"
                )

    @property
    def num_replicas(self) -> int:
        """``R``, the number of slices per global batch."""
        return self._num_replicas

    @property
    def cacheable(self) -> bool:
        """Whether full global batches read their sizes from the cached plan instead of calling Python."""
        return self._cache is not None

    def publish(self, plan: BatchPlan | None) -> None:
        """Makes ``plan`` the cached plan for batches of ``plan.global_batch_size`` examples (None: no cached plan).

        Safe from any thread, including the pipeline's own (the caller serialises plan changes, so the last
        published plan is the current one). Batches already prefetched keep the sizes they were cut with.
        """
        if self._cache is None:
            return
        if plan is None:
            value = (_UNSET,) * (self._num_replicas + 1)
        else:
            value = (int(plan.global_batch_size), *(int(b) for b in plan.per_replica_batch_sizes))
        with self._lock:
            if value != self._published:
                self._cache.assign(value)
                self._published = value

    def pack(self, dataset: tf.data.Dataset) -> tf.data.Dataset:
        """Global batches -> the same global batches, every component packed as ``[R, (b_i), ...]`` by the plan.

        None and ``tf.experimental.Optional`` components stay as they are. With ``R = 1`` the components stay as
        they are (the plan is still looked up, so bad batches raise). The result ends in ``prefetch(1)``, so the size
        lookup (with online re-balancing, a Python call that also runs the re-balancing check) is done ahead of the
        step, as stock's one-batch device buffer would be.

        Raises:
            InputError: The elements are empty structures or hold only None, a component has no leading (batch)
                dimension or is a ``tf.SparseTensor``, or the components' static leading dimensions differ.
        """
        spec = dataset.element_spec
        leaves = tf.nest.flatten(spec)
        if not leaves:
            raise InputError("The dataset's elements are empty structures; there is nothing to split.")
        for leaf in leaves:
            if is_unbatched_marker(leaf):
                continue  # a None component (e.g. no sample weights): nothing to cut
            if isinstance(leaf, tf.SparseTensorSpec):
                raise InputError(
                    f"A dataset component is a tf.SparseTensor, which cannot be cut into per-replica slices; got "
                    f"element_spec={spec}. Make it dense (tf.sparse.to_dense) or ragged "
                    f"(tf.RaggedTensor.from_sparse) in a dataset.map before distributing the dataset."
                )
            shape = getattr(leaf, "shape", None)
            if shape is None or shape.rank == 0:
                raise InputError(
                    f"Every dataset component needs a leading batch dimension to be split across replicas; got "
                    f"element_spec={spec}. Batch the dataset first, e.g. dataset.batch(global_batch_size)."
                )
        batched = [leaf for leaf in leaves if not is_unbatched_marker(leaf)]
        if not batched:
            raise InputError(
                f"The dataset's elements hold only None or Optional components; there is nothing to split: {spec}."
            )
        known = sorted({leaf.shape[0] for leaf in batched if leaf.shape.rank and leaf.shape[0] is not None})
        if len(known) > 1:
            raise InputError(
                f"The dataset's components have different leading (batch) dimensions {known}; got "
                f"element_spec={spec}. Every component of a global batch needs the same number of examples; if "
                f"the dataset is not batched yet, batch it: dataset.batch(global_batch_size)."
            )
        R = self._num_replicas
        # tf.data unpacks a plain tuple into the function's arguments, but passes a namedtuple (or any other
        # structure) as one argument.
        is_tuple = type(spec) is tuple
        cache = self._cache
        slice_sizes = self._slice_sizes

        def python_sizes(dims):
            sizes = tf.numpy_function(slice_sizes, dims, tf.int64, stateful=True)
            return tf.reshape(sizes, [R])

        def leading_dim(t):
            return t.nrows(out_type=tf.int64) if isinstance(t, tf.RaggedTensor) else tf.shape(t, out_type=tf.int64)[0]

        def pack_one(t, sizes):
            if is_unbatched_marker(t):
                return t
            if R == 1:
                return tf.identity(t)
            if isinstance(t, tf.RaggedTensor):  # the outer row partition must use the component's own dtype
                sizes = tf.cast(sizes, t.row_splits.dtype)
            # validate=False: the sizes sum to the batch size (the Python path checked it, or the cached plan is for
            # exactly this size), and the check would cost an assertion op per component per batch.
            return tf.RaggedTensor.from_row_lengths(t, sizes, validate=False)

        def to_packed(*args):
            element = args if is_tuple else args[0]
            flat = tf.nest.flatten(element, expand_composites=False)
            dims = [leading_dim(t) for t in flat if not is_unbatched_marker(t)]
            if cache is None:
                sizes = python_sizes(dims)
            else:
                cached = cache.read_value()
                hit = tf.reduce_all(tf.equal(tf.stack(dims), cached[0]))
                sizes = tf.cond(hit, lambda: cached[1:], lambda: python_sizes(dims))
            with tf.control_dependencies([sizes] if R == 1 else []):  # with R = 1 the lookup only validates
                packed = [pack_one(t, sizes) for t in flat]
            return tf.nest.pack_sequence_as(element, packed)

        return dataset.map(to_packed).prefetch(1)
