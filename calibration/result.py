"""What calibration produces: per-device profiles and the plan solved from them (pure: no TensorFlow).

These are plain frozen dataclasses with a strict dict round trip, so calibration.store can cache them without
importing TensorFlow and the CLI can print them.
"""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from hetero_cs.errors import ProfileCacheError
from hetero_cs.planning.cost_model import CostModel, OutOfMemoryCostModel, ScaledCostModel, cost_model_from_dict
from hetero_cs.planning.plan import BatchPlan, _is_int, check_keys, finite_real, ordered_values

__all__ = ["CalibrationResult", "DeviceProfile"]


def _to_dict(obj: Any, **values: Any) -> dict[str, Any]:
    """A result's stored fields (``compare=False`` ones are not stored) as JSON values, tuples as lists."""
    stored = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.compare}
    return {name: list(value) if isinstance(value, tuple) else value for name, value in stored.items()} | values


def _from_dict(cls: type, data: Mapping[str, Any], optional: set[str], parse: Callable[[Mapping], dict]) -> Any:
    """``cls`` from ``_to_dict`` output, with ``parse(data)``'s values in place of the stored ones."""
    required = {f.name for f in dataclasses.fields(cls) if f.compare} - optional
    check_keys(data, required, optional, error=ProfileCacheError, what=cls.__name__,
               wrong_keys=lambda unknown, missing: (
                   f"{cls.__name__} has unknown keys {unknown} and/or misses keys {missing}. It was written by "
                   f"another version of hetero_cs or edited by hand; recalibrate to replace it."))
    try:
        return cls(**{**data, **parse(data)})
    except ProfileCacheError:
        raise
    except (TypeError, ValueError, KeyError, OverflowError) as exc:
        raise ProfileCacheError(
            f"{cls.__name__} data is invalid: {str(exc).rstrip('.')}. Recalibrate to replace it.") from exc


def _finite_non_negative(owner: str, name: str, value: Any) -> None:
    if not finite_real(value) or value < 0:
        shown = "an integer too large for a float" if isinstance(value, int) and abs(value) > 10**300 else repr(value)
        raise ProfileCacheError(f"{owner}.{name} must be a finite number >= 0. Received: {name}={shown}.")


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """The calibrated step-time curve and memory cap of one compute device.

    Attributes:
        device: TensorFlow device name, e.g. "/device:GPU:0" or "/device:CPU:1".
        cost_model: Step time t(b) in seconds for a slice of b examples (broadcast, forward, backward, gradient
            return), non-decreasing in b.
        max_batch_size: Largest slice that fits in the device's memory, in examples, >= 0; None when unbounded
            (CPU devices without a user cap, or a GPU that held the whole global batch). 0: the device cannot hold
            one example and sits idle; its profile then has no probed sizes and an ``OutOfMemoryCostModel``.
        fit_error: Largest relative error of cost_model at the measured points, >= 0.
        probe_batch_sizes: Probed sizes, strictly increasing, shape [P].
        median_step_times_s: Median step time at each probed size, seconds, shape [P].
        mad_s: Median absolute deviation of the trials at each probed size, seconds, shape [P].
        emulated_as: Catalog device name whose timing was emulated on this device, or None for real timings.
        relative_noise: The timing noise calibration saw on this device, >= 0: the median over probe sizes of
            mad_s / median_step_times_s (0.02 = 2 %). 0.0 in profiles written before it was recorded.
    """

    device: str
    cost_model: CostModel
    max_batch_size: int | None
    fit_error: float
    probe_batch_sizes: tuple[int, ...]
    median_step_times_s: tuple[float, ...]
    mad_s: tuple[float, ...]
    emulated_as: str | None = None
    relative_noise: float = 0.0

    def __post_init__(self) -> None:
        for name in ("probe_batch_sizes", "median_step_times_s", "mad_s"):
            values = ordered_values(getattr(self, name))
            if values is None:
                raise ProfileCacheError(f"DeviceProfile.{name} must be a list of numbers, one per probed size. "
                                        f"Received: {name}={getattr(self, name)!r}.")
            object.__setattr__(self, name, values)
        if bad_sizes := [b for b in self.probe_batch_sizes if not _is_int(b)]:
            raise ProfileCacheError(f"DeviceProfile.probe_batch_sizes must be integers. Received: probe_batch_sizes="
                                    f"{list(self.probe_batch_sizes)!r} (offending: {bad_sizes!r}).")
        if self.emulated_as is not None and not (isinstance(self.emulated_as, str) and self.emulated_as):
            raise ProfileCacheError(f"DeviceProfile.emulated_as must be None or a catalog device name such as 'T4'. "
                                    f"Received: emulated_as={self.emulated_as!r}.")
        if not all(finite_real(t) and t >= 0 for t in self.median_step_times_s + self.mad_s):
            raise ProfileCacheError(f"DeviceProfile.median_step_times_s and mad_s must hold finite numbers of seconds "
                                    f">= 0. Received: median_step_times_s={list(self.median_step_times_s)!r}, "
                                    f"mad_s={list(self.mad_s)!r}.")
        for name, kind in (("probe_batch_sizes", int), ("median_step_times_s", float), ("mad_s", float)):
            object.__setattr__(self, name, tuple(kind(v) for v in getattr(self, name)))
        if not isinstance(self.device, str) or not self.device:
            raise ProfileCacheError(f"DeviceProfile.device must be a non-empty string. Received: {self.device!r}.")
        if not callable(getattr(self.cost_model, "predict_step_time_s", None)):
            raise ProfileCacheError(f"DeviceProfile.cost_model needs predict_step_time_s. Received: "
                                    f"{type(self.cost_model).__name__}.")
        if self.max_batch_size is not None and not (_is_int(self.max_batch_size) and 0 <= self.max_batch_size < 2**63):
            raise ProfileCacheError(f"DeviceProfile.max_batch_size must be None or an int in [0, 2**63). Received: "
                                    f"{self.max_batch_size!r}.")
        _finite_non_negative("DeviceProfile", "fit_error", self.fit_error)
        _finite_non_negative("DeviceProfile", "relative_noise", self.relative_noise)
        sizes, medians, mads = self.probe_batch_sizes, self.median_step_times_s, self.mad_s
        if self.holds_no_example:
            if sizes or medians or mads or not isinstance(self.cost_model, OutOfMemoryCostModel):
                raise ProfileCacheError("A DeviceProfile with max_batch_size=0 (the device cannot hold one example) "
                                        "has no probed sizes and an OutOfMemoryCostModel. Received: probe_batch_sizes="
                                        f"{list(sizes)}, cost_model={self.cost_model!r}. Recalibrate to replace it.")
            return
        if not sizes or len(medians) != len(sizes) or len(mads) != len(sizes):
            raise ProfileCacheError("DeviceProfile needs one median and one MAD per probed size, at least one size. "
                                    f"Received: len(probe_batch_sizes)={len(sizes)}, len(median_step_times_s)="
                                    f"{len(medians)}, len(mad_s)={len(mads)}.")
        if any(b < 1 for b in sizes) or any(b >= c for b, c in zip(sizes, sizes[1:])):
            raise ProfileCacheError(f"DeviceProfile.probe_batch_sizes must be >= 1 and strictly increasing. Received: "
                                    f"{sizes}.")

    def to_dict(self) -> dict[str, Any]:
        """Returns a JSON-serialisable dict; inverse of from_dict."""
        return _to_dict(self, cost_model=self.cost_model.to_dict())

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "DeviceProfile":
        """Rebuilds a profile from to_dict output (``relative_noise`` may be missing: 0.0).

        Raises:
            ProfileCacheError: If a key is unknown or missing, or a value is invalid.
        """
        return _from_dict(cls, data, {"relative_noise"},
                          lambda data: {"cost_model": cost_model_from_dict(data["cost_model"])})

    @property
    def holds_no_example(self) -> bool:
        """True when the device cannot hold one example (``max_batch_size == 0``): it sits idle, untimed."""
        return self.max_batch_size == 0

    def describe_cost_model(self) -> str:
        """The model in one form whatever was fitted: "a=1.200 ms c=0.0400 ms/ex" (t(b) = a + c*b).

        A linear model prints its own a and c. Any other model prints the line through its values at the smallest
        and largest probed sizes (for a piecewise-linear fit, its end knots), marked "(piecewise, k knots)". A
        device that cannot hold one example prints "idle: out of memory at 1 example".
        """
        if self.holds_no_example:
            return "idle: out of memory at 1 example"
        return describe_cost_model(self.cost_model, self.probe_batch_sizes[0], self.probe_batch_sizes[-1])


def describe_cost_model(model, smallest_batch_size: int, largest_batch_size: int) -> str:
    """A cost model in the one printed form: "a=1.200 ms c=0.0400 ms/ex" (t(b) = a + c*b, milliseconds).

    A linear model prints its own a and c; any other model the line through its values at the two sizes given
    (the smallest and largest probed), marked "(piecewise, k knots)" or with its type's name.
    """
    if hasattr(model, "fixed_overhead_s") and hasattr(model, "seconds_per_example"):
        a_s, c_s, note = model.fixed_overhead_s, model.seconds_per_example, ""
    else:
        lo, hi = int(smallest_batch_size), int(largest_batch_size)
        t_lo, t_hi = float(model.predict_step_time_s(lo)), float(model.predict_step_time_s(hi))
        c_s = (t_hi - t_lo) / (hi - lo) if hi > lo else 0.0
        a_s = t_lo - c_s * lo
        knots = len(getattr(model, "batch_sizes", ())) or None
        note = f" (piecewise, {knots} knots)" if knots else f" ({type(model).__name__})"
    return f"a={a_s * 1e3:.3f} ms c={c_s * 1e3:.4f} ms/ex{note}"


@dataclasses.dataclass(frozen=True)
class CalibrationResult:
    """Profiles of every compute device (replica order) and the plan solved from them.

    Attributes:
        profiles: One DeviceProfile per replica, replica i = devices[i], length R >= 1.
        wall_time_s: Wall time calibration took (probing and fitting, not run_plan), seconds, >= 0.
        emulated: True when the step times came from emulated devices (see hetero_cs.emulation).
        plan: The BatchPlan solved for the global batch size, or None.
        measured_makespan_s: Measured step time of the plan when calibrate was given run_plan, else None.
        from_cache: True when ``calibrate`` loaded this result from the profile cache instead of probing; then
            ``wall_time_s`` is the time the original calibration took, not time spent now. Not stored in the
            cache (a stored result reads back as False).
        cache_key: The profile cache key this result was loaded from or saved under (None without a cache), so
            that memory caps lowered at run time can be written back to the same entry. Not stored.
        contention_factors: Per replica, how much slower its step ran when all cards stepped at once at the plan
            first solved than when it stepped alone (calibration's concurrent probe), each >= 1 (1.0 for a card
            that plan left idle); None when no such probe ran (one card, a plan that uses one card, a profile
            written before it). ``cost_models`` carry them, ``plan`` was solved again with them.
    """

    profiles: tuple[DeviceProfile, ...]
    wall_time_s: float
    emulated: bool
    plan: BatchPlan | None = None
    measured_makespan_s: float | None = None
    from_cache: bool = dataclasses.field(default=False, compare=False)
    cache_key: str | None = dataclasses.field(default=None, compare=False)
    contention_factors: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "profiles", tuple(self.profiles))
        if self.contention_factors is not None:
            factors = ordered_values(self.contention_factors) or ()
            if len(factors) != len(self.profiles) or not all(finite_real(f) and f >= 1 for f in factors):
                raise ProfileCacheError(f"CalibrationResult.contention_factors must hold one finite number >= 1 per "
                                        f"profile. Received: contention_factors={self.contention_factors!r}. "
                                        "Recalibrate to replace it.")
            object.__setattr__(self, "contention_factors", tuple(float(f) for f in factors))
        if not self.profiles or not all(isinstance(p, DeviceProfile) for p in self.profiles):
            raise ProfileCacheError("CalibrationResult.profiles must be a non-empty sequence of DeviceProfile. "
                                    f"Received: {self.profiles!r}.")
        _finite_non_negative("CalibrationResult", "wall_time_s", self.wall_time_s)
        for name in ("emulated", "from_cache"):
            if not isinstance(getattr(self, name), bool):
                raise ProfileCacheError(f"CalibrationResult.{name} must be a bool. Received: {getattr(self, name)!r}.")
        if self.plan is not None and len(self.plan.per_replica_batch_sizes) != len(self.profiles):
            raise ProfileCacheError("CalibrationResult.plan must have one slice per profile. Received: "
                                    f"len(per_replica_batch_sizes)={len(self.plan.per_replica_batch_sizes)}, "
                                    f"len(profiles)={len(self.profiles)}.")
        if self.measured_makespan_s is not None:
            _finite_non_negative("CalibrationResult", "measured_makespan_s", self.measured_makespan_s)

    @property
    def devices(self) -> tuple[str, ...]:
        """Device names in replica order."""
        return tuple(p.device for p in self.profiles)

    @property
    def cost_models(self) -> tuple[CostModel, ...]:
        """Cost models in replica order, ready for solve_batch_split: each card's own, times its contention factor
        (a ``ScaledCostModel``) where the concurrent probe measured one above 1."""
        factors = self.contention_factors or (1.0,) * len(self.profiles)
        return tuple(p.cost_model if f == 1.0 else ScaledCostModel(p.cost_model, f)
                     for p, f in zip(self.profiles, factors))

    @property
    def max_batch_sizes(self) -> tuple[int | None, ...]:
        """Memory caps in replica order (None = unbounded)."""
        return tuple(p.max_batch_size for p in self.profiles)

    def to_dict(self) -> dict[str, Any]:
        """Returns a JSON-serialisable dict; inverse of from_dict."""
        return _to_dict(self, profiles=[p.to_dict() for p in self.profiles],
                        plan=None if self.plan is None else self.plan.to_dict())

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "CalibrationResult":
        """Rebuilds a result from to_dict output (``contention_factors`` may be missing: None).

        Raises:
            ProfileCacheError: If a key is unknown or missing, or a value is invalid.
        """
        def parse(data: Mapping[str, Any]) -> dict[str, Any]:
            if not isinstance(data["profiles"], list):
                raise ProfileCacheError("CalibrationResult.profiles must be a list. Recalibrate to replace it.")
            return {"profiles": tuple(DeviceProfile.from_dict(p) for p in data["profiles"]),
                    "plan": None if data["plan"] is None else BatchPlan.from_dict(data["plan"])}

        return _from_dict(cls, data, {"contention_factors"}, parse)

    def format_table(self) -> str:
        """A text table: replica, device, cost model, memory cap and fit error per device.

        The first line says whether timings were measured or emulated; the plan, if any, follows the table.
        """
        source = ("EMULATED timings (catalog devices on logical CPU devices; not real hardware)"
                  if self.emulated else "measured timings")
        header = ("replica", "device", "emulated as", "cost model t(b) = a + c*b", "cap (ex)", "fit err", "noise")
        rows = [(str(i), p.device, p.emulated_as or "-", p.describe_cost_model(),
                 "none" if p.max_batch_size is None else str(p.max_batch_size), f"{p.fit_error * 100:.1f} %",
                 f"{p.relative_noise * 100:.1f} %") for i, p in enumerate(self.profiles)]
        widths = [max(len(r[k]) for r in [header, *rows]) for k in range(len(header))]
        took = (f"loaded from the profile cache (calibrated earlier in {self.wall_time_s:.2f} s)" if self.from_cache
                else f"took {self.wall_time_s:.2f} s")
        lines = [f"Calibration of {len(self.profiles)} device(s), {source}, {took}"]
        lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]
        if self.contention_factors is not None:
            lines.append("all cards at once (concurrent probe): each card's step " + ", ".join(
                f"x{f:.3f}" for f in self.contention_factors) + " its time alone; the plan below includes it")
        if self.plan is not None:
            predicted_s = self.plan.predicted_makespan_s
            lines.append(f"solved plan: per_replica_batch_sizes={list(self.plan.per_replica_batch_sizes)} "
                         f"global_batch_size={self.plan.global_batch_size} predicted_makespan_s="
                         f"{'n/a' if predicted_s is None else f'{predicted_s:.6f}'}")
        if self.measured_makespan_s is not None:
            lines.append(f"measured_makespan_s={self.measured_makespan_s:.6f}")
        return "\n".join(lines)
