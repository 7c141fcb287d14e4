"""Backups of a supervised ``model.fit``, and the exact resume after a restart (``hetero-cs run``).

Under :mod:`hetero_cs.supervisor` (``HETERO_CS_BACKUP_DIR`` is set), ``fit`` under a hetero_cs strategy gets a
:class:`SupervisedBackup` callback (unless the user passes Keras' own ``BackupAndRestore``, which then does the
job, with Keras' rule: a mid-epoch restore replays its epoch from the first batch). It writes, in the library's own
directory (:mod:`hetero_cs.engine.faults.supervised_run`: every file listed in its manifest first),

* the model's variables, the optimizer's (its iteration count, moments, a loss scale) and the metrics';
* the epoch, the batches of that epoch already applied, the optimizer step, and what identifies the run: the
  model's architecture (:func:`calibration.probe.model_fingerprint`), the global batch size, the data's length;

after the first two steps (to measure what a backup costs), then every ``interval_steps`` applied steps, the
number of steps whose time is 200 times a backup's (so backups cost about 0.5 % of training time), at most
:data:`MAX_INTERVAL_STEPS`; and once more when ``fit`` ends (marked complete). A lost card costs at most
``interval_steps`` steps: the number is logged (INFO) and kept in ``strategy.backup.interval_steps``. Each backup is
written atomically: the arrays to the slot (``.a.npz``, ``.b.npz``) the record does not name, then the JSON record
naming them replaces the old record (``os.replace``). Only batches this process applied are backed up.

When the restarted script calls ``fit`` again (the k-th ``fit`` of the process finds ``fit_<k>.json``), the
callback checks that the backup is this run's (else a ConfigError naming the difference and the directory), puts
every variable back, starts at the backup's epoch (Keras' ``initial_epoch``), puts the metrics of that epoch back
after Keras resets them, and has the first batches of that epoch, the ones already applied, read and skipped rather
than trained on: the run goes on at the exact step of the backup and applies no batch twice. A ``fit`` whose backup
is complete is skipped whole (its final variables are restored), so a script of several ``fit`` calls resumes
inside the one that was running. This needs the data in the same order: ``fit(shuffle=True)`` on arrays shuffles
each epoch anew, so a resume inside an epoch is refused (ConfigError, with the fix).

A backup that cannot be written (a read-only or full disk, a directory removed) is a warning: training goes on
without backups.
"""

import itertools
import json
import logging
import math
import pathlib
import threading
import time
import warnings
import zipfile

import keras
import numpy as np

from hetero_cs.engine import _compat
from hetero_cs.engine.faults.supervised_run import BACKUP_DIR_ENV_VAR, backup_dir, register, write_atomically
from hetero_cs.errors import ConfigError

logger = logging.getLogger("hetero_cs.engine.central_storage")  # the messages users filter on

BACKUP_COST_SHARE = 0.005
"""Share of training time spent writing backups after the first (half the 1 % budget, which the first shares)."""

MAX_INTERVAL_STEPS = 1000
"""Most steps between two backups, whatever a backup costs: the most a lost card costs."""

_FIT_ORDINALS = itertools.count()  # the k-th supervised fit of this process: its backup is fit_<k>
_ORDINAL_LOCK = threading.Lock()


def with_backup(strategy, callbacks: list, arguments: dict | None = None) -> list:
    """``fit``'s callbacks with a :class:`SupervisedBackup` last when ``hetero-cs run`` supervises this process,
    unless the user passed Keras' ``BackupAndRestore`` (it then backs up and restores, by Keras' rule).
    ``arguments``: fit's arguments by name (the run's batch size, data and shuffle are read from them)."""
    directory = backup_dir()
    if directory is None:
        return callbacks
    if any(isinstance(c, (keras.callbacks.BackupAndRestore, SupervisedBackup)) for c in callbacks):
        logger.info("hetero_cs: fit has its own BackupAndRestore; hetero-cs run's backups are left to it.")
        return callbacks
    strategy._backup = SupervisedBackup(strategy, directory, run=describe_run(arguments or {}))  # noqa: SLF001
    return [*callbacks, strategy._backup]  # noqa: SLF001


def describe_run(arguments: dict) -> dict:
    """What identifies a fit's data from its arguments: ``global_batch_size`` (None when not known before the first
    batch), ``examples`` (arrays' length, else None) and ``shuffled_arrays`` (arrays shuffled each epoch)."""
    import tensorflow as tf

    x = arguments.get("x")
    leaves = tf.nest.flatten(x) if x is not None else []
    if leaves and all(isinstance(leaf, (np.ndarray, tf.Tensor)) and len(getattr(leaf, "shape", ())) for leaf in leaves):
        return {"global_batch_size": int(arguments.get("batch_size") or 32), "examples": int(leaves[0].shape[0]),
                "shuffled_arrays": bool(arguments.get("shuffle", True))}
    dims = ({spec.shape[0] if spec.shape.rank else None for spec in tf.nest.flatten(x.element_spec)}
            if isinstance(x, tf.data.Dataset) else set())
    return {"global_batch_size": dims.pop() if len(dims) == 1 else None, "examples": None, "shuffled_arrays": False}


def _variable_groups(model) -> dict[str, list]:
    optimizer = getattr(model, "optimizer", None)
    return {"model": list(model.weights), "optimizer": list(optimizer.variables) if optimizer is not None else [],
            "metrics": list(model.metrics_variables)}


class SupervisedBackup(keras.callbacks.Callback):
    """Backs a supervised ``fit`` up, and resumes it exactly from its last backup (see the module docstring).

    Args:
        strategy: The hetero_cs strategy ``fit`` runs under (its emulator's step counters follow a resume).
        directory: Where the backups live (created if missing).
        run: :func:`describe_run` of this fit.
    """

    def __init__(self, strategy, directory: pathlib.Path, run: dict | None = None) -> None:
        super().__init__()
        self._strategy = strategy
        self._dir = pathlib.Path(directory)
        self._run = dict(run or {})
        with _ORDINAL_LOCK:
            self._ordinal = next(_FIT_ORDINALS)
        self._record_path = self._dir / f"fit_{self._ordinal}.json"
        self._slots = [f"fit_{self._ordinal}.a.npz", f"fit_{self._ordinal}.b.npz"]  # the arrays' two files
        self._epoch, self._batches = 0, 0  # the current epoch, and its batches applied
        self._resume_metrics: list | None = None  # metric values to put back when the resumed epoch begins
        # The resumed epoch (None: not resumed), and its batches applied before the restart (skipped now).
        self._resume_epoch, self._resume_batches = None, 0
        self._history: list[dict] = []  # each finished epoch's logs (fit's History), kept in every backup
        self._slot: str | None = None  # the arrays the record names now
        self._last_end = time.perf_counter()  # when the last backup (or fit's start) ended
        self._costs_s: list[float] = []  # what the first two backups took
        self._steps_since = 0
        self._failed: str | None = None  # why backups stopped (a storage failure), or None
        self.interval_steps: int | None = None
        self.backups = 0
        self.backup_time_s = 0.0
        self.last_backup_s: float | None = None
        self.resumed_from: dict | None = None  # the record resumed from, or None

    # ------------------------------------------------------------------------------------------------------------
    def on_train_begin(self, logs=None):
        from calibration.probe import model_fingerprint

        try:
            fingerprint = model_fingerprint(self.model)
        except ConfigError:  # not built: no variables
            fingerprint = None
        self._run.update(model=fingerprint, steps=(self.params or {}).get("steps"))
        try:
            register(self._dir, [self._record_path.name, *self._slots])
        except OSError as exc:
            self._stop_backups(exc)
        if not self._record_path.exists():
            if self._run.get("shuffled_arrays"):
                logger.warning("hetero_cs: fit(shuffle=True) on arrays under hetero-cs run: each epoch is shuffled "
                               "anew, so a restart inside an epoch cannot resume it and will be refused. Pass "
                               "shuffle=False (or a tf.data.Dataset in a fixed order) to resume at the exact step.")
            return
        record, arrays = self._read()
        self._check_same_run(record)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None and not optimizer.built and record["counts"]["optimizer"]:
            optimizer.build(self.model.trainable_variables)  # its variables exist before they are restored
        groups = _variable_groups(self.model)
        for name, variables in groups.items():
            if len(variables) != record["counts"][name] or any(
                    f"{name}_{i}" not in arrays or tuple(v.shape) != arrays[f"{name}_{i}"].shape
                    for i, v in enumerate(variables)):
                raise ConfigError(
                    f"The backup {self._record_path} does not match this model: it holds {record['counts'][name]} "
                    f"{name} variables, the model has {len(variables)} (or their shapes differ). The script "
                    f"changed since it was backed up; remove {self._dir} to start over.")
        for name in ("model", "optimizer"):
            for i, variable in enumerate(groups[name]):
                variable.assign(arrays[f"{name}_{i}"])
        self._resume_metrics = [arrays[f"metrics_{i}"] for i in range(record["counts"]["metrics"])]
        self._epoch, self._batches = record["epoch"], record["batches"]
        self._history = record["history"]
        self._resume_epoch, self._resume_batches = self._epoch, self._batches
        self._slot = record["arrays"]
        self.resumed_from = record
        _compat.set_initial_epoch(self.model, record["epochs"] if record["complete"] else self._epoch)
        if self._strategy.emulator is not None:  # drift schedules go on from the step resumed at
            self._strategy.emulator.advance_to(record["step"])
        if record["complete"]:
            logger.warning("hetero_cs: this fit had finished before the restart (%s): it is skipped, with its final "
                           "variables restored (optimizer step %d).", self._record_path, record["step"])
            return
        self._strategy._resume_skip = self._batches  # noqa: SLF001 - read by fit's train function
        logger.warning(
            "hetero_cs: resuming fit from its backup (%s): epoch %d, %d batch(es) of it already applied and skipped "
            "now, optimizer step %d.", self._record_path, self._epoch + 1, self._batches, record["step"])

    def _check_same_run(self, record: dict) -> None:
        """A ConfigError naming what differs when the backup was made by another run (another model, global batch
        size or data), or when its epoch cannot be resumed in the same order."""
        before, now = record.get("run", {}), self._run
        differences = []
        if before.get("model") and now.get("model") and before["model"] != now["model"]:
            differences.append("the model's architecture differs (its layers, their settings or their shapes)")
        for key, what in (("global_batch_size", "global batch size"), ("examples", "examples in the data"),
                          ("steps", "batches per epoch")):
            if before.get(key) is not None and now.get(key) is not None and before[key] != now[key]:
                differences.append(f"{what} {now[key]} now, {before[key]} when backed up")
        if differences:
            raise ConfigError(
                f"The backup in {self._dir} was made by another run: {'; '.join(differences)}. A backup is resumed "
                f"only by the run that made it. Remove {self._dir} to start over, or run the script as it was.")
        if not record["complete"] and record["batches"] and now.get("shuffled_arrays"):
            raise ConfigError(f"The backup in {self._dir} stopped after {record['batches']} batch(es) of epoch "
                              f"{record['epoch'] + 1}, but fit(shuffle=True) on arrays shuffles that epoch anew: the "
                              f"batches skipped now would not be the ones applied. Pass shuffle=False to fit (or a "
                              f"tf.data.Dataset in a fixed order, e.g. shuffled once with a seed and "
                              f"reshuffle_each_iteration=False), then remove {self._dir} to start over.")

    def _read(self) -> tuple[dict, dict]:
        """The record and every array of the backup, checked; a ConfigError when either cannot be read."""
        try:
            record = json.loads(self._record_path.read_text())
            fields = [(key, record.get(key), kind) for key, kind in (
                ("epoch", int), ("batches", int), ("epochs", int), ("step", int), ("complete", bool), ("arrays", str),
                ("counts", dict), ("history", list))]
            counts = record["counts"] if isinstance(record.get("counts"), dict) else {}
            fields += [(f"counts[{name!r}]", counts.get(name), int) for name in ("model", "optimizer", "metrics")]
            for label, value, kind in fields:  # in order: a counts that is no dict is named before its entries
                if not isinstance(value, kind) or (kind is int and (isinstance(value, bool) or value < 0)):
                    wanted = "an int >= 0" if kind is int else f"a {kind.__name__}"
                    raise ValueError(f"{label}={value!r} is not {wanted}")
            if record["arrays"] not in self._slots:
                raise ValueError(f"arrays={record['arrays']!r} is not one of this fit's files {self._slots}")
            with np.load(self._dir / record["arrays"]) as stored:
                arrays = {key: stored[key] for key in stored.files}  # reads (and CRC-checks) every array now
        except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile) as exc:
            raise ConfigError(f"The backup {self._record_path} cannot be read ({type(exc).__name__}: {exc}). Backups "
                              f"are written atomically, so something else changed or truncated it; remove {self._dir} "
                              f"to start over (training then starts from its first step).") from exc
        return record, arrays

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        if epoch == self._resume_epoch and self._resume_metrics is not None:
            for variable, value in zip(self.model.metrics_variables, self._resume_metrics):
                variable.assign(value)  # Keras reset them as the epoch began
        else:
            self._batches = 0
        self._resume_metrics = None

    def on_train_batch_end(self, batch, logs=None):
        if self._epoch == self._resume_epoch and batch < self._resume_batches:
            return  # a batch applied before the restart, read and skipped now: nothing changed
        self._batches = int(batch) + 1
        self._steps_since += 1
        step_s = time.perf_counter() - self._last_end
        if self.interval_steps is None and self.backups == 1:
            self._save(complete=False)  # the second: a backup's cost without the first one's warm-up
            self._choose_interval(step_s)
        elif self.interval_steps is None or self._steps_since >= self.interval_steps:
            self._save(complete=False)  # the first after step 1 (traced, not timed), then every interval_steps

    def _choose_interval(self, step_s: float) -> None:
        """Fixes the steps between backups from the cheaper of the first two backups and the second step's time."""
        cost_s = min(self._costs_s)
        self.interval_steps = max(1, min(MAX_INTERVAL_STEPS, math.ceil(cost_s / max(BACKUP_COST_SHARE * step_s, 1e-9))))
        logger.info("hetero_cs: fit backs up every %d step(s) (a backup takes %.1f ms, a step %.1f ms): a lost card "
                    "costs at most %d step(s).", self.interval_steps, 1e3 * cost_s, 1e3 * step_s, self.interval_steps)

    def on_epoch_end(self, epoch, logs=None):
        self._epoch, self._batches = epoch + 1, 0
        self._history.append({k: float(v) for k, v in (logs or {}).items() if np.ndim(v) == 0})

    def on_train_end(self, logs=None):
        _compat.set_initial_epoch(self.model, None)
        self._strategy._resume_skip = 0  # noqa: SLF001
        self._save(complete=True)  # fit returned (an error in a step ends it without this call)
        # The epochs finished before the restart go in front of fit's History (``model.history``), so the History a
        # resumed fit returns holds every epoch, as an uninterrupted fit's does.
        record = self.resumed_from
        before = record["history"][:None if record["complete"] else self._resume_epoch] if record is not None else []
        if not before:
            return
        history = getattr(self.model, "history", None)
        if self.resumed_from["complete"] or not isinstance(history, keras.callbacks.History):
            # No epoch ran, so Keras' History never set model.history (fit returns it): a History of its own.
            history = keras.callbacks.History()
            history.set_model(self.model)
            history.on_train_begin()
            self.model.history = history
        keys = {key for epoch in before for key in epoch} | set(history.history)
        ran = len(getattr(history, "epoch", []))
        history.history = {key: [epoch.get(key, float("nan")) for epoch in before] + history.history.get(
            key, [float("nan")] * ran) for key in keys}
        history.epoch = list(range(len(before))) + list(getattr(history, "epoch", []))

    # ------------------------------------------------------------------------------------------------------------
    def _stop_backups(self, exc: OSError) -> None:
        self._failed = f"{type(exc).__name__}: {exc}"
        warnings.warn(
            f"hetero_cs: a backup of fit cannot be written in {self._dir} ({self._failed}); training goes on without "
            f"backups, so a lost card now costs the training since the last one. Give hetero-cs run a --backup-dir "
            f"that is writable and has room for the model and its optimizer ({BACKUP_DIR_ENV_VAR}).",
            RuntimeWarning, stacklevel=2)

    def _save(self, *, complete: bool) -> None:
        if self._failed is not None:
            return
        started = time.perf_counter()
        groups = _variable_groups(self.model)
        arrays = {f"{name}_{i}": np.asarray(v.numpy()) for name, variables in groups.items()
                  for i, v in enumerate(variables)}
        slot = next(name for name in self._slots if name != self._slot)
        optimizer = getattr(self.model, "optimizer", None)
        record = {"epoch": self._epoch, "batches": self._batches, "complete": complete, "history": self._history,
                  "epochs": int(self.params.get("epochs") or 0) if self.params else 0,
                  "step": int(optimizer.iterations.numpy()) if optimizer is not None else 0, "arrays": slot,
                  "counts": {k: len(v) for k, v in groups.items()}, "run": self._run, "written": time.time()}
        try:
            write_atomically(self._dir / slot, lambda stream: np.savez(stream, **arrays))
            write_atomically(self._record_path, lambda stream: stream.write(json.dumps(record).encode()))
        except OSError as exc:  # read-only, full, or removed
            self._stop_backups(exc)
            return
        self._slot = slot
        self._last_end = time.perf_counter()
        self.last_backup_s = self._last_end - started
        self._costs_s = (self._costs_s + [self.last_backup_s])[:2]
        self.backups += 1
        self.backup_time_s += self.last_backup_s
        self._steps_since = 0
