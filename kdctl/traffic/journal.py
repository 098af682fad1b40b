"""The cutover journal and lock: every step written before and after it is applied, in SQLite
in the state directory, so an interrupted cutover can be resumed or undone; and an exclusive
lock, so two kdctl processes never move traffic at once."""

from __future__ import annotations

import fcntl
import getpass
import json
import os
import socket
import sqlite3
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from kdctl._redact import scrub, scrub_data
from kdctl._statefile import explain, guarded
from kdctl.errors import KdctlError
from kdctl.records import utcnow

# "abandoned": an interrupted cutover that a later cutover or rollback superseded; it is never
# resumed.
CutoverState = Literal["running", "succeeded", "failed", "rolled_back", "abandoned"]
# "written": the router's change is in place but not yet applied (nginx: the file, before its
# reload); a resume applies it before it goes on.
StepPhase = Literal["started", "written", "done", "failed"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS cutovers (
    id TEXT PRIMARY KEY, from_backend TEXT NOT NULL, to_backend TEXT NOT NULL,
    strategy TEXT NOT NULL, plan TEXT NOT NULL, state TEXT NOT NULL, forced INTEGER NOT NULL,
    reason TEXT, started_at TEXT NOT NULL, ended_at TEXT, holder TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS steps (
    cutover_id TEXT NOT NULL REFERENCES cutovers(id), idx INTEGER NOT NULL, kind TEXT NOT NULL,
    detail TEXT NOT NULL, phase TEXT NOT NULL, at TEXT NOT NULL, note TEXT);
"""


class LockHeld(KdctlError):
    """Another kdctl holds the traffic lock: a negative answer, not an infrastructure error."""

    exit_code = 1


class StepRecord(BaseModel):
    idx: int
    kind: str
    detail: dict[str, Any]
    phase: StepPhase
    at: datetime
    note: str | None = None


class CutoverRecord(BaseModel):
    id: str
    from_backend: str
    to_backend: str
    strategy: str
    plan: list[dict[str, Any]]
    state: CutoverState
    forced: bool
    reason: str | None
    started_at: datetime
    ended_at: datetime | None
    holder: str
    steps: list[StepRecord] = []

    @property
    def done_steps(self) -> set[int]:
        return {s.idx for s in self.steps if s.phase == "done"}


def holder() -> str:
    return f"{getpass.getuser()}@{socket.gethostname()} pid {os.getpid()}"


class Journal:
    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / "traffic.sqlite"
        self.lock_path = state_dir / "traffic.lock"
        self._lock_fd: int | None = None
        try:
            state_dir.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.executescript(_SCHEMA)
        except (sqlite3.Error, OSError) as exc:
            raise explain(self.path, exc) from None

    def close(self) -> None:
        self.release()
        self._db.close()

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # The lock is an flock on a file: the kernel drops it when its holder dies, even by
    # SIGKILL, so a crashed cutover never leaves traffic locked until someone deletes a file.
    @guarded
    def acquire(self) -> None:
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            who = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another kdctl"
            os.close(fd)
            raise LockHeld(f"another cutover holds the traffic lock: {who}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{holder()} since {utcnow():%Y-%m-%d %H:%M:%SZ}\n".encode(), 0)
        self._lock_fd = fd

    def check_free(self) -> None:
        """LockHeld, naming the holder, when another kdctl is moving traffic now: said before
        anything else, since what it is doing explains any state the router is in."""
        self.acquire()
        self.release()

    def release(self) -> None:
        if self._lock_fd is not None:
            os.ftruncate(self._lock_fd, 0)
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None

    @contextmanager
    def locked(self) -> Iterator[Journal]:
        self.acquire()
        try:
            yield self
        finally:
            self.release()

    @guarded
    def begin(
        self,
        from_backend: str,
        to_backend: str,
        strategy: str,
        plan: list[dict[str, Any]],
        *,
        forced: bool,
    ) -> str:
        cid = uuid.uuid4().hex[:12]
        self.supersede(f"superseded by cutover {cid}")
        self._db.execute(
            "INSERT INTO cutovers (id, from_backend, to_backend, strategy, plan, state, forced,"
            " started_at, holder) VALUES (?, ?, ?, ?, ?, 'running', ?, ?, ?)",
            (
                cid,
                from_backend,
                to_backend,
                strategy,
                json.dumps(plan),
                int(forced),
                utcnow().isoformat(),
                holder(),
            ),
        )
        return cid

    @guarded
    def step(
        self,
        cid: str,
        idx: int,
        kind: str,
        detail: dict[str, Any],
        phase: StepPhase,
        note: str | None = None,
    ) -> None:
        self._db.execute(
            "INSERT INTO steps (cutover_id, idx, kind, detail, phase, at, note)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                cid,
                idx,
                kind,
                json.dumps(scrub_data(detail)),
                phase,
                utcnow().isoformat(),
                scrub(note) if note else note,
            ),
        )

    @guarded
    def supersede(self, reason: str, *, keep: str | None = None) -> None:
        """Every interrupted cutover but `keep` is over: a later order replaced it, so it is
        never resumed. Called under the lock, so none of them is still running."""
        self._db.execute(
            "UPDATE cutovers SET state = 'abandoned', reason = ?, ended_at = ?"
            " WHERE state = 'running' AND id IS NOT ?",
            (reason, utcnow().isoformat(), keep),
        )

    @guarded
    def finish(self, cid: str, state: CutoverState, reason: str | None = None) -> None:
        self._db.execute(
            "UPDATE cutovers SET state = ?, reason = ?, ended_at = ? WHERE id = ?",
            (state, scrub(reason) if reason else reason, utcnow().isoformat(), cid),
        )

    @guarded
    def get(self, cid: str) -> CutoverRecord | None:
        row = self._db.execute(
            "SELECT id, from_backend, to_backend, strategy, plan, state, forced, reason,"
            " started_at, ended_at, holder FROM cutovers WHERE id = ?",
            (cid,),
        ).fetchone()
        if row is None:
            return None
        steps = [
            StepRecord(idx=r[0], kind=r[1], detail=json.loads(r[2]), phase=r[3], at=r[4], note=r[5])
            for r in self._db.execute(
                "SELECT idx, kind, detail, phase, at, note FROM steps WHERE cutover_id = ?"
                " ORDER BY rowid",
                (cid,),
            )
        ]
        return CutoverRecord(
            id=row[0],
            from_backend=row[1],
            to_backend=row[2],
            strategy=row[3],
            plan=json.loads(row[4]),
            state=row[5],
            forced=bool(row[6]),
            reason=row[7],
            started_at=row[8],
            ended_at=row[9],
            holder=row[10],
            steps=steps,
        )

    @guarded
    def latest(self, *, state: CutoverState | None = None) -> CutoverRecord | None:
        row = self._db.execute(
            "SELECT id FROM cutovers WHERE (? IS NULL OR state = ?) ORDER BY started_at DESC,"
            " rowid DESC LIMIT 1",
            (state, state),
        ).fetchone()
        return self.get(row[0]) if row else None
