"""A third-party gate, backend kind and router driver, installed by pip as a separate
distribution, found through the `kdctl.checks`, `kdctl.backends` and `kdctl.routers` entry
points the same way built-ins are, and run through the real CLI against the reference server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Served, kdctl, write_inventory

PLUGIN = '''
"""kdctl-demo-plugin: a health-latency gate, an `sglang-alias` backend kind and a `fixed`
router: a front whose weights cannot change, all traffic to the router's serving backend."""

from datetime import timedelta

from kdctl.backends.sglang import SGLangBackend
from kdctl.checks import Gate, GateResult, Metric, decide, provenance_of, utcnow
from kdctl.traffic import Capabilities, Router, RouterError, RouterState


class FixedRouter(Router):
    kind = "fixed"
    capabilities = Capabilities(weights=False, blue_green=False, read_back=True, drain=False)

    def read(self):
        return RouterState(weights={self.spec.serving: 100}, source="fixed by design")

    def apply(self, weights, *, on_written=None):
        raise RouterError("the fixed router's weights cannot change")


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

[project.entry-points."kdctl.routers"]
fixed = "kdctl_demo_plugin:FixedRouter"
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


def test_an_installed_router_driver_is_read_like_a_built_in(
    plugin_path: Path, reference_server: Served, tmp_path: Path
) -> None:
    """A router kind from another distribution: the inventory names it, status reads its
    weights and asks its front; unknown without the plugin, and nginx's fields refused on it."""
    env = {"PYTHONPATH": os.pathsep.join([str(plugin_path), os.environ.get("PYTHONPATH", "")])}
    port = reference_server.url.rsplit(":", 1)[1]
    router: dict[str, Any] = {
        "kind": "fixed",
        "host": "local",
        "listen": f"127.0.0.1:{port}",  # the engine itself stands as the front
        "serving": "engine",
    }
    data = {
        "hosts": {"local": {"transport": "local"}},
        "backends": {"engine": {"kind": "sglang", "host": "local", "url": reference_server.url}},
        "router": router,
        "state_dir": "state",
    }
    inv = write_inventory(tmp_path / "inventory.yaml", data)
    status = kdctl("status", "-i", str(inv), "--json", env=env)
    doc = json.loads(status.out)
    assert doc["traffic"]["router"] == "fixed" and doc["traffic"]["weights"] == {"engine": 100}
    serving = doc["answers"]["serving"]
    assert (serving["state"], serving["backend"]) == ("serving", "engine"), serving["detail"]
    # The planner reads the weights through the plugged driver too.
    planned = kdctl("cutover", "--to", "engine", "--dry-run", "-i", str(inv), env=env)
    assert planned.code == 2 and "engine already takes all traffic" in planned.err, planned.err

    unknown = kdctl("inventory", "check", "-i", str(inv))
    assert unknown.code == 2
    assert "router.kind: unknown router kind 'fixed' (known: nginx, sglang-router)" in unknown.err
    router["include"] = "/etc/nginx/conf.d/kdctl.conf"
    nginx_only = write_inventory(tmp_path / "nginx-only.yaml", data)
    wrong = kdctl("inventory", "check", "-i", str(nginx_only), env=env)
    assert wrong.code == 2 and "router.include: only an nginx router has 'include'" in wrong.err
