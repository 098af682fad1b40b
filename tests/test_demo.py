"""The README's first command, end to end: the demo's story on the sandbox, its outputs checked."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytest.importorskip("torch")


def test_the_demo_tells_the_whole_story(tmp_path: Path, need_nginx: str) -> None:
    sandbox = tmp_path / "sandbox"
    env = {
        **os.environ,
        "VENV": str(Path(sys.executable).parent.parent),
        "SANDBOX": str(sandbox),
        "COLUMNS": "200",
    }
    run = subprocess.run(
        [str(REPO / "scripts" / "demo")], capture_output=True, text=True, env=env, timeout=900
    )
    out = re.sub(r"\x1b\[[0-9;]*m", "", run.stdout + run.stderr)
    assert run.returncode == 0, out[-3000:]
    # Each command with its exit code, in the story's order.
    steps = re.findall(r"^\$ (kdctl [^\n]*)\n(?:.*?\n)*?\(exit (\d+)\)", out, re.MULTILINE)
    codes = {cmd.split(" --dir")[0].split(" -o")[0]: int(code) for cmd, code in steps}
    assert codes["kdctl cutover --to candidate-int4 --yes"] == 1, out[-3000:]
    assert codes["kdctl cutover --to candidate --watch 5 --yes"] == 0, out[-3000:]
    assert codes["kdctl rollback --yes"] == 0 and codes["kdctl sandbox down"] == 0, out[-3000:]
    assert re.search(
        r"Serving now: baseline through nginx on 127\.0\.0\.1:8000 "
        r"\(answered /generate in \d+ ms\)",
        out,
    )
    assert "speed: the baseline." in out
    assert re.search(
        r"cutover to candidate-int4 refused: exact/exactness:candidate-int4: fail", out
    )
    assert "strict:" in out
    assert re.search(r"cutover \w+: succeeded; router now sends \{'candidate': 100\}", out)
    assert re.search(r"Serving now: candidate through nginx on 127\.0\.0\.1:8000 \(answered", out)
    # A terminal table wraps the long line; the words are what count.
    assert re.search(r"speed: [\d.]+x baseline on\s+throughput:candidate's\s+workload", out)
    # The promotion the cutover recorded ends the last phase; the rollback's reopens it.
    assert "2. Phases remaining: none" in out
    assert re.search(r"promotion:candidate .* fail .* rolled back to", out)
    assert "rolled back: the router sends {'baseline': 100}" in out
    probe = re.search(r"probe load: (\d+) requests, (\d+) failed", out)
    assert probe and int(probe.group(1)) > 0 and probe.group(2) == "0", out[-2000:]
    assert (sandbox / "report" / "report.html").stat().st_size > 1000
    # Nothing it started is left running.
    for pidfile in (sandbox / "run").glob("*.pid"):
        pytest.fail(f"{pidfile} left behind")
    assert not (sandbox / "nginx" / "nginx.pid").exists()
