"""MultiWorkerCallback: what fit/evaluate/predict need from HeteroMultiWorkerMirroredStrategy around the steps."""

import math
import statistics

from hetero_cs.engine.callbacks import FiguresCallback


class MultiWorkerCallback(FiguresCallback):
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

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self._strategy.prepare_emulation(self.model)

    def on_test_begin(self, logs=None):
        self._strategy.prepare_emulation(self.model)

    on_predict_begin = on_test_begin

    def on_epoch_begin(self, epoch, logs=None):
        self._strategy.pop_reported_step_times()  # the epoch's own steps only (not the last validation's)

    def on_epoch_end(self, epoch, logs=None):
        if not self._strategy.is_chief:
            return
        split = getattr(self._strategy.plan, "per_replica_batch_sizes", ())  # () before a plan
        figures = {f"replica_{i}_batch_size": float(b) for i, b in enumerate(split)}
        if self._strategy.agreed:
            times = self._strategy.pop_reported_step_times()
            # Every epoch carries every key (NaN: nothing measured), so the lists stay aligned with the epochs.
            figures["makespan_ms"] = statistics.median(max(t) for t in times) * 1e3 if times else math.nan
            for i in range(self._strategy.num_replicas_in_sync):
                figures[f"replica_{i}_step_ms"] = statistics.median(t[i] for t in times) * 1e3 if times else math.nan
            self._add_guard_figures(figures)
        self._publish(figures, logs)
