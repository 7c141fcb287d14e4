"""A lost card costs a restart, never the run: fit's backups under `hetero-cs run`, and the exact resume.

The oracle: an uninterrupted single-device fit over the same unshuffled data. A fit that dies mid-epoch and is
resumed from its backup (in this process, or restarted by the supervisor without the lost card) must end with
the same weights within 1e-5, and the same optimizer step count: no batch lost, none applied twice.
"""

import errno
import itertools
import os
import pathlib
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

from hetero_cs import HeteroCentralStorageStrategy
from hetero_cs.emulation import Emulator
from hetero_cs.engine.faults import backup
from tiny_regression import B, DEVICES, WORKLOAD, mlp, regression_data

NUM_BATCHES = 6
EPOCHS = 3


def data():
    return regression_data(NUM_BATCHES)


def reference():
    model = mlp()
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    x, y = data()
    history = model.fit(x, y, batch_size=B, epochs=EPOCHS, shuffle=False, verbose=0)
    return model, history


class Crash(keras.callbacks.Callback):
    """Ends fit at one step, as a lost card ends the process (nothing after that step is backed up)."""

    def __init__(self, epoch, batch):
        super().__init__()
        self._at = (epoch, batch)
        self._epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self._epoch, batch) == self._at:
            raise SystemError("the card is lost")


@pytest.fixture
def supervised(monkeypatch, tmp_path):
    """This process looks supervised: backups go to a temporary directory; each 'process' counts fits from 0."""
    monkeypatch.setenv("HETERO_CS_BACKUP_DIR", str(tmp_path / "backups"))
    monkeypatch.setenv("HETERO_CS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(backup, "BACKUP_COST_SHARE", 1e9)  # a backup after every step: the crash redoes none

    def new_process():
        monkeypatch.setattr(backup, "_FIT_ORDINALS", itertools.count())

    return new_process


def fit_under_hetero(callbacks=()):
    strategy = HeteroCentralStorageStrategy(DEVICES, emulate=Emulator(["A10", "T4", "T4"], workload=WORKLOAD,
                                                                      time_scale=1.0), batch_split=[2, 1, 1])
    with strategy.scope():
        model = mlp()
        model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    x, y = data()
    history = model.fit(x, y, batch_size=B, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=list(callbacks))
    return strategy, model, history


@pytest.mark.parametrize("share", [1e9, pytest.param(0.01, marks=pytest.mark.slow)])  # slow: the default 1 %
def test_a_fit_that_dies_mid_epoch_resumes_at_its_backup_and_applies_no_batch_twice(supervised, monkeypatch, share):
    monkeypatch.setattr(backup, "BACKUP_COST_SHARE", share)  # every step, or the default 1 % of training time
    supervised()
    with pytest.raises(SystemError):
        fit_under_hetero([Crash(epoch=1, batch=3)])
    supervised()  # the restarted process
    strategy, model, history = fit_under_hetero()
    ref, ref_history = reference()
    assert int(model.optimizer.iterations) == int(ref.optimizer.iterations) == EPOCHS * NUM_BATCHES
    for got, want in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-5)
    # The epochs after the resumed one are logged as an uninterrupted run logs them; the resumed one too, when the
    # backup was taken inside it (its metrics were backed up with it).
    np.testing.assert_allclose(history.history["loss"][-1], ref_history.history["loss"][-1], atol=1e-5)
    # The History returned holds every epoch, the ones before the restart included.
    assert history.epoch == list(range(EPOCHS))
    if share > 1:
        np.testing.assert_allclose(history.history["mae"], ref_history.history["mae"], atol=1e-5)


def test_a_completed_fit_is_not_run_again_after_a_restart(supervised):
    supervised()
    _, first, _ = fit_under_hetero()
    supervised()
    _, again, history = fit_under_hetero()
    _, ref_history = reference()
    # No epoch ran; the History returned is the finished fit's, as the script expects of it.
    np.testing.assert_allclose(history.history["loss"], ref_history.history["loss"], atol=1e-5)
    assert history.epoch == list(range(EPOCHS))
    for got, want in zip(again.get_weights(), first.get_weights()):
        np.testing.assert_array_equal(got, want)
    assert int(again.optimizer.iterations) == EPOCHS * NUM_BATCHES


def test_a_backup_of_another_model_is_refused_with_the_fix(supervised, tmp_path):
    from hetero_cs import ConfigError

    supervised()
    fit_under_hetero()
    supervised()
    strategy = HeteroCentralStorageStrategy(DEVICES, batch_split=[1, 1, 1])
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3), keras.layers.Dense(1)])
        model.compile(optimizer="adam", loss="mse")
    x, y = data()
    with pytest.raises(ConfigError, match=r"backups was made by another run: the model's architecture differs.*"
                                          r"Remove .*backups to start over"):
        model.fit(x, y, batch_size=B, epochs=1, verbose=0)


def fit_again(model_fn=mlp, **fit_arguments):
    strategy = HeteroCentralStorageStrategy(DEVICES, batch_split=[2, 1, 1])
    with strategy.scope():
        model = model_fn()
        model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    x, y = data()
    arguments = dict(batch_size=B, epochs=EPOCHS, shuffle=False, verbose=0)
    arguments.update(fit_arguments)
    examples = arguments.pop("examples", len(x))
    return model.fit(x[:examples], y[:examples], **arguments)


def test_regression_a_resume_interrupted_while_skipping_applies_no_batch_twice(supervised):
    # 8 batches, a crash at batch 5, then another while the restarted fit skipped the applied ones: the backup taken
    # while skipping said 1 batch with the variables of 5, and the optimizer ran 12 iterations instead of 8.
    supervised()
    with pytest.raises(SystemError):
        fit_under_hetero([Crash(epoch=1, batch=4)])
    supervised()
    with pytest.raises(SystemError):
        fit_under_hetero([Crash(epoch=1, batch=2)])  # batch 2 of epoch 1 is one of those skipped
    supervised()
    strategy, model, _ = fit_under_hetero()
    ref, _ = reference()
    assert int(model.optimizer.iterations) == int(ref.optimizer.iterations) == EPOCHS * NUM_BATCHES
    for got, want in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_regression_a_backup_of_another_run_is_refused_naming_the_difference(supervised):
    # The script went from a global batch of 64 to 32 and was resumed: 12 batches of 32 skipped where 768 examples
    # had been applied, exit 0, weights off by 0.29. A model of the same shapes with other layers was resumed too.
    from hetero_cs import ConfigError

    supervised()
    with pytest.raises(SystemError):
        fit_under_hetero([Crash(epoch=0, batch=3)])
    other_layers = lambda: keras.Sequential([keras.Input((6,)), keras.layers.Dense(12, activation="tanh"),  # noqa
                                             keras.layers.Dense(1)])
    for change, difference in [
        (dict(batch_size=B // 2), f"global batch size {B // 2} now, {B} when backed up"),
        (dict(examples=B * (NUM_BATCHES - 1)), f"examples in the data {B * (NUM_BATCHES - 1)} now, "
                                               f"{B * NUM_BATCHES} when backed up"),
        (dict(model_fn=other_layers), "the model's architecture differs"),
    ]:
        supervised()
        with pytest.raises(ConfigError, match=rf"The backup in .*backups was made by another run: {difference}.*"
                                              r"Remove .*backups to start over"):
            fit_again(**change)


def test_a_mid_epoch_resume_of_arrays_shuffled_each_epoch_is_refused_with_the_fix(supervised, caplog):
    from hetero_cs import ConfigError

    supervised()
    with pytest.raises(SystemError):
        fit_again(shuffle=True, callbacks=[Crash(epoch=0, batch=3)])
    assert "fit(shuffle=True) on arrays under hetero-cs run" in caplog.text  # said before any restart
    supervised()
    with pytest.raises(ConfigError, match=r"stopped after 3 batch\(es\) of epoch 1, but fit\(shuffle=True\) on "
                                          r"arrays shuffles that epoch anew.*Pass shuffle=False"):
        fit_again(shuffle=True)


class Storage(keras.callbacks.Callback):
    """Makes the backup directory fail after a step: removed, or every write refused with ``errno``."""

    def __init__(self, directory, monkeypatch, failure):
        super().__init__()
        self._directory, self._monkeypatch, self._failure = directory, monkeypatch, failure

    def on_train_batch_end(self, batch, logs=None):
        if batch != 2 or not self._directory.exists():
            return
        if self._failure == "removed":
            import shutil

            shutil.rmtree(self._directory)
            return

        def refused(path, write):
            raise OSError(self._failure, os.strerror(self._failure), str(path))

        self._monkeypatch.setattr(backup, "write_atomically", refused)


@pytest.mark.parametrize("failure", ["removed", *(pytest.param(e, marks=pytest.mark.slow)
                                                  for e in (errno.ENOSPC, errno.EROFS))])
def test_regression_a_backup_dir_that_fails_mid_fit_warns_and_training_goes_on(supervised, monkeypatch, tmp_path,
                                                                               failure):
    # A disk that filled ended fit with a raw OSError; a directory removed mid-fit with a raw FileNotFoundError.
    supervised()
    with pytest.warns(RuntimeWarning, match=r"a backup of fit cannot be written in .*backups .*training goes on "
                                            r"without backups.*--backup-dir"):
        _, model, _ = fit_under_hetero([Storage(tmp_path / "backups", monkeypatch, failure)])
    ref, _ = reference()
    assert int(model.optimizer.iterations) == int(ref.optimizer.iterations)


def test_the_backup_interval_is_chosen_from_the_backups_measured_cost():
    callback = backup.SupervisedBackup.__new__(backup.SupervisedBackup)
    callback._costs_s = [0.3, 0.01]  # the first backup warmed up; the second took 10 ms
    callback._choose_interval(0.1)  # a step of 100 ms
    assert callback.interval_steps == 20  # 20 steps of 100 ms: 2 s, 200 times the backup's 10 ms
    callback._costs_s = [100.0, 100.0]
    callback._choose_interval(0.1)
    assert callback.interval_steps == backup.MAX_INTERVAL_STEPS


SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np, tensorflow as tf, keras
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 4)
    tf.config.threading.set_inter_op_parallelism_threads(8)
    import hetero_cs
    from hetero_cs.emulation import Drift, Emulator, Workload
    sys.path.insert(0, {tests!r})
    from test_supervised_restart import B, EPOCHS, WORKLOAD, data, mlp
    # The A10 is lost: the fastest card, which every plan uses (an idle card runs no step and so is never lost);
    # emulated times 20x stretched dominate the host's own per-step time, however busy it is.
    emulator = Emulator(["A10", "T4", "T4"], workload=WORKLOAD, time_scale=20.0,
                        drift=[Drift(replica_id=0, from_step=int(sys.argv[2]), lost=True)])
    strategy = hetero_cs.HeteroCentralStorageStrategy(["/cpu:1", "/cpu:2", "/cpu:3"], emulate=emulator,
                                                      rebalance=False, guard=False)
    print("restart", os.environ["HETERO_CS_RESTART"], "devices", list(strategy.compute_devices), flush=True)
    with strategy.scope():
        model = mlp()
        model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    x, y = data()
    model.fit(x, y, batch_size=B, epochs=EPOCHS, shuffle=False, verbose=0)
    np.savez(sys.argv[1], *model.get_weights(), iterations=int(model.optimizer.iterations))
""")


@pytest.mark.slow  # 27 s: a whole script run twice under the supervisor; the other tests here cover its parts
def test_hetero_cs_run_restarts_a_script_without_the_card_it_lost_and_the_run_is_exact(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(tests=str(pathlib.Path(__file__).parent)))
    out = tmp_path / "weights.npz"
    env = dict(os.environ, HETERO_CS_CACHE_DIR=str(tmp_path / "cache"))
    backups = tmp_path / "backups"
    done = subprocess.run(
        [sys.executable, "-m", "hetero_cs.cli", "run", "--max-restarts", "2", "--backup-dir", str(backups), "--",
         sys.executable, str(script), str(out), "8"],
        capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "restart 0 devices ['/device:CPU:1', '/device:CPU:2', '/device:CPU:3']" in done.stdout
    assert "restart 1 devices ['/device:CPU:2', '/device:CPU:3']" in done.stdout  # without the lost A10
    assert "hetero_cs emulation: lost replica=0 (A10) at its step 8" in done.stderr
    assert "Restarting it without that card" in done.stderr and "resuming fit from its backup" in done.stderr
    assert "planning from the profiles calibrated before the restart" in done.stderr  # no second calibration
    assert done.stderr.count("Calibration profile cache miss") <= 1
    assert not backups.exists()  # removed once the script succeeded
    ref, _ = reference()
    with np.load(out) as got:
        assert int(got["iterations"]) == int(ref.optimizer.iterations) == EPOCHS * NUM_BATCHES
        for i, want in enumerate(ref.get_weights()):
            np.testing.assert_allclose(got[f"arr_{i}"], want, atol=1e-5)


@pytest.mark.parametrize("damage", ["record", "fields", "arrays"])
def test_a_damaged_backup_is_refused_with_the_fix(supervised, tmp_path, damage):
    from hetero_cs import ConfigError

    supervised()
    fit_under_hetero()
    directory = tmp_path / "backups"
    if damage == "record":
        (directory / "fit_0.json").write_text("{not json")
    elif damage == "fields":
        record = directory / "fit_0.json"
        record.write_text(record.read_text().replace('"epoch": 3', '"epoch": "x"'))
    else:
        for path in directory.glob("*.npz"):
            path.write_bytes(b"truncated")
    supervised()
    with pytest.raises(ConfigError, match=r"cannot be read.*remove .*backups to start over"):
        fit_under_hetero()


def test_a_users_own_backup_and_restore_resumes_under_hetero_cs_as_keras_does(supervised, tmp_path):
    # Keras' rule (save_freq="epoch"): the restarted fit starts again at the first epoch not finished. hetero_cs leaves
    # the backups to it and adds none of its own.
    own = str(tmp_path / "keras_backup")
    supervised()
    with pytest.raises(SystemError):
        fit_under_hetero([keras.callbacks.BackupAndRestore(own), Crash(epoch=1, batch=3)])
    assert not (tmp_path / "backups").exists() or not any((tmp_path / "backups").glob("fit_*.json"))
    supervised()
    strategy, model, _ = fit_under_hetero([keras.callbacks.BackupAndRestore(own)])
    ref, _ = reference()
    assert int(model.optimizer.iterations) == int(ref.optimizer.iterations)
    for got, want in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-5)
    assert strategy.backup is None
