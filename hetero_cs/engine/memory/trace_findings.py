"""What a model's traced step showed that micro-batches cannot keep exact: shared by both strategies' micro-batching.

Loads no TensorFlow (the multi-worker strategy's caps are read without it).
"""

import threading

BATCH_NORM = "batch_norm"
NORMALISED_LOSS = "normalised_loss"
LAYER_STATE = "layer_state"


class TraceFindings:
    """What a model's traced step showed that micro-batches cannot keep exact, and the logs said once: the base of
    both strategies' micro-batching (:class:`hetero_cs.engine.memory.micro_batch_state.MicroBatchState`, and
    :class:`hetero_cs.engine.multi_worker.micro_batches.MultiWorkerMicroBatches`).

    A subclass names ``_WHY`` (each finding's reason; ``{paths}``: the layer state behind ``LAYER_STATE``) and
    ``_logger``.

    Args:
        strategy: The strategy.
        setting: ``micro_batches``: None, True or False (see the strategy).
    """

    def __init__(self, strategy, setting: bool | None):
        self._strategy, self.setting = strategy, setting
        self._lock = threading.Lock()
        self._logged: set = set()
        self._found: set[str] = set()  # what traces found that micro-batching cannot keep exact (BATCH_NORM, ...)
        self._paths: set[str] = set()  # the layer state variables behind LAYER_STATE

    def _why(self, found) -> str:
        """Why micro-batches cannot keep ``found`` (findings) exact, one reason each, in a fixed order."""
        paths = ", ".join(sorted(self._paths)[:4])
        return "; ".join(self._WHY[finding].format(paths=paths) for finding in sorted(found))

    def _log_once(self, key, level: int, message: str, *args) -> None:
        """Logs ``message`` the first time only that it is logged under ``key``."""
        with self._lock:
            if key in self._logged:
                return
            self._logged.add(key)
        self._logger.log(level, message, *args)
