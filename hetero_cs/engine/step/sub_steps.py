"""What a replica step reads of a micro-batched step while it is traced: the sub-step, and sparse gradient sums.

A micro-batched step (:mod:`hetero_cs.engine.memory.micro_batches`) runs a global batch as sub-steps whose gradients
the host sums before one update. The step's own code (the replica pass, the cut, the host update) reads here which
overlapped sub-step it is tracing (:func:`current_sub_step`), and sums sparse gradients over sub-steps in a
:class:`SparseSum`.
"""

import dataclasses
from typing import Any

import tensorflow as tf

from hetero_cs.engine.step.replica_state import this_threads, this_threads_value


@dataclasses.dataclass
class SubStepTrace:
    """One sub-step of an overlapped micro-batched call while it is traced (symbolic tensors).

    An overlapped call (:meth:`MicroBatching.run`) traces its sub-steps into one graph; the step engine reads
    this while it traces each one, instead of deciding a plan, reading the host state, or waiting at a barrier:

    Attributes:
        index: ``j`` in [0, K).
        count: ``K``.
        global_batch_size: int32 scalar, ``B`` of the whole step (every replica's loss weighs ``b_ij / B``).
        sizes: int64 ``[R]``, this sub-step's slice sizes ``b_ij``.
        active: The replicas with ``b_ij > 0`` (sorted), or None when all are: only their threads run.
        ends: Replica id -> its previous micro-batch's gradients on the host, shared by the call's sub-steps: a
            replica's next micro-batch starts once they exist (one micro-batch at a time in its memory), and it
            waits for nothing else, no other replica's work and no host update.
        end_stamps: Replica id -> the end stamps (float64 scalars) of its micro-batches so far, shared likewise: a
            replica's next micro-batch's clock starts at the last one (a card runs them back to back).
        applies: Whether this call is the step's last (a step of more than ``SUB_STEPS_PER_CALL`` sub-steps runs
            as several calls; only the last one's last sub-step applies the sums).
        last_of: Replica id -> the index of its last micro-batch's sub-step in this call (only the replicas with
            one).
        counts: Replica id -> how many micro-batches it runs in this call.
        chain_sizes: Replica id -> int scalar, the examples of all its micro-batches in this call.
        chain_starts: Replica id -> the clock start of its first micro-batch in this call (real devices, timed:
            a card's micro-batches are timed as one chain, with no clock between them), shared likewise.
        record: ``record(replica_id, examples, seconds, count)``, called from a TensorFlow thread as a card's
            micro-batch (emulated: each one) or chain of micro-batches (real devices: the call's) ends; None when
            the call is not timed.
    """

    index: int
    count: int
    global_batch_size: Any
    sizes: Any
    active: tuple[int, ...] | None
    ends: dict
    end_stamps: dict = dataclasses.field(default_factory=dict)

    applies: bool = True
    last_of: dict = dataclasses.field(default_factory=dict)
    counts: dict = dataclasses.field(default_factory=dict)
    chain_sizes: dict = dataclasses.field(default_factory=dict)
    chain_starts: dict = dataclasses.field(default_factory=dict)
    record: Any = None

    @property
    def last(self) -> bool:
        """Whether this sub-step applies the summed gradient (the last of the step's last call)."""
        return self.applies and self.index == self.count - 1


def current_sub_step() -> SubStepTrace | None:
    """The overlapped sub-step this thread is tracing (the thread that runs ``strategy.run``), or None."""
    return this_threads_value("sub_step")


def tracing_sub_step(sub_step: SubStepTrace):
    """Makes ``sub_step`` the one this thread traces for the block."""
    return this_threads("sub_step", sub_step)


class SparseSum:
    """The sum of sparse gradients (``tf.IndexedSlices``) over sub-steps, as one device's gradient of the whole batch.

    A lookup of the batch (a row per example): host variables of unknown leading dimension hold the rows' values and
    indices so far, and :meth:`total` appends a last gradient's, in order, giving the IndexedSlices one device
    computes for the whole batch (duplicate rows included, which an update such as Adam's treats one by one). A
    lookup that does not depend on the batch (``rows`` known while tracing: a Transformer's positions) has the same
    rows in every sub-step, summed over it: their values are added row by row, as one device sums them over the batch.
    """

    def __init__(self, row_shape, dtype, index_dtype, dense_shape, rows: int | None = None):
        row_shape = tf.TensorShape(row_shape)
        self.shared = rows is not None
        self.values = tf.Variable(tf.zeros([rows or 0, *row_shape.as_list()], dtype),
                                  shape=tf.TensorShape([rows, *row_shape]), trainable=False,
                                  name="hetero_cs_sparse_gradient_rows")
        self.indices = tf.Variable(tf.zeros([rows or 0], index_dtype), shape=tf.TensorShape([rows]), trainable=False,
                                   name="hetero_cs_sparse_gradient_indices")

    def add(self, gradient):
        """Adds ``gradient``'s rows; returns the write."""
        total = self.total(gradient)
        return tf.group(self.values.assign(total.values), self.indices.assign(total.indices))

    def total(self, gradient) -> tf.IndexedSlices:
        """The rows so far with ``gradient``'s, as one ``tf.IndexedSlices``."""
        if self.shared:
            return tf.IndexedSlices(self.values.read_value() + gradient.values, gradient.indices, gradient.dense_shape)
        return tf.IndexedSlices(tf.concat([self.values.read_value(), gradient.values], 0),
                                tf.concat([self.indices.read_value(), gradient.indices], 0), gradient.dense_shape)

    def clear(self):
        """Forgets every row; returns the write."""
        if self.shared:
            return self.values.assign(tf.zeros_like(self.values))
        return tf.group(self.values.assign(self.values.read_value()[:0]),
                        self.indices.assign(self.indices.read_value()[:0]))
