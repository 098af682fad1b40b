"""The shared evidence store on a real PostgreSQL (a cluster of the tests' own on loopback):
results recorded and read by the CLI, several kdctl processes writing and reading at once, an
import killed mid-write, a SQLite store migrated and verified, and a password that is never in
the inventory and never printed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

from kdctl.evidence import SqliteStore, export_evidence, open_url, store_digest
from kdctl.evidence._postgres import _MERGE_LOCK
from kdctl.records import GateResult, Metric, utcnow
from tests.conftest import kdctl, need_module, write_inventory
from tests.support.postgres import Cluster
from tests.support.sshd import free_port

need_module("psycopg", "postgres")
import psycopg  # noqa: E402

PW_ENV = "KDCTL_TEST_PG_PASSWORD"


def _inventory(folder: Path, url: str | None) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    doc: dict[str, object] = {
        "hosts": {"local": {"transport": "local"}},
        "backends": {
            "candidate": {
                "kind": "sglang",
                "host": "local",
                "url": f"http://127.0.0.1:{free_port()}",
            }
        },
        "state_dir": "state",
    }
    if url is not None:
        doc["evidence"] = {"url": url, "password_env": PW_ENV}
    return str(write_inventory(folder / "inv.yaml", doc))


def _merge_lock_holders(db: Any) -> int:
    key = _MERGE_LOCK
    ((n,),) = db.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
        " AND classid = %s AND objid = %s",
        (key >> 32, key & 0xFFFFFFFF),
    ).fetchall()
    return int(n)


def _results(n: int) -> list[GateResult]:
    now = utcnow()
    return [
        GateResult(
            gate="health",
            backend="candidate",
            verdict="pass",
            metrics=[Metric(name="latency_ms", value=float(i))],
            reasons=[f"result {i}"],
            started_at=now - timedelta(seconds=n - i + 1),
            ended_at=now - timedelta(seconds=n - i),
        )
        for i in range(n)
    ]


def test_a_password_in_the_inventory_is_refused_and_never_printed(tmp_path: Path) -> None:
    inv = write_inventory(
        tmp_path / "inv.yaml",
        {
            "hosts": {"local": {"transport": "local"}},
            "evidence": {"url": "postgresql://kdctl:hunter2-in-file@127.0.0.1:5432/kdctl"},
        },
    )
    run = kdctl("inventory", "check", "-i", str(inv))
    assert run.code == 2, run.out + run.err
    assert "evidence.url" in run.err and "evidence.password_env" in run.err
    assert "hunter2-in-file" not in run.out + run.err
    # Nor on a command line, where every user of the machine sees it.
    local = _inventory(tmp_path / "local", None)
    to = "postgresql://kdctl:hunter2-on-argv@127.0.0.1:5432/kdctl"
    run = kdctl("evidence", "migrate", "--to", to, "-i", local)
    assert run.code == 2 and "holds a password" in run.err
    assert "hunter2-on-argv" not in run.out + run.err


def test_results_recorded_and_read_through_postgres(
    postgres: Cluster, pg_url: str, tmp_path: Path
) -> None:
    inv = _inventory(tmp_path, pg_url)
    env = {PW_ENV: postgres.password}
    signed = kdctl(
        "signoff", "-i", inv, "--backend", "candidate", "--by", "Ana", "--note", "soaked", env=env
    )
    assert signed.code == 0, signed.err
    listed = json.loads(kdctl("evidence", "list", "-i", inv, "--json", env=env).out)["results"]
    assert [r["reasons"][0] for r in listed] == ["signed off by Ana: soaked"]
    # Nothing went to a local file.
    assert not list((tmp_path / "state").glob("evidence.sqlite*"))
    shown = kdctl("evidence", "show", listed[0]["id"][:8], "-i", inv, env=env)
    assert shown.code == 0 and "signed off by Ana" in shown.out

    wrong = "not-the-password-7f"
    bad = kdctl("evidence", "list", "-i", inv, env={PW_ENV: wrong})
    assert bad.code == 2 and "refused the login" in bad.err, bad.err
    assert wrong not in bad.out + bad.err and postgres.password not in bad.out + bad.err
    dead = _inventory(tmp_path / "dead", f"postgresql://kdctl@127.0.0.1:{free_port()}/kdctl")
    down = kdctl("evidence", "list", "-i", dead, env=env)
    assert down.code == 3 and "the evidence store failed" in down.err, down.err
    assert "Traceback" not in down.err


def test_several_writers_and_readers_at_once(
    postgres: Cluster, pg_url: str, tmp_path: Path
) -> None:
    """Four kdctl processes record sign-offs while two list the store, all on a store none
    of them has opened before (its schema made once, under a lock): every result is there
    exactly once, and every listing reads whole results."""
    inv = _inventory(tmp_path, pg_url)
    env = {PW_ENV: postgres.password}
    writers, per_writer = 4, 5
    done = False

    def write(w: int) -> list[int]:
        return [
            kdctl(
                "signoff", "-i", inv, "--backend", "candidate", "--by", f"w{w}",
                "--note", f"n{w}-{j}", env=env,
            ).code
            for j in range(per_writer)
        ]  # fmt: skip

    def read() -> list[int]:
        seen = []
        while not done:
            run = kdctl("evidence", "list", "-i", inv, "--json", "--limit", "1000", env=env)
            assert run.code == 0, run.err
            results = json.loads(run.out)["results"]
            assert all(r["reasons"] and r["details"]["by"] for r in results)
            seen.append(len(results))
        return seen

    with ThreadPoolExecutor(writers + 2) as pool:
        readers = [pool.submit(read) for _ in range(2)]
        wrote = [pool.submit(write, w) for w in range(writers)]
        codes = [c for f in wrote for c in f.result()]
        done = True
        seen = [n for f in readers for n in f.result()]
    assert codes == [0] * writers * per_writer
    final = json.loads(
        kdctl("evidence", "list", "-i", inv, "--json", "--limit", "1000", env=env).out
    )
    notes = sorted(r["details"]["note"] for r in final["results"])
    assert notes == sorted(f"n{w}-{j}" for w in range(writers) for j in range(per_writer))
    assert seen and all(0 <= n <= writers * per_writer for n in seen)


def test_an_import_killed_mid_write_leaves_all_or_nothing(
    postgres: Cluster, pg_url: str, tmp_path: Path, report: Any
) -> None:
    inv = _inventory(tmp_path, pg_url)
    with SqliteStore(tmp_path / "ci.sqlite") as ci:
        for r in _results(3000):
            ci.record(r)
        (tmp_path / "ci.json").write_text(export_evidence(ci).text())
    args = [sys.executable, "-m", "kdctl", "evidence", "import", str(tmp_path / "ci.json")]
    env = {**os.environ, PW_ENV: postgres.password}
    proc = subprocess.Popen(
        [*args, "-i", inv], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    # Killed inside its transaction: once it holds the merge lock, which the transaction takes
    # first, and has had a moment to insert.
    with psycopg.connect(pg_url, password=postgres.password, autocommit=True) as watch:
        deadline = time.monotonic() + 60
        while _merge_lock_holders(watch) == 0 and proc.poll() is None:
            assert time.monotonic() < deadline, "the import never began its transaction"
            time.sleep(0.005)
        time.sleep(0.05)
        proc.kill()
        proc.wait()
        assert proc.returncode == -9, "the import finished before the kill"
        ((count,),) = watch.execute("SELECT count(*) FROM results").fetchall()
        assert count == 0
        # The dead session's lock goes with it (once the server sees the client gone): the
        # next import is not kept waiting.
        deadline = time.monotonic() + 10
        while _merge_lock_holders(watch) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _merge_lock_holders(watch) == 0
    report("PostgreSQL: an import of 3000 results SIGKILLed inside its transaction left 0")
    done = kdctl(
        "evidence", "import", str(tmp_path / "ci.json"), "-i", inv, env={PW_ENV: postgres.password}
    )
    assert done.code == 0, done.err
    with open_url(pg_url, password=postgres.password) as store:
        assert store.count() == (3000, 0)


def test_a_sqlite_store_migrated_verified_and_exported_back(
    postgres: Cluster, pg_url: str, tmp_path: Path
) -> None:
    local = _inventory(tmp_path / "local", None)
    with SqliteStore(tmp_path / "local" / "state" / "evidence.sqlite") as store:
        for r in _results(40):
            store.record(r)
        want = store_digest(store)
    env = {"PGPASSWORD": postgres.password}
    run = kdctl("evidence", "migrate", "--to", pg_url, "-i", local, "--json", env=env)
    assert run.code == 0, run.err
    done = json.loads(run.out)
    assert (done["results"], done["added"], done["digest"]) == (40, 40, want[2])
    again = kdctl("evidence", "migrate", "--to", pg_url, "-i", local, env=env)
    assert again.code == 0 and "0 added, 40 already there" in again.out, again.out
    with open_url(pg_url, password=postgres.password) as shared:
        assert store_digest(shared) == want
    # And back: export from PostgreSQL, import into a fresh SQLite store, the same records.
    shared_inv = _inventory(tmp_path / "shared", pg_url)
    out = tmp_path / "shared.json"
    assert (
        kdctl(
            "evidence", "export", "-i", shared_inv, "-o", str(out), env={PW_ENV: postgres.password}
        ).code
        == 0
    )
    fresh = _inventory(tmp_path / "fresh", None)
    assert kdctl("evidence", "import", str(out), "-i", fresh).code == 0
    with SqliteStore(tmp_path / "fresh" / "state" / "evidence.sqlite") as back:
        assert store_digest(back) == want


def test_a_journal_opened_beside_a_running_cutover_waits_on_none_of_its_tables(
    postgres: Cluster,
) -> None:
    """A cutover holds the journal's tables while it writes a step; a second kdctl opening
    the journal then (a status, a refused second cutover) must not need a lock on them: an
    ALTER TABLE there deadlocked the two (`deadlock detected`, exit 3)."""
    from kdctl.traffic import PostgresJournal

    url = postgres.create_database()
    PostgresJournal(url, password=postgres.password).close()  # the tables made
    with psycopg.connect(url, password=postgres.password) as writing:
        writing.execute("LOCK TABLE steps IN ROW EXCLUSIVE MODE")
        writing.execute("LOCK TABLE cutovers IN ROW EXCLUSIVE MODE")
        with ThreadPoolExecutor(1) as beside:
            opened = beside.submit(PostgresJournal, url, password=postgres.password)
            try:
                journal = opened.result(timeout=10)
            finally:
                writing.rollback()  # a journal that waited is let go, and fails the test
        journal.close()
