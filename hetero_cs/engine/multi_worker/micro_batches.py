"""Micro-batched slices under :class:`hetero_cs.HeteroMultiWorkerMirroredStrategy`: memory never caps a card's share.

Each replica's memory cap (the examples its card holds at once) comes from ``max_batch_sizes=`` given to the
strategy (the same list on every worker, one entry per replica of the cluster), or, on emulated devices, from each
device's emulated memory and the model's size (:func:`hetero_cs.devices.workload.max_examples_in_memory`, what the
emulated card's out-of-memory check uses), lowered entry by entry to ``HETERO_CS_MAX_BATCH_SIZES`` after a restart
for out of memory (:mod:`hetero_cs.engine.multi_worker.oom`). Every worker therefore knows every replica's cap, and
nothing about them travels between workers.

Where caps are known and micro-batching applies, a replica whose slice ``b_i`` exceeds its cap runs it inside its
own replica step as ``k_i = ceil(b_i / cap_i)`` near-equal micro-batches, one after another on its card
(:func:`hetero_cs.engine._compat.replica_pass._micro_batched`), each weighted ``m_ij / B``; the summed gradient then
joins the one all-reduce of the step. So the step still equals one single-device step on the whole global batch, and
``k_i`` follows from ``b_i`` and the cap alone: the split the chief agrees is all the cluster needs. The chief's
plans price each slice as its micro-batches back to back (:class:`~hetero_cs.planning.cost_model.MicroBatchedCostModel`
over the per-step model that calibration fits from each replica's mean micro-batch): a fast card with little memory
keeps its share, and a global batch many times what the cards hold trains.

Where micro-batching would change the math it is not done silently, as under the central-storage strategy
(:mod:`hetero_cs.engine.memory.micro_batches`): the caps then bound each slice (one step per batch), logged once, and a
global batch they cannot hold is a :class:`~hetero_cs.errors.MicroBatchError` on every worker at its first step. That
covers a trainable BatchNormalization (its statistics are all-reduced across replicas inside the forward pass,
which no micro-batch can hold, so ``micro_batches=True`` is refused too), a loss normalised by the global batch (a
mask, ``"mean_with_sample_weight"``), a ``train_step`` override, an optimizer with ``use_ema``, metric state the loss
writes that is not a sum, and (unless ``micro_batches=True`` accepts it) a layer that sets its own non-trainable
state in training. The trace-time findings are made while each worker traces the same step, before any step runs,
so every worker, the chief included, switches alike.

Micro-batching runs in ``model.fit`` with Keras' own ``train_step``, and in ``evaluate`` and ``predict`` with Keras'
own ``test_step`` and ``predict_step`` (:meth:`MultiWorkerMicroBatches.inference_cap`; every model, except the
``evaluate`` of one whose loss all-reduces inside the step); custom loops keep one step per batch. Every replica,
capped or not, traces what keeps the slices within the caps, so every worker switches alike.
"""

import logging
import threading
from collections.abc import Sequence

from hetero_cs._copying import DeepcopiedWithNewLocks
from hetero_cs.devices.workload import max_examples_in_memory
from hetero_cs.engine.memory.trace_findings import BATCH_NORM, LAYER_STATE, NORMALISED_LOSS, TraceFindings
from hetero_cs.errors import ConfigError, MicroBatchError
from hetero_cs.planning.micro_batches import MicroBatchPlan
from hetero_cs.planning.plan import BatchPlan, _is_int, ordered_values
from hetero_cs.planning.restart_caps import CAPS_ENV_VAR, format_caps, lowest_caps

logger = logging.getLogger("hetero_cs.engine.multi_worker.strategy")

METRIC_STATE = "metric_state"
TRAIN_STEP = "train_step"
EMA = "ema"
_WHY = {
    BATCH_NORM: "a trainable BatchNormalization normalises by the statistics of the examples it sees in training (a "
                "synchronized one all-reduces them across replicas inside the forward pass), which micro-batches "
                "cannot keep",
    NORMALISED_LOSS: "a loss normalised by the global batch (a mask, or reduction='mean_with_sample_weight') "
                     "all-reduces its normaliser inside the loss, which micro-batches cannot hold",
    LAYER_STATE: "a layer sets its own non-trainable state in training ({paths}), which micro-batches would each set "
                 "from their own examples",
    METRIC_STATE: "the loss updates metric state that is not a sum",
    TRAIN_STEP: "the model overrides train_step (micro-batches cut Keras' own)",
    EMA: "the optimizer keeps an exponential moving average of the weights (use_ema=True)",
}


def checked_caps(max_batch_sizes, num_replicas: int) -> list[int | None] | None:
    """``max_batch_sizes`` as a list of one cap per replica (ints >= 0 or None), or None.

    Raises:
        ConfigError: Not a sequence of ``num_replicas`` entries, or an entry that is not an integer >= 0 or None.
    """
    if max_batch_sizes is None:
        return None
    given = ordered_values(max_batch_sizes)  # a list, tuple or 1-D array
    if given is None:
        raise ConfigError(
            f"max_batch_sizes must be a list of one memory cap per replica of the cluster (examples its card holds "
            f"at once; None: no cap), in task-index then local order. Received: max_batch_sizes={max_batch_sizes!r}.")
    caps = [int(c) if _is_int(c) else c for c in given]
    bad = [c for c in caps if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 0)]
    if len(caps) != num_replicas or bad:
        raise ConfigError(
            f"max_batch_sizes needs one entry per replica of the cluster (num_replicas_in_sync={num_replicas}), each "
            f"an integer >= 0 or None. Received: max_batch_sizes={caps!r}"
            + (f" ({len(caps)} entries)" if len(caps) != num_replicas else f" (not allowed: {bad!r})") + ".")
    return caps


_LARGEST_SLICE = 2**31 - 1


class MultiWorkerMicroBatches(TraceFindings, DeepcopiedWithNewLocks):
    """A multi-worker strategy's micro-batching: the caps, whether this model's slices run as micro-batches, and
    the last step's micro-batches (``strategy.micro_batching``).

    Args:
        strategy: The :class:`hetero_cs.HeteroMultiWorkerMirroredStrategy`.
        setting: ``micro_batches``: None (where exact), True (also accept a layer's own state set per micro-batch)
            or False (the caps bound each slice).
        max_batch_sizes: Per-replica caps of the whole cluster, checked by :func:`checked_caps`, or None.
        restart_caps: Caps that lower those (or the emulated caps) entry by entry after a restart for out of memory
            (:mod:`hetero_cs.engine.multi_worker.oom`), or None.
    """

    NORMALISED_LOSS, METRIC_STATE = NORMALISED_LOSS, METRIC_STATE  # what the replica pass finds while tracing
    _WHY, _logger = _WHY, logger

    def __init__(self, strategy, setting: bool | None, max_batch_sizes: list[int | None] | None,
                 restart_caps: list[int | None] | None = None):
        super().__init__(strategy, setting)  # the findings and logs (hetero_cs.engine.memory.trace_findings)
        self._given, self._restart_caps = max_batch_sizes, restart_caps
        self._caps: list[int | None] | None = None  # in force for the model being fit
        self._caps_source = ""  # where they come from, for the log
        self._active = False  # this model's slices past a cap run as micro-batches
        self._refused: set[str] = set()  # found while tracing this model's step
        self._refused_by_model: dict[int, set[str]] = {}  # id(model) -> what its traced step found
        self._pending = None  # (model, keras_train_step) whose emulated caps wait for fit's first trace
        self._prepare_lock = threading.Lock()
        self.micro_batched_traces = 0  # replica steps traced with micro-batched slices (every local replica)
        self._evaluates_whole: dict[int, bool] = {}  # id(model) -> its test step all-reduces inside a replica

    @property
    def max_batch_sizes(self) -> list[int | None] | None:
        """The per-replica caps in force (examples a card holds at once; None entries: uncapped), None without."""
        return None if self._caps is None else list(self._caps)

    @property
    def known_caps(self) -> list[int | None] | None:
        """The caps in force since ``fit``, else ``max_batch_sizes`` lowered by a restart's caps (None without)."""
        caps = self._caps
        return list(caps) if caps is not None else lowest_caps(self._given, self._restart_caps)

    def runs_micro_batches(self, model, verb: str) -> bool:
        """Whether ``model.<verb>`` (``"fit"``, ``"evaluate"``, ``"predict"``) runs slices past a cap as
        micro-batches."""
        if verb == "fit":
            return self._active
        return self.setting is not False and not (verb == "evaluate" and self._evaluates_whole.get(id(model), False))

    @property
    def active(self) -> bool:
        """True when slices past a cap run as micro-batches for the model being fit."""
        return self._active

    @property
    def last_plan(self):
        """How the last step's slices ran, as a :class:`~hetero_cs.planning.MicroBatchPlan` (each replica's
        micro-batch size and count, and their predicted times on the chief), or None before a step or without
        micro-batching."""
        split = self._strategy.last_split
        if not self._active or split is None:
            return None
        models = self._strategy.balancer.calibrated_models
        # One micro-batch is one step of the card's own model.
        models = None if models is None else [getattr(m, "base", m) for m in models]
        return MicroBatchPlan.of_slices(BatchPlan(tuple(split), sum(split)), self._caps, models)

    def cap_of(self, replica_id: int) -> int | None:
        """In a replica step: the cap its slice is micro-batched within, or None (one pass)."""
        if self._pending is not None:  # fit's first trace: the model is built now
            with self._prepare_lock:
                pending, self._pending = self._pending, None
                if pending is not None:
                    self.prepare(*pending, at_first_trace=True)
        return _slice_cap(self._caps if self._active else None, replica_id)

    def prepare(self, model, keras_train_step, *, at_first_trace: bool = False) -> None:
        """Before ``fit``: the caps for ``model`` and whether its slices run as micro-batches; tells the planner.
        Emulated caps wait for fit's first trace (``at_first_trace``), where the model's size is known.

        Raises:
            MicroBatchError: No replica can hold one example, or ``micro_batches=True`` for a model whose step
                cannot be micro-batched exactly (a trainable BatchNormalization, ``use_ema``).
        """
        emulator = self._strategy.emulator
        if self._given is None and emulator is not None and (emulator.workload is None or not at_first_trace):
            # Emulated caps need the model's size with its optimizer built (the workload the emulated memory check
            # uses, set by fit before its first step): decided when fit traces its first step, before any step runs.
            self._set(None, False)
            self._pending = (model, keras_train_step)
            return
        caps = lowest_caps(self._given if self._given is not None else self._emulated_caps(model), self._restart_caps)
        self._caps_source = ("max_batch_sizes" if self._given is not None else "the emulated cards' memory") + (
            f", lowered by {CAPS_ENV_VAR}" if self._restart_caps is not None else "")
        with self._lock:
            # What a model's traced step found stays found: Keras keeps the step traced, and a later fit of the
            # same model does not trace (or find) it again.
            self._refused = self._refused_by_model.setdefault(id(model), set())
        if caps is None or all(c is None for c in caps):
            self._set(None, False)
            return
        if all(c is not None and c < 1 for c in caps):
            source = (f" (lowered by {CAPS_ENV_VAR}={format_caps(self._restart_caps)}, set when a job is relaunched "
                      f"after out of memory)" if self._restart_caps is not None else "")
            raise MicroBatchError(
                f"No replica can hold one example of this model: memory caps {caps} examples per replica{source}. "
                f"Give the cards more memory (an emulated card: NAME@SIZE), a smaller model, or other max_batch_sizes.")
        from hetero_cs.engine._compat import replica_xla

        found = {finding for finding, present in (
            (BATCH_NORM, replica_xla.batch_norms_in_training(model)),
            (TRAIN_STEP, getattr(type(model), "train_step", None) is not keras_train_step),
            (EMA, getattr(getattr(model, "optimizer", None), "use_ema", False))) if present}
        if self.setting is True and found:
            raise MicroBatchError(
                f"micro_batches=True, but this model's step cannot be micro-batched on "
                f"HeteroMultiWorkerMirroredStrategy: {self._why(found)}. Use micro_batches=None (the caps then bound "
                f"each slice) or a global batch the caps {caps} hold in one step.")
        with self._lock:
            self._found = found = found | self._refused
        self._set(caps, self.setting is not False and not found)
        if found and self.setting is None:
            self._log_once(("kept", tuple(sorted(found))), logging.INFO,
                           "hetero_cs: not micro-batching this model (%s): each replica's slice stays within its "
                           "memory cap %s.", self._why(found), caps)

    def refuse(self, model, finding: str) -> None:
        """While a replica step is traced: ``finding`` keeps this model's slices within the caps (every worker
        finds it while tracing the same step, so every chief's plan follows before a step runs)."""
        with self._lock:
            if finding in self._refused:
                return
            self._refused.add(finding)
            self._found.add(finding)
        self._set(self._caps, False)
        self._log_once(("refused", finding), logging.WARNING,
                       "hetero_cs: not micro-batching this model: %s; each replica's slice stays within its memory "
                       "cap %s%s.", self._why({finding}), self._caps,
                       "" if self.setting is False else " (micro_batches=False says so without this warning)")

    def accepts_layer_state(self, model, paths: Sequence[str]) -> bool:
        """While a replica step is traced: whether micro-batches may set layer state ``paths`` once each."""
        paths = self._paths = {str(p) for p in paths}
        if self.setting is True:
            self._log_once(("approximation", tuple(sorted(paths))), logging.WARNING,
                           "hetero_cs: micro_batches=True: %s; this model's micro-batched slices approximate one "
                           "device's step there (everything else stays exact).", self._why({LAYER_STATE}))
            return True
        self.refuse(model, LAYER_STATE)
        return False

    def note_custom_loop(self) -> None:
        """``strategy.run`` outside ``fit``, ``evaluate`` and ``predict``: the caps do not apply there (said once)."""
        given = self.known_caps
        if given is not None and any(c is not None for c in given):
            self._log_once(("custom loop",), logging.WARNING,
                           "hetero_cs: max_batch_sizes=%s applies in model.fit, evaluate and predict only: a custom "
                           "loop's strategy.run cuts each slice whole, past any cap (no micro-batches). Size its "
                           "global batch for the caps, or train with model.fit.", given)

    def note_micro_batched(self, model) -> None:
        """While a replica step is traced with micro-batched slices (a counter for tests and logs)."""
        with self._lock:
            self.micro_batched_traces += 1
        self._log_once(("on", id(model)), logging.INFO,
                       "hetero_cs: memory caps %s examples per replica (from %s): a slice past its cap runs as "
                       "micro-batches within it, and every step stays one single-device step on the whole global "
                       "batch.", self._caps, self._caps_source)

    def inference_cap(self, model, replica_id: int) -> int | None:
        """In an ``evaluate`` or ``predict`` replica step: the cap its slice is micro-batched within, or None (one
        pass). The training caps (those in force since ``fit``, else ``max_batch_sizes`` lowered by a restart's
        caps, else the emulated memory's), a safe bound: inference holds less per example than training. Every model
        may run its inference slices as micro-batches (no state is written and BatchNormalization uses its moving
        statistics there), unless ``micro_batches=False``."""
        if self.setting is False:
            return None
        caps = self._caps
        if caps is None:  # before fit: the emulated memory's caps once the model's size is known
            sized = self._given is None and getattr(self._strategy.emulator, "workload", None) is not None
            caps = lowest_caps(self._emulated_caps(model) if sized else None, self.known_caps)
        return _slice_cap(caps, replica_id)

    def note_micro_batched_inference(self, model) -> None:
        """While an evaluate or predict replica step is traced with micro-batched slices (logged once)."""
        self._log_once(("inference", id(model)), logging.INFO,
                       "hetero_cs: memory caps %s examples per replica in evaluate and predict: a slice past its cap "
                       "runs as micro-batches within it.", self.known_caps)

    def evaluates_in_micro_batches(self, model, all_reduces) -> bool:
        """In an evaluate replica step with a cap: False when ``all_reduces()`` finds that the model's test step
        all-reduces inside the replica (a loss normalised by the global batch), which a loop of micro-batches would
        run once per micro-batch while the other replicas run it once (remembered per model, logged once)."""
        known = self._evaluates_whole.get(id(model))  # one dict read or write: atomic
        if known is None:
            known = self._evaluates_whole[id(model)] = bool(all_reduces())
        if known:
            self._log_once(("evaluate whole", id(model)), logging.WARNING,
                           "hetero_cs: not micro-batching this model's evaluate slices: %s; each slice runs in one "
                           "pass, past its memory cap %s (predict's slices still run as micro-batches).",
                           _WHY[NORMALISED_LOSS], self.known_caps)
        return not known

    def check_batch(self, global_batch_size: int) -> None:
        """At every step, on every worker alike: a global batch the caps cannot hold without micro-batches is a
        MicroBatchError here (before any collective), naming why micro-batches are off."""
        caps = self._caps
        if caps is None or self._active or any(c is None for c in caps) or int(global_batch_size) <= sum(caps):
            return
        with self._lock:
            found = set(self._found)
        why = self._why(found) if found and self.setting is not False else "micro_batches=False"
        raise MicroBatchError(
            f"A global batch of {int(global_batch_size)} examples does not fit the replicas' memory in one step "
            f"(memory caps {caps} examples per replica, {sum(caps)} in all), and its slices are not micro-batched: "
            f"{why}. Use a global batch of at most {sum(caps)}"
            + (", or micro_batches=None" if self.setting is False else "") + ".")

    # --------------------------------------------------------------------------------------------------------------
    def _set(self, caps, active: bool) -> None:
        with self._lock:
            changed = (caps, active) != (self._caps, self._active)
            self._caps, self._active = (None if caps is None else list(caps)), bool(active and caps is not None)
        if changed:
            self._strategy._planner.set_memory_caps(caps, micro_batched=self._active)  # noqa: SLF001

    def _emulated_caps(self, model) -> list[int | None] | None:
        emulator = self._strategy.emulator
        if emulator is None:
            return None
        self._strategy.prepare_emulation(model)
        # The least memory each emulated card ever has (its catalog size or NAME@SIZE override, or a Drift's lower
        # limit): a cap that holds then holds at every step.
        return [max_examples_in_memory(emulator.workload, emulator.lowest_memory_bytes(i))
                for i in range(emulator.num_replicas)]


def _slice_cap(caps: list[int | None] | None, replica_id: int) -> int | None:
    """The cap a replica's slice runs as micro-batches within, or None (one pass: no cap, or one of 0).

    A slice holds at most 2**31 - 1 examples (int32 sizes): a larger cap (a roomy card, a tiny model) is that.
    """
    cap = None if caps is None else caps[int(replica_id)]
    return None if cap is None or cap < 1 else min(int(cap), _LARGEST_SLICE)
