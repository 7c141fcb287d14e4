"""HeteroCentralStorageStrategy: central storage with plan-sized, exactly weighted replica slices.

A thin adapter between tf.distribute's hooks and the plan lifecycle: the split itself (chosen, served, watched,
re-planned, guarded) lives in :class:`hetero_cs.planning.balancer.Balancer`; cutting global batches in
:mod:`hetero_cs.engine.step.input_slicing`; clocks and emulated waits in :mod:`hetero_cs.devices.step_clock`; the
private TensorFlow/Keras touches in :mod:`hetero_cs.engine._compat`.
"""

import collections
import functools
import logging
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from hetero_cs.engine import _compat, arguments, calibrating
from hetero_cs.engine.callbacks import with_balance_callback
from hetero_cs.engine.faults import supervised_run
from hetero_cs.engine.faults.backup import with_backup
from hetero_cs.engine.faults.failover import check_setting
from hetero_cs.engine.idle_probes import IdleProbes
from hetero_cs.engine.memory.micro_batches import MicroBatching
from hetero_cs.engine.memory.oom_recovery import StepRecovery, strategy_step_error
from hetero_cs.engine.packed_values import PackedBatchValues
from hetero_cs.engine.replica_wrapping import wrap_replica_fn
from hetero_cs.engine.step import replica_state
from hetero_cs.engine.step.idle_replicas import ActiveSets, served_sizes
from hetero_cs.engine.step.input_roles import InputRoles
from hetero_cs.engine.step.input_slicing import PlanSlicer, bad_batch_error
from hetero_cs.engine.step.step_errors import EmptySliceNotes, raised_by_input_pipeline
from hetero_cs.engine.strategy_state import StrategyState
from hetero_cs.errors import ConfigError
from hetero_cs.planning.balancer import Balancer
from hetero_cs.planning.cost_model import CostModel
from hetero_cs.planning.guard import GuardPolicy
from hetero_cs.planning.plan import BatchPlan

logger = logging.getLogger(__name__)


class HeteroCentralStorageStrategy(
    _compat.DeepcopiedStrategy, _compat.ReplicaCountStrategy, PackedBatchValues, StrategyState,
    tf.distribute.experimental.CentralStorageStrategy):
    """Central-storage data parallelism whose per-replica slices are sized by a plan, with exact weighting.

    Variables live once on the parameter device (host memory). Each step, every global batch of ``B`` examples is
    cut into contiguous slices ``b_1..b_R`` by the current :class:`~hetero_cs.BatchPlan`; replica ``i`` computes
    its gradient on its ``b_i`` examples with its loss weighted by ``b_i / B``, and the host sums the gradients. One
    step on any split therefore equals one single-device step on the whole batch (loss, gradients, optimizer state,
    metrics). See :mod:`hetero_cs.engine.step.replica_state` for the worked number.

    How the plan is chosen:
      * ``batch_split=[2, 1, 1]``: fixed relative shares, no calibration.
      * ``auto_balance=False`` without ``batch_split``: an even split (``B // R`` each, the first ``B % R`` replicas
        one more).
      * ``auto_balance=True`` (default): ``model.fit`` calibrates on the first global batch it sees (or loads a
        cached profile) and solves the minimum-makespan split; custom loops call :meth:`calibrate` once. Until
        then the split is even, and it stays even when the solved split is predicted less than
        ``MIN_PREDICTED_GAIN`` (2 %) faster: such ties are decided by calibration noise.
      * ``rebalance=True`` (default, with auto_balance): per-replica step times are measured during training and
        the plan is re-solved when a device drifts (deadband and cooldown in :class:`~hetero_cs.RebalancePolicy`).

    Examples:
        >>> strategy = hetero_cs.HeteroCentralStorageStrategy(auto_balance=True)  # doctest: +SKIP
        >>> with strategy.scope():  # doctest: +SKIP
        ...     model = keras.Sequential([...])
        ...     model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        >>> model.fit(x, y, batch_size=256, epochs=5)  # doctest: +SKIP

    Args:
        compute_devices: Devices that run replicas, e.g. ``["/gpu:0", "/gpu:1"]``. Default: every GPU; with no GPU,
            every logical CPU device except the parameter device (see :func:`hetero_cs.emulation.setup_logical_devices`).
        parameter_device: Where the variables live. Default ``"/device:CPU:0"`` (host memory).
        auto_balance: Calibrate and solve the split (True), or split evenly (False).
        rebalance: Re-plan online when measured step times drift (only with auto_balance).
        batch_split: Fixed relative shares per replica, length R, finite, >= 0, not all zero; overrides
            auto_balance.
        emulate: Catalog device names, one per compute device (e.g. ``["A10", "T4", "P100"]``), or a
            :class:`hetero_cs.emulation.Emulator` (for drift or a fixed time scale): each replica then also waits for
            the time that device would take. With ``compute_devices=None`` the logical CPU devices
            are created for you (this must happen before TensorFlow initialises).
        profile_cache: Calibration profile cache: None for the default directory (``$HETERO_CS_CACHE_DIR``, else
            ``~/.cache/hetero_cs``), a directory path, a ``calibration.ProfileStore``, or False for no cache.
        guard: With auto_balance, keep a calibrated or re-planned split only after it measured faster than the
            split it replaces, side by side over the same steps (:mod:`hetero_cs.planning.guard`); else revert and
            back off. It also measures a plan against the fastest card alone where the plan measures slower than
            predicted or than that card's predicted time alone, and an overlapped micro-batched plan against the
            plan it replaces. False trusts the prediction; a :class:`hetero_cs.GuardPolicy` turns it on with its
            own thresholds (e.g. ``GuardPolicy(alone_check_margin=0.1)``).
        profile: A profile file written by ``hetero-cs calibrate --model package.module:function --output PATH``
            for these devices and this model: its cost models and memory caps are used instead of calibrating
            (read and checked here; see :func:`hetero_cs.engine.calibrating.load_profile`).
        oom_recovery: In ``model.fit``, a replica that runs out of memory (``tf.errors.ResourceExhaustedError``, or
            another form a GPU raises it in: :mod:`hetero_cs.devices.device_errors`) gets a lower cap and the same
            global batch is retried with a plan solved within the caps, a bounded number of times
            (:mod:`hetero_cs.engine.memory.oom_recovery`); caps grow back slowly. False: the error ends
            ``fit`` as before. A :class:`hetero_cs.planning.memory_caps.MemoryRecoveryPolicy` turns it on with
            that policy (back-off, retries, growth). Needs ``steps_per_execution=1`` (the default) and R >= 2.
            None (the default): on where a step can run out of memory - GPUs, and emulated devices whose least
            memory cannot hold the whole global batch - since keeping the batch in hand for a retry costs about
            1 ms of host time per step; True: on everywhere.
        fused_update: Compile the optimizer's update on the parameter device with XLA, as one function per trace
            (:mod:`hetero_cs.engine.step.fused_update`): it runs on the host between every two steps, and fused it took
            about 40 % less time for an MLP's Adam on a CPU host. None (the default): for Keras' own optimizers
            with dense gradients; True: for any optimizer (one whose update XLA cannot compile then fails at its
            first step); False: never. Never for eager steps (``run_eagerly=True``).
        micro_batches: Where memory caps bind, ``model.fit`` trains each global batch as sub-steps
            (micro-batches), exactly (:mod:`hetero_cs.engine.memory.micro_batches`). None (the default): where that is exact
            and predicted faster, or the batch does not fit in one step; True: also for BatchNormalization in training
            (per-micro-batch statistics, logged); False: never (today's caps bound each replica's slice).
        on_device_error: In ``model.fit``, what a device error (a failing card: an ECC error, an illegal address, a
            card off the bus; not out of memory, not a program error) does: ``"exclude"`` (the default) retries the
            same global batch once, then sets that card aside (0 examples from then on) and retries it on the
            others, exactly; ``"raise"`` ends ``fit`` with :class:`hetero_cs.errors.DeviceFaultError`. The rule
            that tells the two apart: :mod:`hetero_cs.engine.faults.failover`.

    Raises:
        DeviceError: Empty, unparsable, unknown or repeated device names, or the parameter device among the compute
            devices.
        BatchSplitError: ``batch_split`` of the wrong length, with negative, non-finite or only zero shares.
        UnknownEmulatedDeviceError: An ``emulate`` name is not in the catalog.
        ConfigError: ``emulate`` of the wrong length; a ``profile`` of other devices, or with batch_split or
            auto_balance=False; ``fused_update`` or ``micro_batches`` not None or a bool; ``on_device_error`` not
            ``"exclude"`` or ``"raise"``.
        ProfileCacheError: ``profile`` cannot be read or is not a profile.
    """

    def __init__(
        self, compute_devices: Sequence[str] | None = None, parameter_device: str | None = None, *,
        auto_balance: bool = True, rebalance: bool = True, batch_split: Sequence[float] | None = None,
        emulate: "Sequence[str] | Any | None" = None, profile_cache: Any = None, guard: "bool | Any" = True,
        profile: Any = None, oom_recovery: "bool | Any | None" = None, fused_update: bool | None = None,
        micro_batches: bool | None = None, on_device_error: str = "exclude"):
        guard_policy = guard if isinstance(guard, GuardPolicy) else None  # on, with its own thresholds
        guard = True if guard_policy is not None else guard
        arguments.validate_flags(auto_balance=auto_balance, rebalance=rebalance, guard=guard)
        emulator, emulate = arguments.emulation_names(emulate)
        # Restarted by `hetero-cs run` without a lost emulated card (HETERO_CS_EXCLUDED_DEVICES).
        emulator, emulate, compute_devices, batch_split = supervised_run.leave_out_excluded(
            emulator, emulate, compute_devices, batch_split)
        if emulate is not None and compute_devices is None:
            from hetero_cs.devices.logical import setup_logical_devices

            compute_devices = setup_logical_devices(list(emulate))
        parameter_device = arguments.canonical_device(parameter_device or "/device:CPU:0")
        devices = arguments.checked_devices(compute_devices, parameter_device)
        if emulate is not None and len(emulate) != len(devices):
            raise ConfigError(f"emulate names one catalog device per compute device: len(emulate)={len(emulate)}, "
                              f"compute_devices={devices} (R={len(devices)}). Give exactly {len(devices)} names.")
        arguments.validate_profile_cache(profile_cache)
        memory_policy = arguments.memory_policy(oom_recovery)
        arguments.validate_setting("fused_update", fused_update, "None (the default: Keras' own optimizers), True "
                                   "or False (False runs the optimizer's update without XLA)")
        arguments.validate_setting("micro_batches", micro_batches, arguments.MICRO_BATCHES_CHOICES)
        check_setting(on_device_error)
        batch_split = supervised_run.shares_without_lost_gpus(batch_split, len(devices), emulate is not None)
        shares = None if batch_split is None else arguments.checked_shares(batch_split, len(devices))
        if profile is not None:
            profile = calibrating.load_profile(profile, devices, emulate, auto_balance=auto_balance and shares is None)

        _compat.install()
        # Strategy.__init__ (public class) with our extended object; CentralStorageStrategy.__init__ would build the
        # stock one, and it only adds a usage gauge on top of this.
        extended = _compat.HeteroExtended(self, compute_devices=devices, parameter_device=parameter_device)
        tf.distribute.Strategy.__init__(self, extended)
        setattr(self, _compat.STRATEGY_MARKER, True)

        self._compute_devices = tuple(devices)
        self._parameter_device = parameter_device
        if emulator is None and emulate is not None:
            from hetero_cs.devices.emulation import Emulator

            emulator = Emulator(list(emulate))
        self._emulator = emulator
        if emulator is not None:
            logger.warning(
                "hetero_cs: timings are EMULATED - replicas %s emulate %s on logical CPU devices (real compute on "
                "the CPU plus each named device's modelled step time); no GPU is used.", list(devices),
                [spec.name for spec in emulator.specs])
        if len(devices) == 1 and auto_balance and shares is None:
            warnings.warn(f"HeteroCentralStorageStrategy has one compute device ({devices[0]}): there is nothing to "
                          f"balance. Add GPUs, or pass emulate=['A10', 'T4', ...] on a CPU-only machine.", stacklevel=2)
        self._profile_cache = profile_cache
        self._fused_update = fused_update
        self._micro_batching = MicroBatching(self, micro_batches)  # sub-steps where memory caps bind
        self._fit_stats = None  # the last fit's figures (BalanceCallback)
        self._profile = profile  # a calibration.CalibrationResult used instead of calibrating, or None
        self._lock = threading.RLock()
        self._resume_skip = 0  # batches of the resumed epoch already applied before a restart (engine.backup)
        self._source_dataset = None  # the last training input (calibration reads its first batch)
        self._input_roles = InputRoles()  # which inputs feed training steps (fit, evaluate and predict set it)
        self._first_batches = _compat.FirstBatchReader()  # calibration's read-ahead, rewound for training
        self._calibration = None
        self._calibrated_fingerprint: str | None = None
        self._models_set_by_user = False  # set_cost_models: calibration keeps those models unless forced
        self._last_logged_plan: BatchPlan | None = None
        # Errors raised inside the input pipeline, kept until the step that reads their batch fails on them. The
        # pipeline prefetches and runs on TensorFlow's threads, maybe while another entry point (an evaluate run by a
        # fit callback) distributes its own input, so they are matched by the error TensorFlow raised, not cleared.
        self._input_errors: collections.deque = collections.deque(maxlen=16)
        self._empty_slices = EmptySliceNotes()  # cuts that gave a replica 0 examples, warned once per size
        # Without auto-balancing nothing changes the plan between batches, so full global batches take their sizes
        # from a copy of the plan in the graph instead of a Python call each (see hetero_cs.engine.step.input_slicing).
        self._slicer = PlanSlicer(
            len(devices), self._slice_sizes, check_batch=self._check_batch, device=parameter_device,
            cacheable=not (bool(auto_balance) and shares is None))
        # The sets of active replicas plans use; a step gets a branch for each (hetero_cs.engine.step.idle_replicas). A 0
        # share idles its replica in every plan: known before any step is traced.
        self._active_sets = ActiveSets(len(devices))
        self._active_sets.note([int(share > 0) for share in shares or ()], training=True)
        self._idle_probes = IdleProbes(self)  # probes of idle cards, beside training
        self._balancer = Balancer(
            len(devices), auto_balance=auto_balance, rebalance=rebalance, shares=shares, guard=guard,
            guard_policy=guard_policy, on_plan=self._on_plan, memory_policy=memory_policy, idle_replicas_free=True,
            on_trial=lambda plan: self._active_sets.note(plan.per_replica_batch_sizes, training=True),
            idle_prober=self._idle_probes.start)
        self._step_recovery = (StepRecovery(self, always=oom_recovery is not None, memory=oom_recovery is not False,
                                            on_device_error=on_device_error) if len(devices) > 1 else None)
        # Sampled timing when only the balancer needs the times (each step's plan says whether it is timed), on
        # emulated devices as on real ones: an emulated step waits out its device's time every step, timed or not
        # (its clock runs on untimed steps too, step_clock.sampled_wall_clock_stamp), and without the balancer its
        # every step is timed. HETERO_CS_TIMING=1 asks for every step.
        every_step = arguments.env_flag("HETERO_CS_TIMING")
        self._timing_enabled = bool(self._balancer.timing_needed or every_step or emulator is not None)
        self._sampled_timing = bool(self._balancer.timing_needed and not every_step)

    # ----------------------------------------------------------------------------------------------------------
    # Public state
    # ----------------------------------------------------------------------------------------------------------
    def set_cost_models(self, cost_models: Sequence[CostModel], *,
                        max_batch_sizes: Sequence[int | None] | None = None) -> None:
        """Replaces the per-replica cost models (and memory caps) and re-solves the plan, at once (no guard trial).

        Models set here are kept: ``model.fit`` then does not calibrate over them (``calibrate(..., force=True)``
        calibrates, or loads this model's cached calibration on these devices, and replaces them). The re-planner
        still corrects them from measured step times. :attr:`calibration` is None from here on: no calibration
        describes these models.

        Args:
            cost_models: One per replica, in replica-id order.
            max_batch_sizes: Per-replica caps in examples (None entries: uncapped).

        Raises:
            ConfigError: Wrong number of cost models or caps.
        """
        self._balancer.set_cost_models(cost_models, max_batch_sizes=max_batch_sizes)
        self._models_set_by_user = True  # fit's calibration keeps them (hetero_cs.engine.calibrating)
        self._calibration = None  # a calibration no longer describes the models in force

    def set_batch_split(self, shares: Sequence[float] | None) -> None:
        """Fixes the relative shares per replica from now on (None: back to auto_balance / even split).

        Args:
            shares: Length R, finite, >= 0, not all zero; e.g. ``[2, 1, 1]``.

        Raises:
            BatchSplitError: Wrong length, negative, non-finite or all-zero shares.
        """
        shares = None if shares is None else arguments.checked_shares(shares, self.num_replicas_in_sync)
        self._balancer.set_batch_split(shares)
        self._active_sets.note([int(share > 0) for share in shares or ()], training=True)

    def plan_for(self, global_batch_size: int) -> BatchPlan:
        """Returns the plan used for a global batch of ``global_batch_size`` examples (solved once, then cached).

        The first (largest) global batch size seen becomes the reference whose plan is :attr:`plan`; a last partial
        batch ``B' < B`` gets a plan solved for ``B'`` and is weighted by ``B'``.

        Raises:
            ConfigError: ``global_batch_size`` < 1.
        """
        return self._balancer.plan_for(global_batch_size)

    def _log_plan_if_new(self) -> None:
        plan = self.plan
        if plan is not None and plan != self._last_logged_plan:
            self._last_logged_plan = plan
            candidate = self._balancer.guard.candidate
            trying = f" (in force while the guard tries {list(candidate.per_replica_batch_sizes)})" if candidate else ""
            logger.info("hetero_cs batch plan%s:\n%s", trying, plan)

    def _on_plan(self, plan: BatchPlan) -> None:
        # The balancer's new training plan (under its lock): cached for full batches; its active set gets a branch.
        self._slicer.publish(plan)
        self._active_sets.note(plan.per_replica_batch_sizes, training=True)

    def _check_batch(self, *leading_dims) -> np.ndarray:
        # Called from the tf.data pipeline (numpy_function) for a global batch whose components disagree in size or
        # hold 0 examples (hetero_cs.engine.step.input_slicing). The error would reach the user wrapped in TensorFlow's;
        # it is kept on the strategy so that model.fit re-raises it as is.
        error = bad_batch_error(leading_dims)
        self._input_errors.append(error)
        raise error

    def _slice_sizes(self, global_batch_size, *, training: bool = True, traced=None) -> np.ndarray:
        # Called when a step starts (numpy_function, before any replica runs) unless the cached plan covers it
        # (hetero_cs.engine.step.input_slicing); `training` False: evaluate/predict; `traced`: the step's sets of active
        # replicas. Returns the sizes and whether to time the step. An error is kept for model.fit to re-raise.
        try:
            plan = self._balancer.serve(int(global_batch_size), training=training)
            timed = not self._sampled_timing or (training and self._balancer.timing_due())
            caps = self._balancer.max_batch_sizes or ()
            sizes = served_sizes(plan.per_replica_batch_sizes, traced, [i for i, cap in enumerate(caps) if cap == 0])
            if 0 in plan.per_replica_batch_sizes:
                self._empty_slices.note(plan, sizes)
                self._active_sets.note(plan.per_replica_batch_sizes, training=training)
            if plan is self._balancer.plan:
                # The plan in force: later full batches may read it from the graph, unless its set of active replicas
                # has no branch in this step (it runs as a superset, cut here step by step: read from the graph, its
                # idle replicas would run on 0-example slices in branch 0).
                self._slicer.publish(plan if sizes == tuple(plan.per_replica_batch_sizes) else None)
            return np.asarray([*sizes, int(timed)], dtype=np.int64)
        except Exception as exc:
            error = self._micro_batching.explained(exc, training=training)  # exc, or one saying why
            self._input_errors.append(error)
            raise error from (None if error is exc else exc)

    # ----------------------------------------------------------------------------------------------------------
    # Input
    # ----------------------------------------------------------------------------------------------------------
    def experimental_distribute_dataset(self, dataset, options=None):
        """Distributes a dataset of global batches, cutting each by the current plan.

        Every element of ``dataset`` is one global batch (``B`` examples along the first axis of every component);
        replica ``i`` receives examples ``[sum(b_<i), sum(b_<=i))`` of it, so every example is used exactly once and
        ``predict`` outputs come back in order. A last partial batch is split by a plan solved for its own size.
        The cut is decided when the step starts, so a plan change applies to the very next step and never retraces
        it.

        The global batch stays whole in host memory until ``strategy.run`` cuts it (one ``split`` op per component
        on the host); each replica's ops then copy only its own slice to its device. ``experimental_local_results``
        of an element returns the ``R`` slices by the plan in force, as for stock per-replica values. ``options``
        (``tf.distribute.InputOptions``) are accepted for compatibility; their device-placement and per-replica
        buffer settings do not apply to this host-side cut and are ignored with a warning.

        Raises:
            InputError: A component has no batch dimension, or is a ``tf.SparseTensor``.
        """
        return self.distribute_datasets_from_function(lambda _: dataset, options)

    def _distribute(self, dataset):
        """A new training input's first global batch sets the reference size of :attr:`plan` (it may differ from the
        last); an evaluation or prediction input (:mod:`hetero_cs.engine.step.input_roles`) leaves training's plans alone."""
        training = self._input_roles.claim_input()
        with self._lock:
            if training:
                self._source_dataset = dataset
                self._balancer.start_new_input()
                self._slicer.publish(None)  # the new input's first batch sets the reference again
        return _compat.distribute_on_host(self, self._slicer.pack(dataset), source=dataset)

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        """Like ``tf.distribute``'s, but ``dataset_fn``'s dataset yields global batches that are cut by the plan.

        ``dataset_fn`` is called once with an ``InputContext`` for one pipeline and one replica, so
        ``input_context.get_per_replica_batch_size(B)`` returns ``B``: batch by the global batch size.
        """
        context = tf.distribute.InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=1)
        arguments.warn_unused_input_options(options)
        return self._distribute(dataset_fn(context))

    # ----------------------------------------------------------------------------------------------------------
    # Replica steps
    # ----------------------------------------------------------------------------------------------------------
    # Wraps a replica function so it knows its slice size b_i, the global batch B, its start time and its call's
    # handoff.
    _wrap_replica_fn = wrap_replica_fn
    # Writes the caps in force back to the profile cache entry the calibration came from (out-of-memory recovery).
    _write_back_caps = calibrating.write_back_caps
    # The library's error for TensorFlow's error from a step, or None.
    _replica_step_error = strategy_step_error

    def _emulation_pending(self) -> bool:
        """Whether the emulated devices still wait for the model's size (emulation, before calibration)."""
        return self._emulator is not None and getattr(self._emulator, "workload", None) is None

    def _on_replica_gradients(self, grads: list) -> list:
        """Called in replica context when a replica's gradients are ready: copies them to the host, where the
        replica's step ends (:func:`hetero_cs.devices.step_clock.finish_replica_step`)."""
        step = replica_state.current_replica_step()
        if step is None or step.start_stamp is None:
            return grads
        from hetero_cs.devices.step_clock import finish_replica_step

        sub_step, record, batch_size = step.sub_step, self._record_step_time, step.batch_size
        if sub_step is not None:
            # A micro-batch of an overlapped call is not a step the monitor could pair with the others' (each
            # replica runs a different number of them): its time goes to the call's report, which the engine
            # hands to the monitor as one step after the call (MicroBatching). Emulated cards end (and report)
            # each micro-batch, whose waits need it; on real devices a card's chain ends at its last micro-batch.
            count = 1  # an emulated card ends each micro-batch
            if self._emulator is None:
                if sub_step.index != sub_step.last_of.get(step.replica_id):
                    return grads  # a middle micro-batch: no clock
                batch_size, count = sub_step.chain_sizes[step.replica_id], sub_step.counts[step.replica_id]
            record = None if sub_step.record is None else functools.partial(sub_step.record, count=count)

        idle = step.handoff.idle_reports if step.handoff is not None and sub_step is None else ()
        if idle and step.replica_id == min(set(range(len(self._compute_devices))) - set(idle)) and record is not None:
            record = functools.partial(self._record_step_time, idle=idle)  # the first active replica reports the idle
        return finish_replica_step(
            grads, step.start_stamp, replica_id=step.replica_id, batch_size=batch_size, emulator=self._emulator,
            record=record, sampled=step.sampled_timing, keyed=step.shared_start, host_device=self._parameter_device,
            # Its next micro-batch's clock starts where this one's stops (replica_wrapping): back to back, as a
            # card runs them, so the emulated waits of a card's micro-batches add up to its micro-batched time.
            end_stamps=None if sub_step is None else sub_step.end_stamps.setdefault(step.replica_id, []))

    def _record_step_time(self, replica_id: int, batch_size: int, step_time_s: float, *,
                          step_key: float | None = None, idle: tuple = ()) -> None:
        """Monitor callback (runs in a TensorFlow thread once per replica per step): records only. ``step_key``
        is the step's clock start (seconds), shared by its replicas: steps pair by it, also after a failed step.
        ``idle``: the replicas the step left idle, whose reports (0 examples, 0 s) go with this one."""
        self._balancer.record_step_time(int(replica_id), int(batch_size), float(step_time_s), step_key=step_key,
                                        idle_replicas=idle)

    def _record_step_end(self, start_s: float, step_time_s: float) -> None:
        """Called from a TensorFlow thread when the host's work on a step ended (its update): the step's makespan
        then includes the host tail (StepTimeMonitor.record_step_end)."""
        self._balancer.monitor.record_step_end(start_s, step_time_s)

    def _input_error_raised(self, exc: Exception) -> Exception | None:
        """The input pipeline's kept error that TensorFlow's ``exc`` is (no longer kept), else None: the step's own
        error, or one of a later, prefetched batch that is not this step's."""
        error = next((error for error in list(self._input_errors) if raised_by_input_pipeline(exc, error)), None)
        if error is not None:
            self._input_errors.remove(error)
        return error

    # ----------------------------------------------------------------------------------------------------------
    # Calibration
    # ----------------------------------------------------------------------------------------------------------
    def calibrate(self, model, data, *, force: bool = False, progress: bool = True):
        """Prepares balancing for ``model``: emulated device sizes, then (auto_balance) calibration and the plan.

        ``model.fit`` calls this for you on its first global batch. Custom loops call it once before the first
        ``strategy.run``. With the guard on, the calibrated plan is tried against the even split during the
        first training steps and kept only if it measured faster (:mod:`hetero_cs.planning.guard`).

        Args:
            model: A built Keras model created under ``strategy.scope()``.
            data: A ``tf.data.Dataset`` of global batches (its first element is used; the next iteration over
                this dataset object still starts with it, in its own shuffle order), or one global batch
                ``(x, y)`` / ``(x, y, sample_weight)``.
            force: Calibrate even if this model was already calibrated, or cost models were set with
                :meth:`set_cost_models` (the profile cache is still used).
            progress: Show Keras' progress bar while calibrating.

        Returns:
            The ``calibration.CalibrationResult``, or None when no calibration is needed (fixed or even split).

        Raises:
            InputError: The data holds no examples or only None components.
            ConfigError: auto_balance on data without labels.
            CalibrationError, CalibrationOOMError: From calibration.
        """
        result = calibrating.calibrate(self, model, data, force=force, progress=progress)
        reference = self._balancer.reference_batch_size
        # The guard may measure the fastest card alone at any time (when the plan in force measures slow): its
        # set of active replicas gets a branch before the step is traced (hetero_cs.engine.step.idle_replicas), so
        # that trial traces nothing again (a custom loop's step is traced once, after this call).
        alone = None if reference is None else self._balancer.fastest_alone_plan(reference)
        if alone is not None:
            self._active_sets.note(alone.per_replica_batch_sizes, training=True)
        return result

    def _fit_callbacks(self, model, callbacks, arguments=None):
        return with_backup(self, with_balance_callback(self, callbacks), arguments)
