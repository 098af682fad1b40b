"""`kdctl init`: the inventory from what a box shows. The parsers on recorded text; then a box
(a network namespace reached only through its sshd, its own /etc/systemd/system) with SGLang
0.5.23 running under a unit and behind a key, the reference engine started with a pidfile,
nginx in front, and a stopped SGLang unit, read by the real command."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from kdctl.inventory_init import _comment, _Yaml
from kdctl.probes.discovery import (
    HostFacts,
    Listener,
    Process,
    Unit,
    find_engines,
    mask_secrets,
    nginx_fronts,
    nginx_master,
    parse_engine_command,
    parse_exec_start_property,
    parse_nginx_dump,
    parse_pidfiles,
    parse_proc_net_tcp,
    parse_proc_records,
    parse_ps,
    parse_ss,
    parse_systemctl_show,
    parse_unit_dump,
    parse_unit_file,
    same_command,
    secret_values,
    unit_of_cgroup,
)
from kdctl.probes.gpus import GpuProbe
from tests.conftest import REPO, kdctl, need_engine
from tests.support.box import Box, make_box
from tests.support.nginx import NGINX
from tests.test_sglang_live import SGLANG_PYTHON

# --- parsers, on text recorded from real hosts ------------------------------------------------

SS = """\
LISTEN 0      4096       127.0.0.1:30000      0.0.0.0:*    users:(("python3",pid=2101,fd=24))
LISTEN 0      511          0.0.0.0:8000       0.0.0.0:*    users:(("nginx",pid=990,fd=6),\
("nginx",pid=989,fd=6))
LISTEN 0      128             [::]:22            [::]:*    users:(("sshd",pid=700,fd=4))
LISTEN 0      4096   127.0.0.53%lo:53         0.0.0.0:*
LISTEN 0      2048               *:31000            *:*
"""


def test_ss_lines_are_sockets_with_their_owners() -> None:
    found = parse_ss(SS)
    assert [(s.address, s.port) for s in found] == [
        ("127.0.0.1", 30000),
        ("0.0.0.0", 8000),
        ("::", 22),
        ("127.0.0.53", 53),
        ("*", 31000),
    ]
    assert found[0].pids == [2101] and found[0].programs == ["python3"]
    assert found[1].pids == [989, 990] and found[1].programs == ["nginx"]
    # Without root, ss shows no owner for another user's socket: the port is still there.
    assert found[3].pids == [] and found[4].pids == []


def test_proc_net_tcp_where_ss_is_missing() -> None:
    tcp = (
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid\n"
        "   0: 0100007F:7530 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0\n"
        "   1: 0100007F:7530 0100007F:D2F0 01 00000000:00000000 00:00000000 00000000     0\n"
        "   0: 00000000000000000000000000000000:1F40 00000000000000000000000000000000:0000 0A\n"
        "   1: 00000000000000000000000001000000:0016 00000000000000000000000000000000:0000 0A\n"
    )
    found = [(s.address, s.port) for s in parse_proc_net_tcp(tcp)]
    assert found == [("127.0.0.1", 30000), ("::", 8000), ("::1", 22)]


def test_an_engine_that_exits_between_ps_and_proc_is_not_running(tmp_path: Path) -> None:
    """An engine ps lists that is gone when its /proc entry is read (one shutting down as the
    host is read) is no engine running there: left out, not taken for one whose network
    namespace and sockets could not be read."""
    from kdctl.probes.discovery import read_processes
    from kdctl.transports.local import LocalTransport

    script = tmp_path / "sglang.launch_server"
    script.write_text("import time\ntime.sleep(60)\n")
    argv = [sys.executable, str(script), "-m", "sglang.launch_server", "--port", "39999"]
    ending = subprocess.Popen(argv)

    class ExitsAfterPs(LocalTransport):
        def run(self, argv: Any, **kw: Any) -> Any:
            if argv[0] == "sh":  # ps has listed it: it exits before /proc is read
                ending.kill()
                ending.wait()
            return super().run(argv, **kw)

    try:
        listed = read_processes(LocalTransport("local"), systemd=False)
        assert ending.pid in {p.pid for p in listed}
        assert ending.pid not in {
            p.pid for p in read_processes(ExitsAfterPs("local"), systemd=False)
        }
    finally:
        ending.kill()
        ending.wait()


def test_ps_and_the_exact_command_lines_from_proc() -> None:
    ps = (
        "    1       0 root     /sbin/init\n"
        " 2101       1 sglang   /opt/sglang/bin/python -m sglang.launch_server --model-path "
        "/models/My Model --tp 8\n"
        "  bad line\n"
    )
    found = parse_ps(ps)
    assert [(p.pid, p.ppid, p.user) for p in found] == [(1, 0, "root"), (2101, 1, "sglang")]
    # ps joins arguments with spaces: a path holding one is two words there ...
    assert found[1].argv[-3:] == ["Model", "--tp", "8"]
    # ... and one argument in /proc/PID/cmdline.
    net = (
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  "
        "timeout inode\n   0: 0100007F:7530 00000000:0000 0A 00000000:00000000 00:00000000 "
        "00000000     0        0 43024 1 00000000edbf0f7a 100 0 0 10 0\n"
    )
    records = (
        "\x1e2101\x1f/opt/sglang/bin/python\x00-m\x00sglang.launch_server\x00--model-path\x00"
        f"/models/My Model\x00\x1f0::/system.slice/sglang.service\n\x1f{net}"
        "\x1e77\x1f\x1f\x1f"
    )
    exact = parse_proc_records(records)
    assert exact[2101].argv[-1] == "/models/My Model" and 77 not in exact
    assert unit_of_cgroup(exact[2101].cgroup) == "sglang.service"
    # The sockets listening in its own network namespace, by inode.
    assert [(s.port, s.inode) for s in exact[2101].listeners or []] == [(30000, 43024)]
    assert unit_of_cgroup("0::/user.slice/user-0.slice/session-3.scope\n") is None


UNIT = """\
[Unit]
Description=SGLang serving Kimi K2.6
After=network-online.target

[Service]
User=sglang
# The key comes from the environment file, never from this one.
EnvironmentFile=-/etc/sglang/env
Environment="CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7" HF_HUB_OFFLINE=1
Environment=SGLANG_API_KEY=sk-do-not-copy
WorkingDirectory=/srv/sglang
ExecStart=/opt/sglang/bin/python -m sglang.launch_server \\
    --model-path /models/Kimi-K2.6-INT4 --tp 8 \\
    --host 127.0.0.1 --port 30000 --api-key ${SGLANG_API_KEY}
Restart=on-failure
"""


def test_a_unit_file_and_its_drop_in() -> None:
    unit = parse_unit_file("sglang.service", "/etc/systemd/system/sglang.service", [UNIT])
    assert unit.exec_start is not None and unit.exec_start[:3] == [
        "/opt/sglang/bin/python",
        "-m",
        "sglang.launch_server",
    ]
    assert unit.exec_start[-2:] == ["--api-key", "${SGLANG_API_KEY}"]
    assert unit.env == {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    # Other variables by name only: their values may be keys.
    assert unit.env_names == ["CUDA_VISIBLE_DEVICES", "HF_HUB_OFFLINE", "SGLANG_API_KEY"]
    assert "sk-do-not-copy" not in unit.model_dump_json()
    assert unit.environment_files == ["/etc/sglang/env"] and unit.user == "sglang"
    # A drop-in clears ExecStart with an empty one, then sets its own (with systemd's `-`
    # and `@` prefixes: the program, then the argv[0] the process sees).
    drop_in = (
        "[Service]\nExecStart=\n"
        "ExecStart=-@/opt/sglang/bin/python sglang -m sglang.launch_server --port 30001\n"
    )
    unit = parse_unit_file("sglang.service", "/x", [UNIT, drop_in])
    assert unit.exec_start == ["sglang", "-m", "sglang.launch_server", "--port", "30001"]
    assert unit.executable == "/opt/sglang/bin/python"


def test_units_read_in_systemds_order_of_precedence() -> None:
    dump = (
        "\x1e/etc/systemd/system/sglang.service\x1f"
        "[Service]\nExecStart=/bin/a -m sglang.launch_server\n"
        "\x1e/etc/systemd/system/sglang.service.d/override.conf\x1f[Service]\nExecStart=\n"
        "ExecStart=/bin/b -m sglang.launch_server --port 1\n"
        "\x1e/lib/systemd/system/sglang.service\x1f[Service]\nExecStart=/bin/c\n"
        "\x1e/lib/systemd/system/nginx.service\x1f[Service]\nExecStart=/usr/sbin/nginx\n"
    )
    units = {u.name: u for u in parse_unit_dump(dump)}
    assert units["sglang.service"].path == "/etc/systemd/system/sglang.service"
    assert units["sglang.service"].exec_start == [
        "/bin/b",
        "-m",
        "sglang.launch_server",
        "--port",
        "1",
    ]
    assert units["sglang.service"].drop_ins == [
        "/etc/systemd/system/sglang.service.d/override.conf"
    ]
    assert set(units) == {"sglang.service", "nginx.service"}


def test_systemctl_show_where_systemd_runs() -> None:
    shown = (
        "Id=sglang.service\nActiveState=inactive\nSubState=dead\nMainPID=0\n"
        "FragmentPath=/etc/systemd/system/sglang.service\n"
        "ExecStart={ path=/opt/sglang/bin/python ; argv[]=/opt/sglang/bin/python -m "
        "sglang.launch_server --tp 8 ; ignore_errors=no ; start_time=[n/a] ; stop_time=[n/a] ; "
        "pid=0 ; code=(null) ; status=0/0 }\n\n"
        "Id=vllm.service\nActiveState=active\nSubState=running\nMainPID=4242\n"
    )
    blocks = parse_systemctl_show(shown)
    assert blocks["sglang.service"]["ActiveState"] == "inactive"
    assert blocks["vllm.service"]["MainPID"] == "4242"
    assert parse_exec_start_property(blocks["sglang.service"]["ExecStart"]) == [
        "/opt/sglang/bin/python",
        "-m",
        "sglang.launch_server",
        "--tp",
        "8",
    ]


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        (
            "/opt/venv/bin/python3 -m sglang.launch_server --model-path /m/K2 --tp 8 "
            "--served-model-name kimi --host 0.0.0.0 --port=31000 --api-key ${KEY}",
            ("sglang", "0.0.0.0", 31000, "/m/K2", "kimi", 8, True, "KEY"),
        ),
        (
            "python -m sglang.launch_server --model /m/a --tensor-parallel-size 2 --api-key s3cr3t",
            ("sglang", "127.0.0.1", 30000, "/m/a", None, 2, True, None),
        ),
        (
            "/usr/local/bin/vllm serve Qwen/Qwen3-8B -tp 4 --served-model-name q3 q3-alias",
            ("vllm", "0.0.0.0", 8000, "Qwen/Qwen3-8B", "q3", 4, False, None),
        ),
        (
            "python3 -m vllm.entrypoints.openai.api_server --model /m/b --port 8001",
            ("vllm", "0.0.0.0", 8001, "/m/b", None, None, False, None),
        ),
        (
            "/venv/bin/python -m kdctl reference serve --model /m/t --port 31001 "
            "--api-key-env REF_KEY",
            ("reference", "127.0.0.1", 31001, "/m/t", None, None, True, "REF_KEY"),
        ),
        (
            "python -m sglang_router.launch_router --worker-urls http://127.0.0.1:30000 "
            "http://127.0.0.1:30001 --port 8080",
            ("sglang-router", "127.0.0.1", 8080, None, None, None, False, None),
        ),
    ],
)
def test_engine_command_lines(argv: str, want: tuple[object, ...]) -> None:
    cmd = parse_engine_command(argv.split())
    assert cmd is not None
    got = (
        cmd.kind,
        cmd.bind,
        cmd.port,
        cmd.model,
        cmd.served_name,
        cmd.tp_size,
        cmd.requires_key,
        cmd.key_env,
    )
    assert got == want
    if cmd.kind == "sglang-router":
        assert cmd.worker_urls == ["http://127.0.0.1:30000", "http://127.0.0.1:30001"]


@pytest.mark.parametrize(
    "argv",
    [
        "python -m sglang.bench_serving --port 30000",
        "grep sglang.launch_server",
        "/usr/bin/python3 /usr/bin/vllm bench serve",
        "nginx: worker process",
        "kdctl status",
    ],
)
def test_what_is_not_an_engine(argv: str) -> None:
    assert parse_engine_command(argv.split()) is None


def test_keys_are_masked_and_a_units_variable_matches_what_it_expanded_to() -> None:
    argv = ["python", "-m", "sglang.launch_server", "--api-key", "sk-1", "--admin-api-key=sk-2"]
    assert mask_secrets(argv)[-2:] == ["***", "--admin-api-key=***"]
    assert secret_values(argv) == ["sk-1", "sk-2"]
    assert mask_secrets(["x", "--api-key", "${KEY}"]) == ["x", "--api-key", "${KEY}"]
    unit = ["/opt/py", "-m", "sglang.launch_server", "--api-key", "${KEY}", "--x=$Y-z"]
    assert same_command(
        ["/opt/py", "-m", "sglang.launch_server", "--api-key", "k", "--x=1-z"], unit
    )
    assert same_command(["py", "-m", "sglang.launch_server", "--api-key", "k", "--x=1-z"], unit)
    assert not same_command(["/opt/py", "-m", "sglang.launch_server", "--api-key", "k"], unit)
    assert not same_command(
        ["/opt/py", "-m", "sglang.launch_server", "--api-key", "k", "--x=1"], unit
    )


NGINX_T = """\
nginx: the configuration file /etc/nginx/nginx.conf syntax is ok
# configuration file /etc/nginx/nginx.conf:
events { worker_connections 768; }
http {
    include /etc/nginx/conf.d/*.conf;  # the upstreams
}

# configuration file /etc/nginx/conf.d/llm.conf:
upstream llm {
    server 127.0.0.1:30000 weight=1;
    server 127.0.0.1:31000 weight=9 max_fails=0;
}
server {
    listen 8000;
    listen [::]:8000;
    location "/" { proxy_pass http://llm; }
    location /direct { proxy_pass http://127.0.0.1:30000/; }
}
"""


def test_nginx_proxies_read_from_nginx_t() -> None:
    files = parse_nginx_dump(NGINX_T)
    assert set(files) == {"/etc/nginx/nginx.conf", "/etc/nginx/conf.d/llm.conf"}
    fronts = nginx_fronts(files, "/etc/nginx/nginx.conf")
    assert [f.targets for f in fronts] == [
        {"127.0.0.1:30000": 1, "127.0.0.1:31000": 9},
        {"127.0.0.1:30000": 1},
    ]
    assert fronts[0].listen == ["0.0.0.0:8000", "[::]:8000"] and fronts[0].upstream == "llm"
    assert fronts[0].file == "/etc/nginx/conf.d/llm.conf" and not fronts[0].written_by_kdctl
    master = ["nginx: master process /usr/sbin/nginx -p /srv/ng -c /srv/ng/nginx.conf"]
    assert nginx_master(master) == ("/usr/sbin/nginx", "/srv/ng", "/srv/ng/nginx.conf")
    assert nginx_master(["nginx: worker process"]) is None


def test_pidfiles_and_logs() -> None:
    text = (
        "\x1e/run/kdtree/kdtree.pid\x1f4242\x1e/var/run/kdtree/kdtree.pid\x1f4242"
        "\x1e/run/other.pid\x1fnot a pid\x1efd1:4242\x1f/var/log/kdtree/kdtree.log"
        "\x1efd1:77\x1fpipe:[1234]\x1efd1:78\x1f"
    )
    pidfiles, logs = parse_pidfiles(text)
    assert pidfiles == {4242: "/run/kdtree/kdtree.pid"}
    assert logs == {4242: "/var/log/kdtree/kdtree.log"}


def test_engines_joined_from_processes_units_and_sockets() -> None:
    """A unit tied to its process by its ExecStart (no systemd running), the forked worker not
    counted twice, a stopped unit found by its ExecStart, a port held by something else, and
    an engine in another network namespace (a container) told apart by its sockets' inodes."""
    run = ["/py", "-m", "sglang.launch_server", "--port", "30000", "--api-key", "sk-live"]
    unit_argv = [*run[:-1], "${SGLANG_API_KEY}"]
    ours = [Listener(address="127.0.0.1", port=30000, inode=101)]
    container = [Listener(address="0.0.0.0", port=30000, inode=202)]
    elsewhere = ["/py", "-m", "sglang.launch_server", "--host", "0.0.0.0"]
    facts = HostFacts(
        gpus=GpuProbe(visible=False),
        listeners=[
            *ours,
            Listener(address="0.0.0.0", port=31000, pids=[9], programs=["nginx"], inode=102),
        ],
        processes=[
            Process(pid=10, ppid=1, user="root", argv=run, exact=True, own_listeners=ours),
            Process(pid=11, ppid=10, user="root", argv=run, exact=True),
            Process(
                pid=30, ppid=1, user="root", argv=elsewhere, exact=True, own_listeners=container
            ),
            Process(
                pid=20, ppid=1, user="x", argv=["/v/bin/vllm", "serve", "m", "--port", "31000"]
            ),
        ],
        units=[
            Unit(
                name="sglang.service",
                path="/etc/systemd/system/sglang.service",
                exec_start=unit_argv,
            ),
            Unit(
                name="big.service",
                path="/etc/systemd/system/big.service",
                exec_start=["/py", "-m", "sglang.launch_server", "--tp", "8", "--port", "30001"],
                env={"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"},
            ),
        ],
    )
    found = {e.source: e for e in find_engines(facts)}
    assert set(found) == {
        "sglang.service ExecStart",
        "process 20",
        "process 30",
        "big.service ExecStart",
    }
    assert found["process 30"].elsewhere and found["process 30"].listener is None
    assert not found["sglang.service ExecStart"].elsewhere
    live = found["sglang.service ExecStart"]
    assert live.running and live.process is not None and live.process.pid == 10
    assert live.command.key_env == "SGLANG_API_KEY" and live.listener is not None
    stopped = found["big.service ExecStart"]
    assert not stopped.running and stopped.command.tp_size == 8 and stopped.gpus == list(range(8))
    assert found["process 20"].socket_note == "port 31000 is held by nginx (pid 9), not by it"


def test_a_note_cannot_end_its_comment_line() -> None:
    doc = _Yaml()
    doc.open("backends", 0)
    evil = "x\ny: 1\r\x85z\u2028w\u2029v: 2"
    doc.put("model", evil, 2, note=f"from {evil}")
    doc.put("service", {"systemd": "a.service"}, 2, note="from\nnothing: here", guess=True)
    loaded = yaml.safe_load(doc.text())
    assert loaded == {"backends": {"model": evil, "service": {"systemd": "a.service"}}}
    assert "\n" not in _comment("a\nb") and doc.guesses == 1


def test_bad_input_is_named_and_exit_2(tmp_path: Path) -> None:
    out = tmp_path / "inv.yaml"
    run = kdctl("init", "--host", "bad host;rm", "-o", str(out))
    assert run.code == 2 and "--host bad host;rm" in run.err and "Traceback" not in run.err
    run = kdctl("init", "-o", str(out))
    assert run.code == 2 and "--host ADDRESS, or --local" in run.err
    run = kdctl(
        "init", "--host", "10.0.0.1", "--identity-file", str(tmp_path / "nope"), "-o", str(out)
    )
    assert run.code == 2 and str(tmp_path / "nope") in run.err
    run = kdctl("init", "--host", "10.0.0.1", "--user", "-rf", "-o", str(out))
    assert run.code == 2 and "--user -rf" in run.err
    run = kdctl("init", "--local", "-o", str(tmp_path / "no" / "inv.yaml"))
    assert run.code == 2 and str(tmp_path / "no") in run.err
    assert not out.exists()


def test_init_on_this_machine_writes_what_inventory_check_accepts(tmp_path: Path) -> None:
    """Whatever runs here (other tests' engines, a sandbox) is written only as far as it
    checks: the result always passes."""
    out = tmp_path / "local.yaml"
    run = kdctl("init", "--local", "-o", str(out))
    assert run.code == 0, run.err
    assert yaml.safe_load(out.read_text())["hosts"]["local"]["transport"] == "local"
    assert kdctl("inventory", "check", "-i", str(out)).code == 0


class _Channel:
    """One end of a socket pair as an SSH channel: what kdctl's tunnel calls on one."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.closed = False
        self.eof_received = 0

    def settimeout(self, timeout: float | None) -> None:
        self.sock.settimeout(timeout)

    def recv(self, nbytes: int) -> bytes:
        return self.sock.recv(nbytes)

    def recv_ready(self) -> bool:
        return False

    def sendall(self, s: bytes) -> None:
        self.sock.sendall(s)

    def close(self) -> None:
        self.closed = True
        self.sock.close()


class _Sshd:
    """A host's SSH connection as init uses it: each channel opened is answered by `answer`
    (the first request line -> the whole answer), or refused as a box's sshd refuses."""

    name = "box"

    def __init__(self, answer: Callable[[str], bytes] | None) -> None:
        self.answer = answer
        self.dialled: list[tuple[str, int]] = []
        self.requests: list[str] = []

    def open_channel(self, host: str, port: int, *, timeout: float) -> _Channel:
        self.dialled.append((host, port))
        if self.answer is None:
            raise ConnectionRefusedError(f"{host}:{port} on box: connection refused")
        ours, theirs = socket.socketpair()
        threading.Thread(target=self._serve, args=(theirs,), daemon=True).start()
        return _Channel(ours)

    def _serve(self, sock: socket.socket) -> None:
        assert self.answer is not None
        with sock:
            head = b""
            while b"\r\n\r\n" not in head:
                head += sock.recv(4096)
            request = head.decode().split("\r\n")
            self.requests.append(request[0] + " " + next(h for h in request if h[:5] == "Host:"))
            with contextlib.suppress(OSError):
                sock.sendall(self.answer(request[0].split()[1]))


def _json_answer(body: object) -> bytes:
    data = json.dumps(body).encode()
    return f"HTTP/1.1 200 OK\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data


def test_engines_are_asked_through_the_hosts_ssh_channels() -> None:
    """Each request leaves from the host (the address it dials, in a channel of its SSH
    connection); a refusal there is said, typed; a body that does not end is cut at the cap."""
    from kdctl._httpclient import Tunnels, http_client
    from kdctl.inventory_init import _BODY_CAP, _engine_asker, _get

    info = {"model_path": "/m/q", "served_model_name": "q", "tp_size": 2, "version": "0.5.23"}
    models = {"data": [{"id": "q"}]}
    sshd = _Sshd(lambda path: _json_answer(info if path == "/server_info" else models))
    with _engine_asker(sshd) as ask:  # type: ignore[arg-type]
        answer = ask("sglang", "127.0.0.1", 30000)
    assert answer.error is None and answer.route == "/server_info"
    assert (answer.model, answer.served_name, answer.tp_size) == ("/m/q", "q", 2)
    assert set(sshd.dialled) == {("127.0.0.1", 30000)}
    assert sshd.requests == [
        "GET /server_info HTTP/1.1 Host: 127.0.0.1:30000",
        "GET /v1/models HTTP/1.1 Host: 127.0.0.1:30000",
    ]

    refused = _Sshd(None)
    with _engine_asker(refused) as ask:  # type: ignore[arg-type]
        answer = ask("sglang", "::1", 30000)
    assert answer.error is not None and answer.error.startswith("/server_info: ConnectError: ")
    assert "through SSH to box: ::1:30000 on box: connection refused" in answer.error

    endless = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n" + b"[" * (3 * _BODY_CAP)
    sshd = _Sshd(lambda path: endless)
    tunnels = Tunnels()
    url = "http://127.0.0.1:30000"
    tunnels.add(
        url,
        via="box",
        mode="ssh",
        ssh_address=None,
        opener=lambda host, port, timeout: sshd.open_channel(host, port, timeout=timeout),
    )
    try:
        with http_client(trust_env=False, timeout=5) as client:
            status, body = _get(client, url + "/server_info")
    finally:
        tunnels.close()
    assert status == 200 and len(body) == _BODY_CAP


# --- a box read over SSH -----------------------------------------------------------------------

SGLANG_PORT, REFERENCE_PORT, NGINX_PORT = 30000, 31000, 8000


@dataclass
class InitBox:
    box: Box
    root: Path
    llama: Path
    key: str
    units: Path
    nginx_prefix: Path
    reference_argv: list[str]
    reference_pid: int


def _sglang_argv(llama: Path, key: str) -> list[str]:
    return [
        str(SGLANG_PYTHON),
        *("-m", "sglang.launch_server", "--model-path", str(llama)),
        *("--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(SGLANG_PORT)),
        *("--tp-size", "1", "--device", "cpu", "--attention-backend", "torch_native"),
        *("--disable-cuda-graph", "--grammar-backend", "none", "--max-total-tokens", "8192"),
        # Its warm-up generation costs seconds on two cores and nothing here reads it.
        *("--sleep-on-idle", "--skip-server-warmup", "--api-key", key),
    ]


def _unit(exec_start: list[str], env: dict[str, str]) -> str:
    assignments = " ".join(f'"{k}={v}"' for k, v in env.items())
    return (
        "[Unit]\nDescription=LLM engine\n\n[Service]\n"
        f"Environment={assignments}\nExecStart={' '.join(exec_start)}\nRestart=on-failure\n\n"
        "[Install]\nWantedBy=multi-user.target\n"
    )


def _nginx_conf(prefix: Path) -> Path:
    (prefix / "conf.d").mkdir(parents=True)
    (prefix / "tmp").mkdir()
    temp = "".join(
        f"  {kind}_temp_path {prefix / 'tmp' / kind};\n"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    conf = prefix / "nginx.conf"
    conf.write_text(
        f"worker_processes 1;\npid {prefix / 'nginx.pid'};\n"
        f"error_log {prefix / 'error.log'} warn;\nevents {{ worker_connections 64; }}\n"
        f"http {{\n  access_log off;\n{temp}  include conf.d/*.conf;\n}}\n"
    )
    (prefix / "conf.d" / "llm.conf").write_text(
        "upstream llm {\n"
        f"    server 127.0.0.1:{REFERENCE_PORT} weight=3;\n"
        f"    server 127.0.0.1:{SGLANG_PORT} weight=1;\n"
        "}\n"
        f"server {{\n    listen 127.0.0.1:{NGINX_PORT};\n"
        "    location / { proxy_pass http://llm; }\n}\n"
    )
    return conf


def _stop(proc: subprocess.Popen[bytes]) -> None:
    # Its whole session (SGLang's scheduler and detokenizer with it): nothing of theirs is
    # kept, and SGLang's own shutdown takes seconds.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.fixture(scope="module")
def initbox(llama: Path) -> Iterator[InitBox]:
    if os.geteuid() != 0:
        pytest.skip("a box is a network namespace with its own sshd, which needs root")
    need_engine(SGLANG_PYTHON, "scripts/bootstrap-sglang")
    if not (shutil.which("unshare") and os.path.exists(NGINX)):
        pytest.skip("unshare and nginx are needed for the box")
    # Outside pytest's own temporary folders, which only root may enter: the box's login
    # reads the engines' pidfile and nginx's configuration here, as an ops login would.
    root = Path(tempfile.mkdtemp(prefix="kdctl-init-", dir="/tmp"))
    root.chmod(0o755)
    units = root / "units"
    units.mkdir(mode=0o755)
    key = "sk-init-" + secrets.token_hex(16)
    sglang_argv = _sglang_argv(llama, key)
    env = {
        "SGLANG_USE_CPU_ENGINE": "1",
        "PYTHONPATH": str(REPO / "scripts" / "sglang_cpu"),
        "HF_HUB_OFFLINE": "1",
    }
    # The unit holds the variable, as a unit should; systemd would expand it on start.
    (units / "sglang.service").write_text(
        _unit([*sglang_argv[:-1], "${SGLANG_API_KEY}"], {**env, "SGLANG_API_KEY": key})
    )
    # The team's engine, stopped: Kimi K2.6 on eight GPUs, on every interface.
    kimi = [
        "/opt/sglang/bin/python",
        *("-m", "sglang.launch_server", "--model-path", "/models/Kimi-K2.6-INT4", "--tp", "8"),
        *("--served-model-name", "kimi-k2.6", "--host", "0.0.0.0", "--port", "30001"),
        *("--api-key", "${KIMI_API_KEY}"),
    ]
    (units / "sglang-kimi.service").write_text(
        _unit(kimi, {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"})
    )
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    box = make_box(root / "box", f"init-{worker}", mounts={"/etc/systemd/system": units})
    procs: list[subprocess.Popen[bytes]] = []
    nginx_prefix = root / "nginx"
    try:
        with (root / "sglang.log").open("wb") as log:
            procs.append(
                box.popen(
                    sglang_argv,
                    env={**os.environ, **env},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        reference = [
            sys.executable,
            *("-m", "kdctl", "reference", "serve", "--model", str(llama)),
            *("--port", str(REFERENCE_PORT), "--served-model-name", "ref-tiny"),
            *("--sglang-version", "0.5.23"),
        ]
        with (root / "reference.log").open("wb") as log:
            ref = box.popen(reference, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(ref)
        # A command with a pidfile: how kdctl's own services run.
        (root / "reference.pid").write_text(f"{ref.pid}\n")
        conf = _nginx_conf(nginx_prefix)
        started = box.run([NGINX, "-p", str(nginx_prefix), "-c", str(conf)])
        assert started.returncode == 0, started.stderr
        box.wait_listening(NGINX_PORT, timeout_s=10)
        box.wait_listening(REFERENCE_PORT, timeout_s=120)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            ready = box.run(["curl", "-sf", f"http://127.0.0.1:{SGLANG_PORT}/health"])
            if ready.returncode == 0:
                break
            assert procs[0].poll() is None, (root / "sglang.log").read_text()[-3000:]
            time.sleep(1)
        else:
            raise AssertionError(
                "SGLang did not become healthy: " + (root / "sglang.log").read_text()[-3000:]
            )
        yield InitBox(box, root, llama, key, units, nginx_prefix, reference, ref.pid)
    finally:
        for proc in procs:
            _stop(proc)
        with contextlib.suppress(OSError, ValueError):
            os.kill(int((nginx_prefix / "nginx.pid").read_text()), signal.SIGQUIT)
        box.close()
        shutil.rmtree(root, ignore_errors=True)


def _init(ib: InitBox, out: Path, known_hosts: Path, *extra: str) -> tuple[int, str, str]:
    box = ib.box
    run = kdctl(
        "init",
        *("--host", box.address, "--user", box.user, "--identity-file", str(box.identity_file)),
        *("--known-hosts", str(known_hosts), "-o", str(out)),
        *extra,
        timeout=120,
    )
    return run.code, run.out, run.err


def test_init_reads_the_box_over_ssh(initbox: InitBox, tmp_path: Path) -> None:
    ib = initbox
    known = tmp_path / "known_hosts"
    known.write_text("")
    out = tmp_path / "inventory.yaml"

    # An unknown host key is refused, naming its fingerprint and the option that records it.
    code, _, err = _init(ib, out, known)
    assert code == 3 and "SHA256:" in err and "--accept-new" in err, err
    assert not out.exists() and known.read_text() == ""

    code, stdout, err = _init(ib, out, known, "--accept-new")
    assert code == 0, err
    assert ib.box.address in known.read_text()
    text = out.read_text()
    check = kdctl("inventory", "check", "-i", str(out))
    assert check.code == 0, check.err
    # The key is named by its variable only: its value is nowhere kdctl wrote or printed.
    for shown in (text, stdout, err, check.out, check.err):
        assert ib.key not in shown

    inv = yaml.safe_load(text)
    host = next(iter(inv["hosts"]))
    assert inv["hosts"][host]["address"] == ib.box.address
    # Remote, its engines on its loopback: kdctl's HTTP goes through the SSH connection.
    assert inv["hosts"][host]["http"] == "ssh"
    backends = inv["backends"]
    assert backends["sglang"] == {
        "kind": "sglang",
        "host": host,
        "url": f"http://127.0.0.1:{SGLANG_PORT}",
        "model": str(ib.llama),
        "served_model_name": "tiny",
        "tp_size": 1,
        "api_key_env": "SGLANG_API_KEY",
        "service": {"systemd": "sglang.service"},
    }
    reference = backends[f"reference-{REFERENCE_PORT}"]
    assert {k: reference[k] for k in ("kind", "url", "model", "served_model_name", "tp_size")} == {
        "kind": "sglang",
        "url": f"http://127.0.0.1:{REFERENCE_PORT}",
        "model": str(ib.llama),
        "served_model_name": "ref-tiny",
        "tp_size": 1,
    }
    assert reference["service"]["pidfile"] == str(ib.root / "reference.pid")
    assert reference["service"]["command"] == ib.reference_argv
    assert "api_key_env" not in reference
    kimi = backends["sglang-kimi"]
    assert kimi == {
        "kind": "sglang",
        "host": host,
        "url": f"http://{ib.box.address}:30001",
        "model": "/models/Kimi-K2.6-INT4",
        "served_model_name": "kimi-k2.6",
        "tp_size": 8,
        "api_key_env": "KIMI_API_KEY",
        "gpus": list(range(8)),
        "service": {"systemd": "sglang-kimi.service"},
    }
    assert inv["router"] == {
        "kind": "nginx",
        "host": host,
        "listen": f"127.0.0.1:{NGINX_PORT}",
        "serving": f"reference-{REFERENCE_PORT}",
        "nginx": NGINX,
        "prefix": str(ib.nginx_prefix),
        "conf": str(ib.nginx_prefix / "nginx.conf"),
        "include": "/etc/nginx/conf.d/kdctl.conf",
    }

    lines = text.splitlines()

    def line(start: str) -> str:
        return next(ln for ln in lines if ln.lstrip().startswith(start))

    # Where each value came from, on its own line.
    assert "from /etc/systemd/system/sglang-kimi.service" in line("service: {systemd: sglang-kimi")
    assert "from sglang-kimi.service ExecStart --tp" in line("tp_size: 8")
    assert "from /server_info" in line("served_model_name: ref-tiny")
    assert "from sglang.service ExecStart --api-key ${SGLANG_API_KEY}" in line(
        "api_key_env: SGLANG_API_KEY"
    )
    # SGLang wants its key for /server_info: its values are its command line's.
    assert "from sglang.service ExecStart --served-model-name" in line("served_model_name: tiny")
    assert "guess:" in line("include:")
    assert line("# guess: the log path").endswith(f"holds pid {ib.reference_pid})")
    # A Kimi model is served by a stopped unit: the Kimi roadmap, left for the backends it
    # judges that the box does not show yet.
    assert any(ln.startswith("# roadmap: roadmap/kimi-k26-native.yaml") for ln in lines)
    assert "sglang: sglang" in stdout and "sglang-kimi: sglang" in stdout

    # An existing file is kept; --force replaces it (the key is known now: no --accept-new).
    before = out.read_text()
    code, _, err = _init(ib, out, known)
    assert code == 2 and str(out) in err and "--force" in err
    assert out.read_text() == before
    code, _, err = _init(ib, out, known, "--force")
    assert code == 0, err
    assert yaml.safe_load(out.read_text())["backends"]["sglang"] == backends["sglang"]

    # kdctl status with the file as written: the host's `http: ssh` sends every request
    # through the box's sshd, the only way to its loopback. Every key variable the file names
    # must be set to load it; the stopped unit's is never sent anywhere that answers.
    env = {"SGLANG_API_KEY": ib.key, "KIMI_API_KEY": "sk-" + secrets.token_hex(8)}
    run = kdctl("status", "-i", str(out), "--json", env=env, timeout=120)
    assert run.code == 0, run.err
    assert ib.key not in run.out + run.err
    report = json.loads(run.out)
    (box_status,) = report["hosts"]
    assert box_status["name"] == host and box_status["reachable"], box_status
    seen = {b["name"]: b for b in report["backends"]}
    assert set(seen) == set(backends)
    through = f"reached through SSH to {host}"
    for name, served in (("sglang", "tiny"), (f"reference-{REFERENCE_PORT}", "ref-tiny")):
        engine = seen[name]
        assert engine["state"] == "up" and engine["identity"] == "live", engine
        assert engine["served_name"] == served and engine["detail"] == through, engine
    # The stopped unit: nothing listens on the box's port 30001, as the box itself says.
    assert seen["sglang-kimi"]["state"] == "down", seen["sglang-kimi"]
    assert seen["sglang-kimi"]["detail"] == "connection refused"
    # Services: the reference's pidfile holds its pid; no systemd runs in the box, so a
    # unit's state is unknown, with systemctl's own reason.
    ref_service = seen[f"reference-{REFERENCE_PORT}"]["service"]
    assert ref_service["kind"] == "command" and ref_service["state"] == "running"
    assert ref_service["pid"] == ib.reference_pid
    for name in ("sglang", "sglang-kimi"):
        service = seen[name]["service"]
        assert service["kind"] == "systemd" and service["state"] == "unknown", service
        assert service["detail"], service

    # nginx answers through its front, by its own upstream (conf.d/llm.conf): kdctl's file,
    # the `include:` written as a guess, is not there, so which engine answered is not known.
    traffic = report["traffic"]
    assert traffic["router"] == "nginx" and traffic["front"]["answered"] is True, traffic
    assert traffic["front"]["reached"] == through
    assert "/etc/nginx/conf.d/kdctl.conf" in traffic["detail"]
    serving = report["answers"]["serving"]
    assert serving["state"] == "serving" and serving["backend"] is None, serving
    assert "the router's weights were not read back" in serving["detail"]
    # nginx splits its own upstream 3:1 between the two: neither is said to get nothing.
    assert "receives no traffic" not in serving["detail"], serving["detail"]
    assert "is up (its share of the traffic not known)" in serving["detail"]
    shown = kdctl("status", "-i", str(out), env=env, timeout=120)
    assert shown.code == 0, shown.err
    assert ib.key not in shown.out + shown.err
    assert shown.out.splitlines()[0].startswith(
        f"1. Serving now: an engine the router does not name through nginx on {host}:{NGINX_PORT}"
    ), shown.out
    assert "configured to send nothing" not in shown.out
    assert "its weights are not known" in " ".join(shown.out.split())


def test_the_inventory_written_from_recorded_facts(tmp_path: Path) -> None:
    """GPUs held by an engine's processes, a literal key kept out of the file and out of the
    service written, vLLM's own key variable, and a duplicate URL shown commented out."""
    from kdctl.inventory import HostSpec
    from kdctl.inventory_init import InitRequest, _write
    from kdctl.probes.gpus import GpuInfo, GpuProcess
    from kdctl.transports import LocalTransport

    key = "sk-literal-" + secrets.token_hex(8)
    sglang = ["/py", "-m", "sglang.launch_server", "--model-path", "/m/q", "--tp", "2"]
    sglang += ["--api-key", key]
    gpus = GpuProbe(
        visible=True,
        gpus=[
            GpuInfo(index=i, uuid=f"GPU-{i}", name="NVIDIA H200", memory_total_mib=143771)
            for i in range(2)
        ],
        processes=[
            GpuProcess(pid=pid, process_name="python", gpu_uuid=f"GPU-{i}", gpu_index=i)
            for pid, i in ((41, 0), (42, 1))
        ],
    )
    facts = HostFacts(
        hostname="gpu-box.example",
        gpus=gpus,
        processes=[
            Process(pid=40, ppid=1, user="svc", argv=sglang, exact=True),
            Process(pid=41, ppid=40, user="svc", argv=["sglang::scheduler_TP0"]),
            Process(pid=42, ppid=40, user="svc", argv=["sglang::scheduler_TP1"]),
            # A second engine on the same port (a copy started by hand): one URL, one backend.
            Process(pid=50, ppid=1, user="me", argv=sglang[:7], exact=True),
        ],
        units=[
            Unit(
                name="vllm.service",
                path="/etc/systemd/system/vllm.service",
                exec_start=["/v/bin/vllm", "serve", "/m/q", "--port", "8001"],
                env_names=["VLLM_API_KEY"],
            )
        ],
        pidfiles={40: "/run/sglang/sglang.pid"},
    )
    out = tmp_path / "inventory.yaml"
    result = _write(
        InitRequest(output=out, local=True),
        HostSpec(transport="local"),
        LocalTransport("local"),
        facts,
    )
    text = out.read_text()
    assert key not in text and key not in "\n".join(result.lines())
    inv = yaml.safe_load(text)
    assert inv["hosts"]["local"] == {"transport": "local", "gpus": 2, "gpu_model": "NVIDIA H200"}
    assert "2 x NVIDIA H200, 143771 MiB each" in text
    sg = inv["backends"]["sglang-30000"]
    assert sg["gpus"] == [0, 1] and sg["tp_size"] == 2
    assert sg["api_key_env"] == "SGLANG_30000_API_KEY" and "service" not in sg
    assert "# guess: it requires a key (--api-key on its command line)" in text
    assert any("holds a key" in n for n in result.notes)
    assert inv["backends"]["vllm"] == {
        "kind": "openai",
        "host": "local",
        "url": "http://127.0.0.1:8001",
        "model": "/m/q",
        "tp_size": 1,
        "api_key_env": "VLLM_API_KEY",
        "service": {"systemd": "vllm.service"},
    }
    assert "from vllm.service Environment VLLM_API_KEY" in text
    assert "  # sglang-30000-2: not written: http://127.0.0.1:30000 is also" in text
    assert kdctl("inventory", "check", "-i", str(out)).code == 0
