"""Backups of a supervised ``model.fit``, and the exact resume after a restart (``hetero-cs run``).

Under :mod:`hetero_cs.supervisor` (``HETERO_CS_BACKUP_DIR`` is set), ``fit`` under a hetero_cs strategy gets a
:class:`SupervisedBackup` callback (unless the user passes Keras' own ``BackupAndRestore``, which then does the
job, with Keras' rule: a mid-epoch restore replays its epoch from the first batch). It writes

* the model's variables, the optimizer's (its iteration count, moments, a loss scale) and the metrics';
* the epoch, the batches of that epoch already applied, and the optimizer step;

after a training step, whenever the time since the last backup is at least 200 times what the last backup took,
so backups cost about 0.5 % of training time, under 1 % with the first (taken after the first step, to measure
that cost), and
once more when ``fit`` ends (marked complete). Each backup is written atomically: the arrays to a new ``.npz``
file, then the JSON record naming it replaces the old record (``os.replace``), then the old arrays are removed.

When the restarted script calls ``fit`` again (the k-th ``fit`` of the process finds ``fit_<k>.json``), the
callback puts every variable back, starts at the backup's epoch (Keras' ``initial_epoch``), puts the metrics of
that epoch back after Keras resets them, and has the first batches of that epoch, the ones already applied, read and
skipped rather than trained on: the run goes on at the exact step of the backup and applies no batch twice. A
``fit`` whose backup is complete is skipped whole (its final variables are restored), so a script of several
``fit`` calls resumes inside the one that was running. This holds for data in a fixed order (unshuffled, or
shuffled with a seed that repeats each epoch's order): with ``shuffle=True`` on arrays, the restarted epoch's order is
new, and the skipped batches are other examples than those applied.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import pathlib
import tempfile
import threading
import time
import zipfile

import keras
import numpy as np

from hetero_cs.errors import ConfigError

logger = logging.getLogger("hetero_cs.engine.central_storage")  # the messages users filter on

BACKUP_COST_SHARE = 0.005
"""Share of training time spent writing backups after the first (half the 1 % budget, which the first shares)."""

BACKUP_PATTERNS = ("fit_*.json", "fit_*.npz", ".fit_*.tmp", "profiles.json", "profiles.meta.json",
                   ".profiles*.tmp")
"""The files hetero_cs writes in a backup directory (``hetero-cs run`` removes only these once the script succeeds)."""

_FIT_ORDINALS = itertools.count()  # the k-th supervised fit of this process: its backup is fit_<k>
_ORDINAL_LOCK = threading.Lock()


def backup_dir() -> pathlib.Path | None:
    """The directory ``hetero-cs run`` gave this process for backups, or None outside the supervisor."""
    from hetero_cs.supervisor import BACKUP_DIR_ENV_VAR

    text = os.environ.get(BACKUP_DIR_ENV_VAR, "").strip()
    return pathlib.Path(text) if text else None


def with_backup(strategy, callbacks: list) -> list:
    """``fit``'s callbacks with a :class:`SupervisedBackup` last when ``hetero-cs run`` supervises this process,
    unless the user passed Keras' ``BackupAndRestore`` (it then backs up and restores, by Keras' rule)."""
    directory = backup_dir()
    if directory is None:
        return callbacks
    if any(isinstance(c, (keras.callbacks.BackupAndRestore, SupervisedBackup)) for c in callbacks):
        logger.info("hetero_cs: fit has its own BackupAndRestore; hetero-cs run's backups are left to it.")
        return callbacks
    strategy._backup = SupervisedBackup(strategy, directory)  # noqa: SLF001 - strategy.backup
    return [*callbacks, strategy._backup]  # noqa: SLF001


def _variable_groups(model) -> dict[str, list]:
    optimizer = getattr(model, "optimizer", None)
    return {"model": list(model.weights), "optimizer": list(optimizer.variables) if optimizer is not None else [],
            "metrics": list(model.metrics_variables)}


def _write_atomically(path: pathlib.Path, write) -> None:
    handle, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as stream:
            write(stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temp, path)
    except BaseException:
        pathlib.Path(temp).unlink(missing_ok=True)
        raise


class SupervisedBackup(keras.callbacks.Callback):
    """Backs a supervised ``fit`` up, and resumes it exactly from its last backup (see the module docstring).

    Args:
        strategy: The hetero_cs strategy ``fit`` runs under (its emulator's step counters follow a resume).
        directory: Where the backups live (created if missing).
    """

    def __init__(self, strategy, directory: pathlib.Path) -> None:
        super().__init__()
        self._strategy = strategy
        self._dir = pathlib.Path(directory)
        with _ORDINAL_LOCK:
            self._ordinal = next(_FIT_ORDINALS)
        self._record_path = self._dir / f"fit_{self._ordinal}.json"
        self._epoch = 0
        self._batches = 0  # batches of the current epoch applied
        self._resume_metrics: list | None = None  # metric values to put back when the resumed epoch begins
        self._resume_epoch: int | None = None
        self._history: list[dict] = []  # each finished epoch's logs (fit's History), kept in every backup
        self._last_end = 0.0
        self._last_cost_s: float | None = None
        self._sequence = 0
        self.backups = 0
        self.backup_time_s = 0.0
        self.resumed_from: dict | None = None  # the record resumed from, or None

    @property
    def interval_s(self) -> float | None:
        """The training time between two backups now in force, seconds (the last backup's cost over
        BACKUP_COST_SHARE); None before the first."""
        return None if self._last_cost_s is None else self._last_cost_s / BACKUP_COST_SHARE

    # ------------------------------------------------------------------------------------------------------------
    def on_train_begin(self, logs=None):
        from hetero_cs.engine import _compat

        self._dir.mkdir(parents=True, exist_ok=True)
        self._last_end = time.perf_counter()
        if not self._record_path.exists():
            return
        record, arrays = self._read()
        groups = _variable_groups(self.model)
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
        steps = (self.params or {}).get("steps")
        if not record["complete"] and steps is not None and record["batches"] > steps:
            raise ConfigError(
                f"The backup {self._record_path} says {record['batches']} batches of epoch {record['epoch'] + 1} were "
                f"applied, but an epoch of this fit has {steps}: the data changed since it was backed up. Remove "
                f"{self._dir} to start over.")
        for name in ("model", "optimizer"):
            for i, variable in enumerate(groups[name]):
                variable.assign(arrays[f"{name}_{i}"])
        self._resume_metrics = [arrays[f"metrics_{i}"] for i in range(record["counts"]["metrics"])]
        self._epoch, self._batches = record["epoch"], record["batches"]
        self._history = record["history"]
        self._resume_epoch = self._epoch
        self.resumed_from = record
        _compat.set_initial_epoch(self.model, record["epochs"] if record["complete"] else self._epoch)
        emulator = self._strategy.emulator
        if emulator is not None:
            emulator.advance_to(record["step"])  # drift schedules go on from the step resumed at
        if record["complete"]:
            logger.warning("hetero_cs: this fit had finished before the restart (%s): it is skipped, with its final "
                           "variables restored (optimizer step %d).", self._record_path, record["step"])
            return
        self._strategy._resume_skip = self._batches  # noqa: SLF001 - read by fit's train function
        logger.warning(
            "hetero_cs: resuming fit from its backup (%s): epoch %d, %d batch(es) of it already applied and skipped "
            "now, optimizer step %d.", self._record_path, self._epoch + 1, self._batches, record["step"])

    def _read(self) -> tuple[dict, dict]:
        """The record and every array of the backup, checked; a ConfigError when either cannot be read."""
        try:
            record = json.loads(self._record_path.read_text())
            for key, kind in (("epoch", int), ("batches", int), ("epochs", int), ("step", int), ("complete", bool),
                              ("arrays", str), ("counts", dict), ("history", list)):
                if not isinstance(record.get(key), kind) or (kind is int and isinstance(record[key], bool)) or (
                        kind is int and record[key] < 0):
                    raise ValueError(f"{key}={record.get(key)!r} is not a {kind.__name__}"
                                     + (" >= 0" if kind is int else ""))
            for name in ("model", "optimizer", "metrics"):
                count = record["counts"].get(name)
                if not isinstance(count, int) or isinstance(count, bool) or count < 0:
                    raise ValueError(f"counts[{name!r}]={count!r} is not an int >= 0")
            if "/" in record["arrays"] or "\\" in record["arrays"]:
                raise ValueError(f"arrays={record['arrays']!r} names a file outside the backup directory")
            with np.load(self._dir / record["arrays"]) as stored:
                arrays = {key: stored[key] for key in stored.files}  # reads (and CRC-checks) every array now
        except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile) as exc:
            raise ConfigError(
                f"The backup {self._record_path} cannot be read ({type(exc).__name__}: {exc}). Backups are written "
                f"atomically, so something else changed or truncated it; remove {self._dir} to start over (training "
                f"then starts from its first step).") from exc
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
        self._batches = int(batch) + 1
        now = time.perf_counter()
        if self.interval_s is None or now - self._last_end >= self.interval_s:
            self._save(complete=False)

    def on_epoch_end(self, epoch, logs=None):
        self._epoch, self._batches = epoch + 1, 0
        self._history.append({k: float(v) for k, v in (logs or {}).items() if np.ndim(v) == 0})

    def on_train_end(self, logs=None):
        from hetero_cs.engine import _compat

        _compat.set_initial_epoch(self.model, None)
        self._restore_history()
        self._strategy._resume_skip = 0  # noqa: SLF001
        self._save(complete=True)  # fit returned (an error in a step ends it without this call)

    def _restore_history(self) -> None:
        """Puts the epochs finished before the restart in front of fit's History (``model.history``), so the
        History a resumed fit returns holds every epoch, as an uninterrupted fit's does."""
        if self.resumed_from is None:
            return
        before = self.resumed_from["history"][:self._resume_epoch if not self.resumed_from["complete"] else None]
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
    def _save(self, *, complete: bool) -> None:
        started = time.perf_counter()
        groups = _variable_groups(self.model)
        arrays = {f"{name}_{i}": np.asarray(v.numpy()) for name, variables in groups.items()
                  for i, v in enumerate(variables)}
        self._sequence += 1
        name = f"fit_{self._ordinal}-{os.getpid()}-{self._sequence}.npz"
        _write_atomically(self._dir / name, lambda stream: np.savez(stream, **arrays))
        optimizer = getattr(self.model, "optimizer", None)
        record = {"epoch": self._epoch, "batches": self._batches, "complete": complete, "history": self._history,
                  "epochs": int(self.params.get("epochs") or 0) if self.params else 0,
                  "step": int(optimizer.iterations.numpy()) if optimizer is not None else 0,
                  "arrays": name, "counts": {k: len(v) for k, v in groups.items()}, "written": time.time()}
        previous = json.loads(self._record_path.read_text())["arrays"] if self._record_path.exists() else None
        _write_atomically(self._record_path, lambda stream: stream.write(json.dumps(record).encode()))
        if previous is not None and previous != name:
            (self._dir / previous).unlink(missing_ok=True)
        self._last_end = time.perf_counter()
        self._last_cost_s = self._last_end - started
        self.backups += 1
        self.backup_time_s += self._last_cost_s
