"""The chief's side of multi-worker balancing: calibration during the first training steps, then the Balancer.

Under :class:`hetero_cs.HeteroMultiWorkerMirroredStrategy` the split of every global batch is decided by the chief
alone (global replica 0) and reaches every worker inside the step through one all-reduce (see
:mod:`hetero_cs.engine.multi_worker.agreement`); every other worker only reports its own replicas' step times
through the same all-reduce. This object is what the chief consults: it never touches TensorFlow.

Calibration happens *in* training. Any split is exact (each replica's loss weighs ``b_i / B``), so the first steps
can serve probe splits - each replica's share of the even split times 1.0, 0.5 and 1.5 in rotation - and each
worker's own replica is timed on its own device at three slice sizes while the model trains as it would on one
device. After ``probe_steps`` timed probes the chief fits one cost model per replica
(:func:`calibration.fit.fit_cost_model`, the fit calibration uses) and hands them to the
:class:`~hetero_cs.planning.balancer.Balancer` with a guard trial; from then on the Balancer serves every batch
(guard, monitor, re-balancing), exactly as under the central-storage strategy.
"""

import logging
import threading
from collections.abc import Sequence

from hetero_cs._copying import DeepcopiedWithNewLocks
from hetero_cs.planning.balancer import Balancer
from hetero_cs.planning.choice import _split_within_caps, _violates
from hetero_cs.planning.cost_model import near_equal_micro_batches
from hetero_cs.planning.micro_batches import micro_batched_curves, zero_caps
from hetero_cs.planning.plan import split_by_shares
from hetero_cs.planning.sampling import AGREEMENT_COST_S, MAX_AGREEMENT_INTERVAL_STEPS, interval_steps

logger = logging.getLogger(__name__)

PROBE_FACTORS = (1.0, 0.5, 1.5)  # each replica's share of the even split, in rotation over the probe steps
DEFAULT_PROBE_STEPS = 6  # timed probes: each replica sees each factor twice
WARMUP_STEPS = 1  # the first step traces and builds: served even, its times dropped


class ClusterPlanner(DeepcopiedWithNewLocks):
    """Sizes for every global batch, as decided by the chief (thread-safe).

    Args:
        balancer: The plan lifecycle (one per strategy; only the chief's is consulted).
        calibrate: Probe and fit cost models during the first steps (auto_balance); False serves the Balancer's
            plans from the start (a fixed or even split).
        probe_steps: Timed probe steps before the fit, >= 3 (every replica must see every factor).
    """

    def __init__(self, balancer: Balancer, *, calibrate: bool, probe_steps: int = DEFAULT_PROBE_STEPS):
        if probe_steps < len(PROBE_FACTORS):
            raise ValueError(f"probe_steps must be >= {len(PROBE_FACTORS)}. Received: probe_steps={probe_steps}.")
        self._balancer = balancer
        self._lock = threading.Lock()
        self._calibrating, self._probe_steps = bool(calibrate), int(probe_steps)
        self._reference: int | None = None
        self._served = 0  # steps of the reference size served while calibrating
        self._points: list[tuple[list[int], list[float]]] = []  # per replica: sizes, times
        self._step_index = 0  # steps served (all sizes), to pair reports with what was served
        self._splits: dict[int, tuple[tuple[int, ...], bool]] = {}  # step index -> (split served, a probe?)
        self._caps: list[int | None] | None = None  # per-replica memory caps in examples, None: uncapped
        self._micro_batched = False  # slices past a cap run as micro-batches (else the caps bound the slices)

    def set_memory_caps(self, max_batch_sizes: Sequence[int | None] | None, *, micro_batched: bool) -> None:
        """The replicas' memory caps (examples per step or per micro-batch), the same on every worker.

        ``micro_batched``: each replica runs a slice past its cap as near-equal micro-batches within it
        (:func:`hetero_cs.planning.cost_model.near_equal_micro_batches`), so only a cap of 0 binds a split, and the
        plans price each slice as its micro-batches back to back
        (:func:`hetero_cs.planning.micro_batches.micro_batched_curves`); probes time each replica's mean
        micro-batch. Otherwise the caps bound every slice, probes included.

        Raises:
            ConfigError: From :meth:`Balancer.set_max_batch_sizes`.
        """
        caps = None if max_batch_sizes is None else list(max_batch_sizes)
        micro_batched = bool(micro_batched) and caps is not None
        # The caps the Balancer solves within: where slices run as micro-batches, only a cap of 0 binds a split.
        self._balancer.set_max_batch_sizes(zero_caps(caps) if micro_batched else caps)
        with self._lock:
            self._caps, self._micro_batched = caps, micro_batched

    @property
    def calibrating(self) -> bool:
        """True until the probes were fitted (or calibration was not asked for)."""
        return self._calibrating

    def sizes(self, global_batch_size: int) -> tuple[tuple[int, ...], int]:
        """The split of the next global batch, and the index of the step it is served for.

        Raises:
            ConfigError, InfeasiblePlanError: From the Balancer.
        """
        B = int(global_batch_size)
        with self._lock:
            index = self._step_index
            self._step_index += 1
            if self._calibrating:
                if self._reference is None:
                    self._reference = B
                    self._balancer.plan_for(B)  # the reference size, as the first batch sets it
                if B == self._reference:
                    probe = self._served - WARMUP_STEPS
                    self._served += 1
                    if 0 <= probe < self._probe_steps:
                        R = self._balancer.num_replicas
                        shares = [PROBE_FACTORS[(i + probe) % len(PROBE_FACTORS)] for i in range(R)]
                        sizes = ((self._around_caps(B, shares) if self._micro_batched else None)
                                 or tuple(int(b) for b in split_by_shares(B, shares)))
                        caps = self._balancer.max_batch_sizes
                        if _violates(sizes, caps):  # no probe past a memory cap (or on a card that holds none)
                            sizes = tuple(int(b) for b in _split_within_caps(B, shares, caps))
                        self._splits[index] = (sizes, True)
                        return sizes, index
            sizes = tuple(int(b) for b in self._balancer.serve(B).per_replica_batch_sizes)
            self._splits[index] = (sizes, False)
            return sizes, index

    def _around_caps(self, B: int, factors: list[float]) -> tuple[int, ...] | None:
        """A micro-batched probe split: each card whose cap is below its even share takes its factor times its cap
        (0.5, 1 or 1.5 of it: micro-batches of 0.5, 1 and 0.75 times the cap), the others the rest by their factors;
        None when no card is such, or they would take the whole batch.

        Probed at 0.5-1.5 times its even share, such a card would run micro-batches of about its cap every time,
        and one size cannot tell its per-step fixed cost (paid again by each micro-batch) from its per-example cost.
        """
        R = len(factors)
        small = {i: max(1, round(f * cap)) for i, (f, cap) in enumerate(zip(factors, self._caps))
                 if cap and cap * R < B}
        rest = B - sum(small.values())
        others = [i for i in range(R) if i not in small and self._caps[i] != 0]
        if not small or not others or rest < len(others):
            return None
        sizes = small | dict(zip(others, split_by_shares(rest, [factors[i] for i in others])))
        return tuple(int(sizes.get(i, 0)) for i in range(R))

    def hold_steps(self) -> int:
        """How many steps after the one just served keep its split without agreeing (>= 0).

        0 while calibrating and while the Balancer needs every step's times (a guard trial, a monitor window still
        filling); in steady state N - 1, where one agreement in N steps costs at most ``TIMING_BUDGET`` of the last
        measured makespan (``AGREEMENT_COST_S``, N <= ``MAX_AGREEMENT_INTERVAL_STEPS``). A plan the chief makes
        during a hold (a re-plan, ``set_batch_split``) is served from the next agreement on."""
        with self._lock:
            if self._calibrating or self._balancer.samples_needed():
                return 0
            sample = self._balancer.monitor.last_step()
            return interval_steps(AGREEMENT_COST_S, sample and sample.makespan_s, MAX_AGREEMENT_INTERVAL_STEPS) - 1

    def report(self, step_index: int, per_replica_step_times_s: Sequence[float],
               slice_sizes: Sequence[int] | None = None) -> None:
        """The measured step time of every replica in a step cut by the split served at ``step_index`` (a time of 0
        or less: not timed). With ``slice_sizes`` (the slices that step was cut with), times of a step cut
        otherwise (a held batch of another size) are dropped."""
        times = [float(t) for t in per_replica_step_times_s]
        with self._lock:
            served, probe = self._splits.pop(step_index, (None, False))
            if (served is None or any(t <= 0.0 for t in times)
                    or (slice_sizes is not None and tuple(int(b) for b in slice_sizes) != served)):
                return
            if probe:
                self._points.append((list(served), times))
                if len(self._points) >= self._probe_steps and self._calibrating:
                    self._fit()
                return
            for i, (b, t) in enumerate(zip(served, times)):
                self._balancer.record_step_time(i, b, t)

    def _fit(self) -> None:
        from calibration.fit import fit_cost_model
        from calibration.result import describe_cost_model

        R = self._balancer.num_replicas
        caps = self._caps or [None] * R
        models, descriptions = [], []
        for i in range(R):
            # A replica's probes with 0 examples (a global batch below 2R) say nothing about its speed. A slice run
            # as k near-equal micro-batches is k steps of the card's model: its mean micro-batch is the point (the
            # examples rounded: they differ by at most one between its micro-batches).
            cap = caps[i] if self._micro_batched and caps[i] else None
            points = [(max(1, round(probe[i] / k)), step_times[i] / k) for probe, step_times in self._points
                      if (k := len(near_equal_micro_batches(probe[i], cap)))]
            if not points and caps[i] == 0:  # a card that holds no example takes none: any model will do
                models.append(None)
                descriptions.append("holds no example (memory cap 0)")
                continue
            if not points:
                self._calibrating = False
                logger.warning(
                    "hetero_cs multi-worker calibration: replica %d got no example in any probe step (global batch "
                    "%s for %d replicas); keeping the even split.", i, self._reference, R)
                return
            sizes = [b for b, _ in points]
            models.append(fit_cost_model(sizes, [t for _, t in points]).cost_model)
            descriptions.append(describe_cost_model(models[-1], min(sizes), max(sizes)))
        known = [m for m in models if m is not None]
        models = [m if m is not None else max(known, key=lambda k: k.predict_step_time_s(1)) for m in models]
        self._calibrating = False
        logger.info("hetero_cs multi-worker calibration from %d training steps: %s", len(self._points),
                    "; ".join(f"replica {i}: {d}" for i, d in enumerate(descriptions)))
        if self._micro_batched:
            models = micro_batched_curves(models, self._caps)
        self._balancer.set_cost_models(models, trial=True, reference_batch_size=self._reference,
                                       max_batch_sizes=zero_caps(self._caps) if self._micro_batched else self._caps)

