"""Patches that check themselves: every hook a traced step needs must have run by the end of that step.

Part of :mod:`hetero_cs.engine._compat`, the one place of private TensorFlow/Keras touches.

The patches work in pairs: the optimizer's clipping is skipped per replica *and* applied to the summed gradient,
weight decay is deferred in replica context *and* applied in the host update, and so on. If a new Keras stops
calling one of the patched functions (a rename, a new code path), the other half still runs and training goes on
silently without clipping, without weight decay, with stock ``1 / R`` loss weighting or with drifting metrics.

So each patched hook records that it ran (:func:`fired`), and the public entry points that make a hook necessary
(``optimizer.apply``, ``LossScaleOptimizer.apply``, ``Loss.__call__``, ``Mean.update_state``, Keras' own
``_compute_loss``) record what they need (:func:`expect`). Both go to the :class:`StepHooks` of the
``strategy.run`` call being made, held by its :class:`~hetero_cs.engine.step.replica_state.StepHandoff`: reached through the
replica's :class:`~hetero_cs.engine.step.replica_state.ReplicaStep` in a replica thread, and through
``replica_state.step_handoff`` in the merge calls, which run in the calling thread. When the step has been
traced, :func:`verify` raises :class:`~hetero_cs.errors.UnsupportedVersionError` naming every needed hook that did
not run, the installed versions and the supported range. Only traced steps are checked (steps run eagerly record
too, but are not verified): a step's graph is built once, so the check costs nothing per step.
"""

import dataclasses

from hetero_cs.engine.step import replica_state

# What each hook is, in the words of the error message.
ALL_REDUCE = "TFOptimizer._all_reduce_sum_gradients (the replicas' gradients summed on the host)"
UPDATE = "TFOptimizer._distributed_tf_update_step (the optimizer's update on the host)"
CLIP_SKIPPED = "TFOptimizer._clip_gradients in replica context (per-slice clipping, replaced by the next one)"
CLIP_SUMMED = "clipping of the summed gradient on the host (clipnorm / global_clipnorm / clipvalue)"
DECAY_DEFERRED = "TFOptimizer._apply_weight_decay (decoupled weight decay, deferred to the host update)"
DECAY_APPLIED = "the deferred weight decay in the host update"
LOSS_SCALE_APPLY = "LossScaleOptimizer._tf_apply (loss-scaled gradients handed to the inner optimizer)"
LOSS_SCALE_HOST = "the loss-scale judgement on the host (finite check, unscaling, gated update)"
VARIABLE_WRITE = "keras Variable.assign_add / assign on a central variable (aggregated metric and iteration updates)"
LOSS_REDUCE = "keras.src.losses.loss.reduce_weighted_values (the b_i / B weighting of a Keras loss)"
LOSS_SCALE = "keras.src.losses.loss.scale_loss_for_distribution (b_i / B instead of 1 / num_replicas)"
LOSS_UNSCALE = "keras.src.losses.loss.unscale_loss_for_distribution (the logged loss)"

# What goes wrong without a hook (the error message's second sentence).
_CONSEQUENCE = {
    ALL_REDUCE: "gradients would not be weighted, clipped or timed as hetero_cs promises",
    UPDATE: "the update would not wait for every replica, nor apply deferred weight decay or loss scaling",
    CLIP_SKIPPED: "each replica's slice gradient would be clipped before the sum (not one device's clipping)",
    CLIP_SUMMED: "clipping would silently not happen",
    DECAY_DEFERRED: "weight decay would run before the step is known to succeed, or twice",
    DECAY_APPLIED: "weight decay would silently not happen",
    LOSS_SCALE_APPLY: "loss scaling (mixed_float16) would not be judged on the summed gradient",
    LOSS_SCALE_HOST: "gradients would stay multiplied by the loss scale, or overflowed steps would be applied",
    VARIABLE_WRITE: "metrics and the iteration counter would drift (every replica's old value summed)",
    LOSS_REDUCE: "masked and sample-weighted losses would not be exact b_i / B shares",
    LOSS_SCALE: "the loss would not be weighted b_i / B (stock 1 / num_replicas, or no weighting)",
    LOSS_UNSCALE: "the logged loss would be wrong",
}


@dataclasses.dataclass
class StepHooks:
    """Which patched hooks ran in one ``strategy.run`` call (one traced step), and which that step needs.

    Attributes:
        fired: The hooks that ran.
        expected: Hook -> what needed it (e.g. ``"SGD.apply"``), in the order first needed.
    """

    fired: set = dataclasses.field(default_factory=set)
    expected: dict = dataclasses.field(default_factory=dict)


def fired(hook: str) -> None:
    """Records that ``hook`` ran in the step this thread works on (nothing outside a checked step)."""
    record = replica_state.current_hooks()
    if record is not None:
        record.fired.add(hook)


def expect(*hooks: str, by: str) -> None:
    """Records that the step this thread works on needs ``hooks``, because of ``by`` (for the message)."""
    record = replica_state.current_hooks()
    if record is not None:
        for hook in hooks:
            record.expected.setdefault(hook, by)


def expect_optimizer_step(optimizer, *, central_iterations: bool) -> None:
    """What one ``optimizer.apply`` (a Keras TF optimizer, in replica context, with gradients) needs."""
    by = f"{type(optimizer).__name__}.apply"
    expect(ALL_REDUCE, UPDATE, by=by)
    if central_iterations:
        expect(VARIABLE_WRITE, by=f"{by} (its iteration counter)")
    if any(getattr(optimizer, name, None) for name in ("clipnorm", "global_clipnorm", "clipvalue")):
        expect(CLIP_SKIPPED, CLIP_SUMMED, by=f"{by} with clipping")
    if getattr(optimizer, "weight_decay", None) is not None:
        expect(DECAY_DEFERRED, DECAY_APPLIED, by=f"{by} with weight_decay={optimizer.weight_decay}")


def verify(record: StepHooks) -> None:
    """Raises UnsupportedVersionError when a hook the traced step needs did not run."""
    missing = [(hook, by) for hook, by in record.expected.items() if hook not in record.fired]  # what needed it
    if not missing:
        return
    from hetero_cs._supported import version_advice
    from hetero_cs.errors import UnsupportedVersionError

    listed = "; ".join(f"{hook}, needed by {by}: without it {_CONSEQUENCE.get(hook, 'the step is not exact')}"
                       for hook, by in missing)
    raise UnsupportedVersionError(
        f"hetero_cs: a patched Keras/TensorFlow hook did not run in this traced step under "
        f"HeteroCentralStorageStrategy: the installed Keras/TensorFlow no longer calls what hetero_cs patches, or the "
        f"optimizer's class overrides the hook without calling super(). Missing ({len(missing)}): {listed}. Nothing of "
        f"this step was run. If the optimizer is your own subclass, call super() in the override; else "
        f"{version_advice()}"
    )
