"""The three answers a lead asks for, derived from live probes and evidence only:

1. who answers through the router's front door now (serving, degraded, nothing or unknown),
   and whether that engine is speed-optimized by the roadmap's own speed criterion, fresh
   against what answers ("unmeasured" without such evidence, never "yes");
2. which phases remain;
3. whether traffic can move to the candidate now, or what blocks it.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import date, datetime, timedelta
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
    utcnow,
    with_settings,
)
from kdctl.errors import InputError
from kdctl.evidence import EvidenceStore, FrontNow, age_text, currency, shared_url
from kdctl.inventory import LoadedInventory, SystemdService
from kdctl.probes import ServiceState
from kdctl.recording import run_gates
from kdctl.roadmap import (
    CriterionStatus,
    Estimate,
    PhaseReport,
    PhaseStatus,
    Roadmap,
    evaluate,
    evaluate_criterion,
    latest_crossing,
    load_roadmap,
    roadmap_path,
    undated_why,
)
from kdctl.serving import EngineAnswer, ServingProbe, probe_serving
from kdctl.session import Identity, Session, recorded_identities, using
from kdctl.traffic import CutoverRecord, open_journal

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

    # Since when what answers now has answered, or nothing has, where it can be known, and
    # from what (the journal's last change, a unit's state change).
    since: datetime | None = None
    since_from: str | None = None
    # Line 1 in a few words: who answers (a split as its shares), where, what to know at once
    # (a change written and not applied, workers the inventory does not name), and, for
    # "nothing" and "unknown", each engine that does not answer; `detail` holds the whole.
    who_short: str | None = None
    where: str | None = None
    flags: list[str] = []
    engines_short: list[str] = []
    # The speed judgement in a few words (the whole of it is `speed`).
    speed_short: str | None = None
    # Where the router sends to pools' replicas: how many boxes each pool serves from
    # ("native on 2/4 boxes, sglang on 2/4"), by the router's read-back.
    mix: str | None = None

    def line(self) -> str:
        """Line 1, in a few words; `detail` and `speed` say the whole of it."""
        since = f" since {self.since:%Y-%m-%d %H:%M}" if self.since else ""
        speed = f"; speed: {self.speed_short}" if self.speed_short else ""
        if self.speed_short and self.speed_of is not None:
            speed = (
                f"; speed of {self.speed_of}, {self.speed_share}% of traffic: {self.speed_short}"
            )
        flag = f" ({'; '.join(self.flags)})" if self.flags else ""
        if self.state in ("serving", "degraded"):
            who = self.who_short or self.backend or "an engine the router does not name"
            where = f" through {self.router} on {self.where}" if self.router else ""
            if self.state == "degraded":
                return _fit(
                    f"Serving now: degraded: {who}{where}, part of the traffic fails{flag}{speed}."
                )
            return _fit(f"Serving now: {who}{where}{since}{flag}{speed}.")
        why = "; ".join([*self.flags, *self.engines_short])
        if self.state == "nothing":
            return _fit(f"Serving now: nothing{since}" + (f" ({why})." if why else "."))
        return _fit(f"Serving now: unknown ({why or 'no answer was seen'}).")


def _fit(text: str, width: int = 160) -> str:
    """A line a lead reads at a glance: cut at a word, never mid-name, where it runs over (the
    whole of it is printed below)."""
    if len(text) <= width:
        return text
    cut = text[: width - 5].rsplit(" ", 1)[0].rstrip(",;:(")
    return f"{cut} ..."


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
            base = known.get(r.baseline) if r.baseline else None
            f = currency(
                r,
                window=freshness_window(inv, gate),
                current=ident.provenance if ident else None,
                live=ident.live if ident else False,
                baseline=base.provenance if base else None,
                # The settings it may have run under: the inventory's, or a roadmap
                # criterion's own (`phases --run` runs each criterion's gate under its own).
                ways=[inv, *asked.get((gate, backend), [])],
                now=now,
                memo=memo,
            )
            verdict.fresh, verdict.freshness = f.fresh, f.reason
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
    # The date was fitted to results whose dates were set, not measured (sandbox history).
    dated_back: bool = False
    # By the roadmap's estimates instead of measured trends, where its phases carry them.
    estimate: Estimate | None = None


# Most important first: traffic cannot move to an engine that does not answer; a failure is
# work to do; a result that no longer holds is a measurement to make again; then what was
# never measured.
BlockerKind = Literal["not-answering", "fail", "stale", "missing"]
_RANK: dict[str, int] = {"not-answering": 0, "fail": 1, "stale": 2, "missing": 3}
_SAID = {"fail": "fails", "stale": "no longer holds", "missing": "never measured"}
# A result that did not pass without failing: its gate judged nothing, so nothing "fails".
_UNJUDGED = {"inconclusive": "is inconclusive", "error": "errored"}


class Blocker(BaseModel):
    """One thing that keeps traffic from moving now, and the command that would measure or
    fix it."""

    kind: BlockerKind
    phase: str | None = None
    criterion: str | None = None
    # The verdict of the result that keeps a criterion unmet: `fail`, or `inconclusive` and
    # `error`, which judged nothing (null where no result counts).
    verdict: str | None = None
    reason: str
    fix: str | None = None

    @property
    def text(self) -> str:
        return f"{self.phase}/{self.criterion}: {self.reason}" if self.criterion else self.reason

    @property
    def said(self) -> str:
        """Why it blocks, in a word or two: "fails", "is inconclusive", "never measured"."""
        if self.kind == "not-answering":
            return "not answering"
        if self.kind == "fail":
            return _UNJUDGED.get(self.verdict or "", _SAID["fail"])
        return _SAID[self.kind]

    @property
    def short(self) -> str:
        if self.criterion:
            return f"{self.phase}/{self.criterion} {self.said}"
        return self.reason.split(":")[0]


class ServesAll(BaseModel):
    """The candidate already serves all traffic through the front: the cutover is done."""

    backend: str
    since: datetime | None = None
    cutover: str | None = None


class CutoverAnswer(BaseModel):
    candidate: str | None
    target: str | None
    can_cut_over: bool | None
    # Each blocker's whole text, most important first (`blockers` holds them with their fix).
    blocking: list[str] = []
    blockers: list[Blocker] = []
    soon: Soon | None = None
    # Where the candidate is stopped (it shares GPUs with the engine serving): how its
    # evidence was held, since no engine answered for it.
    held: str | None = None
    serves_all: ServesAll | None = None

    def line(self) -> str:
        c = self
        if c.serves_all is not None:
            done = c.serves_all
            since = f" since {done.since:%Y-%m-%d %H:%M}" if done.since else ""
            by = f" (cutover {done.cutover})" if done.cutover else ""
            left = f"; prerequisites unmet: {_counted(c.blockers)}" if c.blockers else ""
            return _fit(
                f"Cut over to {done.backend}: done; it serves all traffic{since}{by}{left}."
            )
        if c.can_cut_over is None:
            return "Cut over now: unknown (no roadmap selected)."
        held = (
            f"; {c.candidate} is stopped, its evidence held until the swap judges it (below)"
            if c.held
            else ""
        )
        if c.can_cut_over:
            return _fit(
                f"Cut over to {c.candidate} now: yes (every prerequisite of {c.target} is met)"
                f"{held}."
            )
        n = len(c.blockers)
        soon = "soon: no forecast"
        if c.soon is not None and c.soon.eta is not None:
            dated = ", from results dated back" if c.soon.dated_back else ""
            soon = f"soon: {c.soon.eta:%Y-%m-%d} if trends hold{dated}"
        if c.soon is not None and c.soon.estimate is not None and c.soon.estimate.at:
            # A person's estimate, said as one, beside (never instead of) a measured forecast.
            by = f"{c.soon.estimate.short()} by the plan"
            soon = f"{soon}, {by}" if c.soon.eta is not None else f"soon: {by}"
        head = f"Cut over to {c.candidate} now: no; {n} blocker{'s' if n != 1 else ''}"
        first = c.blockers[0].short if c.blockers else "unknown"
        room = 160 - len(head) - len(soon) - len(", first: ; .")
        if len(first) > room:
            first = first[: room - 4].rsplit(" ", 1)[0] + " ..."
        return _fit(f"{head}, first: {first}; {soon}{held}.")


class PhaseLeft(BaseModel):
    """A phase not done, as line 2 names it."""

    id: str
    status: str
    eta: datetime | None = None
    # A phase to re-verify: when it was last done.
    done_at: datetime | None = None
    # Its forecast was fitted to results whose dates were set, not measured.
    dated_back: bool = False
    # The plan's words for it: its label, due date and owner, and whether it is past due.
    label: str | None = None
    target: date | None = None
    owner: str | None = None
    late: bool = False


class Answers(BaseModel):
    serving: ServingAnswer
    # Every phase not done, as before: "id (status[, forecast DATE])".
    remaining_phases: list[str]
    cutover: CutoverAnswer
    phases_left: list[PhaseLeft] = []

    # The moment every part of these answers was measured or read.
    assessed_at: datetime | None = None
    # Criteria whose newest result is clearly worse than their trend, with the engine versions.
    regressions: list[str] = []
    # How engines that did not say who they are were described (held to the inventory, or to
    # their newest recorded identity).
    notes: list[str] = []

    def lines(self) -> list[str]:
        """The three answers, each in at most 160 characters."""
        return [self.serving.line(), self._phases_line(), self.cutover.line()]

    def _phases_line(self) -> str:
        if self.cutover.target is None:
            return "Phases remaining: unknown (no roadmap selected: the inventory's roadmap:)."
        todo = [p for p in self.phases_left if p.status != "to_reverify"]
        again = [p for p in self.phases_left if p.status == "to_reverify"]
        if not todo and not again:
            return "Phases remaining: none."
        heads = []
        if todo:
            heads.append(f"Phases remaining ({len(todo)}): ")
        if again:
            lead = "to re-verify" if todo else "Phases remaining: none; to re-verify"
            heads.append(f"{lead} ({len(again)}): ")
        room = (160 - sum(map(len, heads)) - 3) // len(heads)
        named = [_names(ps, room) for ps in (todo, again) if ps]
        return "; ".join(h + n for h, n in zip(heads, named, strict=True)) + "."

    def why_not_now(self) -> list[str]:
        """Every blocker, grouped by phase, the most important first, each with the command
        that would measure or fix it."""
        if not self.cutover.blockers:
            return []
        groups: dict[str, list[Blocker]] = {}
        for b in self.cutover.blockers:
            groups.setdefault(b.phase or "", []).append(b)
        out = [f"Why not now ({len(self.cutover.blockers)}):"]
        for phase, bs in groups.items():
            for b in bs:
                what = f"{b.criterion}: {b.reason}" if b.criterion else b.reason
                fix = f"  -> {b.fix}" if b.fix else ""
                out.append(f"  {phase + ': ' if phase else ''}{what}{fix}")
        return out

    def details(self) -> list[str]:
        """What the three lines leave out, in full: the serving probe's detail and speed, the
        forecast, how a stopped candidate's evidence is held, regressions."""
        s = self.serving
        out = [f"Serving: {s.detail}" + (f" ({s.since_from})" if s.since_from else "")]
        if s.speed and s.speed_of is not None:
            out.append(f"Speed of {s.speed_of}, {s.speed_share}% of traffic: {s.speed}")
        elif s.speed:
            out.append(f"Speed: {s.speed}")
        again = [p for p in self.phases_left if p.status == "to_reverify" and p.done_at]
        if again:
            out.append(
                "To re-verify (done before; their evidence no longer holds): "
                + ", ".join(f"{p.id} (was done {p.done_at:%Y-%m-%d %H:%M})" for p in again)
            )
        c = self.cutover
        if c.soon is not None and c.blockers:
            out.append(f"Soon: {c.soon.detail}")
            if c.soon.estimate is not None:
                out.append(f"Estimate: {c.soon.estimate.detail}")
        late = [p for p in self.phases_left if p.late]
        if late:
            out.append(
                "Late: "
                + ", ".join(
                    f"{p.id} (due {p.target}" + (f", {p.owner}" if p.owner else "") + ")"
                    for p in late
                )
            )
        if c.held:
            out.append(f"Held: {c.held}")
        if self.regressions:
            out.append("Regressions: " + "; ".join(self.regressions))
        out += [f"Note: {n}" for n in self.notes]
        return out


def _names(phases: list[PhaseLeft], room: int) -> str:
    """Phase ids (with a forecast date where there is one) in `room` characters, the rest
    counted."""
    shown: list[str] = []
    for i, p in enumerate(phases):
        dated = ", dated back" if p.dated_back else ""
        word = p.id + (f" (forecast {p.eta:%Y-%m-%d}{dated})" if p.eta else "")
        more = f", +{len(phases) - i - 1} more" if i < len(phases) - 1 else ""
        if shown and len(", ".join([*shown, word])) + len(more) > room:
            return ", ".join(shown) + f", +{len(phases) - i} more"
        shown.append(word)
    return ", ".join(shown)


@dataclass(frozen=True)
class Readiness:
    answers: Answers
    phases: PhaseReport | None
    identities: dict[str, Identity]
    # The results `phases --run` recorded before judging, in the order they ran.
    ran: list[GateResult] = field(default_factory=list)

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
    services: Mapping[str, ServiceState] | None = None,
    session: Session | None = None,
    deep: bool = False,
) -> Readiness:
    """The three answers from one moment: who answers through the front now, the roadmap
    evaluated against what the engines report now, and whether traffic may move.

    `serving` is what the caller has just measured, and the session holds who each engine
    said it is (`kdctl status` probes every engine anyway), so that nothing is asked twice.
    Without a session, one of its own runs a command-mode engine's binary to ask who it is only
    with `deep`, as status does.
    """
    # Read only for a session of its own: the caller's already knows how it asks.
    own = None if deep or session is not None else recorded_identities(inv, store)
    with using(inv, session, recorded=own) as s:
        return _assess(inv, store, s, roadmap, target, candidate, timeout_s, now, serving, services)


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
    services: Mapping[str, ServiceState] | None,
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
    blockers = [_blocker(c) for c in report.blocking] if report else []
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
            blockers.append(
                Blocker(
                    kind="not-answering",
                    reason=f"{report.candidate} is stopped and its host {spec.host} could not be "
                    "read (its identity and checkpoint): its evidence cannot be held to anything "
                    "measured",
                    fix=f"check SSH to {spec.host} (kdctl status)",
                )
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
        elif not cand.live:
            blockers.append(
                Blocker(
                    kind="not-answering",
                    reason=f"{report.candidate} is not answering: {cand.note}",
                    fix=_start_fix(inv, report.candidate),
                )
            )
            # phases --json and every report carry the same verdict as answer 3.
            report = report.model_copy(update={"target_reachable": False})
        elif (broken := _not_generating(probe, report.candidate)) is not None:
            # Its health and info answer, but the one-token generation the serving probe
            # sent it failed: traffic moved there would fail the same way.
            blockers.append(
                Blocker(
                    kind="not-answering",
                    reason=f"{report.candidate} is not generating: {broken}",
                    fix=f"see its log on {spec.host}, then restart it",
                )
            )
            report = report.model_copy(update={"target_reachable": False})
    blockers.sort(key=lambda b: _RANK[b.kind])
    soon = _soon(report) if report is not None and blockers else None
    if soon is not None and report is not None and report.estimate is not None:
        soon = soon.model_copy(update={"estimate": report.estimate})
    last_change = _last_change(inv)
    answer1 = _serving(inv, store, loaded, probe, identify, now)
    _since(answer1, inv, store, last_change, services or {})
    answers = Answers(
        serving=answer1,
        remaining_phases=[_remaining(p) for p in report.remaining] if report else [],
        phases_left=[
            PhaseLeft(
                id=p.id,
                status=p.status,
                eta=p.eta,
                done_at=p.last_done_at if p.status == "to_reverify" else None,
                dated_back=_dated_back(p),
                label=p.label,
                target=p.target,
                owner=p.owner,
                late=p.late,
            )
            for p in (report.remaining if report else [])
        ],
        cutover=CutoverAnswer(
            candidate=report.candidate if report else candidate,
            target=report.target if report else None,
            can_cut_over=not blockers if report else None,
            blocking=[b.text for b in blockers],
            blockers=blockers,
            soon=soon,
            held=held,
            serves_all=_serves_all(probe, report.candidate, last_change) if report else None,
        ),
        assessed_at=now,
        notes=report.notes if report else [],
        regressions=[
            f"{c.phase}/{c.name}: {c.trend.regression}"
            for p in (report.phases if report else [])
            for c in p.criteria
            if c.trend is not None and c.trend.regression
        ],
    )
    return Readiness(answers=answers, phases=report, identities=identities)


def _counted(blockers: list[Blocker]) -> str:
    """How many blockers of each kind, in their order of importance: "1 fails, 3 never
    measured". A prerequisite never measured is not one that no longer holds."""
    counts: dict[str, int] = {}
    for b in sorted(blockers, key=lambda b: _RANK[b.kind]):
        counts[b.said] = counts.get(b.said, 0) + 1
    return ", ".join(f"{n} {said}" for said, n in counts.items())


def _blocker(c: CriterionStatus) -> Blocker:
    kind: BlockerKind = "fail" if c.state == "pass" else c.state
    fix: str | None = None
    if c.gate == "sign-off":
        fix = f"kdctl signoff --backend {c.backend} --by NAME --note WHAT-WAS-CHECKED"
    elif c.gate == "promotion":
        fix = f"kdctl cutover --to {c.backend}"
    elif gate_class(c.gate).runnable:
        fix = f"kdctl phases --run --phase {c.phase}"
    verdict = c.verdict if c.state == "fail" else None
    return Blocker(
        kind=kind, phase=c.phase, criterion=c.name, verdict=verdict, reason=c.reason, fix=fix
    )


def _not_generating(probe: ServingProbe, name: str) -> str | None:
    """Why `name` failed the serving probe's one-token generation, or None where it
    generated, was not asked, or refused kdctl's key."""
    tried = next((e for e in probe.engines if e.name == name), None)
    if tried is None or tried.generated is not False:
        return None
    return tried.detail or "a one-token generation fails"


def _start_fix(inv: LoadedInventory, name: str) -> str:
    spec = inv.backends[name]
    service = spec.service
    if isinstance(service, SystemdService):
        user = " --user" if service.scope == "user" else ""
        return f"start it: systemctl{user} start {service.systemd} on {spec.host}"
    if service is not None:
        return f"start it: its command service on {spec.host} (pidfile {service.pidfile})"
    if spec.url is None:
        return f"give it a server: {name} runs in command mode (no URL to send traffic to)"
    return f"start it on {spec.host}: nothing answers at {spec.url}"


def _last_change(inv: LoadedInventory) -> CutoverRecord | None:
    """The journal's newest cutover or rollback; None where the journal was never written (a
    status creates no journal)."""
    if shared_url(inv) is None and not (inv.state_dir / "traffic.sqlite").exists():
        return None
    with open_journal(inv) as journal:
        return journal.latest()


def _changed_to(record: CutoverRecord | None, backend: str | None) -> datetime | None:
    """When the journal's last change left all traffic on `backend`, if it did."""
    if record is None or record.ended_at is None or backend is None:
        return None
    if record.state == "succeeded" and record.to_backend == backend:
        return record.ended_at
    if record.state == "rolled_back" and record.from_backend == backend:
        return record.ended_at
    return None


def _serves_all(
    probe: ServingProbe, candidate: str, last_change: CutoverRecord | None
) -> ServesAll | None:
    """The candidate answers through the front, and the router sends it everything."""
    routed = probe.routed
    if probe.answered is not True or probe.backend != candidate or routed is None:
        return None
    weights = {n: w for n, w in routed.weights.items() if w > 0}
    if weights != {candidate: 100} or routed.applied is False:
        return None
    since = _changed_to(last_change, candidate)
    return ServesAll(
        backend=candidate,
        since=since,
        cutover=last_change.id if since is not None and last_change is not None else None,
    )


# Gates whose pass means the engine answered kdctl.
_ANSWERED = ("health", "exactness", "throughput", "api-conformance")


def _since(
    answer: ServingAnswer,
    inv: LoadedInventory,
    store: EvidenceStore,
    last_change: CutoverRecord | None,
    services: Mapping[str, ServiceState],
) -> None:
    """Since when line 1 holds, where it can be known: for an engine serving, the journal's
    change that left traffic on it; for nothing, the moment the engine that served last
    stopped, by its unit's own state change, else the last time kdctl saw it answer."""
    if answer.state == "serving" and answer.backend is not None:
        at = _changed_to(last_change, answer.backend)
        if at is not None and last_change is not None:
            answer.since = at
            verb = "cutover" if last_change.state == "succeeded" else "rollback of cutover"
            answer.since_from = f"since {at:%Y-%m-%d %H:%M} by the journal: {verb} {last_change.id}"
        return
    if answer.state != "nothing":
        return
    said = []
    last = None
    if last_change is not None and last_change.state not in ("running", "failed"):
        last = (
            last_change.to_backend if last_change.state == "succeeded" else last_change.from_backend
        )
        said.append(f"{last} served last (the journal: cutover {last_change.id})")
    elif inv.spec.router is not None:
        last = inv.spec.router.serving
        said.append(f"{last} is the engine the inventory's router serves")
    svc = services.get(last) if last else None
    if svc is not None and svc.state in ("stopped", "failed") and svc.since is not None:
        answer.since = svc.since
        said.append(f"its {svc.kind} service {svc.name} {svc.state} at {svc.since:%Y-%m-%d %H:%M}")
    seen = [
        (r.ended_at, r.backend)
        for n in inv.backends
        for gate in _ANSWERED
        for r in store.results(gate=gate, backend=n, limit=1)
        if r.verdict == "pass"
    ]
    if seen:
        at, who = max(seen)
        said.append(f"the last answer kdctl recorded is {who}'s, {at:%Y-%m-%d %H:%M}")
    answer.since_from = "; ".join(said) or None


def _dated_back(phase: PhaseStatus) -> bool:
    return phase.eta is not None and any(
        c.trend is not None and c.trend.note for c in phase.criteria
    )


def _remaining(phase: PhaseStatus) -> str:
    if phase.eta is None:
        return f"{phase.id} ({phase.status})"
    # A forecast fitted to results whose dates were set (sandbox history) says so.
    also = ", from results dated back" if _dated_back(phase) else ""
    return f"{phase.id} ({phase.status}, forecast {phase.eta:%Y-%m-%d}{also})"


def _soon(report: PhaseReport) -> Soon:
    """From the trends of the criteria that block the target: a date only when each has one."""
    crossing = latest_crossing(report.blocking)
    if crossing.last is None:
        named = "; ".join(f"{c.phase}/{c.name} ({undated_why(c)})" for c in crossing.undated[:4])
        # The date stays unknown, but what the others' trends say is still worth knowing.
        partial = "".join(
            f"; {c.phase}/{c.name} would cross about {c.trend.eta:%Y-%m-%d} if it keeps moving "
            f"{c.trend.slope_per_day:+.4g}/day"
            for c in crossing.dated[:2]
            if c.trend is not None and c.trend.eta is not None
        )
        return Soon(detail=(f"no forecast for {named}" if named else "no forecast") + partial)
    last = crossing.last
    t = last.trend
    assert t is not None and t.eta is not None
    # The range is the slope's 95% interval; where it reaches flat there is no latest date.
    span = (
        f" (range {t.eta_range[0]:%Y-%m-%d} to {t.eta_range[1]:%Y-%m-%d})"
        if t.eta_range
        else " (no latest date)"
    )
    return Soon(
        eta=t.eta,
        eta_range=t.eta_range,
        limited_by=f"{last.phase}/{last.name}",
        detail=f"about {t.eta:%Y-%m-%d}{span} if {last.phase}/{last.name} keeps moving "
        f"{t.slope_per_day:+.4g}/day from its newest result ({t.metric} {t.threshold}), "
        "the trend holding" + (f" ({t.note})" if t.note else ""),
        dated_back=bool(t.note),
    )


def _serving(
    inv: LoadedInventory,
    store: EvidenceStore,
    roadmap: Roadmap | None,
    probe: ServingProbe,
    identify: Callable[[set[str]], Mapping[str, Identity]],
    now: datetime,
) -> ServingAnswer:
    answer = _judged_speed(inv, store, roadmap, probe, identify, now)
    if answer.speed_optimized == "unmeasured" and answer.speed_short is None:
        answer.speed_short = "unmeasured"
    return answer


def _judged_speed(
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
    _briefly(answer, inv)
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
        answer.speed_short = "unmeasured"
        return answer
    if roadmap is None:
        answer.speed_optimized = "unmeasured"
        answer.speed = "unmeasured (no roadmap: speed is judged by its speed criterion)"
        return answer
    if who == roadmap.spec.serving:
        answer.speed_optimized = "baseline"
        answer.speed = answer.speed_short = "the baseline"
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
        answer.speed_short = f"unmeasured ({measured}, held to the inventory)"
    elif status.state == "pass":
        answer.speed_optimized = "yes"
        answer.speed = f"{measured} {where} ({needs}; {ago})"
        answer.speed_short = f"yes, {measured}"
    elif status.state == "fail" and status.verdict in _UNJUDGED:
        # Its gate judged nothing (runs of other lengths, paths, a lossy baseline): a ratio
        # it shows is no measured "no", nor a "yes".
        answer.speed_optimized = "unmeasured"
        answer.speed = f"{measured} shown, not judged, {where} ({needs}; {ago}): {status.reason}"
        answer.speed_short = f"not judged ({measured} shown; {status.verdict})"
    elif status.state == "fail":
        answer.speed_optimized = "no"
        answer.speed = f"{measured} {where} ({needs}; {ago}): {status.reason}"
        answer.speed_short = f"no, {measured} ({needs})"
    else:
        answer.speed_optimized = "unmeasured"
        answer.speed = f"unmeasured by {criterion.name} ({needs}): {status.reason}"
    return answer


def _briefly(answer: ServingAnswer, inv: LoadedInventory) -> None:
    """Line 1's few words, from the same probe as its detail."""
    router = inv.spec.router
    if router is not None:
        remote = inv.hosts[router.host].transport != "local"
        answer.where = (
            f"{router.host}:{router.listen.rpartition(':')[2]}" if remote else router.listen
        )
    routed = answer.routed
    if router is None:
        up = [e.name for e in answer.engines if e.serves]
        whose = "its own URL" if len(up) == 1 else "their own URLs"
        answer.who_short = f"{', '.join(up)} on {whose}"
    split = {n: w for n, w in (routed.weights if routed else {}).items() if w > 0}
    if routed is not None and len(split) > 1 and routed.applied is not False:
        answer.who_short = ", ".join(
            f"{n} {w}%" for n, w in sorted(split.items(), key=lambda kv: -kv[1])
        )
    answer.mix = _mix(inv, split)
    if answer.mix is not None and len(split) > 1:
        answer.who_short = answer.mix
    if routed is not None and routed.applied is False:
        answer.flags.append("a router change is written, not applied")
    if routed is not None and routed.unknown_workers(inv):
        answer.flags.append("the router also sends to workers the inventory does not name")
    if answer.state in ("serving", "degraded"):
        return
    front = answer.front
    if front is not None and answer.where is not None:
        if front.answered is None:
            answer.engines_short.append(f"the router on {answer.where} could not be asked")
        elif front.answered is False:
            answer.engines_short.append(f"the router on {answer.where} {front.detail}")
    answer.engines_short += [_engine_brief(e, inv) for e in answer.engines if not e.serves]


def _mix(inv: LoadedInventory, routed: Mapping[str, int]) -> str | None:
    """How many boxes each pool serves from, where the router sends to pools' replicas."""
    pools = [inv.pool_of(n) for n in routed]
    if not pools or None in pools:
        return None
    boxes = {inv.backends[m].host for p in set(pools) if p for m in inv.pools[p]}
    counts = Counter(p for p in pools if p)
    said = [
        f"{pool} on {n}/{len(boxes)}" + (" boxes" if i == 0 else "")
        for i, (pool, n) in enumerate(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    ]
    return ", ".join(said)


def _engine_brief(e: EngineAnswer, inv: LoadedInventory) -> str:
    spec = inv.backends.get(e.name)
    unit = spec.service.systemd if spec and isinstance(spec.service, SystemdService) else None
    svc = (e.service or "").partition(": ")[2]
    if e.state == "up":
        return f"{e.name} up, not generating" if e.generated is False else f"{e.name} up"
    if e.state == "starting":
        return f"{e.name} not ready"
    if "unreachable from here" in (e.detail or ""):
        runs = ", its service runs" if svc.startswith(("running", "active")) else ""
        return f"{e.name} unreachable from here{runs}"
    if e.state == "down" and unit and svc.startswith(("inactive", "failed")):
        return f"{unit} {svc.split('/')[0]}"
    if e.state == "down" and svc in ("stopped", "no pidfile", "stale pidfile"):
        return f"{e.name} not started"
    return f"{e.name} {'down' if e.state == 'down' else 'not answering'}"


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
    timeout_s: float = 15.0,
    deep: bool = False,
    on_start: Callable[[str], None] | None = None,
    progress: ProgressHook | None = None,
    session: Session | None = None,
) -> Readiness:
    """`kdctl phases`: the assessment of the roadmap; with `run`, the gate behind every unmet
    criterion (of the phases in `only`) runs first, and the answers come from what it recorded.
    `timeout_s` bounds each engine's answer to who it is. A command-mode engine's binary loads
    its model to say: it is run to ask only with `deep` or `run` (which runs it to measure
    anyway); otherwise it is described by its newest recorded identity, as status does."""

    def assessed(s: Session) -> Readiness:
        return assess(
            inv,
            store,
            roadmap=roadmap,
            target=target,
            candidate=candidate,
            timeout_s=timeout_s,
            session=s,
        )

    own = None if deep or run or session is not None else recorded_identities(inv, store)
    with using(inv, session, recorded=own) as s:
        found = assessed(s)
        if found.phases is None:
            raise InputError(f"{inv.path}: no roadmap selected (set roadmap: or --roadmap)")
        if not run:
            return found
        ran = run_criteria(
            inv,
            store,
            found.phases,
            roadmap=roadmap,
            phases=only,
            on_start=on_start,
            progress=progress,
            session=s,
        )
        return replace(assessed(s), ran=ran)


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
        unread=probe.routed.error,
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
    # Criteria of several phases may ask for one measurement (the same gate, engines and
    # settings): it runs once, and its result, recorded a moment ago, is judged for each.
    ran: set[str] = set()
    for phase in report.phases:
        if phases and phase.id not in phases:
            continue
        for status in phase.criteria:
            c = resolved[status.name]
            if status.met or not gate_class(c.gate).runnable:
                continue
            same = json.dumps(
                [c.gate, c.backend, c.baseline, c.spec.command, c.spec.settings],
                sort_keys=True,
                default=str,
            )
            if same in ran:
                continue
            ran.add(same)
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
