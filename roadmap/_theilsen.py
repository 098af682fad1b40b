"""Theil-Sen's line (Sen, 1968): the median of the slopes between every pair of points, with the
rank-based confidence interval of the slope that Sen gives, corrected for ties.

A trend has a few dozen points at most, so the pairs are counted in plain Python: importing
scipy.stats for its `theilslopes` costs about half a second, more than half of what a status
may take. tests/test_trends.py holds this against scipy's on random and tied series.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple


class Fit(NamedTuple):
    slope: float
    intercept: float
    low_slope: float
    high_slope: float


def theil_sen(y: Sequence[float], x: Sequence[float], confidence: float = 0.95) -> Fit:
    """The line through (x, y): slope and intercept (the median of y less the slope times the
    median of x), and the slope's two-sided `confidence` interval."""
    if len(x) != len(y) or len(x) < 2:
        raise ValueError("Theil-Sen needs two or more (x, y) points of the same count")
    slopes = sorted(
        (y[j] - y[i]) / (x[j] - x[i]) for i in range(len(x)) for j in range(len(x)) if x[j] > x[i]
    )
    if not slopes:
        raise ValueError("Theil-Sen needs two different x values")
    slope = statistics.median(slopes)
    intercept = statistics.median(y) - slope * statistics.median(x)
    # Kendall's S has this variance under no trend; tied values in x or y lower it.
    n = len(y)

    def ties(values: Sequence[float]) -> int:
        return sum(k * (k - 1) * (2 * k + 5) for k in Counter(values).values() if k > 1)

    sigma = math.sqrt((n * (n - 1) * (2 * n + 5) - ties(x) - ties(y)) / 18)
    z = statistics.NormalDist().inv_cdf((1 + confidence) / 2)
    count = len(slopes)
    upper = min(round((count + z * sigma) / 2), count - 1)
    lower = max(round((count - z * sigma) / 2) - 1, 0)
    return Fit(slope, intercept, slopes[lower], slopes[upper])
