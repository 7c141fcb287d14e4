"""What a failed probe step is reported as: the calibration batch's data when its values explain the failure (integer
labels outside the model's classes, negative labels, non-finite values), else the device.

A bad label in the first global batch of ``model.fit`` is the data's fault; a message that says "check that the
model runs on this device" sends the user to the wrong place.
"""

from collections.abc import Sequence
from typing import Any

import numpy as np

from hetero_cs.errors import CalibrationError

__all__ = ["probe_step_error"]

_PART_NAMES = ("x", "y", "sample_weight")


def probe_step_error(exc: Exception, *, device: str, batch_size: int, model: Any, sample: Sequence[Any],
                     sample_size: int) -> CalibrationError:
    """The CalibrationError for a probe step on ``device`` that failed with TensorFlow's ``exc``.

    Args:
        exc: The op error the step raised.
        device: The probed device.
        batch_size: The probe batch size; the probe batch is the sample's first examples, repeated when larger.
        model: The probed Keras model (its output size gives the valid labels, when it is known).
        sample: The sample batch's parts (x, y[, sample_weight]) as arrays, each with ``sample_size`` examples.
        sample_size: n, the examples in the sample batch.

    Returns:
        A CalibrationError (one line) that names the data, its offending examples and the valid labels when the
        data explains the failure, else the device and TensorFlow's own message.
    """
    from hetero_cs.devices.device_errors import op_message  # imports TensorFlow

    cause = op_message(getattr(exc, "message", str(exc)), exc)
    problem = _data_problem(sample[: len(_PART_NAMES)], min(int(batch_size), int(sample_size)), model, cause, str(exc))
    if problem is not None:
        return CalibrationError(f"The calibration batch's data is at fault, not device={device!r}: {problem}. The "
                                f"probe step at batch_size={batch_size} failed with {type(exc).__name__}: {cause}. "
                                "Fix the data: calibration runs on the first global batch of the dataset given to "
                                "model.fit (or the sample batch given to calibrate).")
    return CalibrationError(f"The probe step failed on device={device!r} at batch_size={batch_size}: "
                            f"{type(exc).__name__}: {cause}. Check that the model runs on this device with this sample "
                            "batch (model(x, training=True) and its loss).")


def _data_problem(parts: Sequence[Any], used: int, model: Any, cause: str, message: str) -> str | None:
    """What is wrong with the values of the first ``used`` examples of the sample, or None (``message``: TensorFlow's
    error, ``cause``: its op's line)."""
    arrays = [np.asarray(part)[:used] for part in parts]
    for name, values in zip(_PART_NAMES, arrays):
        if values.dtype.kind == "f" and not np.all(np.isfinite(values)):
            rows = np.unique(np.nonzero(~np.isfinite(values.reshape(len(values), -1)))[0])
            return f"{name} holds non-finite values (NaN or inf) at examples {_listing(rows)}"
    if len(arrays) < 2 or arrays[1].dtype.kind not in "iu":
        return None
    labels = arrays[1].reshape(len(arrays[1]), -1)
    classes = _output_classes(model)
    bad = labels < 0 if classes is None else (labels < 0) | (labels >= classes)
    if bad.any():
        valid = ">= 0" if classes is None else f"0..{classes - 1} (the model has {classes} outputs)"
        return (f"the labels y hold {_listing(sorted({int(v) for v in labels[bad]}))} at examples "
                f"{_listing(np.unique(np.nonzero(bad)[0]))}; valid labels are {valid}")
    if classes is None and "label" in message.lower():  # TensorFlow's own kernel names the labels
        return f"the labels y do not fit the model's output ({cause})"
    return None


def _listing(values: Any, limit: int = 5) -> str:
    values = [int(v) for v in values]
    return f"[{', '.join(str(v) for v in values[:limit])}{', ...' if len(values) > limit else ''}]"


def _output_classes(model: Any) -> int | None:
    """The size of the model's (single) output's last axis when it is known and > 1, else None."""
    try:
        outputs = model.outputs
        if len(outputs) != 1:
            return None
        classes = outputs[0].shape[-1]
    except (AttributeError, ValueError, TypeError, IndexError):  # subclassed models have no symbolic outputs
        return None
    return int(classes) if classes is not None and int(classes) > 1 else None
