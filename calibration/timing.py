"""Robust statistics of repeated step timings, and the batch sizes a probe visits (pure: no TensorFlow).

Step times on a shared machine have a heavy right tail (a co-tenant process, a garbage collection, a page fault),
so calibration summarises trials by the median and the median absolute deviation (MAD) instead of the mean and the
standard deviation, and drops samples further than ``outlier_mads`` MADs from the median before summarising.
"""

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from hetero_cs.errors import ConfigError

__all__ = ["TimingStats", "operating_batch_sizes", "probe_batch_sizes", "summarize_trials"]

# A MAD below this fraction of the median is treated as this fraction, so samples that agree to float rounding are
# not declared outliers of one another (a MAD of exactly 0 would otherwise flag every sample not equal to the median).
_MIN_RELATIVE_MAD = 1e-6


@dataclasses.dataclass(frozen=True)
class TimingStats:
    """Summary of repeated timings of one step at one batch size.

    Attributes:
        median_s: Median of the kept samples, seconds, >= 0.
        mad_s: Median absolute deviation of the kept samples from their median, seconds, >= 0 (unscaled: for
            Gaussian noise sigma ~= 1.4826 * mad_s).
        min_s: Smallest kept sample, seconds.
        max_s: Largest kept sample, seconds.
        n: Number of samples kept (the statistics are computed from these), >= 1.
        n_outliers: Number of samples dropped as outliers, >= 0.
    """

    median_s: float
    mad_s: float
    min_s: float
    max_s: float
    n: int
    n_outliers: int

    def __post_init__(self) -> None:
        for name in ("median_s", "mad_s", "min_s", "max_s"):
            if not (math.isfinite(value := getattr(self, name)) and value >= 0.0):
                raise ConfigError(f"TimingStats.{name} must be finite and >= 0. Received: {name}={value!r}.")
        if not self.min_s <= self.median_s <= self.max_s:
            raise ConfigError("TimingStats needs min_s <= median_s <= max_s. Received: "
                              f"min_s={self.min_s!r}, median_s={self.median_s!r}, max_s={self.max_s!r}.")
        if self.n < 1 or self.n_outliers < 0:
            raise ConfigError(f"TimingStats needs n >= 1 and n_outliers >= 0. Received: n={self.n}, "
                              f"n_outliers={self.n_outliers}.")


def summarize_trials(samples_s: Sequence[float], *, outlier_mads: float = 5.0) -> TimingStats:
    """Summarises repeated timings by median and MAD after dropping outliers.

    A sample x is an outlier when ``|x - median| > outlier_mads * max(MAD, 1e-6 * median)``, with median and MAD
    taken over all samples. The returned statistics are recomputed over the kept samples. At most half of the samples
    can be outliers (by definition of the median), so at least one sample is always kept.

    Args:
        samples_s: Step times in seconds, length >= 1, each finite and >= 0.
        outlier_mads: Threshold k in (unscaled) MADs, > 0; 5 MADs is about 3.4 sigma for Gaussian noise.

    Returns:
        The TimingStats of the kept samples.

    Raises:
        ConfigError: If samples_s is empty or holds a negative or non-finite value, or outlier_mads <= 0.

    Examples:
        >>> stats = summarize_trials([0.010, 0.011, 0.010, 0.012, 0.250])  # 0.250 s: a stall
        >>> round(stats.median_s, 6), stats.n, stats.n_outliers
        (0.0105, 4, 1)
    """
    samples = np.asarray(samples_s, dtype=np.float64).reshape(-1)
    if samples.size == 0:
        raise ConfigError("summarize_trials needs at least one sample. Received: samples_s=[]. Run trials >= 1.")
    if not np.all(np.isfinite(samples)) or np.any(samples < 0.0):
        raise ConfigError(f"Timing samples must be finite and >= 0 seconds. Received: samples_s={samples.tolist()!r}.")
    if not (math.isfinite(outlier_mads) and outlier_mads > 0.0):
        raise ConfigError(f"outlier_mads must be finite and > 0. Received: outlier_mads={outlier_mads!r}.")
    median = float(np.median(samples))
    mad = float(np.median(np.abs(samples - median)))
    threshold = outlier_mads * max(mad, _MIN_RELATIVE_MAD * median)
    kept = samples[np.abs(samples - median) <= threshold]
    if kept.size == 0:  # Only reachable when every sample is 0.0 and the threshold is 0.
        kept = samples
    kept_median = float(np.median(kept))
    return TimingStats(median_s=kept_median, mad_s=float(np.median(np.abs(kept - kept_median))),
                       min_s=float(kept.min()), max_s=float(kept.max()), n=int(kept.size),
                       n_outliers=int(samples.size - kept.size))


def probe_batch_sizes(max_batch_size: int, *, num: int = 5, min_batch_size: int = 1) -> tuple[int, ...]:
    """Returns up to ``num`` geometrically spaced batch sizes from min_batch_size to max_batch_size.

    Geometric spacing puts as many probes in [1, 16] as in [16, 256], so a fit sees both the fixed per-step overhead
    (which dominates small batches) and the per-example slope (which dominates large ones). Sizes are rounded to
    integers and deduplicated, so fewer than ``num`` come back when the range is narrow.

    Args:
        max_batch_size: Largest size, >= min_batch_size; always included.
        num: Number of sizes wanted, >= 1. With num == 1 only max_batch_size is returned.
        min_batch_size: Smallest size, >= 1; included when num >= 2.

    Returns:
        Strictly increasing batch sizes, each in [min_batch_size, max_batch_size].

    Raises:
        ConfigError: If an argument is out of range.

    Examples:
        >>> probe_batch_sizes(256)
        (1, 4, 16, 64, 256)
    """
    for name, value in (("max_batch_size", max_batch_size), ("num", num), ("min_batch_size", min_batch_size)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ConfigError(f"probe_batch_sizes needs an integer {name} >= 1. Received: {name}={value!r}.")
    if max_batch_size < min_batch_size:
        raise ConfigError("probe_batch_sizes needs max_batch_size >= min_batch_size. Received: "
                          f"max_batch_size={max_batch_size}, min_batch_size={min_batch_size}.")
    sizes = np.rint(np.geomspace(min_batch_size, max_batch_size, num=num)).astype(np.int64)  # within the bounds
    sizes[0], sizes[-1] = min_batch_size, max_batch_size  # num == 1: [max_batch_size]
    return tuple(int(b) for b in np.unique(sizes))


def operating_batch_sizes(batch_size: int, *, max_batch_size: int | None = None) -> tuple[int, ...]:
    """The sizes to probe around a plan's slice ``b``: ``b / 1.25``, ``b`` and ``1.25 b``, rounded, in [1, cap].

    A re-solved plan moves a slice by a few examples; the neighbours keep the refitted curve measured there too.

    Examples:
        >>> operating_batch_sizes(16), operating_batch_sizes(1), operating_batch_sizes(40, max_batch_size=45)
        ((13, 16, 20), (1,), (32, 40, 45))
    """
    top = batch_size if max_batch_size is None else max(1, min(batch_size, max_batch_size))
    cap = math.inf if max_batch_size is None else max_batch_size
    return tuple(sorted({max(1, round(top / 1.25)), top, int(min(cap, round(top * 1.25)))}))
