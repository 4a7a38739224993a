"""Paired bootstrap intervals for per-question scores of two or three configurations.

Every configuration answers the same questions over the same chunks, so differences are paired:
resampling questions (with replacement) keeps each question's scores together, and the interval
reflects how much the difference depends on which questions were drawn. Percentile intervals,
seeded, with the same resamples for every statistic of one table so their intervals agree.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float
    high: float

    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0

    def scaled(self, factor: float) -> "Interval":
        return Interval(self.estimate * factor, self.low * factor, self.high * factor)


class PairedBootstrap:
    """``resamples`` draws of question indices, fixed by ``seed``, shared by every call."""

    def __init__(self, n: int, resamples: int = 5000, seed: int = 0, level: float = 0.95):
        if n < 1:
            raise ValueError(f"A bootstrap needs at least one question, got n={n}.")
        if not 0 < level < 1:
            raise ValueError(f"level must be in (0, 1), got {level}.")
        self.n, self.level = n, level
        self.rows = np.random.default_rng(seed).integers(0, n, size=(resamples, n))

    def _check(self, *arrays) -> list[np.ndarray]:
        out = [np.asarray(a, dtype=np.float64) for a in arrays]
        for a in out:
            if a.shape != (self.n,):
                raise ValueError(f"Expected {self.n} paired per-question scores, got shape {a.shape}.")
        return out

    def _interval(self, estimate: float, draws: np.ndarray) -> Interval:
        draws = draws[np.isfinite(draws)]
        if not draws.size:
            return Interval(estimate, math.nan, math.nan)
        tail = (1 - self.level) / 2 * 100
        low, high = np.percentile(draws, [tail, 100 - tail])
        return Interval(float(estimate), float(low), float(high))

    def mean(self, values) -> Interval:
        """mean(values) over the questions, with its interval (e.g. agreement with full)."""
        (v,) = self._check(values)
        return self._interval(v.mean(), v[self.rows].mean(axis=1))

    def mean_difference(self, config, reference) -> Interval:
        """mean(config - reference) over the questions, with its interval."""
        c, r = self._check(config, reference)
        d = c - r
        return self._interval(d.mean(), d[self.rows].mean(axis=1))

    def ratio_of_means(self, config, reference) -> Interval:
        """mean(config) / mean(reference) (e.g. a configuration's KL to full over plain lazy's).
        Resamples whose reference mean is zero are left out; NaN when the observed one is zero."""
        c, r = self._check(config, reference)
        estimate = c.mean() / r.mean() if r.mean() else math.nan
        means = r[self.rows].mean(axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            draws = np.where(means != 0, c[self.rows].mean(axis=1) / means, np.nan)
        return self._interval(estimate, draws)

    def gap_closed(self, config, lower, upper) -> Interval:
        """(mean(config) - mean(lower)) / (mean(upper) - mean(lower)): the share of the gap
        between ``lower`` (plain reuse) and ``upper`` (full re-encoding) that ``config`` closes.
        Resamples whose gap is zero are left out; NaN when the observed gap is zero."""
        c, lo, up = self._check(config, lower, upper)
        gap = up.mean() - lo.mean()
        estimate = (c.mean() - lo.mean()) / gap if gap else math.nan
        gaps = up[self.rows].mean(axis=1) - lo[self.rows].mean(axis=1)
        gains = c[self.rows].mean(axis=1) - lo[self.rows].mean(axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            draws = np.where(gaps != 0, gains / gaps, np.nan)
        return self._interval(estimate, draws)
