"""What a micro-batched step's traced code reads on the host, and what its trace found it cannot keep exact.

A base class of :class:`hetero_cs.engine.memory.micro_batches.MicroBatching`, in its own module for size. The
traced step reads here, instead of the plan it would otherwise serve: the whole step's ``B`` (every sub-step's loss
weighs ``b_ij / B``), which branch of the host update a sub-step takes (accumulate, or apply the sum), and the host
variables the gradients are summed in. While it is traced, the step tells it what micro-batches could not keep
exact (BatchNormalization's statistics, a loss normalised by the batch, a layer's own state), which the sub-step
loop reads before it runs a step as sub-steps (:meth:`MicroBatchState._refusal`).
"""

import logging

import tensorflow as tf

from hetero_cs.engine.memory.trace_findings import BATCH_NORM, LAYER_STATE, NORMALISED_LOSS, TraceFindings
from hetero_cs.engine.step.sub_steps import SparseSum, current_sub_step

logger = logging.getLogger("hetero_cs.engine.central_storage")

_WHY = {
    BATCH_NORM: "BatchNormalization in training normalises each micro-batch by its own statistics (one device "
                "normalises by the whole batch's) and updates its moving statistics once per micro-batch",
    LAYER_STATE: "a layer sets its own non-trainable state in training ({paths}), which micro-batches would each "
                 "set from their own examples, once per micro-batch",
    NORMALISED_LOSS: "a loss normalised by the batch (a mask, or reduction='mean_with_sample_weight') would divide "
                     "each micro-batch by its own count",
}


class MicroBatchState(TraceFindings):
    """The host state micro-batched steps read, and their trace's findings (the micro-batching's base class).

    Args:
        strategy: The :class:`hetero_cs.HeteroCentralStorageStrategy`.
        setting: ``micro_batches``: None, True or False (see the strategy).
    """

    _WHY, _logger = _WHY, logger

    def __init__(self, strategy, setting: bool | None):
        super().__init__(strategy, setting)
        self._state = None  # int64 [2] host variable [B, accumulate]: [0, 0] outside micro-batched steps
        self._accumulators: dict = {}  # variable ref -> host variable holding the sum of the sub-steps' gradients
        self._checked = False  # a micro-batched step ran with the findings of its trace known

    @property
    def armed(self) -> bool:
        """True once a micro-batched step was prepared: steps traced from then on read the host state."""
        return self._state is not None

    def arm(self) -> None:
        """Creates the host state (once); steps traced afterwards can run as sub-steps."""
        with self._lock:
            if self._state is None:
                with tf.init_scope(), tf.device(self._strategy.parameter_device):
                    self._state = tf.Variable([0, 0], dtype=tf.int64, trainable=False,
                                              name="hetero_cs_micro_batch_state")

    def full_batch_size(self, step_batch_size):
        """In a traced step: ``B`` of the whole micro-batched step, else the step's own (``step_batch_size``)."""
        sub_step = current_sub_step()
        if sub_step is not None:
            return tf.cast(sub_step.global_batch_size, step_batch_size.dtype)
        if not self.armed:
            return step_batch_size
        full = tf.cast(self._state[0], step_batch_size.dtype)
        return tf.where(full > 0, full, step_batch_size)

    def update_branch(self):
        """In a traced step's host update: an int32 scalar, 0 for an ordinary step, 1 for a sub-step that only
        accumulates, 2 for the last sub-step (which applies the sum); None when not armed. In an overlapped call's
        sub-step, the Python int 1 or 2 (known while tracing: its update takes no branch, so nothing of it looks
        like a write of the weights that the next sub-step's reads would wait for)."""
        sub_step = current_sub_step()
        if sub_step is not None:
            return 2 if sub_step.last else 1
        if not self.armed:
            return None
        state = self._state.read_value()
        return tf.cast(tf.where(state[0] > 0, 2 - state[1], 0), tf.int32)

    def _accumulator(self, key, make):
        """The host accumulator ``key`` names, made by ``make()`` on the parameter device the first time."""
        accumulator = self._accumulators.get(key)
        if accumulator is None:
            with tf.init_scope(), tf.device(self._strategy.parameter_device):
                accumulator = self._accumulators[key] = make()
        return accumulator

    def accumulators(self, variables) -> list:
        """One host variable per trained variable (zeros of its shape and dtype), created once."""
        return [self._accumulator(_key(variable), lambda v=variable: tf.Variable(
            tf.zeros(v.shape, v.dtype), trainable=False, name="hetero_cs_gradient_sum")) for variable in variables]

    def sparse_accumulator(self, variable, gradient) -> SparseSum:
        """The :class:`SparseSum` of a variable whose gradient is a ``tf.IndexedSlices``, created once."""
        return self._accumulator(("sparse", _key(variable)), lambda: SparseSum(
            gradient.values.shape[1:], gradient.values.dtype, gradient.indices.dtype, gradient.dense_shape,
            rows=gradient.indices.shape[0]))

    def _zero(self) -> None:
        for accumulator in self._accumulators.values():
            if isinstance(accumulator, SparseSum):
                accumulator.clear()
            else:
                accumulator.assign(tf.zeros_like(accumulator))

    def note(self, finding: str) -> None:
        """Called while a step is traced: ``finding`` (BATCH_NORM, NORMALISED_LOSS) is in this model's step."""
        self._found.add(finding)

    def note_layer_state(self, path: str) -> None:
        """Called while a step is traced: a layer sets its non-trainable variable ``path`` in a replica step
        (BatchNormalization's moving statistics are BATCH_NORM's)."""
        if str(path).endswith(("moving_mean", "moving_variance")):
            return
        self._found.add(LAYER_STATE)
        self._paths.add(str(path))

    def _refusal(self) -> str | None:
        """Why this model's step cannot run as sub-steps (what its trace found and ``setting`` does not accept), or
        None; logs once what ``micro_batches=True`` accepts."""
        found = set(self._found)
        if self.setting is True:
            accepted = found & {BATCH_NORM, LAYER_STATE}
            found -= accepted
            if accepted:
                self._log_once(("approximation", tuple(sorted(accepted))), logging.WARNING,
                               "hetero_cs: micro_batches=True: %s; this model's micro-batched steps approximate one "
                               "device's step there (everything else stays exact).", self._why(accepted))
        return self._why(found) or None


def _key(variable):
    return variable.ref() if hasattr(variable, "ref") else id(variable)
