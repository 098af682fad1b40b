"""Whether an unmet criterion is getting there: its history, a robust trend, and the date the
trend would cross the threshold, "if it holds".

The history of a criterion is every result it would accept but for freshness: the same gate,
backend, baseline and pinned settings, across engine versions and builds (progress spans
builds). The slope is Theil-Sen's, with its confidence interval (roadmap/_theilsen.py), so
one outlier does not bend it. A forecast starts from the newest result and goes on at that
slope, its range from the slope's interval: a series that slowed down still gets a date, later.
No date from fewer than three points, from a series that does not move toward the threshold,
once the newest result meets it, or where that date has passed with nothing measured since.

A regression is a newest result worse than both the trend and the result before it, by more
than the series' own scatter allows, after the engine build, weights or settings changed
between the two: a same-build wobble is noise, and a series that only slowed is not one.
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
# The scatter a newest result may fall outside of before it can be a regression: this many
# median absolute deviations of the earlier points' residuals from their own line, scaled to a
# standard deviation. 3 is the usual outlier rule (normal noise lands that far on the worse side
# about 1 in 740 times); with as few as three earlier points the MAD is itself rough, so the
# band is not drawn tighter.
REGRESSION_MADS = 3.0
# MAD * 1.4826 estimates the standard deviation of normally distributed noise.
_MAD_TO_SD = 1.4826


class TrendPoint(BaseModel):
    at: datetime
    value: float
    # Where it was measured: a chart marks where the engine changed between points.
    engine_version: str | None = None
    # The build beyond its version: the checkpoint's fingerprint and a digest of how the engine
    # was started. Builds of one engine version (another quantization of the same weights)
    # differ here, and a regression is named only across a change of build.
    weights: str | None = None
    engine_settings: str | None = None
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
    # A newest result worse than the trend and the result before it beyond the series'
    # scatter, after a change of build, with what changed.
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
            weights=r.provenance.weights,
            engine_settings=r.provenance.engine_settings,
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
    slope, low, high = fit.slope, fit.low_slope, fit.high_slope
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
    newest_value, at_last = values[-1], recent[-1].at
    if _meets(newest_value, op, limit):
        # The criterion misses for another reason (another requirement, stale evidence).
        trend.reason = f"the newest result meets {op} {limit:g}; {direction}, {slope:+.4g}/day"
        return trend
    if direction != "toward":
        trend.reason = "moving away" if direction == "away" else "flat"
        return trend

    def crossing(s: float) -> datetime | None:
        # From where the series is, not where its line is: a series that slowed down sits
        # below its line, and the line's own crossing may lie behind it.
        if s == 0 or (s > 0) != rising:
            return None
        return at_last + timedelta(days=(limit - newest_value) / s)

    eta = crossing(slope)
    assert eta is not None  # moving toward and not there yet
    if eta < now:
        # Nothing measured since the day it would have got there: only a new result tells.
        trend.reason = (
            f"no forecast: at {slope:+.4g}/day from its newest result it would have met "
            f"{op} {limit:g} about {eta:%Y-%m-%d}, before now; measure it again"
        )
        return trend
    trend.eta = eta
    fast, slow = crossing(high if rising else low), crossing(low if rising else high)
    if fast is not None and slow is not None:
        trend.eta_range = (min(fast, slow), max(fast, slow))
        span_words = f"range {trend.eta_range[0]:%Y-%m-%d} to {trend.eta_range[1]:%Y-%m-%d}"
    else:
        # The slope's interval reaches flat: no latest date can be given.
        span_words = "no latest date: the slope's 95% interval reaches flat"
    ahead = (eta - now).days
    trend.reason = (
        f"about {eta:%Y-%m-%d} ({ahead} days; {span_words}) if {pattern} keeps moving "
        f"{slope:+.4g}/day from {newest_value:.4g}"
    )
    return trend


def _meets(value: float, op: str, limit: float) -> bool:
    return {">=": value >= limit, ">": value > limit, "<=": value <= limit, "<": value < limit}[op]


def _regression(
    points: list[TrendPoint],
    days: list[float],
    values: list[float],
    op: str,
) -> str | None:
    """The newest point against the line of the ones before it and against the one before it:
    a regression when it is worse than both by more than REGRESSION_MADS scaled MADs of those
    points' residuals, and the build (engine version, weights or settings) changed between the
    two newest. Worse than the line but not than the point before it is a series slowing down."""
    if len(values) < MIN_POINTS + 1:
        return None
    new, before = points[-1], points[-2]
    changed = _build_change(before, new)
    if changed is None or len(set(days[:-1])) < 2:
        return None
    fit = theil_sen(values[:-1], days[:-1])
    slope, intercept = fit.slope, fit.intercept
    residuals = [v - (intercept + slope * d) for v, d in zip(values[:-1], days[:-1], strict=True)]
    mad = statistics.median(abs(r) for r in residuals)
    expected = intercept + slope * days[-1]
    # A floor for series that repeat one value exactly (a match rate of 1.0): their scatter is
    # nil, and only float rounding is forgiven.
    band = max(REGRESSION_MADS * _MAD_TO_SD * mad, 1e-9 * max(abs(expected), 1.0))
    rising = op in (">=", ">")
    # The less demanding of the two references: a rising series' line is above its last point.
    reference = min(expected, before.value) if rising else max(expected, before.value)
    worse = reference - new.value if rising else new.value - reference
    if worse <= band:
        return None
    scatter = (
        f"beyond {REGRESSION_MADS:g} MADs of its scatter (+/-{band:.2g})"
        if mad > 0
        else "the points before it on their line"
    )
    return (
        f"{new.value:.4g} against {expected:.4g} expected from the trend and {before.value:.4g}"
        f" before it, {scatter} ({changed})"
    )


def _build_change(before: TrendPoint, new: TrendPoint) -> str | None:
    """What changed between two results' builds, in words; None when nothing did that both
    recorded (the same build measured again, or results too old to say)."""
    said = [
        f"{name} {old[:width]} -> {now[:width]}"
        for name, old, now, width in (
            ("engine", before.engine_version, new.engine_version, 40),
            ("weights", before.weights, new.weights, 8),
            ("engine settings", before.engine_settings, new.engine_settings, 8),
        )
        if old is not None and now is not None and old != now
    ]
    if not said:
        return None
    if new.engine_version is not None and before.engine_version == new.engine_version:
        # One engine version, another build: say which version both ran.
        said.append(f"engine {new.engine_version}")
    return "; ".join(said)
