"""XLA per replica: ``compile(jit_compile=True)`` compiles each replica's forward and backward pass on its device.

One device's ``model.fit`` compiles its whole training step with XLA when ``jit_compile=True`` (and by default on a
GPU); Keras turns XLA off under every ``tf.distribute`` strategy. Under :class:`~hetero_cs.HeteroCentralStorageStrategy`
each replica's part of Keras' ``train_step`` (the forward pass, the loss and the gradient of the loss with respect
to the weights) is one XLA function placed on the replica's device, and the optimizer's update on the parameter
device is another (``fused_update``, :mod:`hetero_cs.engine.step.fused_update`). Between them nothing changes: the
replicas' gradients are weighted ``b_i / B`` and summed on the host, so one step still equals one single-device
step on the whole global batch (the oracle tests compare against one device with ``jit_compile=True``).
:class:`~hetero_cs.HeteroMultiWorkerMirroredStrategy` compiles its replicas' passes the same way, each fed its own
mirrored copy of the weights.

Why not the whole step, as on one device: the weights live once, on the parameter device, and XLA cannot read a
variable placed on another device (TensorFlow's known issue "tf.Variable on a different device"). Each replica
therefore reads the weights it needs (a copy to its device, as every central-storage step does) and hands them to
its compiled function as inputs (Keras' stateless call); the optimizer's update, the metrics and the per-replica
timing stay outside.

When it applies (:func:`applies`):

* ``compile(jit_compile=True)``, or ``"auto"`` where Keras would compile on one device: a GPU is present and every
  layer supports XLA (``layer.supports_jit``). On a CPU-only machine ``"auto"`` stays off, as it does on one device.
* Keras' own ``train_step`` (also when a ``train_step`` override calls ``super().train_step``). An override that
  computes its own step runs without XLA, with a warning: its forward pass, tape and optimizer call are one
  Python function hetero_cs cannot cut.
* No ``BatchNormalization`` layer in training. hetero_cs normalises a training batch by the statistics of the whole
  global batch (:mod:`hetero_cs.engine._compat.batch_norm`), an all-reduce across replicas inside the forward pass,
  which no per-replica compiled function can hold. Such a model trains without XLA, with a warning naming the layer;
  a frozen BatchNormalization (``trainable=False``, inference statistics) does not count.
* No all-reduce across replicas in the forward pass or the loss. A masked loss, or one reduced with
  ``"mean_with_sample_weight"``, is normalised by the whole global batch's mask or weights, an all-reduce; so is a
  layer of the user's own that synchronises replicas. Found while the step is traced: the model then trains without
  XLA, with a warning.
* ``evaluate`` and ``predict`` run each replica's forward pass without XLA.

What it costs: XLA compiles each replica's function once per slice size it meets (a new plan, a last partial batch,
micro-batches of another size): a fraction of a second for small models, seconds for large ones, as one device pays
once per batch shape; a step traced again (a new set of idle replicas) compiles anew. A model XLA cannot compile (an
op without an XLA kernel: ``tf.py_function``, string ops) fails at its first step with a
:class:`~hetero_cs.errors.ConfigError` naming the op and the fix, ``jit_compile=False``; nothing of that step was
applied.
"""

import logging
import weakref

from hetero_cs.engine._compat.context import strategy_of
from hetero_cs.engine._compat.layers import batch_norms_in_training
from hetero_cs.errors import ConfigError

logger = logging.getLogger(__name__)

_warned: weakref.WeakSet = weakref.WeakSet()
_fell_back: weakref.WeakSet = weakref.WeakSet()
_said_compiled: weakref.WeakSet = weakref.WeakSet()


def check_setting(model) -> None:
    """Raises ConfigError unless ``model``'s ``jit_compile`` is True or False (``"auto"`` resolved at compile).

    Keras' ``compile`` takes any value; any other true value would ask XLA for the whole distributed step.
    """
    value = getattr(model, "_jit_compile", None)  # private: what compile stored, before Keras resolves None
    if value is not None and not isinstance(value, bool):
        raise ConfigError(
            f"compile(jit_compile=...) must be True, False or \"auto\". Received: jit_compile={value!r}. Compile "
            f"with jit_compile=True to compile each replica's forward and backward pass with XLA, or False for none.")


def requested(model) -> bool:
    """True when ``model`` was compiled with ``jit_compile=True`` (or ``"auto"`` resolved to True) and runs traced."""
    return getattr(model, "jit_compile", False) is True and not getattr(model, "run_eagerly", False)


def unsupported_reason(model) -> str | None:
    """Why XLA per replica cannot compile Keras' ``train_step`` for ``model``, or None when it can.

    Returns:
        A sentence naming the layers, for the warning of :func:`warn_at_fit`.
    """
    batch_norms = batch_norms_in_training(model)
    if batch_norms:
        names = ", ".join(repr(layer.name) for layer in batch_norms[:3]) + (" ..." if len(batch_norms) > 3 else "")
        return (f"BatchNormalization layer {names} normalises a training batch by the whole global batch's "
                f"statistics, an all-reduce across replicas inside the forward pass that a per-replica XLA function "
                f"cannot hold")
    return None


def applies(model) -> bool:
    """Whether Keras' ``train_step`` of ``model`` compiles each replica's forward and backward pass with XLA."""
    return requested(model) and model not in _fell_back and unsupported_reason(model) is None


def note_compiled(model) -> None:
    """Says once per model (INFO) that its replicas' forward and backward passes are compiled with XLA."""
    if model in _said_compiled:
        return
    _said_compiled.add(model)
    logger.info("hetero_cs: compile(jit_compile=True): each replica's forward pass, loss and gradient are compiled "
                "with XLA on its device; XLA compiles again for every new slice size.")


def fall_back(model, reason: str) -> None:
    """Found while tracing ``model``'s step: it cannot compile per replica because of ``reason``. It trains
    without XLA from now on (this trace included), and a warning says why, once per model."""
    _fell_back.add(model)
    _warn_once(model, reason)


def warn_at_fit(model, keras_train_step) -> None:
    """Before ``fit`` traces its step: warns once per model when XLA was asked for and cannot apply, naming why.

    Args:
        model: The compiled Keras model about to train.
        keras_train_step: Keras' ``train_step`` as the model class would inherit it, to tell an override.
    """
    if not requested(model) or model in _warned:
        return
    reason = unsupported_reason(model)
    if reason is None and getattr(type(model), "train_step", None) is not keras_train_step:
        reason = (f"{type(model).__name__} overrides train_step, and only Keras' own train_step (also when the "
                  f"override calls super().train_step) is cut into a compiled forward and backward pass per replica; "
                  f"the override's own operations run without XLA")
    if reason is not None:
        _warn_once(model, reason)


def _warn_once(model, reason: str) -> None:
    if model in _warned:
        return
    _warned.add(model)
    logger.warning("hetero_cs: compile(jit_compile=True) asked for XLA, but %s. It trains exactly, as with "
                   "jit_compile=False; compile with jit_compile=False to silence this.", reason)


# -- idle replicas under the multi-worker strategy: they skip their pass unless the model's step needs it --------
_multi_worker_fell_back: weakref.WeakSet = weakref.WeakSet()


def multi_worker_skips(model) -> bool:
    """Under the multi-worker strategy: whether a replica of ``model`` with 0 examples skips its forward and
    backward pass in Keras' own ``train_step`` (no trainable BatchNormalization, whose statistics all-reduce inside
    the forward pass, and no such all-reduce found while tracing)."""
    return model not in _multi_worker_fell_back and not batch_norms_in_training(model)


def multi_worker_fall_back(model, reason: str) -> None:
    """Found while tracing ``model``'s step: its idle replicas cannot skip their pass because of ``reason``; they run
    it on 0-example slices (exact) from now on, and the chief's plans price their fixed cost."""
    if model in _multi_worker_fell_back:
        return
    _multi_worker_fell_back.add(model)
    logger.info("hetero_cs: a replica with 0 examples runs its step on an empty slice (it cannot skip it: %s).", reason)
    balancer = getattr(strategy_of(model), "_balancer", None)
    if balancer is not None:
        balancer.set_idle_replicas_free(False)
