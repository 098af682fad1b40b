from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.sshd import SSHD, SshdFleet

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"
H200 = FIXTURES / "nvidia-smi" / "h200-1gpu"
REPLAY_BIN = FIXTURES / "bin"


def _need(binary: str, what: str) -> None:
    if os.path.exists(binary) or shutil.which(binary):
        return
    # CI installs every real part; a skip there would hide a missing install step.
    if os.environ.get("CI"):
        pytest.fail(f"{what} is not installed ({binary}); .ci/run must install it")
    pytest.skip(f"{what} is not installed ({binary})")


@dataclass
class Run:
    code: int
    out: str
    err: str


def kdctl(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> Run:
    """Run the real CLI in a new process, as a user would."""
    full_env = {**os.environ, **(env or {})}
    full_env.setdefault("COLUMNS", "200")
    proc = subprocess.run(
        [sys.executable, "-m", "kdctl", *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd,
        timeout=120,
    )
    return Run(proc.returncode, proc.stdout, proc.stderr)


def write_inventory(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture(scope="session")
def fleet() -> Iterator[SshdFleet]:
    """Three real sshd hosts on loopback: `gpu` replays the H200 capture, the others have none."""
    if os.geteuid() != 0:
        pytest.skip("the sshd fixture runs sshd and adds a login, which needs root")
    _need(SSHD, "OpenSSH's sshd (apt-get install openssh-server)")
    root = Path(tempfile.mkdtemp(prefix="kdctl-sshd-"))
    fleet = SshdFleet(root)
    try:
        fleet.add(
            "gpu",
            env={
                "PATH": f"{REPLAY_BIN}:/usr/local/bin:/usr/bin:/bin",
                "KDCTL_NVSMI_FIXTURES": str(H200),
            },
        )
        fleet.add("plain")
        fleet.add("plain2")
        yield fleet
    finally:
        fleet.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def need_nginx() -> str:
    _need("/usr/sbin/nginx", "nginx (apt-get install nginx)")
    return shutil.which("nginx") or "/usr/sbin/nginx"
