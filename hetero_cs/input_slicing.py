"""The input pipeline that cuts every global batch into the plan's per-replica slices.

``PlanSlicer.slice(dataset)`` turns a dataset of global batches into one of ``R`` consecutive slices per batch:
element ``k * R + i`` is replica ``i``'s slice of global batch ``k``, which is the order in which ``tf.distribute``
hands the elements of one input pipeline to the replicas of one worker.

Where the slice sizes come from. The plan is Python state of the strategy (it is solved, changed by calibration and
re-balanced online), so the pipeline asks Python for the sizes of each global batch through ``tf.numpy_function``.
That call costs about 0.2 ms of host CPU per batch, which competes with the replicas' compute when they share the
host's cores. When the plan does not change online (re-balancing off), the slicer keeps the current plan in a small
host variable, ``[B, b_0, ..., b_{R-1}]``, and a batch of exactly ``B`` examples reads its sizes from there inside
the graph; any other batch (the first one, a last partial batch, mismatched components) still goes to Python, which
validates it, solves its plan and raises the library's errors.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import tensorflow as tf

from hetero_cs.errors import InputError
from hetero_cs.plan import BatchPlan

_UNSET = -1


class PlanSlicer:
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

    def slice(self, dataset: tf.data.Dataset) -> tf.data.Dataset:
        """Global batches -> ``R`` consecutive slices per batch (replica ``i`` gets element ``k * R + i``).

        Raises:
            InputError: The elements are empty structures, a component has no leading (batch) dimension, or the
                components' static leading dimensions differ.
        """
        spec = dataset.element_spec
        leaves = tf.nest.flatten(spec)
        if not leaves:
            raise InputError("The dataset's elements are empty structures; there is nothing to split.")
        for leaf in leaves:
            shape = getattr(leaf, "shape", None)
            if shape is None or shape.rank == 0:
                raise InputError(
                    f"Every dataset component needs a leading batch dimension to be split across replicas; got "
                    f"element_spec={spec}. Batch the dataset first, e.g. dataset.batch(global_batch_size)."
                )
        known = sorted({leaf.shape[0] for leaf in leaves if leaf.shape.rank and leaf.shape[0] is not None})
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

        def to_slices(*args):
            element = args if is_tuple else args[0]
            flat = tf.nest.flatten(element)
            dims = [tf.shape(t, out_type=tf.int64)[0] for t in flat]
            if cache is None:
                sizes = python_sizes(dims)
            else:
                cached = cache.read_value()
                hit = tf.reduce_all(tf.equal(tf.stack(dims), cached[0]))
                sizes = tf.cond(hit, lambda: cached[1:], lambda: python_sizes(dims))
            # One split op per component and a chain of R one-element datasets: about half the host CPU time of
            # slicing inside Dataset.range(R).map(...), which matters when the pipeline shares cores with compute.
            parts = [tf.split(t, sizes, num=R) for t in flat]
            slices = None
            for i in range(R):
                one = tf.data.Dataset.from_tensors(tf.nest.pack_sequence_as(element, [p[i] for p in parts]))
                slices = one if slices is None else slices.concatenate(one)
            return slices

        return dataset.flat_map(to_slices)
