"""throughput: kdctl's load generator against the candidate, compared with the baseline's run of
the same workload (the same workload hash) as a ratio, plus absolute latency SLOs.

Under `mode: offline-batch` a command-mode engine, which has no server to load, is measured by
its own timings of batch runs of the same prompts instead (docs/native-engine-contract.md), at
batch 1 and at every concurrency, each batch size against the baseline's served run at that
concurrency. The mode is one of the settings every result keeps, so such a result never meets
a criterion that asks for the served comparison.

The baseline's run is normally recorded earlier (`kdctl baseline record`), because on one 8-GPU
box the two engines cannot serve at once; where the baseline is up and has no recorded run, or
`baseline_run: interleaved` asks for it (engines sharing one machine), it is measured now, the two
engines taking turns run by run. With `repeats`, each engine's median run is judged.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Sequence
from typing import Any

from kdctl.backends import Backend, EngineInfo, GenerateRequest, HttpBackend, SpecCounters
from kdctl.backends.contract import ContractResult
from kdctl.backends.native import NativeCommandBackend
from kdctl.checks._base import Gate, GateContext, provenance_of
from kdctl.checks.exactness import load_corpus, prompt_file, shipped_prompts
from kdctl.errors import InfraError, InputError, KdctlError
from kdctl.inventory import LoadedInventory
from kdctl.inventory.models import ThroughputSettings
from kdctl.loadgen import SLO, BenchMetrics, LoadPlan, Progress, RequestRecord, run_load
from kdctl.records import (
    Baseline,
    GateResult,
    Metric,
    Verdict,
    content_hash,
    decide,
    utcnow,
)

_SLOS = (
    ("ttft", "slo_ttft_ms"),
    ("itl", "slo_itl_ms"),
    ("tpot", "slo_tpot_ms"),
    ("e2el", "slo_e2el_ms"),
)


# The shipped corpus (roadmap/prompts/): chat, code, math and long prompts written for kdctl,
# what a speculative engine's speed is measured on unless the inventory names another.
TEXT_CORPUS = "mixed.jsonl"
# A short greedy request that shows whether an engine drafts and verifies.
_PROBE = GenerateRequest(text="def add(a, b):", max_new_tokens=8, temperature=0.0, ignore_eos=True)


def build_requests(
    inv: LoadedInventory, settings: ThroughputSettings, *, text: bool | None = None
) -> tuple[list[GenerateRequest], str]:
    """The workload's requests and its hash: random token ids from the seed, or a prompt file
    cycled to `num_prompts`. `text` is the choice `source: auto` leaves to the engines
    (`speculating`); unset, auto means random ids unless `prompts` is set."""
    w = settings.workload
    if text is None:
        text = w.source == "text" or w.prompts is not None
    if not text:
        rng = random.Random(w.seed)  # noqa: S311 - a workload, not a secret
        low, high = w.token_range
        prompts: list[dict[str, Any]] = [
            {"input_ids": [rng.randrange(low, high) for _ in range(w.input_len)]}
            for _ in range(w.num_prompts)
        ]
    else:
        path = (
            prompt_file(inv, w.prompts, "gates.throughput.workload.prompts")
            if w.prompts is not None
            else shipped_prompts(TEXT_CORPUS)
        )
        corpus = load_corpus(path)
        prompts = [corpus[i % len(corpus)] for i in range(w.num_prompts)]
    requests = [
        GenerateRequest(
            text=p.get("prompt"),
            input_ids=p.get("input_ids"),
            max_new_tokens=w.output_len,
            temperature=0.0,
            ignore_eos=w.ignore_eos,
        )
        for p in prompts
    ]
    workload = content_hash(
        {
            # The prompts themselves say what was sent, however `source` chose them.
            "workload": w.model_dump(mode="json", exclude={"prompts", "source"}),
            "prompts": prompts,
            "client": settings.client,
        }
    )[:16]
    return requests, workload


def speculating(ctx: GateContext, names: list[str]) -> tuple[list[str], dict[str, str]]:
    """Which of these engines decode speculatively, asked of each: one short greedy request
    (does its answer count verification passes, as SGLang's does) and its metrics (does it
    export drafting counters, as vLLM does); and those whose metrics could not be read, with
    why. One that does not answer is not counted; the measurement will say why it failed."""
    found: list[str] = []
    unread: dict[str, str] = {}
    for name in names:
        try:
            with ctx.backend(name) as be:
                if not isinstance(be, HttpBackend):
                    continue
                if be.generate(_PROBE).spec_verify_ct is not None:
                    found.append(name)
                    continue
                try:
                    if be.spec_counters() is not None:
                        found.append(name)
                except KdctlError as exc:
                    unread[name] = str(exc)
        except KdctlError:
            continue
    return found, unread


def measure(
    ctx: GateContext,
    sides: Sequence[Backend],
    settings: ThroughputSettings,
    requests: list[GenerateRequest],
) -> list[list[Runs]]:
    """For each engine in `sides`, in order, its runs at every concurrency of the workload:
    `repeats` load runs each, the engines taking turns run by run so that a noisy machine
    weighs on all of them alike."""
    served = [_served_engine(be) for be in sides]
    out: list[list[Runs]] = [[] for _ in served]
    for conc in settings.workload.concurrency:
        runs: list[list[BenchMetrics]] = [[] for _ in served]
        for repeat in range(settings.repeats):
            for be, done in zip(served, runs, strict=True):
                done.append(_served_run(ctx, be, settings, requests, conc, repeat))
        for side, done in zip(out, runs, strict=True):
            side.append(Runs(done))
    return out


def _served_engine(be: Backend) -> HttpBackend:
    if not isinstance(be, HttpBackend):
        offline = (
            f" (gates.throughput.mode: {OFFLINE} compares its own timings of a batch "
            "instead, which stands for the served comparison nowhere)"
            if isinstance(be, NativeCommandBackend)
            else ""
        )
        raise InputError(
            f"backend {be.name}: the throughput gate needs a served engine with a streaming "
            f"HTTP API; kind {be.kind} in this mode has none{offline}"
        )
    return be


def _slo(settings: ThroughputSettings) -> SLO:
    return SLO(
        ttft_ms=settings.slo_ttft_ms, tpot_ms=settings.slo_tpot_ms, e2el_ms=settings.slo_e2el_ms
    )


def _run_label(what: str, repeat: int, settings: ThroughputSettings) -> str:
    return what + (f", run {repeat + 1} of {settings.repeats}" if settings.repeats > 1 else "")


def _served_run(
    ctx: GateContext,
    be: HttpBackend,
    settings: ThroughputSettings,
    requests: list[GenerateRequest],
    conc: int,
    repeat: int,
) -> BenchMetrics:
    """One load run at concurrency `conc`, with the engine's own accept length where it
    counts its drafts itself."""
    w = settings.workload
    plan = LoadPlan(
        max_concurrency=conc,
        request_rate=w.request_rate,
        burstiness=w.burstiness,
        warmup_requests=conc if w.warmup_requests is None else w.warmup_requests,
        seed=w.seed,
        client=settings.client,
        timeout_s=settings.request_timeout_s,
        slo=_slo(settings),
        output_len=w.output_len if w.ignore_eos else None,
    )
    what = _run_label(f"throughput {be.name} at concurrency {conc}", repeat, settings)
    ctx.report(what, 0, len(requests))
    before = _spec_counters(be)
    run = run_load(be, requests, plan, on_progress=_reporter(ctx, what))
    if before is not None:  # only an engine that counts its drafts is asked again
        warmup = plan.warmup_requests * max(r.max_new_tokens for r in requests)
        run = _with_engine_acceptance(run, before, _spec_counters(be), warmup)
    return run


# The mode under which a command-mode engine is measured by its own timings.
OFFLINE = "offline-batch"
# What an offline point's figures come from, where a served one names its HTTP client.
ENGINE_TIMINGS = "engine timings"


def batch_sizes(settings: ThroughputSettings) -> list[int]:
    """Batch 1, the engine's speed alone, and every concurrency the workload pins."""
    return sorted({1, *settings.workload.concurrency})


def measure_offline(
    ctx: GateContext,
    be: NativeCommandBackend,
    settings: ThroughputSettings,
    requests: list[GenerateRequest],
    beside: Backend | None = None,
) -> tuple[list[Runs], list[Runs], EngineInfo | None, str | None]:
    """The engine's runs of `requests` at every batch size, `repeats` each, one run of its
    binary per batch; with `beside`, that engine's served run at the same concurrency after
    each of them, taking turns as the served comparison does, so that a noisy machine weighs
    on both alike; the engine it said it was; and why its speed could not be measured (its
    answers carry no timings), or None. Warm-up requests go first in every run, as the load
    generator sends them first, and are left out of the figures."""
    served = _served_engine(beside) if beside is not None else None
    out: list[Runs] = []
    base: list[Runs] = []
    info: EngineInfo | None = None
    for size in batch_sizes(settings):
        done: list[BenchMetrics] = []
        theirs: list[BenchMetrics] = []
        for repeat in range(settings.repeats):
            point, said, untimed = _offline_run(ctx, be, settings, requests, size, repeat)
            info = info or said
            if untimed is not None:
                return out, base, info, untimed
            assert point is not None
            done.append(point)
            if served is not None and size in settings.workload.concurrency:
                theirs.append(_served_run(ctx, served, settings, requests, size, repeat))
        out.append(Runs(done))
        if theirs:
            base.append(Runs(theirs))
    return out, base, info, None


def _offline_run(
    ctx: GateContext,
    be: NativeCommandBackend,
    settings: ThroughputSettings,
    requests: list[GenerateRequest],
    size: int,
    repeat: int,
) -> tuple[BenchMetrics | None, EngineInfo | None, str | None]:
    w = settings.workload
    warm = size if w.warmup_requests is None else w.warmup_requests
    what = _run_label(f"throughput {be.name} offline at batch {size}", repeat, settings)
    ctx.report(what, 0, len(requests))
    response = be.run_batch([requests[0]] * warm + requests, batch_size=size)
    ctx.report(what, len(requests), len(requests))
    timed = response.results[warm:]
    answered = [r for r in timed if r.error is None]
    untimed = [r for r in answered if r.timings is None]
    if untimed:
        why = (
            f"{len(untimed)} of its {len(answered)} answers at batch {size} carry no "
            "timings (an engine older than the contract's timings): its speed cannot be "
            "measured before it serves"
        )
        return None, response.engine, why
    output_len = w.output_len if w.ignore_eos else None
    return _offline_point(timed, size, output_len, _slo(settings)), response.engine, None


def _offline_point(
    results: list[ContractResult], size: int, output_len: int | None, slo: SLO
) -> BenchMetrics:
    """One batch run's figures from the engine's timings, in the load generator's record: a
    request's E2EL is its TTFT and decode time, and the run lasts from the first admission to
    the last token. Nothing times the gaps between tokens, so there is no ITL."""
    records: list[RequestRecord] = []
    for r in results:
        if r.error is not None or r.timings is None:
            why = f"{r.error.type}: {r.error.message}" if r.error else "no answer"
            records.append(RequestRecord(started_at=0.0, error=why))
            continue
        t = r.timings
        delivered = len(r.output_ids)
        steps = r.spec_verify_ct
        if steps is None and 0 < t.decode_steps < delivered - 1:
            # Fewer passes than tokens: several tokens accepted per pass, which is drafting
            # whether or not the engine counts it as SGLang does.
            steps = t.decode_steps
        records.append(
            RequestRecord(
                started_at=t.start_s,
                ok=True,
                prompt_tokens=r.prompt_tokens,
                output_tokens=delivered,
                streamed_tokens=delivered,
                server_tokens=r.completion_tokens,
                ttft_s=t.ttft_s,
                e2el_s=t.ttft_s + t.decode_s,
                spec_verify_ct=steps,
            )
        )
    timed = [r for r in records if r.ok and r.e2el_s is not None]
    span = (
        max(r.started_at + (r.e2el_s or 0.0) for r in timed) - min(r.started_at for r in timed)
        if timed
        else 0.0
    )
    return BenchMetrics.of(
        records,
        span,
        max_concurrency=size,
        request_rate=None,
        burstiness=1.0,
        client=ENGINE_TIMINGS,
        output_len=output_len,
        slo=slo,
    )


def _spec_counters(be: HttpBackend) -> SpecCounters | None:
    try:
        return be.spec_counters()
    except KdctlError:
        return None  # its metrics unreadable now: the run says nothing of drafting


def _with_engine_acceptance(
    run: BenchMetrics, before: SpecCounters, after: SpecCounters | None, warmup: int
) -> BenchMetrics:
    """A run of an engine that counts its drafts itself (vLLM) rather than per answer: its
    accept length is the counters' growth over the run, which is the load's own only where
    the engine generated no more than the load's tokens and its warm-up's (`warmup`, at
    most); else other traffic shares the window and no figure is given."""
    if run.spec_accept_from is not None or after is None:
        return run
    generated = after.generated - before.generated
    if generated < 0 or generated > run.total_output_tokens + warmup:
        return run.model_copy(
            update={
                "spec_accept_from": "engine counters",
                "spec_accept_note": (
                    f"its counters grew by {generated:.0f} tokens over the run, the load's "
                    f"{run.total_output_tokens} (and at most {warmup} of warm-up): other "
                    "traffic or a restart shares the window, so its accept length is not given"
                ),
            }
        )
    return run.model_copy(
        update={
            "spec_accept_length": after.accept_length_since(before),
            "spec_accept_from": "engine counters",
        }
    )


class Runs:
    """One engine's load runs at one concurrency; `median`, a run as it was measured (never a
    blend of several), is the one judged and recorded."""

    def __init__(self, runs: list[BenchMetrics]) -> None:
        self.runs = runs
        ranked = sorted(runs, key=lambda r: r.output_throughput)
        self.median = ranked[(len(ranked) - 1) // 2]

    def spread(self) -> str:
        """What the median was taken from, for a reason line; empty for a single run."""
        if len(self.runs) < 2:
            return ""
        figures = ", ".join(f"{r.output_throughput:.1f}" for r in self.runs)
        return f"median of {len(self.runs)} runs ({figures} tok/s)"


def _reporter(ctx: GateContext, what: str) -> Progress:
    def report(done: int, total: int) -> None:
        ctx.report(what, done, total)

    return report


def record_throughput(ctx: GateContext, backend: str) -> list[Baseline]:
    """The throughput runs of the engine serving today, for later comparison with a
    candidate: under `source: auto` with no prompt file, on random ids and on the text corpus
    both, since which one a candidate is judged on depends on whether it decodes
    speculatively, and it may not be up to ask yet."""
    settings = ctx.inventory.spec.gates.throughput
    w = settings.workload
    both = w.source == "auto" and w.prompts is None
    return [
        _record_one(ctx, backend, settings, text) for text in ((False, True) if both else (None,))
    ]


def _record_one(
    ctx: GateContext, backend: str, settings: ThroughputSettings, text: bool | None
) -> Baseline:
    requests, workload = build_requests(ctx.inventory, settings, text=text)
    with ctx.backend(backend) as be:
        info = be.info()
        (runs,) = measure(ctx, [be], settings, requests)
    points = [r.median for r in runs]
    # A baseline with failed requests would hold every later candidate to a figure that was
    # not measured (0 tok/s is passed by anything); the same allowance as the gate's.
    failed = [
        f"concurrency {p.max_concurrency}: {p.failed} of {p.requests} requests failed "
        f"({'; '.join(p.errors[:2])})"
        for p in points
        if p.failed > settings.max_failed_requests or p.completed == 0
    ]
    if failed:
        raise InfraError(
            f"throughput baseline of {backend} not recorded: {'; '.join(failed)}; "
            f"gates.throughput.max_failed_requests allows {settings.max_failed_requests}"
        )
    return Baseline(
        backend=backend,
        kind="throughput",
        workload_hash=workload,
        provenance=provenance_of(ctx, backend, info, workload),
        payload={
            "points": [p.model_dump(mode="json") for p in points],
            "repeats": settings.repeats,
        },
    )


class ThroughputGate(Gate):
    name = "throughput"
    settings_field = "throughput"
    takes_baseline = True
    description = "output token throughput against the baseline's, and latency SLOs"

    def workloads(self, inv: LoadedInventory) -> frozenset[str] | None:
        settings = inv.spec.gates.throughput
        w = settings.workload
        # `source: auto` leaves text or random ids to whether the engines draft when it runs.
        choices = (False, True) if w.source == "auto" and w.prompts is None else (None,)
        return frozenset(build_requests(inv, settings, text=t)[1] for t in choices)

    def run(self, ctx: GateContext, backend: str, baseline: str | None) -> GateResult:
        started = utcnow()
        settings = ctx.inventory.spec.gates.throughput
        # A baseline held to its records (stopped for a swap) is not asked.
        asked = [backend] if ctx.recorded_only or baseline is None else [backend, baseline]
        drafting, unread = speculating(ctx, asked)
        # Under `source: auto` with no prompt file, a drafting engine is measured on text.
        auto = settings.workload.source == "auto" and settings.workload.prompts is None
        drafting = drafting if auto else []
        requests, workload = build_requests(ctx.inventory, settings, text=bool(drafting) or None)
        random_ids = requests[0].input_ids is not None
        offline = settings.mode == OFFLINE
        info = None
        source = ""
        base_points: list[BenchMetrics] | None = None
        base_runs: list[Runs] = []
        try:
            recorded = None
            if baseline is not None and (settings.baseline_run == "recorded" or ctx.recorded_only):
                recorded = ctx.baseline_lookup(baseline, "throughput", workload)
            if baseline is not None and recorded is None and ctx.recorded_only:
                return self.unrecorded(
                    ctx,
                    backend,
                    baseline,
                    said="throughput not compared: no usable recorded run",
                    workload=workload,
                    started=started,
                )
            if baseline is not None and recorded is not None:
                base_points = [BenchMetrics.model_validate(p) for p in recorded.payload["points"]]
                source = f"{baseline}'s run recorded {recorded.created_at:%Y-%m-%d %H:%M}Z"
                taken = int(recorded.payload.get("repeats", 1))
                if taken != settings.repeats:
                    # Not in the workload hash (the same requests were sent), but a median of
                    # three is steadier than one run: say which figures meet.
                    source += (
                        f", the median of {taken} run{'s' if taken > 1 else ''} per "
                        f"concurrency where this one takes {settings.repeats}"
                    )
            with ctx.backend(backend) as be:
                if offline:
                    # No recorded run to compare with: the baseline's served runs are taken
                    # now, each beside the batch run of its size.
                    with contextlib.ExitStack() as stack:
                        base_be = (
                            stack.enter_context(ctx.backend(baseline))
                            if baseline is not None and base_points is None
                            else None
                        )
                        runs, base_runs, info, untimed = measure_offline(
                            ctx, _command_engine(be), settings, requests, beside=base_be
                        )
                    if untimed is not None:
                        return self.result(
                            ctx,
                            backend,
                            started=started,
                            baseline=baseline,
                            verdict="inconclusive",
                            reasons=[f"{backend}: {untimed}"],
                            info=info,
                            workload=workload,
                            details={"mode": OFFLINE},
                        )
                    if baseline is not None and base_points is None:
                        base_points = [r.median for r in base_runs]
                        source = (
                            f"{baseline}'s served load measured now, taking turns with "
                            f"{backend}'s batch runs, {_why_now(settings, ctx, baseline)}"
                        )
                elif baseline is None or base_points is not None:
                    info = be.info()
                    (runs,) = measure(ctx, [be], settings, requests)
                else:
                    info = be.info()
                    with ctx.backend(baseline) as base_be:
                        base_runs, runs = measure(ctx, [base_be, be], settings, requests)
                    base_points = [r.median for r in base_runs]
                    source = (
                        f"{baseline} measured now, taking turns with {backend} run by run, "
                        f"{_why_now(settings, ctx, baseline)}"
                    )
        except KdctlError as exc:
            return self.errored(
                ctx, backend, baseline, exc, info=info, workload=workload, started=started
            )
        points = [r.median for r in runs]
        metrics, reasons, verdict = judge(
            settings, points, base_points, backend=backend, random_ids=random_ids, offline=offline
        )
        if settings.repeats > 1:
            base_by = {r.median.max_concurrency: r for r in base_runs}
            for mine in runs:
                size = mine.median.max_concurrency
                spreads = [f"{backend} {mine.spread()}"]
                if size in base_by:
                    spreads.append(f"{baseline} {base_by[size].spread()}")
                word = "batch" if offline else "concurrency"
                reasons.append(f"{word} {size}: {'; '.join(spreads)}")
        if source:
            reasons.insert(0, f"compared with {source}")
        if offline:
            reasons.insert(
                0,
                f"offline batch: the figures are {backend}'s own timings of its generation "
                "loop, reported in its command contract's response, not kdctl's measurement of "
                "a served load; each batch size is compared with the baseline's served load at "
                "that concurrency, and the result stands for no served comparison",
            )
        if random_ids:
            for name, why in unread.items():
                reasons.append(
                    f"whether {name} decodes speculatively could not be read (its metrics: "
                    f"{why}): its speed on random token ids is judged as a plain engine's"
                )
        for who, run_points in ((backend, points), (baseline, base_points or [])):
            for p in run_points:
                if p.spec_accept_note:
                    where = f"{who} at concurrency {p.max_concurrency}"
                    reasons.append(f"{where}: {p.spec_accept_note}")
        if drafting:
            reasons.insert(
                0,
                f"workload: the shipped text corpus {TEXT_CORPUS}, because "
                f"{' and '.join(drafting)} decode{'s' if len(drafting) == 1 else ''} "
                "speculatively (a drafting engine's speed depends on the text; random token "
                "ids say little of it)",
            )
        return self.result(
            ctx,
            backend,
            started=started,
            baseline=baseline,
            verdict=verdict,
            metrics=metrics,
            reasons=reasons,
            info=info,
            workload=workload,
            details={
                "mode": OFFLINE if offline else "served",
                "points": [p.model_dump(mode="json") for p in points],
                "baseline_points": [p.model_dump(mode="json") for p in base_points or []],
                "repeats": settings.repeats,
            },
        )


def _why_now(settings: ThroughputSettings, ctx: GateContext, baseline: str) -> str:
    if settings.baseline_run == "interleaved":
        return "as gates.throughput.baseline_run asks"
    passed = f" ({ctx.passed_over[baseline]})" if baseline in ctx.passed_over else ""
    return f"as no recorded run of this workload matches what it serves now{passed}"


def _command_engine(be: Backend) -> NativeCommandBackend:
    if not isinstance(be, NativeCommandBackend):
        raise InputError(
            f"backend {be.name}: gates.throughput.mode: {OFFLINE} measures a command-mode "
            f"engine by its own timings; kind {be.kind} here is served, so measure its served "
            "load (unset mode, or served)"
        )
    return be


def judge(
    settings: ThroughputSettings,
    points: list[BenchMetrics],
    base_points: list[BenchMetrics] | None,
    *,
    backend: str,
    random_ids: bool,
    offline: bool = False,
) -> tuple[list[Metric], list[str], Verdict]:
    """Every concurrency must hold the ratio and every SLO. A run in which every request failed
    measured nothing and fails; an SLO or ratio that could not be measured otherwise (no
    baseline run to divide by, no second token to time) is inconclusive; and so is a run with
    neither a baseline nor an SLO, which has nothing to be judged against. None is a pass.

    `offline` points are an engine's own timings of its batch runs (`bN.` metrics, no ITL):
    each is held to the baseline's served run at that concurrency, and a batch size the
    workload does not pin (batch 1) is shown beside them, not judged, where it has none."""
    prefix, word = ("b", "batch") if offline else ("c", "concurrency")
    pct = settings.slo_percentile
    metrics: list[Metric] = []
    reasons: list[str] = []
    findings: list[str] = []
    # Runs that did not produce the output length asked: their figures are of another workload.
    short: list[str] = []
    # Runs whose requests took another path than the baseline's (SSH against direct).
    across: list[str] = []
    # Baseline runs that lost more requests than allowed: output tokens a second count the
    # requests served, so each lost one lowers its figure and raises the ratio.
    lossy: list[str] = []
    decided = False
    base_by = {b.max_concurrency: b for b in base_points or []}
    for p in points:
        c = f"{prefix}{p.max_concurrency}"
        at = f"{word} {p.max_concurrency}"
        none_ok = p.completed == 0
        metrics += [
            Metric(name=f"{c}.output_throughput", value=p.output_throughput, unit="tok/s"),
            Metric(name=f"{c}.request_throughput", value=p.request_throughput, unit="req/s"),
            Metric(
                name=f"{c}.failed",
                value=p.failed,
                threshold=settings.max_failed_requests,
                comparison="<=",
            ),
        ]
        if p.request_goodput is not None:
            metrics.append(
                Metric(name=f"{c}.request_goodput", value=p.request_goodput, unit="req/s")
            )
        for stat in ("ttft", "itl", "tpot", "e2el"):
            if offline and stat == "itl":
                continue  # nothing times the gaps between an offline run's tokens
            s = getattr(p, f"{stat}_ms")
            metrics.append(Metric(name=f"{c}.median_{stat}_ms", value=s.p50, unit="ms"))
        if p.spec_accept_length is not None:
            # A speculative decoder's speed is its accept length on this text: kept beside
            # tok/s, TTFT and ITL so a comparison can say what the workload let it accept.
            metrics.append(
                Metric(name=f"{c}.spec_accept_length", value=p.spec_accept_length, unit="tok/step")
            )
        if none_ok:
            # However many failures the settings allow, a run with no success has no figures.
            findings.append(
                f"{at}: {p.failed} of {p.requests} requests to {backend} failed, so nothing was "
                "measured "
                f"({'; '.join(p.errors[:3])})"
            )
        elif p.failed > settings.max_failed_requests:
            findings.append(
                f"{at}: {p.failed} of {p.requests} requests to {backend} failed "
                f"({'; '.join(p.errors[:3])})"
            )
        for stat, field in _SLOS:
            limit = getattr(settings, field)
            if offline and stat == "itl" and limit is None:
                continue
            value = getattr(getattr(p, f"{stat}_ms"), pct)
            m = Metric(
                name=f"{c}.{pct}_{stat}_ms",
                value=value,
                unit="ms",
                threshold=limit,
                comparison="<=" if limit is not None else None,
            )
            metrics.append(m)
            if limit is None:
                continue
            decided = True
            if m.passed is False:
                findings.append(
                    f"{at}: {pct} {stat.upper()} {value:.1f} ms breaks the SLO of {limit:g} ms"
                )
            elif m.unmeasured and not none_ok:
                reasons.append(
                    f"{at}: {pct} {stat.upper()} was not measured "
                    f"({_unmeasured_why(stat, offline)}), so its SLO of {limit:g} ms could not "
                    "be judged"
                )
        if p.token_count_mismatches:
            reasons.append(
                f"{at}: {p.token_count_mismatches} of {p.completed} streams delivered a number "
                "of tokens other than the server's own count; the figures count the tokens "
                "delivered"
            )
        for who, run in ((backend, p), ("the baseline", base_by.get(p.max_concurrency))):
            if run is not None and run.short_outputs:
                short.append(
                    f"{at}: {run.short_outputs} of {run.completed} requests to {who} stopped "
                    f"before the {settings.workload.output_len} output tokens asked (ignore_eos "
                    "is set), so it ran a shorter workload than the one judged"
                )
        if base_points is None:
            continue
        base = base_by.get(p.max_concurrency)
        if offline and base is None and p.max_concurrency not in settings.workload.concurrency:
            reasons.append(
                f"{at}: {p.output_throughput:.1f} tok/s, shown, not compared: the baseline's "
                f"run has no concurrency {p.max_concurrency}"
            )
            continue
        decided = True
        usable = base is not None and base.output_throughput > 0
        ratio = round(p.output_throughput / base.output_throughput, 4) if base and usable else None
        # Two runs of different output lengths are not one workload: their ratio is shown,
        # not judged, either way (see `short`).
        unequal = bool(p.short_outputs or (base is not None and base.short_outputs))
        # The engine's own timings took no path to be measured through; but a batch run
        # admits requests as places free, which only an unpaced served run did too.
        paths = _paced(settings) if offline else _across_paths(p, base, backend)
        if paths:
            across.append(f"{at}: {paths}")
        lost = (
            base is not None
            and base.output_throughput > 0
            and base.failed > settings.max_failed_requests
        )
        if lost and base is not None:
            lossy.append(
                f"{at}: {base.failed} of {base.requests} requests to the baseline failed "
                f"({'; '.join(base.errors[:3])}), so its figure counts only those it served"
            )
        shown_only = unequal or paths is not None or lost
        metrics.append(
            Metric(
                name=f"{c}.ratio",
                value=ratio,
                threshold=None if shown_only else settings.min_ratio,
                comparison=None if shown_only else ">=",
            )
        )
        if base is None or not usable:
            why = (
                "has no run"
                if base is None
                else f"produced no tokens ({base.failed} of {base.requests} requests failed)"
            )
            reasons.append(f"{at}: the baseline {why}, so there is no ratio to judge")
            continue
        if none_ok:
            continue
        assert ratio is not None
        holds = "holds" if ratio >= settings.min_ratio else "is below"
        whose = f" (its served load at concurrency {base.max_concurrency})" if offline else ""
        line = (
            f"{at}: {p.output_throughput:.1f} tok/s against {base.output_throughput:.1f}"
            f"{whose}, ratio {ratio:.3f} {holds} {settings.min_ratio:g}"
        )
        if unequal:
            reasons.append(f"{line}, not judged: the outputs were of other lengths")
            continue
        if paths:
            other = "were paced otherwise" if offline else "took other paths"
            reasons.append(f"{line}, not judged: the two runs {other}")
            continue
        if lost:
            reasons.append(f"{line}, not judged: the baseline's own requests failed")
            continue
        (reasons if holds == "holds" else findings).append(line)
    scaling = _scaling(points, prefix, word)
    if scaling is not None:
        metrics.append(scaling[0])
        reasons.append(scaling[1])
    # Why the figures cannot pass, whatever they are: the verdict is at most inconclusive.
    unjudged = short + across + lossy
    if not decided:
        unjudged.append("no baseline and no SLO set: nothing to judge the figures against")
    speculative = [
        who
        for who, run in ((backend, points), ("the baseline", base_points or []))
        if any(p.spec_accept_length is not None or p.spec_accept_from for p in run)
    ]
    served = all(p.completed and p.failed <= settings.max_failed_requests for p in points)
    # A speculative decoder's speed is a property of the text it drafts on: random token ids
    # accept almost nothing, so figures on them say little of the engine either way, and
    # nothing is judged: neither a threshold held nor one broken.
    judged = not (speculative and random_ids and served)
    if not judged:
        # `auto` asks served engines whether they draft; an engine run offline is not asked
        # (a run of its binary to find out costs its load), so only `text` chooses text for it.
        sources = "text" if offline else "auto or text"
        unjudged.insert(
            0,
            f"{' and '.join(speculative)} decode speculatively, and the workload is random "
            f"token ids: set gates.throughput.workload.source to {sources} (or prompts to a "
            "text corpus) to judge speed",
        )
    verdict = decide(metrics if judged else [], findings if judged else [], unjudged)
    return metrics, findings + unjudged + reasons, verdict


def carried(settings: ThroughputSettings, points: list[BenchMetrics]) -> tuple[int, str] | None:
    """The most concurrent requests a run carried, and how it is known: the highest
    concurrency at which no more requests failed than allowed and every SLO set held at its
    percentile (a latency not measured holds none). None where no concurrency did."""
    pct = settings.slo_percentile
    limits = [(stat, getattr(settings, field)) for stat, field in _SLOS]
    limits = [(stat, limit) for stat, limit in limits if limit is not None]
    held = []
    for p in points:
        if p.completed == 0 or p.failed > settings.max_failed_requests:
            continue
        values = [getattr(getattr(p, f"{stat}_ms"), pct) for stat, _ in limits]
        if all(v is not None and v <= limit for v, (_, limit) in zip(values, limits, strict=True)):
            held.append(p.max_concurrency)
    if not held:
        return None
    slos = ", ".join(f"{pct} {stat.upper()} <= {limit:g} ms" for stat, limit in limits)
    how = f"every SLO held ({slos})" if limits else "no SLO set: every request served"
    return max(held), how


def _scaling(points: list[BenchMetrics], prefix: str, word: str) -> tuple[Metric, str] | None:
    """The output tokens a second at the workload's highest concurrency over those at its
    lowest (`scaling`): how much serving requests together pays. A server that takes one
    request at a time stays near 1 however many wait; a roadmap can require it. None where
    fewer than two concurrencies were measured."""
    ran = sorted((p for p in points if p.completed), key=lambda p: p.max_concurrency)
    if len(ran) < 2 or ran[0].max_concurrency == ran[-1].max_concurrency:
        return None
    lo, hi = ran[0], ran[-1]
    value = round(hi.output_throughput / lo.output_throughput, 3) if lo.output_throughput else None
    name = "scaling"
    shown = "not measured" if value is None else f"{value:.2f}x"
    return (
        Metric(name=name, value=value, unit="x"),
        f"{name}: {word} {hi.max_concurrency} delivers {shown} the output tokens a second of "
        f"{word} {lo.max_concurrency} ({prefix}{hi.max_concurrency} over "
        f"{prefix}{lo.max_concurrency})",
    )


def _path_words(path: str | None) -> str:
    # Runs recorded before paths were said went directly: kdctl had no other path then.
    if path is None or path == "direct":
        return "directly"
    return f"through SSH to {path.removeprefix('ssh:')}"


def _across_paths(run: BenchMetrics, base: BenchMetrics | None, backend: str) -> str | None:
    """Why a run and its baseline's took paths that make their ratio no comparison (one
    through an SSH tunnel, which costs throughput and latency of its own, one directly), or
    None where both took the same one."""
    if base is None or _path_words(run.http_path) == _path_words(base.http_path):
        return None
    return (
        f"{backend} was measured {_path_words(run.http_path)} and the baseline "
        f"{_path_words(base.http_path)}: the tunnel's own cost is in one figure only, so the "
        "ratio is shown, not judged (measure both the same way, e.g. http: ssh on both hosts)"
    )


def _paced(settings: ThroughputSettings) -> str | None:
    """Why a batch run and the baseline's served run of a paced workload are no comparison;
    None where the workload sends all at once."""
    rate = settings.workload.request_rate
    if rate is None:
        return None
    return (
        f"the baseline's served run was paced at {rate:g} requests a second, and a batch run "
        "admits requests as places free: the ratio is shown, not judged (unset "
        "workload.request_rate to compare the two)"
    )


def _unmeasured_why(stat: str, offline: bool = False) -> str:
    if offline and stat == "itl":
        return "an engine's timings of a batch carry no gaps between tokens"
    return {
        "ttft": "no request streamed a token",
        "e2el": "no request completed",
    }.get(stat, "no request streamed a second token")
