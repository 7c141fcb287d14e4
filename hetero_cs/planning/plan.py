"""BatchPlan: how one global batch is cut into per-replica slices, with the predicted step times.

A plan is plain, validated, immutable data: the slices ``b`` (shape [R], integers >= 0, summing to the global
batch ``B > 0``) and, when cost models were known, the predicted makespan ``max_i t_i(b_i)``, the makespan of the
even split (what stock CentralStorageStrategy would do) and the ideal makespan (the continuous lower bound, see
:func:`hetero_cs.planning.solver.ideal_makespan_s`). It round-trips exactly through JSON.

This module also holds the two fixed splitting rules, :func:`even_batch_split` and :func:`split_by_shares`, and
:func:`hetero_cs.planning.solver.plan_from_split`, which wraps any split in a plan with its predictions.

Pure Python: no TensorFlow, no NVML.
"""

import json
import math
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any

from hetero_cs.errors import BatchSplitError, ConfigError

__all__ = ["BatchPlan", "even_batch_split", "split_by_shares"]

_OPTIONAL_FIGURES = ("predicted_makespan_s", "even_split_makespan_s", "ideal_makespan_s")
_KEYS = ("per_replica_batch_sizes", "global_batch_size", *_OPTIONAL_FIGURES, "predicted_step_times_s")


def _is_int(value: Any) -> bool:
    # A Python int first: the ABC check costs tens of microseconds in a step's host callbacks (serving, recording).
    return type(value) is int or isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return type(value) in (int, float) or isinstance(value, numbers.Real) and not isinstance(value, bool)


def _as_tuple(values: Any) -> tuple | None:
    """values as a tuple if it is a non-string iterable (list, tuple, numpy array), else None."""
    return None if isinstance(values, (str, bytes)) or not isinstance(values, Iterable) else tuple(values)


def ordered_values(values: Any) -> tuple | None:
    """values as a tuple if it is an ordered sequence (list, tuple, range, 1-D array), else None.

    Sets, dicts and other iterables without an index order (generators included) give None: their iteration order
    is not a replica order, so taking it would reorder shares silently.
    """
    ordered = isinstance(values, Sequence) or getattr(values, "ndim", None) == 1
    return tuple(values) if ordered and not isinstance(values, (str, bytes, Mapping, Set)) else None


def unordered_note(values: Any) -> str:
    """' (a set, which has no replica order)' and the like for an iterable that ordered_values refuses, else ''."""
    if isinstance(values, (Mapping, Set)):
        return f" (a {type(values).__name__}, which has no replica order)"
    if isinstance(values, Iterable) and not isinstance(values, (str, bytes)) and ordered_values(values) is None:
        return f" (a {type(values).__name__}, not a sequence: make it a list)"
    return ""


def finite_real(value: Any) -> bool:
    """A real number (not a bool) that converts to a finite float; an int too large for a float is not one."""
    if not _is_real(value):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def check_range(name: str, value: Any, low: float, high: float = math.inf, *, low_open: bool = False,
                high_open: bool = True, integer: bool = False, hint: str = "") -> None:
    """Raises ConfigError ``"{name} must be <a number> <in the range> (<hint>). Received: {name}={value!r}."`` unless
    ``value`` is a real number (an integer when ``integer``; never a bool or NaN) from ``low`` to ``high``, each end
    open or closed as asked. A range open above infinity holds finite numbers only."""
    real = _is_int(value) if integer else _is_real(value) and not math.isnan(value)
    if real and (low < value if low_open else low <= value) and (value < high if high_open else value <= high):
        return
    kind = "an integer" if integer else "a finite number" if high == math.inf and high_open else "a number"
    bounds = (f"{'>' if low_open else '>='} {low}" if high == math.inf else
              f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}")
    raise ConfigError(f"{name} must be {kind} {bounds}{f' ({hint})' if hint else ''}. Received: {name}={value!r}.")


def short_repr(values: Any, limit: int = 200) -> str:
    """repr(values), cut to limit characters (and safe for ints too long for Python to print)."""
    try:
        text = repr(values)
    except ValueError:  # int larger than sys.get_int_max_str_digits()
        text = f"<{type(values).__name__} too large to print>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_keys(data: Any, required: Iterable[str], optional: Iterable[str] = (), *, error: type[Exception],
               what: str, wrong_keys: Callable[[list, list], str]) -> None:
    """Checks a stored dict before it is read: raises ``error`` where ``data`` is not a mapping (a message naming
    ``what``), has a key outside ``required`` and ``optional``, or lacks a required one (the message
    ``wrong_keys(unknown, missing)`` words, from both sorted lists)."""
    if not isinstance(data, Mapping):
        raise error(f"{what} needs a mapping. Received: {short_repr(data)}.")
    unknown = sorted(set(data) - set(required) - set(optional))
    missing = sorted(set(required) - set(data))
    if unknown or missing:
        raise error(wrong_keys(unknown, missing))


def _checked_seconds(name: str, value: Any) -> float:
    if not _is_real(value) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"BatchPlan.{name} must be None or a finite number of seconds >= 0. Received: "
                          f"{name}={value!r}.")
    return float(value)


@dataclass(frozen=True)
class BatchPlan:
    """One global batch cut into per-replica slices, with the predicted step times when known.

    Attributes:
        per_replica_batch_sizes: b, examples per replica in replica-id order, shape [R], R >= 1, integers >= 0.
        global_batch_size: B = sum(b) > 0, examples per optimizer step.
        predicted_makespan_s: max_i t_i(b_i) in seconds under the cost models, or None.
        even_split_makespan_s: The makespan of :func:`even_batch_split` (B, R) under the same models, in seconds,
            or None. It ignores memory caps: it is what the stock, evenly splitting strategy would run. None also
            when a device holds no example (an ``OutOfMemoryCostModel``): no even split can run there.
        ideal_makespan_s: The continuous lower bound in seconds (examples infinitely divisible; see
            :func:`hetero_cs.planning.solver.ideal_makespan_s`), or None.
        predicted_step_times_s: t_i(b_i) in seconds, shape [R], or None.

    Raises:
        ConfigError: If a slice is not an integer >= 0, the slices do not sum to global_batch_size, B <= 0, a
            figure is negative, NaN or infinite, or predicted_step_times_s has the wrong length.

    Examples:
        >>> plan = BatchPlan((160, 48, 48), 256, predicted_makespan_s=0.010, even_split_makespan_s=0.0155)
        >>> plan.replica_weights, round(plan.predicted_speedup_vs_even, 2)
        ((0.625, 0.1875, 0.1875), 1.55)
    """

    per_replica_batch_sizes: tuple[int, ...]
    global_batch_size: int
    predicted_makespan_s: float | None = None
    even_split_makespan_s: float | None = None
    ideal_makespan_s: float | None = None
    predicted_step_times_s: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        sizes = _as_tuple(self.per_replica_batch_sizes)
        if not sizes:
            raise ConfigError("BatchPlan.per_replica_batch_sizes must be a non-empty sequence of integers. Received: "
                              f"per_replica_batch_sizes={self.per_replica_batch_sizes!r}.")
        if bad := [(i, b) for i, b in enumerate(sizes) if not _is_int(b) or b < 0]:
            raise ConfigError("BatchPlan.per_replica_batch_sizes must hold integers >= 0. Received: "
                              f"per_replica_batch_sizes={tuple(sizes)!r} (offending (replica, value): {bad}).")
        sizes = tuple(int(b) for b in sizes)
        B = self.global_batch_size
        if not _is_int(B) or B <= 0:
            raise ConfigError(f"BatchPlan.global_batch_size must be an integer > 0. Received: global_batch_size={B!r}.")
        if sum(sizes) != B:
            raise ConfigError(
                f"per_replica_batch_sizes={sizes} sum to {sum(sizes)}, not global_batch_size={B}. Every example "
                "of the global batch goes to exactly one replica; fix the slices or the global batch size.")
        object.__setattr__(self, "per_replica_batch_sizes", sizes)
        object.__setattr__(self, "global_batch_size", int(B))
        for name in (name for name in _OPTIONAL_FIGURES if getattr(self, name) is not None):
            object.__setattr__(self, name, _checked_seconds(name, getattr(self, name)))
        if self.predicted_step_times_s is not None:
            times = _as_tuple(self.predicted_step_times_s)
            if times is None or len(times) != len(sizes):
                raise ConfigError(
                    "BatchPlan.predicted_step_times_s must be None or hold one time per replica. Received: "
                    f"predicted_step_times_s={self.predicted_step_times_s!r} for {len(sizes)} replicas.")
            object.__setattr__(
                self, "predicted_step_times_s", tuple(_checked_seconds("predicted_step_times_s", t) for t in times))

    @property
    def num_replicas(self) -> int:
        """R, the number of replicas (slices)."""
        return len(self.per_replica_batch_sizes)

    @property
    def replica_weights(self) -> tuple[float, ...]:
        """b_i / B per replica, shape [R], summing to 1: each replica's weight in the gradient average."""
        B = self.global_batch_size
        return tuple(b / B for b in self.per_replica_batch_sizes)

    @property
    def predicted_speedup_vs_even(self) -> float | None:
        """even_split_makespan_s / predicted_makespan_s, or None when either is unknown or the makespan is 0."""
        return ratio(self.even_split_makespan_s, self.predicted_makespan_s)

    @property
    def efficiency(self) -> float | None:
        """ideal_makespan_s / predicted_makespan_s in [0, 1], or None when either is unknown or the makespan is 0."""
        return ratio(self.ideal_makespan_s, self.predicted_makespan_s)

    def to_dict(self) -> dict[str, Any]:
        """Returns a JSON-serialisable dict with every field (lists for tuples); inverse of :meth:`from_dict`."""
        return {key: list(value) if isinstance(value, tuple) else value for key, value in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "BatchPlan":
        """Rebuilds a plan from :meth:`to_dict` output; the optional figures may be omitted.

        Raises:
            ConfigError: If data is not a mapping, a key is unknown, a required key is missing, or a value is
                invalid.
        """
        check_keys(data, _KEYS[:2], _KEYS[2:], error=ConfigError, what="BatchPlan.from_dict",
                   wrong_keys=lambda unknown, missing: (
                       f"BatchPlan dict keys are {list(_KEYS)} (the last four optional). Received: "
                       f"unknown={unknown}, missing={missing}. Write it with BatchPlan.to_dict()."))
        return cls(**data)

    def to_json(self) -> str:
        """Returns the plan as a JSON object (floats written exactly, so from_json gives an equal plan)."""
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> "BatchPlan":
        """Inverse of :meth:`to_json`.

        Raises:
            ConfigError: If text is not JSON, or as :meth:`from_dict`.
        """
        try:
            data = json.loads(text)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"BatchPlan.from_json needs a JSON object written by to_json(): {exc}.") from exc
        return cls.from_dict(data)

    def __str__(self) -> str:
        times = self.predicted_step_times_s
        lines = [f"BatchPlan: global_batch_size={self.global_batch_size} on {self.num_replicas} "
                 f"replica{'' if self.num_replicas == 1 else 's'}",
                 f"{'replica':>7}  {'slice':>7}  {'weight':>7}  {'predicted step ms':>17}"]
        for i, (b, w) in enumerate(zip(self.per_replica_batch_sizes, self.replica_weights)):
            step = "idle" if b == 0 else "n/a" if times is None else f"{times[i] * 1e3:.3f}"
            lines.append(f"{i:>7}  {b:>7}  {w:>7.4f}  {step:>17}")
        if idle := [i for i, b in enumerate(self.per_replica_batch_sizes) if b == 0]:
            lines.append(f"idle replicas: {idle} (0 examples: no work on their devices; the rest finish sooner "
                         f"without them, or there are fewer examples than replicas, or their share or memory cap is "
                         f"0: a card that cannot hold one example, or one set aside after a device error)")

        speedup, efficiency = self.predicted_speedup_vs_even, self.efficiency
        lines += [f"predicted makespan: {ms_text(self.predicted_makespan_s)}",
                  f"even split makespan: {ms_text(self.even_split_makespan_s)}",
                  f"ideal makespan: {ms_text(self.ideal_makespan_s)}",
                  f"predicted speedup vs even: {'n/a' if speedup is None else f'{speedup:.3f}x'}",
                  f"efficiency (ideal / predicted): {'n/a' if efficiency is None else f'{efficiency:.3f}'}"]
        return "\n".join(lines)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, or None when either is unknown (None) or the denominator is 0."""
    return None if numerator is None or not denominator else numerator / denominator


def ms_text(seconds: float | None) -> str:
    """``seconds`` as ``"12.345 ms"``, or ``"n/a"`` for None (a figure nothing predicted)."""
    return "n/a" if seconds is None else f"{seconds * 1e3:.3f} ms"


def _checked_global_batch_size(global_batch_size: Any, *, allow_zero: bool) -> int:
    check_range("global_batch_size", global_batch_size, 0 if allow_zero else 1, integer=True)
    return int(global_batch_size)


def even_batch_split(global_batch_size: int, num_replicas: int) -> tuple[int, ...]:
    """Splits B examples as evenly as possible: B // R each, and the first B % R replicas get one more.

    This is stock CentralStorageStrategy's rule (for B divisible by R) made total and deterministic.

    Args:
        global_batch_size: B, integer >= 0.
        num_replicas: R, integer >= 1.

    Returns:
        Slices, shape [R], summing to B; they differ by at most one, larger ones first.

    Raises:
        ConfigError: If B < 0 or R < 1 or either is not an integer.

    Examples:
        >>> even_batch_split(10, 4)
        (3, 3, 2, 2)
    """
    B = _checked_global_batch_size(global_batch_size, allow_zero=True)
    check_range("num_replicas", num_replicas, 1, integer=True)
    q, r = divmod(B, int(num_replicas))
    return tuple(q + 1 if i < r else q for i in range(int(num_replicas)))


def split_by_shares(global_batch_size: int, shares: Sequence[float]) -> tuple[int, ...]:
    """Splits B examples in proportion to fixed shares, by the largest-remainder (Hamilton) method.

    Replica i first gets floor(B * s_i / sum(s)); the examples left over go one each to the replicas with the
    largest fractional parts, ties to the lower replica index. Arithmetic is exact (shares are converted to
    fractions), so the result does not depend on rounding. Every slice is within one example of its exact quota,
    and a replica with share 0 gets 0 examples.

    Args:
        global_batch_size: B, integer >= 0.
        shares: Relative shares, an ordered sequence (list, tuple, 1-D array) with one per replica, shape [R],
            R >= 1; finite, >= 0, not all zero, with a sum a float holds. Only ratios matter: (2, 1, 1) and
            (0.5, 0.25, 0.25) give the same split.

    Returns:
        Slices, shape [R], summing to B.

    Raises:
        ConfigError: If B is not an integer >= 0.
        BatchSplitError: If shares is empty or not an ordered sequence (a set or dict has no replica order), holds
            a value that is not a finite number >= 0 (an int too large for a float is not finite), is all zero, or
            sums to more than a float holds.

    Examples:
        >>> split_by_shares(10, [2, 1, 1])
        (5, 3, 2)
    """
    B = _checked_global_batch_size(global_batch_size, allow_zero=True)
    given = shares
    shares = ordered_values(shares)  # type: ignore[assignment]
    if not shares:
        raise BatchSplitError(
            f"shares must be a non-empty sequence of numbers (an ordered one: list, tuple or 1-D array), one per "
            f"replica in replica order. Received: shares={short_repr(given)}{unordered_note(given)}. Pass e.g. "
            "[2, 1, 1] to give replica 0 half the batch.")
    if bad := [(i, s) for i, s in enumerate(shares) if not finite_real(s) or s < 0]:
        raise BatchSplitError(
            f"shares must be finite numbers >= 0. Received: shares={short_repr(list(shares))} (offending (replica, "
            f"share): {short_repr(bad)}). Give each replica a non-negative relative share, e.g. [2, 1, 1].")
    if not math.isfinite(sum(float(s) for s in shares)):
        raise BatchSplitError(f"shares sum to more than a float holds: shares={short_repr(list(shares))}. Only their "
                              "ratios matter; scale them down, e.g. [2, 1, 1].")
    exact = [_exact_fraction(s) for s in shares]
    if (total := sum(exact)) == 0:
        raise BatchSplitError(f"shares are all zero: shares={list(shares)!r}. At least one replica needs a positive "
                              "share, e.g. [1] * num_replicas for an even split.")
    quotas = [B * s / total for s in exact]
    sizes = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(len(sizes)), key=lambda i: (sizes[i] - quotas[i], i))  # largest remainder first
    extra = set(by_remainder[:B - sum(sizes)])  # one more example each
    return tuple(int(b) + (i in extra) for i, b in enumerate(sizes))


def _exact_fraction(value: Any) -> Fraction:
    """A finite real (Python, numpy int or float of any width) as an exact Fraction."""
    if isinstance(value, numbers.Rational):
        return Fraction(int(value.numerator), int(value.denominator))
    return Fraction(float(value))  # numpy float32 / float16 are Reals but not accepted by Fraction() directly
