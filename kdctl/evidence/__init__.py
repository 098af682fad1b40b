"""Evidence: every gate result and baseline, with provenance, in SQLite (the default) or in a
PostgreSQL store a team shares."""

import os

from kdctl.evidence._freshness import Freshness, freshness
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


def open_store(inv: LoadedInventory) -> EvidenceStore:
    """KDCTL_EVIDENCE_URL, else the inventory's `evidence.url`: the shared PostgreSQL store;
    else SQLite in the state directory."""
    env = os.environ.get(ENV_URL)
    url = env or inv.spec.evidence.url
    if not url:
        return SqliteStore(inv.state_dir / DB_NAME)
    # A password inside the environment's URL stays in the environment; in a file, never.
    return open_url(url, password=inv.evidence_password(), from_env=bool(env))


def open_url(url: str, *, password: str | None = None, from_env: bool = False) -> EvidenceStore:
    from urllib.parse import urlsplit

    from kdctl.errors import InputError
    from kdctl.evidence._postgres import PostgresStore

    where = ENV_URL if from_env else "--to"
    parts = urlsplit(url)
    if parts.scheme not in ("postgresql", "postgres") or not parts.hostname:
        raise InputError(f"{where}: not postgresql://USER@HOST[:PORT]/DATABASE")
    if parts.password is not None and not from_env:
        raise InputError(
            f"{where}: the URL holds a password, which a command line shows to every user of "
            "this machine; give it in PGPASSWORD, PGPASSFILE or evidence.password_env"
        )
    return PostgresStore(url, password=password)


__all__ = [
    "DB_NAME",
    "ENV_KEY",
    "ENV_URL",
    "EvidenceFile",
    "EvidenceStore",
    "Freshness",
    "Imported",
    "Migrated",
    "SqliteStore",
    "export_evidence",
    "freshness",
    "import_evidence",
    "migrate",
    "open_store",
    "open_url",
    "read_evidence_file",
    "store_digest",
]
