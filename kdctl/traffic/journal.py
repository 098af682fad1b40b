"""The cutover journal and lock: every step written before and after it is applied, so an
interrupted cutover can be resumed or undone; and an exclusive lock, so two kdctl processes
never move traffic at once. In SQLite in the state directory with a file lock, or, where the
team shares a PostgreSQL evidence store, there, with an advisory lock held by the session:
either is dropped when its holder dies, even by SIGKILL."""

from __future__ import annotations

import abc
import fcntl
import getpass
import json
import os
import socket
import sqlite3
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from kdctl._redact import scrub, scrub_data
from kdctl._statefile import explain, explained
from kdctl.errors import KdctlError
from kdctl.evidence import error_type, explain_postgres, run, shared_url, shown_url
from kdctl.inventory import LoadedInventory
from kdctl.records import utcnow

# "abandoned": an interrupted cutover that a later cutover or rollback superseded; it is never
# resumed.
# paused: a rolling cutover stopped for a person after a box failed (that box back on its old
# engine); `cutover --resume` goes on from there, `rollback` moves every box back.
CutoverState = Literal["running", "succeeded", "failed", "rolled_back", "abandoned", "paused"]
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

    def written_not_done(self) -> dict[str, int] | None:
        """The weights of its last router change where that change was written and never
        done nor failed (kdctl stopped between writing a router's file and applying it);
        None where its last change finished, or it made none."""
        changes = [s for s in self.steps if s.kind in ("set-weights", "rollback-set-weights")]
        if not changes:
            return None
        last = max(s.idx for s in changes)
        phases = {s.phase for s in changes if s.idx == last}
        if "written" not in phases or phases & {"done", "failed"}:
            return None
        weights = next(s.detail.get("weights") for s in changes if s.idx == last)
        if not isinstance(weights, dict):
            return None
        return {k: int(v) for k, v in weights.items() if int(v) > 0}


def holder() -> str:
    return f"{getpass.getuser()}@{socket.gethostname()} pid {os.getpid()}"


class Journal(abc.ABC):
    """The journal's statements, over either database (`?` placeholders)."""

    where: str
    errors: tuple[type[BaseException], ...]
    # A row's insertion order: SQLite's rowid, PostgreSQL's seq.
    _order = "rowid"

    @abc.abstractmethod
    def _exec(self, sql: str, args: Sequence[object] = ()) -> list[tuple[Any, ...]]: ...

    @abc.abstractmethod
    def explain(self, exc: BaseException) -> KdctlError: ...

    @abc.abstractmethod
    def acquire(self) -> None:
        """The traffic lock, or LockHeld naming who holds it."""

    @abc.abstractmethod
    def release(self) -> None: ...

    @abc.abstractmethod
    def _close(self) -> None: ...

    def close(self) -> None:
        self.release()
        self._close()

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def check_free(self) -> None:
        """LockHeld, naming the holder, when another kdctl is moving traffic now: said before
        anything else, since what it is doing explains any state the router is in."""
        self.acquire()
        self.release()

    @contextmanager
    def locked(self) -> Iterator[Journal]:
        self.acquire()
        try:
            yield self
        finally:
            self.release()

    @explained
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
        self._exec(
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

    @explained
    def step(
        self,
        cid: str,
        idx: int,
        kind: str,
        detail: dict[str, Any],
        phase: StepPhase,
        note: str | None = None,
    ) -> None:
        self._exec(
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

    @explained
    def supersede(self, reason: str, *, keep: str | None = None) -> None:
        """Every interrupted cutover but `keep` is over: a later order replaced it, so it is
        never resumed. Called under the lock, so none of them is still running."""
        self._exec(
            "UPDATE cutovers SET state = 'abandoned', reason = ?, ended_at = ?"
            " WHERE state IN ('running', 'paused') AND (CAST(? AS TEXT) IS NULL OR id <> ?)",
            (reason, utcnow().isoformat(), keep, keep),
        )

    @explained
    def reopen(self, cid: str) -> None:
        """A paused rollout running again (`cutover --resume`)."""
        self._exec(
            "UPDATE cutovers SET state = 'running', reason = NULL, ended_at = NULL WHERE id = ?",
            (cid,),
        )

    @explained
    def finish(self, cid: str, state: CutoverState, reason: str | None = None) -> None:
        self._exec(
            "UPDATE cutovers SET state = ?, reason = ?, ended_at = ? WHERE id = ?",
            (state, scrub(reason) if reason else reason, utcnow().isoformat(), cid),
        )

    @explained
    def get(self, cid: str) -> CutoverRecord | None:
        rows = self._exec(
            "SELECT id, from_backend, to_backend, strategy, plan, state, forced, reason,"
            " started_at, ended_at, holder FROM cutovers WHERE id = ?",
            (cid,),
        )
        if not rows:
            return None
        row = rows[0]
        columns = "idx, kind, detail, phase, at, note"
        order = f"ORDER BY {self._order}"
        steps = [
            StepRecord(idx=r[0], kind=r[1], detail=json.loads(r[2]), phase=r[3], at=r[4], note=r[5])
            for r in self._exec(
                f"SELECT {columns} FROM steps WHERE cutover_id = ? {order}",  # noqa: S608
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

    @explained
    def latest(self, *, state: CutoverState | None = None) -> CutoverRecord | None:
        order = f"ORDER BY started_at DESC, {self._order} DESC"
        rows = self._exec(
            f"SELECT id FROM cutovers WHERE (CAST(? AS TEXT) IS NULL OR state = ?) {order} LIMIT 1",  # noqa: S608
            (state, state),
        )
        return self.get(rows[0][0]) if rows else None


class SqliteJournal(Journal):
    """`traffic.sqlite` in the state directory; the lock an flock on `traffic.lock`, which the
    kernel drops when its holder dies, so a crashed cutover never leaves traffic locked until
    someone deletes a file."""

    errors = (sqlite3.Error, OSError)

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / "traffic.sqlite"
        self.where = str(self.path)
        self.lock_path = state_dir / "traffic.lock"
        self._lock_fd: int | None = None
        try:
            state_dir.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.executescript(_SCHEMA)
        except (sqlite3.Error, OSError) as exc:
            raise explain(self.path, exc) from None

    def explain(self, exc: BaseException) -> KdctlError:
        return explain(self.path, exc)

    def _exec(self, sql: str, args: Sequence[object] = ()) -> list[tuple[Any, ...]]:
        return list(self._db.execute(sql, args).fetchall())

    def _close(self) -> None:
        self._db.close()

    @explained
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

    def release(self) -> None:
        if self._lock_fd is not None:
            os.ftruncate(self._lock_fd, 0)
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None


# pg_advisory_lock keys: the traffic lock (held by the session for a whole cutover), and the
# journal's schema (held by a transaction while its tables are made).
TRAFFIC_LOCK = 0x6B6463746C10
_SCHEMA_LOCK = 0x6B6463746C11


class PostgresJournal(Journal):
    """The journal in the team's PostgreSQL store; the lock a session-level advisory lock, which
    the server drops when the session ends, however kdctl ends."""

    _order = "seq"

    def __init__(self, url: str, *, password: str | None = None) -> None:
        from kdctl.evidence import connect

        self.where = shown_url(url)
        self._db = connect(url, password=password)
        self.errors = (error_type(),)
        self._locked = False
        try:
            with self._db.transaction():
                self._db.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        self._db.execute(statement)
                for table in ("cutovers", "steps"):
                    # ALTER TABLE takes an ACCESS EXCLUSIVE lock even where the column is there
                    # already: a journal opened beside a running cutover, whose writes hold
                    # both tables in turn, deadlocked with it. Altered only where it lacks one.
                    has = self._db.execute(
                        "SELECT 1 FROM information_schema.columns WHERE table_schema = "
                        "current_schema() AND table_name = %s AND column_name = 'seq'",
                        (table,),
                    ).fetchone()
                    if has is None:
                        self._db.execute(f"ALTER TABLE {table} ADD COLUMN seq BIGSERIAL")
                self._db.execute("CREATE TABLE IF NOT EXISTS traffic_lock (holder TEXT NOT NULL)")
        except self.errors as exc:
            self._db.close()
            raise self.explain(exc) from None

    def explain(self, exc: BaseException) -> KdctlError:
        return explain_postgres(self.where, exc)

    def _exec(self, sql: str, args: Sequence[object] = ()) -> list[tuple[Any, ...]]:
        return run(self._db, sql, args)

    def _close(self) -> None:
        self._db.close()

    @explained
    def acquire(self) -> None:
        ((got,),) = self._exec("SELECT pg_try_advisory_lock(?)", (TRAFFIC_LOCK,))
        if not got:
            rows = self._exec("SELECT holder FROM traffic_lock")
            who = rows[0][0] if rows else "another kdctl"
            raise LockHeld(f"another cutover holds the traffic lock: {who}")
        self._locked = True
        with self._db.transaction():
            self._exec("DELETE FROM traffic_lock")
            self._exec(
                "INSERT INTO traffic_lock (holder) VALUES (?)",
                (f"{holder()} since {utcnow():%Y-%m-%d %H:%M:%SZ}",),
            )

    def release(self) -> None:
        if self._locked and not self._db.closed:
            self._exec("DELETE FROM traffic_lock")
            self._exec("SELECT pg_advisory_unlock(?)", (TRAFFIC_LOCK,))
        self._locked = False


def open_journal(inv: LoadedInventory) -> Journal:
    """Where the evidence goes, the journal goes: the team's PostgreSQL store, else SQLite in
    the state directory."""
    url = shared_url(inv)
    if url:
        return PostgresJournal(url, password=inv.evidence_password())
    return SqliteJournal(inv.state_dir)
