"""The rolling cutover's steps on a box (headroom, drain, GPUs free), a person's orders to a
rollout another process runs (pause, abort, promote --full), where a rollout stands (status's
table of boxes), and what happens when a box fails: that box alone goes back to its old engine
and the rollout pauses for a person, as Argo Rollouts pauses on an inconclusive analysis, the
boxes already moved staying moved (or, under --on-fail abort, every box goes back)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import ClassVar, Literal

from pydantic import BaseModel

from kdctl.backends.errors import BackendError, BackendTimeout
from kdctl.checks.promotion import promotion_result
from kdctl.checks.throughput import ThroughputGate, carried
from kdctl.cutover.analysis import AnalysisFailed, watch_front
from kdctl.cutover.plan import (
    AddToRouters,
    DrainEngine,
    GpusFree,
    Headroom,
    Plan,
    RemoveFromRouters,
    SmokeGate,
    Soak,
    Start,
    Step,
    step_from,
)
from kdctl.cutover.runner import (
    CutoverAborted,
    CutoverOutcome,
    Runner,
    best_effort,
    change_engine,
    why,
)
from kdctl.errors import KdctlError
from kdctl.evidence import EvidenceStore, baseline_gaps
from kdctl.inventory import LoadedInventory, PoolSpec
from kdctl.loadgen import BenchMetrics
from kdctl.probes import probe_gpus
from kdctl.records import GateResult, Verdict
from kdctl.session import Session
from kdctl.traffic import Router
from kdctl.traffic.journal import CutoverRecord, Journal

# How often a draining engine's gauges are read.
_DRAIN_POLL_S = 0.2
# How long past the progress deadline a start's own wait for readiness is given to end.
_START_GRACE_S = 15.0


class HeadroomRefused(AnalysisFailed):
    """The boxes left could not carry the load measured now: nothing was taken out."""


class ProgressDeadline(AnalysisFailed):
    """A step that did not end within the rollout's progress deadline: the rollout aborts."""


class Ordered(KdctlError):
    """A person's order, heeded between boxes: `kdctl cutover pause` or `abort`."""

    exit_code = 1


# A person's orders to a rollout another process runs, as journal rows the runner reads
# between boxes (the process holds the traffic lock; an order needs none), and the row a
# resume writes, after which earlier orders are spent. Numbered below the plan's steps (0 on),
# which a fleet's plan may have thousands of.
ORDERS = {"pause": -10, "abort": -11, "promote-full": -12}
RESUMED = -13
ROLLBACK_ORDERED = -14
# Where the steps that put a box back are numbered from: past any plan's.
_BOX_ROLLBACK_IDX = 1_000_000


def orders(journal: Journal, cid: str) -> set[str]:
    """The orders given since the rollout last (re)started."""
    record = journal.get(cid)
    if record is None:
        return set()
    resumed = max((r.at for r in record.steps if r.idx == RESUMED), default=None)
    given = {r.idx for r in record.steps if resumed is None or r.at > resumed}
    return {name for name, idx in ORDERS.items() if idx in given}


@dataclass(frozen=True)
class RollingOptions:
    """How a rolling cutover moves, given on its command line (a resume takes its own)."""

    # Boxes out of the pool at a time: the plan's waves.
    max_unavailable: int = 1
    # What a failed box leads to: a pause for a person (Argo's), or every box moved back.
    on_fail: Literal["pause", "abort"] = "pause"
    # A step not done this long after it began (a soak: past its own length) is stuck: the
    # rollout aborts, as Argo's progressDeadlineSeconds with progressDeadlineAbort. Long
    # enough for an engine of a 1T-parameter model to load on its box.
    progress_deadline_s: float | None = 1800.0


@dataclass(frozen=True)
class Box:
    """One box of a rolling cutover: the replica it serves now and the one to take its place."""

    old: str
    new: str


def boxes_of(plan: Plan | Sequence[Step]) -> list[Box]:
    """The boxes a rolling plan (or its steps, as the journal holds them) moves, in order."""
    steps = plan.steps if isinstance(plan, Plan) else plan
    return [
        Box(old=s.replaces, new=s.backend)
        for s in steps
        if isinstance(s, SmokeGate) and s.replaces is not None
    ]


def measured_peak(
    inv: LoadedInventory, store: EvidenceStore, session: Session, pool: str
) -> tuple[int, str] | None:
    """What one replica of `pool` was measured carrying: the lowest, over its replicas, of the
    highest concurrency each one's recorded throughput run of the inventory's workload served
    within the SLOs (`kdctl baseline record --only throughput`), counting only records taken on
    what the replica is now; with the replica and the record it comes from. None where no
    replica has one."""
    settings = inv.spec.gates.throughput
    workloads = ThroughputGate().workloads(inv) or frozenset()
    found: list[tuple[int, str]] = []
    for name in inv.pools.get(pool, []):
        records = [
            b
            for b in store.baselines(backend=name, kind="throughput")
            if b.workload_hash in workloads
        ]
        if not records:
            continue
        (now,) = session.identify([name]).values()
        usable = next(
            (b for b in records if not baseline_gaps(inv, b, now.provenance, live=now.live)),
            None,
        )
        if usable is None:
            continue
        points = [BenchMetrics.model_validate(p) for p in usable.payload["points"]]
        peak = carried(settings, points)
        if peak is not None:
            found.append(
                (
                    peak[0],
                    f"{name}'s throughput run recorded {usable.created_at:%Y-%m-%d %H:%M}Z, "
                    f"{peak[1]}",
                )
            )
    return min(found) if found else None


def headroom(
    inv: LoadedInventory,
    session: Session,
    members: list[str],
    out: list[str],
    store: EvidenceStore | None = None,
) -> str:
    """The load the router's engines hold now (running and queued requests, from their own
    gauges) against what the engines left once `out` leaves carry: per replica, its pool's
    `capacity_per_replica`, else the pool's measured peak (`measured_peak`, from `store`);
    HeadroomRefused, with the figures, where they could not."""
    loads: dict[str, float] = {}
    usage: dict[str, float] = {}
    unread: list[str] = []
    for name in members:
        try:
            with session.backend(name, timeout=5) as be:
                load = be.load()
        except KdctlError:
            load = None
        if load is None:
            unread.append(name)
        else:
            loads[name] = load.total
            if load.token_usage is not None:
                usage[name] = load.token_usage
    left = [m for m in members if m not in out]
    capacity = 0
    # A replica's capacity, once per pool: a measured peak reads the pool's evidence.
    per_pool: dict[str, int] = {}
    by: dict[str, str] = {}
    for name in left:
        pool = inv.pool_of(name) or name
        if pool not in per_pool:
            spec = inv.spec.backends.get(pool)
            per = spec.capacity_per_replica if isinstance(spec, PoolSpec) else None
            if per is not None:
                by[pool] = f"{pool}: {per} a replica by its capacity_per_replica"
            elif store is not None and (peak := measured_peak(inv, store, session, pool)):
                per = peak[0]
                by[pool] = f"{pool}: {per} a replica, measured ({peak[1]})"
            else:
                return (
                    f"load {sum(loads.values()):g} requests on {len(loads)} engines; headroom "
                    f"not judged: {name}'s pool sets no capacity_per_replica and has no "
                    "recorded throughput run to measure it by"
                )
            per_pool[pool] = per
        capacity += per_pool[pool]
    if unread:
        raise HeadroomRefused(
            f"headroom: the load of {', '.join(unread)} cannot be read from its metrics, so "
            f"taking out {', '.join(out)} cannot be judged safe"
        )
    total = sum(loads.values())
    said = (
        f"load {total:g} requests (running and queued) on {len(members)} engines; the "
        f"{len(left)} left carry {capacity} ({'; '.join(by.values())})"
    )
    if usage:
        # Shown, not judged: caches of two engines' builds hold different token counts.
        said += "; KV cache in use: " + ", ".join(f"{n} {u:.0%}" for n, u in sorted(usage.items()))
    if total > capacity:
        raise HeadroomRefused(f"headroom: {said}: taking out {', '.join(out)} refused")
    return said


def drain_engine(session: Session, name: str, deadline_s: float) -> str:
    """Until the engine, out of every router, has no running request, by its own gauges."""
    deadline = time.monotonic() + deadline_s
    with session.backend(name, timeout=5) as be:
        while True:
            try:
                load = be.load()
            except BackendError as exc:
                # Done again after kdctl was cut off past the stop: nothing runs to drain.
                return f"{name} does not answer ({exc}): nothing to drain"
            if load is None:
                return f"{name} exports no running-requests gauge: stopped without a drain"
            if load.running == 0:
                return f"{name} drained: 0 requests running"
            if time.monotonic() > deadline:
                return (
                    f"{name} still ran {load.running:g} requests at the {deadline_s:g}s "
                    "deadline: stopped with them"
                )
            time.sleep(_DRAIN_POLL_S)


def gpus_free(inv: LoadedInventory, session: Session, name: str) -> str:
    """The stopped engine's GPUs, as its host's nvidia-smi shows them: no compute process."""
    spec = inv.backends[name]
    probe = probe_gpus(session.transport(spec.host))
    if probe.error:
        raise AnalysisFailed(f"{spec.host}: its GPUs cannot be read: {probe.error}")
    if not probe.visible:
        return f"{spec.host} shows no GPU (nvidia-smi: {probe.note or 'none'}): nothing held"
    mine = set(spec.gpus) or {g.index for g in probe.gpus}
    held = [p for p in probe.processes if p.gpu_index is None or p.gpu_index in mine]
    if held:
        who = ", ".join(f"pid {p.pid} {p.process_name} on GPU {p.gpu_index}" for p in held)
        raise AnalysisFailed(f"{spec.host}: {name} stopped, but its GPUs still hold {who}")
    return f"GPUs {sorted(mine)} on {spec.host} hold no compute process"


def members_without(router: Router, name: str) -> list[str]:
    return [m for m in router.read().serving if m != name]


@dataclass
class RollingRunner(Runner):
    """The runner with a rolling cutover's steps; a failure rolls back the box at hand (or the
    wave a soak judged) and pauses the rollout."""

    options: RollingOptions = RollingOptions()
    # The order that stopped it, where one did.
    stopped_by: str | None = None
    # Whether a step outlived the progress deadline.
    stuck: bool = False

    def _apply(
        self, plan: Plan, step: Step, on_written: Callable[[], None] | None = None
    ) -> str | None:
        deadline = self.options.progress_deadline_s
        # The clock is an interval timer's signal, which only the main thread receives: it
        # cuts a step off wherever it waits (an HTTP read, a sleep, a lock), as Ctrl-C does,
        # and the rollback that follows acts on what it finds. Run off the main thread (as
        # a library may), a start still waits no longer than the deadline.
        if deadline is None or threading.current_thread() is not threading.main_thread():
            return self._step(plan, step, on_written)
        # A start waits for readiness itself until the deadline, and says so; the clock over
        # it gives that wait time to end on its own.
        grace = _START_GRACE_S if isinstance(step, Start) else 0
        limit = deadline + grace + (step.seconds if isinstance(step, Soak) else 0)

        def expired(_signum: int, _frame: object) -> None:
            self.stuck = True
            raise ProgressDeadline(
                f"{step.describe()}: not done {limit:g}s after it began (the progress "
                "deadline): the rollout aborts"
            )

        previous = signal.signal(signal.SIGALRM, expired)
        signal.setitimer(signal.ITIMER_REAL, limit)
        try:
            return self._step(plan, step, on_written)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)

    def _step(
        self, plan: Plan, step: Step, on_written: Callable[[], None] | None = None
    ) -> str | None:
        deadline = self.options.progress_deadline_s
        if isinstance(step, Start) and deadline is not None:
            try:
                return change_engine(
                    self.inv, self.session, step.backend, "start", deadline_s=deadline
                )
            except BackendTimeout as exc:
                self.stuck = True
                raise ProgressDeadline(
                    f"{step.describe()}: not ready within the progress deadline: {exc}"
                ) from None
        if isinstance(step, Headroom):
            serving = self.router.read().serving
            return headroom(self.inv, self.session, serving, step.out, self.store)
        if isinstance(step, RemoveFromRouters):
            state = self.router.set_members(members_without(self.router, step.backend))
            return f"the router sends to {', '.join(state.serving)}"
        if isinstance(step, DrainEngine):
            return drain_engine(self.session, step.backend, step.deadline_s)
        if isinstance(step, GpusFree):
            return gpus_free(self.inv, self.session, step.backend)
        if isinstance(step, AddToRouters):
            members = [*members_without(self.router, step.backend), step.backend]
            state = self.router.set_members(members)
            return f"the router sends to {', '.join(state.serving)}"
        if isinstance(step, Soak):
            result = watch_front(
                self.inv, self.router, step.backends[0], step.seconds, also_healthy=step.backends
            )
            self.watches.append(result)
            if result.broke:
                raise AnalysisFailed(f"wave {step.wave} soak: " + "; ".join(result.broke))
            return result.said()
        return super()._apply(plan, step, on_written)

    def before(self, cid: str, plan: Plan, idx: int) -> None:
        """At a box's (or a wave's) first step: a person's pause or abort is heeded here,
        never halfway through a box."""
        step = plan.steps[idx]
        if isinstance(step, Soak) and "promote-full" in orders(self.journal, cid):
            return
        if not isinstance(step, Headroom | RemoveFromRouters):
            return
        given = orders(self.journal, cid) - {"promote-full"}
        if given:
            self.stopped_by = "abort" if "abort" in given else "pause"
            raise Ordered(
                f"{self.stopped_by} ordered by a person (kdctl cutover {self.stopped_by})"
            )

    # A short throughput run beside exactness: the inventory's throughput workload, against
    # the run the replaced replica recorded on the same box.
    smoke_gates: ClassVar[tuple[str, ...]] = ("exactness", "throughput")

    def _smoke(self, plan: Plan, name: str) -> str:
        # Held to what the replica it takes over from recorded, on the same box.
        box = next(b for b in boxes_of(plan) if b.new == name)
        return super()._smoke(plan.model_copy(update={"from_backend": box.old}), name)

    def _undo(
        self, cid: str, plan: Plan, reason: str
    ) -> Literal["failed", "rolled_back", "paused"]:
        """The boxes the failed step left between engines back on their old ones, then the
        rollout paused with the reason, the boxes moved before staying moved; aborted (by a
        person, or by --on-fail abort), every box goes back, the last moved first. Where
        putting a box back fails too, the outcome says so and what to run."""
        abort = (
            self.stopped_by == "abort"
            or self.stuck
            or (self.stopped_by is None and self.options.on_fail == "abort")
        )
        at = self.failed_at if self.stopped_by is None else None
        unsettled = _unsettled(plan, at) if at is not None else []
        box: Box | None = None
        try:
            for box in unsettled:
                back_on_old(self.inv, self.router, self.session, box, self.journal, cid, self.store)
            if abort:
                box = None
                back_all(self.inv, self.router, self.session, plan, self.journal, cid, self.store)
        except HeadroomRefused as exc:
            said = f"{reason}; {held(exc)}"
            best_effort(self.journal.finish, cid, "paused", said)
            return "paused"
        except (Exception, KeyboardInterrupt) as exc:
            which = f"putting {box.old} back" if box else "moving the boxes back"
            said = f"{reason}; {which} failed too: {why(exc)}; to restore it run: kdctl rollback"
            best_effort(self.journal.finish, cid, "failed", said)
            raise CutoverAborted(said) from None
        if abort:
            best_effort(self.journal.finish, cid, "rolled_back", f"{reason}; every box back")
            return "rolled_back"
        back = (
            f" ({', '.join(b.old for b in unsettled)} back on the old engine)" if unsettled else ""
        )
        best_effort(self.journal.finish, cid, "paused", reason + back)
        return "paused"

    def promotions(self, outcome: CutoverOutcome, started: datetime) -> list[GateResult]:
        """One promotion per replica moved, bound to its box: its share of the router now."""
        weights = outcome.router.weights if outcome.router else {}
        moved = [b for b in boxes_of(outcome.plan) if weights.get(b.new, 0) > 0]
        verdict: Verdict = "pass" if outcome.state == "succeeded" else "inconclusive"
        said = f"rolled onto {len(moved)} of {len(boxes_of(outcome.plan))} boxes" + (
            f", paused: {outcome.reason}" if outcome.state == "paused" else ""
        )
        return [
            promotion_result(
                self.inv,
                box.new,
                verdict=verdict,
                reason=f"cutover {outcome.id} (rolling from {outcome.plan.from_backend}): {said}",
                cutover=outcome.id,
                from_backend=box.old,
                strategy="rolling",
                weights=weights,
                started_at=started,
                watches=[w.model_dump() for w in outcome.watches],
            )
            for box in moved
        ]


def held(exc: HeadroomRefused) -> str:
    """Why moving the boxes back stopped, and what a person does next."""
    return (
        f"moving the boxes back held, {exc}; the boxes not yet back stay where they are: "
        "kdctl rollback (or kdctl cutover abort) once the load allows"
    )


def first_of_box(plan: Plan, at: int) -> int:
    """Where the box (or wave) that step `at` belongs to begins: a rollout resumes there."""
    boxes = _unsettled(plan, at)
    if not boxes:
        return at
    names = {n for b in boxes for n in (b.old, b.new)}
    return min(
        i for i, s in enumerate(plan.steps) if getattr(s, "backend", None) in names and i <= at
    )


def _unsettled(plan: Plan, at: int) -> list[Box]:
    """The boxes step `at` leaves between engines: its own box; for a headroom check, none (it
    took nothing out); for a soak, every box of its wave."""
    step = plan.steps[at]
    boxes = boxes_of(plan)
    if isinstance(step, Headroom):
        return []
    if isinstance(step, Soak):
        return [b for b in boxes if b.new in step.backends]
    name = getattr(step, "backend", None)
    return [b for b in boxes if name in (b.old, b.new)]


def moved(plan: Plan, serving: Sequence[str]) -> list[Box]:
    """The boxes a rolling cutover moved or left between engines, the last moved first."""
    return [b for b in reversed(boxes_of(plan)) if b.new in serving or b.old not in serving]


def back_all(
    inv: LoadedInventory,
    router: Router,
    session: Session,
    plan: Plan,
    journal: Journal,
    cid: str,
    store: EvidenceStore | None = None,
) -> list[Box]:
    """Every box moved back on its old engine, one at a time, each confirmed."""
    boxes = moved(plan, router.read().serving)
    for box in boxes:
        back_on_old(inv, router, session, box, journal, cid, store)
    return boxes


def back_on_old(
    inv: LoadedInventory,
    router: Router,
    session: Session,
    box: Box,
    journal: Journal,
    cid: str,
    store: EvidenceStore | None = None,
) -> None:
    """One box back on its old engine: the new one out of the routers and stopped, the old one
    started and put back, each journaled (numbered past the plan's steps, so a resume never
    takes them for it); the routers read back and confirmed."""
    record = journal.get(cid)
    idx = _BOX_ROLLBACK_IDX + (len(record.steps) if record else 0)

    def step(kind: str, backend: str, run: Callable[[], object]) -> None:
        nonlocal idx
        journal.step(cid, idx, kind, {"backend": backend}, "started")
        try:
            said = run()
        except Exception as exc:
            best_effort(journal.step, cid, idx, kind, {"backend": backend}, "failed", why(exc))
            raise
        journal.step(cid, idx, kind, {"backend": backend}, "done", str(said))
        idx += 1

    serving = router.read().serving
    if box.new in serving:
        # Going back takes the box out as going forward did: the boxes left must carry the
        # load meanwhile, or the rollback waits for a person (a rollback that drops to an
        # undersized set is an outage of its own).
        step(
            "box-rollback-headroom",
            box.new,
            lambda: headroom(inv, session, serving, [box.new], store),
        )
        step(
            "box-rollback-remove",
            box.new,
            lambda: router.set_members(members_without(router, box.new)).serving,
        )
    step("box-rollback-stop", box.new, lambda: change_engine(inv, session, box.new, "stop"))
    step("box-rollback-start", box.old, lambda: change_engine(inv, session, box.old, "start"))
    step(
        "box-rollback-add",
        box.old,
        lambda: router.set_members([*members_without(router, box.old), box.old]).serving,
    )


class RolloutBox(BaseModel):
    """One box of a rolling cutover as status shows it."""

    host: str
    # The pool whose replica on this box the router sends to now; null: neither (the box is
    # out of the router, between engines).
    engine: str | None
    # The newest journaled step on this box, and since when.
    step: str | None = None
    since: datetime | None = None


class Rollout(BaseModel):
    wave: int
    waves: int
    boxes: list[RolloutBox]


def rollout(inv: LoadedInventory, record: CutoverRecord, serving: Sequence[str]) -> Rollout:
    """Where a rolling cutover stands: its wave, and each box's engine in the router (`serving`,
    as read back now) and newest journaled step."""
    steps = [step_from(s) for s in record.plan]
    touched = [r.idx for r in record.steps if 0 <= r.idx < len(steps)]
    upto = steps[: max(touched) + 1] if touched else []
    wave = max((s.wave for s in upto if isinstance(s, Headroom)), default=0)
    waves = sum(isinstance(s, Headroom) for s in steps)
    boxes = []
    for box in boxes_of(steps):
        engine = next((inv.pool_of(n) for n in (box.new, box.old) if n in serving), None)
        mine = [r for r in record.steps if r.detail.get("backend") in (box.old, box.new)]
        last = max(mine, key=lambda r: r.at, default=None)
        boxes.append(
            RolloutBox(
                host=inv.backends[box.old].host if box.old in inv.backends else box.old,
                engine=engine,
                step=f"{last.kind} {last.phase}" if last else None,
                since=last.at if last else None,
            )
        )
    return Rollout(wave=wave, waves=waves, boxes=boxes)
