"""`kdctl status` end to end: real sshd hosts, real nginx answering as engines' /health."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kdctl.transports import fan_out
from tests.conftest import kdctl, write_inventory
from tests.support.nginx import start_nginx, stop_nginx
from tests.support.sshd import SshdFleet, free_port

API_KEY = "right-key-9f3a"


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory, need_nginx: str) -> Iterator[dict[str, int]]:
    """nginx servers answering /health the way engines do: 200, 503 while loading, 401."""
    ports = {"up": free_port(), "starting": free_port(), "auth": free_port()}
    servers = f"""
  server {{ listen 127.0.0.1:{ports["up"]}; location = /health {{ return 200; }} }}
  server {{ listen 127.0.0.1:{ports["starting"]}; location = /health {{ return 503; }} }}
  server {{
    listen 127.0.0.1:{ports["auth"]};
    location = /health {{
      if ($http_authorization != "Bearer {API_KEY}") {{ return 401; }}
      return 200;
    }}
  }}
"""
    pidfile = start_nginx(tmp_path_factory.mktemp("nginx"), servers, list(ports.values()))
    yield ports
    stop_nginx(pidfile)


def test_status_over_ssh(fleet: SshdFleet, engines: dict[str, int], tmp_path: Path) -> None:
    # The probe's login is not root: the pidfile lies where that user can read it.
    run_dir = Path(tempfile.mkdtemp(prefix="kdctl-run-"))
    run_dir.chmod(0o755)
    pidfile = run_dir / "engine.pid"
    engine = subprocess.Popen(["sleep", "300"])
    pidfile.write_text(str(engine.pid))
    try:
        inv = write_inventory(
            tmp_path / "inv.yaml",
            {
                "hosts": {
                    "gpu": fleet.host_entry("gpu", gpus=1, gpu_model="NVIDIA H200"),
                    "plain": fleet.host_entry("plain"),
                },
                "backends": {
                    "sglang": {
                        "kind": "sglang",
                        "host": "gpu",
                        "url": f"http://127.0.0.1:{engines['up']}",
                        "gpus": [0],
                        "model": "tiny",
                        "service": {
                            "command": "sleep 300",
                            "pidfile": str(pidfile),
                            "log": str(tmp_path / "log"),
                        },
                    },
                    "native": {
                        "kind": "native",
                        "host": "plain",
                        "url": f"http://127.0.0.1:{engines['starting']}",
                    },
                    "vllm": {
                        "kind": "openai",
                        "host": "plain",
                        "url": f"http://127.0.0.1:{engines['auth']}",
                        "api_key_env": "KDCTL_TEST_KEY",
                    },
                    "gone": {
                        "kind": "sglang",
                        "host": "plain",
                        "url": f"http://127.0.0.1:{free_port()}",
                    },
                },
                "router": {
                    "kind": "nginx",
                    "host": "gpu",
                    "listen": f"127.0.0.1:{free_port()}",
                    "serving": "sglang",
                },
            },
        )
        run = kdctl("status", "-i", str(inv), "--json", env={"KDCTL_TEST_KEY": API_KEY})
        assert run.code == 0, run.err
        doc = json.loads(run.out)
        assert set(doc) >= {"hosts", "backends", "traffic"}
        hosts = {h["name"]: h for h in doc["hosts"]}
        gpu = hosts["gpu"]
        assert gpu["reachable"] and gpu["rtt_ms"] > 0
        assert [g["name"] for g in gpu["gpus"]["gpus"]] == ["NVIDIA H200"]
        assert gpu["gpus"]["gpus"][0]["memory_total_mib"] == 143771
        assert gpu["xids"]["readable"] and gpu["xids"]["events"] == []
        assert hosts["plain"]["gpus"]["note"] == "no NVIDIA GPUs visible"
        # The plain login may not read the kernel log: said so, not passed off as "no Xids".
        plain_xids = hosts["plain"]["xids"]
        assert plain_xids["readable"] != bool(plain_xids["error"])
        backends = {b["name"]: b for b in doc["backends"]}
        assert {n: b["state"] for n, b in backends.items()} == {
            "sglang": "up",
            "native": "starting",
            "vllm": "up",
            "gone": "down",
        }
        assert backends["sglang"]["latency_ms"] > 0
        assert backends["sglang"]["service"]["state"] == "running"
        assert backends["sglang"]["service"]["pid"] == engine.pid
        assert {"name", "kind", "url", "state"} <= set(backends["native"])
        # The inventory names a router nobody runs: nothing answers through it, whatever the
        # inventory's `serving:` says.
        assert doc["traffic"]["serving"] is None
        serving = doc["answers"]["serving"]
        assert (serving["state"], serving["answered"], serving["backend"]) == (
            "nothing",
            False,
            None,
        )

        wrong = kdctl("status", "-i", str(inv), "--json", env={"KDCTL_TEST_KEY": "wrong"})
        vllm = next(b for b in json.loads(wrong.out)["backends"] if b["name"] == "vllm")
        assert (vllm["state"], vllm["detail"]) == ("unknown", "authentication failed")
        assert API_KEY not in run.out + run.err and "wrong" not in wrong.out

        table = kdctl("status", "-i", str(inv), env={"KDCTL_TEST_KEY": API_KEY})
        assert table.code == 0
        assert "NVIDIA H200" in table.out and "no NVIDIA GPUs visible" in table.out
        assert "starting" in table.out and "connection refused" in table.out
    finally:
        engine.kill()
        engine.wait()
        shutil.rmtree(run_dir, ignore_errors=True)


def test_dead_host_is_reported_within_its_deadline(fleet: SshdFleet, tmp_path: Path) -> None:
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)  # the TCP handshake completes, then nothing: a hung sshd
        inv = write_inventory(
            tmp_path / "inv.yaml",
            {
                "hosts": {
                    "gpu": fleet.host_entry("gpu"),
                    "dead": {
                        "address": "127.0.0.1",
                        "port": silent.getsockname()[1],
                        "connect_timeout_s": 30,
                        "known_hosts": str(fleet.known_hosts),
                    },
                    "plain": fleet.host_entry("plain"),
                    "plain2": fleet.host_entry("plain2"),
                }
            },
        )
        started = time.monotonic()
        run = kdctl("status", "-i", str(inv), "--json", "--timeout", "2")
        elapsed = time.monotonic() - started
    assert run.code == 3, run.err
    hosts = {h["name"]: h for h in json.loads(run.out)["hosts"]}
    assert not hosts["dead"]["reachable"]
    assert "no answer within 2s" in hosts["dead"]["error"]
    assert all(hosts[n]["reachable"] for n in ("gpu", "plain", "plain2"))
    # The dead host's own deadline, plus start-up; never its 30 s connect timeout.
    assert elapsed < 2 + 4, elapsed


def test_fan_out_bounds_threads_and_deadlines() -> None:
    import threading

    live = 0
    peak = 0
    lock = threading.Lock()

    def probe(host: str) -> str:
        nonlocal live, peak
        with lock:
            live += 1
            peak = max(peak, live)
        try:
            time.sleep(5 if host == "h0" else 0.05)
            if host == "h1":
                raise RuntimeError("boom")
            return host.upper()
        finally:
            with lock:
                live -= 1

    hosts = [f"h{i}" for i in range(12)]
    started = time.monotonic()
    out = fan_out(probe, hosts, max_workers=3, deadline_s=0.5)
    assert time.monotonic() - started < 2
    assert out["h0"].timed_out and out["h0"].value is None
    assert isinstance(out["h1"].error, RuntimeError)
    assert [out[h].value for h in hosts[2:]] == [h.upper() for h in hosts[2:]]
    # Three workers, plus the one that replaced the worker stuck on h0.
    assert peak <= 4
    with pytest.raises(ValueError, match="unique"):
        fan_out(probe, ["h2", "h2"])


def test_a_hung_nvidia_smi_leaves_the_host_reachable(tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "nvidia-smi").write_text("#!/bin/sh\nexec sleep 30\n")  # as after an Xid 79
    (bindir / "nvidia-smi").chmod(0o755)
    inv = write_inventory(tmp_path / "inv.yaml", {"hosts": {"box": {"transport": "local"}}})
    started = time.monotonic()
    import os

    run = kdctl(
        "status",
        "-i",
        str(inv),
        "--json",
        "--timeout",
        "2",
        env={"PATH": f"{bindir}:{os.environ['PATH']}"},
    )
    assert time.monotonic() - started < 10
    assert run.code == 0, run.err  # reachable: not an infrastructure failure of the host
    (host,) = json.loads(run.out)["hosts"]
    assert host["reachable"] and "did not finish within 2s" in host["error"]


def _logins(fleet: SshdFleet) -> int:
    return sum(
        (sshd.root / "log").read_text().count("Accepted publickey") for sshd in fleet.hosts.values()
    )


def test_one_ssh_connection_per_host_per_command(
    fleet: SshdFleet, engines: dict[str, int], tmp_path: Path, report: Any
) -> None:
    """`kdctl status` over 16 hosts, each with a backend whose service and host identity are
    read over SSH, behind a router on one of them: the status probes, the router's read-back,
    the engines' identities and the evidence binding share one connection a host."""
    names = [f"h{i:02d}" for i in range(16)]
    # One port each: a port just freed can be handed out again, and two engines on one URL
    # are refused by the inventory.
    ports: set[int] = set()
    while len(ports) < len(names):
        ports.add(free_port())
    port_of = dict(zip(names, sorted(ports), strict=True))
    sshds = sorted(fleet.hosts)
    inv = write_inventory(
        tmp_path / "inv.yaml",
        {
            "hosts": {n: fleet.host_entry(sshds[i % len(sshds)]) for i, n in enumerate(names)},
            "backends": {
                f"engine-{n}": {
                    "kind": "sglang",
                    "host": n,
                    "url": f"http://127.0.0.1:{port_of[n]}",
                    "model": "/srv/models/tiny",
                    "service": {
                        "command": "sleep 300",
                        "pidfile": f"/tmp/kdctl-absent-{n}.pid",
                        "log": f"/tmp/kdctl-absent-{n}.log",
                    },
                }
                for n in names
            },
            "router": {
                "kind": "nginx",
                "host": names[0],
                "listen": f"127.0.0.1:{free_port()}",
                "serving": "engine-h00",
            },
        },
    )
    before = _logins(fleet)
    run = kdctl("status", "-i", str(inv), "--json")
    opened = _logins(fleet) - before
    assert run.out, run.err
    assert len(json.loads(run.out)["hosts"]) == 16
    report(f"kdctl status over 16 SSH hosts opened {opened} SSH connections")
    assert opened == 16


def test_an_engine_whose_process_runs_but_does_not_listen_yet_is_starting(
    tmp_path: Path,
) -> None:
    """SGLang listens only once its weights are loaded: while its process runs and its port
    refuses, status says starting, not down; once the process is gone, down."""
    pidfile, log = tmp_path / "engine.pid", tmp_path / "engine.log"
    inv = write_inventory(
        tmp_path / "inv.yaml",
        {
            "hosts": {"local": {"transport": "local"}},
            "backends": {
                "engine": {
                    "kind": "sglang",
                    "host": "local",
                    "url": f"http://127.0.0.1:{free_port()}",
                    "service": {
                        "command": ["sleep", "60"],
                        "pidfile": str(pidfile),
                        "log": str(log),
                    },
                }
            },
            "state_dir": "state",
        },
    )
    loading = subprocess.Popen(["sleep", "60"])
    pidfile.write_text(f"{loading.pid}\n")
    try:
        (engine,) = json.loads(kdctl("status", "-i", str(inv), "--json").out)["backends"]
        assert engine["state"] == "starting", engine
        assert "nothing listens yet, but its command service runs" in engine["detail"]
    finally:
        loading.kill()
        loading.wait()
    (engine,) = json.loads(kdctl("status", "-i", str(inv), "--json").out)["backends"]
    assert engine["state"] == "down", engine


def test_a_model_the_engine_does_not_name_is_shown_as_the_inventorys(tmp_path: Path) -> None:
    """An engine that answers its info routes without naming its model: status shows the
    inventory's model marked as such, never as the engine's word."""
    from tests.support.faulty import replay, serve

    info = (200, b'{"version": "0.5.23"}', "application/json")
    server = serve(
        replay(
            {
                ("GET", "/server_info"): info,
                ("GET", "/model_info"): (200, b"{}", "application/json"),
                ("GET", "/health"): (200, b"", "text/plain"),
            }
        )
    )
    try:
        inv = write_inventory(
            tmp_path / "inv.yaml",
            {
                "hosts": {"local": {"transport": "local"}},
                "backends": {
                    "engine": {
                        "kind": "sglang",
                        "host": "local",
                        "url": f"http://127.0.0.1:{server.server_address[1]}",
                        "model": "/models/Kimi-K2.6-INT4",
                    }
                },
                "state_dir": "state",
            },
        )
        doc = json.loads(kdctl("status", "-i", str(inv), "--json").out)
        (engine,) = doc["backends"]
        assert engine["identity"] == "live" and engine["model_reported"] is False, engine
        table = kdctl("status", "-i", str(inv)).out
        assert "/models/Kimi-K2.6-INT4 (inventory)" in table, table
    finally:
        server.shutdown()
        server.server_close()
