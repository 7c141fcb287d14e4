"""BalanceCallback: calibration at the start of fit, and per-replica timing in the fit logs."""

import logging
import math
import os
import statistics

import keras
import tensorflow as tf

from hetero_cs.engine import arguments, calibrating

logger = logging.getLogger(__name__)


class FiguresCallback(keras.callbacks.Callback):
    """What both strategies' callbacks share: each epoch's figures go to ``strategy.stats`` (a :class:`FitStats`),
    and those named in ``IN_LOGS`` (all of them with ``log_everything=True``) to the epoch logs.

    Args:
        strategy: The hetero_cs strategy the model was built under.
        log_everything: Put every figure in the epoch logs, not only those of ``IN_LOGS``.
    """

    IN_LOGS: tuple[str, ...] = ()

    def __init__(self, strategy, *, log_everything: bool = False):
        super().__init__()
        arguments.validate_flags(log_everything=log_everything)
        self._strategy = strategy
        self._log_everything = log_everything
        self._guard_logged = False

    def on_train_begin(self, logs=None):
        self._strategy._fit_stats = FitStats()  # noqa: SLF001 - this fit's figures (strategy.stats)

    def _publish(self, figures: dict, logs) -> dict:
        """Records the epoch's ``figures`` and puts those due in ``logs``; returns the figures left out of them."""
        self._strategy._fit_stats.record(figures)  # noqa: SLF001 - set by on_train_begin
        shown = figures if self._log_everything else {k: v for k, v in figures.items() if k in self.IN_LOGS}
        if logs is not None:
            logs.update(shown)
        return {k: v for k, v in figures.items() if k not in shown}

    def _add_guard_figures(self, figures: dict) -> None:
        """Adds ``guard_kept`` (NaN before the first decision), ``guard_in_trial`` and ``guard_reverts`` while the
        guard is on, and NaN for all three in later epochs once it is off (a ``batch_split`` set in training), so
        History's lists stay aligned with the epochs."""
        balancer = self._strategy.balancer
        if balancer.guard_enabled:
            decision = balancer.last_guard_decision
            figures["guard_kept"] = math.nan if decision is None else (1.0 if decision.kept else 0.0)
            figures["guard_in_trial"] = 1.0 if balancer.guard.in_trial else 0.0
            figures["guard_reverts"] = float(balancer.guard.num_reverts)
            self._guard_logged = True
        elif self._guard_logged:
            figures["guard_kept"] = figures["guard_in_trial"] = figures["guard_reverts"] = math.nan


class BalanceCallback(FiguresCallback):
    """Connects ``model.fit`` to a HeteroCentralStorageStrategy.

    ``model.fit`` adds it by itself under the strategy; add it yourself only to control its position in the list.

    * ``on_train_begin``: sizes emulated devices for the model and, with ``auto_balance``, calibrates on the first
      global batch (or loads the cached profile) and solves the plan. After the first epoch it logs the plan's
      predicted makespan beside the measured one.
    * Every batch: ``straggler_wait_ms`` (mean idle time of the replicas waiting for the slowest one in the last
      completed step, milliseconds) joins the logs while per-replica timing is on.
    * Every epoch, two figures join the epoch logs (so the progress bar looks like Keras' with two more entries, and
      they reach ``History``): ``makespan_ms`` and ``straggler_wait_ms`` (epoch medians). The others go to
      :attr:`HeteroCentralStorageStrategy.stats` (a :class:`FitStats`, one value per epoch) and, when ``fit`` has a
      ``keras.callbacks.TensorBoard``, to TensorBoard scalars (``epoch_<name>`` in ``<log_dir>/hetero_cs``):
      ``replica_<i>_step_ms`` (median step time of replica i), ``replica_<i>_batch_size`` (its slice in the plan in
      force); with auto_balance the guard's state: ``guard_kept`` (1.0 when its last decision kept the tried plan,
      0.0 when it reverted; NaN before the first decision), ``guard_in_trial`` (1.0 while a plan is being tried)
      and ``guard_reverts`` (how many tried plans were reverted so far; decisions are also logged at INFO by
      ``hetero_cs.planning.guard``); with out-of-memory recovery on, ``oom_recoveries`` (retries after an
      out-of-memory step so far) and ``replica_<i>_memory_cap`` (the cap in force in examples, NaN: none; each
      change is also logged by ``hetero_cs.engine.central_storage``); where a card may fail (GPUs, or an emulated
      ``Drift(fails=True)``) with ``on_device_error="exclude"``, ``device_error_retries`` (steps retried after a
      device error so far) and ``excluded_replicas`` (cards set aside). ``log_everything=True`` puts them all in the
      epoch logs too (the progress bar, ``History``), as before.

    Args:
        strategy: The HeteroCentralStorageStrategy the model was built under.
        log_everything: Put every figure in the epoch logs, not only ``makespan_ms`` and ``straggler_wait_ms``.
        tensorboard_dirs: Log directories of ``fit``'s TensorBoard callbacks (``fit`` passes them); the figures
            that are not in the logs are written under ``<dir>/hetero_cs``.
    """

    IN_LOGS = ("makespan_ms", "straggler_wait_ms")
    """The figures the epoch logs (and so the progress bar) carry by default."""

    def __init__(self, strategy, *, log_everything: bool = False, tensorboard_dirs=()):
        super().__init__(strategy, log_everything=log_everything)
        self._tensorboard_dirs = tuple(str(d) for d in tensorboard_dirs)
        self._writers: dict = {}
        self._samples = []
        self._last_step_seen = -1
        self._held_logs = HeldLogs()

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        strategy = self._strategy
        calibrating.check_policy_support(strategy, self.model)  # mixed_bfloat16 on a GPU without bf16: refused
        data = strategy._source_dataset  # noqa: SLF001 - the dataset fit is about to iterate
        # A fixed or even split without emulation needs nothing before the first batch: no batch is read then.
        needed = strategy.balancer.auto_balance or strategy._emulation_pending()  # noqa: SLF001
        if data is not None and needed:
            # fit(verbose=0) keeps calibration quiet too; its progress bars otherwise show while fit starts.
            strategy.calibrate(self.model, data, progress=self.params.get("verbose", 1) != 0)
        strategy._log_plan_if_new()  # noqa: SLF001

    def on_epoch_begin(self, epoch, logs=None):
        self._samples = []
        self._held_logs.release()  # the last epoch's progress bar has ended its line
        if self.params.get("verbose") in (1, "auto"):  # Keras redraws one line per epoch with a progress bar
            self._held_logs.hold()

    def on_train_end(self, logs=None):
        self.release_held_logs()
        guard = self._strategy.balancer.guard
        if guard.candidate is not None:  # else the trial's last line ("guard: trying ...") reads as if it still decides
            logger.info("hetero_cs guard: the trial of %s had measured %d of its pairs when fit ended; it goes on in "
                        "the next fit on this strategy (until then the plan in force is %s).",
                        list(guard.candidate.per_replica_batch_sizes), guard.num_pairs,
                        list(self._strategy.plan.per_replica_batch_sizes))

    def release_held_logs(self) -> None:
        """Passes on the log records held while the progress bar drew its line (``fit`` calls it when it raises)."""
        self._held_logs.release()

    def on_train_batch_end(self, batch, logs=None):
        if batch == 0:
            self._strategy._log_plan_if_new()  # noqa: SLF001 - a plan first solved for the first batch
        sample = self._strategy.monitor.last_step()
        if sample is None or sample.step == self._last_step_seen:
            return
        self._last_step_seen = sample.step
        self._samples.append(sample)
        if logs is not None:
            logs["straggler_wait_ms"] = sample.straggler_wait_s * 1e3

    def on_epoch_end(self, epoch, logs=None):
        plan = self._strategy.plan
        if epoch == 0 and self._samples and plan is not None and plan.predicted_makespan_s:
            # Steps cut by this plan only (during a guard trial the candidate's steps are not this plan's).
            full = [s for s in self._samples if s.per_replica_batch_sizes == tuple(plan.per_replica_batch_sizes)]
            if full:
                logger.info(
                    "hetero_cs: plan %s predicted a makespan of %.1f ms for the replicas; measured %.1f ms, and "
                    "%.1f ms with the host's gradient sum and update (%s).", list(plan.per_replica_batch_sizes),
                    plan.predicted_makespan_s * 1e3, statistics.median(s.replica_makespan_s for s in full) * 1e3,
                    statistics.median(s.makespan_s for s in full) * 1e3,
                    "one timed step" if len(full) == 1 else f"median of {len(full)} timed steps")
        left = self._publish(self._figures(plan), logs)  # the figures not in the logs go to TensorBoard
        for directory in self._tensorboard_dirs if left else ():
            if directory not in self._writers:
                self._writers[directory] = tf.summary.create_file_writer(os.path.join(directory, "hetero_cs"))
            with (writer := self._writers[directory]).as_default():
                for key, value in left.items():
                    tf.summary.scalar(f"epoch_{key}", value, step=epoch)
            writer.flush()

    def _figures(self, plan) -> dict:
        """Every figure of the epoch (see the class docstring), keys in a stable order."""
        R, balancer, samples = self._strategy.num_replicas_in_sync, self._strategy.balancer, self._samples
        sizes = plan.per_replica_batch_sizes if plan is not None else ()
        figures = {f"replica_{i}_batch_size": float(b) for i, b in enumerate(sizes)}
        recovery = self._strategy._step_recovery  # noqa: SLF001
        if recovery is not None and recovery.failover.possible():
            figures["device_error_retries"] = float(recovery.failover.retries)
            figures["excluded_replicas"] = float(len(recovery.failover.exclusions))
        if recovery is not None and recovery.memory_recovery:
            figures["oom_recoveries"] = float(recovery.recoveries)
            figures.update({f"replica_{i}_memory_cap": math.nan if cap is None else float(cap)
                            for i, cap in enumerate(balancer.max_batch_sizes or [None] * R)})
        self._add_guard_figures(figures)
        if not (samples or self._strategy._timing_enabled):  # noqa: SLF001 - timed: NaN keeps History aligned
            return figures

        def median_ms(seconds) -> float:  # NaN when no step was timed this epoch
            return statistics.median(seconds(s) for s in samples) * 1e3 if samples else math.nan

        figures["makespan_ms"] = median_ms(lambda s: s.makespan_s)
        figures["straggler_wait_ms"] = median_ms(lambda s: s.straggler_wait_s)
        for i in range(R):
            figures[f"replica_{i}_step_ms"] = median_ms(lambda s, i=i: s.per_replica_step_times_s[i])
        return figures


class HeldLogs(logging.Filter):
    """Holds hetero_cs' and calibration's log records while Keras' progress bar draws an epoch's line.

    The bar redraws its line in place (a carriage return per update): a record printed meanwhile would land in the
    middle of it. While held (from an epoch's start), each record of a ``hetero_cs.*`` or ``calibration.*`` logger
    is kept, and :meth:`release` passes them on, in order and with their own time stamps, once the bar has ended its
    line (the next epoch's start, the end of ``fit``, or ``fit`` raising).
    """

    ROOTS = ("hetero_cs", "calibration")

    def __init__(self):
        super().__init__()
        self._records: list[logging.LogRecord] = []
        self._loggers: list[logging.Logger] = []

    def hold(self) -> None:
        # A logger's filters see the records logged on it (not its children's): every logger of ours gets this one.
        self._loggers = [logging.getLogger(name) for name in list(logging.Logger.manager.loggerDict)
                         if name.split(".")[0] in self.ROOTS]
        for each in self._loggers:
            each.addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        self._records.append(record)
        return False

    def release(self) -> None:
        for each in self._loggers:
            each.removeFilter(self)
        self._loggers = []
        records, self._records = self._records, []
        for record in records:
            logging.getLogger(record.name).handle(record)


def with_balance_callback(strategy, callbacks) -> list:
    """``fit``'s callbacks with a :class:`BalanceCallback` first (unless the user added one), told where fit's
    TensorBoard callbacks write."""
    callbacks = list(callbacks or [])
    if not any(isinstance(c, BalanceCallback) for c in callbacks):
        boards = [c.log_dir for c in callbacks if isinstance(c, keras.callbacks.TensorBoard)]
        callbacks.insert(0, BalanceCallback(strategy, tensorboard_dirs=boards))
    return callbacks


class FitStats:
    """hetero_cs's per-epoch figures of the last ``fit`` (:attr:`HeteroCentralStorageStrategy.stats`).

    ``history`` maps each figure's name (see :class:`BalanceCallback`) to one float per epoch, like Keras'
    ``History.history``; a figure missing in an epoch is NaN there, so every list has one value per epoch.

    Examples:
        >>> stats = FitStats()
        >>> stats.record({"makespan_ms": 30.0}); stats.record({"makespan_ms": 29.0, "oom_recoveries": 1.0})
        >>> stats.history["oom_recoveries"], stats.latest()["makespan_ms"]
        ([nan, 1.0], 29.0)
    """

    def __init__(self):
        self.history: dict[str, list[float]] = {}
        self.epochs = 0

    def record(self, figures: dict) -> None:
        """Appends one epoch's figures (NaN for a known figure missing from them)."""
        for key in figures:
            self.history.setdefault(key, [math.nan] * self.epochs)
        for key, values in self.history.items():
            values.append(float(figures.get(key, math.nan)))
        self.epochs += 1

    def latest(self) -> dict[str, float]:
        """The last epoch's figures (empty before the first epoch ends)."""
        return {key: values[-1] for key, values in self.history.items() if values}

