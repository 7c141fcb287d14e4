"""The host's optimizer update compiled as one XLA function on the parameter device (``fused_update``).

Under central storage the optimizer's update runs once per step on the parameter device (host memory, by default),
after the slowest replica's gradients arrive and before the next step can start: it is on every step's critical
path. Keras' optimizers write the update as a few element-wise ops per variable (Adam: about a dozen, each a full
pass over the variable, its slots and its gradient), which TensorFlow runs one kernel at a time. Compiled with XLA
(``tf.function(jit_compile=True)``), the update of every variable becomes a few fused loops instead.

Measured on the 2-core CPU host of ``benchmarks/balance.py`` (MLP 784-256-256-10, 269,322 parameters, Adam): the
update alone took 2.8-3.1 ms plain and 1.6-1.7 ms compiled (median of 50 calls each); auto_balance's host work
outside the replicas per step fell from 6.4-6.6 ms to 3.9-4.7 ms, and the benchmark's efficiency from 0.959-0.966
to 0.973-0.989 (two quiet ``--all-mixes`` runs; benchmarks/README.md).

What does not change: the update's arithmetic is Keras' own (``optimizer.update_step`` and decoupled weight decay),
run in the same order, on the same variables, behind the same barrier; XLA may round a fused expression
differently in the last bit, which the oracle tests (one device, no XLA) bound at 1e-5. What it costs: compiling
the update once per trace of the training function (about 0.3 s for that MLP's Adam on that host).

When it applies (:func:`applies`): never while executing eagerly (each eager step would compile anew); with
``fused_update=None`` (the default) only for Keras' own optimizer classes (their updates are written for XLA: Keras
compiles them itself on GPUs) and dense gradients; with ``True`` for any optimizer and gradient, so a custom
optimizer whose update uses an op XLA cannot compile fails at its first step, and ``fused_update=False`` is the fix.
"""

import logging
from collections.abc import Callable, Sequence

import tensorflow as tf

logger = logging.getLogger(__name__)

#: Where the classes of Keras' own optimizers (Adam, AdamW, SGD, ...) live; a user's subclass lives elsewhere.
_KERAS_OPTIMIZER_MODULES = ("keras.src.optimizers.", "keras.optimizers.")


def applies(setting: bool | None, optimizer, gradients: Sequence) -> bool:
    """Whether this trace compiles the host update of ``optimizer`` with XLA.

    Args:
        setting: The strategy's ``fused_update``: None (Keras' own optimizers with dense gradients), True, False.
        optimizer: The optimizer whose update this is (the inner one under loss scaling).
        gradients: The summed gradients about to be applied (None for a variable without one).
    """
    if setting is False or tf.executing_eagerly():
        return False
    keras_own = type(optimizer).__module__.startswith(_KERAS_OPTIMIZER_MODULES)
    return setting is True or (keras_own and not any(isinstance(g, tf.IndexedSlices) for g in gradients))


def compiled(update: Callable[[list], object], device: str) -> Callable[[list], tf.Tensor]:
    """``update(grads_and_vars)`` as one XLA-compiled function placed on ``device``.

    Args:
        update: Runs the whole host update for a list of (summed gradient, variable) pairs, in cross-replica
            context (the strategy's merge); its return value is ignored.
        device: The parameter device, where every variable and summed gradient lives.

    Returns:
        ``run(grads_and_vars)``, which traces ``update`` into a ``tf.function(jit_compile=True)`` (gradients and
        variables are captured, so nothing is copied) and calls it; it returns a bool scalar that exists once the
        update has run.
    """

    def run(grads_and_vars: list) -> tf.Tensor:
        def hetero_cs_fused_update():  # the name TensorFlow's errors quote (step_errors.xla_compile_error)
            update(grads_and_vars)
            return tf.constant(True)

        logger.debug("hetero_cs: the optimizer update of %d variables on %s is compiled with XLA (fused_update).",
                     len(grads_and_vars), device)
        with tf.device(device):
            return tf.function(hetero_cs_fused_update, jit_compile=True, autograph=False)()

    return run
