"""The statistics a comparison reports, over seeds: a mean with its 95% confidence interval (Student's t), and a
model's difference to the baseline paired by seed (the same data order), with its interval and the paired t-test's
p-value. Seeds are few (3 to 5), so the t-distribution, not the normal, sets the intervals' width.

Pure functions of lists of numbers (scipy for the t-distribution); ``tests/test_stats.py`` checks them against the
formulas written out.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

__all__ = ["Interval", "PairedDifference", "mean_interval", "paired_difference"]

CONFIDENCE = 0.95


@dataclass(frozen=True)
class Interval:
    """``mean`` +- ``half_width`` holds the true mean with probability ``confidence`` (``half_width`` None for one
    value: no spread to measure); ``sd`` the sample standard deviation, ``n`` the number of values."""

    mean: float
    half_width: float | None
    sd: float | None
    n: int
    confidence: float = CONFIDENCE

    @property
    def low(self) -> float | None:
        return None if self.half_width is None else self.mean - self.half_width

    @property
    def high(self) -> float | None:
        return None if self.half_width is None else self.mean + self.half_width


@dataclass(frozen=True)
class PairedDifference:
    """A model's value minus the baseline's, seed by seed: the ``interval`` of its mean, and the two-sided p-value
    of the paired t-test (None below two pairs, or with no spread: a zero sd makes t infinite or undefined)."""

    interval: Interval
    p_value: float | None


def mean_interval(values: list[float], confidence: float = CONFIDENCE) -> Interval:
    """Mean of ``values`` and its ``confidence`` interval: mean +- t_{(1 + confidence) / 2, n - 1} sd / sqrt(n)."""
    from scipy.stats import t

    n = len(values)
    if n == 0:
        raise ValueError("mean_interval needs at least one value")
    mean = statistics.fmean(values)
    if n == 1:
        return Interval(mean, None, None, 1, confidence)
    sd = statistics.stdev(values)
    return Interval(mean, float(t.ppf((1 + confidence) / 2, n - 1)) * sd / math.sqrt(n), sd, n, confidence)


def paired_difference(values: list[float], baseline: list[float], confidence: float = CONFIDENCE) -> PairedDifference:
    """``values[i] - baseline[i]`` (pairs of one seed): their mean's interval and the paired t-test's two-sided
    p-value, 2 P(T_{n-1} > |mean / (sd / sqrt(n))|)."""
    from scipy.stats import t

    if len(values) != len(baseline):
        raise ValueError(f"paired_difference needs pairs: {len(values)} values, {len(baseline)} baseline values")
    differences = [a - b for a, b in zip(values, baseline)]
    interval = mean_interval(differences, confidence)
    if interval.sd is None or interval.sd == 0:
        return PairedDifference(interval, None)
    statistic = interval.mean / (interval.sd / math.sqrt(interval.n))
    return PairedDifference(interval, float(2 * t.sf(abs(statistic), interval.n - 1)))
