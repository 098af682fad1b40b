"""Evidence: every gate result and baseline, with provenance, in SQLite (the default) or in a
PostgreSQL store a team shares."""

import os

from kdctl.evidence._freshness import (
    Freshness,
    FrontNow,
    age_text,
    baseline_gaps,
    baseline_window,
    currency,
    freshness,
)
from kdctl.evidence._postgres import PostgresStore, connect, error_type, run, shown_url
from kdctl.evidence._postgres import explain as explain_postgres
from kdctl.evidence.store import DB_NAME, EvidenceStore, SqliteStore
from kdctl.evidence.transfer import (
    ENV_KEY,
    EvidenceFile,
    Imported,
    Migrated,
    export_evidence,
    import_evidence,
    migrate,
    read_evidence_file,
    store_digest,
)
from kdctl.inventory import LoadedInventory

ENV_URL = "KDCTL_EVIDENCE_URL"


def shared_url(inv: LoadedInventory) -> str | None:
    """KDCTL_EVIDENCE_URL, else the inventory's `evidence.url`: the shared PostgreSQL store
    that evidence and the cutover journal go to; None for SQLite in the state directory."""
    env = os.environ.get(ENV_URL)
    if env:
        # A password inside the environment's URL stays in the environment; in a file, never.
        check_url(env, where=ENV_URL, password_allowed=True)
    return env or inv.spec.evidence.url


def open_store(inv: LoadedInventory) -> EvidenceStore:
    url = shared_url(inv)
    if not url:
        return SqliteStore(inv.state_dir / DB_NAME)
    return PostgresStore(url, password=inv.evidence_password())


def open_url(url: str, *, password: str | None = None) -> EvidenceStore:
    """A store named on the command line (`evidence migrate --to`)."""
    check_url(url, where="--to", password_allowed=False)
    return PostgresStore(url, password=password)


def check_url(url: str, *, where: str, password_allowed: bool) -> None:
    from urllib.parse import urlsplit

    from kdctl.errors import InputError

    parts = urlsplit(url)
    if parts.scheme not in ("postgresql", "postgres") or not parts.hostname:
        raise InputError(f"{where}: not postgresql://USER@HOST[:PORT]/DATABASE")
    if parts.password is not None and not password_allowed:
        raise InputError(
            f"{where}: the URL holds a password, which a command line shows to every user of "
            "this machine; give it in PGPASSWORD, PGPASSFILE or evidence.password_env"
        )


__all__ = [
    "DB_NAME",
    "ENV_KEY",
    "ENV_URL",
    "EvidenceFile",
    "EvidenceStore",
    "Freshness",
    "FrontNow",
    "Imported",
    "Migrated",
    "PostgresStore",
    "SqliteStore",
    "age_text",
    "baseline_gaps",
    "baseline_window",
    "check_url",
    "connect",
    "currency",
    "error_type",
    "explain_postgres",
    "export_evidence",
    "freshness",
    "import_evidence",
    "migrate",
    "open_store",
    "open_url",
    "read_evidence_file",
    "run",
    "shared_url",
    "shown_url",
    "store_digest",
]
