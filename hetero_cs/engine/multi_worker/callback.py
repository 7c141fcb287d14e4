"""MultiWorkerCallback: what fit/evaluate/predict need from HeteroMultiWorkerMirroredStrategy around the steps."""

from __future__ import annotations

import math
import statistics

import keras

from hetero_cs.engine.callbacks import FitStats, add_guard_logs
from hetero_cs.errors import ConfigError


class MultiWorkerCallback(keras.callbacks.Callback):
    """Connects Keras' loops to a :class:`~hetero_cs.HeteroMultiWorkerMirroredStrategy` (added for you).

    * ``on_*_begin``: sizes emulated devices for the model (the model is built by then).
    * Every epoch, on the chief: ``makespan_ms`` joins the epoch logs (the progress bar, ``History``); the other
      figures go to :attr:`HeteroMultiWorkerMirroredStrategy.stats` (a :class:`hetero_cs.engine.callbacks.FitStats`,
      one value per epoch; ``log_everything=True`` puts them in the logs too): ``replica_<i>_batch_size`` (the split
      of the plan in force, the same everywhere once agreed); while auto-balancing also ``replica_<i>_step_ms``
      (medians over the epoch's timed steps, as the workers reported them; NaN when none was timed) and, with the
      guard, ``guard_kept`` (NaN before the first decision), ``guard_in_trial`` and ``guard_reverts``, as under
      the central-storage strategy.

    Args:
        strategy: The HeteroMultiWorkerMirroredStrategy the model was built under.
        log_everything: Put every figure in the epoch logs, not only ``makespan_ms``.
    """

    IN_LOGS = ("makespan_ms",)

    def __init__(self, strategy, *, log_everything: bool = False):
        super().__init__()
        if not isinstance(log_everything, bool):
            raise ConfigError(f"log_everything must be True or False. Received: log_everything={log_everything!r}.")
        self._strategy = strategy
        self._log_everything = log_everything
        self._guard_logged = False

    def on_train_begin(self, logs=None):
        self._strategy._fit_stats = FitStats()  # noqa: SLF001 - this fit's figures (strategy.stats)
        self._strategy.prepare_emulation(self.model)

    def on_test_begin(self, logs=None):
        self._strategy.prepare_emulation(self.model)

    on_predict_begin = on_test_begin

    def on_epoch_begin(self, epoch, logs=None):
        self._strategy.pop_reported_step_times()  # the epoch's own steps only (not the last validation's)

    def on_epoch_end(self, epoch, logs=None):
        if not self._strategy.is_chief:
            return
        plan = self._strategy.plan
        split = () if plan is None else plan.per_replica_batch_sizes
        figures = {f"replica_{i}_batch_size": float(b) for i, b in enumerate(split)}
        if self._strategy.agreed:
            times = self._strategy.pop_reported_step_times()
            R = self._strategy.num_replicas_in_sync
            # Every epoch carries every key (NaN: nothing measured), so the lists stay aligned with the epochs.
            figures["makespan_ms"] = statistics.median(max(t) for t in times) * 1e3 if times else math.nan
            for i in range(R):
                figures[f"replica_{i}_step_ms"] = statistics.median(t[i] for t in times) * 1e3 if times else math.nan
            self._guard_logged = add_guard_logs(figures, self._strategy.balancer, self._guard_logged)
        if self._strategy.stats is not None:
            self._strategy.stats.record(figures)
        if logs is not None:
            logs.update(figures if self._log_everything else {k: v for k, v in figures.items() if k in self.IN_LOGS})
