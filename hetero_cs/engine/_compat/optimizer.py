"""Private touches of Keras' TensorFlow optimizer: clipping, gradient aggregation and updates on the host.

Part of :mod:`hetero_cs.engine._compat`, the one place of private TensorFlow/Keras touches.
"""

import functools
import threading

import tensorflow as tf

from hetero_cs.devices.step_clock import stamp_step_end
from hetero_cs.engine.step import fused_update, replica_state
from hetero_cs.engine.step.sub_steps import SparseSum
from hetero_cs.engine._compat import hooks, loss_scale
from hetero_cs.engine._compat.context import (
    current_hetero_strategy, current_multi_worker_strategy, current_weighting_strategy, is_hetero_strategy,
    set_locally,
)
from hetero_cs.engine._compat.sparse_rows import shared_rows_dense, shared_rows_sum
from hetero_cs.engine._compat.symbols import patch
from hetero_cs.engine._compat.variables import _central_in_replica_context
from hetero_cs.errors import ConfigError, MicroBatchError


def patch_optimizer() -> None:
    # Keras' TF optimizer clips (clipnorm, global_clipnorm, clipvalue) each replica's gradient before the sum,
    # which is not the clipping of the full-batch gradient. Under our strategy clipping is skipped in replica
    # context and applied to the all-reduced (summed) gradient inside _all_reduce_sum_gradients, the last place
    # in replica context before the merge. The same place gives the strategy the moment a replica's gradients
    # are ready (per-replica timing and emulated device time). Under the multi-worker strategy the same two changes
    # apply: clipping after the SUM all-reduce (every replica clips the same summed gradient, as one device would),
    # and the replica's clock stops when its gradients are ready, before the all-reduce waits for the others.
    from keras.src.backend.tensorflow.optimizer import TFOptimizer
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    original_clip = TFOptimizer._clip_gradients  # noqa: SLF001 - Keras' own, for the clipping on the host

    @patch(TFOptimizer, "_clip_gradients")
    def _clip_gradients(original, self, grads):
        if current_weighting_strategy() is not None:
            hooks.fired(hooks.CLIP_SKIPPED)
            return grads
        return original(self, grads)

    def _clip_on_host(optimizer, grads):
        hooks.fired(hooks.CLIP_SUMMED)
        return original_clip(optimizer, grads)

    @patch(TFOptimizer, "_all_reduce_sum_gradients")
    def _all_reduce_sum_gradients(original, self, grads_and_vars):
        multi_worker = current_multi_worker_strategy()
        if getattr(_reduced_already, "active", False):  # an accumulated update under the multi-worker strategy
            return list(grads_and_vars)
        if multi_worker is not None and tf.distribute.get_replica_context() is not None:
            grads_and_vars = [(shared_rows_dense(g), v) for g, v in grads_and_vars]
            grads = multi_worker._on_replica_gradients([g for g, _ in grads_and_vars])  # noqa: SLF001
            reduced = original(self, list(zip(grads, [v for _, v in grads_and_vars])))
            # Every replica clips the same summed gradient.
            return list(zip(_clip_on_host(self, [g for g, _ in reduced]), [v for _, v in reduced]))
        strategy = current_hetero_strategy()
        if strategy is None or tf.distribute.get_replica_context() is None:
            return original(self, grads_and_vars)
        hooks.fired(hooks.ALL_REDUCE)
        grads_and_vars = list(grads_and_vars)
        grads = strategy._on_replica_gradients([g for g, _ in grads_and_vars])  # noqa: SLF001
        grads_and_vars = list(zip(grads, [v for _, v in grads_and_vars]))
        # The barrier: a token on the parameter device that exists once every replica's gradients do. Writes
        # that need no other replica (the iteration counter) wait for it through a control edge, which moves no
        # data. Waiting on the summed gradients instead would make every replica fetch its own copy of the whole
        # summed gradient, which nothing else reads: 2-3 % of a 5 ms CPU step in benchmarks/overhead.py (step
        # only), and a host-to-device copy of the whole gradient per replica on GPUs.
        # The variable updates (cross-replica, in _distributed_tf_update_step) wait for it too: an update needs
        # only its own summed gradient, which may exist before another replica's backward pass fails.
        local = [g for g, _ in grads_and_vars if g is not None]
        step = replica_state.current_replica_step()  # not None: current_hetero_strategy() says a replica step runs
        if step.sub_step is not None:
            # An overlapped micro-batched call: this replica's next micro-batch starts once these gradients exist
            # (hetero_cs.engine.replica_wrapping). Writes that need no other replica do not wait for this
            # sub-step's barrier: the call is undone as a whole when any part of it fails (MicroBatching.run).
            step.sub_step.ends[step.replica_id] = tf.nest.flatten(local, expand_composites=True)
        if not local:
            return grads_and_vars
        token = tf.distribute.get_replica_context().merge_call(_all_replicas_done, args=(local,))
        if step.sub_step is None:
            step.barrier[:] = [token]
        if step.handoff is not None:  # for this call's update merge (another call has its own handoff)
            step.handoff.barrier_token = token
        # Summed on the parameter device only, and clipped there: Keras' all_reduce would broadcast each sum back to
        # every replica's device (the update then reads replica 0's copy), and clip on every replica. Loss-scaled
        # gradients are unscaled and clipped on the host in the update instead (loss_scale.apply_or_skip).
        # Under micro-batching (a trace that may run as a sub-step) or Keras' gradient_accumulation_steps the sum is
        # clipped in the host update, once per update, on the sum it applies (_accumulating_update).
        deferred = (loss_scale.pending_scaler(self) is not None or strategy._micro_batching.armed  # noqa: SLF001
                    or bool(getattr(self, "gradient_accumulation_steps", None)))
        clip = None if deferred else functools.partial(_clip_on_host, self)
        # The clip function goes in the merge function, not its arguments (which are regrouped per replica).
        merge = functools.partial(_sum_on_parameter_device, clip=clip)
        return _refill(grads_and_vars, tf.distribute.get_replica_context().merge_call(merge, args=(local,)))

    @patch(TFOptimizer, "_apply_weight_decay")
    def _apply_weight_decay(original, self, variables):
        # Decoupled weight decay (AdamW, or any optimizer given weight_decay) is applied before the gradients are
        # summed, so it would run even when a replica's step fails. Under our strategy it is deferred to the update
        # merge below, where it runs first (the same order as in one device's step), behind the barrier.
        handoff = replica_state.current_step_handoff()
        if self.weight_decay is not None and current_hetero_strategy() is not None and handoff is not None:
            hooks.fired(hooks.DECAY_DEFERRED)
            handoff.weight_decay = (self, list(variables))
            return None
        return original(self, variables)

    @patch(TFOptimizer, "_distributed_tf_update_step")
    def _distributed_tf_update_step(original, self, distribution, grads_and_vars, learning_rate):
        # Cross-replica (merge_call), in the thread that runs the merge: this call's handoff holds what its replicas
        # left for it (consumed here). The token is from this step's graph only.
        handoff = replica_state.current_step_handoff()
        token = decay = start = None
        if handoff is not None:
            token, decay, start = handoff.barrier_token, handoff.weight_decay, handoff.start_stamp
            handoff.barrier_token = handoff.weight_decay = None
        if not is_hetero_strategy(distribution):
            return original(self, distribution, grads_and_vars, learning_rate)
        hooks.fired(hooks.UPDATE)
        current_graph = tf.compat.v1.get_default_graph()
        # Eager steps have no graph (and run in order): nothing to wait for.
        barrier = [token] if getattr(token, "graph", None) is current_graph and not tf.executing_eagerly() else []
        decay = decay[1] if decay is not None and decay[0] is self else None
        scaler = loss_scale.pending_scaler(self)
        if decay is not None:
            hooks.fired(hooks.DECAY_APPLIED)

        def update(pairs):  # the host update: deferred weight decay first (one device's order), then Keras' own
            if decay is not None:
                _weight_decay_cross_replica(self, distribution, decay)
            return original(self, distribution, pairs, learning_rate)

        grads_and_vars = list(grads_and_vars)
        summed = [t for g, _ in grads_and_vars if g is not None for t in distribution.experimental_local_results(g)]
        if fused_update.applies(distribution.fused_update, self, summed):
            update = fused_update.compiled(update, distribution.parameter_device)

        def run_update(pairs, *, clip: bool = False):
            if scaler is not None:  # mixed_float16: judged, unscaled, clipped and gated on the host
                hooks.fired(hooks.CLIP_SUMMED)
                return loss_scale.apply_or_skip(
                    scaler, self, distribution, pairs, clip=functools.partial(original_clip, self), update=update)
            if clip:
                with tf.device(distribution.parameter_device):
                    pairs = _refill(pairs, _clip_on_host(self, [g for g, _ in pairs if g is not None]))
            return update(pairs)

        with tf.control_dependencies(barrier):
            result = _accumulating_update(self, distribution, grads_and_vars, run_update)
            if result is None:  # no micro-batching armed, no gradient_accumulation_steps
                result = run_update(grads_and_vars)
        if getattr(start, "graph", None) is current_graph and not tf.executing_eagerly():
            # The host tail: the step ends when the update has written every variable (reads come after writes).
            with tf.device(distribution.parameter_device):
                reads = [tf.identity(v) for _, v in grads_and_vars]  # tf variables here: a read each
                stamp_step_end(start, reads, record=distribution._record_step_end,  # noqa: SLF001
                               sampled=handoff.sampled_start)
        return result

    @patch(TFOptimizer, "apply")  # BaseOptimizer.apply (public), where every gradient application goes
    def apply(original, self, grads, trainable_variables=None):
        # Records what this optimizer step needs of the hooks above (hooks.verify checks them once traced): the
        # all-reduce and the host update always, clipping and weight decay when configured.
        if current_hetero_strategy() is not None and tf.distribute.get_replica_context() is not None:
            # An optimizer class that overrides one of _HOOKED (a user's subclass, or Keras' Muon for weight decay)
            # bypasses the patch: clipping per slice or weight decay per replica would be silently wrong. Refused,
            # naming it.
            for name, role in _HOOKED.items():
                if getattr(type(self), name, None) is not getattr(TFOptimizer, name, None):
                    owner = next((c for c in type(self).__mro__ if name in vars(c)), type(self))
                    raise ConfigError(
                        f"The optimizer {type(self).__name__} overrides {name} (in {owner.__module__}."
                        f"{owner.__qualname__}), which hetero_cs replaces for {role}; with the override the step "
                        f"would not equal one device's. Use an optimizer that does not override it, or move the "
                        f"custom logic into update_step.")
            # Keras updates the moving average of use_ema=True inside a cond whose branch makes a merge call (the
            # variables' writes); TensorFlow refuses that in a replica step ("merge_call called while defining a new
            # graph"), under stock MirroredStrategy too. Refused before it, with the fix.
            if getattr(self, "use_ema", False):
                raise ConfigError(
                    f"The optimizer {type(self).__name__} has use_ema=True, which TensorFlow cannot run in a replica "
                    f"step under a central-storage strategy (Keras updates the moving average inside a condition "
                    f"that writes the variables; stock MirroredStrategy fails the same way). Train with "
                    f"use_ema=False; to average the weights, keep your own copy in a callback (on_train_batch_end), "
                    f"or average checkpoints.")
            grads = list(grads)
            if any(g is not None for g in grads):
                hooks.expect_optimizer_step(
                    self, central_iterations=_central_in_replica_context(self.iterations) is not None)
        return original(self, grads, trainable_variables)

    @patch(BaseOptimizer, "_backend_apply_gradients")
    def _backend_apply_gradients(original, self, grads, trainable_variables):
        # Keras' gradient accumulation keeps one accumulator per variable and adds to it inside a cond: under a
        # central-storage strategy that fails in graph mode (a merge call inside the cond) and, eagerly, adds each
        # replica's unreduced gradient. Under our strategy the step takes Keras' plain path (clipping and weight decay
        # are deferred to the host anyway), and the host update sums and applies every n-th step
        # (_accumulating_update): Keras' own rule, on the exact summed gradient.
        if not getattr(self, "gradient_accumulation_steps", None) or tf.distribute.get_replica_context() is None:
            return original(self, grads, trainable_variables)
        multi_worker = current_multi_worker_strategy()
        if multi_worker is not None:
            return _accumulate_across_workers(self, multi_worker, grads, trainable_variables,
                                              functools.partial(original_clip, self))
        if current_hetero_strategy() is not None:
            grads = self._clip_gradients(grads)
            self._apply_weight_decay(trainable_variables)
            return self._backend_update_step(grads, trainable_variables, self.learning_rate)
        return original(self, grads, trainable_variables)


_reduced_already = threading.local()  # .active: the gradients of this update were all-reduced before the cond


def _refill(pairs, values) -> list:
    """``pairs`` of (gradient, variable) with each gradient that is not None replaced by the next of ``values``."""
    values = iter(values)
    return [(None if g is None else next(values), v) for g, v in pairs]


def _accumulate_across_workers(optimizer, strategy, grads, trainable_variables, clip):
    """Keras' ``gradient_accumulation_steps`` under the multi-worker strategy, in replica context.

    Keras decides in a ``tf.cond`` whether this step applies the accumulated gradients, and its apply branch
    all-reduces them (a merge call), which tf.distribute cannot trace inside a replica's cond ("merge_call called
    while defining a new graph"). Here the gradients are all-reduced first, every step (the SUM of every replica's
    ``b_i / B``-weighted gradient: the exact gradient of the global batch), and the cond runs in cross-replica
    context, each branch running Keras' own pieces back in replica context (``call_for_each_replica``), as Keras 2's
    LossScaleOptimizer applied its conditional step: the apply branch averages the accumulated sums and this step's
    (Keras' rule: ``(g + acc) / n``), clips that once, applies weight decay and the update, and zeroes the
    accumulators; the other adds this step's sum to them. Every worker takes the same branch (the iteration count is
    mirrored), and neither branch runs a collective. The iteration count advances after, in Keras' ``apply``.
    """
    n = optimizer.gradient_accumulation_steps
    # As the strategy's _all_reduce_sum_gradients, without its clipping: clipping belongs to the update here (once,
    # on the average it applies).
    local = strategy._on_replica_gradients([shared_rows_dense(g) for g in grads])  # noqa: SLF001 - clock, then SUM
    context = tf.distribute.get_replica_context()
    summed = iter(context.all_reduce(tf.distribute.ReduceOp.SUM, [g for g in local if g is not None]))
    summed = [None if g is None else next(summed) for g in local]
    variables = list(trainable_variables)
    accumulators = [optimizer._accumulated_gradients[optimizer._get_variable_index(v)]  # noqa: SLF001
                    for v in variables]

    def apply_step(step_grads):
        averaged = [None if g is None else (g + a) / n for g, a in zip(step_grads, accumulators)]
        averaged = clip(averaged)
        optimizer._apply_weight_decay(variables)  # noqa: SLF001
        with set_locally(_reduced_already, active=True):
            optimizer._backend_update_step(averaged, variables, optimizer.learning_rate)  # noqa: SLF001
        optimizer._backend_reset_gradient_accumulators()  # noqa: SLF001

    def accumulate_step(step_grads):
        optimizer._backend_increment_gradient_accumulators(step_grads, accumulators)  # noqa: SLF001

    def cross_replica(distribution, step_grads):
        def branch(step, applies: bool):
            def run():
                distribution.extended.call_for_each_replica(step, args=(step_grads,))
                return tf.constant(applies)
            return run

        is_update_step = (optimizer._iterations + 1) % n == 0  # noqa: SLF001
        return tf.cond(is_update_step, branch(apply_step, True), branch(accumulate_step, False))

    context.merge_call(cross_replica, args=(summed,))


def iteration_counter(optimizer):
    """The optimizer's iteration counter variable (None without an optimizer), which a step may have to put back."""
    # Private: Keras keeps the count of optimizer steps in _iterations; the public `iterations` is that variable,
    # except under gradient_accumulation_steps, where it is the count divided by the steps (a tensor).
    counter = getattr(optimizer, "_iterations", None)
    return counter if counter is not None else getattr(optimizer, "iterations", None)


def _accumulating_update(optimizer, distribution, grads_and_vars, run_update):
    """The host update of a step that may sum gradients over calls before applying them, or None when none does.

    Two things sum gradients on the host (in :meth:`MicroBatching.accumulators`, one host variable per trained
    variable): micro-batching (:mod:`hetero_cs.engine.memory.micro_batches`, whose host state says which sub-step this is)
    and Keras' ``gradient_accumulation_steps=n`` (applied every n-th optimizer step, on the average of the n steps'
    summed gradients, as Keras does on one device). The update then takes one of four branches:

    0. An ordinary step: the update on its summed gradients, clipped here.
    1. A sub-step that is not its step's last: its gradients go into the sums; nothing is applied, and the iteration
       count that Keras adds after this update is taken back (a whole step counts once).
    2. The last sub-step (or an ordinary step) of a step Keras' accumulation does not apply yet: into the sums.
    3. The last sub-step, or Keras' n-th step: the update on (sums + its own) / n (n = 1 without Keras'
       accumulation), clipped here (or judged, unscaled and clipped under loss scaling); the sums are zeroed.
    """
    micro = getattr(distribution, "_micro_batching", None)
    armed = micro is not None and micro.armed
    n = getattr(optimizer, "gradient_accumulation_steps", None) or None
    if not armed and n is None:
        return None
    if getattr(optimizer, "use_ema", False) and armed:
        raise MicroBatchError(
            "An optimizer with use_ema=True cannot be micro-batched: its moving average would be updated once per "
            "micro-batch. Pass micro_batches=False to the strategy, or train without use_ema.")
    pairs = list(grads_and_vars)
    present = [(g, v) for g, v in pairs if g is not None]
    device = distribution.parameter_device
    with tf.device(device):
        sub_step = micro.update_branch() if armed else tf.constant(0, tf.int32)  # 0 ordinary, 1 not last, 2 last
        static = isinstance(sub_step, int)  # an overlapped call's sub-step: the branch is known while tracing
        if static:
            sub_step = tf.constant(sub_step, tf.int32)
        # Keras' rule, read before apply() counts this step: (iterations + 1) % n == 0. Private: Keras' iteration
        # counter (the public `iterations` divides it by n under accumulation).
        keras_applies = tf.constant(True) if n is None else tf.equal((optimizer._iterations + 1) % n, 0)  # noqa: SLF001
        branch = tf.where(tf.equal(sub_step, 1), 1, tf.where(
            tf.logical_not(keras_applies), 2, tf.where(tf.logical_or(tf.equal(sub_step, 2), n is not None), 3, 0)))
    # A sparse gradient (an Embedding's tf.IndexedSlices) stays sparse over sub-steps: its rows are concatenated, as
    # the sum over replicas concatenates them, so the update sees one device's IndexedSlices (Adam squares each row
    # entry, so a densified sum would not be the same step); the rows of a lookup that does not depend on the batch
    # are added row by row instead, as over replicas (sparse_rows.shared_rows_sum). Keras' accumulation sums densely, as it does
    # itself.
    sums = [micro.sparse_accumulator(v, g) if isinstance(g, tf.IndexedSlices) and n is None
            else micro.accumulators([v])[0] for g, v in present]

    def ordinary():
        run_update(pairs, clip=True)
        return tf.constant(True)

    def add(uncount: bool):
        with tf.device(device):
            writes = [s.add(g) if isinstance(s, SparseSum) else s.assign_add(tf.convert_to_tensor(g))
                      for (g, _), s in zip(present, sums)]
            if uncount:
                writes.append(optimizer._iterations.assign_sub(1))  # noqa: SLF001 - the counter itself
        with tf.control_dependencies(writes):
            return tf.constant(True)

    def apply_sums():
        with tf.device(device):
            # Divided by n as Keras does (a product with 1 / n is not the same float; tf.cast(1 / 3, float64) loses
            # the bits past float32's).
            total_pairs = _refill(pairs, [s.total(g) if isinstance(s, SparseSum)
                                          else (tf.convert_to_tensor(g) + s.read_value()) / (n or 1)
                                          for (g, _), s in zip(present, sums)])
        run_update(total_pairs, clip=True)
        done = tf.nest.flatten([g for g, _ in total_pairs if g is not None], expand_composites=True)
        with tf.device(device), tf.control_dependencies(done):
            zeroed = [s.clear() if isinstance(s, SparseSum) else s.assign(tf.zeros_like(s)) for s in sums]
        with tf.control_dependencies(zeroed):
            return tf.constant(True)

    if static:
        # No switch_case: a Case op's resource inputs are those of every branch, the weights that apply_sums writes
        # included, so TensorFlow's automatic control dependencies would make the next sub-step's reads of the
        # weights (its forward pass, on every card) wait for this update: a barrier between sub-steps.
        if int(tf.get_static_value(sub_step)) == 1:
            # Clipping and the loss-scale judgement happen once, in the call's last sub-step, on the whole sum this
            # one adds to (traced there: that sub-step's own hook record checks them).
            hooks.fired(hooks.CLIP_SUMMED)
            hooks.fired(hooks.LOSS_SCALE_HOST)
            return add(True)
        # The call's last sub-step: nothing runs after it.
        return apply_sums() if n is None else tf.cond(keras_applies, apply_sums, lambda: add(False))
    return tf.switch_case(branch, [ordinary, lambda: add(True), lambda: add(False), apply_sums])


# Methods whose override changes what runs per replica even when it calls super(): clipping or weight decay of its
# own would apply to each replica's slice. (An override of the all-reduce or of the host update that calls super()
# is fine; one that does not leaves a hook unrun, which hooks.verify reports.)
_HOOKED = {
    "_clip_gradients": "clipping, which must apply to the summed gradient, not to each replica's slice",
    "_apply_weight_decay": "decoupled weight decay, which must run once, in the host update, behind the barrier",
}


def _weight_decay_cross_replica(optimizer, distribution, variables) -> None:
    # Keras' TFOptimizer._apply_weight_decay, minus its maybe_merge_call (we are already in the merge): the same
    # decoupled decay, variable by variable, on the parameter device. _use_weight_decay is Keras' own exclusion
    # list (exclude_from_weight_decay).
    from keras.src import backend

    def weight_decay_fn(variable):
        if optimizer._use_weight_decay(variable):  # noqa: SLF001
            lr = tf.cast(optimizer.learning_rate, variable.dtype)
            wd = tf.cast(optimizer.weight_decay, variable.dtype)
            variable.assign_sub(variable * wd * lr)

    for variable in variables:
        distribution.extended.update(variable.value if isinstance(variable, backend.Variable) else variable,
                                     weight_decay_fn, group=False)


def _sum_on_parameter_device(strategy, per_replica_grads, clip=None) -> list:
    """Cross-replica: each gradient summed over the replicas on the parameter device (then ``clip``ped there).

    Returns plain tensors on the parameter device, one per gradient; every replica receives these same tensors back
    from the merge (no copy to its device), and the optimizer's update, on the parameter device too, reads them
    where they are. ``tf.IndexedSlices`` (an Embedding's gradient) are summed as such.
    """
    device = strategy.parameter_device
    shared = [shared_rows_sum(strategy, g, device) for g in per_replica_grads]
    reduced = strategy.extended.batch_reduce_to(
        tf.distribute.ReduceOp.SUM, [(g, device) for g, done in zip(per_replica_grads, shared) if done is None])
    sums = iter(strategy.experimental_local_results(r)[0] for r in reduced)
    sums = [done if done is not None else next(sums) for done in shared]
    if clip is None:
        return sums
    with tf.device(device):
        return list(clip(sums))


def _all_replicas_done(strategy, per_replica_grads):
    """Cross-replica: a scalar on the parameter device that is computed after every replica's every gradient."""
    local = [t for value in per_replica_grads for t in strategy.experimental_local_results(value)]
    deps = tf.nest.flatten(local, expand_composites=True)  # IndexedSlices (embedding gradients) -> their tensors
    with tf.device(strategy.parameter_device), tf.control_dependencies(deps):
        return tf.identity(tf.constant(0, tf.int32))
