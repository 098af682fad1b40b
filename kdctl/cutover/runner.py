"""The runner: a plan executed under the traffic lock, every step journaled before and after it
is applied, and whatever breaks rolled back to where traffic was; the preflight that holds a
cutover to the roadmap, and the promotion evidence a finished one leaves."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from typing import Any, ClassVar, Literal

from pydantic import BaseModel

from kdctl.checks.promotion import promotion_result
from kdctl.cutover.analysis import AnalysisFailed, WatchResult, watch_front
from kdctl.cutover.plan import Drain, Plan, SetWeights, SmokeGate, Start, Step, Stop, Watch
from kdctl.errors import KdctlError
from kdctl.evidence import EvidenceStore
from kdctl.inventory import LoadedInventory
from kdctl.readiness import assess
from kdctl.recording import run_gates
from kdctl.records import GateResult, Verdict, utcnow
from kdctl.session import Session
from kdctl.traffic import Router, RouterState
from kdctl.traffic.journal import Journal


class CutoverOutcome(BaseModel):
    id: str
    plan: Plan
    # paused: a rolling cutover stopped for a person, the failed box back on its old engine.
    state: Literal["succeeded", "failed", "rolled_back", "paused"]
    reason: str | None = None
    router: RouterState | None = None
    downtime_s: float | None = None
    watches: list[WatchResult] = []


def preflight(
    inv: LoadedInventory, store: EvidenceStore, to: str, *, session: Session | None = None
) -> list[str]:
    """Every criterion that keeps `to` out, with why; empty when the cutover may go."""
    found = assess(inv, store, candidate=to, session=session)
    if found.phases is None:
        return ["no roadmap selected: nothing says the candidate is ready"]
    return list(found.answers.cutover.blocking)


@dataclass
class Runner:
    """Executes a plan; `on_step` hears of every step as it starts (for progress output)."""

    inv: LoadedInventory
    router: Router
    journal: Journal
    store: EvidenceStore
    session: Session
    on_step: Callable[[int, Step], None] | None = None
    # Started past unmet criteria: nothing is held against the new engine but its smoke gate.
    forced: bool = False
    watches: list[WatchResult] = field(default_factory=list)
    drained_at: float | None = None
    downtime_s: float | None = None
    # The plan's step that failed, where one did.
    failed_at: int | None = None

    def run(self, cid: str, plan: Plan, *, skip: set[int] | None = None) -> CutoverOutcome:
        started = utcnow()
        outcome = self._run(cid, plan, skip or set())
        for promoted in self.promotions(outcome, started):
            self.store.record(self.session.binder.bind_result(promoted))
        return outcome

    def before(self, cid: str, plan: Plan, idx: int) -> None:
        """Called before step `idx` is journaled: where a strategy heeds a person's order."""

    def promotions(self, outcome: CutoverOutcome, started: datetime) -> list[GateResult]:
        """The evidence the cutover leaves about where it moved traffic: of a pool, about
        each of its replicas."""
        return [
            record_promotion(self.inv, outcome, started, name)
            for name in self.inv.members(outcome.plan.to_backend)
        ]

    def _run(self, cid: str, plan: Plan, skip: set[int]) -> CutoverOutcome:
        try:
            for idx, step in enumerate(plan.steps):
                if idx in skip:
                    continue
                self.before(cid, plan, idx)
                if self.on_step:
                    self.on_step(idx, step)
                # The journal first: a step it cannot record is never applied.
                self.journal.step(cid, idx, step.kind, step.model_dump(), "started")
                try:
                    written = partial(
                        self.journal.step, cid, idx, step.kind, step.model_dump(), "written"
                    )
                    note = self._apply(plan, step, written)
                except (Exception, KeyboardInterrupt) as exc:
                    self.failed_at = idx
                    best_effort(
                        self.journal.step,
                        cid,
                        idx,
                        step.kind,
                        step.model_dump(),
                        "failed",
                        why(exc),
                    )
                    raise
                self.journal.step(cid, idx, step.kind, step.model_dump(), "done", note)
        # Whatever broke (a router, a full disk under the journal, Ctrl-C), the runner's promise
        # holds: traffic goes back to where it was.
        except (Exception, KeyboardInterrupt) as exc:
            reason = why(exc)
            state = self._undo(cid, plan, reason)
            return self._outcome(cid, plan, state, reason)
        self.journal.finish(cid, "succeeded")
        return self._outcome(cid, plan, "succeeded", None)

    def _outcome(self, cid: str, plan: Plan, state: Any, reason: str | None) -> CutoverOutcome:
        try:
            now = self.router.read()
        except KdctlError:
            now = None
        return CutoverOutcome(
            id=cid,
            plan=plan,
            state=state,
            reason=reason,
            router=now,
            downtime_s=self.downtime_s,
            watches=self.watches,
        )

    def _apply(
        self, plan: Plan, step: Step, on_written: Callable[[], None] | None = None
    ) -> str | None:
        if isinstance(step, SetWeights):
            # A pool's weight is its replicas' (split evenly): the router holds replicas.
            weights = self.inv.replica_weights(step.weights)
            state = self.router.apply(weights, on_written=on_written)
            if self.drained_at is not None:
                self.downtime_s = round(time.monotonic() - self.drained_at, 3)
                self.drained_at = None
            return f"read back {state.weights}"
        if isinstance(step, Watch):
            return self._watch(plan, step.seconds)
        if isinstance(step, Drain):
            self.router.drain()
            self.drained_at = time.monotonic()
            return "draining"
        if isinstance(step, Stop):
            return change_engine(self.inv, self.session, step.backend, "stop")
        if isinstance(step, Start):
            return change_engine(self.inv, self.session, step.backend, "start")
        assert isinstance(step, SmokeGate)
        return self._smoke(plan, step.backend)

    # What a started engine is held to alone, beside its health, before it takes traffic.
    smoke_gates: ClassVar[tuple[str, ...]] = ("exactness",)

    def _smoke(self, plan: Plan, name: str) -> str:
        """Health, and each smoke gate (exactness: against the golden outputs) compared with
        what the engine it replaces recorded: that engine is stopped by now, so only its
        records can be compared, never another engine's (the new one's own would compare it
        with itself). A gate it recorded nothing for is skipped, and said so."""
        results = run_gates(self.inv, self.store, "health", name, None, session=self.session)
        for gate in self.smoke_gates:
            results += run_gates(
                self.inv,
                self.store,
                gate,
                name,
                plan.from_backend,
                session=self.session,
                recorded_only=True,
            )
        bad = [r for r in results if r.verdict not in ("pass", "skipped")]
        if bad:
            raise AnalysisFailed(
                "smoke gate failed: "
                # A gate's first reasons may say what was compared before why it failed.
                + "; ".join(f"{r.gate} {r.verdict}: {'; '.join(r.reasons[:3])}" for r in bad)
            )
        if not self.forced:
            # Stopped at the preflight, the engine was held to what its host shows and the
            # inventory declares; now it answers, the evidence that cleared it must describe
            # the engine that started (its build, its settings), not the one measured before.
            unmet = preflight(self.inv, self.store, name, session=self.session)
            if unmet:
                raise AnalysisFailed(
                    f"{name} started, but its evidence does not hold for it: " + "; ".join(unmet)
                )
        return "; ".join(
            f"{r.gate} pass" if r.verdict == "pass" else (r.reasons or [f"{r.gate} skipped"])[0]
            for r in results
        )

    def _watch(self, plan: Plan, seconds: float) -> str:
        # A pool is watched through its first replica's counters, each replica's health.
        first, *rest = self.inv.members(plan.to_backend)
        result = watch_front(self.inv, self.router, first, seconds, also_healthy=rest)
        self.watches.append(result)
        if result.broke:
            raise AnalysisFailed("SLO breach during the canary: " + "; ".join(result.broke))
        return result.said()

    def _undo(
        self, cid: str, plan: Plan, reason: str
    ) -> Literal["failed", "rolled_back", "paused"]:
        """Back to the old backend: one router write; for a swap, the new engine stopped and
        the old one started first. Where even that fails, the outcome says what the router
        does now and the one command that restores it."""
        try:
            restore(self.inv, self.router, self.session, plan, self.journal, cid)
        except (Exception, KeyboardInterrupt) as exc:
            try:
                now = f"the router now sends {self.router.read().weights}"
            except KdctlError as read_exc:
                now = f"the router could not be read back ({read_exc})"
            said = (
                f"{reason}; the rollback failed too: {why(exc)}; {now}; to restore it run: "
                f"kdctl rollback (it moves all traffic back to {plan.from_backend})"
            )
            best_effort(self.journal.finish, cid, "failed", said)
            raise CutoverAborted(said) from None
        if self.drained_at is not None:
            self.downtime_s = round(time.monotonic() - self.drained_at, 3)
        best_effort(self.journal.finish, cid, "rolled_back", reason)
        return "rolled_back"


class CutoverAborted(KdctlError):
    """A cutover that failed and could not roll itself back: exit 3, with the router's state
    and the command that restores it."""

    exit_code = 3


def why(exc: BaseException) -> str:
    if isinstance(exc, KdctlError):
        return str(exc)
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    return f"{type(exc).__name__}: {exc}"


def best_effort(write: Callable[..., None], *args: Any) -> None:
    """A journal write on the way back: restoring traffic matters more than recording it."""
    # The caller reports the failure that brought it here.
    with contextlib.suppress(Exception):
        write(*args)


def record_promotion(
    inv: LoadedInventory, outcome: CutoverOutcome, started: datetime, backend: str | None = None
) -> GateResult:
    """The evidence a finished cutover leaves about its target (`backend`: one replica of a
    target pool): promoted, or rolled back."""
    plan = outcome.plan
    ends: dict[str, tuple[Verdict, str]] = {
        "succeeded": ("pass", f"all traffic moved to {plan.to_backend}"),
        "rolled_back": ("fail", f"rolled back to {plan.from_backend}: {outcome.reason}"),
        "failed": ("error", f"failed, and so did its rollback: {outcome.reason}"),
        "paused": ("inconclusive", f"paused for a person: {outcome.reason}"),
    }
    verdict, said = ends[outcome.state]
    return promotion_result(
        inv,
        backend or plan.to_backend,
        verdict=verdict,
        reason=f"cutover {outcome.id} ({plan.strategy} from {plan.from_backend}): {said}",
        cutover=outcome.id,
        from_backend=plan.from_backend,
        strategy=plan.strategy,
        weights=outcome.router.weights if outcome.router else None,
        started_at=started,
        watches=[w.model_dump() for w in outcome.watches],
        downtime_s=outcome.downtime_s,
    )


EngineChange = Literal["stop", "start"]


def change_engine(
    inv: LoadedInventory,
    session: Session,
    name: str,
    verb: EngineChange,
    *,
    deadline_s: float = 600.0,
) -> str:
    """Stop an engine, or start it (unless it runs) and wait until it answers ready."""
    spec = inv.backends[name]
    # Who the engine is changes with it: the next question about it is asked anew.
    session.forget(name)
    with session.backend(name) as be:
        control = be.lifecycle(session.transport(spec.host))
        if verb == "stop":
            control.stop()
            return f"{name} stopped"
        if control.state().state != "running":
            control.start()
        health = control.wait_ready(deadline_s=deadline_s)
        return f"{name} ready ({health.state})"


def restore(
    inv: LoadedInventory,
    router: Router,
    session: Session,
    plan: Plan,
    journal: Journal,
    cid: str,
) -> RouterState:
    # Rollback steps are numbered after the plan's, so a resume never mistakes them for it.
    try:
        record = journal.get(cid)
    except Exception:
        record = None  # a damaged journal: the router is restored all the same
    idx = 1000 + (len(record.steps) if record else 0)
    if plan.strategy == "swap":
        # Clients get 503 with Retry-After while the engines change hands, not a 502 from an
        # engine stopped under them (the swap drained; its rollback drains too).
        best_effort(journal.step, cid, idx, "rollback-drain", {}, "started")
        router.drain()
        best_effort(journal.step, cid, idx, "rollback-drain", {}, "done")
        idx += 1
        undo: tuple[tuple[str, EngineChange], ...] = (
            (plan.to_backend, "stop"),
            (plan.from_backend, "start"),
        )
        for name, verb in undo:
            best_effort(journal.step, cid, idx, f"rollback-{verb}", {"backend": name}, "started")
            change_engine(inv, session, name, verb)
            best_effort(journal.step, cid, idx, f"rollback-{verb}", {"backend": name}, "done")
            idx += 1
    weights = {plan.from_backend: 100, plan.to_backend: 0}
    detail = {"weights": weights}
    record_step = partial(best_effort, journal.step, cid, idx, "rollback-set-weights", detail)
    live = router.read()
    back = inv.replica_weights({plan.from_backend: 100}, sent_to=True)
    # A file that says so but was never loaded (kdctl killed before the reload) is no proof.
    if live.weights == back and not live.draining and live.applied is not False:
        # The failed step never took: rewriting the router would only be a needless reload.
        # That the old engine answers through it is still shown, not taken from the file.
        confirmed = router.confirm(back)
        record_step("done", "unchanged")
        return confirmed
    record_step("started")
    state = router.apply(inv.replica_weights(weights))
    record_step("done", str(state.weights))
    return state
