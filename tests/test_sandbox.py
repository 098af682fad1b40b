"""The sandbox: up, reused by a second up, status, down leaving no process behind."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import kdctl, need_sglang_router

pytest.importorskip("torch")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sandbox_up_reuse_and_down(tmp_path: Path, need_nginx: str) -> None:
    root = tmp_path / "sandbox"
    first = kdctl("sandbox", "up", "--dir", str(root), "--json", timeout=600)
    assert first.code == 0, first.out + first.err
    doc = json.loads(first.out)
    assert doc["up"] and doc["router"] == "nginx"
    pids = {p["name"]: p["pid"] for p in doc["processes"]}
    assert set(pids) == {"baseline", "candidate", "candidate-int4", "nginx"}
    try:
        again = kdctl("sandbox", "up", "--dir", str(root), "--json", timeout=600)
        assert again.code == 0, again.err
        assert {p["name"]: p["pid"] for p in json.loads(again.out)["processes"]} == pids
        inv = str(root / "inventory.yaml")
        status = kdctl("status", "-i", inv, "--json")
        backends = {b["name"]: b["state"] for b in json.loads(status.out)["backends"]}
        assert backends == {"baseline": "up", "candidate": "up", "candidate-int4": "up"}
        assert json.loads(status.out)["traffic"]["weights"] == {"baseline": 100}
        serving = json.loads(status.out)["answers"]["serving"]
        assert (serving["state"], serving["backend"]) == ("serving", "baseline")
    finally:
        down = kdctl("sandbox", "down", "--dir", str(root), "--json")
    assert down.code == 0, down.err
    assert not any(p["running"] for p in json.loads(down.out)["processes"])
    assert not any(_alive(pid) for pid in pids.values())
    assert kdctl("sandbox", "status", "--dir", str(root)).code == 1


def test_sandbox_with_sglang_router_cuts_over_blue_green(tmp_path: Path) -> None:
    """Where nginx is missing the sandbox fronts its engines with SGLang's router, which has no
    weights: the same cutover becomes blue-green."""
    need_sglang_router()
    root = tmp_path / "sandbox"
    up = kdctl(
        "sandbox", "up", "--dir", str(root), "--router", "sglang-router", "--json", timeout=600
    )
    try:
        assert up.code == 0, up.out + up.err
        assert json.loads(up.out)["router"] == "sglang-router"
        inv = str(root / "inventory.yaml")
        plan = kdctl("cutover", "--to", "candidate", "--dry-run", "-i", inv)
        assert "plan: blue-green" in plan.out, plan.out + plan.err
        run = kdctl(
            "cutover", "--to", "candidate", "--force", "--yes", "-i", inv, "--json", timeout=300
        )
        assert run.code == 0, run.out + run.err
        assert json.loads(run.out)["router"]["weights"] == {"candidate": 100}
        status = kdctl("status", "-i", inv, "--json")
        serving = json.loads(status.out)["answers"]["serving"]
        # SGLang's router names no backend per answer: its one worker, healthy directly.
        assert (serving["state"], serving["answered"], serving["backend"]) == (
            "serving",
            True,
            "candidate",
        )
        assert serving["routed"]["weights"] == {"candidate": 100}
    finally:
        down = kdctl("sandbox", "down", "--dir", str(root), "--json")
    assert down.code == 0 and not any(p["running"] for p in json.loads(down.out)["processes"])
