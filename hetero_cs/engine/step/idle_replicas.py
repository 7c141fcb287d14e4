"""Idle replicas: a replica whose slice holds 0 examples does no work at all.

A plan may give a replica 0 examples: a 0 share in ``batch_split``, a last batch with fewer examples than replicas, a
plan that leaves a slow card out. Such a replica runs no kernel on its device: no parameter copy, no forward or
backward pass, and the step's gradient sum and failure barrier do not wait for it. Its contribution is an exact zero
(the other replicas' ``b_i / B`` weights already sum to 1).

How. A step is one ``strategy.run`` call, traced once into the step's graph, and the plan (so which replicas idle) is
decided when the step starts, inside that graph. tf.distribute runs the replica functions in threads that meet at
every cross-replica point (the gradient sum, BatchNormalization's statistics, a variable write), so a replica's work
cannot sit in a branch of its own. Instead the whole call has one branch per *set of active replicas* that plans use
(only those threads run, with their own replica ids and devices), and the step picks the branch of its set
(``tf.switch_case``) when it starts. The set of every replica is always branch 0. ``model.fit``'s train step, which
reads its batch before the step, instead serves the step's plan first and runs a step traced for the plan's set
alone, one function per set (:class:`StepPerSet`): no branch op, no other set's work in its graph; a card alone
runs there as one device's step on the whole batch.

Which sets get a branch, and how often a step is traced. Every set that a plan served, solved or tried so far uses
(:class:`ActiveSets`, fed by the strategy when a plan comes into force, a guard trial starts or ``batch_split`` is
set; calibration adds the fastest card alone, which the guard may measure at any time), up to
``MAX_SETS_PER_REPLICA * R`` sets. A set keeps its branch: a trial or a plan that comes back finds its branch traced,
and a probe of idle cards runs beside ``fit``'s step (:mod:`hetero_cs.engine.idle_probes`; elsewhere it gives every
idle card one example at once, the set of every replica), so a long run traces its step once per new set at most
(for three cards, at most the six sets there are), never again for sets it met before.
A step with branches is traced again right before a step when a new set appeared (:meth:`ActiveSets.version`):
``model.fit``'s where it runs one (``steps_per_execution`` above 1, micro-batches), ``evaluate`` and ``predict`` when
they start. In those, a step whose plan's set has no branch (one met while the
step runs, a set past the bound) runs the smallest superset that has one, its extra replicas given one example each
from the largest slices (:func:`served_sizes`): exact, no replica runs a 0-example slice (some kernels fail there:
Conv2D with oneDNN on a CPU), and the set's own branch comes with the next trace. A custom loop's ``tf.function``
keeps the sets it was traced with (trace it after ``strategy.calibrate``); under fixed shares or the even split it
also gets the sets of batches too small for every replica with a share, and runs a plan without a branch as a
superset in every step (:func:`anticipate_custom_loop`); under auto-balance a set met later runs in branch 0, its
idle replicas on 0-example slices: exact, but not idle. Every branch costs each step a little (TensorFlow walks the
branches not taken).

An idle replica's outputs. ``strategy.run`` still returns one value per replica. Where a replica's output has a
batch dimension (a leading dimension unknown at trace time: predictions, per-example losses) the idle replica's
is empty (0 rows, as its slice). A floating scalar (a logged value of Keras' own steps, which each replica gives as its
share; a custom loop's loss) is 0, what a sum over 0 examples gives; any other output is, in Keras' own steps, a copy
of the first active replica's, and in a custom loop zeros.

Under the multi-worker strategy. Every replica of every worker must join each collective (the gradient all-reduce,
BatchNormalization's statistics), so a replica's step cannot be left out. Instead, in Keras' own ``train_step``, a
replica with 0 examples skips its forward pass, loss and gradient (a ``tf.cond`` around that part of the step,
:mod:`hetero_cs.engine._compat.replica_pass`) and hands exact zeros to the all-reduce; a worker whose replicas are all
idle still joins every collective. Where that cannot be
(:func:`hetero_cs.engine._compat.replica_xla.multi_worker_skips`: a trainable BatchNormalization, a loss normalised
across replicas, a ``train_step`` override, a custom loop), the idle replica runs its pass on a 0-example slice, exact
as before, and plans price its fixed cost (the chief's Balancer is told which:
``Balancer.set_idle_replicas_free``).
"""

import logging
import threading
import weakref
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

from hetero_cs._copying import DeepcopiedWithNewLocks
from hetero_cs.engine.step import replica_state
from hetero_cs.errors import HeteroCSError

logger = logging.getLogger(__name__)

#: Sets of active replicas per kind of step (training, inference) that get a branch, per replica (``R`` = 3: six, every
#: set there is); a set met past the bound runs as the smallest superset with a branch (:func:`served_sizes`).
MAX_SETS_PER_REPLICA = 2


def active_set(sizes: Sequence[int]) -> tuple[int, ...] | None:
    """The replicas with ``b_i > 0`` of a cut's ``sizes`` (a sorted tuple), or None when every replica has examples:
    what :class:`ActiveSets` notes, what :class:`StepPerSet` keys its steps by and what :func:`served_sizes` finds a
    branch for."""
    active = tuple(i for i, b in enumerate(sizes) if int(b) > 0)
    return None if len(active) == len(sizes) else active


class ActiveSets(DeepcopiedWithNewLocks):
    """The sets of active replicas that plans have used, per kind of step (thread-safe).

    A set is a sorted tuple of replica ids with ``b_i > 0``, never empty and never all ``R`` replicas (that is
    branch 0 of every step). A set, once noted, keeps its branch (at most ``MAX_SETS_PER_REPLICA * R`` of them): each
    branch is one more trace of the step's active replicas' share of it, so a step is traced again only for a set it
    has not met. Training plans' sets go to training steps and to inference steps (which cut a batch of the training
    size by training's plan); inference plans' sets (``evaluate``, ``predict``, fit's validation pass) only to
    inference steps, so that a last validation batch smaller than ``R`` does not make fit trace its train step again.

    :meth:`version` grows whenever the sets a step of that kind would get change: a Keras step function traced at an
    older version (``traced_with``) is traced again before its next call.

    Args:
        num_replicas: ``R`` >= 1.
    """

    def __init__(self, num_replicas: int):
        self._num_replicas = int(num_replicas)
        self._lock = threading.Lock()
        self._sets: dict[bool, list[tuple[int, ...]]] = {True: [], False: []}
        self._versions: dict[bool, int] = {True: 0, False: 0}
        # The Keras step functions traced so far (tf.function objects, weakly): the version each was traced at.
        self.traced_with: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __deepcopy__(self, memo: dict) -> "ActiveSets":
        memo[id(self.traced_with)] = weakref.WeakKeyDictionary()  # a copy traces its own step functions
        return super().__deepcopy__(memo)

    def note(self, batch_sizes: Sequence[int], *, training: bool) -> None:
        """Records the set of replicas with ``b_i > 0`` in a plan (a plan without a 0 adds nothing)."""
        active = active_set(batch_sizes)
        if not active:
            return
        with self._lock:
            sets = self._sets[bool(training)]
            if active in sets:
                return
            if len(sets) >= MAX_SETS_PER_REPLICA * self._num_replicas:
                logger.debug("hetero_cs: the set of active replicas %s gets no branch of its own (%d sets have one); "
                             "its steps run as the smallest superset that has one.", list(active), len(sets))
                return
            sets.append(active)
            self._versions[bool(training)] += 1

    def for_trace(self, *, training: bool) -> tuple[tuple[int, ...], ...]:
        """The sets a step of this kind traced now gets branches for."""
        with self._lock:
            return tuple(sorted(self._sets[True] if training else {*self._sets[True], *self._sets[False]}))

    def version(self, *, training: bool) -> int:
        """Grows whenever :meth:`for_trace` of this kind changes."""
        with self._lock:
            return self._versions[True] + (0 if training else self._versions[False])

    def refresh(self, model, attribute: str, *, training: bool) -> None:
        """Drops ``model``'s Keras step function ``attribute`` ("test_function", ...) when it was traced at an older
        :meth:`version`, so that Keras traces it again (with a branch for every set)."""
        function = getattr(model, attribute, None)
        if function is not None and self.traced_with.get(function, 0) < self.version(training=training):
            setattr(model, attribute, None)

    def mark_traced_function(self, function, version: int) -> None:
        """Records that the Keras step ``function`` is (or will be, at its first call) traced at ``version``."""
        if function is not None and function not in self.traced_with:
            self.traced_with[function] = version


def set_of_traced_step() -> tuple | None:
    """``(active, whole)`` while the step traced (or run) in this thread is one of :class:`StepPerSet`'s, for exactly
    the replicas ``active`` (None: every replica), reading the sizes handed to it (``PlanSlicer.handed``); ``whole``:
    its one active replica runs the whole batch as one device's step. Else None."""
    return replica_state.this_threads_value("step_set")


class StepPerSet:
    """``model.fit``'s train step traced once per set of active replicas, each as its own function, without branches.

    Called with a global batch in hand (read before the step), it serves the step's plan first, in Python (the
    strategy's slice sizes, as a step with branches serves them when it starts), hands the sizes to the step, and runs
    the step traced for the plan's set: only those replicas' work is in its graph, so the step walks no branch of
    another set, and a set met later (a re-plan that leaves a card out, a guard trial) traces one more
    function, its own, once, rather than the whole step with a branch more. Every set met so far keeps its function,
    with no bound (a function costs no step any time, only its trace's memory, as a new input shape does on one
    device): no replica ever gets an example its plan spared it.

    A card alone (a set of one replica) holds the whole global batch, so its step needs no cut and nothing weighed:
    it runs as one device's step on that card (:attr:`hetero_cs.engine.step.replica_state.ReplicaStep.whole_batch`),
    its batch's static size known where the traced call knows it (a one-card strategy's step knows its dataset's,
    which may be none: a ``Mean`` weighed by a number, as Keras' per-output loss trackers weigh by that size, counts
    one per step in either, ``_compat.losses.patch_mean_metric``). That step skips the
    loss reader, so it is taken only once a step traced with the reader (the first step, whatever its set) has run:
    a program the reader refuses is refused at its first step, whatever the plan, and a card alone met first is
    traced twice.

    Args:
        strategy: The central-storage strategy.
        make: Returns a new, untraced Keras train function (called once per set).
        whole_allowed: Whether a card alone may run as one device's step (False: a model compiled with
            ``jit_compile=True``, whose XLA per replica only the weighted step compiles). Called once per step.
    """

    def __init__(self, strategy, make: Callable[[], Callable], whole_allowed: Callable[[], bool] = lambda: True):
        self._strategy = strategy
        self._make = make
        self._whole_allowed = whole_allowed
        self._steps: dict = {}
        self._read = False  # a step traced with the loss reader has run

    def __call__(self, batch, batch_size: int):
        strategy = self._strategy
        with replica_state.this_threads("between_steps", True):  # a probe of an idle card may trace its step here
            decided = strategy._slice_sizes(batch_size, training=True)  # noqa: SLF001 - the sizes, then whether timed
        key = active_set(decided[:strategy.num_replicas_in_sync])
        whole = self._read and key is not None and len(key) == 1 and self._whole_allowed()
        emulator = strategy._emulator  # noqa: SLF001
        if emulator is not None and key is not None:  # the idle replicas' emulated step counters (report_idle_replicas)
            emulator.skip_step(sorted(set(range(strategy.num_replicas_in_sync)) - set(key)))
        step = self._steps.get((key, whole))
        if step is None:
            if self._steps:
                logger.info("hetero_cs: tracing the train step again, for the active replicas %s (once per set of "
                            "active replicas%s).", list(key or range(strategy.num_replicas_in_sync)),
                            "; a card alone: one device's step on the whole batch" if whole else "")
                strategy._balancer.step_traced_again()  # noqa: SLF001 - a guard trial's next steps pay for the trace
            step = self._steps[(key, whole)] = self._make()
        # For the block: the step traced (or run) in this thread is this set's (set_of_traced_step).
        with strategy._slicer.handed(decided), replica_state.this_threads("step_set", (key, whole)):  # noqa: SLF001
            outputs = step([batch])
        self._read = True
        return outputs


def anticipate_last_batch(strategy, num_examples: int | None, batch_size: int | None, *,
                          training: bool = False) -> None:
    """Notes the set of active replicas of a pass's last batch when it is smaller than ``R``.

    ``fit``, ``evaluate`` or ``predict`` over ``num_examples`` arrays in batches of ``batch_size`` ends on a batch of
    ``N % B`` examples; when that is less than ``R`` some replicas idle. Its plan (``plan_for``, or
    ``plan_for_inference``, which changes nothing of training's plans) is known before the pass, so its set gets a
    branch in the first trace instead of running its idle replicas on 0-example slices (some kernels fail there:
    Conv2D with oneDNN on a CPU). Datasets, whose last batch is unknown before it comes, are not anticipated.
    """
    if not num_examples or not batch_size or not 0 < num_examples % batch_size < strategy.num_replicas_in_sync:
        return
    balancer = strategy._balancer  # noqa: SLF001
    try:
        if training:
            balancer.plan_for(batch_size)  # the reference first, as the first batch makes it
        plan = (balancer.plan_for if training else balancer.plan_for_inference)(num_examples % batch_size)
    except HeteroCSError:
        return  # no plan for this size (caps): its step fails or runs with its own error, as before
    strategy._active_sets.note(plan.per_replica_batch_sizes, training=training)  # noqa: SLF001


def anticipate_custom_loop(strategy, *, training: bool, batch_size: int | None) -> bool:
    """For a custom loop's step being traced: True when its plans may run as a traced superset (fixed shares, the
    even split); then also notes the sets of the plans that cut batches too small for every replica with a share,
    those of ``batch_size`` examples only when the traced batch has that static size (``None``: any size).

    A custom loop's ``tf.function`` is traced once, before any plan of it is served, so a set of active replicas
    that only a served plan reveals has no branch there. Under fixed shares or the even split every 0 of a plan comes
    from rounding a positive share (``batch_split=[4, 1, 3, 1]`` cuts ``B = 5`` as ``[2, 1, 2, 0]``), so giving that
    replica one example of the largest slice (:func:`served_sizes`) is as exact and leaves out no card on purpose; a
    batch with fewer examples than the replicas with a share (a last partial batch) has no such superset, so its
    plans' sets (at most ``R - 1``, known before any step: the policy's plans need no measurement) get branches
    now. Under auto-balance a 0 is the solver's choice (a card left out for being slow), so nothing changes: such a
    plan's idle replicas run on 0-example slices in branch 0, exact, and no card gets an example it was spared.
    """
    from hetero_cs.planning.choice import choose_plan

    balancer = strategy._balancer  # noqa: SLF001
    if balancer.auto_balance:
        return False
    shares = balancer.shares
    with_share = [i for i in range(balancer.num_replicas) if shares is None or shares[i] > 0]
    small = range(1, len(with_share)) if batch_size is None else [b for b in [batch_size] if b < len(with_share)]
    for size in small:
        try:
            plan = choose_plan(size, balancer.num_replicas, shares=shares, auto_balance=False, cost_models=None,
                               max_batch_sizes=balancer.max_batch_sizes, log_ties=False)
        except HeteroCSError:
            continue  # no plan for this size (caps): its step fails with its own error, as before
        strategy._active_sets.note(plan.per_replica_batch_sizes, training=training)  # noqa: SLF001
    return True


def served_sizes(sizes: Sequence[int], traced, keep_idle: Sequence[int] = ()) -> tuple[int, ...]:
    """The sizes to cut a step with, given its plan's ``sizes`` and the sets the running step has branches for.

    A plan's set of active replicas may have no branch in the running step of a Keras loop (``traced``: its traced
    sets; None in a custom loop, which is never traced again, or for a step without branches, eagerly or with one
    replica): a plan that changed while the step starts (the re-planner proposes, the guard starts a trial, inside
    the call that serves the step), a set past :data:`MAX_SETS_PER_REPLICA`. Its branch 0 would run the idle replicas on
    0-example slices, where some kernels fail (Conv2D with oneDNN on a CPU). It runs the smallest traced superset
    instead (the set of every replica is one), each replica that the superset adds given one example from the
    largest slice of the set, when the batch holds enough examples; else the plan's sizes stand (a batch with fewer
    examples than replicas: exact, its idle replicas run on 0-example slices). A superset never holds a replica of
    ``keep_idle`` (a card set aside after a device error, or one whose memory cap is 0). ``model.fit`` traces its
    step again before the next one, which then runs the plan's own set.
    """
    sizes = tuple(int(b) for b in sizes)
    R = len(sizes)
    active = active_set(sizes)
    if traced is None or active is None or active in traced:
        return sizes
    supersets = sorted((s for s in traced if set(active) < set(s)), key=lambda s: (len(s), s)) + [tuple(range(R))]
    # The smallest with enough examples for its replicas; a card set aside never gets an example.
    superset = next((s for s in supersets if sum(sizes) >= len(s) and not set(s) & set(keep_idle)), None)
    if superset is None:
        return sizes
    split = list(sizes)
    for i in superset:
        if split[i] == 0:
            split[max(superset, key=lambda j: split[j])] -= 1  # the donor: the largest slice
            split[i] = 1
    logger.debug("hetero_cs: split %s runs as %s this step (its set of active replicas gets a branch when the step "
                 "is traced again).", list(sizes), split)
    return tuple(split)


def branch_index(sizes, sets: Sequence[Sequence[int]], num_replicas: int):
    """In the graph: the branch of this step's sizes (``k + 1`` for ``sets[k]``; 0 for any other set).

    Args:
        sizes: int64 ``[R]``, the step's slice sizes.
        sets: The traced sets (each a sorted tuple of replica ids).
        num_replicas: ``R``.
    """
    weights = tf.constant([1 << i for i in range(num_replicas)], tf.int64)
    code = tf.reduce_sum(tf.where(sizes > 0, weights, tf.zeros_like(weights)))
    codes = tf.constant([-1] + [sum(1 << i for i in s) for s in sets], tf.int64)
    matches = tf.cast(tf.equal(codes, code), tf.int32)
    return tf.cast(tf.argmax(matches), tf.int32)  # no match: 0 (argmax of all-equal values is the first)


def subset_per_replica(structure, active: Sequence[int], num_replicas: int, *, components, per_replica):
    """``structure`` with every per-replica value of ``R`` components reduced to the components of ``active``."""

    def select(value):
        parts = components(value)
        if parts is None or len(parts) != num_replicas or isinstance(value, tf.Variable):
            return value
        return per_replica([parts[i] for i in active])

    return tf.nest.map_structure(select, structure)


def expand_outputs(result, active: Sequence[int], num_replicas: int, *, keras_step: bool, host: str,
                   components, per_replica, sizes=None):
    """The outputs of a call over ``active`` replicas, as if every replica had run (see the module docstring).

    Per-replica values get ``R`` components: the active replicas' own, and for each idle replica an empty batch
    (an output with a batch dimension: in a graph, a leading dimension unknown at trace time; eagerly, with
    ``sizes`` the step's slice sizes, a leading dimension equal to each active replica's slice size), a copy of the
    first active replica's (``keras_step``, but for a floating scalar: a logged share) or zeros (placed on ``host``,
    no op on the idle replica's device).
    """
    slot = {replica: k for k, replica in enumerate(active)}
    count = len(active)

    def batched(parts) -> bool:
        shape = parts[0].shape  # not a scalar, nor of unknown rank
        return bool(shape.rank) and (shape[0] is None if sizes is None else all(
            p.shape.rank and p.shape[0] == int(sizes[r]) for p, r in zip(parts, active)))

    def fill(template, is_batch):
        shape = template.shape
        with tf.device(host):
            if is_batch:
                if isinstance(template, tf.RaggedTensor):
                    return template[:0]
                if shape[1:].is_fully_defined():
                    return tf.zeros([0, *shape[1:].as_list()], template.dtype)
                return tf.zeros(tf.concat([[0], tf.shape(template)[1:]], axis=0), template.dtype)
            if keras_step and not (shape.rank == 0 and template.dtype.is_floating):
                return tf.identity(template)  # a logged floating scalar is a share: an idle replica's is 0
            return tf.zeros(shape, template.dtype) if shape.is_fully_defined() else tf.zeros_like(template)

    def expand(value):
        parts = components(value)
        if (parts is None or len(parts) != count) and count == 1 and isinstance(value, (tf.Tensor, tf.RaggedTensor)):
            parts = (value,)  # one active replica: not regrouped
        if parts is None or len(parts) != count or isinstance(value, tf.Variable):
            return value
        first, is_batch = parts[0], batched(parts)
        return per_replica([parts[slot[r]] if r in slot else fill(first, is_batch) for r in range(num_replicas)])

    return tf.nest.map_structure(expand, result)


def report_idle_replicas(idle: Sequence[int], start_stamp, *, record: Callable[..., None] | None, emulator,
                         host: str) -> None:
    """On the host: each idle replica's step report (0 examples, 0 s) and its emulated step counter.

    The step-time monitor pairs a step's reports by its clock start and completes a step once every replica has
    reported; an idle replica's report says it had no examples (a report of 0 examples never feeds a cost model).
    The emulator's per-replica step counter (which drift schedules read) advances as for a working replica.

    Fit's step per set makes neither here: :class:`StepPerSet` advances the counters when it serves the step, and
    the step's first active replica makes the reports with its own (``StepHandoff.idle_reports``). An op of its own
    every step, beside a card alone's compute, cost about 3 % of a 13 ms step on a 2-core host (emulated; measured
    side by side with a one-card strategy).
    """
    if not idle or (start_stamp is None and emulator is None):
        return

    def _report(start):
        start_s = float(start)
        if emulator is not None:
            emulator.skip_step(idle)
        if record is not None and start_s >= 0.0:  # a sampled step that is not timed has a negative stamp
            record(idle[0], 0, 0.0, step_key=start_s, idle=tuple(idle[1:]))  # one call for the idle replicas
        return np.float64(0.0)

    stamp = tf.cast(start_stamp if start_stamp is not None else tf.constant(-1.0, tf.float64), tf.float64)

    def report():
        with tf.device(host):
            return tf.numpy_function(_report, [stamp], tf.float64, stateful=True, name="hetero_cs_idle_replicas")

    if emulator is not None:
        report()  # every step: the emulator's counters advance
    else:  # only a timed step has reports to make: an untimed one (sampled timing) calls no Python
        tf.cond(stamp >= 0.0, report, lambda: tf.constant(0.0, tf.float64))
