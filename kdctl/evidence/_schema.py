"""The evidence database's schema, as an ordered list of migrations.

A database records the version it is at; opening it applies every later migration in one
transaction. Never edit a released migration: add the next one. SQLite and PostgreSQL take the
same list; PostgreSQL adds after a version what SQLite has built in (POSTGRES_AFTER): an
insertion-order column like SQLite's rowid, so records that ended at the same instant list in
the order they came.
"""

from __future__ import annotations

MIGRATIONS: list[str] = [
    # 1: gate results
    """
    CREATE TABLE results (
        id TEXT PRIMARY KEY,
        gate TEXT NOT NULL,
        backend TEXT NOT NULL,
        baseline TEXT,
        verdict TEXT NOT NULL,
        started_at TEXT NOT NULL,
        ended_at TEXT NOT NULL,
        body TEXT NOT NULL,
        imported_from TEXT
    );
    CREATE INDEX results_by_gate ON results (gate, backend, ended_at);
    """,
    # 2: baselines (golden outputs and throughput runs) recorded from the engine serving today
    """
    CREATE TABLE baselines (
        id TEXT PRIMARY KEY,
        backend TEXT NOT NULL,
        kind TEXT NOT NULL,
        workload_hash TEXT NOT NULL,
        created_at TEXT NOT NULL,
        body TEXT NOT NULL,
        imported_from TEXT
    );
    CREATE INDEX baselines_by_workload ON baselines (backend, kind, workload_hash, created_at);
    """,
]

SCHEMA_VERSION = len(MIGRATIONS)
# By index into MIGRATIONS.
POSTGRES_AFTER: dict[int, str] = {
    0: "ALTER TABLE results ADD COLUMN seq BIGSERIAL",
    1: "ALTER TABLE baselines ADD COLUMN seq BIGSERIAL",
}
