"""Running gates and recording baselines: the glue between backends, checks and evidence."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from kdctl.checks import (
    Baseline,
    BaselineKind,
    GateContext,
    GateResult,
    ProgressHook,
    freshness_window,
    gate_class,
    gate_settings,
    gates,
    utcnow,
)
from kdctl.checks.api_conformance import record_api
from kdctl.checks.exactness import record_golden
from kdctl.checks.signoff import sign_off
from kdctl.checks.throughput import record_throughput
from kdctl.evidence import EvidenceStore
from kdctl.evidence._freshness import age_text
from kdctl.inventory import LoadedInventory
from kdctl.session import Session, check_names, using


@contextmanager
def gate_context(
    inv: LoadedInventory,
    store: EvidenceStore,
    progress: ProgressHook | None = None,
    *,
    session: Session | None = None,
    recorded_only: bool = False,
) -> Iterator[GateContext]:
    """What a gate runs with; `inv` may carry other gate settings than the session's (a
    roadmap criterion's own), never other hosts or backends."""
    with using(inv, session) as s:

        def lookup(name: str, kind: BaselineKind, workload: str) -> Baseline | None:
            found = store.baselines(backend=name, kind=kind, workload_hash=workload)
            if not found:
                return None
            (now,) = s.identify([name]).values()
            # A run recorded on another build, checkpoint, host or TP measured something else.
            # An engine that answers is held to what it reports; one that does not (stopped
            # for a swap) to what its host shows (the checkpoint's fingerprint, the host's id)
            # and the inventory declares, and the result carries the record's identity for
            # freshness to hold against what is deployed.
            fields = None if now.live else ("weights", "host_id")
            gaps = [b.provenance.differs_from(now.provenance, fields) for b in found]
            if kind == "throughput":
                # A speed is the machine's as much as the build's (drivers, clocks, firmware,
                # none of which the identity holds): a run is a denominator only as long as
                # the gate's own results count.
                window = freshness_window(inv, "throughput")
                for b, gap in zip(found, gaps, strict=True):
                    age = utcnow() - b.created_at
                    if not gap and age > window:
                        gap.append(
                            f"recorded {age_text(age)} ago, past the throughput window of "
                            f"{age_text(window)}"
                        )
            chosen = next((b for b, gap in zip(found, gaps, strict=True) if not gap), None)
            if chosen is None:
                ctx.passed_over[name] = (
                    f"{len(found)} recorded {kind} baseline(s) of {name} passed over: not taken "
                    f"on what it {'serves' if now.live else 'has'} now ({'; '.join(gaps[0])})"
                )
            else:
                ctx.used_baselines[name] = chosen
            return chosen

        ctx = GateContext(
            inventory=inv,
            backend=s.backend,
            baseline_lookup=lookup,
            progress=progress,
            transport=s.transport,
            last_result=store.latest,
            recorded_only=recorded_only,
        )
        yield ctx


def run_gates(
    inv: LoadedInventory,
    store: EvidenceStore,
    gate: str,
    backend: str,
    baseline: str | None,
    *,
    on_start: Callable[[str], None] | None = None,
    progress: ProgressHook | None = None,
    session: Session | None = None,
    recorded_only: bool = False,
) -> list[GateResult]:
    """Run one gate or `all`, record every result as evidence, and return them. With
    `recorded_only`, a baseline is compared only through what it recorded, never asked live
    (it is stopped: a swap's smoke gate)."""
    check_names(inv, backend, baseline)
    names = (
        sorted(n for n, g in gates().items() if g.runnable)
        if gate == "all"
        else [gate_class(gate).name]
    )
    results = []
    with (
        using(inv, session) as s,
        gate_context(inv, store, progress, session=s, recorded_only=recorded_only) as ctx,
    ):
        for name in names:
            cls = gate_class(name)
            if on_start:
                on_start(name)
            if cls.needs_baseline and baseline is None:
                now = utcnow()
                result = GateResult(
                    gate=name,
                    backend=backend,
                    verdict="skipped",
                    reasons=["needs --baseline"],
                    started_at=now,
                    ended_at=now,
                )
            else:
                ctx.used_baselines.clear()
                ctx.passed_over.clear()
                result = cls().run(ctx, backend, baseline)
            result.settings = gate_settings(inv, name)
            recorded = ctx.used_baselines.get(baseline) if baseline is not None else None
            result = s.binder.bind_result(result, recorded)
            # A comparison not made for want of a record is no evidence either way: it must not
            # stand as the newest result over an earlier measured one.
            if not (recorded_only and result.verdict == "skipped"):
                store.record(result)
            results.append(result)
    return results


BASELINE_KINDS: tuple[BaselineKind, ...] = ("golden", "throughput", "api")


def record_baseline(
    inv: LoadedInventory,
    store: EvidenceStore,
    backend: str,
    kinds: tuple[BaselineKind, ...] = BASELINE_KINDS,
    *,
    progress: ProgressHook | None = None,
    session: Session | None = None,
) -> list[Baseline]:
    """Golden outputs and a throughput run from the engine serving today, kept as evidence.

    Each is stored as soon as it is measured, so a failure in the second keeps the first.
    """
    check_names(inv, backend)
    recorders: dict[BaselineKind, Callable[[GateContext, str], list[Baseline]]] = {
        "golden": lambda ctx, name: [record_golden(ctx, name)],
        "throughput": record_throughput,
        "api": lambda ctx, name: [record_api(ctx, name)],
    }
    recorded = []
    with using(inv, session) as s, gate_context(inv, store, progress, session=s) as ctx:
        for kind in kinds:
            for baseline in recorders[kind](ctx, backend):
                baseline.provenance = s.binder.bind(backend, baseline.provenance)
                store.record_baseline(baseline)
                recorded.append(baseline)
    return recorded


def record_signoff(
    inv: LoadedInventory,
    store: EvidenceStore,
    backend: str,
    by: str,
    note: str,
    *,
    session: Session | None = None,
) -> GateResult:
    """A person's approval, kept as evidence like any gate's result, bound to the engine as it
    answers now (its build, settings, weights): an approval of one build is not one of the
    next. An engine that does not answer is described by the inventory, and the result says so."""
    check_names(inv, backend)
    with using(inv, session) as s, gate_context(inv, store, session=s) as ctx:
        (now,) = s.identify([backend]).values()
        result = sign_off(ctx, backend, by, note)
        result = result.model_copy(update={"provenance": now.provenance})
        if not now.live and now.note:
            result.reasons.append(now.note)
    store.record(result)
    return result
