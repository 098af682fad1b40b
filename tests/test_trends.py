""" "Now or soon": trends and forecasts from the evidence history. Histories are carried in by
kdctl's own import path, from exports whose results ended days and weeks ago, as a CI job's
results reach a laptop."""

from __future__ import annotations

import copy
import json
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import yaml

from kdctl.evidence import ENV_URL
from tests.conftest import (
    Served,
    _need,
    engine_pair,
    kdctl,
    local_host_id,
    need_module,
    write_inventory,
)
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


def _setup(
    tmp_path: Path,
    series: list[tuple[float, float, str]],
    *,
    require: str = ">= 1.0",
    weights: list[str] | None = None,
) -> Path:
    """An inventory whose throughput criterion requires `require` of the ratio, and a history
    of throughput results (days ago, ratio, engine version; the checkpoint's fingerprint from
    `weights`, where given) imported through `kdctl evidence import`."""
    from kdctl.checks import gate_settings
    from kdctl.checks.throughput import build_requests
    from kdctl.evidence import SqliteStore, export_evidence
    from kdctl.inventory import load_inventory
    from kdctl.records import GateResult, Metric, Provenance

    roadmap = copy.deepcopy(ROADMAP)
    roadmap["phases"][0]["criteria"][0]["require"] = {"*.ratio": require}
    (tmp_path / "roadmap.yaml").write_text(yaml.safe_dump(roadmap, sort_keys=False))
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
        for i, (days_ago, ratio, version) in enumerate(series):
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
                        weights=weights[i] if weights else None,
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


def test_no_pace_from_phases_done_days_apart(tmp_path: Path) -> None:
    """The ratio reached 1.0 two days ago and the soak is signed off now: two phases done two
    days apart say nothing of phases a week yet."""
    inv = _setup(tmp_path, [(6, 0.9, "b1"), (4, 0.95, "b2"), (2, 1.02, "b3"), (1, 1.05, "b4")])
    signed = kdctl(
        "signoff", "-i", str(inv), "--backend", "candidate", "--by", "Ana", "--note", "ok"
    )
    assert signed.code == 0, signed.err
    doc = json.loads(kdctl("phases", "-i", str(inv), "--json").out)
    assert [p["status"] for p in doc["phases"]] == ["done", "done"]
    assert doc["pace_per_week"] is None
    assert doc["pace_detail"].startswith("too early to tell (2 phases first done within 2.0 days")
    table = " ".join(kdctl("phases", "-i", str(inv)).out.split())
    assert "pace: too early to tell" in table


def test_falling_away_gives_no_date(tmp_path: Path) -> None:
    inv = _setup(tmp_path, [(30, 0.9, "b1"), (20, 0.8, "b2"), (10, 0.7, "b3"), (1, 0.6, "b4")])
    c, answers = _criterion(inv)
    assert (c["trend"]["direction"], c["trend"]["eta"]) == ("away", None)
    assert answers["cutover"]["soon"]["eta"] is None
    assert "moving away" in answers["cutover"]["soon"]["detail"]


def test_a_gate_bar_stricter_than_the_requirement_is_named(tmp_path: Path) -> None:
    """The criterion asks a ratio of 0.5, the gate's own bar held 1.0: the result failed at
    0.7, which the requirement would pass. Not met, and said why, with the way out."""
    inv = _setup(tmp_path, [(1, 0.7, "b1")], require=">= 0.5")
    c, _ = _criterion(inv)
    assert (c["met"], c["state"]) == (False, "fail"), c
    assert [v["ok"] for v in c["values"]] == [True], c["values"]
    assert "the gate's own stricter bar failed (c8.ratio 0.7 is not >= 1)" in c["reason"], c
    # A requirement the value breaks too says nothing of the gate's bar.
    (tmp_path / "both").mkdir()
    inv = _setup(tmp_path / "both", [(1, 0.4, "b1")], require=">= 0.5")
    c, _ = _criterion(inv)
    assert c["state"] == "fail" and "stricter bar" not in c["reason"], c
    # Either way the figure that failed comes first, as answer 3 and a refusal quote it.
    assert c["reason"].split(" ago: ")[1].startswith("c8.ratio 0.4 is not >= 1"), c


def test_no_date_from_points_minutes_apart(tmp_path: Path) -> None:
    """Three runs minutes apart put 1.0 a quarter of an hour away: noise, not a trend."""
    inv = _setup(tmp_path, [(0.003, 0.82, "b1"), (0.002, 0.83, "b1"), (0.001, 0.84, "b1")])
    c, _ = _criterion(inv)
    t = c["trend"]
    # Enough points (three), too short a span: no direction, no date.
    assert (t["direction"], t["points"], t["eta"]) == ("too few points", 3, None), t
    assert "under a day" in t["reason"], t


def test_no_date_from_a_crossing_already_past(tmp_path: Path) -> None:
    """Three results months old whose line crossed weeks ago, nothing newer meeting it: the
    date would be in the past, so there is none."""
    inv = _setup(tmp_path, [(120, 0.5, "b1"), (110, 0.7, "b2"), (100, 0.9, "b3")])
    c, answers = _criterion(inv)
    t = c["trend"]
    # Moving toward the threshold and not there: only a crossing behind now leaves no date.
    assert (t["direction"], t["eta"], c["met"]) == ("toward", None, False), t
    assert t["slope_per_day"] > 0 and t["history"][-1]["value"] < 1.0, t
    assert "before now" in t["reason"], t["reason"]
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


def test_a_series_that_slowed_down_gets_a_date_from_where_it_is(tmp_path: Path) -> None:
    """Weekly 0.40, 0.50, 0.60, 0.70, then 0.75 against >= 0.8: the line through them crossed
    0.8 already, the series has not. From 0.75 at the fitted 0.1 a week it is half a week away,
    a week at the slope interval's slow end (0.05 a week). Each result a new build, the newest
    short of the line but better than the one before: slowing down, not a regression."""
    weekly = [
        (29, 0.40, "b1"),
        (22, 0.50, "b2"),
        (15, 0.60, "b3"),
        (8, 0.70, "b4"),
        (1, 0.75, "b5"),
    ]
    inv = _setup(tmp_path, weekly, require=">= 0.8")
    c, answers = _criterion(inv)
    t = c["trend"]
    newest = datetime.now(timezone.utc) - timedelta(days=1)
    eta = datetime.fromisoformat(t["eta"])
    low, high = (datetime.fromisoformat(x) for x in t["eta_range"])
    for got, days in ((eta, 3.5), (low, 3.5), (high, 7.0)):
        assert abs(got - (newest + timedelta(days=days))) < timedelta(minutes=5), t
    assert t["reason"].endswith("keeps moving +0.01429/day from 0.75"), t["reason"]
    assert t["regression"] is None and answers["regressions"] == []
    assert datetime.fromisoformat(answers["cutover"]["soon"]["eta"]) == eta
    status = " ".join(kdctl("status", "-i", str(inv), "--timeout", "3").out.split())
    assert f"Soon: about {eta:%Y-%m-%d} (range {low:%Y-%m-%d} to {high:%Y-%m-%d})" in status
    assert "Regressions:" not in status


def test_a_step_is_a_regression_only_after_a_change_of_build(tmp_path: Path) -> None:
    """One planted step, 0.92 then 0.71 where the line expects 0.956, under one engine version:
    after new weights (a checkpoint quantized again) it is named with what changed; the same
    build measured again, it is noise and not named."""
    step = [(40, 0.80, "v1"), (30, 0.84, "v1"), (20, 0.88, "v1"), (10, 0.92, "v1"), (1, 0.71, "v1")]
    for name in ("requantized", "same"):
        (tmp_path / name).mkdir()
    old, new = "0a7b5028f8745b4b", "66aa67da6d1a109e"
    requantized = _setup(tmp_path / "requantized", step, weights=[old] * 4 + [new])
    c, answers = _criterion(requantized)
    regression = c["trend"]["regression"]
    assert regression and regression.startswith("0.71 against 0.956 expected"), c["trend"]
    assert regression.endswith("(weights 0a7b5028 -> 66aa67da; engine v1)"), regression
    assert answers["regressions"] == [f"throughput-parity/throughput:candidate: {regression}"]

    same = _setup(tmp_path / "same", step, weights=[old] * 5)
    c, answers = _criterion(same)
    assert c["trend"]["regression"] is None and answers["regressions"] == [], c["trend"]
    status = " ".join(kdctl("status", "-i", str(same), "--timeout", "3").out.split())
    assert "Regressions:" not in status


def test_the_sandbox_int4_builds_slowing_down_are_no_regression() -> None:
    """The INT4 builds `kdctl sandbox history` measures, as measured there: quantization groups
    32, 16, 8 and 4 a week apart, one engine version, each its own weights and settings; mean
    top-logprob differences 0.0435, 0.0366, 0.0303, 0.0266 against <= 0.02. The newest misses
    its line (0.0234) but improves on the build before: no regression, and a forecast from
    0.0266. Had the newest build been worse than the one before, it would be named."""
    from kdctl.records import GateResult, Metric, Provenance
    from kdctl.roadmap._trend import trend_of

    now = datetime.now(timezone.utc)
    builds = [
        (21, 0.043479, "0a7b5028f8745b4b", "ee94d3ba9b9546fd"),
        (14, 0.036618, "352380cf04344484", "c75e03feb9805206"),
        (7, 0.030303, "6b3476f2a01091a8", "5c5553d84f3fb69f"),
        (0, 0.026604, "66aa67da6d1a109e", "1e684662d953a851"),
    ]

    def history(newest: float) -> list[GateResult]:
        measured = [*builds[:-1], (0, newest, *builds[-1][2:])]
        return [
            GateResult(
                gate="exactness",
                backend="candidate-int4",
                verdict="pass",
                metrics=[Metric(name="mean_top_logprob_diff", value=value)],
                provenance=Provenance(
                    engine_version="kdctl-reference 0.1.0",
                    weights=weights,
                    engine_settings=settings,
                    host="local",
                ),
                started_at=now - timedelta(days=days, minutes=1),
                ended_at=now - timedelta(days=days),
            )
            for days, value, weights, settings in reversed(measured)
        ]

    trend = trend_of(history(0.026604), "mean_top_logprob_diff", "<=", 0.02, met=False, now=now)
    assert trend.regression is None, trend
    assert trend.eta is not None and trend.eta_range is not None
    assert timedelta(days=7) < trend.eta - now < timedelta(days=8.5), trend.eta
    worse = trend_of(history(0.034), "mean_top_logprob_diff", "<=", 0.02, met=False, now=now)
    assert worse.regression is not None
    assert worse.regression.endswith(
        "(weights 6b3476f2 -> 66aa67da; engine settings 5c5553d8 -> 1e684662; "
        "engine kdctl-reference 0.1.0)"
    ), worse.regression


# One build measured again and again: a short throughput run (one concurrency, four prompts)
# of the candidate against its twin, the same model served twice, on cores other tests share.
ONE_BUILD_RUNS = 6
ONE_BUILD_GATES = {
    "throughput": {
        "workload": {"input_len": 24, "output_len": 6, "concurrency": [1], "num_prompts": 4},
        "min_ratio": 0.5,
        "baseline_run": "interleaved",
    }
}


def _one_build_inventory(path: Path, reference: Served, twin: Served) -> Path:
    (path.parent / "roadmap.yaml").write_text(yaml.safe_dump(ROADMAP, sort_keys=False))
    return write_inventory(
        path,
        {
            "hosts": {"local": {"transport": "local"}},
            "backends": engine_pair(reference.url, twin.url),
            "gates": ONE_BUILD_GATES,
            "roadmap": "roadmap.yaml",
            "state_dir": "state",
        },
    )


@pytest.fixture(scope="module")
def one_build_measured(
    tmp_path_factory: pytest.TempPathFactory, reference_server: Served, twin_server: Served
) -> Path:
    """ONE_BUILD_RUNS real throughput results of one build, measured here, then dated a day
    apart into the past and exported: what nightly runs of an unchanged engine leave."""
    from kdctl.evidence import SqliteStore, export_evidence, open_store
    from kdctl.inventory import load_inventory

    root = tmp_path_factory.mktemp("one-build")
    inv = _one_build_inventory(root / "inv.yaml", reference_server, twin_server)
    for _ in range(ONE_BUILD_RUNS):
        run = kdctl("gate", "run", "throughput", "-b", "candidate", "-i", str(inv), "--json")
        assert run.code in (0, 1), run.err
    with open_store(load_inventory(inv)) as measured:
        results = sorted(measured.results(gate="throughput"), key=lambda r: r.ended_at)
    assert len(results) == ONE_BUILD_RUNS
    export = root / "nightly.json"
    with SqliteStore(root / "dated.sqlite") as dated:
        for i, r in enumerate(results):
            back = timedelta(days=ONE_BUILD_RUNS - i)
            dated.record(
                r.model_copy(
                    update={"started_at": r.started_at - back, "ended_at": r.ended_at - back}
                )
            )
        export.write_text(export_evidence(dated).model_dump_json())
    return export


def test_one_build_measured_again_and_again_is_never_a_regression(
    tmp_path: Path,
    one_build_measured: Path,
    reference_server: Served,
    twin_server: Served,
    report: Any,
) -> None:
    """Real results of one build scatter (two engines sharing the cores); whichever of them is
    the newest, none is a regression: its build, weights and settings are the ones before it.
    Were it another build, how many would the scatter band alone have named is reported."""
    from kdctl.evidence import open_store
    from kdctl.inventory import load_inventory
    from kdctl.roadmap._trend import TrendPoint, _regression, trend_of

    inv = _one_build_inventory(tmp_path / "inv.yaml", reference_server, twin_server)
    imported = kdctl("evidence", "import", str(one_build_measured), "-i", str(inv))
    assert imported.code == 0, imported.err
    c, answers = _criterion(inv)
    assert c["trend"]["points"] == ONE_BUILD_RUNS and c["trend"]["regression"] is None, c
    assert answers["regressions"] == []
    with open_store(load_inventory(inv)) as store:
        history = store.results(gate="throughput", backend="candidate")
    builds = {
        (r.provenance.engine_version, r.provenance.weights, r.provenance.engine_settings)
        for r in history
    }
    # The rule had a build to compare: one, and known.
    assert len(builds) == 1 and None not in next(iter(builds))
    (name,) = {m.name for r in history for m in r.metrics if m.name.endswith(".ratio")}
    values = [next(m.value for m in r.metrics if m.name == name) for r in history]
    assert len(set(values)) > 1, values  # measured, so it scatters
    outside = 0
    for k in range(4, ONE_BUILD_RUNS + 1):
        trend = trend_of(history[-k:], "*.ratio", ">=", 1.0, met=False, now=history[0].ended_at)
        assert trend.regression is None, trend
        # The same points with the newest relabelled another build: the band alone decides.
        days = [(p.at - trend.history[0].at).total_seconds() / 86400 for p in trend.history]
        relabelled: list[TrendPoint] = [
            *trend.history[:-1],
            trend.history[-1].model_copy(update={"engine_version": "another build"}),
        ]
        outside += _regression(relabelled, days, [p.value for p in relabelled], ">=") is not None
    report(
        f"one build's throughput ratio measured {ONE_BUILD_RUNS} times: "
        f"{', '.join(f'{v:.3f}' for v in reversed(values))}; no regression named; "
        f"{outside} of {ONE_BUILD_RUNS - 3} newest results beyond the scatter band and the "
        "result before them, which only a change of build would have made one"
    )


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
