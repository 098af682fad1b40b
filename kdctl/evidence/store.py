"""The evidence store: gate results and baselines in one SQLite file in the state directory."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from pydantic import ValidationError

from kdctl._redact import scrub_data
from kdctl._statefile import explain, guarded
from kdctl.errors import InputError
from kdctl.evidence._schema import MIGRATIONS, SCHEMA_VERSION
from kdctl.records import Baseline, BaselineKind, GateResult

DB_NAME = "evidence.sqlite"


class EvidenceStore:
    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InputError(f"{path.parent}: cannot create the state directory: {exc}") from None
        try:
            self._db = sqlite3.connect(path, timeout=30, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._migrate()
        except (sqlite3.Error, OSError) as exc:
            raise explain(path, exc) from None

    @classmethod
    def in_state_dir(cls, state_dir: Path) -> EvidenceStore:
        return cls(state_dir / DB_NAME)

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> EvidenceStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    @property
    def schema_version(self) -> int:
        return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    def _migrate(self) -> None:
        if self.schema_version == SCHEMA_VERSION:
            return
        # Under the write lock, and the version read again there: two kdctl processes opening
        # a new store at once must not both create its tables.
        with self._tx() as db:
            current = self.schema_version
            if current > SCHEMA_VERSION:
                raise InputError(
                    f"{self.path}: schema version {current} is newer than this kdctl "
                    f"understands ({SCHEMA_VERSION}); upgrade kdctl"
                )
            for version in range(current, SCHEMA_VERSION):
                for statement in MIGRATIONS[version].split(";"):
                    if statement.strip():
                        db.execute(statement)
            # PRAGMA takes no parameters; the value is an int from our own list.
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    @guarded
    def record(self, result: GateResult) -> None:
        with self._tx() as db:
            _insert(db, _scrubbed(result), None)

    @guarded
    def record_baseline(self, baseline: Baseline) -> None:
        with self._tx() as db:
            _insert(db, _scrubbed(baseline), None)

    def _load(self, rows: list[tuple[str]]) -> list[GateResult]:
        try:
            return [GateResult.model_validate_json(row[0]) for row in rows]
        except ValidationError as exc:
            raise InputError(f"{self.path}: a stored result is corrupt: {exc}") from None

    @guarded
    def results(
        self, *, gate: str | None = None, backend: str | None = None, limit: int | None = None
    ) -> list[GateResult]:
        """Newest first."""
        sql = (
            "SELECT body FROM results WHERE (? IS NULL OR gate = ?) AND (? IS NULL OR backend = ?)"
        )
        sql += " ORDER BY ended_at DESC, rowid DESC"
        args: list[object] = [gate, gate, backend, backend]
        if limit is not None:
            sql += " LIMIT ?"
            args.append(limit)
        return self._load(self._db.execute(sql, args).fetchall())

    @guarded
    def latest(self, gate: str, backend: str) -> GateResult | None:
        found = self.results(gate=gate, backend=backend, limit=1)
        return found[0] if found else None

    @guarded
    def get(self, result_id: str) -> GateResult | None:
        rows = self._db.execute("SELECT body FROM results WHERE id = ?", (result_id,)).fetchall()
        if not rows:
            # A prefix, as git takes abbreviated commit ids, when it is unambiguous.
            rows = self._db.execute(
                "SELECT body FROM results WHERE id LIKE ? || '%' LIMIT 2", (result_id,)
            ).fetchall()
            if len(rows) > 1:
                raise InputError(f"result id {result_id!r} is ambiguous: give more characters")
        found = self._load(rows)
        return found[0] if found else None

    @guarded
    def baselines(
        self,
        *,
        backend: str | None = None,
        kind: BaselineKind | None = None,
        workload_hash: str | None = None,
    ) -> list[Baseline]:
        rows = self._db.execute(
            "SELECT body FROM baselines WHERE (? IS NULL OR backend = ?)"
            " AND (? IS NULL OR kind = ?) AND (? IS NULL OR workload_hash = ?)"
            " ORDER BY created_at DESC, rowid DESC",
            (backend, backend, kind, kind, workload_hash, workload_hash),
        ).fetchall()
        try:
            return [Baseline.model_validate_json(row[0]) for row in rows]
        except ValidationError as exc:
            raise InputError(f"{self.path}: a stored baseline is corrupt: {exc}") from None

    @guarded
    def merge(
        self, results: list[GateResult], baselines: list[Baseline], *, source: str
    ) -> tuple[int, int]:
        """Add records from elsewhere in one transaction: all of them or none.

        A record already here with the same content is skipped; the same id with different
        content is refused, since one of the two has been altered.
        """
        added = skipped = 0
        with self._tx() as db:
            for table, records in (("results", results), ("baselines", baselines)):
                for rec in records:
                    row = db.execute(
                        f"SELECT body FROM {table} WHERE id = ?",  # noqa: S608 - fixed names
                        (rec.id,),
                    ).fetchone()
                    body = rec.model_dump_json()
                    if row is not None:
                        if canonical(row[0]) != canonical(body):
                            raise InputError(
                                f"{source}: {table[:-1]} {rec.id} differs from the one already "
                                f"stored with that id; refusing the whole file"
                            )
                        skipped += 1
                        continue
                    _insert(db, rec, source)
                    added += 1
        return added, skipped


R = TypeVar("R", GateResult, Baseline)


def _scrubbed(rec: R) -> R:
    """What kdctl measured may quote an engine's log: no secret it knows is kept."""
    return type(rec).model_validate(scrub_data(rec.model_dump(mode="json")))


def _insert(db: sqlite3.Connection, rec: GateResult | Baseline, source: str | None) -> None:
    if isinstance(rec, GateResult):
        db.execute(
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
        db.execute(
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


def canonical(body: str) -> str:
    return json.dumps(json.loads(body), sort_keys=True)
