"""The wheel: one distribution, backends/ and checks/ inside it, data files shipped."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(REPO)],
        check=True,
        capture_output=True,
    )
    (whl,) = out.glob("kdctl-*.whl")
    return whl


def test_wheel_layout(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for expected in (
        "kdctl/cli.py",
        "kdctl/py.typed",
        "kdctl/backends/__init__.py",
        "kdctl/backends/health.py",
        "kdctl/checks/__init__.py",
        "kdctl/roadmap/README.md",
        "kdctl/templates/README.md",
    ):
        assert expected in names, expected
    # Nothing with a generic name at the top of site-packages.
    tops = {n.split("/")[0] for n in names}
    assert tops == {"kdctl", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}
    meta = next(n for n in names if n.endswith("entry_points.txt"))
    assert "kdctl = kdctl.cli:main" in zipfile.ZipFile(wheel).read(meta).decode()
    requires = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA")))
    core = [
        line.split()[1]
        for line in requires.decode().splitlines()
        if line.startswith("Requires-Dist:") and "extra ==" not in line
    ]
    assert {re.split(r"[<>=!~,; ]", c)[0].lower() for c in core} == {
        "typer",
        "rich",
        "pydantic",
        "httpx",
        # httpx's own transport layer and its async runtime, which the SSH tunnel plugs into.
        "httpcore",
        "anyio",
        "aiohttp",
        "orjson",
        "paramiko",
        "jinja2",
        "pyyaml",
        "prometheus-client",
    }


def test_installed_wheel_works_outside_the_checkout(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )
    work = tmp_path / "elsewhere"
    work.mkdir()
    (work / "inventory.yaml").write_text("hosts:\n  here: {transport: local}\n")
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); "
        "import kdctl, kdctl.backends, kdctl.checks; "
        "from importlib.resources import files; "
        "assert kdctl.__file__.startswith(sys.argv[1]), kdctl.__file__; "
        "assert files('kdctl.roadmap').joinpath('README.md').is_file(); "
        "sys.argv = ['kdctl', 'inventory', 'check']; "
        "from kdctl.cli import main; main()"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(target)], cwd=work, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert "inventory.yaml: valid" in proc.stdout
