"""Reading a dataset's first global batch without moving the dataset: its next iteration starts where this one did.

Part of :mod:`hetero_cs.engine._compat`, the one place of private TensorFlow/Keras touches.

Calibration (and emulation's sizing) needs one real global batch before training. Reading it from the user's
dataset opens an iterator, and opening an iterator is not free of side effects: a ``Dataset.shuffle(seed=...)``
with ``reshuffle_each_iteration`` draws the next epoch's order from a seed generator that every new iterator
advances, and Keras' ``PyDataset`` adapter (``fit(shuffle=True)``) shuffles its batch order with Python's
``random`` as each iterator starts. Training would then see different batches from single-device training.

:class:`FirstBatchReader` reads the batch through the same pipeline the training iterates (our packed host
dataset), saves that iterator's state before reading (tf.data iterator checkpointing: position, shuffle seeds and
the seed generator's draw count) together with Python's and NumPy's global random states, and puts the random
states back after reading. The next iterator of a distributed dataset made from the same source dataset is then
restored from the saved state before it yields anything, so it starts with the first iteration's order and leaves
the seed generator as one iteration would: the first training epoch sees what single-device training sees, and so
does every later one.
"""

import logging
import random
import threading
import warnings
import weakref

import numpy as np
import tensorflow as tf

from hetero_cs._copying import DeepcopiedWithNewLocks

logger = logging.getLogger(__name__)

# Private: tf.data's ExternalStatePolicy for iterator serialization. IGNORE: our own pipeline calls Python (the
# plan lookup), whose state is not part of the data order and must not make saving fail or warn.
_IGNORE_EXTERNAL_STATE = tf.data.experimental.ExternalStatePolicy.IGNORE.value


def host_iterator_resource(distributed_iterator):
    """The resource of the plain tf.data iterator behind one of our distributed iterators (one input worker)."""
    # Private: DistributedIterator._iterators holds one _SingleWorkerOwnedDatasetIterator per input worker (ours
    # has one, the host); its _iterator is the OwnedIterator over our packed dataset (no MultiDeviceIterator: see
    # distribute_on_host), whose _iterator_resource is what tf.data's (de)serialization ops take.
    return distributed_iterator._iterators[0]._iterator._iterator_resource  # noqa: SLF001


class FirstBatchReader(DeepcopiedWithNewLocks):
    """Per strategy: first batches read ahead of training, and the iterator states to start training from."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pending = weakref.WeakKeyDictionary()  # source dataset -> serialized iterator state at position 0
        self._warned = False

    def read(self, distributed, source):
        """Returns the first element of ``distributed`` (made from ``source``); its next iteration starts over.

        Args:
            distributed: One of our distributed datasets (``distribute_on_host``) over ``source``.
            source: The user's dataset (the key under which the state waits for the next iteration).

        Raises:
            StopIteration: The dataset is empty.
        """
        iterator = distributed.plain_iterator()  # nothing restored into it
        state = self._on_host(tf.raw_ops.SerializeIterator, iterator, external_state_policy=_IGNORE_EXTERNAL_STATE)
        python_state, numpy_state = random.getstate(), np.random.get_state()
        try:
            element = next(iterator)
        finally:
            del iterator  # stops its prefetching before the random states are put back
            random.setstate(python_state)
            np.random.set_state(numpy_state)
        if state is not None:
            with self._lock:
                self._pending[source] = state
        return element

    def restore_next(self, source, iterator) -> None:
        """Makes ``iterator`` (just created over ``source``) start where the read one did, if one was read."""
        if source is None:
            return
        with self._lock:
            state = self._pending.pop(source, None)
        if state is None or not tf.executing_eagerly():
            return  # an iterator made inside a tf.function cannot be restored here: it starts as TensorFlow starts it
        self._on_host(tf.raw_ops.DeserializeIterator, iterator, serialized=state)

    def _on_host(self, op, iterator, **kwargs):
        """``op`` (tf.data's iterator (de)serialization) on ``iterator``'s host iterator, or None with a warning."""
        try:
            return op(resource_handle=host_iterator_resource(iterator), **kwargs)
        except (tf.errors.OpError, AttributeError, IndexError) as exc:
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"hetero_cs read the first global batch (for calibration) from the dataset but cannot rewind it "
                    f"({type(exc).__name__}: {exc}). A dataset that reshuffles on each iteration (Dataset.shuffle, a "
                    f"shuffling PyDataset) may then give training a different batch order from single-device "
                    f"training. Pass one batch instead of the dataset: strategy.calibrate(model, (x, y)), or use "
                    f"batch_split=[...] without emulation (no batch is read then).",
                    stacklevel=3,  # the caller of read or restore_next
                )
            return None
