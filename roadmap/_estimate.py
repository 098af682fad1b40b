"""When the target is reached by the plan's own estimates: the critical path through the phases
not done yet.

A person's estimate is not a measurement, so it is kept apart from a forecast (a trend fitted to
evidence): a phase ends at the later of the two where it has both, and the answer says which
phases on the path had a measured trend. Phases that do not depend on each other are taken to
run side by side; one on the path with neither an estimate nor a forecast leaves the date
unknown, and is named.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import date, datetime

from pydantic import BaseModel

from kdctl.inventory.models import parse_duration


class PathStep(BaseModel):
    phase: str
    # What this phase adds: its estimate ("3d"), or the forecast that ends it later.
    takes: str
    ends: datetime
    forecast: bool = False


class Estimate(BaseModel):
    """The target's prerequisites done by the plan: a date, the path that sets it, or why
    there is none."""

    at: datetime | None = None
    path: list[PathStep] = []
    # Phases on the path whose end is a measured trend's forecast, not a person's estimate.
    forecast_on_path: list[str] = []
    # Phases past their target date, not done.
    late: list[str] = []
    detail: str

    # When it was worked out: within a day of it, the hour says more than the date.
    made_at: datetime | None = None

    def short(self) -> str:
        if self.at is None:
            return "no estimate"
        soon = self.made_at is not None and (self.at - self.made_at).total_seconds() < 86400
        return f"estimate {self.at:%Y-%m-%d %H:%M}" if soon else f"estimate {self.at:%Y-%m-%d}"


@dataclass(frozen=True)
class PhasePlan:
    """What the plan says of one phase, and what the evidence says of it now."""

    id: str
    depends_on: Sequence[str]
    done: bool
    estimate: str | None = None
    eta: datetime | None = None


def critical_path(
    phases: Mapping[str, PhasePlan], wanted: Sequence[str], now: datetime
) -> Estimate:
    """When every phase in `wanted` (and what they depend on) is done, by estimates and
    forecasts; the path is the chain of phases that sets that date."""
    ends: dict[str, tuple[datetime, list[PathStep]] | None] = {}

    def end(pid: str) -> tuple[datetime, list[PathStep]] | None:
        if pid in ends:
            return ends[pid]
        p = phases[pid]
        if p.done:
            ends[pid] = (now, [])
            return ends[pid]
        start: datetime = now
        before: list[PathStep] = []
        for dep in p.depends_on:
            got = end(dep)
            if got is None:
                ends[pid] = None
                return None
            if got[0] > start:
                start, before = got
        if p.estimate is None and p.eta is None:
            ends[pid] = None
            return None
        by_estimate = start + parse_duration(p.estimate) if p.estimate else None
        if p.eta is not None and (by_estimate is None or p.eta > by_estimate):
            step = PathStep(
                phase=pid, takes=f"forecast {p.eta:%Y-%m-%d}", ends=p.eta, forecast=True
            )
        else:
            assert by_estimate is not None and p.estimate is not None
            step = PathStep(phase=pid, takes=p.estimate, ends=by_estimate)
        ends[pid] = (step.ends, [*before, step])
        return ends[pid]

    found = [(pid, end(pid)) for pid in wanted]
    unknown = [pid for pid, got in found if got is None]
    if unknown:
        # The phases that stop the date: on the way, undone, with neither estimate nor trend.
        bare = [
            pid
            for pid, p in phases.items()
            if not p.done and p.estimate is None and p.eta is None and _needed(pid, wanted, phases)
        ]
        return Estimate(
            detail="no estimate: "
            + ", ".join(bare or unknown)
            + " ha"
            + ("ve" if len(bare or unknown) > 1 else "s")
            + " neither an estimate nor a forecast"
        )
    dated = [got for _, got in found if got is not None]
    if not dated:
        return Estimate(at=now, made_at=now, detail="every prerequisite is done")
    at, path = max(dated, key=lambda g: g[0])
    measured = [s.phase for s in path if s.forecast]
    steps = ", ".join(f"{s.phase} {s.takes}" for s in path)
    trend = (
        f"measured trends on the path: {', '.join(measured)}"
        if measured
        else "no phase on it has a measured trend"
    )
    return Estimate(
        at=at,
        made_at=now,
        path=path,
        forecast_on_path=measured,
        detail=f"estimate {at:%Y-%m-%d} (critical path: {steps or 'none'}); {trend}",
    )


def _needed(pid: str, wanted: Sequence[str], phases: Mapping[str, PhasePlan]) -> bool:
    stack, seen = list(wanted), set()
    while stack:
        cur = stack.pop()
        if cur == pid:
            return True
        if cur not in seen:
            seen.add(cur)
            stack.extend(phases[cur].depends_on)
    return False


def late(target: date | None, done: bool, now: datetime) -> bool:
    """Past its target date and not done."""
    return target is not None and not done and now.date() > target
