"""Global batches in the input pipeline, and their cut into replica slices at the start of each step.

The pipeline (``PlanSlicer.pack``) only checks each global batch: it hands every component to the step whole, on the
host, as it came (``B`` examples along axis 0). The step decides the cut when it starts (:meth:`PlanSlicer.step_sizes`,
called by ``strategy.run`` in cross-replica context, before any replica runs) and cuts each component into replica
``i``'s slice (examples ``[sum(b_<i), sum(b_<=i))``) with one ``split`` op (:func:`cut`).

Why the cut is decided in the step. The plan is Python state of the strategy (solved, changed by calibration, by the
guard and by online re-balancing). Decided in the input pipeline, it was decided ahead of the step: tf.data reads
at least one batch ahead (its own prefetch, and tf.distribute's iterator asks for the next element while a step
runs), so a plan change took effect one or two steps late, the guard's timing samples were switched for the wrong
step, the solver ran for batches that never ran, and its Python ran on tf.data's threads beside the replicas'.
Decided when the step starts, the plan applies to that very step; the step's replicas wait for the decision, so
nothing else of the step runs while it is made (the calling thread waits for the step, as it does between steps).

Where the slice sizes come from. With online re-balancing, the guard or sampled timing, every step calls Python once
(``tf.numpy_function``, about 0.2 ms of host CPU) for ``[b_0, ..., b_{R-1}, timed]``: the plan to serve and
whether to time this step. When nothing changes the plan between steps (a fixed or even split), the plan in force
is kept in a small host variable, ``[B, b_0, ..., b_{R-1}]``, and a batch of exactly ``B`` examples reads its sizes
from there inside the graph; any other batch (the first one, a last partial batch) still goes to Python.
``model.fit``'s train step, which reads its batch before the step, is served in Python just before it and reads the
sizes handed to it (:meth:`PlanSlicer.handed`; see :class:`hetero_cs.engine.step.idle_replicas.StepPerSet`).
"""

import contextlib
import functools
import threading
from collections.abc import Callable

import keras
import numpy as np
import tensorflow as tf

from hetero_cs._copying import DeepcopiedWithNewLocks
from hetero_cs.engine.step.tensors import leading_dim
from hetero_cs.errors import InputError
from hetero_cs.planning.plan import BatchPlan

_UNSET = -1


def cut(component, sizes, num_replicas: int) -> list:
    """Replica slices of one global-batch component: ``[B, ...]`` -> ``R`` tensors of ``[b_i, ...]``.

    Args:
        component: A tensor or ``tf.RaggedTensor`` with ``B`` examples along axis 0.
        sizes: int64 tensor ``[R]``, the slice sizes (non-negative, summing to ``B``).
        num_replicas: ``R``.

    Returns:
        A list of ``R`` slices (ragged where the component is), in replica order.
    """
    if isinstance(component, tf.RaggedTensor):  # by row ranges: tf.split does not take ragged tensors
        ends = tf.cumsum(tf.cast(sizes, component.row_splits.dtype))
        starts = ends - tf.cast(sizes, component.row_splits.dtype)
        return [component[starts[i]:ends[i]] for i in range(num_replicas)]
    return tf.split(component, sizes, num=num_replicas)


def bad_batch_error(leading_dims, spec=None) -> InputError:
    """The error for a global batch whose components hold different numbers of examples, or 0 examples (``spec``:
    the dataset's element_spec, when the error is found from it)."""
    sizes = [int(d) for d in leading_dims]
    if min(sizes) < 0:  # a component of unknown rank that came as a scalar (see PlanSlicer.pack)
        return InputError(f"A dataset element has a component with no leading batch dimension (a scalar; leading "
                          f"dimensions {['none' if d < 0 else d for d in sizes]}), so it cannot be cut into "
                          f"per-replica slices. Batch the dataset first, e.g. dataset.batch(global_batch_size).")
    if len(set(sizes)) > 1:
        return InputError(f"The components of one dataset element have different leading (batch) dimensions "
                          f"{sizes}{'' if spec is None else f'; got element_spec={spec}'}, so they cannot be cut into "
                          f"the same slices. Every component of a global batch needs the same number of examples; if "
                          f"the dataset is not batched yet, batch it: dataset.batch(global_batch_size).")
    return InputError("A dataset element holds 0 examples: there is nothing to split. Drop empty batches, e.g. "
                      "dataset.filter(lambda x, *rest: tf.shape(x)[0] > 0).")


class BatchCount(keras.callbacks.Callback):
    """The batches one fit (its training batches, and the epochs it began: none when a restored backup says the fit
    had finished) or evaluate call ran. A dataset whose emptiness Keras cannot see before it reads it (a
    filter that drops everything, an empty generator) ends Keras' loop with a warning and no step; :meth:`check`
    raises the InputError an empty dataset of known size gets."""

    def __init__(self, verb: str):
        super().__init__()
        self.verb, self.batches, self.epochs = verb, 0, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epochs += 1

    def on_train_batch_end(self, batch, logs=None):
        self.batches += self.verb == "fit"

    def on_test_batch_end(self, batch, logs=None):
        self.batches += self.verb == "evaluate"

    def check(self, expected: bool) -> None:
        if expected and self.batches == 0:
            raise empty_input_error(self.verb)


def empty_input_error(verb: str):
    """The InputError of fit, evaluate or predict given a dataset with no batch."""
    return InputError(f"model.{verb} got no batches: the dataset is empty. Check the dataset (e.g. a take(0), a filter "
                      f"that drops everything, or fewer examples than one batch with drop_remainder=True).")


def _leading_dim_or_minus_one(tensor) -> tf.Tensor:
    """In the pipeline: ``tensor``'s leading dimension (int64), or -1 for a scalar of a component whose rank is not
    known while tracing (a generator's ``TensorSpec(None)``), where ``tf.shape(tensor)[0]`` would fail."""
    if isinstance(tensor, tf.RaggedTensor) or tensor.shape.rank is not None:
        return leading_dim(tensor, tf.int64)
    return tf.cond(tf.rank(tensor) > 0, lambda: leading_dim(tensor, tf.int64), lambda: tf.constant(-1, tf.int64))


def is_unbatched_marker(spec_or_value) -> bool:
    """True for a component that stands for "no data" and is handed to every replica as it is.

    That is None (tf.data's NoneTensorSpec, e.g. the missing sample weights of ``(x, y, None)``) and
    ``tf.experimental.Optional`` (what Keras makes of None in some of its data adapters).
    """
    # NoneTensorSpec has no public name.
    return spec_or_value is None or type(spec_or_value).__name__ == "NoneTensorSpec" or isinstance(
        spec_or_value, (tf.OptionalSpec, tf.experimental.Optional))


class PlanSlicer(DeepcopiedWithNewLocks):
    """Checks global batches in the pipeline, and decides each step's slice sizes when the step starts.

    Args:
        num_replicas: ``R`` >= 1.
        slice_sizes: The Python path, called at the start of a step with the batch size ``B`` (a numpy int64 scalar)
            and the keyword ``training`` (False for an evaluation or prediction step); returns
            ``[b_0, ..., b_{R-1}, timed]`` (int64: the slice sizes, summing to ``B``, and 1 if this step is to be
            timed) or raises.
        check_batch: Called from the pipeline with every component's leading dimension (numpy int64 scalars) of a
            global batch whose components disagree or hold 0 examples; raises the library's error for it.
        device: Where the cached plan lives (the parameter device: host memory).
        cacheable: Whether the plan may be cached in the graph. False when the plan must be looked at for every
            step (online re-balancing, the guard and sampled timing decide there).
    """

    def __init__(self, num_replicas: int, slice_sizes: Callable[..., np.ndarray], *,
                 check_batch: Callable[..., np.ndarray] | None = None, device: str, cacheable: bool):
        self._num_replicas = int(num_replicas)
        self._slice_sizes = slice_sizes
        self._check_batch = check_batch
        self._device = device
        self._lock = threading.Lock()
        self._published: tuple[int, ...] = (_UNSET,) * (self._num_replicas + 1)
        # Created outside any strategy scope and tf.function: plain host variables, not mirrored ones.
        with tf.init_scope(), tf.device(device):
            self._cache = (tf.Variable(self._published, dtype=tf.int64, trainable=False, name="hetero_cs_plan_cache")
                           if cacheable else None)
            # The sizes the last step started with (read after a failed step: which replica had how many examples).
            self._last_sizes = tf.Variable([0] * self._num_replicas, dtype=tf.int64, trainable=False,
                                           name="hetero_cs_last_step_sizes")
            # The sizes served before a step that reads them instead of deciding (see `handed`).
            self._handed = tf.Variable([0] * (self._num_replicas + 1), dtype=tf.int64, trainable=False,
                                       name="hetero_cs_handed_step_plan")
        self._hand_lock = threading.Lock()
        self._handed_value: tuple[int, ...] | None = None  # what the handed variable holds

    @property
    def num_replicas(self) -> int:
        """``R``, the number of slices per global batch."""
        return self._num_replicas

    @property
    def cacheable(self) -> bool:
        """Whether full global batches read their sizes from the cached plan instead of calling Python."""
        return self._cache is not None

    def last_step_sizes(self) -> tuple[int, ...]:
        """The slice sizes the last step (training, evaluation or prediction) started with, read on the host."""
        return tuple(int(b) for b in self._last_sizes.numpy())

    def publish(self, plan: BatchPlan | None) -> None:
        """Makes ``plan`` the cached plan for batches of ``plan.global_batch_size`` examples (None: no cached plan).

        Safe from any thread (the caller serialises plan changes, so the last published plan is the current one).
        The next step that starts reads it.
        """
        if self._cache is None:
            return
        value = ((_UNSET,) * (self._num_replicas + 1) if plan is None
                 else (int(plan.global_batch_size), *(int(b) for b in plan.per_replica_batch_sizes)))
        with self._lock:
            if value != self._published:
                self._cache.assign(value)
                self._published = value

    @contextlib.contextmanager
    def handed(self, decided: np.ndarray):
        """For the block: a step that reads its sizes (``step_sizes(..., handed=True)``) reads ``decided``, the
        ``[b_0, ..., b_{R-1}, timed]`` that ``slice_sizes`` returned for its batch before it (one such step at a
        time: a block waits for another thread's)."""
        with self._hand_lock:
            value = tuple(int(b) for b in decided)
            if value != self._handed_value:  # an eager write costs a step ~0.1 ms; most steps repeat the last plan
                self._handed.assign(value)
                self._handed_value = value
            yield

    def step_sizes(self, global_batch_size, *, training: bool = True, traced=None,
                   handed: bool = False) -> tuple[tf.Tensor, tf.Tensor]:
        """This step's slice sizes and whether to time it, decided now (call it once per step, before the cut).

        Args:
            global_batch_size: ``B``, an int scalar tensor (the step's batch).
            training: False for an evaluation or prediction step (its plan leaves training's alone).
            traced: The sets of active replicas the step has branches for (passed on to ``slice_sizes`` as the
                keyword ``traced``), or None.
            handed: The step reads the sizes served before it (:meth:`handed`) instead of deciding them.

        Returns:
            ``(sizes, timed)``: an int64 tensor ``[R]`` summing to ``B``, and a bool scalar.
        """
        R = self._num_replicas
        with tf.device(self._device):
            B = tf.cast(global_batch_size, tf.int64)

            def python_sizes():
                extra = {} if traced is None else {"traced": frozenset(traced)}
                decided = tf.numpy_function(functools.partial(self._slice_sizes, training=bool(training), **extra), [B],
                                            tf.int64, stateful=True, name="hetero_cs_step_plan")
                return tf.reshape(decided, [R + 1])

            if handed:
                decided = self._handed.read_value()
            elif self._cache is None:
                decided = python_sizes()
            else:
                cached = self._cache.read_value()
                decided = tf.cond(tf.equal(cached[0], B),
                                  lambda: tf.concat([cached[1:], tf.ones([1], tf.int64)], axis=0), python_sizes)
            with tf.control_dependencies([self._last_sizes.assign(decided[:R])]):
                sizes = tf.identity(decided[:R])
            return sizes, decided[R] > 0

    def pack(self, dataset: tf.data.Dataset) -> tf.data.Dataset:
        """Global batches -> the same global batches, checked: every component has the same number of examples, > 0.

        A batch that fails the check (found in the graph, without a Python call for good batches) goes to the
        ``check_batch`` Python path, which raises the library's error for it. None and ``tf.experimental.Optional``
        components are not checked. The cut happens in the step (:meth:`step_sizes`, :func:`cut`).

        Raises:
            InputError: The elements are empty structures or hold only None, a component has no leading (batch)
                dimension or is a ``tf.SparseTensor``, or the components' static leading dimensions differ.
        """
        spec = dataset.element_spec
        leaves = tf.nest.flatten(spec)
        if not leaves:
            raise InputError("The dataset's elements are empty structures; there is nothing to split.")
        batched = [leaf for leaf in leaves if not is_unbatched_marker(leaf)]  # None (no sample weights): no cut
        for leaf in batched:
            if isinstance(leaf, tf.SparseTensorSpec):
                raise InputError(f"A dataset component is a tf.SparseTensor, which cannot be cut into per-replica "
                                 f"slices; got element_spec={spec}. Make it dense (tf.sparse.to_dense) or ragged "
                                 f"(tf.RaggedTensor.from_sparse) in a dataset.map before distributing the dataset.")
            shape = getattr(leaf, "shape", None)
            if shape is None or shape.rank == 0:
                raise InputError(
                    f"Every dataset component needs a leading batch dimension to be split across replicas; got "
                    f"element_spec={spec}. Batch the dataset first, e.g. dataset.batch(global_batch_size).")
        if not batched:
            raise InputError(
                f"The dataset's elements hold only None or Optional components; there is nothing to split: {spec}.")
        known = sorted({leaf.shape[0] for leaf in batched if leaf.shape.rank and leaf.shape[0] is not None})
        if len(known) > 1:
            raise bad_batch_error(known, spec)
        if self._check_batch is None:
            return dataset.prefetch(1)

        def checked(*args):
            # tf.data unpacks a plain tuple into the function's arguments, but passes a namedtuple (or any other
            # structure) as one argument.
            element = args if type(spec) is tuple else args[0]
            flat = tf.nest.flatten(element, expand_composites=False)
            dims = tf.stack([_leading_dim_or_minus_one(t) for t in flat if not is_unbatched_marker(t)])
            good = tf.logical_and(tf.reduce_all(tf.equal(dims, dims[0])), dims[0] > 0)
            verdict = tf.cond(good, lambda: tf.constant(0, tf.int64), lambda: tf.reshape(tf.numpy_function(
                self._check_batch, tf.unstack(dims), tf.int64, stateful=True), []))
            with tf.control_dependencies([verdict]):
                kept = [t if is_unbatched_marker(t) else tf.identity(t) for t in flat]
            return tf.nest.pack_sequence_as(element, kept)

        # The check does not depend on the plan, so the next batch may be read and checked while a step runs.
        return dataset.map(checked).prefetch(1)
