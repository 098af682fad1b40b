"""A third-party gate and backend kind, installed by pip as a separate distribution, found
through the `kdctl.checks` and `kdctl.backends` entry points the same way built-ins are, and
run through the real CLI against the reference server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import Served, kdctl, write_inventory

PLUGIN = '''
"""kdctl-demo-plugin: a health-latency gate and an `sglang-alias` backend kind."""

from datetime import timedelta

from kdctl.backends.sglang import SGLangBackend
from kdctl.checks import Gate, GateResult, Metric, decide, provenance_of, utcnow


class SGLangAlias(SGLangBackend):
    kind = "sglang-alias"


class HealthLatencyGate(Gate):
    name = "demo-health-latency"
    description = "the health route answers within 2 s"
    freshness_window = timedelta(hours=1)

    def run(self, ctx, backend, baseline):
        started = utcnow()
        with ctx.backend(backend) as be:
            health = be.health()
            info = be.info()
        metrics = [
            Metric(name="health_ms", value=health.latency_ms, threshold=2000, comparison="<=")
        ]
        return GateResult(
            gate=self.name,
            backend=backend,
            verdict=decide(metrics),
            metrics=metrics,
            reasons=[f"health {health.state}"],
            provenance=provenance_of(ctx, backend, info, "demo"),
            started_at=started,
            ended_at=utcnow(),
        )
'''

PYPROJECT = """
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "kdctl-demo-plugin"
version = "0.1.0"

[project.entry-points."kdctl.checks"]
demo-health-latency = "kdctl_demo_plugin:HealthLatencyGate"

[project.entry-points."kdctl.backends"]
sglang-alias = "kdctl_demo_plugin:SGLangAlias"
"""


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("plugin-src")
    (src / "pyproject.toml").write_text(PYPROJECT)
    (src / "kdctl_demo_plugin").mkdir()
    (src / "kdctl_demo_plugin" / "__init__.py").write_text(textwrap.dedent(PLUGIN))
    target = tmp_path_factory.mktemp("site")
    # Into a folder of its own, not the shared environment: pip writes the package and its
    # dist-info with the entry points, as it would into site-packages.
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(src)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert pip.returncode == 0, pip.stderr
    assert list(target.glob("kdctl_demo_plugin-0.1.0.dist-info/entry_points.txt"))
    return target


def test_an_installed_gate_and_backend_kind_run_like_built_ins(
    plugin_path: Path, reference_server: Served, tmp_path: Path
) -> None:
    env = {"PYTHONPATH": os.pathsep.join([str(plugin_path), os.environ.get("PYTHONPATH", "")])}
    listed = kdctl("gate", "list", "--json", env=env)
    names = {g["name"] for g in json.loads(listed.out)["gates"]}
    assert "demo-health-latency" in names and "exactness" in names
    # Without the plugin on the path, neither exists.
    assert "demo-health-latency" not in kdctl("gate", "list", "--json").out

    inv = write_inventory(
        tmp_path / "inventory.yaml",
        {
            "hosts": {"local": {"transport": "local"}},
            "backends": {
                "engine": {"kind": "sglang-alias", "host": "local", "url": reference_server.url}
            },
            "state_dir": "state",
        },
    )
    run = kdctl("gate", "run", "demo-health-latency", "-b", "engine", "-i", str(inv), "--json",
                env=env)  # fmt: skip
    assert run.code == 0, run.out + run.err
    (result,) = json.loads(run.out)["results"]
    assert result["verdict"] == "pass" and result["metrics"][0]["value"] > 0
    # The recorded result is bound like a built-in's: to the host that measured it.
    assert result["provenance"]["host_id"]
    unknown = kdctl("inventory", "check", "-i", str(inv))
    assert unknown.code == 2 and "sglang-alias" in unknown.err
