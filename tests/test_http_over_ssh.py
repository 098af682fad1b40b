"""HTTP over SSH: two reference servers and nginx inside a box (a network namespace) whose only
open port is its sshd, as on a GPU box whose HTTP ports are closed to the laptop. Status, every
gate and a cutover reach them through channels of kdctl's one SSH connection to the box; with
`http: direct` the engines are out of reach, said as such, never "down" and never "nothing"."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from kdctl.backends.reference import serve_argv
from tests.conftest import kdctl, need_module, write_inventory
from tests.support.box import Box, make_box
from tests.support.nginx import NGINX, stop_nginx
from tests.support.sshd import PROBE_USER, free_port

need_module("torch", "reference")

ROADMAP = {
    "title": "Through SSH",
    "serving": "baseline",
    "candidate": "candidate",
    "phases": [
        {
            "id": "ready",
            "title": "Healthy and exact",
            "criteria": [{"gate": "health"}, {"gate": "exactness"}],
        },
        {
            "id": "cutover",
            "title": "Cutover",
            "depends_on": ["ready"],
            "criteria": [{"name": "soak", "gate": "sign-off"}],
        },
    ],
}

GATES = {
    "exactness": {"max_new_tokens": 4, "top_k": 3},
    "throughput": {
        "workload": {"input_len": 16, "output_len": 6, "concurrency": [2], "num_prompts": 4},
        # The same model on both sides: only the shared machine's load parts them.
        "min_ratio": 0.05,
    },
}


@dataclass
class Boxed:
    box: Box
    root: Path
    baseline_port: int
    candidate_port: int
    nginx_port: int
    include: Path
    # An address of the box that this machine has no route to (the candidate listens there
    # too): a direct connect fails at once, the box's sshd reaches it.
    hidden: str


def _nginx_conf(root: Path, include: Path) -> Path:
    temp = "\n".join(
        f"  {kind}_temp_path {root / 'tmp' / kind};"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    conf = root / "nginx.conf"
    conf.write_text(
        f"worker_processes 1;\npid {root / 'nginx.pid'};\nerror_log {root / 'error.log'} warn;\n"
        f"events {{ worker_connections 256; }}\nhttp {{\n  access_log off;\n{temp}\n"
        f"  include {include};\n}}\n"
    )
    return conf


@pytest.fixture(scope="module")
def boxed(models: dict[str, Path]) -> Iterator[Boxed]:
    """The box, the two engines on its loopback (the candidate on every address of the box:
    reached directly on its veth address, and only through SSH on one this machine has no
    route to), nginx on its loopback sending all to the baseline, run by the SSH login so
    that kdctl can reload it."""
    if os.geteuid() != 0:
        pytest.skip("a network namespace needs root")
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    root = Path(tempfile.mkdtemp(prefix="kdctl-http-ssh-"))
    root.chmod(0o755)
    box = make_box(root / "box", f"hs{worker}"[:9])
    procs: list[subprocess.Popen[bytes]] = []
    nginx_root = root / "nginx"
    hidden: str | None = None
    try:
        ports = (free_port(), free_port(), free_port())
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        for port, extra in ((ports[0], []), (ports[1], ["--host", "0.0.0.0"])):
            argv = serve_argv(models["dsv3"], port, served_name="tiny") + extra
            procs.append(
                box.popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )
        (nginx_root / "tmp").mkdir(parents=True)
        include = nginx_root / "kdctl.conf"
        hidden = "10.78." + box.address.split(".", 2)[2]
        _run_ok(box.run(["ip", "addr", "add", f"{hidden}/32", "dev", "lo"]))
        _run_ok(subprocess.run(["ip", "route", "replace", "unreachable", f"{hidden}/32"],
                               capture_output=True, text=True))  # fmt: skip
        boxed = Boxed(box, root, ports[0], ports[1], ports[2], include, hidden)
        from kdctl.inventory import load_inventory
        from kdctl.traffic.nginx import NginxRouter
        from kdctl.transports import LocalTransport

        inv = load_inventory(write_inventory(root / "render.yaml", inventory(boxed)))
        assert inv.spec.router is not None
        include.write_text(
            NginxRouter(inv, inv.spec.router, LocalTransport("box")).render({"baseline": 100})
        )
        conf = _nginx_conf(nginx_root, include)
        shutil.chown(nginx_root, PROBE_USER)
        for p in nginx_root.rglob("*"):
            shutil.chown(p, PROBE_USER)
        started = box.run(["runuser", "-u", PROBE_USER, "--", NGINX, "-p", str(nginx_root),
                           "-c", str(conf)])  # fmt: skip
        assert started.returncode == 0, started.stderr
        for port in ports:
            box.wait_listening(port, timeout_s=180)
        # A reference server listens before its warm-up ends, answering 503 until then.
        box.wait_ready(*ports[:2])
        yield boxed
    finally:
        if hidden is not None:
            subprocess.run(["ip", "route", "del", f"{hidden}/32"], capture_output=True)
        stop_nginx(nginx_root / "nginx.pid")
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)
        box.close()
        shutil.rmtree(root, ignore_errors=True)


def _run_ok(done: subprocess.CompletedProcess[str]) -> None:
    assert done.returncode == 0, done.stderr


def inventory(b: Boxed, *, http: str | None = None, router: bool = True, **extra: Any) -> dict:
    host = b.box.host_entry(**({"http": http} if http else {}))
    data: dict[str, Any] = {
        "hosts": {"box": host},
        "backends": {
            "baseline": {
                "kind": "sglang",
                "host": "box",
                "url": f"http://127.0.0.1:{b.baseline_port}",
            },
            "candidate": {
                "kind": "native",
                "mode": "http",
                "host": "box",
                "url": f"http://127.0.0.1:{b.candidate_port}",
            },
        },
        "gates": GATES,
        "state_dir": "state",
        **extra,
    }
    if router:
        nginx_root = b.include.parent
        data["router"] = {
            "kind": "nginx",
            "host": "box",
            "listen": f"127.0.0.1:{b.nginx_port}",
            "serving": "baseline",
            "include": str(b.include),
            "nginx": NGINX,
            "prefix": str(nginx_root),
            "conf": str(nginx_root / "nginx.conf"),
        }
    return data


def status(inv: Path) -> dict[str, Any]:
    run = kdctl("status", "-i", str(inv), "--json")
    assert run.out, run.err
    return dict(json.loads(run.out))


def test_status_through_the_tunnel_names_the_engine_serving(boxed: Boxed, tmp_path: Path) -> None:
    # The engines are on the box's loopback: reached only through its sshd.
    assert boxed.box.run(["true"]).returncode == 0
    auto = write_inventory(tmp_path / "auto.yaml", inventory(boxed))
    doc = status(auto)
    serving = doc["answers"]["serving"]
    assert (serving["state"], serving["backend"]) == ("serving", "baseline"), serving["detail"]
    assert "reached through SSH to box" in serving["detail"]
    assert serving["front"]["reached"] == "reached through SSH to box"
    engines = {e["name"]: e for e in serving["engines"]}
    assert engines["baseline"]["state"] == engines["candidate"]["state"] == "up"
    assert {b["name"]: b["state"] for b in doc["backends"]} == {
        "baseline": "up",
        "candidate": "up",
    }

    # http: ssh, no router: each engine answers on its own URL, through the tunnel.
    ssh = write_inventory(tmp_path / "ssh.yaml", inventory(boxed, http="ssh", router=False))
    serving = status(ssh)["answers"]["serving"]
    assert serving["state"] == "serving", serving
    reached = {e["name"]: (e["state"], e["reached"]) for e in serving["engines"]}
    assert reached == {
        "baseline": ("up", "reached through SSH to box"),
        "candidate": ("up", "reached through SSH to box"),
    }, serving["engines"]
    assert "baseline (reached through SSH to box)" in serving["detail"]
    assert "candidate (reached through SSH to box)" in serving["detail"]
    text = kdctl("status", "-i", str(ssh))
    assert "Serving now:" in text.out and "baseline" in text.out, text.out + text.err

    # auto, on an address of the box with no route from here: the tunnel, saying why.
    data = inventory(boxed, router=False)
    data["backends"]["candidate"]["url"] = f"http://{boxed.hidden}:{boxed.candidate_port}"
    fallback = write_inventory(tmp_path / "fallback.yaml", data)
    serving = status(fallback)["answers"]["serving"]
    engines = {e["name"]: e for e in serving["engines"]}
    assert engines["candidate"]["reached"] == "reached through SSH to box: no direct route"
    assert "candidate (reached through SSH to box: no direct route)" in serving["detail"], serving


def test_direct_is_unknown_and_unreachable_never_down_nor_nothing(
    boxed: Boxed, tmp_path: Path
) -> None:
    inv = write_inventory(tmp_path / "direct.yaml", inventory(boxed, http="direct", router=False))
    doc = status(inv)
    serving = doc["answers"]["serving"]
    assert serving["state"] == "unknown" and serving["answered"] is None, serving
    detail = serving["detail"]
    assert "baseline is unreachable from here: connection refused" in detail, detail
    assert f"a socket listens on 127.0.0.1:{boxed.baseline_port} on box" in detail
    assert "nothing" not in detail and "down" not in detail
    engines = {e["name"]: e for e in serving["engines"]}
    assert engines["baseline"]["unreachable"] and engines["baseline"]["state"] == "unknown"
    # The backend's own row says the same, not "down" nor "starting".
    rows = {b["name"]: b for b in doc["backends"]}
    assert rows["baseline"]["state"] == "unknown", rows["baseline"]
    assert "unreachable from here" in rows["baseline"]["detail"], rows["baseline"]
    text = kdctl("status", "-i", str(inv))
    line = next(x for x in text.out.splitlines() if "Serving now:" in x)
    assert "Serving now: unknown" in line and "unreachable from here" in line, line
    assert "down" not in line and "nothing" not in line, line

    # A router that listens on the box, its port closed to this machine: not "refuses".
    routed = write_inventory(tmp_path / "routed.yaml", inventory(boxed, http="direct"))
    serving = status(routed)["answers"]["serving"]
    assert serving["state"] == "unknown", serving
    # Refused from here, while a socket listens on the box: not known to serve or not.
    assert (serving["front"]["answered"], serving["front"]["failure"]) == (None, "refused")
    assert "unreachable from here: connection refused" in serving["front"]["detail"]


def test_every_gate_and_a_cutover_work_through_it(boxed: Boxed, tmp_path: Path) -> None:
    (tmp_path / "roadmap.yaml").write_text(yaml.safe_dump(ROADMAP, sort_keys=False))
    inv = write_inventory(tmp_path / "inv.yaml", inventory(boxed, roadmap="roadmap.yaml"))
    run = kdctl(
        "gate", "run", "all", "-b", "candidate", "--baseline", "baseline", "-i", str(inv),
        "--json", timeout=300,
    )  # fmt: skip
    results = {r["gate"]: r for r in json.loads(run.out)["results"]}
    verdicts = {g: r["verdict"] for g, r in results.items()}
    for gate in ("health", "exactness", "api-conformance", "throughput"):
        assert verdicts[gate] == "pass", (gate, results[gate]["reasons"])
    throughput = results["throughput"]
    assert throughput["provenance"]["http_path"] == "ssh:box"
    assert throughput["details"]["points"][0]["http_path"] == "ssh:box"
    assert throughput["details"]["baseline_points"][0]["http_path"] == "ssh:box"

    # The path survives an export and an import into another store.
    exported = tmp_path / "evidence.json"
    assert kdctl("evidence", "export", "-o", str(exported), "-i", str(inv)).code == 0
    other = write_inventory(
        tmp_path / "other.yaml", inventory(boxed, state_dir=str(tmp_path / "other"))
    )
    imported = kdctl("evidence", "import", str(exported), "-i", str(other))
    assert imported.code == 0, imported.out + imported.err
    listed = kdctl("evidence", "list", "--gate", "throughput", "-i", str(other), "--json")
    (copy,) = json.loads(listed.out)["results"]
    assert copy["provenance"]["http_path"] == "ssh:box"

    moved = kdctl("cutover", "--to", "candidate", "--strategy", "blue-green", "--yes",
                  "-i", str(inv), "--json", timeout=300)  # fmt: skip
    assert moved.code == 0, moved.out + moved.err
    assert json.loads(moved.out)["router"]["weights"] == {"candidate": 100}
    serving = status(inv)["answers"]["serving"]
    assert (serving["state"], serving["backend"]) == ("serving", "candidate"), serving
    back = kdctl("rollback", "--yes", "-i", str(inv), timeout=300)
    assert back.code == 0, back.out + back.err


def test_a_tunnelled_run_is_not_compared_with_a_direct_one(boxed: Boxed, tmp_path: Path) -> None:
    """The candidate also listens on the box's address: reached directly, while the
    baseline, on the box's loopback, is reached through the tunnel."""
    data = inventory(boxed, router=False)
    data["backends"]["candidate"]["url"] = f"http://{boxed.box.address}:{boxed.candidate_port}"
    # httpx's async client here (its streams over channels), aiohttp's (through the tunnel's
    # socket) in the gate run all above and the recorded run below.
    data["gates"] = {
        **GATES,
        "throughput": {**GATES["throughput"], "baseline_run": "interleaved", "client": "httpx"},
    }
    inv = write_inventory(tmp_path / "mixed.yaml", data)
    run = kdctl("gate", "run", "throughput", "-b", "candidate", "--baseline", "baseline",
                "-i", str(inv), "--json", timeout=300)  # fmt: skip
    (result,) = json.loads(run.out)["results"]
    assert result["verdict"] == "inconclusive", result["reasons"]
    assert result["provenance"]["http_path"] == "direct"
    assert result["details"]["baseline_points"][0]["http_path"] == "ssh:box"
    assert result["details"]["baseline_points"][0]["failed"] == 0
    said = " ".join(result["reasons"])
    assert "candidate was measured directly and the baseline through SSH to box" in said
    ratio = next(m for m in result["metrics"] if m["name"] == "c2.ratio")
    assert ratio["value"] is not None and ratio["threshold"] is None

    # A recorded run through the tunnel, against which the direct candidate is not judged.
    data["gates"] = GATES
    write_inventory(inv, data)
    recorded = kdctl("baseline", "record", "-b", "baseline", "--only", "throughput",
                     "-i", str(inv), timeout=300)  # fmt: skip
    assert recorded.code == 0, recorded.out + recorded.err
    run = kdctl("gate", "run", "throughput", "-b", "candidate", "--baseline", "baseline",
                "-i", str(inv), "--json", timeout=300)  # fmt: skip
    (result,) = json.loads(run.out)["results"]
    assert result["verdict"] == "inconclusive", result["reasons"]
    assert "run recorded" in result["reasons"][0]
    assert "the baseline through SSH to box" in " ".join(result["reasons"])


def test_http_ssh_needs_an_ssh_host(tmp_path: Path) -> None:
    inv = write_inventory(
        tmp_path / "inv.yaml",
        {"hosts": {"here": {"transport": "local", "http": "ssh"}}, "state_dir": "state"},
    )
    run = kdctl("inventory", "check", "-i", str(inv))
    assert run.code == 2, run.out + run.err
    assert "hosts.here.http" in run.err and "needs transport: ssh" in run.err
