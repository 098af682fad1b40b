"""Cutovers interrupted and failing, through a real nginx on loopback in front of reference
servers under a probe load: SIGKILL at every journal row, the newest operation resumed, a full
disk, concurrent recorders, engines that require a key. Apart from tests/test_traffic.py so
the two files run on separate test workers."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import kdctl, need_module, serve_reference
from tests.support.traffic import Load, kill_when, nginx_front, weights

need_module("torch", "reference")


@pytest.mark.parametrize(
    ("strategy", "rows_per_run"),
    [
        # The forced preflight; set-weights (started, written, done), watch (started, done),
        # set-weights again.
        ("canary", 9),
        # The forced preflight; one set-weights (started, written, done).
        ("blue-green", 4),
    ],
)
def test_sigkill_after_each_journal_step_then_resume_or_rollback(
    front: dict[str, Any], report: Any, strategy: str, rows_per_run: int
) -> None:
    """kdctl killed with SIGKILL right after each journal row in turn, under a probe load
    through the front. Right after the kill, status says what nginx runs (a file written and
    not reloaded is "written, not applied"); `--resume` (odd rounds) or `rollback` (even
    rounds) leaves the router matching the journal's last word; no request fails."""
    import sqlite3

    from kdctl.traffic import SqliteJournal

    inv = str(front["inv"])
    state = front["inv"].parent / "state"
    steps = ["--steps", "50,100", "--watch", "1"] if strategy == "canary" else []
    unapplied = 0
    with Load(front["url"]) as load:
        for k in range(1, rows_per_run):
            db = state / "traffic.sqlite"
            before = 0
            if db.exists():
                conn = sqlite3.connect(db)
                before = conn.execute("SELECT count(*) FROM steps").fetchone()[0]
                conn.close()
            cutover = ["cutover", "--to", "candidate", "--strategy", strategy, *steps]
            kill_when(
                [*cutover, "--force", "--yes", "-i", inv],
                db,
                "SELECT count(*) FROM steps",
                before + k,
            )
            with SqliteJournal(state) as journal:
                open_one = journal.latest(state="running")
            assert open_one is not None, f"round {k}: the cutover finished before the kill"
            status = kdctl("status", "-i", inv, "--json", "--timeout", "5")
            serving = json.loads(status.out)["answers"]["serving"]
            assert serving["state"] == "serving", (k, serving["detail"])
            if serving["routed"]["applied"] is False:
                unapplied += 1
                assert "written, not applied" in serving["detail"], serving["detail"]
            else:
                assert "written, not applied" not in serving["detail"]
            if k % 2:
                run = kdctl("cutover", "--resume", "--yes", "-i", inv)
                want = {"candidate": 100}
            else:
                run = kdctl("rollback", "--yes", "-i", inv)
                want = {"baseline": 100}
            assert run.code == 0, (k, run.out, run.err)
            assert weights(front["include"]) == want, k
            with SqliteJournal(state) as journal:
                last = journal.get(open_one.id)
            assert last is not None and last.state == ("succeeded" if k % 2 else "rolled_back"), k
            if k % 2:
                assert kdctl("rollback", "--yes", "-i", inv).code == 0
            assert weights(front["include"]) == {"baseline": 100}
            after = json.loads(kdctl("status", "-i", inv, "--json").out)["answers"]["serving"]
            assert (after["backend"], after["routed"]["applied"]) == ("baseline", True), k
    report(
        f"{strategy}, SIGKILL at each of {rows_per_run - 1} journal rows: {load.sent} requests "
        f"through the front, {len(load.failures)} failed; {unapplied} kill(s) left a file "
        "written, not applied"
    )
    assert load.sent > 0 and not load.failures, load.failures[:5]


def test_a_first_change_written_and_never_applied_is_said_from_the_journal(
    front: dict[str, Any],
) -> None:
    """The first cutover of a state directory, on an nginx whose file kdctl has never
    reloaded (no record of what nginx loaded): kdctl SIGKILLed between writing the file and
    reloading nginx. nginx cannot tell; kdctl's journal, holding the change written and never
    done, does: status says written, not applied, while the front still answers from the
    baseline."""
    import httpx

    from kdctl.traffic import BACKEND_HEADER

    inv = str(front["inv"])
    db = front["inv"].parent / "state" / "traffic.sqlite"
    args = ["cutover", "--to", "candidate", "--strategy", "blue-green", "--force", "--yes"]
    # The forced preflight, then set-weights started and written: killed at the third row.
    # The reload follows the written row within milliseconds; a kill that lands after it is
    # rolled back and tried again.
    for _ in range(5):
        kill_when([*args, "-i", inv], db, "SELECT count(*) FROM steps", 3)
        answered = httpx.get(front["url"] + "/health").headers.get(BACKEND_HEADER)
        if answered == "baseline" and weights(front["include"]) == {"candidate": 100}:
            break
        assert kdctl("rollback", "--yes", "-i", inv).code == 0
    else:
        pytest.fail("every kill landed after nginx's reload")
    assert not (front["include"].parent / "kdctl.conf.applied").exists()
    serving = json.loads(kdctl("status", "-i", inv, "--json", "--timeout", "5").out)
    said = serving["answers"]["serving"]
    assert said["routed"]["applied"] is False, said
    assert "written, not applied" in said["detail"], said["detail"]
    assert (said["state"], said["backend"]) == ("serving", "baseline"), said["detail"]
    assert kdctl("rollback", "--yes", "-i", inv).code == 0
    assert weights(front["include"]) == {"baseline": 100}


def test_only_the_newest_operation_is_resumed(front: dict[str, Any]) -> None:
    """A cutover killed before its first write, then one that succeeded: the first is
    abandoned, not "in progress", and --resume has nothing to replay. A canary killed at 50/50,
    then a rollback killed inside its write: --resume finishes the rollback, the operator's
    last order, never the canary. One begun unforced whose criteria fail since, or a router
    changed by hand since: --resume refuses."""
    from kdctl.traffic import SqliteJournal

    inv = str(front["inv"])
    db = front["inv"].parent / "state" / "traffic.sqlite"
    canary = ["cutover", "--to", "candidate", "--steps", "50,100", "--watch", "30"]
    canary += ["--force", "--yes", "-i", inv]
    kill_when(canary, db, "SELECT count(*) FROM cutovers", 1)
    with SqliteJournal(db.parent) as journal:
        first = journal.latest()
    assert first is not None and first.state == "running"
    assert weights(front["include"]) == {"baseline": 100}
    bg = kdctl(
        "cutover", "--to", "candidate", "--strategy", "blue-green", "--force", "--yes", "-i", inv
    )
    assert bg.code == 0, bg.out + bg.err
    with SqliteJournal(db.parent) as journal:
        abandoned = journal.get(first.id)
    assert abandoned is not None and abandoned.state == "abandoned"
    status = json.loads(kdctl("status", "-i", inv, "--json").out)
    assert status["traffic"]["cutover_in_progress"] is None
    resumed = kdctl("cutover", "--resume", "--yes", "-i", inv)
    assert resumed.code == 2 and "no interrupted cutover" in resumed.err, resumed.err
    assert "succeeded" in resumed.err
    assert weights(front["include"]) == {"candidate": 100}
    assert kdctl("rollback", "--yes", "-i", inv).code == 0

    # The canary at 50/50, killed in its watch.
    done_50 = (
        "SELECT count(*) FROM steps WHERE kind = 'watch' AND phase = 'started' AND cutover_id ="
        " (SELECT id FROM cutovers WHERE state = 'running' ORDER BY rowid DESC LIMIT 1)"
    )
    kill_when(canary, db, done_50, 1)
    assert weights(front["include"]) == {"baseline": 50, "candidate": 50}
    # The rollback, killed once its router write is journaled as started.
    started = (
        "SELECT count(*) FROM steps WHERE kind = 'rollback-set-weights' AND phase = 'started'"
        " AND cutover_id = (SELECT id FROM cutovers ORDER BY rowid DESC LIMIT 1)"
    )
    kill_when(["rollback", "--yes", "-i", inv], db, started, 1)
    resumed = kdctl("cutover", "--resume", "--yes", "-i", inv)
    assert resumed.code == 1, resumed.out + resumed.err  # the cutover ends rolled back
    assert "rolled_back" in resumed.out and weights(front["include"]) == {"baseline": 100}

    # Killed at 50/50 again. Had it started with every criterion met (unforced), a resume
    # assesses the candidate again and, its criteria unmet now, changes nothing.
    kill_when(canary, db, done_50, 1)
    import sqlite3

    conn = sqlite3.connect(db)
    with conn:
        conn.execute("UPDATE cutovers SET forced = 0 WHERE state = 'running'")
    conn.close()
    held = kdctl("cutover", "--resume", "--yes", "-i", inv)
    assert held.code == 1, held.out + held.err
    assert "resuming cutover" in held.err and "to candidate refused:" in held.err, held.err
    assert "--force overrides" in held.err
    assert weights(front["include"]) == {"baseline": 50, "candidate": 50}
    # Then someone sends everything to the candidate by hand.
    from kdctl.inventory import load_inventory
    from kdctl.traffic.nginx import NginxRouter
    from kdctl.transports import TransportPool

    loaded = load_inventory(front["inv"])
    with TransportPool(loaded) as pool:
        router = NginxRouter(loaded, loaded.spec.router, pool.get("local"))  # type: ignore[arg-type]
        router.apply({"candidate": 100})
    refused = kdctl("cutover", "--resume", "--yes", "-i", inv)
    assert refused.code == 1, refused.out + refused.err
    assert "cannot be resumed: the router now sends {'candidate': 100}" in refused.err
    assert weights(front["include"]) == {"candidate": 100}  # nothing changed
    assert kdctl("rollback", "--yes", "-i", inv).code == 0
    assert weights(front["include"]) == {"baseline": 100}


def test_a_disk_that_fills_during_a_canary_rolls_back(front: dict[str, Any], report: Any) -> None:
    """The journal cannot be written past 50/50 (a file-size limit, which SQLite meets as a
    full disk): the runner's promise holds, traffic goes back to the baseline, and the message
    says so; no traceback."""
    import resource

    inv = str(front["inv"])
    state = front["inv"].parent / "state"
    # A first cutover and its rollback create the journal and the evidence store.
    assert (
        kdctl(
            "cutover",
            "--to",
            "candidate",
            "--strategy",
            "blue-green",
            "--force",
            "--yes",
            "-i",
            inv,
        ).code
        == 0
    )
    assert kdctl("rollback", "--yes", "-i", inv).code == 0
    limit = max(p.stat().st_size for p in state.iterdir()) + 4096

    def small_disk() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    with Load(front["url"]) as load:
        started = time.monotonic()
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "kdctl",
                "cutover",
                "--to",
                "candidate",
                "--steps",
                "50,100",
                "--watch",
                "3",
                "--force",
                "--yes",
                "-i",
                inv,
            ],
            capture_output=True,
            text=True,
            preexec_fn=small_disk,
            timeout=300,
        )
        took = time.monotonic() - started
    out = proc.stdout + proc.stderr
    assert proc.returncode in (1, 3), out
    assert "Traceback" not in out, out
    assert weights(front["include"]) == {"baseline": 100}, out
    assert "disk" in out, out
    report(
        f"disk full during a canary: exit {proc.returncode} after {took:.1f}s, router back at "
        f"baseline 100; {load.sent} requests through the front, {len(load.failures)} failed"
    )
    assert not load.failures, load.failures[:5]


def test_gates_recorded_while_a_cutover_runs_and_a_second_cutover_is_refused(
    front: dict[str, Any], report: Any
) -> None:
    """Two kdctl processes recording gates in a loop while a third cuts over: every result is
    there exactly once, and a second cutover meanwhile is refused naming the holder."""
    inv = str(front["inv"])
    per_writer = 4
    runs: list[Any] = []

    def record() -> None:
        for _ in range(per_writer):
            runs.append(kdctl("gate", "run", "health", "-b", "baseline", "-i", inv))

    writers = [threading.Thread(target=record) for _ in range(2)]
    canary = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kdctl",
            "cutover",
            "--to",
            "candidate",
            "--steps",
            "50,100",
            "--watch",
            "4",
            "--force",
            "--yes",
            "-i",
            inv,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for w in writers:
        w.start()
    # The canary holds the lock through its watch; a loaded machine can take seconds to start
    # it, and a second cutover started before it would take the lock first.
    lock = Path(inv).parent / "state" / "traffic.lock"
    deadline = time.monotonic() + 120
    while f"pid {canary.pid} " not in (lock.read_text() if lock.exists() else ""):
        assert canary.poll() is None and time.monotonic() < deadline, canary.communicate()
        time.sleep(0.05)
    second = kdctl("cutover", "--to", "candidate", "--force", "--yes", "-i", inv)
    for w in writers:
        w.join(300)
    out, err = canary.communicate(timeout=300)
    assert canary.returncode == 0, out + err
    assert second.code == 1 and "holds the traffic lock" in second.err, second.err
    assert f"pid {canary.pid}" in second.err, second.err
    assert [r.code for r in runs] == [0] * (2 * per_writer), [r.err for r in runs if r.code]
    listed = kdctl("evidence", "list", "--gate", "health", "--limit", "100", "--json", "-i", inv)
    ids = [r["id"] for r in json.loads(listed.out)["results"]]
    assert len(ids) == len(set(ids)) == 2 * per_writer
    report(
        f"concurrent: {len(ids)} health results from 2 writers during a canary, all recorded "
        "once; the second cutover refused naming the holder"
    )
    assert kdctl("rollback", "--yes", "-i", inv).code == 0


def test_a_canary_between_engines_that_require_a_key(
    tmp_path: Path, need_nginx: str, models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both engines require `Authorization: Bearer`: the watch's probe load carries the key,
    so the canary goes through instead of reading every probe's 401 as a breach."""
    key = "sk-canary-test-41d2"
    monkeypatch.setenv("KDCTL_TEST_ENGINE_KEY", key)
    engines = [serve_reference(models["dsv3"], api_key=key) for _ in range(2)]
    setup = nginx_front(
        tmp_path, need_nginx, engines[0].url, engines[1].url, api_key_env="KDCTL_TEST_ENGINE_KEY"
    )
    try:
        front = next(setup)
        inv = str(front["inv"])
        run = kdctl(
            "cutover",
            "--to",
            "candidate",
            "--steps",
            "50,100",
            "--watch",
            "2",
            "--force",
            "--yes",
            "-i",
            inv,
            "--json",
        )
        assert run.code == 0, run.out + run.err
        outcome = json.loads(run.out)
        assert outcome["state"] == "succeeded", outcome
        assert [w["failed"] for w in outcome["watches"]] == [0]
        assert outcome["watches"][0]["sent"] > 0
        status = json.loads(kdctl("status", "-i", inv, "--json").out)["answers"]["serving"]
        assert (status["state"], status["backend"]) == ("serving", "candidate")
        assert key not in run.out + run.err
    finally:
        setup.close()  # stops nginx
        for served in engines:
            served.proc.terminate()
            served.proc.wait(10)
