"""`kdctl report`: the readiness report for CI in Markdown, self-contained HTML (charts as inline
SVG), JUnit XML and JSON, rendered from the templates in `templates/` with autoescape on, so a
name or prompt holding markup reaches the page as text."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from itertools import pairwise
from pathlib import Path
from typing import Any, Literal

from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape

from kdctl import __version__
from kdctl.errors import InputError
from kdctl.evidence import EvidenceStore
from kdctl.inventory.models import parse_threshold
from kdctl.readiness import Readiness
from kdctl.records import GateResult, utcnow
from kdctl.roadmap import CriterionStatus, PhaseReport

Format = Literal["markdown", "html", "junit", "json"]
FORMATS: dict[str, str] = {
    "markdown": "report.md",
    "html": "report.html",
    "junit": "report.junit.xml",
    "json": "report.json",
}


@dataclass(frozen=True)
class Bar:
    label: str
    value: float
    # Fractions of the chart's width, worked out here so templates only place shapes.
    width: float
    series: str


@dataclass(frozen=True)
class BarChart:
    title: str
    unit: str
    bars: list[Bar]


@dataclass(frozen=True)
class DivergenceRow:
    prompt: str
    matched: int
    total: int
    diverged_at: int | None
    ok: bool


@dataclass(frozen=True)
class DivergenceChart:
    title: str
    tokens: int
    rows: list[DivergenceRow]


@dataclass(frozen=True)
class HistoryPoint:
    x: float
    y: float
    label: str


@dataclass(frozen=True)
class VersionMark:
    x: float
    version: str


@dataclass(frozen=True)
class HistoryChart:
    """One criterion's results over time in a W x H box: the threshold as a line, a mark
    where the engine version changed, the projection dashed to the forecast crossing."""

    title: str
    reason: str
    points: list[HistoryPoint]
    threshold_y: float
    versions: list[VersionMark]
    # (x1, y1, x2, y2) from the newest point to the crossing, when there is a forecast.
    projection: tuple[float, float, float, float] | None
    x_labels: tuple[str, str]
    y_labels: tuple[str, str]
    regression: str | None

    @property
    def polyline(self) -> str:
        return " ".join(f"{p.x},{p.y}" for p in self.points)


# The plot area of a history chart, in SVG units.
HISTORY_BOX = (48.0, 28.0, 500.0, 188.0)


@dataclass
class Charts:
    throughput: list[BarChart] = field(default_factory=list)
    exactness: list[DivergenceChart] = field(default_factory=list)
    history: list[HistoryChart] = field(default_factory=list)


def parse_formats(text: str) -> list[Format]:
    chosen = [f.strip() for f in text.split(",") if f.strip()]
    unknown = [f for f in chosen if f not in FORMATS]
    if unknown or not chosen:
        raise InputError(
            f"--format: {', '.join(unknown) or repr(text)} is not one of {', '.join(FORMATS)}"
        )
    return list(dict.fromkeys(chosen))  # type: ignore[arg-type]


def _bar_chart(title: str, unit: str, rows: list[tuple[str, str, float]]) -> BarChart:
    top = max((v for _, _, v in rows), default=0.0) or 1.0
    return BarChart(
        title=title,
        unit=unit,
        bars=[Bar(label=label, value=v, width=v / top, series=s) for label, s, v in rows],
    )


def _throughput_charts(result: GateResult) -> list[BarChart]:
    cand = {p["max_concurrency"]: p for p in result.details.get("points", [])}
    base = {p["max_concurrency"]: p for p in result.details.get("baseline_points", [])}
    who = {"candidate": result.backend, "baseline": result.baseline or "baseline"}
    charts = []
    # (title, unit, the field of a BenchMetrics record, and its statistic where it has one)
    shown: tuple[tuple[str, str, str, str | None], ...] = (
        ("Output token throughput", "tok/s", "output_throughput", None),
        ("Median TTFT", "ms", "ttft_ms", "p50"),
        ("Median ITL", "ms", "itl_ms", "p50"),
    )
    for title, unit, key, stat in shown:
        rows: list[tuple[str, str, float]] = []
        for conc in sorted(cand):
            for series, points in (("candidate", cand), ("baseline", base)):
                point = points.get(conc)
                value = None
                if point:
                    value = point[key][stat] if stat else point[key]
                if value is not None:
                    rows.append((f"c{conc} {who[series]}", series, float(value)))
        if rows:
            charts.append(
                _bar_chart(f"{title}: {who['candidate']} against {who['baseline']}", unit, rows)
            )
    return charts


def _exactness_chart(result: GateResult) -> DivergenceChart | None:
    prompts = result.details.get("prompts", [])
    if not prompts:
        return None
    total = max(1, *(int(p.get("tokens") or 0) for p in prompts))
    rows = [
        DivergenceRow(
            prompt=str(p.get("id")),
            matched=int(p.get("matched_tokens") or 0),
            total=int(p.get("tokens") or 0),
            diverged_at=p.get("first_divergence"),
            ok=bool(p.get("ok")),
        )
        for p in prompts
    ]
    mode = result.details.get("mode", "")
    return DivergenceChart(
        title=f"Exactness ({mode}): {result.backend} against {result.baseline}",
        tokens=total,
        rows=rows,
    )


def _history_chart(c: CriterionStatus) -> HistoryChart | None:
    t = c.trend
    if t is None or len(t.history) < 2 or t.threshold is None:
        return None
    op, limit = parse_threshold(t.threshold)
    start = t.history[0].at
    end = t.eta if t.eta is not None else t.history[-1].at
    span = max((end - start).total_seconds(), 1.0)
    values = [p.value for p in t.history]
    low, high = min(*values, limit), max(*values, limit)
    pad = (high - low) * 0.1 or abs(high) * 0.1 or 1.0
    low, high = low - pad, high + pad
    left, top, right, bottom = HISTORY_BOX

    def x(at: datetime) -> float:
        return round(left + (right - left) * (at - start).total_seconds() / span, 1)

    def y(value: float) -> float:
        return round(bottom - (bottom - top) * (value - low) / (high - low), 1)

    points = [
        HistoryPoint(x(p.at), y(p.value), f"{p.at:%Y-%m-%d} {p.value:.4g}") for p in t.history
    ]
    versions = [
        VersionMark(x(p.at), p.engine_version or "?")
        for prev, p in pairwise(t.history)
        if p.engine_version != prev.engine_version
    ]
    projection = None
    if t.eta is not None:
        newest = points[-1]
        projection = (newest.x, newest.y, x(t.eta), y(limit))
    return HistoryChart(
        title=f"{c.phase}/{c.name}: {t.metric} {op} {limit:g}",
        reason=t.reason,
        points=points,
        threshold_y=y(limit),
        versions=versions,
        projection=projection,
        x_labels=(f"{start:%Y-%m-%d}", f"{end:%Y-%m-%d}"),
        y_labels=(f"{low:.3g}", f"{high:.3g}"),
        regression=t.regression,
    )


def collect_charts(store: EvidenceStore, phases: PhaseReport | None) -> Charts:
    """Charts from the evidence each criterion was judged by, newest first, one per result."""
    charts = Charts()
    if phases is None:
        return charts
    seen: set[str] = set()
    for phase in phases.phases:
        for c in phase.criteria:
            history = _history_chart(c)
            if history is not None:
                charts.history.append(history)
            if c.evidence_id is None or c.evidence_id in seen:
                continue
            seen.add(c.evidence_id)
            result = store.get(c.evidence_id)
            if result is None:
                continue
            if c.gate == "throughput":
                charts.throughput += _throughput_charts(result)
            elif c.gate == "exactness":
                chart = _exactness_chart(result)
                if chart is not None:
                    charts.exactness.append(chart)
    return charts


def _environment() -> Environment:
    return Environment(
        loader=PackageLoader("kdctl.templates", ""),
        # Every format is escaped for what it is: HTML and XML by jinja2, Markdown by its
        # `md` filter, which every value in that template goes through.
        autoescape=select_autoescape(("html.j2", "xml.j2"), default_for_string=True),
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )


def _md(value: Any) -> str:
    """Markdown table cells as text: a pipe or newline would break the row, and markup or
    HTML from a name or prompt must show as written, not render."""
    text = str(value).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    for ch in ("\\", "|", "`", "*", "_", "[", "]"):
        text = text.replace(ch, "\\" + ch)
    return " ".join(text.split())


def render_reports(
    readiness: Readiness,
    store: EvidenceStore,
    formats: list[Format],
    out_dir: Path,
    *,
    inventory: str,
    now: datetime | None = None,
    in_progress: dict[str, Any] | None = None,
) -> list[Path]:
    """Write each chosen format into `out_dir`; each file is written whole, then renamed.
    `in_progress`: the journal's unfinished cutover (`cutover_in_progress`), a rolling one's
    boxes with it."""
    now = now or utcnow()
    phases = readiness.phases
    doc: dict[str, Any] = {
        "generated_at": now.isoformat(),
        "kdctl_version": __version__,
        "inventory": inventory,
        "answers": readiness.answers.model_dump(mode="json"),
        "phases": phases.model_dump(mode="json") if phases else None,
        "cutover_in_progress": in_progress,
    }
    context = {
        "doc": doc,
        "answers": readiness.answers,
        "lines": readiness.answers.lines(),
        "why": readiness.answers.why_not_now(),
        "details": readiness.answers.details(),
        "phases": phases,
        "in_progress": in_progress,
        "charts": collect_charts(store, phases),
        "generated_at": now.strftime("%Y-%m-%d %H:%M:%SZ"),
        "version": __version__,
        "inventory": inventory,
    }
    env = _environment()
    env.filters["md"] = _md
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"{out_dir}: cannot create the report folder: {exc.strerror}") from None
    written = []
    for fmt in formats:
        name = FORMATS[fmt]
        if fmt == "json":
            text = json.dumps(doc, indent=2) + "\n"
        else:
            text = env.get_template(f"{name}.j2").render(**context)
        target = out_dir / name
        tmp = target.with_name(f".{name}.tmp")
        try:
            tmp.write_text(text, encoding="utf-8")
            tmp.replace(target)
        except OSError as exc:
            raise InputError(f"{target}: cannot write: {exc.strerror}") from None
        written.append(target)
    return written
