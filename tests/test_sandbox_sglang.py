"""The sandbox with SGLang itself as its baseline: recorded from, held to, cut over from and
back to, under load through SGLang's router."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from kdctl.sandbox import FRONT_PORT
from tests.conftest import kdctl, need_module, need_sglang_router
from tests.support.sandbox import sandbox_dir, sandbox_models_of

need_module("torch", "reference")

sandbox_models = pytest.fixture(scope="module", name="sandbox_models")(sandbox_models_of)
OFFSET = 100
FRONT = f"http://127.0.0.1:{FRONT_PORT + OFFSET}"


def test_sandbox_with_sglang_itself_as_baseline_behind_its_router(
    tmp_path: Path, sandbox_models: Path, report: Any
) -> None:
    """`--baseline sglang`: SGLang 0.5.23 itself (its CPU build) serves as baseline on the
    sandbox's K2-configured weights, SGLang's router in front (which has no weights, so the
    cutover is blue-green). The baseline's golden outputs are recorded from SGLang, the
    candidate is held to them and meets strict exactness, and speaks SGLang's API as SGLang
    answered it; it is cut over to and rolled back under a load through the router: every
    request answered; the report then names the baseline serving."""
    from kdctl.sandbox import SGLANG_VERSION, sglang_venv
    from tests.conftest import need_engine
    from tests.support.traffic import Load

    need_sglang_router()
    need_engine(sglang_venv() / "bin" / "python", "scripts/bootstrap-sglang")
    root = sandbox_dir(tmp_path, sandbox_models)
    # Its own ports, so that the demo's sandbox (tests/test_sandbox.py) runs beside it.
    up = kdctl(
        "sandbox", "up", "--dir", str(root), "--router", "sglang-router", "--baseline", "sglang",
        "--port-offset", str(OFFSET), "--json", timeout=900,
    )  # fmt: skip
    try:
        assert up.code == 0, up.out + up.err
        assert json.loads(up.out)["router"] == "sglang-router"
        urls = {p["name"]: p["url"] for p in json.loads(up.out)["processes"]}
        assert urls == {
            "baseline": "http://127.0.0.1:30100",
            "candidate": "http://127.0.0.1:31100",
            "candidate-int4": "http://127.0.0.1:31101",
            "sglang-router": FRONT,
        }, urls
        # A second `up` keeps the ports it runs on; another offset is refused.
        moved = kdctl("sandbox", "up", "--dir", str(root), "--port-offset", "0")
        assert moved.code == 2 and "already runs with --port-offset 100" in moved.err, moved.err
        inv = str(root / "inventory.yaml")
        status = json.loads(kdctl("status", "-i", inv, "--json").out)
        engines = {b["name"]: b for b in status["backends"]}
        assert engines["baseline"]["version"] == SGLANG_VERSION, engines["baseline"]
        # As the demo prints it: the baseline's row names the release SGLang said it is (the
        # reference server in its place says "kdctl-reference").
        shown = kdctl("status", "-i", inv).out
        row = re.search(r"^│ baseline\s+│ up\s+│[^\n]*", shown, re.M)
        assert row and f"│ {SGLANG_VERSION} " in row.group(0), shown
        recorded = kdctl("baseline", "record", "-b", "baseline", "--only", "golden", "-i", inv)
        assert recorded.code == 0, recorded.out + recorded.err
        gate = kdctl(
            "gate", "run", "exactness", "-b", "candidate", "--baseline", "baseline",
            "-i", inv, "--json", timeout=300,
        )  # fmt: skip
        result = json.loads(gate.out)["results"][0]
        # The sandbox's exactness is strict: every prompt token for token.
        assert result["settings"]["mode"] == "strict", result["settings"]
        assert result["verdict"] == "pass", result["reasons"]
        assert "golden outputs recorded" in result["reasons"][0], result["reasons"]
        # Served against SGLang itself, the native engine speaks its API as of its release.
        api = kdctl(
            "gate", "run", "api-conformance", "-b", "candidate", "--baseline", "baseline",
            "-i", inv, "--json", timeout=300,
        )  # fmt: skip
        conformance = json.loads(api.out)["results"][0]
        assert conformance["verdict"] == "pass", conformance["reasons"]
        plan = kdctl("cutover", "--to", "candidate", "--dry-run", "-i", inv)
        assert "plan: blue-green" in plan.out, plan.out + plan.err
        with Load(FRONT) as load:
            run = kdctl(
                "cutover", "--to", "candidate", "--force", "--yes", "-i", inv, "--json",
                timeout=300,
            )  # fmt: skip
        assert run.code == 0, run.out + run.err
        assert json.loads(run.out)["router"]["weights"] == {"candidate": 100}
        assert load.sent > 0 and load.failures == [], load.failures[:5]
        status = kdctl("status", "-i", inv, "--json")
        serving = json.loads(status.out)["answers"]["serving"]
        # SGLang's router names no backend per answer: its one worker, healthy directly.
        assert (serving["state"], serving["answered"], serving["backend"]) == (
            "serving",
            True,
            "candidate",
        )
        # Forced past prerequisites never measured (its throughput, say): done, and what is
        # left is said as what it is, never as results that "no longer hold".
        line3 = re.search(r"^3\. .*$", kdctl("status", "-i", inv).out, re.M)
        assert line3 and "; prerequisites unmet: " in line3.group(0), line3
        assert " never measured." in line3.group(0) and "no longer" not in line3.group(0), line3
        with Load(FRONT) as back_load:
            back = kdctl("rollback", "--yes", "-i", inv, timeout=300)
        assert back.code == 0, back.out + back.err
        assert back_load.failures == [], back_load.failures[:5]
        # The report says so too: the baseline, SGLang, serving again.
        made = kdctl("report", "-f", "markdown,json", "-o", str(tmp_path / "report"), "-i", inv)
        assert made.code in (0, 1), made.out + made.err
        shown = json.loads((tmp_path / "report" / "report.json").read_text())
        assert shown["answers"]["serving"]["backend"] == "baseline", shown["answers"]
    finally:
        down = kdctl("sandbox", "down", "--dir", str(root), "--json")
    assert down.code == 0 and not any(p["running"] for p in json.loads(down.out)["processes"])
    metrics = {m["name"]: m["value"] for m in result["metrics"]}
    report(
        f"sandbox with SGLang {SGLANG_VERSION} itself as baseline: the candidate strict-exact "
        f"against SGLang's golden outputs ({metrics['exact_prompts']:g}/{metrics['prompts']:g} "
        f"prompts, mean top-5 logprob difference {metrics['mean_top_logprob_diff']:.4f}); cut "
        f"over and back under {load.sent + back_load.sent} requests, 0 failed"
    )
