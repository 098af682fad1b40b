"""A swap: two engines declared on the same GPU, so the old one stops before the new one
starts, through a real nginx on loopback, with reference servers as the engines. The swap
killed at each journal row is tests/test_swap_kills.py, so the two run on separate workers."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from kdctl.backends.reference import serve_argv
from tests.conftest import kdctl, need_module, warm_argv, write_inventory
from tests.support.nginx import kdctl_front, router_entry
from tests.support.sshd import free_port
from tests.support.traffic import ROADMAP, promotion

need_module("torch", "reference")

# The hub token the candidate's service takes from the environment (from_env).
TOKEN = "hf_kdctl_test_9f3a"


@dataclass
class Swap:
    root: Path
    inv: str
    include: Path
    ports: dict[str, int]
    backends: dict[str, dict[str, Any]]

    @property
    def front_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['front']}"

    def url(self, name: str) -> str:
        return str(self.backends[name]["url"])


def _service(root: Path, name: str, model: Path, port: int) -> dict[str, Any]:
    return {
        "command": warm_argv(serve_argv(model, port)),
        "pidfile": str(root / f"{name}.pid"),
        "log": str(root / f"{name}.log"),
    }


@contextmanager
def swap_setup(nginx: str, models: dict[str, Path], root: Path) -> Iterator[Swap]:
    """Engines on one GPU behind nginx, the baseline serving with its golden outputs
    recorded; every process stopped on the way out."""
    from kdctl.backends import make_backend
    from kdctl.inventory import load_inventory
    from kdctl.transports import TransportPool

    ports = {n: free_port() for n in ("baseline", "candidate", "candidate-int4", "leaky", "front")}
    (root / "nginx").mkdir()
    include = root / "nginx" / "kdctl.conf"
    backends: dict[str, dict[str, Any]] = {
        name: {
            "kind": "sglang",
            "host": "local",
            "url": f"http://127.0.0.1:{ports[name]}",
            "gpus": [0],
            "service": _service(root, name, models[key], ports[name]),
        }
        for name, key in (
            ("baseline", "dsv3"),
            ("candidate", "dsv3"),
            ("candidate-int4", "dsv3-int4"),
        )
    }
    backends["candidate"]["service"]["env"] = {"HF_TOKEN": {"from_env": "KDCTL_TEST_HUB_TOKEN"}}
    # An engine whose start script prints its hub token, then dies.
    backends["leaky"] = {
        "kind": "sglang",
        "host": "local",
        "url": f"http://127.0.0.1:{ports['leaky']}",
        "gpus": [0],
        "service": {
            "command": ["sh", "-c", 'echo "loading with HF_TOKEN=$HF_TOKEN"; exit 1'],
            "pidfile": str(root / "leaky.pid"),
            "log": str(root / "leaky.log"),
            "env": {"HF_TOKEN": {"from_env": "KDCTL_TEST_HUB_TOKEN"}},
        },
    }
    (root / "roadmap.yaml").write_text(yaml.safe_dump(ROADMAP, sort_keys=False))
    inv_path = write_inventory(
        root / "inv.yaml",
        {
            "hosts": {"local": {"transport": "local", "gpus": 1}},
            "backends": backends,
            "router": router_entry(nginx, root / "nginx", ports["front"]),
            "gates": {"exactness": {"max_new_tokens": 6, "top_k": 3, "mode": "strict"}},
            "roadmap": "roadmap.yaml",
            "state_dir": "state",
        },
    )
    loaded = load_inventory(inv_path)
    inv = str(inv_path)
    swap = Swap(root, inv, include, ports, backends)
    try:
        with (
            TransportPool(loaded) as pool,
            make_backend("baseline", loaded.backends["baseline"]) as be,
        ):
            control = be.lifecycle(pool.get("local"))
            control.start()
            control.wait_ready(deadline_s=180)
        with kdctl_front(inv_path, {"baseline": 100}):
            golden = kdctl("baseline", "record", "-b", "baseline", "--only", "golden", "-i", inv)
            assert golden.code == 0, golden.err
            yield swap
    finally:
        for name in backends:
            pid = root / f"{name}.pid"
            if pid.exists():
                subprocess.run(["kill", "--", f"-{pid.read_text().strip()}"], check=False)


def test_swap_on_shared_gpus_stops_the_old_engine_first(
    need_nginx: str, models: dict[str, Path], tmp_path: Path
) -> None:
    """The old engine stops before the new one starts. A candidate failing its smoke gate
    (INT4, strict) is stopped and the old one restarted; a hub token the engine prints is
    masked wherever kdctl carries its log."""
    from kdctl.traffic import SqliteJournal

    with swap_setup(need_nginx, models, tmp_path) as swap:
        inv = swap.inv
        plan = kdctl("cutover", "--to", "candidate-int4", "--dry-run", "-i", inv)
        assert "plan: swap" in plan.out and "need the same GPUs" in plan.out
        # Stopped because it shares the baseline's GPU: that alone does not block answer 3;
        # its criteria do, and the report says how it is held.
        phased = json.loads(
            kdctl("phases", "-i", inv, "--candidate", "candidate-int4", "--json").out
        )
        blocking = phased["answers"]["cutover"]["blocking"]
        assert not any("is not answering" in b for b in blocking), blocking
        assert any("exactness" in b for b in blocking), blocking
        held = phased["answers"]["cutover"]["held"]
        assert "candidate-int4 is stopped: it shares GPUs with baseline" in held, held
        forced = ("--force", "--yes", "-i", inv)
        bad = kdctl("cutover", "--to", "candidate-int4", *forced, "--json", timeout=600)
        assert bad.code == 1, bad.out + bad.err
        outcome = json.loads(bad.out)
        assert (
            outcome["state"] == "rolled_back"
            and "smoke gate failed: exactness fail" in outcome["reason"]
        )
        assert outcome["router"]["weights"] == {"baseline": 100}
        assert not (tmp_path / "candidate-int4.pid").exists()
        assert httpx.get(swap.url("baseline") + "/health").status_code == 200

        args = ("cutover", "--to", "candidate", *forced, "--json")
        # The candidate's hub token is missing where kdctl runs: refused before the drain.
        assert "KDCTL_TEST_HUB_TOKEN" not in os.environ
        routed = swap.include.read_text()
        unset = kdctl(*args, timeout=600)
        assert unset.code == 2, unset.out + unset.err
        assert (
            f"{inv}: backends.candidate.service.env.HF_TOKEN: environment variable "
            "KDCTL_TEST_HUB_TOKEN is not set" in unset.err
        )
        assert httpx.get(swap.url("baseline") + "/health").status_code == 200
        assert swap.include.read_text() == routed

        # The engine prints the token into its log and dies: the log tail travels into the
        # error, the promotion evidence and the journal, each with the token masked.
        env = {"KDCTL_TEST_HUB_TOKEN": TOKEN}
        leaked = kdctl("cutover", "--to", "leaky", *forced, env=env, timeout=600)
        assert leaked.code == 1, leaked.out + leaked.err
        assert "loading with HF_TOKEN=***" in leaked.out + leaked.err, leaked.out + leaked.err
        assert TOKEN in (tmp_path / "leaky.log").read_text()  # the engine's own log, untouched
        exported = kdctl("evidence", "export", "-i", inv, env=env)
        assert "HF_TOKEN=***" in exported.out and TOKEN not in exported.out
        for stored in (tmp_path / "state").glob("*.sqlite*"):
            assert TOKEN.encode() not in stored.read_bytes(), stored
        assert httpx.get(swap.url("baseline") + "/health").status_code == 200
        good = kdctl(*args, env=env, timeout=600)
        assert good.code == 0, good.out + good.err
        assert TOKEN not in good.out + good.err
        pid = (tmp_path / "candidate.pid").read_text().strip()
        assert f"HF_TOKEN={TOKEN}" in Path(f"/proc/{pid}/environ").read_text().split("\x00")
        outcome = json.loads(good.out)
        assert outcome["state"] == "succeeded" and outcome["router"]["weights"] == {
            "candidate": 100
        }
        assert 0 < outcome["downtime_s"] < 300
        assert promotion(inv)["downtime_s"] == outcome["downtime_s"]
        assert not (tmp_path / "baseline.pid").exists()
        with SqliteJournal(tmp_path / "state") as journal:
            steps = [(s.kind, s.phase) for s in journal.get(outcome["id"]).steps]  # type: ignore[union-attr]
        assert steps.index(("stop", "done")) < steps.index(("start", "started"))
        assert steps[0] == ("force", "done")
        # The front is open again, on the candidate; signed off as it serves; and back.
        r = httpx.get(swap.front_url + "/health")
        assert r.headers["x-kdctl-backend"] == "candidate"
        signed = kdctl("signoff", "-b", "candidate", "--by", "Ada", "--note", "soak", "-i", inv)
        assert signed.code == 0, signed.err
        assert kdctl("rollback", "--yes", "-i", inv, env=env, timeout=600).code == 0
        assert httpx.get(swap.front_url + "/health").headers["x-kdctl-backend"] == "baseline"

        # Stopped, the candidate is cleared on evidence held to what the inventory declares,
        # a sign-off now among it. Its service now starts it drafting: once it answers, the
        # sign-off given to the engine that did not draft does not hold, and the swap,
        # unforced, rolls back.
        roadmap = yaml.safe_load((tmp_path / "roadmap.yaml").read_text())
        roadmap["phases"][0]["criteria"].append({"name": "signed", "gate": "sign-off"})
        (tmp_path / "roadmap.yaml").write_text(yaml.safe_dump(roadmap, sort_keys=False))
        data = yaml.safe_load(Path(inv).read_text())
        data["backends"]["candidate"]["service"]["command"] += [
            "--draft-model",
            str(models["dsv3-draft"]),
            "--draft-tokens",
            "3",
        ]
        write_inventory(Path(inv), data)
        phased = json.loads(kdctl("phases", "-i", inv, "--json", env=env).out)
        answer = phased["answers"]["cutover"]
        assert answer["can_cut_over"] is True, answer
        assert "candidate is stopped: it shares GPUs with baseline" in answer["held"], answer
        said = " ".join(kdctl("status", "-i", inv, env=env).out.split())
        assert "Cut over to candidate now: yes" in said, said
        assert "the swap judges it again once it answers" in said, said
        again = kdctl("cutover", "--to", "candidate", "--yes", "-i", inv, "--json", env=env)
        assert again.code == 1, again.out + again.err
        outcome = json.loads(again.out)
        assert outcome["state"] == "rolled_back", outcome
        reason = outcome["reason"]
        assert "candidate started, but its evidence does not hold for it" in reason, reason
        assert "ready/signed: stale" in reason and "speculative_algorithm None" in reason, reason
        assert httpx.get(swap.front_url + "/health").headers["x-kdctl-backend"] == "baseline"
