"""Another machine on this one: a network namespace with its own loopback, one address on a veth
pair, and a real sshd listening there. A server bound to the box's 127.0.0.1 is reachable from
the test process only through that sshd, as on a GPU box whose HTTP ports are closed to the
laptop. Namespaces and links are named after the box (`kdctl-<name>`), so a crashed run's
leftovers can be found and removed (`ip netns del kdctl-<name>`).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.sshd import SSHD, ensure_probe_user, keygen, write_sshd_config

_WAIT_READY = """
import sys, time, urllib.request
for port in sys.argv[1:]:
    deadline = time.monotonic() + 170
    while True:
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).status == 200:
                break
        except OSError:
            pass
        if time.monotonic() > deadline:
            sys.exit(f"127.0.0.1:{port} never answered 200")
        time.sleep(0.2)
"""


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")


def _subnet(name: str) -> int:
    """One /30 of 10.77.0.0/16 per box name, stable across runs and distinct between the
    boxes a run makes (the worker id is part of the name)."""
    return zlib.crc32(name.encode()) % 16000


@dataclass
class Box:
    name: str
    netns: str
    address: str
    port: int
    user: str
    identity_file: Path
    known_hosts: Path
    root: Path

    def popen(self, argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        """A process inside the box (its network only: files and users are this machine's)."""
        return subprocess.Popen(["ip", "netns", "exec", self.netns, *argv], **kwargs)

    def run(self, argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["ip", "netns", "exec", self.netns, *argv], capture_output=True, text=True, **kwargs
        )

    def wait_listening(self, port: int, timeout_s: float = 120.0) -> None:
        """Until something inside the box listens on its own 127.0.0.1:port."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            probe = self.run(["ss", "-Hltn", f"sport = :{port}"])
            if probe.stdout.strip():
                return
            time.sleep(0.2)
        raise RuntimeError(f"nothing listens on {self.name}'s 127.0.0.1:{port}")

    def wait_ready(self, *ports: int, timeout_s: float = 180.0) -> None:
        """Until each HTTP server on the box's 127.0.0.1:PORT answers /health with 200 (a
        reference server listens before its warm-up ends, answering 503 until then)."""
        done = self.run([sys.executable, "-c", _WAIT_READY, *map(str, ports)], timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"{self.name}: {done.stderr.strip()}")

    def host_entry(self, **extra: object) -> dict[str, object]:
        """An inventory `hosts:` entry reaching the box over SSH."""
        entry: dict[str, object] = {
            "transport": "ssh",
            "address": self.address,
            "port": self.port,
            "user": self.user,
            "identity_file": str(self.identity_file),
            "known_hosts": str(self.known_hosts),
        }
        entry.update(extra)
        return entry

    def close(self) -> None:
        pidfile = self.root / "sshd.pid"
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(pidfile.read_text()), 15)
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True)


def make_box(root: Path, name: str, *, mounts: Mapping[str, Path] | None = None) -> Box:
    """A namespace `kdctl-<name>` at 10.77.N.2/30 (this machine at .1), its loopback up, and
    sshd on port 22 of its address with its own host key and a user key that logs in as the
    probe user. Leftovers of a box of the same name are removed first. `mounts` (a path on
    the box: a folder or file here) are what the box's logins see at those paths, in a mount
    namespace of sshd's own: /etc/systemd/system with the box's units, say."""
    netns = f"kdctl-{name}"[:15]
    host_if, box_if = f"{netns[:12]}-h", f"{netns[:12]}-b"
    subprocess.run(["ip", "netns", "del", netns], capture_output=True)
    subprocess.run(["ip", "link", "del", host_if], capture_output=True)
    n = _subnet(name)
    base = (10 << 24) | (77 << 16) | (n * 4)
    host_ip = socket.inet_ntoa((base + 1).to_bytes(4, "big"))
    box_ip = socket.inet_ntoa((base + 2).to_bytes(4, "big"))
    _run("ip", "netns", "add", netns)
    _run("ip", "link", "add", host_if, "type", "veth", "peer", "name", box_if)
    _run("ip", "link", "set", box_if, "netns", netns)
    _run("ip", "addr", "add", f"{host_ip}/30", "dev", host_if)
    _run("ip", "link", "set", host_if, "up")
    _run("ip", "netns", "exec", netns, "ip", "addr", "add", f"{box_ip}/30", "dev", box_if)
    _run("ip", "netns", "exec", netns, "ip", "link", "set", box_if, "up")
    _run("ip", "netns", "exec", netns, "ip", "link", "set", "lo", "up")

    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o755)
    Path("/run/sshd").mkdir(exist_ok=True)
    user = ensure_probe_user()
    hostkey, userkey = root / "hostkey", root / "userkey"
    keygen(hostkey)
    keygen(userkey)
    authorized = root / "authorized_keys"
    shutil.copy(root / "userkey.pub", authorized)
    authorized.chmod(0o644)
    kind, b64 = (root / "hostkey.pub").read_text().split()[:2]
    known_hosts = root / "known_hosts"
    known_hosts.write_text(f"{box_ip} {kind} {b64}\n")
    config = write_sshd_config(
        root,
        port=22,
        listen=box_ip,
        hostkey=hostkey,
        authorized_keys=authorized,
        extra=["AllowTcpForwarding yes"],
    )
    sshd = [SSHD, "-f", str(config), "-E", str(root / "sshd.log")]
    if mounts:
        binds = "".join(
            f"mount --bind {shlex.quote(str(src))} {shlex.quote(dst)}; "
            for dst, src in mounts.items()
        )
        script = f"set -e; {binds}exec {shlex.join(sshd)}"
        sshd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]
    _run("ip", "netns", "exec", netns, *sshd)
    box = Box(name, netns, box_ip, 22, user, userkey, known_hosts, root)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with socket.socket() as s:
            s.settimeout(1)
            if s.connect_ex((box_ip, 22)) == 0:
                return box
        time.sleep(0.05)
    box.close()
    raise RuntimeError(f"sshd in {netns} did not listen: {(root / 'sshd.log').read_text()}")
