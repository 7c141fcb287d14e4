"""MultiWorkerCallback: what fit/evaluate/predict need from HeteroMultiWorkerMirroredStrategy around the steps."""

from __future__ import annotations

import keras


class MultiWorkerCallback(keras.callbacks.Callback):
    """Connects Keras' loops to a :class:`~hetero_cs.HeteroMultiWorkerMirroredStrategy` (added for you).

    * ``on_*_begin``: sizes emulated devices for the model (the model is built by then).
    * Every epoch: ``replica_<i>_batch_size`` (the split of the plan in force on the chief, the same everywhere
      once agreed) joins the epoch logs while auto-balancing, with ``calibrating`` (1.0 during the probe steps).

    Args:
        strategy: The HeteroMultiWorkerMirroredStrategy the model was built under.
    """

    def __init__(self, strategy):
        super().__init__()
        self._strategy = strategy

    def on_train_begin(self, logs=None):
        self._strategy.prepare_emulation(self.model)

    def on_test_begin(self, logs=None):
        self._strategy.prepare_emulation(self.model)

    def on_predict_begin(self, logs=None):
        self._strategy.prepare_emulation(self.model)

    def on_epoch_end(self, epoch, logs=None):
        if logs is None or not self._strategy.is_chief:
            return
        plan = self._strategy.plan
        if plan is not None:
            for i, b in enumerate(plan.per_replica_batch_sizes):
                logs[f"replica_{i}_batch_size"] = float(b)
