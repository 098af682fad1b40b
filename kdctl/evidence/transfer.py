"""Carrying evidence between machines: a JSON file with a digest of its content.

A result measured on the GPU box or in a CI job is exported there and imported here. The digest
catches a file edited or damaged on the way; with KDCTL_EVIDENCE_KEY set on both sides it is
also an HMAC, so only holders of the key can produce a file that imports.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kdctl import __version__
from kdctl._limits import check_size, load_json
from kdctl.errors import InfraError, InputError
from kdctl.evidence.store import EvidenceStore, canonical
from kdctl.records import Baseline, GateResult, content_hash, utcnow

ENV_KEY = "KDCTL_EVIDENCE_KEY"
# Golden outputs of a large corpus with top-k logprobs run to tens of megabytes; a gigabyte is
# not an export.
MAX_EXPORT_BYTES = 256 << 20
FORMAT: Literal[1] = 1


class EvidenceFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["kdctl-evidence"] = "kdctl-evidence"
    format: Literal[1] = FORMAT
    exported_at: datetime = Field(default_factory=utcnow)
    kdctl_version: str = __version__
    results: list[GateResult] = Field(default_factory=list)
    baselines: list[Baseline] = Field(default_factory=list)
    digest: str = ""
    hmac_sha256: str | None = None

    def text(self) -> str:
        return self.model_dump_json(indent=2) + "\n"

    def write(self, path: Path) -> None:
        """Whole or not at all: a full disk or a kill mid-write leaves the old file, never a
        truncated export that a later import would refuse as damaged."""
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            tmp.write_text(self.text())
            tmp.replace(path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise InputError(f"{path}: cannot write: {exc.strerror}") from None


def _payload(doc: EvidenceFile) -> dict[str, Any]:
    return doc.model_dump(mode="json", include={"results", "baselines"})


def _mac(key: str, digest: str) -> str:
    return hmac.new(key.encode(), digest.encode(), hashlib.sha256).hexdigest()


def export_evidence(
    store: EvidenceStore, *, gate: str | None = None, backend: str | None = None
) -> EvidenceFile:
    doc = EvidenceFile(
        results=store.results(gate=gate, backend=backend),
        baselines=store.baselines(backend=backend) if gate is None else [],
    )
    doc.digest = content_hash(_payload(doc))
    key = os.environ.get(ENV_KEY)
    if key:
        doc.hmac_sha256 = _mac(key, doc.digest)
    return doc


class Imported(BaseModel):
    added: int
    already_present: int
    # Verified with KDCTL_EVIDENCE_KEY; False means only a digest, which anyone who edits the
    # file can compute again: it proves the file is intact, not who made it.
    signed: bool


def read_evidence_file(path: Path, *, require_signed: bool = False) -> EvidenceFile:
    """Parse and verify an export; every refusal names the file and what is wrong with it."""
    try:
        check_size(path.stat().st_size, MAX_EXPORT_BYTES, str(path))
        raw = load_json(path.read_text(encoding="utf-8"), str(path), max_bytes=MAX_EXPORT_BYTES)
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: cannot read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}:{exc.lineno}: not JSON: {exc.msg}") from None
    if not isinstance(raw, dict) or raw.get("kind") != "kdctl-evidence":
        raise InputError(f'{path}: not a kdctl evidence export (no "kind": "kdctl-evidence")')
    try:
        doc = EvidenceFile.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"]).lstrip(".")
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise InputError(f"{path}: {where}: {err['msg']}{more}") from None
    if not hmac.compare_digest(content_hash(_payload(doc)), doc.digest):
        raise InputError(
            f"{path}: the content does not match its digest: the file was changed after export; "
            "refusing it"
        )
    key = os.environ.get(ENV_KEY)
    if require_signed and not key:
        raise InputError(
            f"{path}: the inventory requires signed evidence (evidence.require_signed) and "
            f"{ENV_KEY} is not set to verify it; refusing it"
        )
    if key:
        if doc.hmac_sha256 is None:
            raise InputError(f"{path}: {ENV_KEY} is set but the file carries no HMAC; refusing it")
        if not hmac.compare_digest(_mac(key, doc.digest), doc.hmac_sha256):
            raise InputError(f"{path}: HMAC does not verify with {ENV_KEY}; refusing it")
    _check_times(path, doc)
    return doc


# How far ahead of this machine's clock a record may end: beyond it, the exporting box's
# clock is wrong, and its results would sort as the newest here long after they were taken.
MAX_CLOCK_SKEW = timedelta(minutes=5)


def _check_times(path: Path, doc: EvidenceFile) -> None:
    """Every time in the file has a zone and none is in this machine's future: a naive time
    cannot be compared with any other, and a future one outranks every later local result."""
    now = utcnow()
    stamps = [
        (f"results[{i}].{name}", getattr(r, name))
        for i, r in enumerate(doc.results)
        for name in ("started_at", "ended_at")
    ] + [(f"baselines[{i}].created_at", b.created_at) for i, b in enumerate(doc.baselines)]
    for where, at in stamps:
        if at.tzinfo is None:
            raise InputError(f"{path}: {where}: {at.isoformat()} has no time zone; refusing it")
        if at - now > MAX_CLOCK_SKEW:
            ahead = int((at - now).total_seconds() // 60)
            raise InputError(
                f"{path}: {where}: {at.isoformat()} is {ahead} min ahead of this machine's "
                "clock: the exporting box's clock is wrong; refusing it"
            )


_MOVED_BACK = "imported with its times moved back"


def _clamped(store: EvidenceStore, doc: EvidenceFile) -> tuple[list[GateResult], list[Baseline]]:
    """The file's records with every time ahead of this machine's clock (a box whose clock
    runs fast, within MAX_CLOCK_SKEW) moved back to the import moment, duration kept and the
    move said in the result's reasons: a result measured here after the import then always
    sorts newer than it, whatever the two clocks said. A record an earlier import of the file
    already moved is taken as stored, so the same file imported twice adds nothing."""
    now = utcnow()
    results = []
    for r in doc.results:
        ahead = r.ended_at - now
        if ahead > timedelta(0):
            stored = store.get(r.id)
            if (
                stored is not None
                and stored.reasons[-1:]
                and stored.reasons[-1].startswith(_MOVED_BACK)
            ):
                as_moved = r.model_copy(
                    update={k: getattr(stored, k) for k in ("started_at", "ended_at", "reasons")}
                )
                if as_moved == stored:
                    results.append(stored)
                    continue
            r = r.model_copy(
                update={
                    "started_at": r.started_at - ahead,
                    "ended_at": now,
                    "reasons": [
                        *r.reasons,
                        f"{_MOVED_BACK} {ahead.total_seconds():.0f}s to the moment of import: "
                        "the exporting box's clock ran ahead of this one's",
                    ],
                }
            )
        results.append(r)
    ahead_of_now = [b for b in doc.baselines if b.created_at > now]
    kept = {b.id: b for b in store.baselines()} if ahead_of_now else {}
    baselines = [
        kept.get(b.id, b.model_copy(update={"created_at": now})) if b.created_at > now else b
        for b in doc.baselines
    ]
    return results, baselines


def import_evidence(store: EvidenceStore, path: Path, *, require_signed: bool = False) -> Imported:
    doc = read_evidence_file(path, require_signed=require_signed)
    results, baselines = _clamped(store, doc)
    added, skipped = store.merge(results, baselines, source=str(path))
    return Imported(added=added, already_present=skipped, signed=doc.hmac_sha256 is not None)


class Migrated(BaseModel):
    source: str
    target: str
    results: int
    baselines: int
    added: int
    already_present: int
    # sha256 over every record's canonical content, the same on both sides.
    digest: str


def store_digest(store: EvidenceStore) -> tuple[int, int, str]:
    """(results, baselines, digest): what a copy must reproduce exactly."""
    return _digest(store.results(), store.baselines())


def _digest(results: list[GateResult], baselines: list[Baseline]) -> tuple[int, int, str]:
    bodies = sorted(
        [("result", r.id, canonical(r.model_dump_json())) for r in results]
        + [("baseline", b.id, canonical(b.model_dump_json())) for b in baselines]
    )
    return len(results), len(baselines), content_hash(bodies)


def migrate(source: EvidenceStore, target: EvidenceStore) -> Migrated:
    """Every result and baseline of `source` into `target`, in one transaction there, then
    verified: the target holds the same records with the same content (it may hold more, from
    elsewhere; then only the source's records are compared)."""
    results, baselines = source.results(), source.baselines()
    added, skipped = target.merge(results, baselines, source=f"migrate from {source.where}")
    want = _digest(results, baselines)
    copied = {r.id for r in results} | {b.id for b in baselines}
    got = _digest(
        [r for r in target.results() if r.id in copied],
        [b for b in target.baselines() if b.id in copied],
    )
    if got != want:
        raise InfraError(
            f"{target.where}: the copy does not verify: {got[0]} results and {got[1]} baselines "
            f"(digest {got[2][:12]}) against {want[0]} and {want[1]} ({want[2][:12]}) in "
            f"{source.where}"
        )
    return Migrated(
        source=source.where,
        target=target.where,
        results=want[0],
        baselines=want[1],
        added=added,
        already_present=skipped,
        digest=want[2],
    )
