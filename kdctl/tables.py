"""Rich renderings of kdctl's records: what a person reads; `--json` prints the records."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.text import Text

from kdctl.checks import Gate
from kdctl.cutover import CutoverOutcome, Plan
from kdctl.evidence import Imported, age_text
from kdctl.inventory import LoadedInventory
from kdctl.readiness import Answers
from kdctl.recording import PlannedRecording
from kdctl.records import Baseline, GateResult
from kdctl.roadmap import CriterionStatus, Measured, PhaseReport
from kdctl.sandbox import HistoryPoint, SandboxStatus
from kdctl.status import BackendStatus, StatusReport

_STATE_STYLE = {"up": "green", "starting": "yellow", "down": "red", "unknown": "magenta"}


def _state_text(b: BackendStatus) -> Text:
    """Its health, and where its health answers but its generation fails, that too: an
    engine that answers /health and fails every request is not one to send traffic to."""
    if b.state == "up" and b.generates is False:
        return Text("up, not generating", "red")
    return Text(b.state, _STATE_STYLE.get(b.state, ""))


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def _t(value: object) -> Text:
    """Text, never markup: names, models and details come from files and engines."""
    return Text("-" if value is None or value == "" else str(value))


def _table(title: str | Text | None, columns: tuple[str, ...]) -> Table:
    """A table whose cells wrap, and fold a word longer than their column, rather than cut a
    value to an ellipsis: a path or a reason read in half is read wrong."""
    table = Table(title=title, title_justify="left")
    for col in columns:
        table.add_column(col, overflow="fold")
    return table


def _rows_table(
    title: str,
    columns: tuple[str, ...],
    rows: list[dict[str, Text]],
    *,
    wide: bool,
    narrow_drop: tuple[str, ...] = (),
) -> Table:
    """A table of named cells. Unless `wide`: without the `narrow_drop` columns, nor any
    column no row has a value in."""

    def empty(col: str) -> bool:
        return all(r[col].plain in ("", "-") for r in rows)

    shown = (
        columns
        if wide
        else tuple(c for c in columns if c not in narrow_drop and not (rows and empty(c)))
    )
    table = _table(title, shown)
    for r in rows:
        table.add_row(*(r[c] for c in shown))
    return table


def status_tables(report: StatusReport, *, wide: bool = False) -> Group:
    """`wide` adds the columns a terminal of 80 columns has no room for: kind, URL, latency."""
    hosts = _table("Hosts", ("host", "target", "reachable", "RTT", "GPUs", "Xids"))
    for h in report.hosts:
        if not h.reachable:
            hosts.add_row(
                _t(h.name), _t(h.target), Text("no", "red"), "-", Text(h.error or "", "red"), "-"
            )
            continue
        gpus = h.gpus
        if gpus is None or not gpus.visible:
            gpu_text = Text(
                (gpus.error or gpus.note or "") if gpus else "",
                "yellow" if gpus and gpus.error else "",
            )
        else:
            lines = []
            for g in gpus.gpus:
                used, total = (g.memory_used_mib or 0) / 1024, (g.memory_total_mib or 0) / 1024
                mem = f"{used:.1f}/{total:.1f} GiB"
                util = "-" if g.utilization_pct is None else f"{g.utilization_pct:.0f}%"
                lines.append(f"{g.index} {g.name}  {mem}  {util}")
            for p in gpus.processes:
                lines.append(f"  pid {p.pid} {p.process_name} on GPU {p.gpu_index}")
            gpu_text = Text("\n".join(lines))
        xids = h.xids
        if xids is None:
            xid_text = Text("-")
        elif not xids.readable:
            xid_text = Text("unreadable", "yellow")
        elif xids.events:
            xid_text = Text(", ".join(f"Xid {e.code}" for e in xids.events[-5:]), "red")
        else:
            xid_text = Text("none", "green")
        hosts.add_row(
            _t(h.name), _t(h.target), Text("yes", "green"), _ms(h.rtt_ms), gpu_text, xid_text
        )

    cols: tuple[str, ...] = ("backend", "kind", "url", "state", "latency", "model", "version")
    cols = (*cols, "TP", "drafts", "service", "detail")
    rows = []
    for b in report.backends:
        service = "-"
        if b.service:
            service = f"{b.service.state}" + (f" pid {b.service.pid}" if b.service.pid else "")
        rows.append(
            {
                "backend": _t(b.name),
                "kind": _t(b.kind),
                "url": _t(b.url),
                "state": _state_text(b),
                "latency": _t(_ms(b.latency_ms)),
                # What the engine did not say itself is marked as the inventory's word.
                "model": _t(
                    b.model if b.model_reported or not b.model else f"{b.model} (inventory)"
                ),
                "version": _t(b.version),
                "TP": _t(str(b.tp_size) if b.tp_size_reported else f"{b.tp_size} (inventory)"),
                "drafts": _t(_drafts(b)),
                "service": _t(service),
                "detail": Text(b.detail or ""),
            }
        )
    backends = _rows_table(
        "Backends",
        cols,
        rows,
        wide=wide,
        narrow_drop=("kind", "url", "latency"),
    )

    pools = Text()
    for pool in report.pools:
        down = [
            f"{b.name} {_state_text(b)}" + (f" ({b.detail})" if b.detail else "")
            for b in report.backends
            if b.name in pool.replicas and b.name not in pool.up
        ]
        style = "green" if len(pool.up) == len(pool.replicas) else "yellow" if pool.up else "red"
        pools.append(f"Pool {pool.name}: {pool.summary}", style)
        pools.append("".join(f"; {d}" for d in down) + "\n")
    pools.rstrip()

    t = report.traffic
    if t.router:
        split = ", ".join(f"{k} {v}%" for k, v in t.weights.items()) or "nothing"
        traffic = Text(f"Traffic: {t.router} on {t.router_host} ({t.listen}): ")
        if t.detail:
            # Not read back: what it is configured to send is not known, not "nothing".
            traffic.append(f"its weights are not known: {t.detail}")
        else:
            traffic.append(f"configured to send {split} (from {t.source})")
        if t.applied is False:
            traffic.append(f"; WRITTEN, NOT APPLIED: {t.router} runs what it last loaded", "yellow")
        if t.front is not None:
            f = t.front
            said = f"{f.detail}" + (f", from {f.backend}" if f.backend else "")
            traffic.append(
                f"; its front {said}",
                "green" if f.answered else ("red" if f.answered is False else "yellow"),
            )
        if t.draining:
            traffic.append("; DRAINING: new requests get 503", "yellow")
        if t.cutover_in_progress:
            c = t.cutover_in_progress
            what = "paused" if c.get("state") == "paused" else "in progress"
            traffic.append(
                f"\nCutover {what}: {c['id']} {c['strategy']} {c['from']} -> {c['to']}, "
                f"{c['steps_done']}/{c['steps']} steps done "
                + (f"({c['reason']}) " if c.get("state") == "paused" and c.get("reason") else "")
                + "(kdctl cutover --resume, kdctl rollback)",
                "yellow",
            )
            if "boxes" in c:
                traffic.append(f"\nWave {c['wave']} of {c['waves']}:")
                for b in c["boxes"]:
                    since = f" since {b['since'][11:19]}" if b.get("since") else ""
                    engine = b["engine"] or "out of the router"
                    step = f", {b['step']}{since}" if b.get("step") else ""
                    traffic.append(f"\n  {b['host']}: {engine}{step}")
    else:
        traffic = Text("Traffic: no router in the inventory")
    parts: list[Table | Text] = [hosts, backends, *([pools] if report.pools else []), traffic]
    if report.gates:
        verdicts = _table(
            "Latest gate verdicts",
            ("backend", "gate", "baseline", "verdict", "age", "evidence", "still holds"),
        )
        for v in report.gates:
            # A verdict about something no longer there is not shown in its verdict's colour.
            style = _VERDICT_STYLE.get(v.verdict, "") if v.fresh is not False else "yellow"
            holds = "-" if v.fresh is None else "yes" if v.fresh else (v.freshness or "no")
            verdicts.add_row(
                _t(v.backend),
                _t(v.gate),
                _t(v.baseline),
                Text(v.verdict if v.fresh is not False else f"{v.verdict} (stale)", style),
                v.age,
                v.evidence_id[:12],
                _t(holds),
            )
        parts.append(verdicts)
    if report.baselines:
        rows = [
            {
                "backend": _t(c.backend),
                "kind": _t(c.kind),
                "holds": _t(c.holds),
                "workload": _t(c.workload_hash),
                "recorded": _t(f"{c.recorded_at:%Y-%m-%d %H:%M}"),
                "age": _t(c.age),
                "describes it now": Text(
                    "-" if c.current is None else "yes" if c.current else (c.why or "no"),
                    "" if c.current is not False else "yellow",
                ),
            }
            for c in report.baselines
        ]
        cols = ("backend", "kind", "holds", "workload", "recorded", "age", "describes it now")
        parts.append(_rows_table("Recorded baselines", cols, rows, wide=wide))
    if report.answers is not None:
        parts.insert(0, answers_text(report.answers))
    return Group(*parts)


def inventory_summary(inv: LoadedInventory) -> Group:
    hosts = _table(Text(f"{inv.path}: valid"), ("host", "transport", "target", "GPUs", "host keys"))
    for name, h in inv.hosts.items():
        gpus = f"{h.gpus} x {h.gpu_model}" if h.gpus and h.gpu_model else str(h.gpus or "-")
        keys = "-" if h.transport == "local" else f"{h.host_key_policy} ({h.known_hosts})"
        hosts.add_row(_t(name), h.transport, _t(h.target), _t(gpus), _t(keys))
    backends = _table(None, ("backend", "kind", "host", "url", "GPUs", "TP", "service", "API key"))
    for name, b in inv.backends.items():
        service = "-"
        if b.service is not None:
            service = getattr(b.service, "systemd", None) or f"command ({b.service.pidfile})"  # type: ignore[union-attr]
        key = (
            f"${b.api_key_env}"
            if b.api_key_env
            else (str(b.api_key_file) if b.api_key_file else "-")
        )
        gpus = ",".join(map(str, b.gpus)) or "-"
        backends.add_row(
            _t(name), _t(b.kind), _t(b.host), _t(b.url), gpus, str(b.tp_size), _t(service), _t(key)
        )
    parts: list[Table | Text] = [hosts, backends]
    r = inv.spec.router
    if r:
        parts.append(Text(f"router: {r.kind} on {r.host} at {r.listen}, serving {r.serving}"))
    parts.append(Text(f"state dir: {inv.state_dir}"))
    if inv.spec.roadmap:
        parts.append(Text(f"roadmap: {inv.spec.roadmap}"))
    return Group(*parts)


_VERDICT_STYLE = {
    "pass": "green",
    "fail": "red",
    "inconclusive": "yellow",
    "error": "magenta",
    "skipped": "dim",
}


def evidence_table(results: list[GateResult]) -> Table:
    table = _table("Evidence", ("id", "gate", "backend", "baseline", "verdict", "ended", "reasons"))
    for r in results:
        table.add_row(
            r.id[:12],
            _t(r.gate),
            _t(r.backend),
            _t(r.baseline),
            Text(r.verdict, _VERDICT_STYLE.get(r.verdict, "")),
            r.ended_at.strftime("%Y-%m-%d %H:%M:%SZ"),
            Text("; ".join(r.reasons)),
        )
    return table


def evidence_detail(r: GateResult) -> Group:
    head = Text(f"{r.gate} on {r.backend}: ")
    head.append(r.verdict, _VERDICT_STYLE.get(r.verdict, ""))
    if r.baseline:
        head.append(f" (against {r.baseline})")
    metrics = _table("Metrics", ("metric", "value", "threshold", "ok"))
    for m in r.metrics:
        threshold = f"{m.comparison} {m.threshold}" if m.comparison else "-"
        ok = {True: Text("yes", "green"), False: Text("no", "red"), None: Text("-")}[m.passed]
        metrics.add_row(_t(m.name), _t(f"{m.value}{' ' + m.unit if m.unit else ''}"), threshold, ok)
    prov = r.provenance
    lines = [
        f"id {r.id}",
        f"from {r.started_at.isoformat()} to {r.ended_at.isoformat()}",
        f"engine {prov.engine_version or '?'}, model {prov.model_path or '?'} "
        f"(config {prov.config_hash or '?'}), host {prov.host or '?'}, "
        f"GPUs {prov.gpus or '-'}, TP {prov.tp_size or '?'}, kdctl {prov.kdctl_version or '?'}",
        *[f"- {reason}" for reason in r.reasons],
    ]
    return Group(head, Text("\n".join(lines)), metrics)


@contextmanager
def progress_bars(
    console: Console, enabled: bool = True
) -> Iterator[Callable[[str, int, int], None]]:
    """A hook that long steps call with (what, done, total); one bar per `what`, drawn on the
    console while it is a terminal and skipped otherwise (CI logs get the final tables only)."""
    if not enabled or not console.is_terminal:
        yield lambda what, done, total: None
        return
    bars: dict[str, TaskID] = {}
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as progress:

        def hook(what: str, done: int, total: int) -> None:
            if what not in bars:
                bars[what] = progress.add_task(what, total=total)
            progress.update(bars[what], completed=done, total=total)

        yield hook


def recording_plan_lines(backend: str, planned: list[PlannedRecording]) -> list[str]:
    """`baseline record --plan`: each recording, what it sends and how long it may hold the box."""
    out = [f"Recording the baselines of {backend} would run (nothing is sent now):"]
    for p in planned:
        took = f"about {_duration(p.estimate_s)}" if p.estimate_s is not None else "time unknown"
        out.append(
            f"  {p.kind}: {p.what}; {p.requests} requests, {p.output_tokens} output tokens; "
            f"{took} ({p.basis})"
        )
    known = [p.estimate_s for p in planned if p.estimate_s is not None]
    if known and len(known) == sum(p.output_tokens > 0 for p in planned):
        out.append(f"In all: about {_duration(sum(known))} of the engine's time, plus its warm-up.")
    else:
        out.append("In all: not estimated (no recorded rate for every part).")
    return out


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def baseline_line(b: Baseline) -> str:
    """One line per recorded baseline: what it holds, in the figures a person checks first."""
    head = f"recorded {b.kind} baseline {b.id[:12]} from {b.backend}"
    if b.kind == "api":
        answers = b.payload.get("answers", {})
        return f"{head}: answers to {len(answers)} API probes"
    if b.kind == "golden":
        return f"{head}: {len(b.payload.get('outputs', []))} prompts, workload {b.workload_hash}"
    points = ", ".join(
        f"concurrency {p['max_concurrency']}: {p['output_throughput']:.1f} tok/s, "
        f"median TTFT {_ms(p['ttft_ms']['p50'])}, {p['failed']} failed"
        for p in b.payload.get("points", [])
    )
    return f"{head}: {points}; workload {b.workload_hash}"


_PHASE_STYLE = {
    "done": "green",
    "to_reverify": "yellow",
    "in_progress": "yellow",
    "blocked": "red",
    "remaining": "dim",
}
_CRITERION_STYLE = {"pass": "green", "fail": "red", "missing": "yellow", "stale": "magenta"}


def answers_text(answers: Answers) -> Text:
    """The three answers, then every blocker with what would clear it, then the detail the
    three lines leave out."""
    text = Text()
    for i, line in enumerate(answers.lines()):
        text.append(f"{i + 1}. ", "bold")
        text.append(line + "\n")
    why = answers.why_not_now()
    if why:
        text.append("\n" + why[0] + "\n", "bold")
        for line in why[1:]:
            text.append(line + "\n")
    details = answers.details()
    if details:
        text.append("\n")
        for line in details:
            text.append(line + "\n", "dim")
    return text


def _value(m: Measured) -> str:
    if m.value is None:
        return f"{m.metric} unmeasured"
    value = f"{m.value:.4g}" if isinstance(m.value, float) else str(m.value)
    return f"{m.metric} {value}"


def _trend(c: CriterionStatus) -> str:
    """Last values, slope, and the crossing date or why there is none."""
    t = c.trend
    if t is None:
        return "-"
    values = " ".join(f"{p.value:.3g}" for p in t.history[-4:])
    slope = f", {t.slope_per_day:+.3g}/d" if t.slope_per_day is not None else ""
    eta = f", ETA {t.eta:%Y-%m-%d}" if t.eta else f"; {t.reason}"
    regression = f"; REGRESSION: {t.regression}" if t.regression else ""
    return f"{values}{slope}{eta}{regression}"


def _pins(pinned: dict[str, object]) -> str:
    """The settings a criterion pins, compact: nested ones flattened to their leaves."""

    def flat(prefix: str, value: object) -> list[str]:
        if isinstance(value, dict):
            return [x for k, v in value.items() for x in flat(f"{prefix}{k}.", v)]
        if isinstance(value, list):
            value = ",".join(map(str, value))
        return [f"{prefix.rstrip('.')}={value}"] if value is not None else []

    return " ".join(flat("", pinned))


def phases_table(report: PhaseReport, *, wide: bool = False) -> Group:
    """`wide` adds each unmet criterion's pinned settings and trend."""
    head = Text(f"{report.title} ({report.roadmap}); target {report.target}", "bold")
    phase_rows = []
    for p in report.phases:
        done = f"{p.first_done_at:%Y-%m-%d}" if p.first_done_at else "-"
        if p.status == "to_reverify" and p.last_done_at:
            done = f"was done {p.last_done_at:%Y-%m-%d %H:%M}"
        plan = [f"estimate {p.estimate}" if p.estimate else "", p.owner or ""]
        if p.target:
            plan.append(f"due {p.target}" + (" (LATE)" if p.late else ""))
        phase_rows.append(
            {
                "phase": _t(p.id),
                "status": Text(p.status.replace("_", " "), _PHASE_STYLE[p.status]),
                "criteria met": Text(f"{p.met}/{p.total}"),
                "done": Text(done),
                "forecast": _t(p.eta_detail or "-"),
                "plan": Text(", ".join(x for x in plan if x), "red" if p.late else ""),
                "title": _t(f"{p.label}: {p.title}" if p.label else p.title),
            }
        )
    table = _rows_table(
        "Phases",
        ("phase", "status", "criteria met", "done", "forecast", "plan", "title"),
        phase_rows,
        wide=wide,
    )
    cols = ("phase", "criterion", "state", "threshold", "pins", "last measured", "age", "trend")
    rows = []
    for p in report.phases:
        for c in p.criteria:
            if c.met:
                continue
            measured = ", ".join(_value(m) for m in c.values[:4]) or "-"
            age = "-" if c.age_s is None else age_text(timedelta(seconds=c.age_s))
            rows.append(
                {
                    "phase": _t(p.id),
                    "criterion": _t(c.name),
                    "state": Text(c.state, _CRITERION_STYLE[c.state]),
                    "threshold": _t(c.threshold),
                    "pins": _t(_pins(c.pinned)),
                    "last measured": _t(measured),
                    "age": _t(age),
                    "trend": _t(_trend(c)),
                    "why": Text(c.reason),
                }
            )
    unmet = _rows_table(
        "Unmet criteria",
        (*cols, "why"),
        rows,
        wide=wide,
        narrow_drop=("pins", "trend"),
    )
    parts: list[Text | Table] = [head, table, Text(f"pace: {report.pace_detail}")]
    if report.estimate is not None:
        parts.append(Text(f"by the plan's estimates: {report.estimate.detail}"))
    if rows:
        parts.append(unmet)
    for note in report.notes:
        parts.append(Text(f"note: {note}", "yellow"))
    return Group(*parts)


def gate_lines(known: Mapping[str, type[Gate]]) -> list[str]:
    return [
        f"{name:<16} {g.description}{' (needs --baseline)' if g.needs_baseline else ''}"
        for name, g in sorted(known.items())
    ]


def gates_document(known: Mapping[str, type[Gate]]) -> dict[str, Any]:
    return {
        "gates": [
            {
                "name": name,
                "description": g.description,
                "needs_baseline": g.needs_baseline,
                "default_freshness_s": int(g.freshness_window.total_seconds()),
            }
            for name, g in sorted(known.items())
        ]
    }


def plan_lines(plan: Plan) -> list[str]:
    head = f"plan: {plan.strategy} from {plan.from_backend} to {plan.to_backend} ({plan.reason})"
    return [head, *(f"  {i + 1}. {step.describe()}" for i, step in enumerate(plan.steps))]


def outcome_line(outcome: CutoverOutcome) -> str:
    line = f"cutover {outcome.id}: {outcome.state}"
    if outcome.reason:
        line += f": {outcome.reason}"
    if outcome.router is not None:
        line += f"; router now sends {outcome.router.weights}"
    if outcome.downtime_s is not None:
        line += f"; downtime {outcome.downtime_s:.2f}s"
    return line


def imported_line(file: Path, done: Imported) -> str:
    trust = (
        "signed (HMAC verified with KDCTL_EVIDENCE_KEY)"
        if done.signed
        else "unsigned: its digest shows it is intact, not who made it (set KDCTL_EVIDENCE_KEY "
        "on both sides, and evidence.require_signed to refuse such files)"
    )
    return f"{file}: {done.added} record(s) added, {done.already_present} already present; {trust}"


def sandbox_lines(st: SandboxStatus) -> list[str]:
    lines = []
    for p in st.processes:
        state = f"running, pid {p.pid}" if p.running else "stopped"
        lines.append(f"{p.name:<16} {state:<20} {p.url or ''}")
    return [*lines, f"inventory: {st.inventory}"]


def history_lines(points: list[HistoryPoint]) -> list[str]:
    lines = []
    for p in points:
        shown = ", ".join(
            f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
            for k, v in p.metrics.items()
            if k in ("mean_top_logprob_diff", "match_rate", "max_top_logprob_diff")
        )
        back = (p.measured_at - p.dated).days
        when = f"dated {p.dated:%Y-%m-%d} ({back} days back)" if back else "serving now"
        lines.append(f"{p.build:<10} {when:<30} {p.verdict:<5} {shown}")
    return [*lines, f"measured {points[-1].measured_at:%Y-%m-%d %H:%M}Z" if points else "none"]


def _drafts(b: BackendStatus) -> str | None:
    """The engine's own word on speculative decoding: its algorithm and, once it has verified
    drafts, its lifetime tokens per step; nothing where it does not say."""
    if b.speculative is None or b.speculative == "none":
        return b.speculative
    if b.spec_accept_length is None:
        return f"{b.speculative}, nothing verified yet"
    return f"{b.speculative}, {b.spec_accept_length:.2f} tok/step (its own count)"
