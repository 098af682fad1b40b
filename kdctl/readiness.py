"""The three answers a lead asks for, derived from live probes and evidence only:

1. who answers through the router's front door now (serving, degraded, nothing or unknown),
   and whether that engine is speed-optimized by the roadmap's own speed criterion, fresh
   against what answers ("unmeasured" without such evidence, never "yes");
2. which phases remain;
3. whether traffic can move to the candidate now, or what blocks it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from kdctl.checks import (
    GateResult,
    ProgressHook,
    Workloads,
    freshness_window,
    gate_class,
    gates,
    measured_otherwise,
    utcnow,
    with_settings,
)
from kdctl.errors import InputError
from kdctl.evidence import EvidenceStore, freshness
from kdctl.evidence._freshness import age_text
from kdctl.inventory import LoadedInventory
from kdctl.recording import run_gates
from kdctl.roadmap import (
    FrontNow,
    PhaseReport,
    PhaseStatus,
    Roadmap,
    evaluate,
    evaluate_criterion,
    load_roadmap,
    roadmap_path,
)
from kdctl.serving import ServingProbe, probe_serving
from kdctl.session import Identity, Session, using

# "baseline": the engine the roadmap replaces, the yardstick every ratio is measured against.
Speed = Literal["yes", "no", "unmeasured", "baseline"]


class ServingAnswer(ServingProbe):
    """Line 1: who answers through the front now (measured), and whether that engine is
    speed-optimized by the roadmap's own speed criterion (fresh against what answers)."""

    # The routed weight of the backend that answered, as the router's configuration says.
    weight: int | None = None
    # Null when nothing answered: there is no engine to judge.
    speed_optimized: Speed | None = None
    speed: str | None = None
    speed_criterion: str | None = None
    evidence_id: str | None = None
    # Where the router splits traffic, the engine whose speed is judged (the one carrying the
    # most) and its share: the probe's one answer may have come from either.
    speed_of: str | None = None
    speed_share: int | None = None

    def line(self) -> str:
        speed = f"; speed: {self.speed}" if self.speed else ""
        if self.speed and self.speed_of is not None:
            speed = f"; speed of {self.speed_of}, {self.speed_share}% of traffic: {self.speed}"
        if self.state == "serving":
            return f"Serving now: {self.detail}{speed}."
        if self.state == "degraded":
            return f"Serving now: degraded. {self.detail}{speed}."
        if self.state == "nothing":
            return f"Serving now: nothing. {self.detail}."
        return f"Serving now: unknown ({self.detail})."


class LatestVerdict(BaseModel):
    gate: str
    backend: str
    baseline: str | None
    verdict: str
    ended_at: datetime
    age: str
    evidence_id: str
    # Whether it still describes what answers now, in the gate's default window (a roadmap
    # criterion may set its own); None where no one said who the engine is.
    fresh: bool | None = None
    freshness: str | None = None


def latest_verdicts(
    inv: LoadedInventory,
    store: EvidenceStore,
    now: datetime | None = None,
    identities: Mapping[str, Identity] | None = None,
) -> list[LatestVerdict]:
    """The newest result of every gate for every backend, with its age, and, where who the
    engines are now is known, whether it still describes them: a pass measured on another
    build, checkpoint or host is listed as stale, not as a pass of what runs."""
    now = now or utcnow()
    known = identities or {}
    found = []
    memo: Workloads = {}
    asked = _asked_settings(inv)
    for backend in inv.backends:
        for gate in sorted(gates()):
            r = store.latest(gate, backend)
            if r is None:
                continue
            verdict = LatestVerdict(
                gate=gate,
                backend=backend,
                baseline=r.baseline,
                verdict=r.verdict,
                ended_at=r.ended_at,
                age=age_text(now - r.ended_at),
                evidence_id=r.id,
            )
            ident = known.get(backend)
            if ident is not None:
                current = ident.provenance
                if r.baseline is not None and r.baseline in known:
                    current = current.with_baseline(known[r.baseline].provenance)
                f = freshness(
                    r,
                    window=freshness_window(inv, gate),
                    current=current,
                    now=now,
                    live=ident.live,
                )
                verdict.fresh, verdict.freshness = f.fresh, f.reason
            # The settings it may have run under: the inventory's, or a roadmap criterion's own
            # (`phases --run` runs each criterion's gate under its settings).
            ways = [inv, *asked.get((gate, backend), [])]
            verdicts = [measured_otherwise(way, r, memo) for way in ways]
            other = None if None in verdicts else verdicts[0]
            if other is not None and verdict.fresh is not False:
                # Whoever the engine is, this is not the measurement the inventory asks for now.
                verdict.fresh, verdict.freshness = False, f"stale: {other}"
            found.append(verdict)
    return found


def _asked_settings(inv: LoadedInventory) -> dict[tuple[str, str], list[LoadedInventory]]:
    """The inventory under each roadmap criterion's own gate settings, by (gate, backend); none
    where no roadmap is selected or it cannot be read (phases says why)."""
    path = roadmap_path(inv)
    if path is None:
        return {}
    try:
        loaded = load_roadmap(path, inv)
    except InputError:
        return {}
    asked: dict[tuple[str, str], list[LoadedInventory]] = {}
    for criteria in loaded.criteria().values():
        for c in criteria:
            if c.spec.settings:
                way = with_settings(inv, c.gate, dict(c.spec.settings))
                asked.setdefault((c.gate, c.backend), []).append(way)
    return asked


class Soon(BaseModel):
    """ "Or soon?": the latest crossing among the blocking criteria's trends, if every one of
    them has one; else which have none, and why."""

    eta: datetime | None = None
    eta_range: tuple[datetime, datetime] | None = None
    # The criterion whose crossing comes last (the one that limits the date).
    limited_by: str | None = None
    detail: str


class CutoverAnswer(BaseModel):
    candidate: str | None
    target: str | None
    can_cut_over: bool | None
    blocking: list[str] = []
    soon: Soon | None = None
    # Where the candidate is stopped (it shares GPUs with the engine serving): how its
    # evidence was held, since no engine answered for it.
    held: str | None = None


class Answers(BaseModel):
    serving: ServingAnswer
    remaining_phases: list[str]
    cutover: CutoverAnswer

    # The moment every part of these answers was measured or read.
    assessed_at: datetime | None = None
    # Criteria whose newest result is clearly worse than their trend, with the engine versions.
    regressions: list[str] = []

    def lines(self) -> list[str]:
        serving = self.serving.line()
        if self.cutover.target is None:
            remaining = "Phases remaining: unknown (no roadmap selected: the inventory's roadmap:)"
        elif self.remaining_phases:
            remaining = f"Phases remaining ({len(self.remaining_phases)}): " + ", ".join(
                self.remaining_phases
            )
        else:
            remaining = "Phases remaining: none"
        c = self.cutover
        if c.can_cut_over is None:
            cut = "Cut over now: unknown (no roadmap selected)"
        elif c.can_cut_over:
            cut = f"Cut over to {c.candidate} now: yes (every prerequisite of {c.target} is met)"
        else:
            shown = "; ".join(c.blocking[:6]) + (" ..." if len(c.blocking) > 6 else "")
            soon = f"; soon: {c.soon.detail}" if c.soon else ""
            cut = f"Cut over to {c.candidate} now: no{soon}; blocked by {shown}"
        if c.held:
            cut += f"; {c.held}"
        lines = [serving, remaining, cut]
        if self.regressions:
            lines.append("Regressions: " + "; ".join(self.regressions))
        return lines


@dataclass(frozen=True)
class Readiness:
    answers: Answers
    phases: PhaseReport | None
    identities: dict[str, Identity]

    def phases_document(self) -> dict[str, Any]:
        """`kdctl phases --json`: the phase report with the three answers beside it."""
        doc = self.phases.model_dump(mode="json") if self.phases is not None else {}
        doc["answers"] = self.answers.model_dump(mode="json")
        return doc


def assess(
    inv: LoadedInventory,
    store: EvidenceStore,
    *,
    roadmap: Path | None = None,
    target: str | None = None,
    candidate: str | None = None,
    timeout_s: float = 15.0,
    now: datetime | None = None,
    serving: ServingProbe | None = None,
    session: Session | None = None,
) -> Readiness:
    """The three answers from one moment: who answers through the front now, the roadmap
    evaluated against what the engines report now, and whether traffic may move.

    `serving` is what the caller has just measured, and the session holds who each engine
    said it is (`kdctl status` probes every engine anyway), so that nothing is asked twice.
    """
    with using(inv, session) as s:
        return _assess(inv, store, s, roadmap, target, candidate, timeout_s, now, serving)


def _assess(
    inv: LoadedInventory,
    store: EvidenceStore,
    session: Session,
    roadmap: Path | None,
    target: str | None,
    candidate: str | None,
    timeout_s: float,
    now: datetime | None,
    serving: ServingProbe | None,
) -> Readiness:
    now = now or utcnow()
    path = roadmap_path(inv, roadmap)
    loaded = load_roadmap(path, inv) if path is not None else None
    if candidate is not None and candidate not in inv.backends:
        known = ", ".join(sorted(inv.backends))
        raise InputError(f"unknown backend {candidate!r} (known: {known})")
    probe = serving or probe_serving(inv, timeout_s=timeout_s, session=session)
    identities: dict[str, Identity] = {}

    def identify(names: set[str]) -> dict[str, Identity]:
        # An engine with no evidence is not asked.
        found = session.identify(names, timeout_s=timeout_s)
        identities.update(found)
        return found

    report = (
        evaluate(
            loaded,
            inv,
            store,
            identify,
            target=target,
            candidate=candidate,
            now=now,
            front=_front_now(probe),
        )
        if loaded
        else None
    )
    blocking = [f"{c.phase}/{c.name}: {c.reason}" for c in report.blocking] if report else []
    held: str | None = None
    if report is not None:
        # Traffic cannot move to an engine that does not answer, whatever its evidence says.
        cand = identify({report.candidate})[report.candidate]
        serving_now = loaded.spec.serving if loaded is not None else None
        # Stopped for a swap only while the engine holding its GPUs answers: with that one
        # down too, nothing explains the candidate's silence.
        swapped = (
            serving_now is not None
            and serving_now != report.candidate
            and inv.backends[serving_now].shares_gpus_with(inv.backends[report.candidate])
            and identify({serving_now})[serving_now].live
        )
        spec = inv.backends[report.candidate]
        unread = not cand.live and swapped and session.binder.host_id(spec.host) is None
        if unread:
            # Held to its host, which did not answer: nothing ties its evidence to the machine
            # and checkpoint there, so it stands on the inventory's word alone.
            blocking.append(
                f"{report.candidate} is stopped and its host {spec.host} could not be read "
                "(its identity and checkpoint): its evidence cannot be held to anything measured"
            )
            report = report.model_copy(update={"target_reachable": False})
        elif not cand.live and swapped:
            # It cannot run while the engine it replaces holds its GPUs: a cutover is a swap,
            # whose smoke gate judges it live before traffic reopens. Its criteria stand, held
            # to what its host shows and the inventory declares, and it is said so.
            held = (
                f"{report.candidate} is stopped: it shares GPUs with {serving_now}, so its "
                "evidence is held to what its host shows and the inventory declares; the swap "
                "judges it again once it answers, before traffic reopens"
            )
            # Said once, in answer 3 (`held`), which every output carries.
        elif not cand.live:
            blocking.append(f"{report.candidate} is not answering: {cand.note}")
            # phases --json and every report carry the same verdict as answer 3.
            report = report.model_copy(update={"target_reachable": False})
    soon = _soon(report) if report is not None and blocking else None
    answers = Answers(
        serving=_serving(inv, store, loaded, probe, identify, now),
        remaining_phases=[_remaining(p) for p in report.remaining] if report else [],
        cutover=CutoverAnswer(
            candidate=report.candidate if report else candidate,
            target=report.target if report else None,
            can_cut_over=not blocking if report else None,
            blocking=blocking,
            soon=soon,
            held=held,
        ),
        assessed_at=now,
        regressions=[
            f"{c.phase}/{c.name}: {c.trend.regression}"
            for p in (report.phases if report else [])
            for c in p.criteria
            if c.trend is not None and c.trend.regression
        ],
    )
    return Readiness(answers=answers, phases=report, identities=identities)


def _remaining(phase: PhaseStatus) -> str:
    if phase.eta is None:
        return f"{phase.id} ({phase.status})"
    # A forecast fitted to results whose dates were set (sandbox history) says so.
    dated = any(c.trend is not None and c.trend.note for c in phase.criteria)
    also = ", from results dated back" if dated else ""
    return f"{phase.id} ({phase.status}, forecast {phase.eta:%Y-%m-%d}{also})"


def _soon(report: PhaseReport) -> Soon:
    """From the trends of the criteria that block the target: a date only when each has one."""
    without = [c for c in report.blocking if c.trend is None or c.trend.eta is None]
    if without or not report.blocking:
        named = "; ".join(
            f"{c.phase}/{c.name} ({c.trend.reason if c.trend else 'no numeric requirement'})"
            for c in without[:4]
        )
        # The date stays unknown, but what the others' trends say is still worth knowing.
        dated = [c for c in report.blocking if c.trend is not None and c.trend.eta is not None]
        partial = "".join(
            f"; {c.phase}/{c.name} would cross about {c.trend.eta:%Y-%m-%d} if it keeps moving "
            f"{c.trend.slope_per_day:+.4g}/day"
            for c in dated[:2]
            if c.trend is not None and c.trend.eta is not None
        )
        return Soon(detail=(f"no forecast for {named}" if named else "no forecast") + partial)
    last = max(report.blocking, key=lambda c: c.trend.eta if c.trend and c.trend.eta else now_min())
    t = last.trend
    assert t is not None and t.eta is not None
    span = f" (range {t.eta_range[0]:%Y-%m-%d} to {t.eta_range[1]:%Y-%m-%d})" if t.eta_range else ""
    return Soon(
        eta=t.eta,
        eta_range=t.eta_range,
        limited_by=f"{last.phase}/{last.name}",
        detail=f"about {t.eta:%Y-%m-%d}{span} if {last.phase}/{last.name} keeps moving "
        f"{t.slope_per_day:+.4g}/day ({t.metric} {t.threshold}), the trend holding"
        + (f" ({t.note})" if t.note else ""),
    )


def now_min() -> datetime:
    return datetime.min.replace(tzinfo=timezone.utc)


def _serving(
    inv: LoadedInventory,
    store: EvidenceStore,
    roadmap: Roadmap | None,
    probe: ServingProbe,
    identify: Callable[[set[str]], Mapping[str, Identity]],
    now: datetime,
) -> ServingAnswer:
    answer = ServingAnswer(
        **dict(probe),
        weight=(
            probe.routed.weights.get(probe.backend) if probe.routed and probe.backend else None
        ),
    )
    if probe.state not in ("serving", "degraded"):
        return answer
    who = probe.backend
    routed = probe.routed
    weights = {n: w for n, w in (routed.weights if routed else {}).items() if w > 0}
    # Only a split the router runs: a file written and not applied describes nothing served.
    if who in weights and len(weights) > 1 and routed is not None and routed.applied is not False:
        # A split (a canary under way): the probe's one answer came from either engine, and
        # the engine that carries most of the traffic is the one whose speed is served.
        who = max(weights, key=lambda n: weights[n])
        answer.speed_of, answer.speed_share = who, weights[who]
        heavy = next((e for e in probe.engines if e.name == who), None)
        if heavy is None or not heavy.serves:
            # The router retries a dead upstream on the other: its weight is not its share.
            answer.speed_optimized = "unmeasured"
            answer.speed = (
                f"unmeasured ({who}, {weights[who]}% of the traffic by the router's weights, "
                "does not generate: which engine serves the traffic is not known)"
            )
            return answer
    if who is None:
        answer.speed_optimized = "unmeasured"
        answer.speed = "unmeasured (which engine answered is not known)"
        return answer
    if roadmap is None:
        answer.speed_optimized = "unmeasured"
        answer.speed = "unmeasured (no roadmap: speed is judged by its speed criterion)"
        return answer
    if who == roadmap.spec.serving:
        answer.speed_optimized = "baseline"
        answer.speed = "the baseline"
        return answer
    criterion = roadmap.speed_criterion(who)
    if criterion is None:
        answer.speed_optimized = "unmeasured"
        answer.speed = f"unmeasured (the roadmap has no speed criterion that judges {who})"
        return answer
    status = evaluate_criterion(criterion, inv, store, identify, now=now)
    answer.speed_criterion = criterion.name
    answer.evidence_id = status.evidence_id
    ratios = [m for m in status.values if m.metric.endswith("ratio") and m.value is not None]
    shown = min(ratios, key=lambda m: float(m.value or 0), default=None)
    against = criterion.baseline or "the baseline"
    measured = f"{float(shown.value or 0):.2f}x {against}" if shown else "measured"
    ago = f"measured {age_text(timedelta(seconds=status.age_s))} ago" if status.age_s else ""
    needs = f"needs {status.threshold}"
    where = f"on {criterion.name}'s workload{_drafting(store, status.evidence_id)}"
    if status.state == "pass" and status.identity != "live":
        # Its evidence holds only against what the inventory declares: the engine did not
        # say what it runs, so what serves is not shown to be what was measured.
        answer.speed_optimized = "unmeasured"
        answer.speed = (
            f"{measured} {where} ({needs}; {ago}), held to the inventory: {who} did not say "
            "what it runs"
        )
    elif status.state == "pass":
        answer.speed_optimized = "yes"
        answer.speed = f"{measured} {where} ({needs}; {ago})"
    elif status.state == "fail":
        answer.speed_optimized = "no"
        answer.speed = f"{measured} {where} ({needs}; {ago}): {status.reason}"
    else:
        answer.speed_optimized = "unmeasured"
        answer.speed = f"unmeasured by {criterion.name} ({needs}): {status.reason}"
    return answer


def _drafting(store: EvidenceStore, evidence_id: str | None) -> str:
    """A speculative engine's accept length on the measured workload, from the same result:
    its speed is worth only as much as the text let it accept."""
    result = store.get(evidence_id) if evidence_id else None
    accepted = [
        float(m.value)
        for m in (result.metrics if result else [])
        if m.name.endswith(".spec_accept_length") and m.value is not None
    ]
    if not accepted:
        return ""
    return f", decoding speculatively with {min(accepted):.2f} tokens accepted per verification"


def assess_phases(
    inv: LoadedInventory,
    store: EvidenceStore,
    *,
    roadmap: Path | None = None,
    target: str | None = None,
    candidate: str | None = None,
    run: bool = False,
    only: list[str] | None = None,
    on_start: Callable[[str], None] | None = None,
    progress: ProgressHook | None = None,
    session: Session | None = None,
) -> Readiness:
    """`kdctl phases`: the assessment of the roadmap; with `run`, the gate behind every unmet
    criterion (of the phases in `only`) runs first, and the answers come from what it recorded."""
    with using(inv, session) as s:
        found = assess(inv, store, roadmap=roadmap, target=target, candidate=candidate, session=s)
        if found.phases is None:
            raise InputError(f"{inv.path}: no roadmap selected (set roadmap: or --roadmap)")
        if not run:
            return found
        run_criteria(
            inv,
            store,
            found.phases,
            roadmap=roadmap,
            phases=only,
            on_start=on_start,
            progress=progress,
            session=s,
        )
        return assess(inv, store, roadmap=roadmap, target=target, candidate=candidate, session=s)


def _front_now(probe: ServingProbe) -> FrontNow | None:
    """What the front answered, for the roadmap to hold recorded promotions against; None
    where there is no router to ask (the promotion cannot be checked, nor was it made)."""
    if probe.routed is None:
        return None
    return FrontNow(
        answered=probe.answered,
        backend=probe.backend if probe.answered else None,
        weights={k: v for k, v in probe.routed.weights.items() if v > 0},
        detail=probe.front.detail if probe.front is not None else probe.detail,
    )


def default_baseline(inv: LoadedInventory, backend: str) -> str | None:
    """What a gate compares with when no --baseline is given: the roadmap's serving backend,
    the engine a candidate must match (None for that engine itself, or with no roadmap)."""
    path = roadmap_path(inv)
    if path is None:
        return None
    serving = load_roadmap(path, inv).spec.serving
    return serving if serving != backend else None


def run_criteria(
    inv: LoadedInventory,
    store: EvidenceStore,
    report: PhaseReport,
    *,
    roadmap: Path | None = None,
    phases: list[str] | None = None,
    on_start: Callable[[str], None] | None = None,
    progress: ProgressHook | None = None,
    session: Session | None = None,
) -> list[GateResult]:
    """Run the gate behind every unmet criterion (of `phases`, else all) with the criterion's
    own settings, and record the results. A person's sign-off is left to the person."""
    path = roadmap_path(inv, roadmap)
    assert path is not None
    loaded = load_roadmap(path, inv)
    for phase_id in phases or []:
        loaded.phase(phase_id)
    resolved = {c.name: c for cs in loaded.criteria(report.candidate).values() for c in cs}
    results: list[GateResult] = []
    for phase in report.phases:
        if phases and phase.id not in phases:
            continue
        for status in phase.criteria:
            c = resolved[status.name]
            if status.met or not gate_class(c.gate).runnable:
                continue
            scoped = with_settings(inv, c.gate, dict(c.spec.settings))
            if c.spec.command is not None:
                only = {c.spec.command: inv.spec.gates.commands[c.spec.command]}
                gates = scoped.spec.gates.model_copy(update={"commands": only})
                scoped = replace(scoped, spec=scoped.spec.model_copy(update={"gates": gates}))
            if on_start is not None:
                on_start(f"{phase.id}/{c.name}")
            results += run_gates(
                scoped, store, c.gate, c.backend, c.baseline, progress=progress, session=session
            )
    return results
