"""What `kdctl cutover` and `kdctl rollback` do: preflight against the roadmap, confirmation,
the lock, the journal, the plan, and the read-back of the router after every change."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from kdctl.checks.promotion import promotion_result
from kdctl.cutover.plan import (
    DEFAULT_STEPS,
    Plan,
    SetWeights,
    Step,
    Strategy,
    plan_cutover,
    step_from,
)
from kdctl.cutover.rolling import (
    ORDERS,
    RESUMED,
    ROLLBACK_ORDERED,
    HeadroomRefused,
    RollingOptions,
    RollingRunner,
    back_all,
    boxes_of,
    first_of_box,
    held,
    moved,
    rollout,
)
from kdctl.cutover.runner import CutoverOutcome, Runner, preflight, restore
from kdctl.errors import InputError, KdctlError
from kdctl.evidence import EvidenceStore
from kdctl.inventory import LoadedInventory
from kdctl.records import GateResult, utcnow
from kdctl.session import Session, using
from kdctl.traffic import Router, RouterState, make_router
from kdctl.traffic.journal import CutoverRecord, Journal, open_journal

# Asked before anything changes; False stops there. The CLI answers from --yes or a terminal.
Confirm = Callable[[str], bool]


class Refused(KdctlError):
    """A cutover kdctl will not make: prerequisites unmet, or no one said yes."""

    exit_code = 1


_ROLLING = RollingOptions()


def cutover(
    inv: LoadedInventory,
    store: EvidenceStore,
    to: str | None,
    *,
    confirm: Confirm,
    strategy: Strategy | None = None,
    steps: tuple[int, ...] = DEFAULT_STEPS,
    watch_s: float = 10.0,
    force: bool = False,
    dry_run: bool = False,
    resume: bool = False,
    rolling: RollingOptions = _ROLLING,
    on_step: Callable[[int, Step], None] | None = None,
    session: Session | None = None,
) -> Plan | CutoverOutcome:
    with using(inv, session) as s, open_journal(inv) as journal:
        journal.check_free()
        router = make_router(inv, s.pool)
        if resume:
            return _resume(
                _Resume(inv, store, router, journal, s, confirm, on_step, force, rolling)
            )
        if to is None:
            raise InputError("--to: which backend to cut over to")

        def planned() -> Plan:
            return plan_cutover(
                inv,
                router,
                router.read(),
                to,
                strategy=strategy,
                weights=steps,
                watch_s=watch_s,
                max_unavailable=rolling.max_unavailable,
            )

        plan = planned()
        if dry_run:
            return plan
        # The lock is held from the readiness assessment to the last step, as terraform holds
        # its state lock across the prompt: no other cutover can change what was assessed.
        with journal.locked():
            plan = planned()
            blocking = _cleared(inv, store, to, s, force, f"cutover to {to}")
            question = (
                f"Cut over from {plan.from_backend} to {to} "
                f"({plan.strategy}, {len(plan.steps)} steps)?"
            )
            if blocking:
                question = f"FORCE past {len(blocking)} unmet criteria: " + question
            asked = time.monotonic()
            if not confirm(question):
                raise Refused("cutover not confirmed; nothing changed")
            if time.monotonic() - asked > _ASSESSED_FOR_S:
                # Readiness from before a person's wait is not readiness now: nothing the
                # session learnt before it is taken on trust.
                s.forget_all()
                blocking = _cleared(inv, store, to, s, force, f"cutover to {to}")
            cid = journal.begin(
                plan.from_backend,
                to,
                plan.strategy,
                [s.model_dump() for s in plan.steps],
                forced=bool(blocking),
            )
            if blocking:
                journal.step(cid, -1, "force", {"unmet": blocking}, "done", "forced past preflight")
            runner = _runner(plan)(
                inv, router, journal, store, s, on_step=on_step, forced=force or bool(blocking)
            )
            if isinstance(runner, RollingRunner):
                runner.options = rolling
            return runner.run(cid, plan)


def _runner(plan: Plan) -> type[Runner]:
    return RollingRunner if plan.strategy == "rolling" else Runner


# How long a preflight's assessment stands while a confirmation is awaited; past it, the
# engines are assessed again before the first step.
_ASSESSED_FOR_S = 5.0


def _cleared(
    inv: LoadedInventory,
    store: EvidenceStore,
    to: str,
    session: Session,
    force: bool,
    what: str,
    then: str = "",
) -> list[str]:
    """The criteria that keep `to` out, assessed now (a pool: each replica, by its own
    evidence); Refused when there are any and nothing forces past them, with `then` saying what
    the traffic is left doing."""
    blocking = [
        f"{name}: {why}" if name != to else why
        for name in inv.members(to)
        for why in preflight(inv, store, name, session=session)
    ]
    if blocking and not force:
        raise Refused(
            f"{what} refused: "
            + "; ".join(blocking)
            + " (every prerequisite needs passing fresh evidence; --force overrides)"
            + then
        )
    return blocking


@dataclass(frozen=True)
class _Resume:
    """What a resume works with: the command's own options, not the interrupted one's."""

    inv: LoadedInventory
    store: EvidenceStore
    router: Router
    journal: Journal
    session: Session
    confirm: Confirm
    on_step: Callable[[int, Step], None] | None
    force: bool
    rolling: RollingOptions


def _resume(ctx: _Resume) -> CutoverOutcome:
    inv, store, router, journal, session = ctx.inv, ctx.store, ctx.router, ctx.journal, ctx.session
    confirm, on_step, force = ctx.confirm, ctx.on_step, ctx.force
    with journal.locked():
        # Only the operator's last order is resumed: an older interrupted cutover was replaced
        # by whatever came after it.
        record = journal.latest()
        paused = record is not None and record.state == "paused"
        if record is None or (record.state != "running" and not paused):
            said = f"; the newest, {record.id}, {record.state}" if record else ""
            raise InputError(f"no interrupted cutover in the journal{said}")
        journal.supersede(f"superseded by cutover {record.id}", keep=record.id)
        plan = _journaled_plan(record, "resumed from the journal")
        if plan.strategy == "rolling":
            return _resume_rolling(ctx)
        live = router.read()
        if any(s.kind.startswith("rollback-") for s in record.steps):
            # It was being rolled back when it stopped: resuming finishes the rollback.
            if not confirm(
                f"Finish rolling back cutover {record.id} to {plan.from_backend}; the router "
                f"now sends {live.weights}?"
            ):
                raise Refused("resume not confirmed; nothing changed")
            started = utcnow()
            state = restore(inv, router, session, plan, journal, record.id)
            journal.finish(record.id, "rolled_back", "kdctl cutover --resume: rollback finished")
            for result in _rolled_back(inv, session, record, state, started, "resumed rollback"):
                store.record(result)
            return CutoverOutcome(
                id=record.id,
                plan=plan,
                state="rolled_back",
                reason="rollback resumed",
                router=state,
            )
        # As the router holds them: a pool's weight split over its replicas.
        expected = [
            inv.replica_weights(ws, sent_to=True) for ws in _resumable_weights(plan, record)
        ]
        if live.weights not in expected:
            raise Refused(
                f"cutover {record.id} cannot be resumed: the router now sends {live.weights}, "
                f"not {' or '.join(map(str, expected))} as its journal left it; something else "
                "changed it since. Nothing changed: kdctl rollback returns traffic to "
                f"{plan.from_backend}, or start a new cutover"
            )
        # The candidate is assessed again: the evidence that let the cutover start may have
        # failed or gone stale since. One forced at its start stays forced.
        blocking = _cleared(
            inv,
            store,
            plan.to_backend,
            session,
            force or record.forced,
            f"resuming cutover {record.id} to {plan.to_backend}",
            (
                f". The front is draining (clients get 503 with Retry-After): kdctl rollback "
                f"returns traffic to {plan.from_backend}"
            )
            if live.draining
            else "",
        )
        question = (
            f"Resume cutover {record.id} ({plan.strategy} to {plan.to_backend}); the router "
            f"now sends {live.weights}; {len(record.done_steps)} of {len(plan.steps)} steps done?"
        )
        if blocking:
            question = f"FORCE past {len(blocking)} unmet criteria: " + question
        if not confirm(question):
            raise Refused("resume not confirmed; nothing changed")
        if blocking:
            journal.step(
                record.id, -1, "force", {"unmet": blocking}, "done", "forced past preflight"
            )
        runner = Runner(
            inv, router, journal, store, session, on_step=on_step, forced=force or bool(blocking)
        )
        return runner.run(record.id, plan, skip=record.done_steps)


def _resume_rolling(ctx: _Resume) -> CutoverOutcome:
    """A rolling cutover goes on from the box (or wave) it stopped at, from that box's first
    step: each step acts on what it finds (out of the routers, stopped, started), so one
    interrupted halfway is done again, never assumed done."""
    inv, store, router, journal, session = ctx.inv, ctx.store, ctx.router, ctx.journal, ctx.session
    confirm, force = ctx.confirm, ctx.force
    record = journal.latest()
    assert record is not None
    plan = _journaled_plan(record, "resumed from the journal")
    if any(r.idx == ROLLBACK_ORDERED for r in record.steps):
        # It was being rolled back when it stopped: resuming finishes the rollback.
        if not confirm(f"Finish rolling back cutover {record.id} to {plan.from_backend}?"):
            raise Refused("resume not confirmed; nothing changed")
        try:
            back_all(inv, router, session, plan, journal, record.id, store)
        except HeadroomRefused as exc:
            journal.finish(record.id, "paused", held(exc))
            raise Refused(f"resuming the rollback of {record.id}: {held(exc)}") from None
        journal.finish(record.id, "rolled_back", "kdctl cutover --resume: rollback finished")
        return CutoverOutcome(
            id=record.id,
            plan=plan,
            state="rolled_back",
            reason="rollback resumed",
            router=router.confirm(router.read().weights),
        )
    done = record.done_steps
    pending = [i for i in range(len(plan.steps)) if i not in done]
    if not pending:
        raise InputError(f"cutover {record.id} has no step left to run")
    start = first_of_box(plan, pending[0])
    live = router.read()
    for name in live.serving:
        if inv.pool_of(name) not in (plan.from_backend, plan.to_backend):
            raise Refused(
                f"cutover {record.id} cannot be resumed: the router sends to {name}, which is "
                f"in neither {plan.from_backend} nor {plan.to_backend}; something else changed "
                "it since. Nothing changed"
            )
    blocking = _cleared(
        inv, store, plan.to_backend, session, force or record.forced, f"resuming {record.id}"
    )
    question = (
        f"Resume rolling cutover {record.id} to {plan.to_backend} at step {start + 1} of "
        f"{len(plan.steps)} ({plan.steps[start].describe()}); the router now sends to "
        f"{', '.join(live.serving)}?"
    )
    if blocking:
        question = f"FORCE past {len(blocking)} unmet criteria: " + question
    if not confirm(question):
        raise Refused("resume not confirmed; nothing changed")
    journal.reopen(record.id)
    journal.step(record.id, RESUMED, "resumed", {}, "done", "kdctl cutover --resume")
    runner = RollingRunner(
        inv,
        router,
        journal,
        store,
        session,
        on_step=ctx.on_step,
        forced=force or bool(blocking),
        options=ctx.rolling,
    )
    return runner.run(record.id, plan, skip=set(range(start)))


def _resumable_weights(plan: Plan, record: CutoverRecord) -> list[dict[str, int]]:
    """What the router may send when a resume takes over: what the last finished weight step
    left, or what the interrupted one was writing (nginx may have loaded it or not)."""
    done = record.done_steps
    touched = {s.idx for s in record.steps}

    def positive(weights: dict[str, int]) -> dict[str, int]:
        return {k: v for k, v in weights.items() if v > 0}

    last = {plan.from_backend: 100}
    for i, step in enumerate(plan.steps):
        if not isinstance(step, SetWeights):
            continue
        if i in done:
            last = positive(step.weights)
        elif i in touched:
            return [last, positive(step.weights)]
        else:
            break
    return [last]


def _journaled_plan(record: CutoverRecord, reason: str) -> Plan:
    return Plan(
        from_backend=record.from_backend,
        to_backend=record.to_backend,
        strategy=record.strategy,
        reason=reason,
        steps=[step_from(s) for s in record.plan],
    )


def rollback(
    inv: LoadedInventory,
    store: EvidenceStore,
    *,
    confirm: Confirm,
    session: Session | None = None,
) -> tuple[str, RouterState]:
    """Back to the backend that served before the last cutover: no gates, one router write,
    confirmed by read-back; for a swap, the old engine restarted first. The cutover's target
    gets a failed promotion, so no phase still counts it as serving."""
    started = utcnow()
    with using(inv, session) as s, open_journal(inv) as journal:
        router = make_router(inv, s.pool)
        with journal.locked():
            record = journal.latest()
            if record is None:
                raise InputError("no cutover in the journal to roll back")
            plan = _journaled_plan(record, "rollback")
            live = router.read()
            if plan.strategy == "rolling":
                return _rollback_rolling(inv, store, router, journal, s, record, confirm, started)
            back = inv.replica_weights({record.from_backend: 100}, sent_to=True)
            unchanged = live.weights == back and not live.draining
            if unchanged and live.applied is not False:
                # Nothing to write, but the old engine must still be seen answering through
                # the front before "rolled back" is said; an interrupted cutover still ends
                # here, in the journal.
                live = router.confirm(back)
                if record.state == "running":
                    journal.finish(record.id, "rolled_back", "kdctl rollback: router unchanged")
                    journal.supersede(f"superseded by the rollback of {record.id}")
                    for result in _rolled_back(inv, s, record, live, started, "router unchanged"):
                        store.record(result)
                return record.from_backend, live
            if not confirm(
                f"Roll back to {record.from_backend} (the router now sends {live.weights})?"
            ):
                raise Refused("rollback not confirmed; nothing changed")
            # The order is journaled before anything moves: killed from here on, a resume
            # finishes this rollback instead of the cutover it undoes.
            journal.step(record.id, 999, "rollback-ordered", {}, "done", "kdctl rollback")
            state = restore(inv, router, s, plan, journal, record.id)
            journal.finish(record.id, "rolled_back", "kdctl rollback")
            journal.supersede(f"superseded by the rollback of {record.id}")
            for result in _rolled_back(inv, s, record, state, started, "kdctl rollback"):
                store.record(result)
            return record.from_backend, state


def _rollback_rolling(
    inv: LoadedInventory,
    store: EvidenceStore,
    router: Router,
    journal: Journal,
    session: Session,
    record: CutoverRecord,
    confirm: Confirm,
    started: datetime,
) -> tuple[str, RouterState]:
    """Every box a rolling cutover moved back on its old engine, last moved first, one box at
    a time, each confirmed; the pool it came from serving alone again."""
    plan = _journaled_plan(record, "rollback")
    live = router.read()
    boxes = moved(plan, live.serving)
    if boxes and not confirm(
        f"Roll back {len(boxes)} box(es) to {record.from_backend} "
        f"({', '.join(b.old for b in boxes)}); the router now sends to {', '.join(live.serving)}?"
    ):
        raise Refused("rollback not confirmed; nothing changed")
    journal.step(record.id, ROLLBACK_ORDERED, "rollback-ordered", {}, "done", "kdctl rollback")
    # In progress again until every box is back: status shows it, and a rollback cut off
    # halfway is finished by --resume (or by this command again).
    journal.reopen(record.id)
    try:
        back_all(inv, router, session, plan, journal, record.id, store)
    except HeadroomRefused as exc:
        journal.finish(record.id, "paused", held(exc))
        raise Refused(f"rollback of {record.id}: {held(exc)}") from None
    state = router.confirm(router.read().weights)
    journal.finish(record.id, "rolled_back", "kdctl rollback")
    journal.supersede(f"superseded by the rollback of {record.id}")
    for box in boxes_of(plan):
        for result in _rolled_back(
            inv, session, record, state, started, "kdctl rollback", box.new, box.old
        ):
            store.record(result)
    return record.from_backend, state


def _rolled_back(
    inv: LoadedInventory,
    session: Session,
    record: CutoverRecord,
    state: RouterState,
    started: datetime,
    how: str,
    backend: str | None = None,
    from_backend: str | None = None,
) -> list[GateResult]:
    """A failed promotion of the cutover's target, one per replica of a target pool (a
    rolling cutover's: of the replica `backend`, from the one it replaced on its box)."""
    return [
        session.binder.bind_result(
            promotion_result(
                inv,
                name,
                verdict="fail",
                reason=f"cutover {record.id} rolled back to {record.from_backend} ({how})",
                cutover=record.id,
                from_backend=from_backend or record.from_backend,
                strategy=record.strategy,
                weights=state.weights,
                started_at=started,
            )
        )
        for name in ([backend] if backend else inv.members(record.to_backend))
    ]


Order = Literal["pause", "promote", "abort"]


def order(
    inv: LoadedInventory,
    store: EvidenceStore,
    what: Order,
    *,
    confirm: Confirm,
    full: bool = False,
    on_step: Callable[[int, Step], None] | None = None,
    session: Session | None = None,
) -> str | CutoverOutcome:
    """A person's order to the journal's rolling cutover, as Argo Rollouts takes them. To one
    running in another process (which holds the traffic lock): pause or abort at its next box,
    `promote --full` skips its remaining soaks; each is a journal row it reads between boxes.
    To one paused: promote goes on from its box (as --resume), abort moves every box back."""
    with open_journal(inv) as journal:
        record = journal.latest(state="running") or journal.latest(state="paused")
        if record is None or record.strategy != "rolling":
            raise InputError("no rolling cutover in progress or paused in the journal")
        name = "promote-full" if what == "promote" and full else what
        if record.state == "running":
            if name == "promote":
                raise InputError(
                    f"cutover {record.id} is running, not paused: promote --full skips its "
                    "remaining soaks"
                )
            journal.step(record.id, ORDERS[name], f"{name}-ordered", {}, "done", f"kdctl {what}")
            return f"cutover {record.id}: {what} ordered; heeded at its next box"
        if name == "promote-full":
            journal.step(record.id, ORDERS[name], f"{name}-ordered", {}, "done", f"kdctl {what}")
    if what == "pause":
        return f"cutover {record.id} is paused already"
    if what == "abort":
        backend, _ = rollback(inv, store, confirm=confirm, session=session)
        return f"cutover {record.id} aborted: every box back on {backend}"
    outcome = cutover(
        inv, store, None, confirm=confirm, resume=True, on_step=on_step, session=session
    )
    assert isinstance(outcome, CutoverOutcome)
    return outcome


def cutover_in_progress(inv: LoadedInventory, weights: Mapping[str, int]) -> dict[str, Any] | None:
    """The journal's cutover that has not finished, or a rolling one paused, as status and the
    report show it; a rolling one with its wave and each box's engine in the router, by
    `weights` as the router was read back."""
    if not (inv.state_dir / "traffic.sqlite").exists():
        return None
    with open_journal(inv) as journal:
        record = journal.latest(state="running") or journal.latest(state="paused")
    if record is None:
        return None
    shown: dict[str, Any] = {
        "id": record.id,
        "state": record.state,
        "reason": record.reason,
        "from": record.from_backend,
        "to": record.to_backend,
        "strategy": record.strategy,
        # The plan's own steps: not a rollback's, nor a person's orders.
        "steps_done": len({i for i in record.done_steps if 0 <= i < len(record.plan)}),
        "steps": len(record.plan),
        "holder": record.holder,
    }
    if record.strategy == "rolling":
        serving = [n for n, w in weights.items() if w > 0]
        shown |= rollout(inv, record, serving).model_dump(mode="json")
    return shown
