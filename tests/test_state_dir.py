"""A damaged state directory: an evidence database with a broken header or cut short, a
directory kdctl may not write, a disk that fills while recording. Each ends in a clear message
naming the file, exit 2 or 3, never a traceback, and the evidence already there intact."""

from __future__ import annotations

import json
import os
import resource
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, Run, Served, engine_pair, kdctl, need_module, write_inventory


def _inventory(tmp_path: Path, state: Path, url: str | None = None) -> Path:
    data: dict[str, Any] = {"hosts": {"local": {"transport": "local"}}, "state_dir": str(state)}
    if url is not None:
        data["backends"] = engine_pair(url, url.replace("127.0.0.1", "localhost"))
    return write_inventory(tmp_path / "inv.yaml", data)


def _seed(state: Path) -> bytes:
    """One recorded result, through kdctl's own store: the evidence that must survive."""
    from kdctl.evidence import SqliteStore
    from kdctl.records import GateResult, utcnow

    with SqliteStore(state / "evidence.sqlite") as store:
        now = utcnow()
        store.record(
            GateResult(
                gate="health", backend="baseline", verdict="pass", started_at=now, ended_at=now
            )
        )
    db = state / "evidence.sqlite"
    with sqlite3.connect(db) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return db.read_bytes()


def _clear(run: Run, code: int, *needles: str) -> None:
    assert run.code == code, (run.code, run.out, run.err)
    assert "Traceback" not in run.err + run.out, run.err
    for needle in needles:
        assert needle in run.err, run.err


def test_a_damaged_or_truncated_database_is_named_and_left_as_it_is(
    tmp_path: Path, report: Any
) -> None:
    state = tmp_path / "state"
    good = _seed(state)
    inv = _inventory(tmp_path, state)
    db = state / "evidence.sqlite"
    for name, damaged in (
        ("header", b"not a database at all" + good[21:]),
        ("truncated", good[: len(good) // 2]),
        # Cut to nothing: not a new store, whatever SQLite would make of it.
        ("emptied", b""),
    ):
        db.write_bytes(damaged)
        for args in (("evidence", "list"), ("status",), ("phases",)):
            started = time.monotonic()
            run = kdctl(*args, "-i", str(inv))
            took = time.monotonic() - started
            if args == ("phases",):
                # No roadmap: refused as bad input before the database matters.
                assert run.code == 2 and "Traceback" not in run.err
                continue
            _clear(run, 2, str(db), "damaged")
            report(f"evidence database ({name}): {' '.join(args)} exit 2 in {took:.2f}s")
        assert db.read_bytes() == damaged  # nothing written into it


@pytest.mark.skipif(os.geteuid() != 0, reason="runs kdctl as another user, which needs root")
def test_a_state_directory_kdctl_may_not_write() -> None:
    # pytest's own folder is root's alone: the other user needs a path it can reach.
    tmp_path = Path(tempfile.mkdtemp(prefix="kdctl-readonly-"))
    tmp_path.chmod(0o755)
    try:
        _as_another_user(tmp_path)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)


def _as_another_user(tmp_path: Path) -> None:
    state = tmp_path / "state"
    good = _seed(state)
    inv = _inventory(tmp_path, state, "http://127.0.0.1:9")
    inv.chmod(0o644)
    # Another user, as a colleague's shell would be: the directory and its files are root's.
    run = subprocess.run(
        [
            "setpriv",
            "--reuid=nobody",
            "--regid=nogroup",
            "--clear-groups",
            sys.executable,
            "-m",
            "kdctl",
            "signoff",
            "-b",
            "baseline",
            "--by",
            "ops",
            "--note",
            "n",
            "-i",
            str(inv),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "HOME": str(tmp_path), "PYTHONPATH": str(REPO)},
        timeout=60,
    )
    _clear(Run(run.returncode, run.stdout, run.stderr), 2, str(state), "--state-dir")
    assert (state / "evidence.sqlite").read_bytes() == good


def _limit_file_size(limit: int) -> Any:
    def apply() -> None:
        # Python ignores SIGXFSZ: a write past the limit fails with EFBIG, as on a full disk.
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def test_a_disk_that_fills_while_recording(
    tmp_path: Path, reference_server: Served, report: Any
) -> None:
    need_module("torch", "reference")
    state = tmp_path / "state"
    _seed(state)
    inv = _inventory(tmp_path, state, reference_server.url)
    db = state / "evidence.sqlite"
    before = json.loads(kdctl("evidence", "list", "-i", str(inv), "--json").out)["results"]
    size = max(p.stat().st_size for p in state.iterdir())
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "kdctl", "gate", "run", "health", "-b", "baseline", "-i", str(inv)],
        capture_output=True,
        text=True,
        preexec_fn=_limit_file_size(size + 512),
        timeout=120,
    )
    took = time.monotonic() - started
    _clear(Run(proc.returncode, proc.stdout, proc.stderr), 3, str(state), "disk may be full")
    report(f"disk full under the state directory, gate run: exit 3 in {took:.2f}s")
    after = json.loads(kdctl("evidence", "list", "-i", str(inv), "--json").out)["results"]
    assert [r["id"] for r in after] == [r["id"] for r in before]
    assert shutil.disk_usage(db.parent).free > 0
