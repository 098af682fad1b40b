"""The three answers as a lead reads them: each line within 160 characters, the blocker that
matters first, phases to re-verify apart from phases never done, and a status that runs no
command-mode engine. Against kdctl's reference servers on loopback, with results the real gates
record."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from tests.conftest import Served, kdctl, write_inventory
from tests.support.sshd import free_port

ROADMAP: dict[str, Any] = {
    "title": "Answers",
    "serving": "baseline",
    "candidate": "candidate",
    "phases": [
        {"id": "serving", "title": "Serving", "criteria": [{"gate": "health"}]},
        {
            "id": "bench",
            "title": "Kernel benchmark",
            "criteria": [{"gate": "command", "command": "bench"}],
        },
        {"id": "exact", "title": "Exactness", "criteria": [{"gate": "exactness"}]},
        {
            "id": "cutover",
            "title": "Cutover",
            "depends_on": ["serving", "bench", "exact"],
            "criteria": [{"name": "soak", "gate": "sign-off"}],
        },
    ],
}


def _setup(tmp_path: Path, baseline: str, candidate: str, **extra: Any) -> Path:
    (tmp_path / "roadmap.yaml").write_text(yaml.safe_dump(ROADMAP, sort_keys=False))
    # A benchmark that runs and misses its bar: a failure, not a missing result.
    bench = [sys.executable, "-c", "print('{\"speed\": 1}')"]
    data: dict[str, Any] = {
        "hosts": {"local": {"transport": "local"}},
        "backends": {
            "baseline": {"kind": "sglang", "host": "local", "url": baseline},
            "candidate": {"kind": "sglang", "host": "local", "url": candidate},
        },
        "gates": {"commands": {"bench": {"command": bench, "thresholds": {"speed": ">= 2"}}}},
        "roadmap": "roadmap.yaml",
        "state_dir": "state",
    }
    for key, value in extra.items():
        data[key].update(value)
    return write_inventory(tmp_path / "inv.yaml", data)


def _answers(inv: Path, *args: str) -> tuple[list[str], str]:
    """The three numbered lines as printed, and the whole output unwrapped."""
    run = kdctl("status", "-i", str(inv), "--timeout", "5", *args)
    assert run.code == 0, run.out + run.err
    lines = [m.group(0) for m in re.finditer(r"^[123]\. .*$", run.out, re.M)]
    assert len(lines) == 3, run.out
    for line in lines:
        assert len(line) <= 160, line
    return lines, " ".join(run.out.split())


def test_the_blocker_that_matters_comes_first(
    tmp_path: Path, reference_server: Served, twin_server: Served
) -> None:
    inv = _setup(tmp_path, twin_server.url, reference_server.url)
    for gate in ("health", "command"):
        kdctl("gate", "run", gate, "-b", "candidate", "-i", str(inv))

    lines, said = _answers(inv)
    assert lines[0] == (
        "1. Serving now: baseline, candidate on their own URLs; speed: unmeasured."
    ), lines
    assert lines[1] == "2. Phases remaining (3): bench, exact, cutover.", lines
    # A failure outranks what was never measured.
    assert lines[2] == (
        "3. Cut over to candidate now: no; 2 blockers, first: bench/command:bench fails; "
        "soon: no forecast."
    ), lines
    why = said[said.index("Why not now (2):") :]
    assert why.index("bench: command:bench: fail") < why.index("exact: exactness:candidate")
    assert "-> kdctl phases --run --phase bench" in why

    # The health pass expires: its phase was done and is to be measured again, not built.
    roadmap = json.loads(json.dumps(ROADMAP))
    roadmap["phases"][0]["criteria"][0]["freshness"] = "2s"
    (tmp_path / "roadmap.yaml").write_text(yaml.safe_dump(roadmap, sort_keys=False))
    time.sleep(2.5)
    lines, said = _answers(inv)
    assert lines[1] == (
        "2. Phases remaining (3): bench, exact, cutover; to re-verify (1): serving."
    ), lines
    assert re.search(r"To re-verify .*: serving \(was done \d{4}-\d\d-\d\d \d\d:\d\d\)", said)
    # Stale comes after failed, before never measured.
    order = [
        said.index(s)
        for s in ("command:bench: fail", "health:candidate: stale", "exactness:candidate: no")
    ]
    assert order == sorted(order), said
    phases = json.loads(kdctl("phases", "-i", str(inv), "--json").out)
    by_id = {p["id"]: p for p in phases["phases"]}
    assert by_id["serving"]["status"] == "to_reverify"
    assert by_id["serving"]["last_done_at"] is not None
    assert by_id["exact"]["status"] == "remaining"

    # The candidate stops: whatever else is missing, that comes first.
    stopped = _setup(tmp_path, twin_server.url, f"http://127.0.0.1:{free_port()}")
    lines, said = _answers(stopped)
    assert re.match(
        r"3\. Cut over to candidate now: no; \d blockers, first: candidate is not answering; ",
        lines[2],
    ), lines
    assert said.index("candidate is not answering") < said.index("command:bench: fail")


def test_nothing_serving_names_each_engine_briefly(tmp_path: Path) -> None:
    def service(name: str) -> dict[str, Any]:
        return {
            "command": [sys.executable, "-m", "http.server"],
            "pidfile": str(tmp_path / f"{name}.pid"),
            "log": str(tmp_path / f"{name}.log"),
        }

    inv = _setup(
        tmp_path,
        f"http://127.0.0.1:{free_port()}",
        f"http://127.0.0.1:{free_port()}",
    )
    data = yaml.safe_load(inv.read_text())
    for name in ("baseline", "candidate"):
        data["backends"][name]["service"] = service(name)
    write_inventory(inv, data)
    lines, said = _answers(inv)
    assert lines[0] == "1. Serving now: nothing (baseline not started; candidate not started).", (
        lines
    )
    assert "Serving: no router in the inventory, and no engine answers on its own URL" in said


def test_status_runs_no_command_mode_engine_unless_asked(
    tmp_path: Path, reference_server: Served, twin_server: Served
) -> None:
    marker = tmp_path / "ran"
    # An engine's binary that leaves a trace each time it runs.
    engine = tmp_path / "engine.py"
    engine.write_text(f"import pathlib, sys\npathlib.Path({str(marker)!r}).touch()\nsys.exit(3)\n")
    inv = _setup(
        tmp_path,
        twin_server.url,
        reference_server.url,
        backends={
            "native-tiny": {
                "kind": "native",
                "mode": "command",
                "host": "local",
                "command": [sys.executable, str(engine)],
            }
        },
    )
    _answers(inv)
    doc = json.loads(kdctl("status", "-i", str(inv), "--timeout", "5", "--json").out)
    assert not marker.exists(), "status ran the command-mode engine's binary"
    (native,) = (b for b in doc["backends"] if b["name"] == "native-tiny")
    said = native["detail"]
    assert "native-tiny runs in command mode and was not run to ask who it is" in said, said
    assert "kdctl status --deep runs it" in said
    deep = kdctl("status", "-i", str(inv), "--timeout", "5", "--deep")
    assert deep.code == 0, deep.err
    assert marker.exists(), "status --deep did not run the command-mode engine"


def test_tables_fit_80_columns_without_an_ellipsis(
    tmp_path: Path, reference_server: Served, twin_server: Served
) -> None:
    inv = _setup(tmp_path, twin_server.url, reference_server.url)
    kdctl("gate", "run", "command", "-b", "candidate", "-i", str(inv))
    for command in (["status", "--timeout", "5"], ["phases"]):
        for width in ("80", "120"):
            run = kdctl(*command, "-i", str(inv), env={"COLUMNS": width})
            widest = max(len(line) for line in run.out.splitlines())
            assert widest <= int(width), (width, run.out)
            assert "…" not in run.out, run.out
        # Every column, where a terminal has room.
        wide = kdctl(*command, "-i", str(inv), "--wide", env={"COLUMNS": "250"})
        assert ("url" in wide.out) if command[0] == "status" else ("pins" in wide.out)
