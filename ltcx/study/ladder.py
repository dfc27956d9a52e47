"""The compute ladder's maths: a power law of loss in training compute per architecture, its uncertainty, the
frontier, and the compute multiplier against the baseline.

* ``fit_power_law``: ``log L = log a + b log C`` by least squares over every (compute, loss) point (each seed of
  each size), with the standard errors of ``log a`` and ``b`` (scipy's ``linregress``; none below 3 points);
* ``compute_multiplier``: at an architecture's compute ``C`` and the loss ``L`` it reached, the compute the
  baseline's fit needs for that loss, ``C_base(L) = exp((log L - log a0) / b0)``, over ``C``: above 1 the
  architecture reaches the loss with less compute. Computed seed by seed (each seed's own fits: the baseline's and
  the loss at that size), its interval is the seeds' 95% t interval of ``log M``, reported as ``exp``;
* ``frontier``: the lowest loss reached at or below each compute, whichever architecture reached it.

Pure functions of numbers; ``tests/test_study.py`` checks them on synthetic power-law data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Multiplier", "PowerLaw", "compute_multiplier", "fit_power_law", "frontier"]


@dataclass(frozen=True)
class PowerLaw:
    """``L = a C^b``: ``log_a`` and ``b`` with their standard errors (None below 3 points), ``n`` points, ``r2``."""

    log_a: float
    b: float
    log_a_se: float | None
    b_se: float | None
    n: int
    r2: float | None

    def loss(self, compute: float) -> float:
        return math.exp(self.log_a + self.b * math.log(compute))

    def compute_for(self, loss: float) -> float:
        """The compute at which the fit reaches ``loss``."""
        return math.exp((math.log(loss) - self.log_a) / self.b)

    def describe(self) -> str:
        se = lambda v: "" if v is None else f" +- {v:.3g}"  # noqa: E731
        return f"L = exp({self.log_a:.4g}{se(self.log_a_se)}) C^({self.b:.4g}{se(self.b_se)})"


def fit_power_law(compute: list[float], loss: list[float]) -> PowerLaw:
    """Least squares of ``log loss`` on ``log compute``; needs two distinct computes and positive values."""
    from scipy.stats import linregress

    if len(compute) != len(loss) or len(set(compute)) < 2:
        raise ValueError("a power-law fit needs points at two computes at least")
    if min(compute) <= 0 or min(loss) <= 0:
        raise ValueError("a power-law fit needs positive computes and losses")
    x = [math.log(c) for c in compute]
    y = [math.log(v) for v in loss]
    fit = linregress(x, y)
    n = len(x)
    exact = n < 3
    return PowerLaw(float(fit.intercept), float(fit.slope), None if exact else float(fit.intercept_stderr),
                    None if exact else float(fit.stderr), n, None if exact else float(fit.rvalue ** 2))


@dataclass(frozen=True)
class Multiplier:
    """The compute multiplier (geometric mean over seeds) and its 95% interval (None for one seed)."""

    value: float
    low: float | None
    high: float | None
    per_seed: list[float]


def compute_multiplier(baseline_fits: list[PowerLaw], compute: float, losses: list[float]) -> Multiplier:
    """``baseline_fits[i]`` (seed i's baseline fit) and ``losses[i]`` (seed i's loss of the architecture at
    ``compute``): the multiplier seed by seed and its interval (``ltcx.study.stats.mean_interval`` of the logs)."""
    from ltcx.study.stats import mean_interval

    if len(baseline_fits) != len(losses) or not losses:
        raise ValueError("compute_multiplier needs one baseline fit per seed's loss")
    logs = [math.log(fit.compute_for(loss) / compute) for fit, loss in zip(baseline_fits, losses)]
    interval = mean_interval(logs)
    return Multiplier(math.exp(interval.mean), None if interval.low is None else math.exp(interval.low),
                      None if interval.high is None else math.exp(interval.high), [math.exp(v) for v in logs])


def frontier(points: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """The points (compute, loss, architecture) that no point of less or equal compute beats: the lower envelope,
    by compute."""
    best: list[tuple[float, float, str]] = []
    for point in sorted(points, key=lambda p: (p[0], p[1])):
        if not best or point[1] < best[-1][1]:
            best.append(point)
    return best
