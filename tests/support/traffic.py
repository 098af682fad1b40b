"""What the traffic tests share: the roadmap their inventories point at, a client load through
the front that counts every failed request, kdctl killed at a journal row, and what the
router's file and the evidence say now."""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.conftest import engine_pair, kdctl, kdctl_start, write_inventory
from tests.support.nginx import kdctl_front, router_entry
from tests.support.sshd import free_port

ROADMAP = {
    "title": "Traffic test",
    "serving": "baseline",
    "candidate": "candidate",
    "phases": [
        {
            "id": "ready",
            "title": "Healthy and exact",
            "criteria": [
                {"gate": "health"},
                {"gate": "exactness", "settings": {"mode": "strict"}},
            ],
        },
        {
            "id": "cutover",
            "title": "Cutover",
            "depends_on": ["ready"],
            "criteria": [
                {"name": "soak", "gate": "sign-off"},
            ],
        },
    ],
}


@dataclass
class Load:
    """Streaming and non-streaming requests through the front until stopped: every response
    must be 2xx and complete, every stream must end with its final chunk."""

    url: str
    # The key the front requires, sent as clients send it (Authorization: Bearer).
    api_key: str | None = None
    # A client as HTTP asks: a 503 with Retry-After (the front while engines swap) is asked
    # again, sooner than it says, until the deadline; not a lost request.
    retry_draining: bool = False
    # Between one thread's requests: three threads still keep requests in flight through every
    # transition (about 23 a second, each thread's in flight a quarter of the time, against a
    # reference server on an idle machine), at about 0.36 of a core of the engine's, where 0.05
    # took 0.65 (32 a second): the engines share two cores with the rest of the suite.
    pause_s: float = 0.1
    sent: int = 0
    retried: int = 0
    failures: list[str] = field(default_factory=list)
    served_by: dict[str, int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def _one(self, client: httpx.Client, stream: bool, i: int) -> None:
        body = {
            "input_ids": [11 + i % 50, 12, 13],
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
            "stream": stream,
        }
        deadline = time.monotonic() + 120
        failure = None
        try:
            while True:
                if stream:
                    with client.stream("POST", self.url + "/generate", json=body) as r:
                        lines = [ln for ln in r.iter_lines() if ln.startswith("data:")]
                        ok = r.status_code == 200 and lines and lines[-1] == "data: [DONE]"
                        failure = None if ok else f"stream HTTP {r.status_code}, ended {lines[-1:]}"
                else:
                    r = client.post(self.url + "/generate", json=body)
                    ok = r.status_code == 200 and "text" in r.json()
                    failure = None if ok else f"HTTP {r.status_code}: {r.text[:80]}"
                draining = r.status_code == 503 and "retry-after" in r.headers
                if not (failure and draining and self.retry_draining):
                    break
                if time.monotonic() > deadline:
                    failure += " (still draining after 120 s)"
                    break
                self.retried += 1
                time.sleep(0.2)
            who = r.headers.get("x-kdctl-backend", "?")
            self.served_by[who] = self.served_by.get(who, 0) + 1
        except httpx.HTTPError as exc:
            failure = f"{type(exc).__name__}: {exc}"
        if failure:
            self.failures.append(failure)
        self.sent += 1

    def _loop(self, stream: bool) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        with httpx.Client(timeout=30, headers=headers) as client:
            i = 0
            deadline = time.monotonic() + 240  # bounded in time
            while not self._stop.is_set() and i < 2000 and time.monotonic() < deadline:
                self._one(client, stream, i)
                i += 1
                self._stop.wait(self.pause_s)

    def __enter__(self) -> Load:
        for stream in (True, False, True):
            t = threading.Thread(target=self._loop, args=(stream,), daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)


def weights(include: Path) -> dict[str, int]:
    from kdctl.traffic.nginx import parse_config

    return parse_config(include.read_text(), source=str(include)).weights


def promotion(inv: str) -> dict[str, Any]:
    """The newest promotion result: what the last cutover or rollback left the router doing."""
    listed = kdctl("evidence", "list", "--gate", "promotion", "--json", "-i", inv)
    newest = json.loads(listed.out)["results"][0]
    return {
        "verdict": newest["verdict"],
        "reason": newest["reasons"][0],
        **{m["name"]: m["value"] for m in newest["metrics"]},
    }


def kill_when(args: list[str], db: Path, sql: str, want: int) -> None:
    """Run kdctl and SIGKILL it as soon as `sql` over the journal counts `want` rows."""
    proc = kdctl_start(*args)
    # Below this poller's priority: on a loaded machine the poller, not the process it
    # watches, gets the core, so the kill lands between row `want` and the next.
    os.setpriority(os.PRIO_PROCESS, proc.pid, 5)
    deadline = time.monotonic() + 120
    conn: sqlite3.Connection | None = None
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                # One connection, polled: each query in autocommit reads the latest commit,
                # and reopening the file every 2 ms took a core from the processes measured.
                if conn is None and db.exists():
                    conn = sqlite3.connect(db, isolation_level=None)
                if conn is not None and conn.execute(sql).fetchone()[0] >= want:
                    proc.kill()
                    break
            except sqlite3.OperationalError:
                pass  # the journal is still being created
            time.sleep(0.002)
    finally:
        if conn is not None:
            conn.close()
    proc.wait(30)


def nginx_front(
    tmp_path: Path, nginx: str, baseline: str, candidate: str, **backend: Any
) -> Iterator[dict[str, Any]]:
    """nginx with kdctl's configuration in front of two engines at these URLs, sending all to
    `baseline`; `backend` fields go into both engines' inventory entries."""
    root = tmp_path / "nginx"
    root.mkdir()
    (tmp_path / "roadmap.yaml").write_text(yaml.safe_dump(ROADMAP, sort_keys=False))
    pair = engine_pair(baseline, candidate)
    for entry in pair.values():
        entry.update(backend)
    data = {
        "hosts": {"local": {"transport": "local"}},
        "backends": pair,
        "router": router_entry(nginx, root, free_port()),
        "gates": {"exactness": {"max_new_tokens": 6, "top_k": 3}},
        "roadmap": "roadmap.yaml",
        "state_dir": "state",
    }
    inv_path = write_inventory(tmp_path / "inv.yaml", data)
    with kdctl_front(inv_path, {"baseline": 100}) as url:
        yield {
            "inv": inv_path,
            "url": url,
            "include": root / "kdctl.conf",
            "data": data,
            "root": root,
        }
