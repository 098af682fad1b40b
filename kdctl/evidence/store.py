"""The evidence store: gate results and baselines, with one interface over two databases.

SQLite, one file in the state directory, is the default and the sandbox's. PostgreSQL is a
team's shared store (`evidence: {url: postgresql://...}` or KDCTL_EVIDENCE_URL): CI jobs on the
GPU box record into it while a lead runs `kdctl status` from a laptop. Both hold the same
schema, migrated by the same ordered list of versions (`_schema.py`); every write is one
transaction, so a reader never sees half a result and a killed writer leaves nothing.
"""

from __future__ import annotations

import abc
import contextlib
import json
import os
import sqlite3
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, TypeVar

from pydantic import ValidationError

from kdctl._redact import scrub_data
from kdctl._statefile import explain, explained
from kdctl.errors import InputError, KdctlError
from kdctl.evidence._schema import MIGRATIONS, SCHEMA_VERSION
from kdctl.records import Baseline, BaselineKind, GateResult

DB_NAME = "evidence.sqlite"


class EvidenceStore(abc.ABC):
    """Results and baselines: record, list newest first, get by id or prefix, merge."""

    # For messages: the file, or the URL without its password.
    where: str
    # The database's own error types, which `explain` turns into kdctl's.
    errors: tuple[type[BaseException], ...]
    # A row's insertion order, to order records that ended at the same instant.
    _order = "rowid"

    @abc.abstractmethod
    def close(self) -> None: ...

    @abc.abstractmethod
    def explain(self, exc: BaseException) -> KdctlError: ...

    @abc.abstractmethod
    def _transaction(self) -> AbstractContextManager[Any]: ...

    @abc.abstractmethod
    def _query(self, sql: str, args: Sequence[object] = ()) -> list[tuple[Any, ...]]:
        """Rows of one statement, in `?` placeholder style."""

    @abc.abstractmethod
    def _run(self, db: Any, sql: str, args: Sequence[object] = ()) -> list[tuple[Any, ...]]:
        """One statement inside a transaction `_transaction` opened."""

    @property
    @abc.abstractmethod
    def schema_version(self) -> int: ...

    def __enter__(self) -> EvidenceStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _migrate(self, current: Callable[[Any], int], set_version: Callable[[Any], None]) -> None:
        """Every later version in one transaction, the version read again under its lock:
        two kdctl processes opening a new store at once must not both create its tables."""
        with self._transaction() as db:
            self._lock_schema(db)
            found = current(db)
            if found > SCHEMA_VERSION:
                raise InputError(
                    f"{self.where}: schema version {found} is newer than this kdctl "
                    f"understands ({SCHEMA_VERSION}); upgrade kdctl"
                )
            if found == SCHEMA_VERSION:
                return
            for version in range(found, SCHEMA_VERSION):
                for statement in self._dialect(version, MIGRATIONS[version]).split(";"):
                    if statement.strip():
                        self._run(db, statement)
            set_version(db)

    @abc.abstractmethod
    def _lock_schema(self, db: Any) -> None:
        """Held until the migration's transaction ends."""

    def _dialect(self, version: int, ddl: str) -> str:
        return ddl

    @explained
    def record(self, result: GateResult) -> None:
        with self._transaction() as db:
            self._insert(db, _scrubbed(result), None)

    @explained
    def record_baseline(self, baseline: Baseline) -> None:
        with self._transaction() as db:
            self._insert(db, _scrubbed(baseline), None)

    def _load(self, rows: list[tuple[Any, ...]]) -> list[GateResult]:
        try:
            return [GateResult.model_validate_json(row[0]) for row in rows]
        except ValidationError as exc:
            raise InputError(f"{self.where}: a stored result is corrupt: {exc}") from None

    @explained
    def results(
        self, *, gate: str | None = None, backend: str | None = None, limit: int | None = None
    ) -> list[GateResult]:
        """Newest first."""
        where, args = _filters(gate=gate, backend=backend)
        order = f"ORDER BY ended_at DESC, {self._order} DESC"
        sql = f"SELECT body FROM results {where} {order}"  # noqa: S608 - fixed column names
        if limit is not None:
            sql += " LIMIT ?"
            args.append(limit)
        return self._load(self._query(sql, args))

    @explained
    def count(self) -> tuple[int, int]:
        """(results, baselines)."""
        ((results,),) = self._query("SELECT count(*) FROM results")
        ((baselines,),) = self._query("SELECT count(*) FROM baselines")
        return int(results), int(baselines)

    def latest(self, gate: str, backend: str) -> GateResult | None:
        found = self.results(gate=gate, backend=backend, limit=1)
        return found[0] if found else None

    @explained
    def get(self, result_id: str) -> GateResult | None:
        rows = self._query("SELECT body FROM results WHERE id = ?", (result_id,))
        if not rows:
            # A prefix, as git takes abbreviated commit ids, when it is unambiguous.
            rows = self._query(
                "SELECT body FROM results WHERE id LIKE ? ESCAPE '\\' LIMIT 2",
                (_like_prefix(result_id),),
            )
            if len(rows) > 1:
                raise InputError(f"result id {result_id!r} is ambiguous: give more characters")
        found = self._load(rows)
        return found[0] if found else None

    @explained
    def baselines(
        self,
        *,
        backend: str | None = None,
        kind: BaselineKind | None = None,
        workload_hash: str | None = None,
    ) -> list[Baseline]:
        where, args = _filters(backend=backend, kind=kind, workload_hash=workload_hash)
        order = f"ORDER BY created_at DESC, {self._order} DESC"
        rows = self._query(
            f"SELECT body FROM baselines {where} {order}",  # noqa: S608 - fixed column names
            args,
        )
        try:
            return [Baseline.model_validate_json(row[0]) for row in rows]
        except ValidationError as exc:
            raise InputError(f"{self.where}: a stored baseline is corrupt: {exc}") from None

    @explained
    def merge(
        self, results: list[GateResult], baselines: list[Baseline], *, source: str
    ) -> tuple[int, int]:
        """Add records from elsewhere in one transaction: all of them or none.

        A record already here with the same content is skipped; the same id with different
        content is refused, since one of the two has been altered.
        """
        added = skipped = 0
        with self._transaction() as db:
            self._serialize_merges(db)
            for table, records in (("results", results), ("baselines", baselines)):
                for rec in records:
                    row = self._run(
                        db,
                        f"SELECT body FROM {table} WHERE id = ?",  # noqa: S608 - fixed names
                        (rec.id,),
                    )
                    body = rec.model_dump_json()
                    if row:
                        if canonical(row[0][0]) != canonical(body):
                            raise InputError(
                                f"{source}: {table[:-1]} {rec.id} differs from the one already "
                                f"stored with that id; refusing the whole file"
                            )
                        skipped += 1
                        continue
                    self._insert(db, rec, source)
                    added += 1
        return added, skipped

    @abc.abstractmethod
    def _serialize_merges(self, db: Any) -> None:
        """Two merges of the same records at once must not both insert them."""

    def _insert(self, db: Any, rec: GateResult | Baseline, source: str | None) -> None:
        if isinstance(rec, GateResult):
            self._run(
                db,
                "INSERT INTO results (id, gate, backend, baseline, verdict, started_at, ended_at,"
                " body, imported_from) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    rec.id,
                    rec.gate,
                    rec.backend,
                    rec.baseline,
                    rec.verdict,
                    rec.started_at.isoformat(),
                    rec.ended_at.isoformat(),
                    rec.model_dump_json(),
                    source,
                ),
            )
        else:
            self._run(
                db,
                "INSERT INTO baselines (id, backend, kind, workload_hash, created_at, body,"
                " imported_from) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    rec.id,
                    rec.backend,
                    rec.kind,
                    rec.workload_hash,
                    rec.created_at.isoformat(),
                    rec.model_dump_json(),
                    source,
                ),
            )


def _create(path: Path) -> None:
    """A new store's file, made with its header under another name and linked into place: a
    second kdctl opening the path meanwhile never meets a file of no bytes, which is refused
    as one that was cut. Where another made it first, theirs is kept."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.new")
    try:
        db = sqlite3.connect(tmp, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")  # writes the header
        finally:
            db.close()
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
    finally:
        for leftover in (tmp, tmp.with_name(tmp.name + "-wal"), tmp.with_name(tmp.name + "-shm")):
            leftover.unlink(missing_ok=True)


class SqliteStore(EvidenceStore):
    """One file in the state directory, in WAL mode: readers never wait for the writer."""

    errors = (sqlite3.Error, OSError)

    def __init__(self, path: Path) -> None:
        self.path = path
        self.where = str(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InputError(f"{path.parent}: cannot create the state directory: {exc}") from None
        try:
            if not path.exists():
                _create(path)
            emptied = path.stat().st_size == 0
        except (sqlite3.Error, OSError) as exc:
            raise explain(path, exc) from None
        if emptied:
            # kdctl makes its stores itself and writes their header at once: an existing file
            # of no bytes was cut (a disk fault, a stray `: >`), and opening it would start an
            # empty store over every result, baseline and sign-off without a word.
            raise InputError(
                f"{path}: the evidence database is empty (0 bytes), so it is damaged, not new; "
                "nothing in it was changed. Move it aside and restore a backup, or import an "
                "export (kdctl evidence import), then run again"
            )
        try:
            self._db = sqlite3.connect(path, timeout=30, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA foreign_keys=ON")
            if self.schema_version != SCHEMA_VERSION:
                self._migrate(
                    lambda db: int(db.execute("PRAGMA user_version").fetchone()[0]),
                    # PRAGMA takes no parameters; the value is an int from our own list.
                    lambda db: db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}"),
                )
        except (sqlite3.Error, OSError) as exc:
            raise explain(path, exc) from None

    def close(self) -> None:
        self._db.close()

    def explain(self, exc: BaseException) -> KdctlError:
        return explain(self.path, exc)

    @property
    def schema_version(self) -> int:
        return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def _lock_schema(self, db: Any) -> None:
        return None  # BEGIN IMMEDIATE holds SQLite's write lock already

    def _serialize_merges(self, db: Any) -> None:
        return None  # as here: one writer at a time

    def _query(self, sql: str, args: Sequence[object] = ()) -> list[tuple[Any, ...]]:
        return list(self._db.execute(sql, args).fetchall())

    def _run(self, db: Any, sql: str, args: Sequence[object] = ()) -> list[tuple[Any, ...]]:
        return list(db.execute(sql, args).fetchall())


R = TypeVar("R", GateResult, Baseline)


def _scrubbed(rec: R) -> R:
    """What kdctl measured may quote an engine's log: no secret it knows is kept."""
    return type(rec).model_validate(scrub_data(rec.model_dump(mode="json")))


def _filters(**equal: str | None) -> tuple[str, list[object]]:
    """`WHERE a = ? AND b = ?` for the filters given: only those, so the index serves them."""
    given = {column: value for column, value in equal.items() if value is not None}
    if not given:
        return "", []
    return "WHERE " + " AND ".join(f"{column} = ?" for column in given), list(given.values())


def _like_prefix(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return escaped + "%"


def canonical(body: str) -> str:
    return json.dumps(json.loads(body), sort_keys=True)
