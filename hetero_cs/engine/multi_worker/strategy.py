"""HeteroMultiWorkerMirroredStrategy: several machines on MultiWorkerMirroredStrategy, balanced and exact.

Every worker runs the same script on the same data, and ``batch_size`` is the *global* batch ``B``. Each worker's
input pipeline yields every global batch whole, once, on the worker's CPU; ``strategy.run`` cuts it there by the
plan of this step and hands each local replica only its own contiguous slice ``[sum(b_<i), sum(b_<=i))``
(:mod:`hetero_cs.engine.multi_worker.input`), so every example is used exactly once over the cluster and a replica's
device receives ``b_i`` examples, not ``B``.
Replica ``i``'s loss is weighted ``b_i / B`` (the shared Keras patches of :mod:`hetero_cs.engine._compat`) and the
gradients are SUM-all-reduced by TensorFlow's own collectives: one step on any split equals one single-device step
on the whole batch. A last partial batch ``B' < B`` is split by a plan for ``B'`` and weighted by ``B'``.

Agreement: :mod:`hetero_cs.engine.multi_worker.agreement`.
"""

import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from hetero_cs.engine import _compat, arguments
from hetero_cs.engine.step import replica_state
from hetero_cs.devices.logical import MAX_EMULATED_REPLICAS_PER_WORKER, setup_worker_replica_cpus
from hetero_cs.engine.multi_worker.agreement import PlanAgreement
from hetero_cs.engine.multi_worker.cluster_planner import ClusterPlanner
from hetero_cs.engine.multi_worker.input import MultiWorkerInput
from hetero_cs.engine.multi_worker.oom import out_of_memory_here
from hetero_cs.engine.strategy_state import SharedState
from hetero_cs.errors import ConfigError, HeteroCSError
from hetero_cs.planning.balancer import Balancer

logger = logging.getLogger(__name__)

EMULATE_ENV_VAR = "HETERO_CS_EMULATE"


class HeteroMultiWorkerMirroredStrategy(_compat.DeepcopiedStrategy, _compat.ReplicaCountStrategy, MultiWorkerInput,
                                        PlanAgreement, SharedState, tf.distribute.MultiWorkerMirroredStrategy):
    """MultiWorkerMirroredStrategy whose replicas take plan-sized slices of each global batch, weighted exactly.

    Variables are mirrored on every replica, as under MultiWorkerMirroredStrategy; the cluster comes from
    ``TF_CONFIG`` (``hetero-cs launch --workers N -- COMMAND`` sets it for N workers on this machine). Replicas are
    numbered in task-index order, then local order (``replica_id_in_sync_group``); on a CPU-only worker there is one
    replica per worker, or one per emulated device when ``emulate`` names several per worker.

    Example (the same script on every worker)::

        strategy = hetero_cs.HeteroMultiWorkerMirroredStrategy(batch_split=[3, 1])
        with strategy.scope():
            model = keras.Sequential([...])
            model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        model.fit(dataset_of_global_batches, epochs=5)  # every worker: the same dataset, unsharded

    Args:
        auto_balance: Calibrate each replica during the first training steps (each worker times its own device on
            probe splits, which are exact training steps too), let the chief solve the minimum-makespan split and
            try it against the even split (the guard); False: an even split.
        rebalance: With auto_balance, re-plan when measured step times drift (the chief decides; all adopt).
        batch_split: Fixed relative shares for all replicas of all workers, in task-index then local order
            (length ``num_replicas_in_sync``); overrides auto_balance.
        emulate: Catalog device names for all replicas of all workers, in task-index then local order, e.g.
            ``["A10", "T4"]`` (one replica per worker on 2 workers) or ``["A10", "T4", "P100", "T4"]`` (2 workers
            of 2 replicas each: the name count is a multiple of the workers in ``TF_CONFIG``, and each worker then
            runs that many replicas on logical CPU devices). Each replica computes on the CPU and then also waits
            for the time its named device would take. Or a :class:`hetero_cs.emulation.Emulator` over those names, e.g. with
            ``drift=[Drift(replica_id=0, factor=3.0, from_step=40)]`` (cluster replica ids; every worker must build
            the same one: it is not sent between workers). None reads ``HETERO_CS_EMULATE`` (set by
            ``hetero-cs launch --emulate``).
        profile_cache: Accepted for symmetry with the central-storage strategy; calibration here happens during
            training and is not cached (must be None or False).
        communication_options: ``tf.distribute.experimental.CommunicationOptions``; its ``timeout_seconds`` bounds
            how long a collective waits for a worker that died (then every other worker fails with an error instead
            of hanging).
        micro_batches: Where a replica's slice exceeds its memory cap, ``model.fit`` runs it as micro-batches within
            the cap inside the replica's step, exactly (:mod:`hetero_cs.engine.multi_worker.micro_batches`). None (the
            default): where that is exact; True: also where a layer sets its own state per micro-batch (logged);
            False: the caps bound each slice.
        max_batch_sizes: Each replica's memory cap, the examples its card holds at once (None entries: uncapped),
            for all replicas of the cluster in task-index then local order, the same list on every worker. None:
            from the emulated devices' memory when emulating, else no caps (real cards: give them here). Lowered
            entry by entry to ``HETERO_CS_MAX_BATCH_SIZES`` when that is set (``hetero-cs launch`` sets it when it
            relaunches the job after a replica ran out of memory: see :mod:`hetero_cs.engine.multi_worker.oom`).

    Raises:
        BatchSplitError: ``batch_split`` of the wrong length, with negative, non-finite or only zero shares.
        ConfigError: ``emulate`` of the wrong length (not a multiple of the workers, or not one name per replica
            of a GPU cluster), a profile_cache other than None/False, ``micro_batches`` not None or a bool, or
            ``max_batch_sizes`` (or ``HETERO_CS_MAX_BATCH_SIZES``) not one integer >= 0 or None per replica.
        EmulationError: Several emulated replicas per worker, but TensorFlow was initialised before the strategy
            was built (it cannot create their logical CPU devices any more).
        UnknownEmulatedDeviceError: An ``emulate`` name is not in the catalog.
    """

    def __init__(self, *, auto_balance: bool = True, rebalance: bool = True, batch_split: Sequence[float] | None = None,
                 emulate: Sequence[str] | None = None, profile_cache: Any = None, communication_options: Any = None,
                 micro_batches: bool | None = None, max_batch_sizes: Sequence[int | None] | None = None):
        arguments.validate_flags(auto_balance=auto_balance, rebalance=rebalance)
        arguments.validate_setting("micro_batches", micro_batches, arguments.MICRO_BATCHES_CHOICES)
        if profile_cache not in (None, False):
            raise ConfigError(
                f"profile_cache={profile_cache!r}: HeteroMultiWorkerMirroredStrategy calibrates during the first "
                f"training steps and caches nothing. Pass None or False.")
        from_launch = os.environ.get(EMULATE_ENV_VAR, "").strip()
        source = "emulate"  # where the names came from, for the errors below
        if emulate is None and from_launch:  # one entry per worker; several local replicas joined by "+"
            source = f"{EMULATE_ENV_VAR}={from_launch!r} (set by hetero-cs launch --emulate; emulate=None)"
            emulate = _names_per_worker(from_launch, source)
        elif emulate is not None and from_launch:
            given = [spec.name for spec in emulate.specs] if hasattr(emulate, "specs") else emulate
            logger.warning(
                "hetero_cs: emulate=%r given in the script wins over %s=%r (hetero-cs launch --emulate); drop one of "
                "them.", given, EMULATE_ENV_VAR, from_launch)
        if not os.environ.get("TF_CONFIG", "").strip():
            logger.warning(
                "hetero_cs: TF_CONFIG is not set, so this process is a cluster of one worker. Start every worker "
                "with its TF_CONFIG, or on one machine: hetero-cs launch --workers N -- python your_script.py")
        from hetero_cs.devices import emulation

        if emulate is not None and not isinstance(emulate, (list, tuple, emulation.Emulator)):
            raise ConfigError(
                f"HeteroMultiWorkerMirroredStrategy(emulate=...) takes catalog device names (a list of str, one per "
                f"replica of the cluster) or a hetero_cs.emulation.Emulator, not {type(emulate).__name__}. "
                f"Received: emulate={emulate!r}.")
        if isinstance(emulate, (list, tuple)) and any(isinstance(n, str) and "+" in n for n in emulate):
            raise ConfigError(
                f"emulate={list(emulate)!r}: in a script, emulate= is a flat list of catalog names for all replicas, "
                f"in task-index then local order (e.g. ['A10', 'T4', 'P100', 'T4'] for 2 workers of 2); the A10+T4 "
                f"form is for hetero-cs launch --emulate and HETERO_CS_EMULATE.")
        try:
            emulator, emulate = arguments.emulation_names(emulate)
        except HeteroCSError as exc:
            if source == "emulate":
                raise
            raise type(exc)(f"{source}: {exc}") from None
        # MultiWorkerMirroredStrategy must be built before TensorFlow initialises (it configures collective ops):
        # nothing above touches TensorFlow's runtime, and the Keras patches are installed after.
        local_replicas = 1 if emulate is None else _emulated_local_replicas(len(emulate), source)
        if local_replicas > 1:  # several emulated devices per worker: one logical CPU device per local replica
            setup_worker_replica_cpus(local_replicas)
        with _compat.local_cpu_replicas(local_replicas):
            super().__init__(communication_options=communication_options)
        _compat.install()
        setattr(self, _compat.MULTI_WORKER_MARKER, True)
        _compat.skip_partial_batch_agreement(self)  # every worker reads the same batches: no per-step "has data?"

        R = self.num_replicas_in_sync
        self._num_local = len(self.extended.worker_devices)
        self._first_replica = _compat.id_in_cluster(self) * self._num_local
        shares = None if batch_split is None else arguments.checked_shares(batch_split, R)
        if emulate is not None and len(emulate) != R:
            raise ConfigError(
                f"{source} names one catalog device per replica of the whole cluster, in task-index order: "
                f"{len(emulate)} names, num_replicas_in_sync={R} ({R // self._num_local} workers x "
                f"{self._num_local} local replicas). Give exactly {R} names.")
        self._emulator = None if emulate is None else emulator or emulation.Emulator(list(emulate))
        if emulate is not None:
            # An Emulator is not sent between workers: each worker builds its own from the same script, applies
            # only its own replicas' waits and drifts (cluster replica ids), and sets the time scale from the first
            # global batch, which is the same on every worker.
            local = list(emulate)[self._first_replica:self._first_replica + self._num_local]
            logger.warning(
                "hetero_cs: timings are EMULATED - this worker's replicas %s emulate %s (real compute on the CPU "
                "plus each named device's modelled step time); no GPU is used.",
                list(range(self._first_replica, self._first_replica + self._num_local)), local)
        self._balancer = Balancer(R, auto_balance=auto_balance, rebalance=rebalance, shares=shares)
        self._agreed = bool(auto_balance) and shares is None and R > 1  # the chief decides every step
        self._planner = ClusterPlanner(self._balancer, calibrate=self._agreed)
        self._timing = self._agreed or self._emulator is not None
        self._lock = threading.Lock()
        self._start_agreement()
        self._time_scale_set = False
        self._fit_stats = None  # the last fit's figures (MultiWorkerCallback)
        from hetero_cs.engine.multi_worker.micro_batches import MultiWorkerMicroBatches, checked_caps

        # Not named _micro_batching: _compat reads that name as the central-storage strategy's micro-batching.
        self._micro_slices = MultiWorkerMicroBatches(self, micro_batches, checked_caps(max_batch_sizes, R),
                                                     restart_caps=_restart_caps(R))

    # ----------------------------------------------------------------------------------------------------------
    # Public state
    # ----------------------------------------------------------------------------------------------------------
    @property
    def micro_batching(self):
        """This strategy's micro-batched slices (:class:`hetero_cs.engine.multi_worker.micro_batches.MultiWorkerMicroBatches`):
        ``max_batch_sizes`` (the caps in force), ``active`` and ``last_plan`` (each replica's micro-batch size and
        count in the last step)."""
        return self._micro_slices

    @property
    def is_chief(self) -> bool:
        """True on the worker that holds replica 0 and decides the plan."""
        return self._first_replica == 0

    @property
    def agreed(self) -> bool:
        """True when the chief decides the split through the agreement (auto_balance without a fixed batch_split,
        R > 1)."""
        return self._agreed

    @property
    def last_split(self) -> tuple[int, ...] | None:
        """The per-replica batch sizes of the last step this worker cut (agreed or held; the same on every worker),
        None before the first step."""
        return self._last_split

    @property
    def calibrating(self) -> bool:
        """On the chief: True while it still serves probe splits (auto_balance, before the fit). False elsewhere."""
        return self.is_chief and self._planner.calibrating

    def prepare_emulation(self, model) -> None:
        """Sizes the emulated devices for ``model`` (its FLOPs and parameter bytes); fit/evaluate/predict call it.

        Custom loops call it once, with the built model, before the first ``strategy.run``. No-op without
        emulation.
        """
        if self._emulator is None or self._emulator.workload is not None:
            return
        from calibration.workload import estimate_workload

        self._emulator.set_workload(estimate_workload(model))

    def _prepare_idle_replicas(self, model, keras_train_step) -> None:
        """Before ``fit``: plans may leave a card out where a replica of ``model`` with 0 examples skips its
        forward and backward pass (Keras' own ``train_step``, :func:`hetero_cs.engine.step.idle_replicas.
        multi_worker_skips`); elsewhere an idle replica still pays its fixed cost, and plans price it. Then the
        memory caps for ``model`` and whether its slices run as micro-batches (:mod:`hetero_cs.engine.
        multi_worker_micro`)."""
        from hetero_cs.engine._compat import replica_xla

        skips = getattr(type(model), "train_step", None) is keras_train_step and replica_xla.multi_worker_skips(model)
        self._balancer.set_idle_replicas_free(skips)
        self._micro_slices.prepare(model, keras_train_step)

    # ``_out_of_memory_here(verb, exc, replica_scopes, model=None)``: the ClusterOutOfMemory for ``exc`` on this
    # worker, or None (read by Keras' wrapped fit, evaluate and predict, which cannot import this package).
    _out_of_memory_here = out_of_memory_here

    def _ensure_time_scale(self, global_batch_size: int) -> None:
        """Emulation: the time scale comes from the first global batch (the same on every worker)."""
        if self._emulator is None or self._time_scale_set:
            return
        with self._lock:
            if not self._time_scale_set:
                if self._emulator.workload is None:
                    raise ConfigError(
                        "Emulated devices need the model's size before the first step. fit/evaluate/predict do "
                        "this for you; in a custom loop call strategy.prepare_emulation(model) first.")
                self._emulator.calibrate_time_scale(
                    global_batch_size, target_makespan_s=arguments.emulated_makespan_target_s())
                self._time_scale_set = True

    def _on_replica_gradients(self, grads: list) -> list:
        """Replica context, gradients ready, before the all-reduce: the step's end (emulated wait, time)."""
        step = replica_state.current_replica_step()
        if step is None or step.start_stamp is None:
            return grads
        from hetero_cs.devices.step_clock import finish_replica_step

        return finish_replica_step(
            grads, step.start_stamp, replica_id=step.replica_id, batch_size=step.batch_size,
            emulator=None if step.waited_per_micro_batch else self._emulator, record=self._record_step_time)

    def _keras_callbacks(self, callbacks):
        from hetero_cs.engine.multi_worker.callback import MultiWorkerCallback

        if hasattr(callbacks, "callbacks"):  # a keras.callbacks.CallbackList: the caller built it, keep it
            return callbacks
        callbacks = list(callbacks or [])
        return callbacks if any(isinstance(c, MultiWorkerCallback) for c in callbacks) else [
            MultiWorkerCallback(self), *callbacks]


def cluster_workers() -> int:
    """The number of workers (chief included) that ``TF_CONFIG`` names; 1 without ``TF_CONFIG``."""
    if not os.environ.get("TF_CONFIG", "").strip():
        return 1
    spec = tf.distribute.cluster_resolver.TFConfigClusterResolver().cluster_spec().as_dict()
    return max(1, sum(len(spec.get(job, ())) for job in ("chief", "worker")))


def _names_per_worker(text: str, source: str) -> list[str]:
    """``HETERO_CS_EMULATE``'s entries (one per worker, ``+`` between a worker's devices) as a flat list, checked
    against the workers in ``TF_CONFIG``: an entry per worker, the same number of devices in each."""
    groups = [[name.strip() for name in entry.split("+")] for entry in text.split(",")]
    workers = cluster_workers()
    sizes = [len(group) for group in groups]
    if "+" in text and (len(groups) != workers or len(set(sizes)) != 1):
        raise ConfigError(
            f"{source} gives {len(groups)} worker entries of {sizes} devices, but TF_CONFIG names {workers} "
            f"worker(s): give one entry per worker, comma-separated, each with the same number of devices joined by "
            f"+ (e.g. A10+T4,P100+T4 for 2 workers of 2 replicas).")
    return [name for group in groups for name in group]


def _emulated_local_replicas(num_names: int, source: str) -> int:
    """Local replicas per worker when ``num_names`` emulated devices are spread over the cluster's workers."""
    workers = cluster_workers()
    if num_names % workers:
        raise ConfigError(
            f"{source} names {num_names} emulated devices for {workers} workers: every worker runs the same number "
            f"of replicas (MultiWorkerMirroredStrategy's rule), so give a multiple of {workers}, in task-index then "
            f"local order (e.g. 2 per worker: ['A10', 'T4', 'P100', 'T4'] for workers [A10, T4] and [P100, T4]).")
    per_worker = num_names // workers
    if per_worker > MAX_EMULATED_REPLICAS_PER_WORKER:
        raise ConfigError(
            f"{source} gives each of {workers} worker(s) {per_worker} emulated replicas; at most "
            f"{MAX_EMULATED_REPLICAS_PER_WORKER} per worker process are supported (more stalled in testing: their "
            f"emulated waits block beside the CPU collectives). Use more workers (hetero-cs launch --workers) with "
            f"fewer devices each.")
    return per_worker


def _restart_caps(num_replicas: int) -> list[int | None] | None:
    """The caps ``HETERO_CS_MAX_BATCH_SIZES`` holds (set by ``hetero-cs launch`` when it relaunches a job after an
    out-of-memory error, :mod:`hetero_cs.engine.multi_worker.oom`), or None when it is not set.

    Raises:
        ConfigError: Not one integer >= 0 or ``none`` per replica.
    """
    from hetero_cs.planning.restart_caps import CAPS_ENV_VAR, parse_caps

    text = os.environ.get(CAPS_ENV_VAR, "").strip()
    if not text:
        return None
    caps = parse_caps(text, num_replicas)
    logger.warning("hetero_cs: memory caps lowered to %s=%s (hetero-cs launch sets it when it relaunches a job after "
                   "a replica ran out of memory).", CAPS_ENV_VAR, text)
    return caps
