"""hetero_cs' log lines and Keras' progress bar: a record logged while the bar draws an epoch's line waits for it."""

import contextlib
import io
import logging

import keras
import numpy as np
import pytest

from hetero_cs import HeteroCentralStorageStrategy

DEVICES = ["/cpu:1", "/cpu:2"]
logger = logging.getLogger("hetero_cs.tests.progress_bar")  # one of hetero_cs' loggers, made before fit


class LogsMidEpoch(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 1:
            logger.warning("hetero_cs test: logged in the middle of epoch %d", self.epoch)

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch


class Raises(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 2:
            raise KeyboardInterrupt


def model_under(strategy):
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    return model


@contextlib.contextmanager
def terminal():
    """One stream for the progress bar (stdout) and hetero_cs' records, as a terminal shows both (redirected
    inside the test: pytest sets its own stdout at the start of each phase)."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    ours = logging.getLogger("hetero_cs")
    ours.addHandler(handler)
    try:
        with contextlib.redirect_stdout(stream):
            yield stream
    finally:
        ours.removeHandler(handler)


def test_a_record_logged_mid_epoch_waits_for_the_progress_bar_to_end_its_line():
    x, y = np.ones((32, 4), np.float32), np.ones((32, 1), np.float32)
    model = model_under(HeteroCentralStorageStrategy(DEVICES, batch_split=[3, 1]))
    with terminal() as stream:
        model.fit(x, y, batch_size=8, epochs=2, verbose=1, callbacks=[LogsMidEpoch()])
    out = stream.getvalue()
    for epoch in (0, 1):
        line = f"hetero_cs test: logged in the middle of epoch {epoch}"
        at = out.index(line)
        assert out[at - 1] == "\n", repr(out[max(0, at - 200):at + len(line)])  # on a line of its own
        bar = out.rindex("4/4", 0, at)  # after the epoch's last update of the bar, which then ended its line
        assert "\n" in out[bar:at], repr(out[bar:at])


def test_records_held_when_fit_raises_mid_epoch_are_passed_on():
    x, y = np.ones((32, 4), np.float32), np.ones((32, 1), np.float32)
    model = model_under(HeteroCentralStorageStrategy(DEVICES, batch_split=[3, 1]))
    with terminal() as stream, pytest.raises(KeyboardInterrupt):
        model.fit(x, y, batch_size=8, epochs=1, verbose=1, callbacks=[LogsMidEpoch(), Raises()])
    assert "hetero_cs test: logged in the middle of epoch 0" in stream.getvalue()
    assert not logger.filters  # nothing is held any more
