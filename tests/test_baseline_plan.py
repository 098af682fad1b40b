"""Recorded baselines as a lead plans them: what recording would run and how long it would hold
the box, printed before anything is sent; their own window; their coverage in status."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

from tests.conftest import Served, kdctl, write_inventory
from tests.support.sshd import free_port

GATES: dict[str, Any] = {
    "throughput": {
        "workload": {"input_len": 16, "output_len": 8, "concurrency": [1, 2], "num_prompts": 4},
        "baseline_run": "recorded",
    },
    "exactness": {"max_new_tokens": 4},
}


def _inventory(tmp_path: Path, url: str, name: str = "inv", **gates: Any) -> Path:
    """An inventory file of its own; every one shares the state directory (the evidence)."""
    return write_inventory(
        tmp_path / f"{name}.yaml",
        {
            "hosts": {"local": {"transport": "local"}},
            "backends": {"baseline": {"kind": "sglang", "host": "local", "url": url}},
            "gates": {**GATES, **gates},
            "state_dir": "state",
        },
    )


def test_the_plan_runs_nothing_and_estimates_from_the_engines_own_rate(
    tmp_path: Path, reference_server: Served
) -> None:
    # The plan is made with the engine's port closed: it cannot have sent anything.
    closed = _inventory(tmp_path, f"http://127.0.0.1:{free_port()}", name="closed")
    plan = kdctl("baseline", "record", "-b", "baseline", "--plan", "-i", str(closed))
    assert plan.code == 0, plan.err
    said = " ".join(plan.out.split())
    assert "nothing is sent now" in said
    assert "random ids: 4 prompts of 16 tokens, 8 out, at concurrency 1, 2" in said
    assert "time unknown (no throughput of baseline recorded yet)" in said
    assert "In all: not estimated" in said

    inv = _inventory(tmp_path, reference_server.url)
    started = time.monotonic()
    recorded = kdctl("baseline", "record", "-b", "baseline", "-i", str(inv))
    took = time.monotonic() - started
    assert recorded.code == 0, recorded.err
    # Through the closed port again: the plan now has this engine's own recorded rates.
    doc = json.loads(
        kdctl("baseline", "record", "-b", "baseline", "--plan", "--json", "-i", str(closed)).out
    )
    by_kind = {p["kind"]: p for p in doc["plan"]}
    assert by_kind["golden"]["estimate_s"] > 0
    assert "median TTFT and TPOT at concurrency 1" in by_kind["golden"]["basis"]
    throughput = [p for p in doc["plan"] if p["kind"] == "throughput"]
    assert len(throughput) == 2 and all(p["estimate_s"] > 0 for p in throughput)
    estimate = sum(p["estimate_s"] or 0 for p in doc["plan"])
    # The estimate leaves out start-up and warm-up: below what the recording took, not absurd.
    assert 0.05 * took < estimate < took, (estimate, took)


def test_a_baseline_window_of_its_own_and_coverage_in_status(
    tmp_path: Path, reference_server: Served
) -> None:
    inv = _inventory(tmp_path, reference_server.url)
    recorded = kdctl("baseline", "record", "-b", "baseline", "--only", "api", "-i", str(inv))
    assert recorded.code == 0, recorded.err
    doc = json.loads(kdctl("status", "-i", str(inv), "--json", "--timeout", "5").out)
    (api,) = doc["baselines"]
    assert (api["kind"], api["current"], api["holds"]) == ("api", True, "answers to 14 API probes")

    # API answers stand as long as what they were measured on runs, unless a window is set.
    short = _inventory(tmp_path, reference_server.url, "short", freshness={"baseline": "1s"})
    time.sleep(1.5)
    doc = json.loads(kdctl("status", "-i", str(short), "--json", "--timeout", "5").out)
    (api,) = doc["baselines"]
    assert api["current"] is False
    assert re.match(r"recorded \d+s ago, past the baseline window of 1s", api["why"]), api
    text = kdctl("status", "-i", str(short), "--timeout", "5")
    assert "Recorded baselines" in text.out and "past the baseline window" in text.out

    # The engine down on a host that cannot be reached: nothing it or its host says now can
    # be held against the record, so it is not said to describe it.
    away = write_inventory(
        tmp_path / "away.yaml",
        {
            "hosts": {
                "box": {
                    "transport": "ssh",
                    "address": "127.0.0.1",
                    "port": free_port(),
                    "user": "root",
                    "connect_timeout_s": 2,
                },
            },
            "backends": {
                "baseline": {"kind": "sglang", "host": "box", "url": "http://127.0.0.1:9"}
            },
            "state_dir": "state",
        },
    )
    doc = json.loads(kdctl("status", "-i", str(away), "--json", "--timeout", "5").out)
    (api,) = doc["baselines"]
    assert api["current"] is False and "nothing now to hold the record to" in api["why"], api
