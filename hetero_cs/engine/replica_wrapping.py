"""The wrapper every replica function runs in: its slice size b_i, the global batch B, its clock, emulated memory.

``HeteroCentralStorageStrategy`` wraps each function given to ``strategy.run`` (Keras' train step included) with
:func:`wrap_replica_fn`; the wrapped function runs in replica context under
:func:`hetero_cs.engine.step.replica_state.replica_step`, which the exact b_i/B weighting and the step timing read.
"""

import contextlib

import tensorflow as tf

from hetero_cs.engine import _compat
from hetero_cs.engine.step import replica_state, tensors
from hetero_cs.engine.step.sub_steps import current_sub_step
from hetero_cs.engine._compat.batch_flow import BatchFlow, seed_replica_step
from hetero_cs.engine._compat.loss_reader import check_predictions, shares_of_logs
from hetero_cs.devices.device_errors import naming_the_replica
from hetero_cs.devices.step_clock import emulated_memory_gate, sampled_wall_clock_stamp, wall_clock_stamp
from hetero_cs.errors import ConfigError


def wrap_replica_fn(strategy, fn, args, kwargs, batch_leaves=(), timed=None, handoff=None, scope_replica=False,
                    whole=False):
    """Wraps a replica function so it knows its slice size b_i, the global batch B and its start time.

    ``b_i`` and ``B`` come from one argument leaf: the first of ``batch_leaves`` (slices of a distributed
    dataset's element) if any, else the first per-replica value whose components all have a batch dimension.
    ``timed`` (a bool scalar tensor, or None) is this step's plan's word on whether to time it (sampled timing).
    ``handoff`` (a :class:`hetero_cs.engine.step.replica_state.StepHandoff`, shared by the call's replicas) goes on every
    replica's step. ``scope_replica``: the call runs some replicas only (the others idle), whose threads
    tf.distribute numbers 0, 1, ... in its op names ("replica_<k>/"): each replica's ops then also go under
    "hetero_replica_<replica id>/", so that an op error names the right replica. ``whole``: the call's one replica
    holds the whole global batch (``batch_leaves`` are tensors) and runs as one device's step: timed as any, with
    nothing weighed (``ReplicaStep.whole_batch``).
    """
    flat = tf.nest.flatten((args, kwargs or {}))
    batch_ids = {id(v) for v in batch_leaves}

    def is_batched_per_replica(v):
        return isinstance(v, tf.distribute.DistributedValues) and all(
            getattr(c, "shape", None) is not None and c.shape.rank != 0 for c in strategy.experimental_local_results(v))

    sub_step = current_sub_step()  # a sub-step of an overlapped micro-batched call (traced in this thread)
    # The leaves each replica receives its own slice of: one row per example (the loss reader's seeds).
    row_leaves = [i for i, v in enumerate(flat) if id(v) in batch_ids or is_batched_per_replica(v)]
    batch_index = next((i for i in row_leaves if id(flat[i]) in batch_ids), row_leaves[0] if row_leaves else None)
    global_batch_size = step_start = None
    sampled = strategy._sampled_timing and timed is not None  # one decision per step: every replica agrees
    if batch_index is not None:
        components = strategy.experimental_local_results(flat[batch_index])
        with tf.device(strategy._parameter_device):
            # A sub-step of a micro-batched step weighs by the whole step's B.
            global_batch_size = strategy._micro_batching.full_batch_size(
                tf.add_n([tensors.leading_dim(c) for c in components]))
            # In an overlapped call each replica's micro-batch starts when its previous one ends, not when the
            # step starts: its clock starts in the replica (below), and the call has no shared start.
            if strategy._timing_enabled and sub_step is None:
                # One clock start per step, when the step's input is there: every replica's step time runs
                # from it (what a real device's does: input and parameters reach it after the step starts).
                anchor = tensors.dense_part(components[0])  # data, so never constant-folded
                step_start = (sampled_wall_clock_stamp(anchor, timed, emulated=strategy._emulator is not None)
                              if sampled else wall_clock_stamp(anchor))
                if handoff is not None:  # the host's end of this step is timed from the same start
                    handoff.start_stamp, handoff.sampled_start = step_start, sampled
    if strategy._emulation_pending():
        raise ConfigError("Emulated devices need the model's size before the first step. model.fit does this for you; "
                          "before a model.evaluate or model.predict that comes before any fit, and in a custom loop "
                          "before the first strategy.run, call strategy.calibrate(model, dataset) once.")

    # Traced inside evaluate or predict (fit's validation pass included): an inference step.
    roles = strategy._input_roles
    inferring, keras_loop, logs = roles.inferring_now, roles.keras_loop_now, roles.keras_logs_now

    def replica_fn(*call_args, **call_kwargs):
        replica_id = _compat.replica_id_in_sync_group(tf.distribute.get_replica_context())
        previous = sub_step.ends.get(replica_id) if sub_step is not None else None
        if previous:
            # One micro-batch at a time on this card: this one starts once the replica's previous one has its
            # gradients (copied to the host where it is timed). Nothing else gates it (no other replica, no host
            # update).
            with tf.control_dependencies(previous):
                call_args, call_kwargs = tf.nest.map_structure(
                    lambda t: tf.identity(t) if isinstance(t, tf.Tensor) else t, (call_args, call_kwargs),
                    expand_composites=True)
        call_flat = tf.nest.flatten((call_args, call_kwargs))
        if batch_index is not None and batch_index < len(call_flat):
            batched = call_flat[batch_index]  # this replica's component of the batch leaf
        else:  # no per-replica batch: the first argument with a batch dimension
            batched = next((t for t in call_flat if isinstance(t, (tf.Tensor, tf.RaggedTensor))
                            and (t.shape.rank is None or t.shape.rank >= 1)), None)
        batch_size = tensors.leading_dim(batched) if batched is not None else tf.constant(0, tf.int32)
        start = step_start
        if sub_step is not None and sub_step.end_stamps.get(replica_id):
            start = sub_step.end_stamps[replica_id][-1]  # back to back: where its previous micro-batch stopped
        # On real devices the micro-batches of an overlapped call are timed as one chain per card, from its first
        # micro-batch's start (below) to its last one's end: a clock between them would only add host callbacks
        # between a card's micro-batches. Emulated cards time each one (their waits need it).
        chained = sub_step is not None and strategy._emulator is None
        if chained and replica_id in sub_step.chain_starts:
            start = sub_step.chain_starts[replica_id]
        if start is None and strategy._timing_enabled and batched is not None:
            start = wall_clock_stamp(tensors.dense_part(batched))
            if chained:
                sub_step.chain_starts[replica_id] = start
        step = replica_state.ReplicaStep(
            replica_id=replica_id, device=strategy._compute_devices[replica_id], batch_size=batch_size,
            global_batch_size=None if whole else global_batch_size, start_stamp=start,
            sampled_timing=step_start is not None and sampled, shared_start=step_start is not None, handoff=handoff,
            sub_step=sub_step, flow=BatchFlow(replica_id), whole_batch=whole)
        if strategy._emulator is not None and batched is not None:
            # An emulated slice too large for its device fails here, before the replica computes anything (no
            # loss or metric of the failed step is formed), as a GPU fails at its first large allocation.
            call_args, call_kwargs = emulated_memory_gate(
                (call_args, call_kwargs), tensors.dense_part(batched), replica_id=replica_id,
                batch_size=batch_size, emulator=strategy._emulator, training=not inferring)
        if not whole:
            seed_replica_step(step, [v for i, v in enumerate(call_flat) if i in row_leaves],
                              [v for i, v in enumerate(tf.nest.flatten((call_args, call_kwargs))) if i in row_leaves])
        scope = tf.name_scope(f"hetero_replica_{replica_id}") if scope_replica else contextlib.nullcontext()
        with replica_state.replica_step(step), naming_the_replica(replica_id), scope:
            outputs = fn(*call_args, **call_kwargs)
            if step.global_batch_size is None or not keras_loop:
                return outputs
            return shares_of_logs(step, outputs) if logs else check_predictions(step, outputs)

    return replica_fn
