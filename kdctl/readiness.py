"""The three answers a lead asks for, derived from live probes and evidence only:

1. which backend takes traffic now, at what weight, and whether it is speed-optimized (its
   throughput gate passed on fresh evidence; "unmeasured" without any, never "yes");
2. which phases remain;
3. whether traffic can move to the candidate now, or what blocks it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel

from kdctl.checks._gate import (
    ProgressHook,
    freshness_window,
    gate_class,
    gates,
    with_settings,
)
from kdctl.checks.result import GateResult, utcnow
from kdctl.errors import InputError
from kdctl.evidence import EvidenceStore, freshness
from kdctl.evidence.freshness import age_text
from kdctl.gating import Identity, identify_backends, run_gates
from kdctl.inventory import LoadedInventory
from kdctl.roadmap import (
    PhaseReport,
    evaluate,
    load_roadmap,
    roadmap_path,
)

if TYPE_CHECKING:
    from kdctl.status import TrafficStatus

Speed = Literal["yes", "no", "unmeasured"]


class ServingAnswer(BaseModel):
    backend: str | None
    weight: int | None = None
    router: str | None = None
    # Where the weights were read: the router's live state, or only the inventory's word.
    source: str = "inventory"
    speed_optimized: Speed
    detail: str
    evidence_id: str | None = None


class LatestVerdict(BaseModel):
    gate: str
    backend: str
    baseline: str | None
    verdict: str
    ended_at: datetime
    age: str
    evidence_id: str


def latest_verdicts(
    inv: LoadedInventory, store: EvidenceStore, now: datetime | None = None
) -> list[LatestVerdict]:
    """The newest result of every gate for every backend, with its age: what `status` lists
    beside the live probes (freshness is the roadmap's business, not this table's)."""
    now = now or utcnow()
    found = []
    for backend in inv.backends:
        for gate in sorted(gates()):
            r = store.latest(gate, backend)
            if r is not None:
                found.append(
                    LatestVerdict(
                        gate=gate,
                        backend=backend,
                        baseline=r.baseline,
                        verdict=r.verdict,
                        ended_at=r.ended_at,
                        age=age_text(now - r.ended_at),
                        evidence_id=r.id,
                    )
                )
    return found


class CutoverAnswer(BaseModel):
    candidate: str | None
    target: str | None
    can_cut_over: bool | None
    blocking: list[str] = []


class Answers(BaseModel):
    serving: ServingAnswer
    remaining_phases: list[str]
    cutover: CutoverAnswer

    def lines(self) -> list[str]:
        s = self.serving
        if s.backend is None:
            serving = f"Serving now: unknown ({s.detail})"
        else:
            weight = f" at weight {s.weight}" if s.weight is not None else ""
            serving = f"Serving now: {s.backend}{weight}; speed-optimized: {s.speed_optimized}"
            serving += f" ({s.detail})"
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
            cut = f"Cut over to {c.candidate} now: no; blocked by {shown}"
        return [serving, remaining, cut]


@dataclass(frozen=True)
class Readiness:
    answers: Answers
    phases: PhaseReport | None
    identities: dict[str, Identity]


def assess(
    inv: LoadedInventory,
    store: EvidenceStore,
    *,
    roadmap: Path | None = None,
    target: str | None = None,
    candidate: str | None = None,
    timeout_s: float = 15.0,
    now: datetime | None = None,
    traffic: TrafficStatus | None = None,
    identities: dict[str, Identity] | None = None,
) -> Readiness:
    """Evaluate the roadmap and the serving backend against what the engines report now.

    `traffic` and `identities` are the router's state and what engines said they are, where
    the caller has just asked (`kdctl status` does), so that nothing is asked twice.
    """
    from kdctl.status import live_traffic  # status shows these answers, so it imports us

    now = now or utcnow()
    path = roadmap_path(inv, roadmap)
    loaded = load_roadmap(path, inv) if path is not None else None
    traffic = traffic or live_traffic(inv)
    serving = traffic.serving
    if candidate is not None and candidate not in inv.backends:
        known = ", ".join(sorted(inv.backends))
        raise InputError(f"unknown backend {candidate!r} (known: {known})")
    identities = dict(identities or {})

    def identify(names: set[str]) -> dict[str, Identity]:
        # One round of questions per assessment; an engine with no evidence is not asked.
        missing = names - identities.keys()
        if missing:
            identities.update(identify_backends(inv, missing, timeout_s=timeout_s))
        return {n: identities[n] for n in names}

    if serving and store.latest("throughput", serving) is not None:
        identify({serving})
    report = (
        evaluate(loaded, inv, store, identify, target=target, candidate=candidate, now=now)
        if loaded
        else None
    )
    blocking = [f"{c.phase}/{c.name}: {c.reason}" for c in report.blocking] if report else []
    if report is not None:
        # Traffic cannot move to an engine that does not answer, whatever its evidence says.
        cand = identify({report.candidate})[report.candidate]
        if not cand.live:
            blocking.append(f"{report.candidate} is not answering: {cand.note}")
    answers = Answers(
        serving=_serving(inv, store, traffic, identities, now),
        remaining_phases=[f"{p.id} ({p.status})" for p in report.remaining] if report else [],
        cutover=CutoverAnswer(
            candidate=report.candidate if report else candidate,
            target=report.target if report else None,
            can_cut_over=not blocking if report else None,
            blocking=blocking,
        ),
    )
    return Readiness(answers=answers, phases=report, identities=identities)


def _serving(
    inv: LoadedInventory,
    store: EvidenceStore,
    traffic: TrafficStatus,
    identities: dict[str, Identity],
    now: datetime,
) -> ServingAnswer:
    serving = traffic.serving
    if traffic.router is None:
        return ServingAnswer(
            backend=None, speed_optimized="unmeasured", detail="no router in the inventory"
        )
    if serving is None:
        return ServingAnswer(
            backend=None,
            router=traffic.router,
            source=traffic.source,
            speed_optimized="unmeasured",
            detail=f"the {traffic.router} router sends traffic to no backend",
        )
    latest: GateResult | None = store.latest("throughput", serving)
    base = {
        "backend": serving,
        "weight": traffic.weights.get(serving),
        "router": traffic.router,
        "source": traffic.source,
    }
    if latest is None:
        return ServingAnswer(
            **base, speed_optimized="unmeasured", detail="no throughput result on record"
        )
    ident = identities.get(serving)
    if ident is None:
        return ServingAnswer(**base, speed_optimized="unmeasured", detail="identity unknown")
    f = freshness(
        latest,
        window=freshness_window(inv, "throughput"),
        current=ident.provenance,
        now=now,
        live=ident.live,
    )
    if not f.fresh:
        return ServingAnswer(
            **base,
            speed_optimized="unmeasured",
            detail=f"the last throughput result is {f.reason}",
            evidence_id=latest.id,
        )
    ago = age_text(now - latest.ended_at)
    against = f" against {latest.baseline}" if latest.baseline else ""
    if latest.verdict == "pass":
        ratios = [m for m in latest.metrics if m.name.endswith(".ratio")]
        shown = ", ".join(f"{m.name} {m.value}" for m in ratios)
        return ServingAnswer(
            **base,
            speed_optimized="yes",
            detail=f"throughput passed{against} {ago} ago" + (f": {shown}" if shown else ""),
            evidence_id=latest.id,
        )
    word: Speed = "unmeasured" if latest.verdict in ("inconclusive", "error", "skipped") else "no"
    first = latest.reasons[0] if latest.reasons else ""
    return ServingAnswer(
        **base,
        speed_optimized=word,
        detail=f"throughput {latest.verdict}{against} {ago} ago: {first}",
        evidence_id=latest.id,
    )


def run_criteria(
    inv: LoadedInventory,
    store: EvidenceStore,
    report: PhaseReport,
    *,
    roadmap: Path | None = None,
    phases: list[str] | None = None,
    on_start: Callable[[str], None] | None = None,
    progress: ProgressHook | None = None,
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
            results += run_gates(scoped, store, c.gate, c.backend, c.baseline, progress=progress)
    return results
