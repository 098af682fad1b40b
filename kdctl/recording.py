"""Running gates and recording baselines: the glue between backends, checks and evidence."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime

from pydantic import BaseModel

from kdctl.checks import (
    Baseline,
    BaselineKind,
    GateContext,
    GateResult,
    ProgressHook,
    gate_class,
    gate_settings,
    gates,
    utcnow,
)
from kdctl.checks.api_conformance import PROBES, record_api
from kdctl.checks.exactness import corpus_path, load_corpus, record_golden
from kdctl.checks.signoff import sign_off
from kdctl.checks.throughput import record_throughput
from kdctl.errors import InputError
from kdctl.evidence import EvidenceStore, age_text, baseline_gaps
from kdctl.inventory import LoadedInventory
from kdctl.session import Identity, Session, check_names, using


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
            # A run recorded on another build, checkpoint, host or TP measured something else;
            # the result carries the record's identity for freshness to hold against what is
            # deployed.
            gaps = [baseline_gaps(inv, b, now.provenance, live=now.live) for b in found]
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
    (it is stopped: a swap's smoke gate). A pool is judged replica by replica, each against
    the baseline's replica on its own box where the baseline is a pool too."""
    if backend in inv.pools:
        with using(inv, session) as s:
            return [
                result
                for member in inv.pools[backend]
                for result in run_gates(
                    inv,
                    store,
                    gate,
                    member,
                    _counterpart(inv, baseline, inv.backends[member].host),
                    on_start=on_start,
                    progress=progress,
                    session=s,
                    recorded_only=recorded_only,
                )
            ]
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


def _counterpart(inv: LoadedInventory, baseline: str | None, host: str) -> str | None:
    """The backend a replica on `host` is compared with: the baseline's replica on the same
    box where the baseline is a pool (the same GPUs and links), else the baseline itself."""
    if baseline is None or baseline not in inv.pools:
        return baseline
    same = [m for m in inv.pools[baseline] if inv.backends[m].host == host]
    if not same:
        raise InputError(
            f"{baseline} has no replica on {host}: name the baseline replica to compare with"
        )
    return same[0]


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


class PlannedRecording(BaseModel):
    """What `kdctl baseline record` would run for one kind, and the box time it may take."""

    kind: BaselineKind
    what: str
    requests: int
    output_tokens: int
    # Seconds, from this engine's own recorded throughput; None where nothing gives a rate.
    estimate_s: float | None = None
    basis: str


def plan_baseline(
    inv: LoadedInventory,
    store: EvidenceStore,
    backend: str,
    kinds: tuple[BaselineKind, ...] = BASELINE_KINDS,
) -> list[PlannedRecording]:
    """What recording the baselines of `backend` would send, without sending anything: the
    engine serving today holds the box while it is measured. The time is estimated from its
    newest recorded throughput run (output tokens a second at each concurrency), said so."""
    check_names(inv, backend)
    rates, basis = _recorded_rates(store, backend)
    plans: list[PlannedRecording] = []
    for kind in kinds:
        if kind == "golden":
            settings = inv.spec.gates.exactness
            corpus = load_corpus(corpus_path(inv, settings))
            tokens = len(corpus) * settings.max_new_tokens
            # One prompt at a time: a prompt's first token and its decode steps, at the
            # lowest concurrency recorded (a higher one's TPOT makes it a little long).
            low = min(rates) if rates else None
            seconds = (
                len(corpus) * (rates[low].ttft_s + settings.max_new_tokens * rates[low].tpot_s)
                if low is not None
                else None
            )
            plans.append(
                PlannedRecording(
                    kind=kind,
                    what=f"{len(corpus)} prompts, up to {settings.max_new_tokens} tokens each, "
                    f"greedy, top-{settings.top_k} logprobs, one at a time",
                    requests=len(corpus),
                    output_tokens=tokens,
                    estimate_s=seconds,
                    basis=basis
                    if low is None
                    else f"{basis}: median TTFT and TPOT at concurrency {low}",
                )
            )
        elif kind == "throughput":
            plans += _plan_throughput(inv, rates, basis)
        else:
            plans.append(
                PlannedRecording(
                    kind=kind,
                    what=f"{len(PROBES)} API probes (routes, fields, streams, error codes)",
                    requests=len(PROBES),
                    output_tokens=0,
                    estimate_s=None,
                    basis="a few seconds: short requests",
                )
            )
    return plans


def _plan_throughput(
    inv: LoadedInventory, rates: dict[int, _Rate], basis: str
) -> list[PlannedRecording]:
    settings = inv.spec.gates.throughput
    w = settings.workload
    # Under `source: auto` with no prompt file, both workloads are recorded (record_throughput).
    both = w.source == "auto" and not w.prompts
    variants = ["random ids", "the text corpus"] if both else [str(w.prompts or w.source)]
    plans = []
    for variant in variants:
        per_run = w.num_prompts * w.output_len
        runs = len(w.concurrency) * settings.repeats
        warm = sum(c if w.warmup_requests is None else w.warmup_requests for c in w.concurrency)
        known = all(c in rates for c in w.concurrency)
        seconds = (
            sum(settings.repeats * per_run / rates[c].output_tok_s for c in w.concurrency)
            if known
            else None
        )
        plans.append(
            PlannedRecording(
                kind="throughput",
                what=f"{variant}: {w.num_prompts} prompts of {w.input_len} tokens, "
                f"{w.output_len} out, at concurrency {', '.join(map(str, w.concurrency))}, "
                f"{settings.repeats} run(s) each, {warm * settings.repeats} warm-up requests",
                requests=(w.num_prompts * runs) + warm * settings.repeats,
                output_tokens=per_run * runs,
                estimate_s=seconds,
                basis=basis if known or not rates else f"{basis}; not at every concurrency asked",
            )
        )
    return plans


@dataclass(frozen=True)
class _Rate:
    output_tok_s: float
    ttft_s: float
    tpot_s: float


def _recorded_rates(store: EvidenceStore, backend: str) -> tuple[dict[int, _Rate], str]:
    """Output tokens a second and the median TTFT and TPOT by concurrency, from the newest
    throughput run recorded of `backend`, and where they come from."""
    for b in store.baselines(backend=backend, kind="throughput"):
        rates = {
            int(p["max_concurrency"]): _Rate(
                float(p["output_throughput"]),
                float(p["ttft_ms"]["p50"]) / 1000,
                float(p["tpot_ms"]["p50"]) / 1000,
            )
            for p in b.payload.get("points", [])
            if p.get("output_throughput") and p.get("ttft_ms") and p.get("tpot_ms")
        }
        if rates:
            shown = ", ".join(
                f"{r.output_tok_s:.0f} tok/s at concurrency {c}" for c, r in sorted(rates.items())
            )
            return rates, f"from its throughput baseline of {b.created_at:%Y-%m-%d} ({shown})"
    return {}, f"no throughput of {backend} recorded yet"


class BaselineCoverage(BaseModel):
    """One recorded baseline as `status` shows it: what it holds, its age, whether it still
    describes the engine as it is now."""

    backend: str
    kind: BaselineKind
    id: str
    workload_hash: str
    holds: str
    recorded_at: datetime
    age: str
    # None where who the engine is now is not known.
    current: bool | None = None
    why: str | None = None


def baseline_coverage(
    inv: LoadedInventory, store: EvidenceStore, identities: Mapping[str, Identity]
) -> list[BaselineCoverage]:
    """The newest recorded baseline of each kind and workload of every backend."""
    now = utcnow()
    found: list[BaselineCoverage] = []
    for name in inv.backends:
        seen: set[tuple[str, str]] = set()
        for b in store.baselines(backend=name):
            if (b.kind, b.workload_hash) in seen:
                continue
            seen.add((b.kind, b.workload_hash))
            ident = identities.get(name)
            gaps = (
                baseline_gaps(inv, b, ident.provenance, live=ident.live)
                if ident is not None
                else None
            )
            found.append(
                BaselineCoverage(
                    backend=name,
                    kind=b.kind,
                    id=b.id,
                    workload_hash=b.workload_hash,
                    holds=_holds(b),
                    recorded_at=b.created_at,
                    age=age_text(now - b.created_at),
                    current=None if gaps is None else not gaps,
                    why="; ".join(gaps) if gaps else None,
                )
            )
    return found


def _holds(b: Baseline) -> str:
    if b.kind == "api":
        return f"answers to {len(b.payload.get('answers', {}))} API probes"
    if b.kind == "golden":
        return f"golden outputs of {len(b.payload.get('outputs', []))} prompts"
    points = ", ".join(
        f"{float(p['output_throughput']):.0f} tok/s at {p['max_concurrency']}"
        for p in b.payload.get("points", [])
        if p.get("output_throughput") is not None
    )
    return f"throughput: {points or 'no figures'}"
