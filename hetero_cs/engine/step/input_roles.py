"""Which distributed inputs feed training steps, and whether the step being traced is an inference step.

A strategy cuts every global batch it distributes, for training and for inference alike, but training owns the plan
lifecycle (the reference size whose plan is ``strategy.plan``, the guard's trial, re-planning) and its memory caps
bound a step that keeps activations for a backward pass. The strategy therefore needs to know, when an input is
distributed, whether its batches feed training steps, and, when a replica function is traced, whether it is an
inference step.

Keras' ``fit`` distributes its training data first (its ``TFEpochIterator`` is made before the epoch loop) and
its validation data later, inside the loop; ``evaluate`` and ``predict`` distribute their own. ``fit``, ``evaluate``
and ``predict`` run under :meth:`InputRoles.fitting` / :meth:`InputRoles.inferring` (set by the library's wrappers
of those methods), so:

* an input distributed inside ``evaluate`` or ``predict`` (fit's validation pass included) is an inference input;
* inside ``fit``, the first input distributed is the training input and any later one (validation data) is an
  inference input; when ``fit`` is given an already distributed dataset, every input it distributes is inference;
* any other input (a custom loop's) is a training input.

The state is per thread: it is the thread that calls ``fit`` that distributes its inputs and traces its steps.
"""

import threading

from hetero_cs._copying import DeepcopiedWithNewLocks
from hetero_cs.engine.step.replica_state import set_locally


class _ThreadRoles(threading.local):
    """This thread's counts of the ``fit``, ``evaluate`` and ``predict`` calls it runs (class attributes: the
    defaults every thread starts from)."""

    inferring = fitting = predicting = 0
    training_input_pending = False


class InputRoles(DeepcopiedWithNewLocks):
    """Per-thread record of whether the Keras loop running in this thread trains or infers."""

    def __init__(self):
        self._state = _ThreadRoles()

    def fitting(self, *, training_input_pending: bool = True):
        """Marks a ``fit`` call: its first distributed input trains (if ``training_input_pending``), later ones infer.

        Args:
            training_input_pending: False when ``fit`` was given an input distributed already, so that every input
                it distributes itself is validation data.
        """
        state = self._state
        return set_locally(state, fitting=state.fitting + 1, training_input_pending=bool(training_input_pending))

    def inferring(self, *, predicting: bool = False):
        """Marks an ``evaluate`` or ``predict`` call (fit's validation pass included)."""
        state = self._state
        return set_locally(state, inferring=state.inferring + 1, predicting=state.predicting + int(predicting))

    @property
    def inferring_now(self) -> bool:
        """True while this thread runs ``evaluate`` or ``predict``: the steps traced now are inference steps."""
        return self._state.inferring > 0

    @property
    def keras_loop_now(self) -> bool:
        """True while this thread runs ``fit``, ``evaluate`` or ``predict``: the steps traced now are Keras' own
        (their outputs are logs read from shared metric state, or predictions)."""
        return self._state.inferring > 0 or self._state.fitting > 0

    @property
    def keras_logs_now(self) -> bool:
        """True while this thread runs ``fit`` or ``evaluate`` (not ``predict``): the steps traced now return logs."""
        return self.keras_loop_now and self._state.predicting == 0

    def claim_input(self) -> bool:
        """Called once per input distributed in this thread: True when its batches feed training steps."""
        state = self._state
        if state.inferring:
            return False
        if state.fitting:
            training, state.training_input_pending = state.training_input_pending, False
            return training
        return True
