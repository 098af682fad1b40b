"""A real nginx under its own prefix on loopback: nothing under /etc is read or written."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

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


def router_entry(nginx: str, root: Path, port: int, serving: str = "baseline") -> dict[str, Any]:
    """An inventory's `router:` for kdctl's nginx under its own prefix `root`, on loopback."""
    return {
        "kind": "nginx",
        "host": "local",
        "listen": f"127.0.0.1:{port}",
        "serving": serving,
        "include": str(root / "kdctl.conf"),
        "nginx": nginx,
        "prefix": str(root),
        "conf": str(root / "nginx.conf"),
    }


@contextmanager
def kdctl_front(inv_path: Path, weights: dict[str, int], *, wait: bool = True) -> Iterator[str]:
    """nginx running kdctl's own configuration of the inventory's router (`router_entry`),
    rendered for `weights`; its URL, answering /health where `wait`; stopped on the way out."""
    from kdctl.backends import wait_http
    from kdctl.inventory import load_inventory
    from kdctl.traffic.nginx import NginxRouter
    from kdctl.transports import TransportPool

    inv = load_inventory(inv_path)
    spec = inv.spec.router
    assert spec is not None and spec.prefix is not None
    include = Path(spec.include)
    with TransportPool(inv) as pool:
        router = NginxRouter(inv, spec, pool.get(spec.host))  # type: ignore[arg-type]
        include.write_text(router.render(weights))
    port = int(spec.listen.rpartition(":")[2])
    pidfile = start_nginx(Path(spec.prefix), f"  include {include};", [port])
    url = f"http://127.0.0.1:{port}"
    try:
        if wait:
            wait_http(url + "/health")
        yield url
    finally:
        stop_nginx(pidfile)
