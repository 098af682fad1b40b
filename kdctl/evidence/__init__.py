"""Evidence: every gate result and baseline, with provenance, in an SQLite file."""

from kdctl.evidence._freshness import Freshness, freshness
from kdctl.evidence.store import DB_NAME, EvidenceStore
from kdctl.evidence.transfer import (
    ENV_KEY,
    EvidenceFile,
    Imported,
    export_evidence,
    import_evidence,
    read_evidence_file,
)

__all__ = [
    "DB_NAME",
    "ENV_KEY",
    "EvidenceFile",
    "EvidenceStore",
    "Freshness",
    "Imported",
    "export_evidence",
    "freshness",
    "import_evidence",
    "read_evidence_file",
]
