"""Whether an unmet criterion is getting there: its history, a robust trend, and the date the
trend would cross the threshold, "if it holds".

The history of a criterion is every result it would accept but for freshness: the same gate,
backend, baseline and pinned settings, across engine versions and builds (progress spans
builds). The slope is Theil-Sen's, with its confidence interval (roadmap/_theilsen.py), so
one outlier does not bend it; a date is never given from fewer than three points or from a
series that does not move toward the threshold.
"""

from __future__ import annotations

import fnmatch
import statistics
from datetime import datetime, timedelta
from typing import Literal

from pydantic import BaseModel

from kdctl.inventory.models import parse_threshold
from kdctl.records import GateResult, Metric
from kdctl.roadmap._theilsen import theil_sen

Direction = Literal["toward", "away", "flat", "too few points"]

# The recent points a slope is fitted to: progress months ago says little about next week.
RECENT = 12
MIN_POINTS = 3
# A forecast from points hours apart extrapolates noise: the series must span a day.
MIN_SPAN_DAYS = 1.0


class TrendPoint(BaseModel):
    at: datetime
    value: float
    # Where it was measured: a chart marks where the engine changed between points.
    engine_version: str | None = None
    model: str | None = None
    host: str | None = None
    # The machine itself (its id and GPU serials), where the result was bound to it: a box
    # replaced under the same inventory name is another machine.
    host_id: str | None = None
    # Days the result was dated back from when it was measured (kdctl sandbox history does, to
    # show a forecast): its place in time is set, not measured.
    dated_back_days: float | None = None
    evidence_id: str


class Trend(BaseModel):
    # The requirement followed: a metric pattern and its threshold.
    metric: str | None = None
    threshold: str | None = None
    points: int
    direction: Direction
    slope_per_day: float | None = None
    eta: datetime | None = None
    eta_range: tuple[datetime, datetime] | None = None
    reason: str
    history: list[TrendPoint] = []
    # A newest result clearly worse than the trend before it, with the two engine versions.
    regression: str | None = None
    # Why the pace is not a measured one, where it is not (results dated back).
    note: str | None = None


def _value(metrics: list[Metric], pattern: str, op: str) -> float | None:
    """The requirement's binding value in one result: the worst of the metrics it matches
    (the lowest where it must be at least, the highest where at most)."""
    found = [
        float(m.value)
        for m in metrics
        if fnmatch.fnmatchcase(m.name, pattern) and isinstance(m.value, int | float)
    ]
    if not found:
        return None
    return min(found) if op in (">=", ">") else max(found)


def requirements(
    require: dict[str, str], newest: GateResult | None
) -> list[tuple[str, str, float]]:
    """(pattern, op, limit) for each numeric requirement; a criterion that names none follows
    the thresholds its gate recorded."""
    if require:
        out = []
        for pattern, text in require.items():
            op, limit = parse_threshold(text)
            if op in (">=", ">", "<=", "<"):
                out.append((pattern, op, limit))
        return out
    if newest is None:
        return []
    return [
        (m.name, m.comparison, float(m.threshold))
        for m in newest.metrics
        if m.comparison in (">=", ">", "<=", "<") and m.threshold is not None
    ]


def trend_of(
    history: list[GateResult],
    pattern: str,
    op: str,
    limit: float,
    *,
    met: bool,
    now: datetime,
) -> Trend:
    """`history` newest first, as the store lists it."""
    points = [
        TrendPoint(
            at=r.ended_at,
            value=v,
            engine_version=r.provenance.engine_version,
            model=r.provenance.model_path,
            host=r.provenance.host,
            host_id=r.provenance.host_id,
            dated_back_days=(r.details.get("history") or {}).get("dated_back_days") or None,
            evidence_id=r.id,
        )
        for r in reversed(history)
        if (v := _value(r.metrics, pattern, op)) is not None
    ]
    base = {"metric": pattern, "threshold": f"{op} {limit:g}", "points": len(points)}
    # One series is one host: a point measured on other hardware says nothing of where this
    # one is heading (builds and checkpoints do change along it: that is what is forecast).
    newest = points[-1] if points else None
    series = [p for p in points if newest and (p.host, p.host_id) == (newest.host, newest.host_id)]
    recent = series[-RECENT:]
    if len(recent) < MIN_POINTS:
        return Trend(
            **base,
            direction="too few points",
            reason=f"too few points ({len(recent)} result{'s' if len(recent) != 1 else ''})",
            history=points,
        )
    t0 = recent[0].at
    days = [(p.at - t0).total_seconds() / 86400 for p in recent]
    if days[-1] < MIN_SPAN_DAYS:
        hours = days[-1] * 24
        return Trend(
            **base,
            direction="too few points",
            reason=f"no forecast: its {len(recent)} points span {hours:.1f} h, under a day",
            history=points,
        )
    values = [p.value for p in recent]
    fit = theil_sen(values, days)
    slope, low, high, intercept = fit.slope, fit.low_slope, fit.high_slope, fit.intercept
    regression = _regression(recent, days, values, op)
    rising = op in (">=", ">")
    span = max(days[-1] - days[0], 1e-9)
    # Flat: over the span it was watched, the line moved less than 1% of the threshold.
    if abs(slope) * span < 0.01 * max(abs(limit), 1e-9):
        direction: Direction = "flat"
    else:
        direction = "toward" if (slope > 0) == rising else "away"
    dated = [p for p in recent if p.dated_back_days]
    trend = Trend(
        **base,
        direction=direction,
        slope_per_day=round(slope, 6),
        history=points,
        regression=regression,
        reason="",
        note=(
            f"{len(dated)} of its {len(recent)} points were dated back by kdctl sandbox "
            "history: the pace is set, not measured"
        )
        if dated
        else None,
    )
    if met:
        trend.reason = f"met; {direction}, {slope:+.4g}/day"
        return trend
    if direction != "toward":
        trend.reason = "moving away" if direction == "away" else "flat"
        return trend
    last_day = days[-1]
    current = intercept + slope * last_day
    at_last = recent[-1].at

    def crossing(s: float) -> datetime | None:
        if s == 0 or (s > 0) != rising:
            return None
        return at_last + timedelta(days=(limit - current) / s)

    eta = crossing(slope)
    if eta is None or eta < at_last:
        trend.reason = "the fitted line already holds; the newest result does not"
        return trend
    if eta < now:
        # The line crossed before today and the newest result still misses: the series has
        # not moved as fitted since, so it forecasts nothing.
        trend.reason = (
            f"no forecast: the line crossed {eta:%Y-%m-%d}, before now, and no newer result "
            "meets it"
        )
        return trend
    trend.eta = eta
    fast, slow = crossing(high if rising else low), crossing(low if rising else high)
    if fast is not None and slow is not None:
        trend.eta_range = (min(fast, slow), max(fast, slow))
    ahead = (eta - now).days
    trend.reason = f"about {eta:%Y-%m-%d} ({ahead} days) if {pattern} keeps moving {slope:+.4g}/day"
    return trend


def _regression(
    points: list[TrendPoint],
    days: list[float],
    values: list[float],
    op: str,
) -> str | None:
    """The newest point against the trend of the ones before it: flagged when it is worse
    than the line predicts by more than the points' own scatter (and 5% of the value)."""
    if len(values) < MIN_POINTS + 1:
        return None
    fit = theil_sen(values[:-1], days[:-1])
    slope, intercept = fit.slope, fit.intercept
    residuals = [v - (intercept + slope * d) for v, d in zip(values[:-1], days[:-1], strict=True)]
    scatter = statistics.median(abs(r) for r in residuals) * 3
    expected = intercept + slope * days[-1]
    worse = expected - values[-1] if op in (">=", ">") else values[-1] - expected
    if worse <= max(scatter, 0.05 * abs(expected)):
        return None
    new, before = points[-1], points[-2]
    return (
        f"{new.value:.4g} against {expected:.4g} expected from the trend"
        f" (engine {before.engine_version or '?'} -> {new.engine_version or '?'})"
    )
