"""Per-replica step-time models: t_i(b), the seconds one training step takes on replica i with b examples.

A cost model is any object with ``predict_step_time_s(batch_size: int) -> float`` that is non-decreasing in
batch_size (:class:`CostModel`). This module provides the three the library builds itself:

* :class:`LinearCostModel` - ``t(b) = fixed_overhead_s + seconds_per_example * b``;
* :class:`PiecewiseLinearCostModel` - a monotone curve through measured points (what calibration's isotonic fit
  produces when a line does not fit: real GPU curves are flat for small batches, then rise);
* :class:`ScaledCostModel` - ``factor * base(b)``, the online monitor's correction of a calibrated model.

All three are frozen dataclasses validated on construction, serialise with ``to_dict()`` (a ``"kind"`` key plus
the fields) and load with :func:`cost_model_from_dict`. :func:`hetero_cs.planning.cost_checks.check_cost_model`
validates any model's predictions at given batch sizes; the solver uses the same rules.

Pure Python: no TensorFlow, no NVML.
"""

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Protocol, runtime_checkable

from hetero_cs.errors import InvalidCostModelError
from hetero_cs.planning.cost_checks import MAX_SECONDS, _check_base, _check_batch_size
from hetero_cs.planning.plan import _is_int, _is_real, check_keys, even_batch_split

__all__ = ["CostModel", "IdleFreeCostModel", "LinearCostModel", "MicroBatchedCostModel", "PiecewiseLinearCostModel",
           "ScaledCostModel", "cost_model_from_dict"]


@runtime_checkable
class CostModel(Protocol):
    """Anything that predicts one replica's step time from its batch size.

    ``predict_step_time_s(b)`` is the wall time, in seconds, of one training step of this replica on ``b >= 0``
    examples (parameter broadcast, forward, backward, gradient return). It must be finite, ``>= 0`` and
    non-decreasing in ``b``; ``b = 0`` is the cost of an idle replica that still takes part in the step.
    """

    def predict_step_time_s(self, batch_size: int) -> float:
        """Returns the predicted step time in seconds for ``batch_size`` examples."""
        ...


def _check_keys(kind: str, data: Mapping[str, Any], required: set[str]) -> None:
    check_keys(data, required, {"kind"}, error=InvalidCostModelError, what=f"A {kind} cost model dict",
               wrong_keys=lambda unknown, missing: (
                   f"A {kind} cost model dict has keys {sorted(required)} (plus 'kind'). Received: "
                   f"unknown={unknown}, missing={missing}. Write it with to_dict()."))
    if "kind" in data and data["kind"] != kind:
        raise InvalidCostModelError(f"Expected kind={kind!r}. Received: kind={data['kind']!r}.")


class _Stored:
    """``to_dict`` and ``from_dict`` of a cost model dataclass: its ``KIND`` under ``"kind"``, then its fields."""

    KIND = ""

    def to_dict(self) -> dict[str, Any]:
        """Returns ``{"kind": KIND}`` plus the fields (tuples as lists), e.g. ``{"kind": "linear",
        "fixed_overhead_s": ..., "seconds_per_example": ...}``."""
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        return {"kind": self.KIND, **{k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Any:
        """Inverse of :meth:`to_dict`; ``"kind"`` may be omitted. Unknown or missing keys raise."""
        names = [f.name for f in fields(cls) if f.init]
        _check_keys(cls.KIND, data, set(names))
        return cls(**{name: data[name] for name in names})  # __post_init__ checks the values


@dataclass(frozen=True)
class LinearCostModel(_Stored):
    """Affine step time: ``t(b) = fixed_overhead_s + seconds_per_example * b`` seconds.

    Attributes:
        fixed_overhead_s: Seconds per step independent of the batch (launches, parameter broadcast, gradient
            return), finite, >= 0.
        seconds_per_example: Marginal seconds per example, finite, >= 0.

    Raises:
        InvalidCostModelError: If a field is not a finite real number >= 0.

    Examples:
        >>> model = LinearCostModel(fixed_overhead_s=0.005, seconds_per_example=1e-4)
        >>> round(model.predict_step_time_s(100), 6), model.throughput_examples_per_s
        (0.015, 10000.0)
    """

    KIND = "linear"
    fixed_overhead_s: float
    seconds_per_example: float

    def __post_init__(self) -> None:
        for name in ("fixed_overhead_s", "seconds_per_example"):
            value = getattr(self, name)
            if not (_is_real(value) and 0 <= value <= MAX_SECONDS):  # (NaN and inf fail the range)
                raise InvalidCostModelError(
                    f"LinearCostModel.{name} must be a number from 0 to {MAX_SECONDS:g} (seconds). Received: "
                    f"{name}={value!r}. Refit the model from calibration samples.")
            object.__setattr__(self, name, float(value))

    def predict_step_time_s(self, batch_size: int) -> float:
        """Returns ``fixed_overhead_s + seconds_per_example * batch_size`` in seconds (batch_size >= 0)."""
        _check_batch_size(batch_size)
        return self.fixed_overhead_s + self.seconds_per_example * batch_size

    @property
    def throughput_examples_per_s(self) -> float:
        """Marginal throughput ``1 / seconds_per_example`` in examples per second (``inf`` when it is 0)."""
        return math.inf if self.seconds_per_example == 0 else 1.0 / self.seconds_per_example

@dataclass(frozen=True)
class PiecewiseLinearCostModel(_Stored):
    """Monotone piecewise-linear step time through measured points ``(batch_sizes[k], step_times_s[k])``.

    Between points the time is interpolated linearly; below the first point it is constant at the first time
    (small batches are overhead-bound); above the last point it continues with the last segment's slope (clamped
    at >= 0; with a single point the curve is constant).

    Attributes:
        batch_sizes: Knot batch sizes, shape [K], K >= 1, integers >= 0, strictly increasing.
        step_times_s: Step time at each knot in seconds, shape [K], finite, >= 0, non-decreasing.

    Raises:
        InvalidCostModelError: If the lengths differ, a batch size is not an integer >= 0 or not strictly
            increasing, or a time is NaN, negative or decreasing (the message names the offending points).

    Examples:
        >>> model = PiecewiseLinearCostModel((16, 64, 128), (0.010, 0.010, 0.018))
        >>> [round(model.predict_step_time_s(b), 4) for b in (1, 64, 96, 256)]
        [0.01, 0.01, 0.014, 0.034]
    """

    KIND = "piecewise_linear"
    batch_sizes: tuple[int, ...]
    step_times_s: tuple[float, ...]
    _last_slope_s: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            sizes, times = tuple(self.batch_sizes), tuple(self.step_times_s)
        except TypeError as exc:
            raise InvalidCostModelError(
                "PiecewiseLinearCostModel needs sequences batch_sizes and step_times_s. Received: "
                f"batch_sizes={self.batch_sizes!r}, step_times_s={self.step_times_s!r}.") from exc
        if not sizes or len(sizes) != len(times):
            raise InvalidCostModelError(
                "PiecewiseLinearCostModel needs as many step times as batch sizes, at least one. Received: "
                f"len(batch_sizes)={len(sizes)}, len(step_times_s)={len(times)}.")
        if bad := [b for b in sizes if not _is_int(b) or b < 0]:
            raise InvalidCostModelError("PiecewiseLinearCostModel.batch_sizes must be integers >= 0. Received: "
                                        f"batch_sizes={list(sizes)} (offending: {bad}).")
        sizes = tuple(int(b) for b in sizes)
        if k := next((k for k in range(1, len(sizes)) if sizes[k] <= sizes[k - 1]), 0):  # the first out of order
            raise InvalidCostModelError(
                "PiecewiseLinearCostModel.batch_sizes must be strictly increasing. Received: "
                f"batch_sizes[{k - 1}]={sizes[k - 1]}, batch_sizes[{k}]={sizes[k]}. Sort the points and merge "
                "repeated batch sizes (average their times).")
        # (NaN fails the range too)
        if bad_times := [(b, t) for b, t in zip(sizes, times) if not (_is_real(t) and 0 <= t <= MAX_SECONDS)]:
            raise InvalidCostModelError(
                f"PiecewiseLinearCostModel.step_times_s must be from 0 to {MAX_SECONDS:g} seconds. Received "
                f"(batch_size, step_time_s): {bad_times}. Drop failed measurements before fitting.")
        times = tuple(float(t) for t in times)
        if k := next((k for k in range(1, len(times)) if times[k] < times[k - 1]), 0):  # the first that decreases
            raise InvalidCostModelError(
                "PiecewiseLinearCostModel.step_times_s must be non-decreasing in batch size. Received: "
                f"step time {times[k - 1]!r} s at batch_size={sizes[k - 1]} but {times[k]!r} s at "
                f"batch_size={sizes[k]}. Fit the measurements with calibration's isotonic fit "
                "(calibration.fit.fit_cost_model), which makes them monotone.")
        slope = max(0.0, (times[-1] - times[-2]) / (sizes[-1] - sizes[-2])) if len(sizes) >= 2 else 0.0
        for name, value in (("batch_sizes", sizes), ("step_times_s", times), ("_last_slope_s", slope)):
            object.__setattr__(self, name, value)

    def predict_step_time_s(self, batch_size: int) -> float:
        """Returns the interpolated step time in seconds for ``batch_size >= 0`` examples."""
        _check_batch_size(batch_size)
        xs, ys = self.batch_sizes, self.step_times_s
        if batch_size <= xs[0]:
            return ys[0]
        if batch_size >= xs[-1]:
            return ys[-1] + self._last_slope_s * (batch_size - xs[-1])
        k = bisect.bisect_right(xs, batch_size)  # xs[k - 1] <= batch_size < xs[k]
        x0, x1, y0, y1 = xs[k - 1], xs[k], ys[k - 1], ys[k]
        return y0 + (y1 - y0) * ((batch_size - x0) / (x1 - x0))

@dataclass(frozen=True)
class ScaledCostModel(_Stored):
    """``t(b) = factor * base.predict_step_time_s(b)``: a calibrated model corrected by a measured ratio.

    The online monitor uses it when a device drifts (thermal throttling, a co-tenant): ``factor`` is the robust
    ratio of measured to predicted step times.

    Attributes:
        base: Any :class:`CostModel`.
        factor: Multiplier, finite, > 0.

    Raises:
        InvalidCostModelError: If base has no ``predict_step_time_s`` or factor is not a finite number > 0.

    Examples:
        >>> ScaledCostModel(LinearCostModel(0.01, 0.001), 2.0).predict_step_time_s(10)
        0.04
    """

    KIND = "scaled"
    base: CostModel
    factor: float

    def __post_init__(self) -> None:
        _check_base(self)
        if not _is_real(self.factor) or not math.isfinite(self.factor) or self.factor <= 0:
            raise InvalidCostModelError(
                f"ScaledCostModel.factor must be a finite number > 0. Received: factor={self.factor!r}. "
                "A factor comes from measured / predicted step times; drop non-positive measurements.")
        object.__setattr__(self, "factor", float(self.factor))

    def predict_step_time_s(self, batch_size: int) -> float:
        """Returns ``factor * base.predict_step_time_s(batch_size)`` in seconds."""
        return self.factor * self.base.predict_step_time_s(batch_size)

    def to_dict(self) -> dict[str, Any]:
        """Returns ``{"kind": "scaled", "factor": ..., "base": base.to_dict()}``.

        Raises:
            InvalidCostModelError: If base has no ``to_dict``.
        """
        if not callable(to_dict := getattr(self.base, "to_dict", None)):
            raise InvalidCostModelError(
                f"ScaledCostModel.to_dict needs a base with to_dict(). Received: base={self.base!r}. Use one of "
                "LinearCostModel, PiecewiseLinearCostModel or ScaledCostModel as the base.")
        return {"kind": self.KIND, "factor": self.factor, "base": to_dict()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ScaledCostModel":
        """Inverse of :meth:`to_dict`; ``"kind"`` may be omitted. Unknown or missing keys raise."""
        _check_keys(cls.KIND, data, {"factor", "base"})
        return cls(cost_model_from_dict(data["base"]), data["factor"])


@dataclass(frozen=True)
class IdleFreeCostModel:
    """``t(0) = 0`` and ``t(b) = base.predict_step_time_s(b)`` for ``b >= 1``: a replica that gets no examples costs
    nothing, which is what the central-storage engine does with it (no kernel on its device, no wait at the
    barrier; :mod:`hetero_cs.engine.step.idle_replicas`). Still non-decreasing, so the solver stays optimal, and it
    then leaves a card out whenever that is predicted faster: a card whose fixed cost per step exceeds the time
    the others need for the whole batch gets 0 examples.

    Attributes:
        base: Any :class:`CostModel` (its own ``t(0)`` is the fixed cost a working replica pays).

    Examples:
        >>> slow = IdleFreeCostModel(LinearCostModel(0.05, 0.001))
        >>> slow.predict_step_time_s(0), round(slow.predict_step_time_s(1), 6)
        (0.0, 0.051)
    """

    base: CostModel

    def __post_init__(self) -> None:
        _check_base(self)

    def predict_step_time_s(self, batch_size: int) -> float:
        """0.0 for ``batch_size == 0``; else ``base.predict_step_time_s(batch_size)``, in seconds."""
        _check_batch_size(batch_size)
        return 0.0 if batch_size == 0 else self.base.predict_step_time_s(batch_size)


OUT_OF_MEMORY_SECONDS_PER_EXAMPLE = 86_400.0
""":class:`OutOfMemoryCostModel`'s step time per example: one day, a time no plan takes."""


@dataclass(frozen=True)
class OutOfMemoryCostModel(_Stored):
    """The cost model of a device that cannot hold one example (calibration ran out of memory at a batch of 1).

    Nothing could be timed there, so there is no step time to report: ``t(0) = 0`` (it does no work) and
    ``t(b) = OUT_OF_MEMORY_SECONDS_PER_EXAMPLE * b`` for ``b >= 1``, a time no plan takes. Its profile's memory cap
    of 0 keeps the device out of every training plan; the prohibitive time keeps it out of a plan solved without
    the caps too (an evaluation batch larger than the training caps hold).

    Examples:
        >>> model = OutOfMemoryCostModel()
        >>> model.predict_step_time_s(0), model.predict_step_time_s(2)
        (0.0, 172800.0)
    """

    KIND = "out_of_memory"

    def predict_step_time_s(self, batch_size: int) -> float:
        """0.0 for ``batch_size == 0``, else ``OUT_OF_MEMORY_SECONDS_PER_EXAMPLE * batch_size`` seconds."""
        _check_batch_size(batch_size)
        return OUT_OF_MEMORY_SECONDS_PER_EXAMPLE * batch_size


def holds_no_example(model: Any) -> bool:
    """True when ``model`` is (or wraps, through ``base``) an :class:`OutOfMemoryCostModel`: its device takes no
    example, so a split that gives it some (the even split, for comparison) cannot run."""
    for _ in range(16):  # (a chain of bases, followed 16 deep at most)
        if isinstance(model, OutOfMemoryCostModel):
            return True
        model = getattr(model, "base", None)
    return False


@dataclass(frozen=True)
class MicroBatchedCostModel:
    """A replica's time for ``b`` examples run as micro-batches of at most ``max_micro_batch_size`` each, one after
    another on its card within one optimizer step (:mod:`hetero_cs.engine.memory.micro_batches`).

    ``b`` goes in ``k = ceil(b / max_micro_batch_size)`` micro-batches of near-equal size (``q + 1`` examples in
    ``r`` of them and ``q`` in the rest, ``b = k q + r``), each paying ``base``'s full step time, its per-step fixed
    cost included (parameters to the card, gradients back): ``r t(q + 1) + (k - r) t(q)``. No micro-batch waits for
    another card's. Made non-decreasing in ``b`` (the running maximum), so the minimum-makespan solver stays exact
    over it; for a linear ``base`` it is already. ``b = 0`` costs ``base``'s ``t(0)`` (0 for an
    :class:`IdleFreeCostModel`).

    Attributes:
        base: The replica's per-step :class:`CostModel` (one micro-batch is one of its steps).
        max_micro_batch_size: ``m_max >= 1``, the examples its memory holds at once (its memory cap).

    Raises:
        InvalidCostModelError: ``base`` has no ``predict_step_time_s``, or ``max_micro_batch_size`` is not an
            integer >= 1.

    Examples:
        >>> model = MicroBatchedCostModel(LinearCostModel(0.010, 0.001), 16)
        >>> round(model.predict_step_time_s(16) * 1e3, 3), round(model.predict_step_time_s(17) * 1e3, 3)
        (26.0, 37.0)
    """

    base: CostModel
    max_micro_batch_size: int
    _running_max: list = field(default_factory=lambda: [], init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_base(self)
        if not _is_int(self.max_micro_batch_size) or self.max_micro_batch_size < 1:
            raise InvalidCostModelError(
                f"MicroBatchedCostModel.max_micro_batch_size must be an integer >= 1 (the examples the card holds at "
                f"once). Received: max_micro_batch_size={self.max_micro_batch_size!r}.")

    def micro_batches(self, batch_size: int) -> list[int]:
        """The micro-batch sizes ``b`` examples run as, largest first (``[]`` for 0)."""
        _check_batch_size(batch_size)
        return near_equal_micro_batches(int(batch_size), self.max_micro_batch_size)

    def _raw_s(self, batch_size: int) -> float:
        if batch_size == 0:
            return float(self.base.predict_step_time_s(0))
        k = -(-int(batch_size) // self.max_micro_batch_size)
        q, r = divmod(int(batch_size), k)
        lower = float(self.base.predict_step_time_s(q))
        # k t(q) + r (t(q+1) - t(q)): the same sum, but exactly non-decreasing in b for a linear base, flat ones too
        return k * lower + (r * (float(self.base.predict_step_time_s(q + 1)) - lower) if r else 0.0)

    def predict_step_time_s(self, batch_size: int) -> float:
        """``max_{b' <= b}`` of the micro-batches' summed step times, in seconds."""
        _check_batch_size(batch_size)
        b = int(batch_size)
        if _is_linear(self.base):  # k a + c b: non-decreasing as it is
            return self._raw_s(b)
        known = self._running_max
        while len(known) <= b:
            value = self._raw_s(len(known))
            known.append(value if not known else max(value, known[-1]))
        return known[b]


def near_equal_micro_batches(batch_size: int, max_micro_batch_size: int | None) -> list[int]:
    """The micro-batches a slice of ``batch_size`` examples runs as within a cap: ``k = ceil(b / cap)`` of near-equal
    size (``q + 1`` examples in ``r`` of them, then ``q`` in the rest, ``b = k q + r``), largest first; ``[]`` for 0
    examples, ``[b]`` without a cap (None). The rule every engine and :class:`MicroBatchedCostModel` share.

    Examples:
        >>> near_equal_micro_batches(10, 4), near_equal_micro_batches(10, None), near_equal_micro_batches(0, 4)
        ([4, 3, 3], [10], [])
    """
    b = int(batch_size)
    if max_micro_batch_size is not None and (not _is_int(max_micro_batch_size) or max_micro_batch_size < 1):
        raise InvalidCostModelError("A micro-batch cap must be an integer >= 1 (the examples a card holds at once) or "
                                    f"None. Received: max_micro_batch_size={max_micro_batch_size!r}.")
    if b <= 0:
        return []
    return list(even_batch_split(b, 1 if max_micro_batch_size is None else -(-b // int(max_micro_batch_size))))  # ceil


def _is_linear(model: Any) -> bool:
    """True when ``model`` is ``t(b) = a + c b`` for ``b >= 1``: a :class:`LinearCostModel`, maybe scaled or
    idle-free (``t(0) = 0``)."""
    while isinstance(model, (IdleFreeCostModel, ScaledCostModel)):
        model = model.base
    return type(model) is LinearCostModel


def idle_free(cost_models: Sequence[CostModel]) -> list[CostModel]:
    """Each model as an :class:`IdleFreeCostModel` (one already idle-free is kept as it is)."""
    return [m if isinstance(m, IdleFreeCostModel) else IdleFreeCostModel(m) for m in cost_models]


def without_idle_pricing(model: CostModel) -> CostModel:
    """``model`` without an :class:`IdleFreeCostModel` wrapper (also inside a :class:`ScaledCostModel`): the device's
    own curve, as calibrated or updated online, for users and profiles."""
    if isinstance(model, IdleFreeCostModel):
        return model.base
    if isinstance(model, ScaledCostModel) and isinstance(model.base, IdleFreeCostModel):
        return ScaledCostModel(model.base.base, model.factor)
    return model


_KINDS: dict[str, Any] = {kind.KIND: kind for kind in (LinearCostModel, PiecewiseLinearCostModel, ScaledCostModel,
                                                      OutOfMemoryCostModel)}


def cost_model_from_dict(data: Mapping[str, Any]) -> CostModel:
    """Rebuilds a cost model from its ``to_dict()`` output, dispatching on ``data["kind"]``.

    Args:
        data: A mapping with ``"kind"`` in ``{"linear", "piecewise_linear", "scaled", "out_of_memory"}`` and that
            kind's fields.

    Returns:
        The cost model.

    Raises:
        InvalidCostModelError: If data is not a mapping, the kind is missing or unknown, a key is unknown or
            missing, or a value is invalid.

    Examples:
        >>> cost_model_from_dict({"kind": "linear", "fixed_overhead_s": 0.002, "seconds_per_example": 1e-4})
        LinearCostModel(fixed_overhead_s=0.002, seconds_per_example=0.0001)
    """
    if not isinstance(data, Mapping) or not isinstance(data.get("kind"), str) or data["kind"] not in _KINDS:
        kind = data.get("kind") if isinstance(data, Mapping) else None
        raise InvalidCostModelError(f"A cost model dict needs 'kind' in {sorted(_KINDS)}. Received: kind={kind!r} in "
                                    f"{data!r}. Write it with the model's to_dict().")
    return _KINDS[data["kind"]].from_dict(data)
