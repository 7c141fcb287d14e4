"""The values of a Keras model's variables that a step changes outside the optimizer's update, saved and put back.

A step's replicas update a BatchNormalization's moving statistics and the metrics' variables (the loss tracker)
as they go, before the host's update. When one replica fails after the others did so (a device error at the end
of its step, an out-of-memory error in its backward pass), or a micro-batched step is undone, those values are put
back so the retried step starts from the state the failed one did.
"""

from __future__ import annotations

import numpy as np


def saved_state(model) -> list:
    """``(variable, value)`` of the model's non-trained and metric variables (values copied to host memory)."""
    variables = {id(v): v for v in list(model.non_trainable_variables) + list(model.metrics_variables)}
    return [(v, np.array(v.numpy())) for v in variables.values()]


def restore(saved) -> None:
    """Puts back the values of :func:`saved_state` (None: nothing)."""
    for variable, value in saved or ():
        variable.assign(value)
