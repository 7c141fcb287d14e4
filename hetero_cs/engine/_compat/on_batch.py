"""Keras' ``train_on_batch``, ``test_on_batch`` and ``predict_on_batch`` under the central-storage strategy.

Part of :mod:`hetero_cs.engine._compat`, the one place of private TensorFlow/Keras touches.

Keras runs these three on the batch as plain tensors, which ``strategy.run`` hands whole to every replica: every card
computes the whole batch, ``predict_on_batch`` returns R copies of the predictions, and the loss and metrics that
``train_on_batch`` and ``test_on_batch`` return count each example R times (the weights of ``train_on_batch`` come
out right: R equal gradients, each weighed 1 / R). Under :class:`~hetero_cs.HeteroCentralStorageStrategy` each runs
as its entry point on that one batch instead - ``fit`` for one epoch of one step, ``evaluate``, ``predict``, with
``batch_size`` the batch's examples - so the batch is cut by the plan like any other and the result is exactly one
device's: Keras' ``*_on_batch`` also reset the metrics first and return the same logs, as numpy values. That costs
the entry point's own setup on every call (its callbacks; under ``auto_balance`` the first call calibrates). Under
other strategies, and under the multi-worker strategy (whose workers each read their own data), Keras' own runs.
"""

from hetero_cs.engine._compat.context import is_hetero_strategy, strategy_of
from hetero_cs.engine._compat.symbols import patch, require
from hetero_cs.engine._compat.trainer import _examples_and_batch_size
from hetero_cs.errors import InputError


def patch_on_batch() -> None:
    # Private: TensorFlowTrainer is where Keras' TensorFlow backend defines the three methods.
    TensorFlowTrainer = require("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer")

    @patch(TensorFlowTrainer, "train_on_batch")
    def train_on_batch(original, self, x, y=None, sample_weight=None, class_weight=None, return_dict=False):
        if not is_hetero_strategy(strategy_of(self)):
            return original(self, x, y, sample_weight=sample_weight, class_weight=class_weight, return_dict=return_dict)
        self.fit(x, y, sample_weight=sample_weight, class_weight=class_weight, batch_size=_examples(x), epochs=1,
                 verbose=0, shuffle=False)
        # The metrics after fit's one step (reset when its epoch began): Keras' logs of the step, without the
        # strategy's own figures that fit's epoch logs carry (makespan_ms, ...).
        return _as_returned(self, self.get_metrics_result(), return_dict)

    @patch(TensorFlowTrainer, "test_on_batch")
    def test_on_batch(original, self, x, y=None, sample_weight=None, return_dict=False):
        if not is_hetero_strategy(strategy_of(self)):
            return original(self, x, y, sample_weight=sample_weight, return_dict=return_dict)
        logs = self.evaluate(x, y, sample_weight=sample_weight, batch_size=_examples(x), verbose=0, return_dict=True)
        return _as_returned(self, logs, return_dict)

    @patch(TensorFlowTrainer, "predict_on_batch")
    def predict_on_batch(original, self, x):
        if not is_hetero_strategy(strategy_of(self)):
            return original(self, x)
        return self.predict(x, batch_size=_examples(x), verbose=0)


def _examples(x) -> int:
    """The examples in the batch ``x`` (its first leaf's leading dimension), read as fit reads arrays."""
    examples, _ = _examples_and_batch_size({"x": x})
    if examples is None:
        raise InputError(f"*_on_batch needs a batch of arrays or tensors with a leading batch dimension. Received: "
                         f"x of type {type(x).__name__}. Pass numpy arrays or tensors of shape (batch, ...).")
    return examples


def _as_returned(model, logs: dict, return_dict: bool):
    """``logs`` as Keras' ``*_on_batch`` return them: Python numbers, as a dict or in the metrics' order."""
    # Private: Keras' own conversion of the logs and their order (loss first, then the compiled metrics), as its
    # *_on_batch return them.
    from keras.src.utils.python_utils import pythonify_logs

    logs = pythonify_logs(logs)
    return logs if return_dict else model._flatten_metrics_in_order(logs)  # noqa: SLF001
