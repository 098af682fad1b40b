""" "Now or soon": trends and forecasts from the evidence history. Histories are carried in by
kdctl's own import path, from exports whose results ended days and weeks ago, as a CI job's
results reach a laptop."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import yaml

from kdctl.evidence import ENV_URL
from tests.conftest import _need, kdctl, local_host_id, need_module, write_inventory
from tests.support.chromium import CHROMIUM, colours, screenshot
from tests.support.sshd import free_port

need_module("scipy", "test")

ROADMAP = {
    "title": "Trend test",
    "serving": "baseline",
    "candidate": "candidate",
    "phases": [
        {
            "id": "throughput-parity",
            "title": "Throughput parity",
            "criteria": [
                {
                    "gate": "throughput",
                    "require": {"*.ratio": ">= 1.0"},
                }
            ],
        },
        {
            "id": "cutover",
            "title": "Cutover",
            "depends_on": ["throughput-parity"],
            "criteria": [{"name": "soak", "gate": "sign-off"}],
        },
    ],
}


@pytest.fixture(params=["sqlite", "postgres"], autouse=True)
def store(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test here on both stores: SQLite in the state directory, and a PostgreSQL
    database (KDCTL_EVIDENCE_URL, its password in PGPASSWORD)."""
    if request.param == "postgres":
        cluster = request.getfixturevalue("postgres")
        monkeypatch.setenv(ENV_URL, cluster.create_database())
        monkeypatch.setenv("PGPASSWORD", cluster.password)


def _setup(tmp_path: Path, series: list[tuple[float, float, str]]) -> Path:
    """An inventory, and a history of throughput results (days ago, ratio, engine version)
    imported through `kdctl evidence import`."""
    from kdctl.checks._base import gate_settings
    from kdctl.checks.throughput import build_requests
    from kdctl.evidence import SqliteStore, export_evidence
    from kdctl.inventory import load_inventory
    from kdctl.records import GateResult, Metric, Provenance

    (tmp_path / "roadmap.yaml").write_text(yaml.safe_dump(ROADMAP, sort_keys=False))
    inv_path = write_inventory(
        tmp_path / "inv.yaml",
        {
            "hosts": {"local": {"transport": "local"}},
            "backends": {
                name: {"kind": "sglang", "host": "local", "url": f"http://127.0.0.1:{free_port()}"}
                for name in ("baseline", "candidate")
            },
            "roadmap": "roadmap.yaml",
            "state_dir": "state",
        },
    )
    loaded = load_inventory(inv_path)
    settings = gate_settings(loaded, "throughput")
    # The workload a run of the gate sends under these settings, as each of its results records.
    workload = build_requests(loaded, loaded.spec.gates.throughput)[1]
    now = datetime.now(timezone.utc)
    here = local_host_id()
    with SqliteStore(tmp_path / "ci.sqlite") as ci:
        for days_ago, ratio, version in series:
            ended = now - timedelta(days=days_ago)
            ci.record(
                GateResult(
                    gate="throughput",
                    backend="candidate",
                    baseline="baseline",
                    verdict="pass" if ratio >= 1.0 else "fail",
                    metrics=[Metric(name="c8.ratio", value=ratio, threshold=1.0, comparison=">=")],
                    provenance=Provenance(
                        engine_version=version,
                        model_path="tiny",
                        host="local",
                        host_id=here,
                        baseline_host_id=here,
                        workload_hash=workload,
                    ),
                    settings=settings,
                    started_at=ended - timedelta(minutes=5),
                    ended_at=ended,
                )
            )
        export = tmp_path / "ci-evidence.json"
        export.write_text(export_evidence(ci).model_dump_json())
    imported = kdctl("evidence", "import", str(export), "-i", str(inv_path))
    assert imported.code == 0, imported.err
    return inv_path


def _criterion(inv: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    run = kdctl("phases", "-i", str(inv), "--json")
    assert run.code in (0, 1), run.err
    doc = json.loads(run.out)
    return doc["phases"][0]["criteria"][0], doc["answers"]


def test_rising_toward_the_threshold_gives_a_date_with_a_range(tmp_path: Path) -> None:
    # 0.42, 0.55, 0.61, 0.78 over six weeks: about 0.0086 a day, 1.0 some 25 days on.
    inv = _setup(
        tmp_path,
        [(42, 0.42, "b1"), (28, 0.55, "b2"), (14, 0.61, "b3"), (1, 0.78, "b4")],
    )
    c, answers = _criterion(inv)
    t = c["trend"]
    assert (t["points"], t["direction"]) == (4, "toward")
    assert [p["engine_version"] for p in t["history"]] == ["b1", "b2", "b3", "b4"]
    assert {(p["model"], p["host"]) for p in t["history"]} == {("tiny", "local")}
    assert 0.005 < t["slope_per_day"] < 0.015
    eta = datetime.fromisoformat(t["eta"])
    now = datetime.now(timezone.utc)
    assert now + timedelta(days=10) < eta < now + timedelta(days=60), eta
    low, high = (datetime.fromisoformat(x) for x in t["eta_range"])
    assert low <= eta <= high
    soon = answers["cutover"]["soon"]
    assert soon["limited_by"] == "throughput-parity/throughput:candidate"
    assert datetime.fromisoformat(soon["eta"]) == eta
    status = kdctl("status", "-i", str(inv), "--timeout", "3")
    line = " ".join(status.out.split())
    assert f"soon: {eta:%Y-%m-%d} if trends hold" in line, line
    assert f"Soon: about {eta:%Y-%m-%d}" in line, line
    assert "if throughput-parity/throughput:candidate keeps moving +0.00" in line
    phases = " ".join(kdctl("phases", "-i", str(inv), "--wide").out.split())
    assert f"ETA {eta:%Y-%m-%d}" in phases

    # The phase's own forecast is its unmet criteria's latest crossing; a phase with a
    # criterion that has none says which.
    doc = json.loads(kdctl("phases", "-i", str(inv), "--json").out)
    parity, cutover = doc["phases"]
    assert datetime.fromisoformat(parity["eta"]) == eta
    assert parity["eta_detail"] == f"about {eta:%Y-%m-%d}, limited by throughput:candidate"
    assert cutover["eta"] is None
    assert cutover["eta_detail"].startswith("unknown: no forecast for soak")
    assert parity["first_done_at"] is None and doc["pace_per_week"] is None


def test_the_report_charts_the_history_with_its_threshold_versions_and_projection(
    tmp_path: Path,
) -> None:
    inv = _setup(
        tmp_path,
        [(42, 0.42, "b1"), (28, 0.55, "b2"), (14, 0.61, "b2"), (1, 0.78, "b3")],
    )
    out = tmp_path / "report"
    run = kdctl("report", "-i", str(inv), "-o", str(out), "-f", "html,markdown")
    assert run.code == 1, run.err
    html = (out / "report.html").read_text()
    chart = html[html.index('aria-label="history of throughput-parity/throughput:candidate') :]
    chart = chart[: chart.index("</svg>")]
    assert chart.count("<circle") == 4 and chart.count("<polyline") == 1
    # b1 -> b2 and b2 -> b3: two marks where the engine changed, each named.
    assert chart.count('stroke-dasharray="2 3"') == 2 and ">b2<" in chart and ">b3<" in chart
    assert chart.count('stroke-dasharray="6 4"') == 1  # the projection to the crossing
    assert "about 20" in chart and "if *.ratio keeps moving" in chart
    md = (out / "report.md").read_text()
    assert "about 20" in md and "limited by throughput:candidate" in md

    _need(CHROMIUM, "Chromium (apt-get install chromium)")
    shot = tmp_path / "report-history.png"
    drawn = colours(screenshot(out / "report.html", shot, size=(1200, 1400)))
    assert any(abs(r - 59) < 12 and abs(g - 110) < 12 and abs(b - 168) < 12 for r, g, b in drawn)
    assert any(abs(r - 179) < 12 and abs(g - 38) < 12 and abs(b - 30) < 12 for r, g, b in drawn)
    assert any(abs(r - 138) < 12 and abs(g - 127) < 12 and abs(b - 196) < 12 for r, g, b in drawn)


def test_phases_first_done_and_the_pace(tmp_path: Path) -> None:
    # The ratio first reached 1.0 two weeks ago; the soak is signed off now.
    inv = _setup(tmp_path, [(42, 0.9, "b1"), (28, 0.95, "b2"), (14, 1.02, "b3"), (1, 1.05, "b4")])
    signed = kdctl(
        "signoff", "-i", str(inv), "--backend", "candidate", "--by", "Ana", "--note", "ok"
    )
    assert signed.code == 0, signed.err
    doc = json.loads(kdctl("phases", "-i", str(inv), "--json").out)
    now = datetime.now(timezone.utc)
    parity, cutover = doc["phases"]
    assert parity["status"] == cutover["status"] == "done"
    first = datetime.fromisoformat(parity["first_done_at"])
    assert abs(first - (now - timedelta(days=14))) < timedelta(minutes=5)
    assert abs(datetime.fromisoformat(cutover["first_done_at"]) - now) < timedelta(minutes=5)
    assert parity["eta"] is None and parity["eta_detail"] is None
    assert 0.49 < doc["pace_per_week"] < 0.51
    table = " ".join(kdctl("phases", "-i", str(inv)).out.split())
    assert f"{first:%Y-%m-%d}" in table and "pace: 0.5 phases a week (2 done from" in table


def test_falling_away_gives_no_date(tmp_path: Path) -> None:
    inv = _setup(tmp_path, [(30, 0.9, "b1"), (20, 0.8, "b2"), (10, 0.7, "b3"), (1, 0.6, "b4")])
    c, answers = _criterion(inv)
    assert (c["trend"]["direction"], c["trend"]["eta"]) == ("away", None)
    assert answers["cutover"]["soon"]["eta"] is None
    assert "moving away" in answers["cutover"]["soon"]["detail"]


def test_no_date_from_points_minutes_apart(tmp_path: Path) -> None:
    """Three runs minutes apart put 1.0 a quarter of an hour away: noise, not a trend."""
    inv = _setup(tmp_path, [(0.003, 0.82, "b1"), (0.002, 0.83, "b1"), (0.001, 0.84, "b1")])
    c, _ = _criterion(inv)
    assert c["trend"]["eta"] is None and "under a day" in c["trend"]["reason"], c["trend"]


def test_no_date_from_a_crossing_already_past(tmp_path: Path) -> None:
    """Three results months old whose line crossed weeks ago, nothing newer meeting it: the
    date would be in the past, so there is none."""
    inv = _setup(tmp_path, [(120, 0.5, "b1"), (110, 0.7, "b2"), (100, 0.9, "b3")])
    c, answers = _criterion(inv)
    assert c["trend"]["eta"] is None, c["trend"]
    assert "before now" in c["trend"]["reason"], c["trend"]["reason"]
    assert answers["cutover"]["soon"]["eta"] is None


def test_two_points_give_no_date(tmp_path: Path) -> None:
    inv = _setup(tmp_path, [(10, 0.5, "b1"), (1, 0.7, "b2")])
    c, answers = _criterion(inv)
    assert (c["trend"]["direction"], c["trend"]["eta"], c["trend"]["points"]) == (
        "too few points",
        None,
        2,
    )
    assert "too few points (2 results)" in answers["cutover"]["soon"]["detail"]


def test_one_outlier_does_not_flip_the_direction(tmp_path: Path) -> None:
    inv = _setup(
        tmp_path,
        [
            (50, 0.5, "b1"),
            (40, 0.55, "b2"),
            (30, 0.6, "b3"),
            (20, 0.05, "b4"),
            (10, 0.7, "b5"),
            (1, 0.75, "b6"),
        ],
    )
    c, _ = _criterion(inv)
    assert c["trend"]["direction"] == "toward" and c["trend"]["eta"] is not None
    assert 0.004 < c["trend"]["slope_per_day"] < 0.01


def test_a_regression_after_a_new_build_is_flagged(tmp_path: Path) -> None:
    inv = _setup(
        tmp_path,
        [(40, 0.80, "b1"), (30, 0.84, "b2"), (20, 0.88, "b3"), (10, 0.92, "b4"), (1, 0.71, "b5")],
    )
    c, answers = _criterion(inv)
    regression = c["trend"]["regression"]
    assert regression and "(engine b4 -> b5)" in regression, c["trend"]
    assert any("throughput:candidate" in r and "b4 -> b5" in r for r in answers["regressions"])
    status = kdctl("status", "-i", str(inv), "--timeout", "3")
    assert "Regressions: throughput-parity/throughput:candidate" in " ".join(status.out.split())


def test_a_met_criterion_shows_its_trend_without_a_date(tmp_path: Path) -> None:
    inv = _setup(tmp_path, [(30, 0.9, "b1"), (20, 0.95, "b2"), (10, 1.0, "b3"), (1, 1.05, "b4")])
    c, _ = _criterion(inv)
    assert c["met"] is True
    t = c["trend"]
    assert (t["direction"], t["eta"], t["points"]) == ("toward", None, 4)
    assert t["reason"].startswith("met; toward")


def test_a_box_replaced_under_the_same_name_starts_a_new_series() -> None:
    """Three results rising on one machine, then one on another machine that the inventory
    still calls `local`: the newest machine has one point, too few to forecast from."""
    from kdctl.records import GateResult, Metric, Provenance
    from kdctl.roadmap._trend import trend_of

    now = datetime.now(timezone.utc)

    def result(days_ago: float, ratio: float, machine: str) -> GateResult:
        ended = now - timedelta(days=days_ago)
        return GateResult(
            gate="throughput",
            backend="candidate",
            verdict="pass" if ratio >= 1.0 else "fail",
            metrics=[Metric(name="c8.ratio", value=ratio, threshold=1.0, comparison=">=")],
            provenance=Provenance(host="local", host_id=machine),
            started_at=ended,
            ended_at=ended,
        )

    history = [result(1, 0.98, "box-b")] + [
        result(d, r, "box-a") for d, r in ((10, 0.95), (20, 0.9), (30, 0.85))
    ]
    trend = trend_of(history, "*.ratio", ">=", 1.0, met=False, now=now)
    assert trend.direction == "too few points" and trend.eta is None, trend
    assert len(trend.history) == 4  # all drawn, one series fitted


@pytest.mark.parametrize("seed", range(6))
def test_theil_sen_is_scipys(seed: int) -> None:
    """kdctl's Theil-Sen (slope, intercept and the slope's 95% interval) against scipy's
    `theilslopes`, on series with noise, outliers and ties in both x and y."""
    import random

    from scipy.stats import theilslopes

    from kdctl.roadmap._theilsen import theil_sen

    rng = random.Random(seed)
    n = rng.randint(3, 30)
    x = [float(rng.randint(0, 12)) if seed % 2 else rng.uniform(0, 40) for _ in range(n)]
    x[0], x[1] = 0.0, 1.0  # two different x at least
    y = [0.01 * xi + rng.gauss(0, 0.05) for xi in x]
    if seed % 3 == 0:
        y[rng.randrange(n)] = 5.0  # an outlier
        y[-1] = y[-2]  # a tie in y
    ours = theil_sen(y, x)
    theirs = theilslopes(y, x)
    assert ours.slope == pytest.approx(theirs.slope, abs=1e-12)
    assert ours.intercept == pytest.approx(theirs.intercept, abs=1e-12)
    assert ours.low_slope == pytest.approx(theirs.low_slope, abs=1e-12)
    assert ours.high_slope == pytest.approx(theirs.high_slope, abs=1e-12)
