"""HeteroCentralStorageStrategy: central storage with plan-sized, exactly weighted replica slices."""

from __future__ import annotations

import logging
import math
import numbers
import os
import threading
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from hetero_cs import _compat, training
from hetero_cs.cost_model import CostModel
from hetero_cs.errors import BatchSplitError, ConfigError, DeviceError, InputError, ReplicaStepError
from hetero_cs.input_slicing import PlanSlicer, is_unbatched_marker, unpack as unpack_slices
from hetero_cs.monitor import StepTimeMonitor
from hetero_cs.plan import BatchPlan, even_batch_split, plan_from_split, split_by_shares
from hetero_cs.rebalance import RebalancePolicy, Rebalancer
from hetero_cs.solver import solve_batch_split

logger = logging.getLogger(__name__)

_PARAMETER_DEVICE_DEFAULT = "/device:CPU:0"

MIN_PREDICTED_GAIN = 0.02
"""An auto-balanced plan replaces the even split only if it is predicted at least 2 % faster (noise margin)."""

_EMPTY_SLICE_ADVICE = (
    "Some TensorFlow kernels fail on 0-example inputs, e.g. Conv2D and SeparableConv2D on CPU with oneDNN ('input "
    "depth must be evenly divisible by filter depth'). To give every replica at least one example, make every "
    "global batch hold at least R examples: drop a last partial batch smaller than R (dataset.batch(B, "
    "drop_remainder=True), or fit on the first N - N % B examples), choose a global batch size B whose remainder "
    "N % B is 0 or at least R, and give no replica a 0 share in batch_split; or set TF_ENABLE_ONEDNN_OPTS=0 before "
    "TensorFlow is imported. An unsynchronized BatchNormalization would also average NaN moments from the empty "
    "slice into its moving statistics: use BatchNormalization(synchronized=True)."
)

REBALANCE_CHECK_INTERVAL_STEPS = 4
"""Online re-balancing looks at the monitor every 4 completed steps (``RebalancePolicy.check_interval_steps``).

A look costs about 0.4 ms of host CPU for 3 replicas; it runs in the input pipeline, beside the step. Every 4 steps
keeps that under 0.1 ms per step and delays a reaction to a drifting device by at most 3 steps."""


def _canonical_device(name: str) -> str:
    """'/cpu:1', 'CPU:1', '/job:localhost/replica:0/task:0/device:CPU:1' -> '/device:CPU:1'."""
    if not isinstance(name, str) or not name.strip():
        raise DeviceError(f"Device names must be non-empty strings. Received: device={name!r}.")
    text = name.strip()
    if not text.startswith("/"):
        text = "/device:" + text
    try:
        spec = tf.DeviceSpec.from_string(text)
    except ValueError as exc:
        raise DeviceError(
            f"Cannot parse device name {name!r}. Use names like '/device:GPU:0' or '/cpu:1'."
        ) from exc
    if spec.device_type is None or spec.device_index is None:
        raise DeviceError(
            f"Device name {name!r} needs a type and an index, like '/device:GPU:0' or '/cpu:1'."
        )
    return f"/device:{spec.device_type.upper()}:{spec.device_index}"


def _default_compute_devices(parameter_device: str) -> list[str]:
    gpus = [_canonical_device(d.name) for d in tf.config.list_logical_devices("GPU")]
    if gpus:
        return gpus
    cpus = [_canonical_device(d.name) for d in tf.config.list_logical_devices("CPU")]
    others = [d for d in cpus if d != parameter_device]
    return others or cpus[:1]


class HeteroCentralStorageStrategy(tf.distribute.experimental.CentralStorageStrategy):
    """Central-storage data parallelism whose per-replica slices are sized by a plan, with exact weighting.

    Variables live once on the parameter device (host memory). Each step, every global batch of ``B`` examples is
    cut into contiguous slices ``b_1..b_R`` by the current :class:`~hetero_cs.BatchPlan`; replica ``i`` computes
    its gradient on its ``b_i`` examples with its loss weighted by ``b_i / B``, and the host sums the gradients. One
    step on any split therefore equals one single-device step on the whole batch (loss, gradients, optimizer state,
    metrics). See :mod:`hetero_cs.training` for the worked number.

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

    Example:
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

    Raises:
        DeviceError: Empty, unparsable, unknown or repeated device names, or the parameter device among the compute
            devices.
        BatchSplitError: ``batch_split`` of the wrong length, with negative, non-finite or only zero shares.
        UnknownEmulatedDeviceError: An ``emulate`` name is not in the catalog.
        ConfigError: ``emulate`` of the wrong length.
    """

    def __init__(
        self,
        compute_devices: Sequence[str] | None = None,
        parameter_device: str | None = None,
        *,
        auto_balance: bool = True,
        rebalance: bool = True,
        batch_split: Sequence[float] | None = None,
        emulate: "Sequence[str] | Any | None" = None,
        profile_cache: Any = None,
    ):
        from hetero_cs import emulation

        emulator = None
        if isinstance(emulate, emulation.Emulator):
            emulator, emulate = emulate, [spec.name for spec in emulate.specs]
        if emulate is not None:
            names = None if isinstance(emulate, str) or not isinstance(emulate, Iterable) else list(emulate)
            if not names:
                raise ConfigError(
                    f"emulate must be a non-empty list of catalog names, one per compute device. Received: "
                    f"emulate={emulate!r}. Example: emulate=['A10', 'T4', 'P100']."
                )
            emulate = names
            for name in emulate:
                emulation.get_device_spec(name)  # UnknownEmulatedDeviceError with the known names
            if compute_devices is None:
                compute_devices = emulation.setup_logical_devices(list(emulate))
        parameter_device = _canonical_device(parameter_device or _PARAMETER_DEVICE_DEFAULT)
        if compute_devices is None:
            compute_devices = _default_compute_devices(parameter_device)
        if isinstance(compute_devices, str):
            compute_devices = [compute_devices]
        devices = [_canonical_device(d) for d in compute_devices]
        self._validate_devices(devices, parameter_device)
        if emulate is not None and len(emulate) != len(devices):
            raise ConfigError(
                f"emulate names one catalog device per compute device: len(emulate)={len(emulate)}, "
                f"compute_devices={devices} (R={len(devices)}). Give exactly {len(devices)} names."
            )
        _validate_profile_cache(profile_cache)
        if batch_split is not None:
            shares = _shares_list(batch_split)
            if len(shares) != len(devices):
                raise BatchSplitError(
                    f"batch_split has one share per replica: len(batch_split)={len(shares)}, but there are "
                    f"R={len(devices)} compute devices {devices}. Give {len(devices)} shares, e.g. "
                    f"{[1] * len(devices)}."
                )
            _validate_shares(shares)
        self._shares: tuple[float, ...] | None = None if batch_split is None else tuple(float(s) for s in shares)

        _compat.install()
        # Strategy.__init__ (public class) with our extended object; CentralStorageStrategy.__init__ would build the
        # stock one, and it only adds a usage gauge on top of this.
        extended = _compat.HeteroExtended(self, compute_devices=devices, parameter_device=parameter_device)
        tf.distribute.Strategy.__init__(self, extended)
        setattr(self, _compat.STRATEGY_MARKER, True)

        self._compute_devices = tuple(devices)
        self._parameter_device = parameter_device
        self._auto_balance = bool(auto_balance) and self._shares is None
        self._rebalance_enabled = bool(rebalance) and self._auto_balance
        if emulator is None and emulate is not None:
            emulator = emulation.Emulator(list(emulate))
        self._emulator = emulator
        if emulator is not None:
            logger.warning(
                "hetero_cs: timings are EMULATED - replicas %s emulate %s on logical CPU devices (real compute on "
                "the CPU plus each named device's modelled step time); no GPU is used.",
                list(devices),
                [spec.name for spec in emulator.specs],
            )
        if len(devices) == 1 and self._auto_balance:
            warnings.warn(
                f"HeteroCentralStorageStrategy has one compute device ({devices[0]}): there is nothing to balance. "
                f"Add GPUs, or pass emulate=['A10', 'T4', ...] on a CPU-only machine.",
                stacklevel=2,
            )
        self._profile_cache = profile_cache
        self._lock = threading.RLock()
        self._calibrated_models: list[CostModel] | None = None  # from calibration / set_cost_models
        self._cost_models: list[CostModel] | None = None  # the above, updated online by the monitor
        self._max_batch_sizes: list[int | None] | None = None
        self._plan: BatchPlan | None = None
        self._plans_by_batch: dict[int, BatchPlan] = {}
        self._reference_batch_size: int | None = None
        self._source_dataset = None
        self._calibration = None
        self._calibrated_fingerprint: str | None = None
        self._monitor = StepTimeMonitor(len(devices))
        self._rebalancer = self._make_rebalancer()
        self._handled_steps = 0
        self._timing_enabled = self._rebalance_enabled or self._emulator is not None or _env_flag(
            "HETERO_CS_TIMING"
        )
        self._last_logged_plan: BatchPlan | None = None
        self._input_error: Exception | None = None  # the last error raised inside the input pipeline
        self._empty_slice_plan: BatchPlan | None = None  # the last plan cut that gave a replica 0 examples
        self._warned_empty_slices: set[int] = set()  # global batch sizes already warned about
        # Without online re-balancing nothing changes the plan between batches, so full global batches take their
        # sizes from a copy of the plan in the graph instead of a Python call each (see hetero_cs.input_slicing).
        self._slicer = PlanSlicer(
            len(devices), self._slice_sizes, device=parameter_device, cacheable=not self._rebalance_enabled
        )

    # ----------------------------------------------------------------------------------------------------------
    # Validation
    # ----------------------------------------------------------------------------------------------------------
    @staticmethod
    def _validate_devices(devices: list[str], parameter_device: str) -> None:
        if not devices:
            raise DeviceError("compute_devices is empty. Give at least one device, e.g. ['/gpu:0'].")
        if len(set(devices)) != len(devices):
            raise DeviceError(f"compute_devices repeats a device: {devices}. List each device once.")
        if parameter_device in devices and len(devices) > 1:
            raise DeviceError(
                f"The parameter device {parameter_device} is also a compute device in {devices}. Keep the "
                f"variables on a device that does not run a replica (default '/device:CPU:0'), or drop it from "
                f"compute_devices."
            )
        known = {_canonical_device(d.name) for d in tf.config.list_logical_devices()}
        unknown = [d for d in [*devices, parameter_device] if d not in known]
        if unknown:
            raise DeviceError(
                f"Unknown device(s) {unknown}; TensorFlow sees {sorted(known)}. On a CPU-only machine create "
                f"logical devices first with hetero_cs.emulation.setup_logical_devices([...]) or pass emulate=[...]."
            )

    # ----------------------------------------------------------------------------------------------------------
    # Public state
    # ----------------------------------------------------------------------------------------------------------
    @property
    def plan(self) -> BatchPlan | None:
        """The current plan for the full global batch (None before the first global batch is seen)."""
        return self._plan

    @property
    def compute_devices(self) -> tuple[str, ...]:
        """The replicas' devices, in replica-id order."""
        return self._compute_devices

    @property
    def parameter_device(self) -> str:
        """Where the central variables live."""
        return self._parameter_device

    @property
    def emulator(self):
        """The :class:`hetero_cs.emulation.Emulator` adding emulated device time, or None on real devices."""
        return self._emulator

    @property
    def monitor(self) -> StepTimeMonitor:
        """Per-replica step-time statistics (filled while timing is on: rebalance, emulation, HETERO_CS_TIMING=1)."""
        return self._monitor

    @property
    def calibration(self):
        """The last ``calibration.CalibrationResult`` used for the plan, or None."""
        return self._calibration

    @property
    def cost_models(self) -> list[CostModel] | None:
        """Per-replica cost models behind the plan (calibrated, then updated online), or None."""
        return None if self._cost_models is None else list(self._cost_models)

    def set_cost_models(
        self, cost_models: Sequence[CostModel], *, max_batch_sizes: Sequence[int | None] | None = None
    ) -> None:
        """Replaces the per-replica cost models (and memory caps) and re-solves the plan.

        Args:
            cost_models: One per replica, in replica-id order.
            max_batch_sizes: Per-replica caps in examples (None entries: uncapped).

        Raises:
            ConfigError: Wrong number of cost models or caps.
        """
        from hetero_cs.cost_model import check_cost_model
        from hetero_cs.solver import _checked_caps  # the solver's own cap validation, same messages

        models = list(cost_models)
        R = self.num_replicas_in_sync
        if len(models) != R:
            raise ConfigError(
                f"Need one cost model per replica: got {len(models)} for R={R}. Pass them in replica-id order."
            )
        if max_batch_sizes is not None and not isinstance(max_batch_sizes, (str, bytes)):
            try:
                count = len(max_batch_sizes)
            except TypeError:
                count = None
            if count is not None and count != R:
                raise ConfigError(
                    f"Need one cap per replica: len(max_batch_sizes)={count}, R={R}. Use None for no cap."
                )
        caps = None if max_batch_sizes is None else _checked_caps(max_batch_sizes, R, 0)
        for i, model in enumerate(models):
            check_cost_model(model, [0, 1], replica_id=i)
        with self._lock:
            # Solve with the new models before committing anything, so a failure leaves the strategy as it was.
            previous = (self._calibrated_models, self._cost_models, self._max_batch_sizes)
            self._calibrated_models, self._cost_models, self._max_batch_sizes = list(models), list(models), caps
            try:
                plan = self._solve(self._reference_batch_size) if self._reference_batch_size is not None else None
                rebalancer = self._make_rebalancer()
            except Exception:
                self._calibrated_models, self._cost_models, self._max_batch_sizes = previous
                raise
            self._rebalancer = rebalancer
            self._plans_by_batch.clear()
            if plan is not None:
                self._set_plan(plan)

    def set_batch_split(self, shares: Sequence[float] | None) -> None:
        """Fixes the relative shares per replica from now on (None: back to auto_balance / even split).

        Args:
            shares: Length R, finite, >= 0, not all zero; e.g. ``[2, 1, 1]``.

        Raises:
            BatchSplitError: Wrong length, negative, non-finite or all-zero shares.
        """
        if shares is not None:
            shares = _shares_list(shares)
            if len(shares) != self.num_replicas_in_sync:
                raise BatchSplitError(
                    f"batch_split has one share per replica: len(batch_split)={len(shares)}, but there are "
                    f"R={self.num_replicas_in_sync} compute devices. Give {self.num_replicas_in_sync} shares."
                )
            _validate_shares(shares)
        with self._lock:
            self._shares = None if shares is None else tuple(float(s) for s in shares)
            self._plans_by_batch.clear()
            if self._reference_batch_size is not None:
                self._set_plan(self._solve(self._reference_batch_size))

    def _log_plan_if_new(self) -> None:
        plan = self._plan
        if plan is not None and plan != self._last_logged_plan:
            self._last_logged_plan = plan
            logger.info("hetero_cs batch plan:\n%s", plan)

    def _make_rebalancer(self) -> Rebalancer:
        policy = RebalancePolicy(check_interval_steps=REBALANCE_CHECK_INTERVAL_STEPS)
        return Rebalancer(policy, max_batch_sizes=self._max_batch_sizes)

    def _set_plan(self, plan: BatchPlan) -> None:
        with self._lock:
            self._plan = plan
            self._slicer.publish(plan)
            self._plans_by_batch[plan.global_batch_size] = plan
            # Plans for other (partial-batch) sizes came from the same models only if this plan did.
            for size in [k for k, v in self._plans_by_batch.items() if k != plan.global_batch_size]:
                del self._plans_by_batch[size]

    # ----------------------------------------------------------------------------------------------------------
    # Planning
    # ----------------------------------------------------------------------------------------------------------
    def _solve(self, global_batch_size: int) -> BatchPlan:
        R = self.num_replicas_in_sync
        if self._shares is not None:
            return plan_from_split(split_by_shares(global_batch_size, self._shares), self._cost_models)
        if not self._auto_balance or self._cost_models is None:
            return plan_from_split(even_batch_split(global_batch_size, R), self._cost_models)
        min_batch_size = 1 if global_batch_size >= R else 0
        plan = solve_batch_split(
            self._cost_models,
            global_batch_size,
            max_batch_sizes=self._max_batch_sizes,
            min_batch_size=min_batch_size,
        )
        even = even_batch_split(global_batch_size, R)
        speedup = plan.predicted_speedup_vs_even
        caps_allow_even = self._max_batch_sizes is None or all(
            cap is None or b <= cap for b, cap in zip(even, self._max_batch_sizes)
        )
        if caps_allow_even and speedup is not None and speedup < 1.0 + MIN_PREDICTED_GAIN:
            # When the devices are (nearly) alike, or fixed per-step costs dominate, many splits tie and the
            # optimum is decided by calibration noise (e.g. 3/197 on two identical CPUs); keep the even split.
            reference = self._reference_batch_size in (None, global_batch_size)  # not a last partial batch
            logger.log(
                logging.INFO if reference else logging.DEBUG,
                "hetero_cs: the solved split %s is predicted only %.1f %% faster than the even split (below "
                "MIN_PREDICTED_GAIN=%.0f %%); keeping the even split %s.",
                list(plan.per_replica_batch_sizes),
                (speedup - 1.0) * 100,
                MIN_PREDICTED_GAIN * 100,
                list(even),
            )
            return plan_from_split(even, self._cost_models, max_batch_sizes=self._max_batch_sizes)
        return plan

    def plan_for(self, global_batch_size: int) -> BatchPlan:
        """Returns the plan used for a global batch of ``global_batch_size`` examples (solved once, then cached).

        The first (largest) global batch size seen becomes the reference whose plan is :attr:`plan`; a last partial
        batch ``B' < B`` gets a plan solved for ``B'`` and is weighted by ``B'``.

        Raises:
            ConfigError: ``global_batch_size`` < 1.
        """
        if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, numbers.Integral):
            raise ConfigError(
                f"global_batch_size must be an integer >= 1 (examples per step). Received: "
                f"global_batch_size={global_batch_size!r}. Pass the number of examples per step."
            )
        b = int(global_batch_size)
        if b < 1:
            raise ConfigError(f"global_batch_size must be >= 1. Received: global_batch_size={global_batch_size}.")
        with self._lock:
            plan = self._plans_by_batch.get(b)
            if plan is None:
                plan = self._solve(b)
                self._plans_by_batch[b] = plan
            if self._reference_batch_size is None or b > self._reference_batch_size:
                self._reference_batch_size = b
            if b == self._reference_batch_size and plan is not self._plan:
                self._set_plan(plan)
            return plan

    def _slice_sizes(self, *leading_dims) -> np.ndarray:
        # Called from the tf.data pipeline (numpy_function) with every component's leading dimension, for every
        # global batch that the cached plan does not cover (hetero_cs.input_slicing). An error here would reach the
        # user wrapped in TensorFlow's; it is kept on the strategy so that model.fit re-raises it as it is.
        try:
            sizes = sorted({int(d) for d in leading_dims})
            if len(sizes) > 1:
                raise InputError(
                    f"The components of one dataset element have different leading (batch) dimensions "
                    f"{[int(d) for d in leading_dims]}, so they cannot be cut into the same slices. Every "
                    f"component of a global batch needs the same number of examples; if the dataset is not "
                    f"batched yet, batch it: dataset.batch(global_batch_size)."
                )
            if self._rebalance_enabled:
                self._maybe_rebalance()
            if sizes[0] == 0:
                raise InputError(
                    "A dataset element holds 0 examples: there is nothing to split. Drop empty batches, e.g. "
                    "dataset.filter(lambda x, *rest: tf.shape(x)[0] > 0)."
                )
            with self._lock:
                plan = self.plan_for(sizes[0])
                if plan is self._plan:  # the reference plan: later full batches may read it from the graph
                    self._slicer.publish(plan)
                if 0 in plan.per_replica_batch_sizes:
                    self._note_empty_slices(plan)
            return np.asarray(plan.per_replica_batch_sizes, dtype=np.int64)
        except Exception as exc:
            self._input_error = exc
            raise

    def _note_empty_slices(self, plan: BatchPlan) -> None:
        """Remembers a cut that leaves a replica without examples, and warns once per global batch size."""
        self._empty_slice_plan = plan
        size = plan.global_batch_size
        if size in self._warned_empty_slices:
            return
        self._warned_empty_slices.add(size)
        empty = [i for i, b in enumerate(plan.per_replica_batch_sizes) if b == 0]
        logger.warning(
            "hetero_cs: a global batch of %d examples is cut %s, so replica(s) %s get 0 examples in that step "
            "(exact: their loss weight is 0; R = %d replicas). %s",
            size,
            list(plan.per_replica_batch_sizes),
            empty,
            len(plan.per_replica_batch_sizes),
            _EMPTY_SLICE_ADVICE,
        )

    # ----------------------------------------------------------------------------------------------------------
    # Input
    # ----------------------------------------------------------------------------------------------------------
    def experimental_distribute_dataset(self, dataset, options=None):
        """Distributes a dataset of global batches, cutting each by the current plan.

        Every element of ``dataset`` is one global batch (``B`` examples along the first axis of every component);
        replica ``i`` receives examples ``[sum(b_<i), sum(b_<=i))`` of it, so every example is used exactly once and
        ``predict`` outputs come back in order. A last partial batch is split by a plan solved for its own size.
        A plan change takes effect a few batches later (the pipeline prefetches) and never retraces the step.

        The global batch stays whole in host memory until ``strategy.run`` cuts it (one ``split`` op per component
        on the host); each replica's ops then copy only its own slice to its device. ``experimental_local_results``
        of an element returns the ``R`` slices, as for stock per-replica values. ``options``
        (``tf.distribute.InputOptions``) are accepted for compatibility; their device-placement and per-replica
        buffer settings do not apply to this host-side cut and are ignored with a warning.

        Raises:
            InputError: A component has no batch dimension, or is a ``tf.SparseTensor``.
        """
        _warn_unused_input_options(options)
        self._start_new_input(dataset)
        return _compat.distribute_on_host(self, self._slicer.pack(dataset))

    def _start_new_input(self, dataset) -> None:
        """A new input's first global batch sets the reference size of :attr:`plan` (it may differ from the last)."""
        with self._lock:
            self._source_dataset = dataset
            self._reference_batch_size = None
            self._input_error = None
            self._slicer.publish(None)  # the new input's first batch sets the reference again

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        """Like ``tf.distribute``'s, but ``dataset_fn``'s dataset yields global batches that are cut by the plan.

        ``dataset_fn`` is called once with an ``InputContext`` for one pipeline and one replica, so
        ``input_context.get_per_replica_batch_size(B)`` returns ``B``: batch by the global batch size.
        """
        context = tf.distribute.InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=1)
        _warn_unused_input_options(options)
        dataset = dataset_fn(context)
        self._start_new_input(dataset)
        return _compat.distribute_on_host(self, self._slicer.pack(dataset))

    def _replica_slices(self, value) -> list | None:
        """The ``R`` slices of one packed global-batch leaf from a distributed dataset, or None for other values."""
        if self.num_replicas_in_sync == 1:
            return None  # one replica: the batch is not packed, it is already replica 0's slice
        parts = _compat.components(value)
        if parts is None or len(parts) != 1:
            return None
        packed = parts[0]
        R = self.num_replicas_in_sync
        if is_unbatched_marker(packed):  # None / Optional ("no sample weights"): the same for every replica
            return [packed] * R
        rows = packed.shape[0] if isinstance(packed, tf.RaggedTensor) else None
        if not isinstance(packed, tf.RaggedTensor) or (rows is not None and rows != R):
            made_for = f" (it was cut for {rows} replicas: another strategy's dataset?)" if rows is not None else ""
            raise InputError(
                f"Got a per-replica value with 1 component{made_for}, but this strategy has R={R} replicas. Pass "
                f"elements of this strategy's experimental_distribute_dataset(...), or per-replica values made by "
                f"its experimental_distribute_values_from_function."
            )
        with tf.device(self.extended.input_device):
            return unpack_slices(packed, R)

    def _unpack(self, structure, created=None):
        """``structure`` with every packed global-batch leaf replaced by a per-replica value of its ``R`` slices.

        The new per-replica values are appended to ``created`` (a list) when given.
        """

        def convert(value):
            slices = self._replica_slices(value)
            if slices is None:
                return value
            unpacked = _compat.per_replica(slices)
            if created is not None and not is_unbatched_marker(slices[0]):
                created.append(unpacked)
            return unpacked

        return tf.nest.map_structure(convert, structure)

    def _unpack_inputs(self, args, kwargs):
        """``strategy.run``'s arguments with every packed global batch replaced by per-replica slices.

        Returns ``(args, kwargs, batch_leaves)``; ``batch_leaves`` are the per-replica slices made here, in order.
        """
        created: list = []
        return self._unpack(args, created), self._unpack(kwargs or {}, created), created

    def experimental_local_results(self, value):
        """Like ``tf.distribute``'s; an element of a distributed dataset gives its ``R`` per-replica slices.

        For a nested element such as ``(features, labels)`` the result is a tuple of ``R`` such structures, replica
        ``i``'s holding its slice of every component.
        """
        return super().experimental_local_results(self._unpack(value))

    # ----------------------------------------------------------------------------------------------------------
    # Replica steps
    # ----------------------------------------------------------------------------------------------------------
    def _wrap_replica_fn(self, fn, args, kwargs, batch_leaves=()):
        """Wraps a replica function so it knows its slice size b_i, the global batch B and its start time.

        ``b_i`` and ``B`` come from one argument leaf: the first of ``batch_leaves`` (slices of a distributed
        dataset's element) if any, else the first per-replica value whose components all have a batch dimension.
        """
        flat = tf.nest.flatten((args, kwargs or {}))
        batch_ids = {id(v) for v in batch_leaves}

        def is_batched_per_replica(v):
            return isinstance(v, tf.distribute.DistributedValues) and all(
                getattr(c, "shape", None) is not None and c.shape.rank != 0 for c in self.experimental_local_results(v)
            )

        batch_index = next((i for i, v in enumerate(flat) if id(v) in batch_ids), None)
        if batch_index is None:
            batch_index = next((i for i, v in enumerate(flat) if is_batched_per_replica(v)), None)
        global_batch_size = None
        step_start = None
        if batch_index is not None:
            components = self.experimental_local_results(flat[batch_index])
            with tf.device(self._parameter_device):
                global_batch_size = tf.add_n([_leading_dim(c) for c in components])
                if self._timing_enabled:
                    from hetero_cs.step_timing import wall_clock_stamp

                    # One clock start per step, when the step's input is there: every replica's step time runs
                    # from it (what a real device's does: input and parameters reach it after the step starts).
                    step_start = wall_clock_stamp(_dense_part(components[0]))  # data, so never constant-folded
        if self._emulator is not None and not self._emulator_ready():
            raise ConfigError(
                "Emulated devices need the model's size before the first step. model.fit does this for you; "
                "before a model.evaluate or model.predict that comes before any fit, and in a custom loop before "
                "the first strategy.run, call strategy.calibrate(model, dataset) once."
            )
        strategy = self

        def replica_fn(*call_args, **call_kwargs):
            context = tf.distribute.get_replica_context()
            replica_id = _compat.replica_id_in_sync_group(context)
            call_flat = tf.nest.flatten((call_args, call_kwargs))
            if batch_index is not None and batch_index < len(call_flat):
                batched = call_flat[batch_index]  # this replica's component of the batch leaf
            else:  # no per-replica batch: the first argument with a batch dimension
                leaves = [t for t in call_flat if isinstance(t, (tf.Tensor, tf.RaggedTensor))]
                batched = next((t for t in leaves if t.shape.rank is None or t.shape.rank >= 1), None)
            batch_size = _leading_dim(batched) if batched is not None else tf.constant(0, tf.int32)
            start = step_start
            if start is None and strategy._timing_enabled and batched is not None:
                from hetero_cs.step_timing import wall_clock_stamp

                start = wall_clock_stamp(_dense_part(batched))
            step = training.ReplicaStep(
                replica_id=replica_id,
                device=strategy._compute_devices[replica_id],
                batch_size=batch_size,
                global_batch_size=global_batch_size,
                start_stamp=start,
            )
            with training.replica_step(step):
                return fn(*call_args, **call_kwargs)

        return replica_fn

    def _emulator_ready(self) -> bool:
        return getattr(self._emulator, "workload", None) is not None

    def _on_replica_gradients(self, grads: list) -> list:
        """Called in replica context when a replica's gradients are ready, just before they go to the host."""
        step = training.current_replica_step()
        if step is None or step.start_stamp is None:
            return grads
        from hetero_cs.step_timing import finish_replica_step

        return finish_replica_step(
            grads,
            step.start_stamp,
            replica_id=step.replica_id,
            batch_size=step.batch_size,
            emulator=self._emulator,
            record=self._record_step_time,
        )

    def _record_step_time(self, replica_id: int, batch_size: int, step_time_s: float) -> None:
        """Monitor callback (runs in a TensorFlow thread once per replica per step): records only."""
        self._monitor.record(int(replica_id), int(batch_size), float(step_time_s))

    def _maybe_rebalance(self) -> None:
        """Re-plans from the monitor if steps completed since the last look.

        Called from the input pipeline before it cuts the next global batch, so the decision runs ahead of the
        training step instead of inside it, and the new plan reaches the very batches being prepared.
        """
        with self._lock:
            completed = self._monitor.completed_steps
            if completed <= self._handled_steps:
                return
            self._handled_steps = completed
            if not self._rebalance_enabled or self._shares is not None or self._plan is None:
                return
            new_plan = self._rebalancer.propose_from_monitor(
                self._monitor, self._plan, base_models=self._calibrated_models
            )
            if new_plan is not None:
                self._cost_models = self._monitor.updated_cost_models(self._calibrated_models)
                self._set_plan(new_plan)

    def _replica_step_error(self, exc: Exception):
        """A ReplicaStepError naming the replica and device an op error came from, or None if it names none.

        TensorFlow names replica i's ops "replica_<i>/..." (i >= 1); replica 0's ops carry no prefix.
        """
        import re

        if self._input_error is not None:
            error, self._input_error = self._input_error, None
            return error
        message = str(exc)
        # "[[{{node NAME}}]]" names the op that failed; "Detected at node NAME" may name an op it fed.
        match = re.search(r"\[\[\{\{node ([^}\s]+)\}\}\]\]", message) or re.search(r"node (\S+)", message)
        if match is None or "Iterator" in match.group(1) or "IteratorGetNext" in message:
            return None  # the input pipeline failed (e.g. a generator), not a replica's step
        # The replica's scope may follow other scopes, e.g. "gradient_tape/replica_1/...".
        scope = re.search(r"(?:^|/)replica_(\d+)/", match.group(1))
        replica_id = int(scope.group(1)) if scope else 0
        if replica_id >= self.num_replicas_in_sync:
            return None
        device = self._compute_devices[replica_id]
        lines = [line.strip() for line in message.splitlines()]
        # TensorFlow puts the op's own message on the line before "[[{{node ...}}]]".
        marker = next((i for i, line in enumerate(lines) if line.startswith("[[{{node")), None)
        before = [line for line in lines[:marker] if line] if marker is not None else []
        cause = before[-1] if before else type(exc).__name__
        plan = list(self._plan.per_replica_batch_sizes) if self._plan else None
        empty = self._empty_slice_plan
        if empty is not None and empty.per_replica_batch_sizes[replica_id] == 0:
            advice = (
                f"That replica gets 0 examples of a global batch of {empty.global_batch_size} (cut "
                f"{list(empty.per_replica_batch_sizes)}; full batches: {plan}), which is likely this step. "
                f"{_EMPTY_SLICE_ADVICE}"
            )
        else:
            advice = f"Check that replica's slice of the batch (plan: {plan}) and the device."
        return ReplicaStepError(
            f"The training step failed in replica {replica_id} on {device} ({type(exc).__name__}: {cause.strip()}). "
            f"No update of this step was applied: variables and optimizer state are as they were before it. "
            f"{advice} The original error is chained below.",
            replica_id=replica_id,
            device=device,
        )

    # ----------------------------------------------------------------------------------------------------------
    # Reductions
    # ----------------------------------------------------------------------------------------------------------
    def reduce(self, reduce_op, value, axis=None):
        """Reduces per-replica values across replicas, leaf by leaf for nested values.

        Stock CentralStorageStrategy returns replica 0's value for ``MEAN`` of a tuple or dict (and raises for
        ``SUM``); here each leaf is reduced on its own.

        With uneven slices, average per-example quantities by weight, not per replica. Worked number: slices
        ``[7, 3]`` whose mean losses are 1.0 and 0.0 have the full-batch mean 0.7, but ``reduce("MEAN", loss,
        axis=None)`` gives 0.5. Compute each replica's loss with ``tf.nn.compute_average_loss(per_example_loss,
        global_batch_size=B)`` (0.7 and 0.0) and reduce with ``"SUM"``: 0.7. ``axis=0`` reduces per example and is
        exact as is. ``MEAN`` with ``axis=None`` of an element of a distributed dataset, or of values whose shapes
        differ between replicas (slices of a data batch), has no element-wise mean; it returns the largest replica's
        value, which is what Keras needs when it infers input shapes from a distributed batch.
        """
        if tf.nest.is_nested(value) and not isinstance(value, tf.distribute.DistributedValues):
            return tf.nest.map_structure(lambda v: self.reduce(reduce_op, v, axis=axis), value)
        if value is None:  # e.g. the missing sample weights of an (x, y, None) batch
            return None
        op = reduce_op if isinstance(reduce_op, str) else reduce_op.value
        slices = self._replica_slices(value)
        if slices is not None:  # an element of a distributed dataset: reduce its per-replica slices
            if is_unbatched_marker(slices[0]):
                return slices[0]
            if axis is None and str(op).upper() == "MEAN":
                return _largest(slices)
            value = _compat.per_replica(slices)
        if (
            axis is None
            and str(op).upper() == "MEAN"
            and isinstance(value, tf.distribute.DistributedValues)
            and _known_unequal_shapes(self.experimental_local_results(value))
        ):
            return _largest(self.experimental_local_results(value))
        return super().reduce(reduce_op, value, axis=axis)

    def gather(self, value, axis):
        """Like ``tf.distribute``'s, leaf by leaf for nested values; an element of a distributed dataset gathers its
        slices back into the global batch. (Stock gather returns only part of a nested value.)"""
        gather_one = super().gather

        def gather_leaf(leaf):
            slices = self._replica_slices(leaf)
            if slices is None:
                return gather_one(leaf, axis)
            if is_unbatched_marker(slices[0]):  # None / Optional: nothing to gather
                return slices[0]
            return gather_one(_compat.per_replica(slices), axis)

        return tf.nest.map_structure(gather_leaf, value)

    # ----------------------------------------------------------------------------------------------------------
    # Calibration
    # ----------------------------------------------------------------------------------------------------------
    def calibrate(self, model, data, *, force: bool = False, progress: bool = True):
        """Prepares balancing for ``model``: emulated device sizes, then (auto_balance) calibration and the plan.

        ``model.fit`` calls this for you on its first global batch. Custom loops call it once before the first
        ``strategy.run``.

        Args:
            model: A built Keras model created under ``strategy.scope()``.
            data: A ``tf.data.Dataset`` of global batches (its first element is used), or one global batch
                ``(x, y)`` / ``(x, y, sample_weight)``.
            force: Calibrate even if this model was already calibrated (the profile cache is still used).
            progress: Show Keras' progress bar while calibrating.

        Returns:
            The ``calibration.CalibrationResult``, or None when no calibration is needed (fixed or even split).
        """
        from calibration import calibrate as run_calibration
        from calibration.probe import model_fingerprint

        batch = _first_batch(data)
        batched = [leaf for leaf in tf.nest.flatten(batch) if not is_unbatched_marker(leaf)]
        if not batched:
            raise InputError(
                "The first dataset element holds only None or Optional components; there is nothing to calibrate on."
            )
        global_batch_size = int(_leading_dim_value(batched[0]))
        if global_batch_size < 1:
            raise InputError(
                "The first dataset element holds 0 examples; calibration needs a global batch of at least one. Drop "
                "empty batches, e.g. dataset.filter(lambda x, *rest: tf.shape(x)[0] > 0)."
            )
        if self._emulator is not None and not self._emulator_ready():
            from hetero_cs.emulation import estimate_workload

            target_s = _emulated_makespan_target_s()  # before anything changes: a bad value leaves no trace
            self._emulator.set_workload(estimate_workload(model))
            self._emulator.calibrate_time_scale(global_batch_size, target_makespan_s=target_s)
        if not self._auto_balance:
            self.plan_for(global_batch_size)
            return None
        fingerprint = model_fingerprint(model)
        if not force and self._calibrated_fingerprint == fingerprint and self._cost_models is not None:
            return self._calibration
        if not isinstance(batch, (tuple, list)) or len(batch) not in (2, 3) or batch[1] is None:
            raise ConfigError(
                f"auto_balance calibrates each device on the model's training step with (x, y) or "
                f"(x, y, sample_weight) batches, but this data's batches have no labels (got a "
                f"{type(batch).__name__}{f' of length {len(batch)}' if isinstance(batch, (tuple, list)) else ''}; "
                f"e.g. x only, with a loss from add_loss). Pass batch_split=[...] (fixed shares) or "
                f"auto_balance=False to train on such data."
            )
        result = run_calibration(
            model,
            batch,
            devices=list(self._compute_devices),
            parameter_device=self._parameter_device,
            global_batch_size=global_batch_size,
            emulator=self._emulator,
            store=self._store(),
            progress=progress,
        )
        self._calibration = result
        self._calibrated_fingerprint = fingerprint
        logger.info("hetero_cs calibration:\n%s", result.format_table())
        with self._lock:
            self._reference_batch_size = max(self._reference_batch_size or 0, global_batch_size)
        self.set_cost_models(
            [p.cost_model for p in result.profiles], max_batch_sizes=[p.max_batch_size for p in result.profiles]
        )
        return result

    def _store(self):
        from calibration.store import ProfileStore

        cache = self._profile_cache
        if cache is False:
            return False
        if cache is None:
            return ProfileStore()
        if isinstance(cache, (str, os.PathLike)):
            return ProfileStore(cache)
        return cache

    def _fit_callbacks(self, model, callbacks):
        from hetero_cs.callbacks import BalanceCallback

        callbacks = list(callbacks or [])
        if not any(isinstance(c, BalanceCallback) for c in callbacks):
            callbacks.insert(0, BalanceCallback(self))
        return callbacks


_DEFAULT_INPUT_OPTIONS = tf.distribute.InputOptions()


def _warn_unused_input_options(options) -> None:
    """Warns about InputOptions settings that cannot apply when every global batch is cut on the host."""
    if options is None:
        return
    if not isinstance(options, tf.distribute.InputOptions):
        raise InputError(
            f"options must be a tf.distribute.InputOptions or None; got {type(options).__name__}: {options!r}."
        )
    fields = (
        "experimental_fetch_to_device",
        "experimental_replication_mode",
        "experimental_place_dataset_on_device",
        "experimental_per_replica_buffer_size",
    )
    changed = {f: getattr(options, f) for f in fields if getattr(options, f) != getattr(_DEFAULT_INPUT_OPTIONS, f)}
    if changed:
        logger.warning(
            "hetero_cs: InputOptions %s are ignored: every global batch goes to the host and is cut there inside "
            "strategy.run, so there is no per-replica input to place or buffer. Add .prefetch(...) to the dataset "
            "for more buffering.",
            changed,
        )


def _shares_list(batch_split) -> list:
    if isinstance(batch_split, (str, bytes)) or not isinstance(batch_split, Iterable):
        raise BatchSplitError(
            f"batch_split must be a sequence of relative shares, one per replica. Received: "
            f"batch_split={batch_split!r}. Example: batch_split=[2, 1, 1]."
        )
    return list(batch_split)


def _validate_profile_cache(profile_cache) -> None:
    from calibration.store import ProfileStore

    if profile_cache is None or profile_cache is False or isinstance(profile_cache, (str, os.PathLike, ProfileStore)):
        return
    raise ConfigError(
        f"profile_cache must be None (the default cache directory), False (no cache), a directory path or a "
        f"calibration.ProfileStore. Received: profile_cache={profile_cache!r}."
    )


def _validate_shares(shares: Sequence[float]) -> None:
    bad = [
        s
        for s in shares
        if isinstance(s, bool) or not isinstance(s, numbers.Real) or not math.isfinite(s) or s < 0
    ]
    if bad or not any(s > 0 for s in shares):
        raise BatchSplitError(
            f"batch_split shares must be finite numbers >= 0 with at least one > 0. Received: "
            f"batch_split={list(shares)}. Example: batch_split=[2, 1, 1] gives replica 0 half of each batch."
        )


def _leading_dim(tensor) -> tf.Tensor:
    """The batch size (int32 scalar) of a tensor or ragged tensor."""
    if isinstance(tensor, tf.RaggedTensor):
        return tensor.nrows(out_type=tf.int32)
    return tf.shape(tensor, out_type=tf.int32)[0]


def _dense_part(tensor):
    """A dense tensor holding ``tensor``'s data (a ragged tensor's flat values), e.g. to anchor a clock stamp on."""
    return tensor.flat_values if isinstance(tensor, tf.RaggedTensor) else tensor


def _leading_dim_value(value) -> int:
    shape = getattr(value, "shape", None)
    if shape is None:
        shape = np.shape(value)
    if len(shape) == 0:
        raise InputError(
            f"A batch component has no batch dimension (shape={tuple(shape)}); batch the data first."
        )
    return int(shape[0])


def _largest(slices):
    """The slice with the most examples where that is known without running anything, else the first one."""
    sizes = [s.shape[0] if s.shape.rank else None for s in slices]
    known = [n if n is not None else -1 for n in sizes]
    return slices[int(np.argmax(known))]


def _known_unequal_shapes(components) -> bool:
    """True when every component's shape is fully known and they are not all equal (uneven eager slices)."""
    shapes = []
    for c in components:
        shape = getattr(c, "shape", None)
        if shape is None or shape.rank is None or None in shape.as_list():
            return False
        shapes.append(tuple(shape.as_list()))
    return len(set(shapes)) > 1


def _first_batch(data):
    if isinstance(data, tf.data.Dataset):
        for element in data.take(1):
            return element
        raise InputError("The dataset is empty; calibration needs one global batch.")
    if isinstance(data, (tuple, list)) and data:
        return tuple(data)
    raise InputError(
        f"Calibration needs a tf.data.Dataset of global batches or one batch (x, y); got {type(data).__name__}."
    )


def _emulated_makespan_target_s() -> float:
    """Emulated even-split makespan to aim for, seconds: HETERO_CS_EMULATION_TARGET_MAKESPAN_MS, default 100 ms.

    Real compute of the logical CPU replicas shares the host's cores; the emulated waits must stay well above it
    so that the emulated devices, not CPU contention, set each replica's step time.
    """
    raw = os.environ.get("HETERO_CS_EMULATION_TARGET_MAKESPAN_MS", "").strip()
    if not raw:
        return 0.1
    try:
        value_ms = float(raw)
    except ValueError:
        value_ms = math.nan
    if not math.isfinite(value_ms) or value_ms <= 0:
        raise ConfigError(
            f"HETERO_CS_EMULATION_TARGET_MAKESPAN_MS={raw!r} must be a positive number of milliseconds, e.g. 100."
        )
    return value_ms / 1e3


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")
