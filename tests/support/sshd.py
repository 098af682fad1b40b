"""Real OpenSSH sshd instances on loopback, each standing in for one host."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
# A login with a plain POSIX shell and no rc files: a remote command then costs what sshd costs,
# not what the local root's .bashrc (pyenv init) costs, which would dwarf everything measured.
PROBE_USER = "kdctl-probe"


def ensure_probe_user() -> str:
    def exists() -> bool:
        return subprocess.run(["id", "-u", PROBE_USER], capture_output=True).returncode == 0

    if not exists():
        made = subprocess.run(
            ["useradd", "--create-home", "--shell", "/bin/sh", "--password", "*", PROBE_USER],
            capture_output=True,
        )
        # Another test worker may have added it a moment before.
        if made.returncode != 0 and not exists():
            raise RuntimeError(f"useradd {PROBE_USER}: {made.stderr.decode().strip()}")
    return PROBE_USER


# Ports handed out for servers the tests start. Not the kernel's pick (port 0): that comes from
# the ephemeral range, where every client connection also takes its source port, and two workers
# asking at once can be given the same free port, one test's engine then answering for another's.
# Each xdist worker takes its own slice below the ephemeral range instead, and never hands out
# one port twice; the sandbox's fixed ports (30000 and up, 8000) are outside every slice.
_PORTS_LOW, _PORTS_HIGH = 10000, 29000
_handed: set[int] = set()


def free_port() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(worker) if worker.isdigit() else 0
    width = (_PORTS_HIGH - _PORTS_LOW) // max(count, 1)
    # A process of its own (a helper the test runs) starts elsewhere in the worker's slice.
    start = _PORTS_LOW + index * width
    offset = (os.getpid() * 7919) % width
    for i in range(width):
        port = start + (offset + i) % width
        if port in _handed:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed.add(port)
        return port
    raise RuntimeError(f"no free port left in {start}..{start + width - 1}")


def keygen(path: Path) -> None:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", path.name, "-f", str(path)],
        check=True,
    )


def known_hosts_line(port: int, hostkey_pub: Path) -> str:
    kind, b64 = hostkey_pub.read_text().split()[:2]
    return f"[127.0.0.1]:{port} {kind} {b64}\n"


def write_sshd_config(
    root: Path,
    *,
    port: int,
    listen: str,
    hostkey: Path,
    authorized_keys: Path,
    extra: list[str] | None = None,
) -> Path:
    """The test hosts' sshd_config: key logins only, its own host key and pidfile under
    `root`, SFTP (kdctl moves files with it), room for many parallel sessions."""
    config = root / "sshd_config"
    config.write_text(
        "\n".join(
            [
                f"Port {port}",
                f"ListenAddress {listen}",
                f"HostKey {hostkey}",
                f"AuthorizedKeysFile {authorized_keys}",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "PermitRootLogin prohibit-password",
                f"PidFile {root / 'sshd.pid'}",
                "StrictModes no",
                "UsePAM no",
                "MaxStartups 100:30:200",
                "MaxSessions 50",
                "Subsystem sftp internal-sftp",
                *(extra or []),
                "",
            ]
        )
    )
    return config


@dataclass
class Sshd:
    name: str
    port: int
    root: Path
    hostkey: Path
    proc_pid: int | None = None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def pidfile(self) -> Path:
        return self.root / "sshd.pid"

    def stop(self) -> None:
        try:
            pid = int(self.pidfile.read_text())
        except (OSError, ValueError):
            return
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        for _ in range(100):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.02)


def start_sshd(
    root: Path, name: str, authorized_keys: Path, *, env: dict[str, str] | None = None
) -> Sshd:
    """Start one sshd on a free loopback port with its own host key; wait until it listens."""
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o755)
    Path("/run/sshd").mkdir(exist_ok=True)
    hostkey = root / "hostkey"
    if not hostkey.exists():
        keygen(hostkey)
    port = free_port()
    setenv = " ".join(f"{k}={v}" for k, v in (env or {}).items())
    config = write_sshd_config(
        root,
        port=port,
        listen="127.0.0.1",
        hostkey=hostkey,
        authorized_keys=authorized_keys,
        extra=[f"SetEnv {setenv}"] if setenv else [],
    )
    subprocess.run([SSHD, "-f", str(config), "-E", str(root / "log")], check=True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return Sshd(name=name, port=port, root=root, hostkey=hostkey, env=env or {})
        time.sleep(0.02)
    raise RuntimeError(f"sshd {name} did not listen on {port}: {(root / 'log').read_text()}")


class SshdFleet:
    """Several sshd hosts sharing one user key, with a known_hosts file listing all of them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        # sshd reads authorized_keys as the user logging in, so it must be able to reach it.
        root.chmod(0o755)
        self.user = ensure_probe_user()
        self.userkey = root / "userkey"
        keygen(self.userkey)
        self.authorized_keys = root / "authorized_keys"
        shutil.copy(root / "userkey.pub", self.authorized_keys)
        self.authorized_keys.chmod(0o644)
        self.known_hosts = root / "known_hosts"
        self.known_hosts.write_text("")
        self.hosts: dict[str, Sshd] = {}

    def add(self, name: str, *, env: dict[str, str] | None = None) -> Sshd:
        sshd = start_sshd(self.root / name, name, self.authorized_keys, env=env)
        self.hosts[name] = sshd
        with self.known_hosts.open("a") as fh:
            fh.write(known_hosts_line(sshd.port, sshd.hostkey.with_suffix(".pub")))
        return sshd

    def host_entry(self, name: str, **extra: object) -> dict[str, object]:
        """An inventory `hosts:` entry for one of the fleet's sshd hosts."""
        sshd = self.hosts[name]
        entry: dict[str, object] = {
            "address": "127.0.0.1",
            "port": sshd.port,
            "user": self.user,
            "identity_file": str(self.userkey),
            "known_hosts": str(self.known_hosts),
        }
        entry.update(extra)
        return entry

    def stop(self) -> None:
        for sshd in self.hosts.values():
            sshd.stop()
