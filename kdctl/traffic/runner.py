"""Cutover and rollback: a plan of steps chosen by what the router can do and where the engines
run, executed under the traffic lock with every step journaled before and after it is applied.

Strategies, in Argo Rollouts' terms:
- blue-green: the candidate already up and gated takes all traffic at once; the old backend
  stays warm for a rollback.
- canary: weight steps (5, 25, 50, 100 by default) with an SLO watch between them; a breach rolls
  back at once and says which SLO broke.
- swap: the two engines need the same GPUs on one host, so the old one must stop before the new
  one starts: drain (503 with Retry-After), stop, start, wait ready, smoke gate, reopen; any
  failure stops the new one and restarts the old. The downtime is measured.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from typing import Any, Literal

from pydantic import BaseModel

from kdctl._httpclient import http_client
from kdctl.backends import GenerateRequest, HttpBackend, make_backend
from kdctl.backends.health import probe_health
from kdctl.backends.sglang import SGLangBackend
from kdctl.checks.promotion import promotion_result
from kdctl.errors import InputError, KdctlError
from kdctl.evidence import EvidenceStore
from kdctl.inventory import LoadedInventory
from kdctl.loadgen import (
    BenchMetrics,
    LoadPlan,
    histogram_quantile,
    past_last_bucket,
    resolution,
    run_load,
)
from kdctl.readiness import assess
from kdctl.recording import run_gates
from kdctl.records import GateResult, Verdict, utcnow
from kdctl.serving import front_api_key
from kdctl.session import Session
from kdctl.traffic._router import Router, RouterState
from kdctl.traffic.journal import Journal

Strategy = Literal["blue-green", "canary", "swap"]
StepKind = Literal["set-weights", "watch", "drain", "stop", "start", "smoke-gate"]
DEFAULT_STEPS = (5, 25, 50, 100)


def parse_steps(text: str) -> tuple[int, ...]:
    """`--steps 5,25,50,100`: the canary's weights; the planner judges their order and range."""
    try:
        return tuple(int(w) for w in text.split(","))
    except ValueError:
        raise InputError(
            f"--steps: {text!r} is not a list of percentages like 5,25,50,100"
        ) from None


class Step(BaseModel):
    kind: StepKind
    weights: dict[str, int] | None = None
    backend: str | None = None
    seconds: float | None = None

    def describe(self) -> str:
        if self.kind == "set-weights":
            assert self.weights is not None
            return "set weights " + ", ".join(f"{k} {v}%" for k, v in self.weights.items())
        if self.kind == "watch":
            return f"watch SLOs for {self.seconds:g}s under a probe load"
        if self.kind == "drain":
            return "drain: the router answers 503 with Retry-After"
        if self.kind == "smoke-gate":
            return (
                f"smoke gate on {self.backend}: health, and exactness against the golden "
                "outputs of the engine it replaces where they are recorded"
            )
        return f"{self.kind} {self.backend}"


class Plan(BaseModel):
    from_backend: str
    to_backend: str
    strategy: Strategy
    reason: str
    steps: list[Step]


def _worst(so_far: float | None, now: float | None) -> float | None:
    return now if so_far is None else so_far if now is None else max(so_far, now)


def plan_cutover(
    inv: LoadedInventory,
    router: Router,
    current: RouterState,
    to: str,
    *,
    strategy: Strategy | None = None,
    weights: tuple[int, ...] = DEFAULT_STEPS,
    watch_s: float = 10.0,
) -> Plan:
    if to not in inv.backends:
        raise InputError(f"--to: unknown backend {to!r} (known: {', '.join(sorted(inv.backends))})")
    serving = current.serving
    if len(serving) != 1:
        raise InputError(
            f"the router sends traffic to {serving or 'nothing'}: finish or roll back the "
            "cutover in progress first (kdctl cutover --resume, kdctl rollback)"
        )
    (src,) = serving
    if src == to:
        raise InputError(f"{to} already takes all traffic")
    caps = router.capabilities
    shared = inv.backends[src].shares_gpus_with(inv.backends[to])
    if strategy is None:
        if shared:
            strategy, why = "swap", f"{src} and {to} need the same GPUs on {inv.backends[to].host}"
        elif caps.weights:
            strategy, why = "canary", f"{router.kind} splits traffic by weight"
        else:
            strategy, why = "blue-green", f"{router.kind} has no weights: all at once"
    else:
        why = "chosen with --strategy"
        if shared and strategy != "swap":
            raise InputError(
                f"--strategy {strategy}: {src} and {to} share GPUs "
                f"{sorted(set(inv.backends[src].gpus) & set(inv.backends[to].gpus))} on "
                f"{inv.backends[to].host}; both cannot run at once, only swap can move traffic"
            )
        if strategy == "canary" and not caps.weights:
            raise InputError(f"--strategy canary: {router.kind} has no traffic weights")
        if strategy == "swap" and not caps.drain:
            raise InputError(f"--strategy swap: {router.kind} cannot drain")
    steps: list[Step] = []
    if strategy == "blue-green":
        steps.append(Step(kind="set-weights", weights={src: 0, to: 100}))
    elif strategy == "canary":
        if not weights or sorted(weights) != list(weights) or weights[-1] != 100:
            raise InputError(f"--steps {weights}: weights must rise and end at 100")
        for w in weights:
            steps.append(Step(kind="set-weights", weights={src: 100 - w, to: w}))
            # --watch 0 asks for no watch: no step that would report a window never measured.
            if w < 100 and watch_s > 0:
                steps.append(Step(kind="watch", seconds=watch_s))
    else:
        # A swap stops one engine and starts the other, and a rollback starts the first again:
        # both must be startable before anything is drained.
        for name in (to, src):
            inv.service_env(name)
        steps += [
            Step(kind="drain"),
            Step(kind="stop", backend=src),
            Step(kind="start", backend=to),
            Step(kind="smoke-gate", backend=to),
            Step(kind="set-weights", weights={src: 0, to: 100}),
        ]
    return Plan(from_backend=src, to_backend=to, strategy=strategy, reason=why, steps=steps)


class CutoverOutcome(BaseModel):
    id: str
    plan: Plan
    state: Literal["succeeded", "failed", "rolled_back"]
    reason: str | None = None
    router: RouterState | None = None
    downtime_s: float | None = None
    watches: list[dict[str, Any]] = []


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
    watches: list[dict[str, Any]] = field(default_factory=list)
    drained_at: float | None = None
    downtime_s: float | None = None

    def run(self, cid: str, plan: Plan, *, skip: set[int] | None = None) -> CutoverOutcome:
        started = utcnow()
        outcome = self._run(cid, plan, skip or set())
        promoted = record_promotion(self.inv, outcome, started)
        self.store.record(self.session.binder.bind_result(promoted))
        return outcome

    def _run(self, cid: str, plan: Plan, skip: set[int]) -> CutoverOutcome:
        try:
            for idx, step in enumerate(plan.steps):
                if idx in skip:
                    continue
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
                    _best_effort(
                        self.journal.step,
                        cid,
                        idx,
                        step.kind,
                        step.model_dump(),
                        "failed",
                        _why(exc),
                    )
                    raise
                self.journal.step(cid, idx, step.kind, step.model_dump(), "done", note)
        # Whatever broke (a router, a full disk under the journal, Ctrl-C), the runner's promise
        # holds: traffic goes back to where it was.
        except (Exception, KeyboardInterrupt) as exc:
            reason = _why(exc)
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
        if step.kind == "set-weights":
            assert step.weights is not None
            state = self.router.apply(step.weights, on_written=on_written)
            if self.drained_at is not None:
                self.downtime_s = round(time.monotonic() - self.drained_at, 3)
                self.drained_at = None
            return f"read back {state.weights}"
        if step.kind == "watch":
            assert step.seconds is not None
            return self._watch(plan, step.seconds)
        if step.kind == "drain":
            self.router.drain()
            self.drained_at = time.monotonic()
            return "draining"
        if step.kind == "stop" or step.kind == "start":
            assert step.backend is not None
            return change_engine(self.inv, self.session, step.backend, step.kind)
        assert step.backend is not None
        return self._smoke(plan, step.backend)

    def _smoke(self, plan: Plan, name: str) -> str:
        """Health, and exactness against the golden outputs of the engine it replaces: that
        engine is stopped by now, so only what it recorded can be compared, never another
        engine's golden (the new one's own would compare it with itself)."""
        results = run_gates(self.inv, self.store, "health", name, None, session=self.session)
        src = plan.from_backend
        results += run_gates(
            self.inv,
            self.store,
            "exactness",
            name,
            src,
            session=self.session,
            recorded_only=True,
        )
        bad = [r for r in results if r.verdict not in ("pass", "skipped")]
        if bad:
            raise AnalysisFailed(
                "smoke gate failed: "
                + "; ".join(f"{r.gate} {r.verdict}: {(r.reasons or [''])[0]}" for r in bad)
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
        """A probe load through the front for `seconds`: every request must succeed, and TTFT
        and ITL must hold the inventory's SLOs; the candidate must stay healthy."""
        settings = self.inv.spec.gates.throughput
        pct = settings.slo_percentile
        # The probes speak the candidate's protocol (SGLang's /generate, the OpenAI API, ...)
        # to the front, as its clients do once it takes their traffic.
        front = self.inv.backends[plan.to_backend].model_copy(
            update={"host": self.router.spec.host, "url": self.router.front_url}
        )
        # The probes carry the key clients send through the front: the router's own, else the
        # candidate's, which must also open the baseline for clients to survive the cutover.
        key = front_api_key(self.inv, {plan.to_backend: 100})
        be = make_backend("router-front", front, api_key=key)
        if not isinstance(be, HttpBackend):
            raise InputError(f"{plan.to_backend} is not served over HTTP: no canary to watch")
        if isinstance(be, SGLangBackend):
            be.one_engine = False  # both engines answer through it during a canary
        engine_before = engine_counters(self.inv, plan.to_backend)
        deadline = time.monotonic() + seconds
        failed = sent = 0
        # None until a window measures one: an unmeasured percentile is not 0 ms.
        worst_ttft: float | None = None
        worst_itl: float | None = None
        try:
            while time.monotonic() < deadline:
                reqs = [
                    GenerateRequest(
                        input_ids=[11 + i, 12, 13, 14], max_new_tokens=8, ignore_eos=True
                    )
                    for i in range(4)
                ]
                m = run_load(be, reqs, LoadPlan(max_concurrency=2, timeout_s=60))
                sent += m.requests
                failed += m.failed
                worst_ttft = _worst(worst_ttft, getattr(m.ttft_ms, pct))
                worst_itl = _worst(worst_itl, getattr(m.itl_ms, pct))
                with http_client() as client:
                    health = probe_health(
                        client,
                        self.inv.backends[plan.to_backend].url or "",
                        api_key=self.inv.api_key(plan.to_backend),
                    )
                broke = _breaches(m, pct, settings.slo_ttft_ms, settings.slo_itl_ms)
                if health.state != "up":
                    broke.append(f"{plan.to_backend} health {health.state}: {health.detail}")
                if broke:
                    self.watches.append({"sent": sent, "failed": failed, "broke": broke})
                    raise AnalysisFailed("SLO breach during the canary: " + "; ".join(broke))
        finally:
            be.close()
        watch: dict[str, Any] = {
            "sent": sent,
            "failed": failed,
            f"ttft_{pct}_ms": worst_ttft,
            f"itl_{pct}_ms": worst_itl,
        }
        # The candidate's own view of the window: how many requests it served (all traffic,
        # not only the probe's), and their TTFT percentile from its histogram's buckets.
        engine_after = engine_counters(self.inv, plan.to_backend)
        window = (
            engine_after.minus(engine_before)
            if engine_before is not None and engine_after is not None
            else None
        )
        unknown_share = (
            f"{plan.to_backend}'s metrics gave no request counter kdctl reads: how many of the "
            "probes it served is not known"
        )
        if window is None:
            watch["engine_note"] = unknown_share
        elif window.went_back():
            # Counters only rise: lower ones mean another process (a restart) behind the URL.
            watch["engine_note"] = (
                f"{plan.to_backend}'s counters went back during the window (restarted?): "
                "its own view of it was not read"
            )
        else:
            if window.requests is None:
                watch["engine_note"] = unknown_share
            else:
                watch["engine_requests"] = window.requests
                if window.requests <= 0:
                    watch["engine_note"] = (
                        f"{plan.to_backend} served no request in the window (its own counter): "
                        "its share of the probes was not measured"
                    )
            engine_ms, note, breach = engine_ttft(window, pct, settings.slo_ttft_ms)
            if engine_ms is not None:
                watch[f"engine_ttft_{pct}_ms"] = round(engine_ms, 2)
            if note:
                watch["engine_ttft_note"] = f"{plan.to_backend}'s {note}"
            if breach:
                self.watches.append(watch)
                raise AnalysisFailed(
                    f"SLO breach during the canary: {plan.to_backend}'s own {breach}"
                )
        self.watches.append(watch)
        ttft = "not measured" if worst_ttft is None else f"{worst_ttft:.0f} ms"
        itl = "not measured" if worst_itl is None else f"{worst_itl:.1f} ms"
        said = f"{sent} probe requests, {failed} failed, TTFT {pct} {ttft}, ITL {pct} {itl}"
        return said + (f"; {watch['engine_note']}" if "engine_note" in watch else "")

    def _undo(self, cid: str, plan: Plan, reason: str) -> Literal["failed", "rolled_back"]:
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
                f"{reason}; the rollback failed too: {_why(exc)}; {now}; to restore it run: "
                f"kdctl rollback (it moves all traffic back to {plan.from_backend})"
            )
            _best_effort(self.journal.finish, cid, "failed", said)
            raise CutoverAborted(said) from None
        if self.drained_at is not None:
            self.downtime_s = round(time.monotonic() - self.drained_at, 3)
        _best_effort(self.journal.finish, cid, "rolled_back", reason)
        return "rolled_back"


class AnalysisFailed(KdctlError):
    """A step's analysis judged the new backend unfit (the smoke gate, the canary's SLO watch):
    a negative verdict, not a broken router, so traffic goes back and the exit is 1."""

    exit_code = 1


class CutoverAborted(KdctlError):
    """A cutover that failed and could not roll itself back: exit 3, with the router's state
    and the command that restores it."""

    exit_code = 3


def _why(exc: BaseException) -> str:
    if isinstance(exc, KdctlError):
        return str(exc)
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    return f"{type(exc).__name__}: {exc}"


def _best_effort(write: Callable[..., None], *args: Any) -> None:
    """A journal write on the way back: restoring traffic matters more than recording it."""
    # The caller reports the failure that brought it here.
    with contextlib.suppress(Exception):
        write(*args)


def record_promotion(
    inv: LoadedInventory, outcome: CutoverOutcome, started: datetime
) -> GateResult:
    """The evidence a finished cutover leaves about its target: promoted, or rolled back."""
    plan = outcome.plan
    ends: dict[str, tuple[Verdict, str]] = {
        "succeeded": ("pass", f"all traffic moved to {plan.to_backend}"),
        "rolled_back": ("fail", f"rolled back to {plan.from_backend}: {outcome.reason}"),
        "failed": ("error", f"failed, and so did its rollback: {outcome.reason}"),
    }
    verdict, said = ends[outcome.state]
    return promotion_result(
        inv,
        plan.to_backend,
        verdict=verdict,
        reason=f"cutover {outcome.id} ({plan.strategy} from {plan.from_backend}): {said}",
        cutover=outcome.id,
        from_backend=plan.from_backend,
        strategy=plan.strategy,
        weights=outcome.router.weights if outcome.router else None,
        started_at=started,
        watches=outcome.watches,
        downtime_s=outcome.downtime_s,
    )


_REQUESTS = "sglang:num_requests_total"
_TTFT_BUCKET = "sglang:time_to_first_token_seconds_bucket"


@dataclass(frozen=True)
class EngineCounters:
    """An engine's request counter and its TTFT histogram's cumulative buckets ({le: count}),
    summed over labels. `requests` is None where the engine exports no such counter (SGLang
    before mid-2025): not counted is not zero."""

    requests: float | None
    ttft_buckets: dict[float, float]

    def went_back(self) -> bool:
        """Whether this window, as a difference, has a counter below zero."""
        return (self.requests is not None and self.requests < 0) or any(
            n < 0 for n in self.ttft_buckets.values()
        )

    def minus(self, before: EngineCounters) -> EngineCounters:
        """What was counted between `before` and this reading."""
        requests = None
        if self.requests is not None and before.requests is not None:
            requests = self.requests - before.requests
        return EngineCounters(
            requests=requests,
            ttft_buckets={
                le: n - before.ttft_buckets.get(le, 0.0) for le, n in self.ttft_buckets.items()
            },
        )


def engine_ttft(
    window: EngineCounters, pct: str, slo_ms: float | None
) -> tuple[float | None, str, str]:
    """An engine's TTFT percentile over a window, from its histogram's buckets; a note where
    the buckets are too coarse to judge `slo_ms` (SGLang's start at 0.1 s: every request under
    it counts as up to 100 ms there, so a tighter SLO would breach on every window, and is left
    to the probes, which time each request); and a breach where they judge it broken."""
    seconds_at = histogram_quantile(int(pct[1:]) / 100, window.ttft_buckets)
    if seconds_at is None:
        return None, "", ""
    engine_ms = seconds_at * 1000
    finest = resolution(window.ttft_buckets)
    if past_last_bucket(int(pct[1:]) / 100, window.ttft_buckets):
        # PromQL's estimate is then the last finite bound, a floor: the percentile is over it,
        # by how much the histogram cannot say.
        if slo_ms is not None and engine_ms >= slo_ms:
            return (
                engine_ms,
                "",
                (
                    f"TTFT {pct} over {engine_ms:.0f} ms (past the histogram's last finite bucket) "
                    f"exceeds the SLO of {slo_ms:g} ms"
                ),
            )
        return (
            None,
            f"TTFT histogram puts {pct} past its last finite bucket ({engine_ms:g} ms): "
            "not measured there; judged by the probes",
            "",
        )
    if slo_ms is not None and finest is not None and slo_ms / 1000 < finest:
        return (
            engine_ms,
            f"TTFT histogram cannot judge an SLO of {slo_ms:g} ms: its first bucket ends at "
            f"{finest * 1000:g} ms; judged by the probes",
            "",
        )
    if slo_ms is not None and engine_ms > slo_ms:
        return (
            engine_ms,
            "",
            f"TTFT {pct} {engine_ms:.0f} ms over the window exceeds the SLO of {slo_ms:g} ms",
        )
    return engine_ms, "", ""


def engine_counters(inv: LoadedInventory, name: str) -> EngineCounters | None:
    """The engine's counters from its Prometheus metrics; None when it exports none or does
    not answer."""
    spec = inv.backends[name]
    try:
        with make_backend(name, spec, api_key=inv.api_key(name), timeout=5) as be:
            families = be.metrics()
    except KdctlError:
        return None
    requests: float | None = None
    buckets: dict[float, float] = {}
    for family in families.values():
        for sample in family.samples:
            if sample.name == _REQUESTS:
                requests = (requests or 0.0) + float(sample.value)
            elif sample.name == _TTFT_BUCKET and "le" in sample.labels:
                le = float(sample.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + float(sample.value)
    if requests is None and not buckets:
        return None
    return EngineCounters(requests=requests, ttft_buckets=buckets)


def _breaches(m: BenchMetrics, pct: str, ttft_ms: float | None, itl_ms: float | None) -> list[str]:
    broke = []
    if m.failed:
        errors = "; ".join(m.errors[:2])
        broke.append(f"error rate: {m.failed}/{m.requests} requests failed ({errors})")
    ttft, itl = getattr(m.ttft_ms, pct), getattr(m.itl_ms, pct)
    if ttft_ms is not None and ttft is not None and ttft > ttft_ms:
        broke.append(f"TTFT {pct} {ttft:.0f} ms over the SLO of {ttft_ms:g} ms")
    if itl_ms is not None and itl is not None and itl > itl_ms:
        broke.append(f"ITL {pct} {itl:.1f} ms over the SLO of {itl_ms:g} ms")
    return broke


EngineChange = Literal["stop", "start"]


def change_engine(inv: LoadedInventory, session: Session, name: str, verb: EngineChange) -> str:
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
        health = control.wait_ready(deadline_s=600)
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
        _best_effort(journal.step, cid, idx, "rollback-drain", {}, "started")
        router.drain()
        _best_effort(journal.step, cid, idx, "rollback-drain", {}, "done")
        idx += 1
        undo: tuple[tuple[str, EngineChange], ...] = (
            (plan.to_backend, "stop"),
            (plan.from_backend, "start"),
        )
        for name, verb in undo:
            _best_effort(journal.step, cid, idx, f"rollback-{verb}", {"backend": name}, "started")
            change_engine(inv, session, name, verb)
            _best_effort(journal.step, cid, idx, f"rollback-{verb}", {"backend": name}, "done")
            idx += 1
    weights = {plan.from_backend: 100, plan.to_backend: 0}
    detail = {"weights": weights}
    record_step = partial(_best_effort, journal.step, cid, idx, "rollback-set-weights", detail)
    live = router.read()
    # A file that says so but was never loaded (kdctl killed before the reload) is no proof.
    if live.weights == {plan.from_backend: 100} and not live.draining and live.applied is not False:
        # The failed step never took: rewriting the router would only be a needless reload.
        # That the old engine answers through it is still shown, not taken from the file.
        confirmed = router.confirm({plan.from_backend: 100})
        record_step("done", "unchanged")
        return confirmed
    record_step("started")
    state = router.apply(weights)
    record_step("done", str(state.weights))
    return state
