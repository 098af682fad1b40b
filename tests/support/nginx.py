"""A real nginx under its own prefix on loopback: nothing under /etc is read or written."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"


def start_nginx(root: Path, servers: str, ports: list[int]) -> Path:
    """Start nginx with `servers` (server blocks) inside an http block; return its pidfile."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "tmp").mkdir(exist_ok=True)
    conf = root / "nginx.conf"
    temp = "\n".join(
        f"  {kind}_temp_path {root / 'tmp' / kind};"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    conf.write_text(
        f"""worker_processes 1;
pid {root / "nginx.pid"};
error_log {root / "error.log"} warn;
events {{ worker_connections 256; }}
http {{
  access_log off;
{temp}
{servers}
}}
"""
    )
    subprocess.run([NGINX, "-p", str(root), "-c", str(conf)], check=True, capture_output=True)
    deadline = time.monotonic() + 10
    for port in ports:
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"nginx did not listen on {port}")
            time.sleep(0.02)
    return root / "nginx.pid"


def stop_nginx(pidfile: Path) -> None:
    try:
        pid = int(pidfile.read_text())
        os.kill(pid, signal.SIGQUIT)
    except (OSError, ValueError):
        return
    for _ in range(200):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.02)
