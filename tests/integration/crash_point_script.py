"""A supervised training script that kills itself (SIGKILL) at a chosen point: test_crash_points.py runs it.

    python crash_point_script.py OUT KIND N INTERVAL

KIND is where it dies, at the N-th time it gets there in this process: ``step`` (a step applied, before its
backup), ``write`` (a backup's file half written, not yet renamed), ``skip`` (a batch applied before the restart,
being skipped) or ``restart`` (the backup read, nothing restored yet); ``none`` never. INTERVAL fixes the steps
between backups (instead of the measured one). Every applied step's optimizer iteration is appended to OUT/steps.
The final weights and iterations go to OUT/weights.npz.
"""

import os
import pathlib
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
out, kind, count, interval = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
seen = {}


def reached(where: str) -> None:
    seen[where] = seen.get(where, 0) + 1
    if where == kind and seen[where] == count:
        sys.stderr.write(f"crash point: {where} {count}\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)


import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                           [tf.config.LogicalDeviceConfiguration()] * 4)
import hetero_cs  # noqa: E402
from hetero_cs.engine.faults import backup  # noqa: E402
from hetero_cs.engine._compat import trainer  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from tiny_regression import B, mlp, regression_data  # noqa: E402

written = backup.write_atomically


def write_atomically(path, write):
    def half_then_rest(stream):
        write(stream)
        stream.flush()
        stream.truncate(stream.tell() // 2)  # half of it on disk, under the temporary name
        reached("write")
        stream.seek(0)
        write(stream)

    written(path, half_then_rest)


backup.write_atomically = write_atomically
skip = trainer.skip_applied_batches


def skip_applied_batches(model, strategy, iterator):
    reached("skip")
    return skip(model, strategy, iterator)


trainer.skip_applied_batches = skip_applied_batches
check = backup.SupervisedBackup._check_same_run


def check_same_run(self, record):
    check(self, record)
    reached("restart")


backup.SupervisedBackup._check_same_run = check_same_run


def choose_interval(self, step_s):
    self.interval_steps = interval


backup.SupervisedBackup._choose_interval = choose_interval


class Steps(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        resumed = strategy.backup.resumed_from
        if resumed is None or self.model.optimizer.iterations.numpy() > resumed["step"]:  # applied, not skipped
            with open(out / "steps", "a") as stream:
                stream.write(f"{int(self.model.optimizer.iterations.numpy())}\n")
            reached("step")


strategy = hetero_cs.HeteroCentralStorageStrategy(["/cpu:1", "/cpu:2", "/cpu:3"], batch_split=[2, 1, 1],
                                                  rebalance=False, guard=False)
with strategy.scope():
    model = mlp()
    model.compile(optimizer="adam", loss="mse")
x, y = regression_data(int(os.environ.get("CRASH_NUM_BATCHES", "6")))
model.fit(x, y, batch_size=B, epochs=int(os.environ.get("CRASH_EPOCHS", "3")), shuffle=False, verbose=0,
          callbacks=[Steps()])
np.savez(out / "weights.npz", *model.get_weights(), iterations=int(model.optimizer.iterations))
