"""Exact weighted steps: what each replica knows about its slice while it runs.

Replica i of a :class:`~hetero_cs.HeteroCentralStorageStrategy` holds ``b_i`` examples of a global batch of ``B``.
Its loss must be ``sum(per_example_loss_i) / B`` - its mean loss times ``b_i / B`` - and the host sums the
replicas' gradients. Stock Keras 3 instead scales each replica's mean loss by ``1 / num_replicas``, which is exact
only when every slice has the same size.

Worked number: a batch of ``B = 10`` examples split ``[7, 3]`` whose per-example losses average 1.0 on the first
replica and 0.0 on the second. The full-batch mean loss is ``(7 * 1.0 + 3 * 0.0) / 10 = 0.7``. Averaging the
replicas' means gives ``(1.0 + 0.0) / 2 = 0.5`` - wrong by 0.2. Weighting each mean by ``b_i / B`` gives
``1.0 * 7/10 + 0.0 * 3/10 = 0.7``, and so does ``tf.nn.compute_average_loss(per_example_loss,
global_batch_size=10)`` on each replica followed by a SUM over replicas.

Inside ``strategy.run`` (and so inside ``model.fit``/``evaluate``), :func:`replica_weight` and
:func:`current_global_batch_size` expose ``b_i / B`` and ``B`` for the step being run, so custom loops stay exact
on a last partial batch too::

    def step_fn(x, y):
        with tf.GradientTape() as tape:
            per_example_loss = loss_fn(y, model(x, training=True))
            loss = tf.nn.compute_average_loss(
                per_example_loss, global_batch_size=hetero_cs.current_global_batch_size())
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    per_replica_loss = strategy.run(step_fn, args=next(iterator))
    step_loss = strategy.reduce("SUM", per_replica_loss, axis=None)  # the full-batch mean loss

The thread-local state here is set by the strategy around each replica's function (TensorFlow runs replica
functions in one Python thread each while tracing). What the replica functions of one ``strategy.run`` hand the
cross-replica merges of that same call (and back) lives on a :class:`StepHandoff` made for that call, never in
module globals: two models tracing their steps in two threads cannot take each other's state.
"""

import dataclasses
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from hetero_cs.errors import NotInReplicaStepError

_state = threading.local()


@dataclasses.dataclass(frozen=True)
class ReplicaStep:
    """What one replica knows about the step it is running (symbolic tensors while tracing).

    Attributes:
        replica_id: 0-based replica index (``replica_id_in_sync_group``).
        device: The replica's compute device, e.g. ``"/device:CPU:1"``.
        batch_size: int32 scalar tensor, ``b_i`` (may be 0).
        global_batch_size: int32 scalar tensor, ``B`` = sum of all ``b_i`` of this step, or None when the
            step's inputs were not per-replica values (then every replica sees the same inputs and the stock
            ``1 / num_replicas`` weighting is exact).
        start_stamp: float64 scalar tensor, wall clock when the slice reached the device, or None when
            per-replica timing is off.
        sampled_timing: True when start_stamp is negative on steps that are not timed (sampled timing).
        shared_start: True when start_stamp is the step's one clock start, the same tensor in every replica (taken
            once per step from the batch); it then also identifies the step to the step-time monitor.
        barrier: Filled when the optimizer all-reduces the gradients: a token on the parameter device that exists
            only once every replica has computed its gradients. Writes that need no other replica (the
            optimizer's iteration counter) wait for it, so a step that fails in any replica changes nothing.
        loss_terms: References (``tensor.ref()``) of the loss values of this step that are already this
            replica's share of the global batch's loss (a Keras loss reduced under the strategy, a
            ``compute_loss`` result). Summed over replicas they give the single-device loss; any other scalar
            loss is taken as a mean over the replica's slice (see :mod:`hetero_cs.engine._compat.losses`).
        handoff: The :class:`StepHandoff` of the ``strategy.run`` call this replica step belongs to (shared by
            its replicas), or None.
        layer_losses: ``add_loss`` values (activity regularizers included) of this replica's call of each layer,
            by ``id(layer)``: kept per replica, since the replicas call the same layer objects at once.
        sub_step: The :class:`hetero_cs.engine.step.sub_steps.SubStepTrace` when this replica step is a sub-step of
            an overlapped micro-batched call, else None.
        waited_per_micro_batch: True when the replica ran its slice as micro-batches and waited out each one's
            emulated device time already (the multi-worker strategy's micro-batched slices): the step's end then
            only times it.
        flow: The :class:`hetero_cs.engine._compat.batch_flow.BatchFlow` of this replica's step: which of its
            tensors hold one row per example (seeded by the strategy with the replica's slice), read by the loss
            reader (:mod:`hetero_cs.engine._compat.loss_reader`).
        weights: References of the tensors :func:`replica_weight` returned in this step.
        replica_counts: References of ``strategy.num_replicas_in_sync`` converted to a tensor in this step.
        whole_batch: True when this replica holds the step's whole global batch, as the one active replica of a
            step traced for it alone (:class:`hetero_cs.engine.step.idle_replicas.StepPerSet`): it then runs as
            one device's step (``global_batch_size`` None, ``strategy.num_replicas_in_sync`` 1 in it), with
            nothing to weigh.
    """

    replica_id: int
    device: str
    batch_size: Any
    global_batch_size: Any
    start_stamp: Any = None
    sampled_timing: bool = False
    shared_start: bool = False
    barrier: list = dataclasses.field(default_factory=list)
    loss_terms: set = dataclasses.field(default_factory=set)
    handoff: "StepHandoff | None" = None
    layer_losses: dict = dataclasses.field(default_factory=dict)
    sub_step: Any = None
    waited_per_micro_batch: bool = False
    flow: Any = None
    weights: set = dataclasses.field(default_factory=set)
    replica_counts: set = dataclasses.field(default_factory=set)
    whole_batch: bool = False


@dataclasses.dataclass(eq=False)
class StepHandoff:
    """State one ``strategy.run`` call passes between its replica functions and its cross-replica merges.

    TensorFlow runs each replica function in a thread of its own and the merges (``merge_call``) in the thread that
    called ``strategy.run``; one handoff is made per call (per traced step inside ``tf.function``), so another
    model tracing in another thread has its own. Set and read by :mod:`hetero_cs.engine._compat`.

    Attributes:
        barrier_token: The failure barrier of this step (see ``ReplicaStep.barrier``): an int32 scalar on the
            parameter device, set once every replica's gradients exist; the optimizer's host update waits for it.
        weight_decay: (optimizer, variables): decoupled weight decay a replica deferred to the update merge.
        loss_scale_pending: (LossScaleOptimizer, graph or None): the replicas apply loss-scaled gradients through
            its inner optimizer in this step.
        loss_scale_finite: (inner optimizer, bool scalar tensor, graph or None): the update merge judged the step's
            summed gradients finite (or not); the inner optimizer's iteration counter adds it instead of 1.
        start_stamp: The step's float64 clock start, shared by its replicas (None when the step is not timed);
            the host's end of the step is timed from it. ``sampled_start``: it is negative on untimed steps.
        idle_reports: The replicas this call leaves idle whose step reports (0 examples) its first active replica
            makes with its own, in the same host call (fit's step per set; elsewhere an op of their own makes them,
            ``idle_replicas.report_idle_replicas``).
        hooks: The record of which patched Keras/TensorFlow hooks ran in this step and which it needs
            (:class:`hetero_cs.engine._compat.hooks.StepHooks`), or None where nothing checks them (the multi-worker
            strategy).
    """

    barrier_token: Any = None
    weight_decay: tuple | None = None
    loss_scale_pending: tuple | None = None
    loss_scale_finite: tuple | None = None
    hooks: Any = None
    start_stamp: Any = None
    sampled_start: bool = False
    idle_reports: tuple = ()


@contextmanager
def set_locally(state: threading.local, **values) -> Iterator[None]:
    """Within: ``state``'s attributes (this thread's) set to ``values``; put back as they were after (None when
    unset)."""
    previous = {name: getattr(state, name, None) for name in values}
    for name, value in values.items():
        setattr(state, name, value)
    try:
        yield
    finally:
        for name, value in previous.items():
            setattr(state, name, value)


def this_threads(name: str, value: Any):
    """Sets ``name`` of this thread's state to ``value`` for the block, then restores what it was (read it with
    ``this_threads_value(name)``)."""
    return set_locally(_state, **{name: value})


def step_handoff(handoff: StepHandoff):
    """Makes ``handoff`` this thread's for the block: the thread that runs ``strategy.run``, and so its merges."""
    return this_threads("handoff", handoff)


def current_step_handoff() -> StepHandoff | None:
    """The handoff of the ``strategy.run`` call this thread works for: as its replica (the replica step's), or as
    the thread running its merges (set by :func:`step_handoff`); None outside both."""
    return getattr(current_replica_step(), "handoff", None) or this_threads_value("handoff")


def this_threads_value(name: str) -> Any:
    """What :func:`this_threads` set ``name`` to in this thread's block, or None outside it."""
    return getattr(_state, name, None)


def replica_step(step: ReplicaStep):
    """Makes ``step`` the current replica step of this thread for the duration of the block."""
    return this_threads("step", step)


def current_replica_step() -> ReplicaStep | None:
    """Returns the replica step this thread is running, or None outside a HeteroCentralStorageStrategy replica."""
    return this_threads_value("step")


def current_hooks():
    """The hook record of the step this thread works on (its ``strategy.run`` call's handoff's), or None."""
    return getattr(current_step_handoff(), "hooks", None)


def _require_step() -> ReplicaStep:
    import tensorflow as tf

    step = current_replica_step()
    if (step is not None and step.global_batch_size is None and step.batch_size is not None
            and tf.distribute.get_strategy().num_replicas_in_sync == 1):
        # One replica: tf.distribute hands it a distributed dataset's batch as plain tensors, so no per-replica
        # value marks the global batch; the replica's batch (its first argument with a batch dimension) is all of it.
        return dataclasses.replace(step, global_batch_size=step.batch_size)
    if step is None or step.global_batch_size is None:
        raise NotInReplicaStepError(
            "This accessor only works inside a replica function run by HeteroCentralStorageStrategy.run with "
            "per-replica inputs (for example a distributed dataset's element). Call it inside the function you "
            "pass to strategy.run.")
    return step


def current_global_batch_size():
    """Returns ``B``, the global batch size of the step being run, as an int32 scalar tensor.

    It is the sum of all replicas' slice sizes of this step, so it is right for a last partial batch too. With one
    replica it is the replica's batch (its first argument with a batch dimension).

    Raises:
        NotInReplicaStepError: Outside a replica function of HeteroCentralStorageStrategy.
    """
    return _require_step().global_batch_size


def replica_weight(dtype: str = "float32"):
    """Returns ``b_i / B`` for this replica as a scalar tensor of ``dtype``; the weights of all replicas sum to 1.

    Raises:
        NotInReplicaStepError: Outside a replica function of HeteroCentralStorageStrategy.
    """
    import tensorflow as tf

    step = _require_step()
    weight = tf.math.divide_no_nan(tf.cast(step.batch_size, dtype), tf.cast(step.global_batch_size, dtype))
    step.weights.add(weight.ref())  # the loss reader takes a value times this weight as weighed already
    return weight


def per_example(values):
    """Marks ``values`` as one row per example of this replica's slice, for computations hetero_cs cannot read.

    hetero_cs proves from the graph that a loss or a prediction is computed from each example alone before it splits
    the batch (docs/exactness.md); it cannot read Python code in the forward pass (``tf.py_function``,
    ``tf.numpy_function``), and refuses a program that uses its result. If your function works example by example
    (row ``k`` of its output depends on row ``k`` of its inputs only), mark its output: the reader takes it as one
    row per example. hetero_cs cannot check this claim; a function that mixes examples then trains differently from
    one device, silently. Outside a replica step of our strategies (one device) this is ``tf.identity``.

    Args:
        values: A tensor, or a nested structure of tensors, each with the examples along its first axis.

    Returns:
        ``values``, unchanged in value.

    Examples:
        >>> y = tf.numpy_function(my_row_wise_function, [x], tf.float32)  # doctest: +SKIP
        >>> y = hetero_cs.per_example(y)  # doctest: +SKIP
    """
    import tensorflow as tf

    marked = tf.nest.map_structure(tf.identity, values)
    step = current_replica_step()
    if step is not None and step.flow is not None and not tf.executing_eagerly():
        step.flow.seed_rows(marked)
    return marked
