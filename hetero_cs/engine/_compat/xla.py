"""Private touches for XLA per replica: Keras' train step with each replica's forward and backward pass compiled.

Part of :mod:`hetero_cs.engine._compat`, the one place of private TensorFlow/Keras touches. What applies when, and
why the weights go in as inputs: :mod:`hetero_cs.engine.replica_xla`.
"""

from __future__ import annotations

import functools
import logging

import tensorflow as tf

from hetero_cs.engine import replica_xla, training
from hetero_cs.engine._compat import symbols
from hetero_cs.engine._compat.distribute import is_hetero_strategy

logger = logging.getLogger(__name__)


def keras_train_step():
    """``train_step`` as a model class inherits it from Keras (hetero_cs's dispatch below, once installed)."""
    return symbols.require("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer").train_step


def _patch_train_step() -> None:
    # Keras' TensorFlow train_step runs the forward pass, the loss, the tape and the optimizer in one Python
    # function. Under our central-storage strategy, inside a replica step of a model compiled with XLA per replica
    # (hetero_cs.engine.replica_xla.applies), the same step runs with its forward pass, loss and gradient in one
    # tf.function(jit_compile=True) on the replica's device (_compiled_step); elsewhere Keras' own runs.
    TensorFlowTrainer = symbols.require("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer")
    original = TensorFlowTrainer.train_step

    @functools.wraps(original)
    def train_step(self, data):
        step = training.current_replica_step()
        strategy = getattr(self, "_distribute_strategy", None)
        if (step is None or step.global_batch_size is None or not is_hetero_strategy(strategy)
                or not self.trainable_weights or not replica_xla.applies(self)):
            return original(self, data)
        return _compiled_step(self, data, step)

    TensorFlowTrainer.train_step = train_step

    # Keras resolves compile(jit_compile="auto") to False under every tf.distribute strategy. Under our central-
    # storage strategy it resolves as it would for one device (Keras' own rule: a device other than the CPU is
    # present and every layer supports XLA). Private: Trainer._resolve_auto_jit_compile is that rule; it reads
    # self._distribute_strategy, which the model has, so the strategy is hidden from it for the call.
    Trainer = symbols.require("keras.src.trainers.trainer", "Trainer")
    original_resolve = Trainer._resolve_auto_jit_compile  # noqa: SLF001

    @functools.wraps(original_resolve)
    def _resolve_auto_jit_compile(self):
        strategy = getattr(self, "_distribute_strategy", None)
        if not is_hetero_strategy(strategy):
            return original_resolve(self)
        self._distribute_strategy = None  # noqa: SLF001
        try:
            return original_resolve(self)
        finally:
            self._distribute_strategy = strategy  # noqa: SLF001

    Trainer._resolve_auto_jit_compile = _resolve_auto_jit_compile  # noqa: SLF001


def _compiled_step(model, data, step):
    """Keras' ``train_step`` for one replica, its forward pass, loss and gradient compiled with XLA.

    The same operations in the same order as Keras' TensorFlow ``train_step``: the forward pass, ``_compute_loss``
    (weighted ``b_i / B`` by hetero_cs's patches), the logged loss, ``optimizer.scale_loss``, the gradient of the
    scaled loss, ``apply_gradients``, ``compute_metrics``. The first three and the gradient run in the compiled
    function; it takes every weight as an input, read here on the replica's device, because XLA cannot read a
    variable on the parameter device. State the forward pass writes (a seed generator's state, a layer's moving
    statistics) is written back after it, in replica context, as the uncompiled step writes it.
    """
    # Private: Keras' own helpers of its train_step (unpacking, the loss tracker, the logged loss's unscaling,
    # _call_has_training_arg, _compute_loss) and its StatelessScope, the scope Keras' stateless_call uses to run a
    # model on given weight values and record the state it writes instead of writing it.
    from keras.src import tree
    from keras.src.backend.common.stateless_scope import StatelessScope
    from keras.src.losses import loss as loss_module
    from keras.src.trainers.data_adapters import data_adapter_utils

    from hetero_cs.engine._compat.losses import _register

    x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
    trainable = list(model.trainable_variables)
    non_trainable = list(model.non_trainable_variables)
    optimizer = model.optimizer
    # optimizer.scale_loss multiplies by the loss scale (a variable on the parameter device) under
    # LossScaleOptimizer and returns the loss itself otherwise: the scale goes in as an input too.
    unit = tf.ones((), tf.float32)
    scale = None if optimizer is None else optimizer.scale_loss(unit)
    scale = None if scale is unit else tf.convert_to_tensor(scale)
    written: list[int] = []

    def hetero_cs_replica_forward_backward(weights, state, scale, x, y, sample_weight):
        mapping = list(zip(trainable, weights)) + list(zip(non_trainable, state))
        with StatelessScope(state_mapping=mapping, collect_losses=True) as scope:
            with tf.GradientTape() as tape:
                tape.watch(weights)
                y_pred = model(x, training=True) if model._call_has_training_arg else model(x)  # noqa: SLF001
                loss = model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,  # noqa: SLF001
                                           training=True)
                scaled = loss if scale is None else loss * tf.cast(scale, loss.dtype)
            gradients = tape.gradient(scaled, weights)
            new_state = [scope.get_current_value(variable) for variable in non_trainable]
        written[:] = [i for i, value in enumerate(new_state) if value is not None]
        return y_pred, loss, gradients, [new_state[i] for i in written]

    compiled = tf.function(hetero_cs_replica_forward_backward, jit_compile=True, autograph=False)
    # One function per replica and trace: its captures (this replica's b_i, B) are this replica's own.
    weights = [tf.convert_to_tensor(variable) for variable in trainable]
    state = [tf.convert_to_tensor(variable) for variable in non_trainable]
    y_pred, loss, gradients, new_state = compiled(weights, state, scale, x, y, sample_weight)
    _register(step, loss)  # a b_i / B share, as _compute_loss's own result is
    for i, value in zip(written, new_state):
        non_trainable[i].assign(value)
    model._loss_tracker.update_state(  # noqa: SLF001
        loss_module.unscale_loss_for_distribution(loss),
        sample_weight=tf.shape(next(i for i in tree.flatten(x) if i is not None))[0])
    model.optimizer.apply_gradients(zip(gradients, trainable))
    return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
