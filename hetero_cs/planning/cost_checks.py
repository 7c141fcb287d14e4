"""Checks of cost models (pure): a batch-size argument, a wrapper's base, and any model's predictions at given
batch sizes (a number, finite, >= 0 and non-decreasing), with errors that name the replica, the values and the fix.

The solver, the balancer and the model classes of :mod:`hetero_cs.planning.cost_model` share these rules.
"""

import math
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np

from hetero_cs.errors import ConfigError, InvalidCostModelError
from hetero_cs.planning.plan import _is_int

__all__ = ["check_cost_model"]


MAX_SECONDS = 1e6
"""The largest step time, fixed overhead or time per example a cost model accepts, in seconds (11.6 days): no
measurement is larger, and a larger value (an edited profile) would overflow predictions at large batch sizes."""


def _check_batch_size(batch_size: Any) -> None:
    # A plain int, the common case, is checked first because the solver calls this often.
    if (type(batch_size) is int or _is_int(batch_size)) and batch_size >= 0:
        return
    raise ConfigError(f"batch_size must be an integer >= 0. Received: batch_size={batch_size!r}. Pass the number of "
                      "examples of one replica's slice.")


def _check_base(model: Any) -> None:
    """A wrapper's ``base`` must be a cost model (the message names the wrapper's class)."""
    if not callable(getattr(model.base, "predict_step_time_s", None)):
        raise InvalidCostModelError(f"{type(model).__name__}.base must have a predict_step_time_s method. Received: "
                                    f"base={model.base!r}.")


def check_cost_model(model: Any, batch_sizes: Sequence[int], *, replica_id: int | None = None) -> np.ndarray:
    """Evaluates ``model`` at ``batch_sizes`` and checks the predictions are usable.

    Args:
        model: A :class:`CostModel`.
        batch_sizes: Batch sizes to check, integers >= 0, shape [N]; they are checked in increasing order.
        replica_id: The replica the model belongs to, named in error messages (None: not named).

    Returns:
        The predicted step times in seconds, float64 array of shape [N], in the order of ``batch_sizes``.

    Raises:
        InvalidCostModelError: If the model has no ``predict_step_time_s``, a prediction fails or is not a number (a
            string, None, a list: see :func:`checked_prediction`), NaN, infinite or negative, or predictions decrease
            with batch size (the message names the replica, the batch sizes and the values).
    """
    predict = predictor(model, replica_id)
    sizes = [int(b) for b in batch_sizes]
    times = np.array([checked_prediction(predict, b, replica_id) for b in sizes], dtype=np.float64)
    order = np.argsort(np.asarray(sizes, dtype=np.int64), kind="stable")
    for a, c in zip(order[:-1], order[1:]):
        if sizes[c] > sizes[a] and times[c] < times[a]:
            raise decreasing_error(replica_id, sizes[a], float(times[a]), sizes[c], float(times[c]))
    return times


def _who(replica_id: int | None) -> str:
    return "cost model" if replica_id is None else f"cost_models[{replica_id}]"


def predictor(model: Any, replica_id: int | None = None) -> Any:
    """``model.predict_step_time_s``, or InvalidCostModelError naming the replica when it has none."""
    predict = getattr(model, "predict_step_time_s", None)
    if not callable(predict):
        raise InvalidCostModelError(f"{_who(replica_id)} has no predict_step_time_s method. Received: {model!r}. "
                                    "Pass a CostModel such as LinearCostModel or PiecewiseLinearCostModel.")
    return predict


def checked_prediction(predict: Any, batch_size: int, replica_id: int | None = None) -> float:
    """``predict(batch_size)`` as a float of seconds, or InvalidCostModelError naming the replica.

    Real numbers are Python and NumPy ints and floats and 0-d real arrays; a string ("0.5"), None, a list, a bool
    or an array of several values is not a prediction, even where float() would take it. An int too large for a
    float gives inf, which is refused as any time that is not finite and >= 0.
    """
    who = _who(replica_id)
    try:
        raw = predict(batch_size)
    except Exception as exc:  # noqa: BLE001 - any failure of a user's model is reported with its replica
        raise InvalidCostModelError(f"{who}.predict_step_time_s({batch_size}) failed: {exc}. A cost model returns "
                                    "seconds as a float for any batch size >= 0.") from exc
    if isinstance(raw, bool) or not (isinstance(raw, numbers.Real) or (
            getattr(raw, "ndim", None) == 0 and getattr(getattr(raw, "dtype", None), "kind", "") in "iuf")):
        try:
            shown = repr(raw)
        except Exception:  # noqa: BLE001 - a user's object may fail to print; its type still says enough
            shown = "<unprintable>"
        raise InvalidCostModelError(
            f"{who}.predict_step_time_s({batch_size}) did not return a number: it returned {shown[:80]} "
            f"({type(raw).__name__}). A cost model returns seconds as a float (or int); fix its predict_step_time_s.")
    try:
        value = float(raw)
    except OverflowError:
        value = math.inf
    if not 0.0 <= value < math.inf:
        fix = "the device or fix the" if replica_id is None else f"replica {replica_id} or fix its"
        raise InvalidCostModelError(f"{who}.predict_step_time_s({batch_size}) returned {value!r}; step times must be "
                                    f"finite and >= 0 seconds. Recalibrate {fix} cost model.")
    return value


def decreasing_error(replica_id: int | None, b0: int, t0: float, b1: int, t1: float) -> InvalidCostModelError:
    """The error for a model that predicts ``t1 < t0`` at ``b1 > b0`` (the message names the replica and values)."""
    whose = "the" if replica_id is None else f"replica {replica_id}'s"
    return InvalidCostModelError(
        f"{_who(replica_id)} predicts a shorter step for a larger batch: predict_step_time_s({b0})={t0!r} s > "
        f"predict_step_time_s({b1})={t1!r} s. Cost models must be non-decreasing in batch_size; fit {whose} "
        "measurements with calibration's isotonic fit (calibration.fit.fit_cost_model).")
