"""A roadmap's state, computed from evidence: never typed in, never cached.

A criterion is met only by the newest result that matches it (gate, backend, baseline, the
settings it pins), and only while that result is fresh. A newer failure undoes an older pass.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import date, datetime, timezone
from typing import Any, Literal

from pydantic import BaseModel

from kdctl.checks import (
    Workloads,
    freshness_window,
    gate_settings,
    with_settings,
)
from kdctl.evidence import EvidenceStore, FrontNow, age_text, currency
from kdctl.inventory import LoadedInventory
from kdctl.inventory.models import parse_duration, parse_threshold
from kdctl.records import GateResult, Metric, not_met, utcnow
from kdctl.roadmap._estimate import Estimate, PhasePlan, critical_path, late
from kdctl.roadmap._load import ResolvedCriterion, Roadmap
from kdctl.roadmap._trend import Trend, requirements, trend_of
from kdctl.session import Identity

CriterionState = Literal["pass", "fail", "missing", "stale"]
# "to_reverify": done once, and every criterion it misses now is stale (its evidence expired, or
# the engine, weights or settings changed since): measured again, not built anew.
PhaseState = Literal["done", "to_reverify", "in_progress", "blocked", "remaining"]


class Measured(BaseModel):
    metric: str
    value: float | int | str | None
    threshold: str | None = None
    ok: bool | None = None


class CriterionStatus(BaseModel):
    name: str
    phase: str
    gate: str
    backend: str
    baseline: str | None
    command: str | None = None
    settings: dict[str, Any] = {}
    # Every setting a result must have been measured under to count (`settings` are the
    # criterion's own overrides of the inventory's).
    pinned: dict[str, Any] = {}
    # What it takes, in words: the thresholds a person checks.
    threshold: str
    met: bool
    state: CriterionState
    reason: str
    evidence_id: str | None = None
    verdict: str | None = None
    ended_at: datetime | None = None
    age_s: float | None = None
    window_s: float
    identity: Literal["live", "declared"] = "declared"
    values: list[Measured] = []
    # The judging result's own reasons, when it did not pass.
    findings: list[str] = []
    # Its history and where it is heading: one trend per numeric requirement, the one that
    # limits it first.
    trend: Trend | None = None
    # Why a stale result no longer holds, by name (Freshness.changed; "workload", "front",
    # "identity").
    stale_by: list[str] = []


class PhaseStatus(BaseModel):
    id: str
    title: str
    status: PhaseState
    depends_on: list[str]
    blocked_by: list[str] = []
    met: int
    total: int
    criteria: list[CriterionStatus]
    # From the history: the first moment every criterion's newest result passed, freshness
    # aside (a phase done once and undone later keeps its date).
    first_done_at: datetime | None = None
    # The last moment it was done by the same rule: for a phase to re-verify, when it was.
    last_done_at: datetime | None = None
    # Not done: the latest crossing among its unmet criteria's trends, "if they hold"; None
    # with the criteria that have no forecast named in `eta_detail`.
    eta: datetime | None = None
    eta_detail: str | None = None
    # The plan's own words: the team's label, a person's estimate, the owner, the due date, and
    # whether that date passed with the phase not done.
    label: str | None = None
    estimate: str | None = None
    owner: str | None = None
    target: date | None = None
    late: bool = False


class PhaseReport(BaseModel):
    roadmap: str
    title: str
    serving: str
    candidate: str
    target: str
    evaluated_at: datetime
    phases: list[PhaseStatus]
    # The target's prerequisites all done: traffic may move now.
    target_reachable: bool
    blocking: list[CriterionStatus] = []
    notes: list[str] = []
    # Phases first done per week, from the first to the latest first-done date.
    pace_per_week: float | None = None
    pace_detail: str = ""
    # Where the roadmap's phases carry estimates: when the target's prerequisites are done by
    # them, along the critical path (kept apart from forecasts, which trends measure).
    estimate: Estimate | None = None

    @property
    def remaining(self) -> list[PhaseStatus]:
        return [p for p in self.phases if p.status != "done"]


def evaluate(
    roadmap: Roadmap,
    inv: LoadedInventory,
    store: EvidenceStore,
    identify: Callable[[set[str]], Mapping[str, Identity]],
    *,
    target: str | None = None,
    candidate: str | None = None,
    now: datetime | None = None,
    front: FrontNow | None = None,
) -> PhaseReport:
    """`identify` asks backends what they serve; it is called once, for the backends that have
    evidence to hold against them (asking an engine in command mode runs its binary). `front`
    is what the router's front answered just now: a recorded promotion holds only while it
    still answers from the promoted engine."""
    now = now or utcnow()
    target = target or roadmap.target
    roadmap.phase(target)
    resolved = roadmap.criteria(candidate)
    histories = {
        (c.phase, c.name): _matching(c, inv, store) for cs in resolved.values() for c in cs
    }
    found = {key: (h[0] if h else None) for key, h in histories.items()}
    with_evidence = [c for cs in resolved.values() for c in cs if found[(c.phase, c.name)]]
    identities = identify(
        {c.backend for c in with_evidence}
        | {c.baseline for c in with_evidence if c.baseline is not None}
    )
    memo: Workloads = {}
    criteria: dict[str, list[CriterionStatus]] = {
        phase_id: [
            _with_trend(
                _criterion(
                    c,
                    inv,
                    found[(c.phase, c.name)],
                    identities.get(c.backend),
                    identities.get(c.baseline) if c.baseline else None,
                    now,
                    front,
                    memo,
                ),
                c,
                histories[(c.phase, c.name)],
                now,
            )
            for c in cs
        ]
        for phase_id, cs in resolved.items()
    }
    done = {pid for pid, cs in criteria.items() if all(c.met for c in cs)}
    phases = []
    for phase in roadmap.phases:
        cs = criteria[phase.id]
        met = sum(c.met for c in cs)
        unmet_deps = [d for d in phase.depends_on if d not in done]
        last_done = _last_done(resolved[phase.id], histories)
        status: PhaseState
        if phase.id in done:
            status = "done"
        elif last_done is not None and _only_stale(resolved[phase.id], cs, histories):
            status = "to_reverify"
        elif met:
            status = "in_progress"
        elif unmet_deps:
            status = "blocked"
        else:
            status = "remaining"
        eta, eta_detail = _phase_eta(cs) if status != "done" else (None, None)
        phases.append(
            PhaseStatus(
                id=phase.id,
                title=phase.title,
                status=status,
                depends_on=list(phase.depends_on),
                blocked_by=unmet_deps,
                met=met,
                total=len(cs),
                criteria=cs,
                first_done_at=_first_done(resolved[phase.id], histories),
                last_done_at=last_done,
                eta=eta,
                eta_detail=eta_detail,
                label=phase.label,
                estimate=phase.estimate,
                owner=phase.owner,
                target=phase.target,
                late=late(phase.target, status == "done", now),
            )
        )
    prerequisites = roadmap.prerequisites(target)
    plans = {
        p.id: PhasePlan(
            id=p.id,
            depends_on=p.depends_on,
            # Work done and only to be measured again takes no more of the plan's time.
            done=p.status in ("done", "to_reverify"),
            estimate=p.estimate,
            eta=p.eta,
        )
        for p in phases
    }
    estimate = (
        critical_path(plans, prerequisites, now)
        if any(p.estimate for p in roadmap.phases)
        else None
    )
    if estimate is not None:
        estimate.late = [p.id for p in phases if p.late]
    blocking = [c for pid in prerequisites for c in criteria[pid] if not c.met]
    notes = sorted({i.note for i in identities.values() if i.note})
    pace, pace_detail = _pace([p.first_done_at for p in phases if p.first_done_at is not None])
    return PhaseReport(
        roadmap=str(roadmap.path),
        title=roadmap.spec.title,
        serving=roadmap.spec.serving,
        candidate=candidate or roadmap.spec.candidate,
        target=target,
        evaluated_at=now,
        phases=phases,
        target_reachable=not blocking,
        blocking=blocking,
        notes=notes,
        pace_per_week=pace,
        pace_detail=pace_detail,
        estimate=estimate,
    )


def _first_done(
    criteria: list[ResolvedCriterion],
    histories: Mapping[tuple[str, str], list[GateResult]],
) -> datetime | None:
    """The first moment at which each criterion's newest result (then) passed."""
    oldest_first = [list(reversed(histories[(c.phase, c.name)])) for c in criteria]
    if not criteria or not all(oldest_first):
        return None
    for moment in sorted({r.ended_at for h in oldest_first for r in h}):
        then = [next((r for r in reversed(h) if r.ended_at <= moment), None) for h in oldest_first]
        if all(_passes(c, r) for c, r in zip(criteria, then, strict=True)):
            return moment
    return None


def _only_stale(
    criteria: list[ResolvedCriterion],
    statuses: list[CriterionStatus],
    histories: Mapping[tuple[str, str], list[GateResult]],
) -> bool:
    """Whether every criterion missed now is missed only because its newest result, a pass,
    no longer holds: a newer failure is a phase broken, not one to measure again."""
    unmet = [(c, s) for c, s in zip(criteria, statuses, strict=True) if not s.met]
    return bool(unmet) and all(
        s.state == "stale"
        and bool(s.stale_by)
        and set(s.stale_by) <= _REMEASURE
        and _passes(c, next(iter(histories[(c.phase, c.name)]), None))
        for c, s in unmet
    )


# What makes a pass one to measure again on the same deployment: its age, a new engine build,
# settings, checkpoint or workload. A result of another machine or model (host, model path)
# was never a pass here; one whose engine's identity is unknown cannot be placed at all.
_REMEASURE = frozenset(
    {
        "age",
        "workload",
        "engine_version",
        "engine_settings",
        "config_hash",
        "weights",
        "tp_size",
        "gpus",
        "baseline_engine_version",
        "baseline_engine_settings",
        "baseline_weights",
    }
)


def _last_done(
    criteria: list[ResolvedCriterion],
    histories: Mapping[tuple[str, str], list[GateResult]],
) -> datetime | None:
    """The last moment at which each criterion's newest result (then) passed."""
    newest_first = [histories[(c.phase, c.name)] for c in criteria]
    if not criteria or not all(newest_first):
        return None
    for moment in sorted({r.ended_at for h in newest_first for r in h}, reverse=True):
        then = [next((r for r in h if r.ended_at <= moment), None) for h in newest_first]
        if all(_passes(c, r) for c, r in zip(criteria, then, strict=True)):
            return moment
    return None


def _passes(c: ResolvedCriterion, result: GateResult | None) -> bool:
    return result is not None and _verdict(c, result) == "pass" and not _require(c, result)[1]


@dataclass(frozen=True)
class Crossing:
    """When some unmet criteria are all forecast to be met: the latest of their trends'
    dates, set by `last`; none while any of them (`undated`) has no date."""

    last: CriterionStatus | None
    undated: list[CriterionStatus]
    dated: list[CriterionStatus]

    @property
    def eta(self) -> datetime | None:
        return self.last.trend.eta if self.last and self.last.trend else None


def latest_crossing(criteria: Iterable[CriterionStatus]) -> Crossing:
    unmet = [c for c in criteria if not c.met]
    dated = [c for c in unmet if c.trend is not None and c.trend.eta is not None]
    undated = [c for c in unmet if c.trend is None or c.trend.eta is None]
    last = None
    if dated and not undated:
        last = max(dated, key=lambda c: _eta_key(c.trend))
    return Crossing(last=last, undated=undated, dated=dated)


def undated_why(c: CriterionStatus) -> str:
    return c.trend.reason if c.trend else "no numeric requirement"


def _phase_eta(criteria: list[CriterionStatus]) -> tuple[datetime | None, str | None]:
    crossing = latest_crossing(criteria)
    if crossing.undated:
        named = "; ".join(f"{c.name} ({undated_why(c)})" for c in crossing.undated)
        return None, f"unknown: no forecast for {named}"
    if crossing.last is None:
        return None, None
    return crossing.eta, f"about {crossing.eta:%Y-%m-%d}, limited by {crossing.last.name}"


# A pace is a rate over time: phases first done minutes apart (a first run of every gate)
# would give thousands a week. Under a week between the first and the latest, none is given.
PACE_MIN_DAYS = 7.0


def _pace(done_at: list[datetime]) -> tuple[float | None, str]:
    if len(done_at) < 2:
        return None, f"none yet ({len(done_at)} of the phases done; a pace needs two)"
    first, last = min(done_at), max(done_at)
    days = (last - first).total_seconds() / 86400
    if days < PACE_MIN_DAYS:
        hours = days * 24
        within = (
            f"{days:.1f} days"
            if days >= 1
            else f"{hours:.1f} h"
            if hours >= 1
            else f"{hours * 60:.0f} min"
        )
        return None, (
            f"too early to tell ({len(done_at)} phases first done within {within}; a pace "
            f"needs {PACE_MIN_DAYS:g} days between the first and the latest)"
        )
    pace = (len(done_at) - 1) / (days / 7)
    return round(pace, 3), (
        f"{pace:.2g} phases a week ({len(done_at)} done from {first:%Y-%m-%d} to {last:%Y-%m-%d})"
    )


def evaluate_criterion(
    c: ResolvedCriterion,
    inv: LoadedInventory,
    store: EvidenceStore,
    identify: Callable[[set[str]], Mapping[str, Identity]],
    *,
    now: datetime | None = None,
) -> CriterionStatus:
    """One criterion, judged as `evaluate` judges it inside its phase."""
    now = now or utcnow()
    result = _newest_match(c, inv, store)
    names = {c.backend} | ({c.baseline} if c.baseline else set())
    if result is None:
        return _criterion(c, inv, result, None, None, now)
    identities = identify(names)
    base = identities.get(c.baseline) if c.baseline else None
    return _criterion(c, inv, result, identities.get(c.backend), base, now)


def pinned_settings(c: ResolvedCriterion, inv: LoadedInventory) -> dict[str, Any]:
    """Every setting the gate runs with for this criterion (the inventory's, with the
    criterion's own overrides), as the gate records them: a criterion means its workload, so a
    result under any other settings does not meet it. A command criterion pins its command."""
    recorded = gate_settings(with_settings(inv, c.gate, c.spec.settings), c.gate)
    if c.spec.command is not None:
        return {c.spec.command: recorded[c.spec.command]} if c.spec.command in recorded else {}
    return recorded


def _matches(c: ResolvedCriterion, r: GateResult, pinned: dict[str, Any]) -> bool:
    if c.baseline is not None and r.baseline != c.baseline:
        return False
    if any(r.settings.get(k) != v for k, v in pinned.items()):
        return False
    return not (c.spec.command is not None and c.spec.command not in r.details)


def _threshold_text(c: ResolvedCriterion, result: GateResult | None) -> str:
    parts = [f"{m} {t.strip()}" for m, t in c.spec.require.items()]
    if not parts and result is not None:
        metrics = _scoped(c, result.metrics)
        parts = [f"{m.name} {m.comparison} {m.threshold:g}" for m in metrics if m.comparison]
    pinned = ", ".join(f"{k} {v}" for k, v in c.spec.settings.items())
    words = "; ".join(parts) or f"{c.gate} passes"
    return f"{words} ({pinned})" if pinned else words


def _scoped(c: ResolvedCriterion, metrics: list[Metric]) -> list[Metric]:
    """A command criterion looks at its own check's metrics only."""
    if c.spec.command is None:
        return metrics
    return [m for m in metrics if m.name.startswith(f"{c.spec.command}.")]


def _require(c: ResolvedCriterion, result: GateResult) -> tuple[list[Measured], list[str]]:
    values: list[Measured] = []
    broken: list[str] = []
    metrics = _scoped(c, result.metrics)
    for pattern, text in c.spec.require.items():
        op, limit = parse_threshold(text)
        found = [m for m in metrics if fnmatch.fnmatchcase(m.name, pattern)]
        if not found:
            broken.append(f"{pattern} was not measured")
            values.append(Measured(metric=pattern, value=None, threshold=text.strip(), ok=False))
        for m in found:
            held = Metric(name=m.name, value=m.value, threshold=limit, comparison=op)
            ok = held.passed is True
            values.append(Measured(metric=m.name, value=m.value, threshold=text.strip(), ok=ok))
            if not ok:
                broken.append(not_met(held))
    if not c.spec.require:
        for m in metrics:
            if m.comparison is not None:
                values.append(
                    Measured(
                        metric=m.name,
                        value=m.value,
                        threshold=f"{m.comparison} {m.threshold:g}",
                        ok=m.passed,
                    )
                )
    return values, broken


def _failed_bars(c: ResolvedCriterion, result: GateResult) -> list[Metric]:
    """The result's measured figures that broke the gate's own thresholds."""
    return [m for m in _scoped(c, result.metrics) if m.passed is False]


def _stricter(c: ResolvedCriterion, bars: list[Metric]) -> list[Metric]:
    """The failed bars on metrics the criterion's requirement judges and finds met: a
    roadmap asking `ratio >= 0.5` of a gate holding `min_ratio: 0.8`, whose phase could then
    never be done by its own requirement."""
    return [m for m in bars if any(fnmatch.fnmatchcase(m.name, p) for p in c.spec.require)]


def _newest_match(
    c: ResolvedCriterion, inv: LoadedInventory, store: EvidenceStore
) -> GateResult | None:
    found = _matching(c, inv, store)
    return found[0] if found else None


def _matching(c: ResolvedCriterion, inv: LoadedInventory, store: EvidenceStore) -> list[GateResult]:
    """Every result the criterion would accept but for freshness, newest first: its history
    across engine versions and builds."""
    pinned = pinned_settings(c, inv)
    listed = store.results(gate=c.gate, backend=c.backend, limit=HISTORY)
    return [r for r in listed if _matches(c, r, pinned)]


# The results read for a criterion's history.
HISTORY = 200


def _with_trend(
    status: CriterionStatus,
    c: ResolvedCriterion,
    history: list[GateResult],
    now: datetime,
) -> CriterionStatus:
    """The trend of the requirement that limits the criterion: the one with the latest
    crossing, or the first with none."""
    judged = [r for r in history if r.verdict in ("pass", "fail")]
    reqs = requirements(dict(c.spec.require), judged[0] if judged else None)
    if not reqs:
        return status
    trends = [
        trend_of(judged, pattern, op, limit, met=status.met, now=now) for pattern, op, limit in reqs
    ]
    unmet = [t for t in trends if not _holds(t)]
    pool = unmet or trends
    no_eta = [t for t in pool if t.eta is None]
    chosen = no_eta[0] if (no_eta and not status.met) else max(pool, key=_eta_key)
    return status.model_copy(update={"trend": chosen})


def _holds(t: Trend) -> bool:
    if not t.history or t.threshold is None:
        return False
    op, limit = t.threshold.split(" ", 1)
    return (
        Metric(name="x", value=t.history[-1].value, threshold=float(limit), comparison=op).passed
        is True
    )


def _eta_key(t: Trend | None) -> datetime:
    return (t.eta if t else None) or datetime.min.replace(tzinfo=timezone.utc)


def _criterion(
    c: ResolvedCriterion,
    inv: LoadedInventory,
    result: GateResult | None,
    identity: Identity | None,
    baseline_now: Identity | None,
    now: datetime,
    front: FrontNow | None = None,
    memo: Workloads | None = None,
) -> CriterionStatus:
    window = parse_duration(c.spec.freshness) if c.spec.freshness else freshness_window(inv, c.gate)
    base: dict[str, Any] = {
        "name": c.name,
        "phase": c.phase,
        "gate": c.gate,
        "backend": c.backend,
        "baseline": c.baseline,
        "command": c.spec.command,
        "settings": dict(c.spec.settings),
        "pinned": pinned_settings(c, inv),
        "threshold": _threshold_text(c, result),
        "window_s": window.total_seconds(),
        "identity": "live" if identity and identity.live else "declared",
    }
    if result is None:
        against = f" against {c.baseline}" if c.baseline else ""
        return CriterionStatus(
            **base,
            met=False,
            state="missing",
            reason=f"no {c.gate} result for {c.backend}{against}"
            + (" under the settings it pins" if base["pinned"] else ""),
        )
    evidence = {
        "evidence_id": result.id,
        "verdict": _verdict(c, result),
        "ended_at": result.ended_at,
        "age_s": (now - result.ended_at).total_seconds(),
    }
    values, broken = _require(c, result)
    f = currency(
        result,
        window=window,
        current=identity.provenance if identity else None,
        live=identity.live if identity else False,
        baseline=baseline_now.provenance if baseline_now else None,
        ways=[with_settings(inv, c.gate, c.spec.settings)],
        settings_matched=True,  # chosen by the settings it pins
        front=front,
        now=now,
        memo=memo,
    )
    fresh_ok, why, stale_by = f.fresh, f.reason, f.changed
    if not fresh_ok:
        return CriterionStatus(
            **base,
            **evidence,
            values=values,
            met=False,
            state="stale",
            reason=why,
            stale_by=list(stale_by),
        )
    if evidence["verdict"] != "pass":
        # The figures that failed first, as a lead reads them in one line; then the summary
        # and the first concrete finding (a divergence, a broken SLO).
        bars = _failed_bars(c, result)
        said = "; ".join([*map(not_met, bars[:3]), *result.reasons[:2]])
        stricter = [] if broken or not c.spec.require else _stricter(c, bars)
        return CriterionStatus(
            **base,
            **evidence,
            values=values,
            met=False,
            state="fail",
            reason=f"{evidence['verdict']} {age_text(now - result.ended_at)} ago"
            + (f": {said}" if said else "")
            + (
                f"; the criterion's requirement holds, the gate's own stricter bar failed "
                f"({', '.join(map(not_met, stricter))}): set that bar in the criterion's settings"
                if stricter
                else ""
            ),
            findings=result.reasons[:20],
        )
    if broken:
        return CriterionStatus(
            **base, **evidence, values=values, met=False, state="fail", reason="; ".join(broken)
        )
    return CriterionStatus(**base, **evidence, values=values, met=True, state="pass", reason=why)


def _verdict(c: ResolvedCriterion, r: GateResult) -> str:
    if c.spec.command is not None and r.verdict != "error":
        return str(r.details.get(c.spec.command, {}).get("verdict", r.verdict))
    return r.verdict
