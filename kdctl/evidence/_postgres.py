"""The evidence store on PostgreSQL (psycopg 3, the `postgres` extra): one store a team shares.

The password never sits in the inventory: it comes from `evidence.password_env`, from
`evidence.password_file`, or from libpq's own PGPASSWORD and PGPASSFILE; a URL is shown with
its password masked, and the password is registered with the scrubber like an API key.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from kdctl import _redact as redact
from kdctl.errors import InfraError, InputError, KdctlError
from kdctl.evidence._schema import POSTGRES_AFTER, SCHEMA_VERSION
from kdctl.evidence.store import EvidenceStore

# pg_advisory_xact_lock keys: kdctl's schema migrations, and merges of records from elsewhere.
_MIGRATION_LOCK = 0x6B6463746C01
_MERGE_LOCK = 0x6B6463746C02


def shown_url(url: str) -> str:
    """The URL with its password masked, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def _psycopg() -> Any:
    try:
        import psycopg
    except ImportError:
        raise InputError(
            "a postgresql:// evidence store needs the postgres extra: pip install 'kdctl[postgres]'"
        ) from None
    return psycopg


def connect(url: str, *, password: str | None = None, timeout_s: int = 10) -> Any:
    """An autocommit connection to the shared store; InputError or InfraError naming it."""
    psycopg = _psycopg()
    redact.register(password, urlsplit(url).password)
    try:
        return psycopg.connect(
            url,
            autocommit=True,
            connect_timeout=timeout_s,
            **({"password": password} if password else {}),
        )
    except psycopg.Error as exc:
        raise explain(shown_url(url), exc) from None


def explain(where: str, exc: BaseException) -> KdctlError:
    text = redact.scrub(str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc))
    if "password authentication failed" in text or "no password supplied" in text:
        return InputError(
            f"{where}: the evidence store refused the login ({text}); set "
            "evidence.password_env or evidence.password_file, or PGPASSWORD / PGPASSFILE"
        )
    return InfraError(f"{where}: the evidence store failed: {text}")


def placeholders(sql: str) -> str:
    """kdctl's statements use `?`; psycopg takes `%s`, and a literal % doubled."""
    return sql.replace("%", "%%").replace("?", "%s")


class PostgresStore(EvidenceStore):
    _order = "seq"

    def __init__(self, url: str, *, password: str | None = None):
        self.url = url
        self.where = shown_url(url)
        self.errors = (error_type(),)
        self._db = connect(url, password=password)
        try:
            self._migrate(self._version_in, self._set_version)
        except self.errors as exc:
            self._db.close()
            raise self.explain(exc) from None

    def close(self) -> None:
        self._db.close()

    def explain(self, exc: BaseException) -> KdctlError:
        return explain(self.where, exc)

    @property
    def schema_version(self) -> int:
        row = self._db.execute("SELECT version FROM kdctl_schema").fetchone()
        return int(row[0]) if row else 0

    def _version_in(self, db: Any) -> int:
        db.execute("CREATE TABLE IF NOT EXISTS kdctl_schema (version INTEGER NOT NULL)")
        row = db.execute("SELECT version FROM kdctl_schema").fetchone()
        return int(row[0]) if row else 0

    def _set_version(self, db: Any) -> None:
        db.execute("DELETE FROM kdctl_schema")
        db.execute("INSERT INTO kdctl_schema (version) VALUES (%s)", (SCHEMA_VERSION,))

    @contextmanager
    def _transaction(self) -> Iterator[Any]:
        with self._db.transaction():
            yield self._db

    def _lock_schema(self, db: Any) -> None:
        # Two kdctl processes opening a new store at once: one creates, the other waits.
        db.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))

    def _dialect(self, version: int, ddl: str) -> str:
        after = POSTGRES_AFTER.get(version)
        return f"{ddl};{after}" if after else ddl

    def _serialize_merges(self, db: Any) -> None:
        db.execute("SELECT pg_advisory_xact_lock(%s)", (_MERGE_LOCK,))

    def _query(self, sql: str, args: Sequence[object] = ()) -> list[tuple[Any, ...]]:
        return self._run(self._db, sql, args)

    def _run(self, db: Any, sql: str, args: Sequence[object] = ()) -> list[tuple[Any, ...]]:
        return run(db, sql, args)


def run(db: Any, sql: str, args: Sequence[object] = ()) -> list[tuple[Any, ...]]:
    """One statement in kdctl's `?` style; its rows, or none for a statement that returns none."""
    cur = db.execute(placeholders(sql), list(args))
    return list(cur.fetchall()) if cur.description is not None else []


def error_type() -> type[BaseException]:
    """psycopg's base error, for the stores' error handling."""
    return _psycopg().Error  # type: ignore[no-any-return]
