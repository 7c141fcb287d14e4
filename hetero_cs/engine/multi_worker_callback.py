"""MultiWorkerCallback: what fit/evaluate/predict need from HeteroMultiWorkerMirroredStrategy around the steps."""

from __future__ import annotations

import math
import statistics

import keras

from hetero_cs.engine.callbacks import add_guard_logs


class MultiWorkerCallback(keras.callbacks.Callback):
    """Connects Keras' loops to a :class:`~hetero_cs.HeteroMultiWorkerMirroredStrategy` (added for you).

    * ``on_*_begin``: sizes emulated devices for the model (the model is built by then).
    * Every epoch, on the chief: ``replica_<i>_batch_size`` (the split of the plan in force, the same everywhere
      once agreed) joins the epoch logs; while auto-balancing also ``makespan_ms`` and ``replica_<i>_step_ms``
      (medians over the epoch's timed steps, as the workers reported them; NaN when none was timed) and, with the
      guard, ``guard_kept`` (NaN before the first decision), ``guard_in_trial`` and ``guard_reverts``, as under
      the central-storage strategy.

    Args:
        strategy: The HeteroMultiWorkerMirroredStrategy the model was built under.
    """

    def __init__(self, strategy):
        super().__init__()
        self._strategy = strategy
        self._guard_logged = False

    def on_train_begin(self, logs=None):
        self._strategy.prepare_emulation(self.model)

    def on_test_begin(self, logs=None):
        self._strategy.prepare_emulation(self.model)

    def on_predict_begin(self, logs=None):
        self._strategy.prepare_emulation(self.model)

    def on_epoch_begin(self, epoch, logs=None):
        self._strategy.pop_reported_step_times()  # the epoch's own steps only (not the last validation's)

    def on_epoch_end(self, epoch, logs=None):
        if logs is None or not self._strategy.is_chief:
            return
        plan = self._strategy.plan
        if plan is not None:
            for i, b in enumerate(plan.per_replica_batch_sizes):
                logs[f"replica_{i}_batch_size"] = float(b)
        if not self._strategy.agreed:
            return
        times = self._strategy.pop_reported_step_times()
        R = self._strategy.num_replicas_in_sync
        # Every epoch carries every key (NaN: nothing measured), so History's lists stay aligned with the epochs.
        logs["makespan_ms"] = statistics.median(max(t) for t in times) * 1e3 if times else math.nan
        for i in range(R):
            logs[f"replica_{i}_step_ms"] = statistics.median(t[i] for t in times) * 1e3 if times else math.nan
        self._guard_logged = add_guard_logs(logs, self._strategy.balancer, self._guard_logged)
