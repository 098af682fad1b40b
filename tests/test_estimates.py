"""The plan's own estimates: the critical path through the phases not done, kept apart from
forecasts measured from trends, and phases past their due date named."""

from __future__ import annotations

import json
import re
from datetime import date, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import yaml

from kdctl.roadmap._estimate import PhasePlan, critical_path
from tests.conftest import kdctl, write_inventory
from tests.support.sshd import free_port

NOW = datetime(2026, 12, 6, 12, 0, tzinfo=timezone.utc)


def _plan(**phases: tuple[list[str], str | None, datetime | None, bool]) -> dict[str, PhasePlan]:
    return {
        pid: PhasePlan(id=pid, depends_on=deps, estimate=est, eta=eta, done=done)
        for pid, (deps, est, eta, done) in phases.items()
    }


def test_the_longest_branch_sets_the_date() -> None:
    # loader -> tp8 -> server, and loader -> kernels: two branches side by side after loader.
    plans = _plan(
        loader=([], "3d", None, False),
        tp8=(["loader"], "5d", None, False),
        server=(["tp8"], "10d", None, False),
        kernels=(["loader"], "4d", None, False),
    )
    est = critical_path(plans, ["server", "kernels"], NOW)
    assert est.at == NOW + timedelta(days=18)
    assert [(s.phase, s.takes) for s in est.path] == [
        ("loader", "3d"),
        ("tp8", "5d"),
        ("server", "10d"),
    ]
    assert est.detail == (
        "estimate 2026-12-24 (critical path: loader 3d, tp8 5d, server 10d); "
        "no phase on it has a measured trend"
    )


def test_a_forecast_later_than_the_estimate_ends_its_phase() -> None:
    plans = _plan(
        core=([], None, None, True),
        int4=(["core"], "2d", NOW + timedelta(days=9), False),
        marlin=(["int4"], "1d", None, False),
    )
    est = critical_path(plans, ["marlin"], NOW)
    assert est.at == NOW + timedelta(days=10)
    assert est.forecast_on_path == ["int4"]
    assert "int4 forecast 2026-12-15, marlin 1d" in est.detail
    assert "measured trends on the path: int4" in est.detail
    # An earlier forecast does not shorten what the estimate says the work takes.
    plans["int4"] = PhasePlan(id="int4", depends_on=["core"], estimate="2d", eta=NOW, done=False)
    assert critical_path(plans, ["marlin"], NOW).at == NOW + timedelta(days=3)


def test_a_phase_with_neither_estimate_nor_forecast_leaves_no_date() -> None:
    plans = _plan(
        loader=([], "3d", None, False),
        tp8=(["loader"], None, None, False),
        other=([], None, None, False),
    )
    est = critical_path(plans, ["tp8"], NOW)
    assert est.at is None
    # Only a phase on the way is named; `other` is not needed for tp8.
    assert est.detail == "no estimate: tp8 has neither an estimate nor a forecast"


ROADMAP: dict[str, Any] = {
    "title": "Plan",
    "serving": "baseline",
    "candidate": "candidate",
    "phases": [
        {
            "id": "loader",
            "label": "Phase 3",
            "title": "Weight loader",
            "estimate": "3d",
            "owner": "kim",
            "target": "2026-01-05",
            "criteria": [{"gate": "health"}],
        },
        {
            "id": "tp8",
            "title": "TP 8",
            "depends_on": ["loader"],
            "estimate": "5d",
            "criteria": [{"gate": "exactness"}],
        },
        {
            "id": "cutover",
            "title": "Cutover",
            "depends_on": ["tp8"],
            "criteria": [{"name": "soak", "gate": "sign-off"}],
        },
    ],
}


def test_the_answers_carry_the_estimate_and_the_late_phase(tmp_path: Path) -> None:
    (tmp_path / "roadmap.yaml").write_text(yaml.safe_dump(ROADMAP, sort_keys=False))
    inv = write_inventory(
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
    run = kdctl("phases", "-i", str(inv), "--json")
    doc = json.loads(run.out)
    soon = doc["answers"]["cutover"]["soon"]
    at = datetime.fromisoformat(soon["estimate"]["at"])
    assert timedelta(days=7, hours=23) < at - datetime.now(timezone.utc) <= timedelta(days=8)
    assert [s["phase"] for s in soon["estimate"]["path"]] == ["loader", "tp8"]
    loader = next(p for p in doc["phases"] if p["id"] == "loader")
    assert (loader["estimate"], loader["owner"], loader["target"]) == ("3d", "kim", "2026-01-05")
    assert loader["late"] is True and loader["label"] == "Phase 3"
    assert doc["estimate"]["late"] == ["loader"]

    text = kdctl("phases", "-i", str(inv))
    said = " ".join(text.out.split())
    assert re.search(r"soon: estimate \d{4}-\d\d-\d\d by the plan\.", said), said
    assert "Estimate: estimate" in said and "critical path: loader 3d, tp8 5d" in said
    assert "Late: loader (due 2026-01-05, kim)" in said
    assert "Phase 3: Weight loader" in said
    assert date.fromisoformat(loader["target"]) < date.today()
