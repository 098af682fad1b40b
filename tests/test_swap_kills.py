"""A swap SIGKILLed after each of its journal rows in turn, under a probe load through the
front that honours Retry-After: right after the kill, status says what the front does;
`--resume` (odd rounds) finishes the swap, `rollback` (even rounds) brings the old engine back
and the router to it; each round swaps away from whichever engine serves then, so both
directions are killed. No request is lost."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.conftest import kdctl, need_module
from tests.support.traffic import Load, kill_when, weights
from tests.test_swap import TOKEN, swap_setup

need_module("torch", "reference")

# The forced preflight; drain, stop, start and smoke-gate (started, done each); set-weights
# (started, written, done).
ROWS_PER_RUN = 12


def test_swap_killed_after_each_journal_row_then_resumed_or_rolled_back(
    need_nginx: str, models: dict[str, Path], tmp_path: Path, report: Any
) -> None:
    from kdctl.traffic import SqliteJournal

    with swap_setup(need_nginx, models, tmp_path) as swap, pytest.MonkeyPatch.context() as mp:
        mp.setenv("KDCTL_TEST_HUB_TOKEN", TOKEN)
        # A prerequisite the candidate never meets (no one signs off), so that every round is
        # forced and journals the same rows; the smoke gates of earlier rounds would otherwise
        # give it passing evidence, and a later swap would start unforced, one row shorter.
        roadmap = yaml.safe_load((tmp_path / "roadmap.yaml").read_text())
        roadmap["phases"][0]["criteria"].append({"name": "signed", "gate": "sign-off"})
        (tmp_path / "roadmap.yaml").write_text(yaml.safe_dump(roadmap, sort_keys=False))
        inv = swap.inv
        db = tmp_path / "state" / "traffic.sqlite"
        # Each round swaps away from the engine serving: a resumed swap leaves the other one
        # serving, and the next round swaps back (both directions, no extra restarts).
        serving, other = "baseline", "candidate"
        with Load(swap.front_url, retry_draining=True) as load:
            for k in range(1, ROWS_PER_RUN):
                before = 0
                if db.exists():  # the first cutover makes the journal
                    with sqlite3.connect(db) as conn:
                        before = conn.execute("SELECT count(*) FROM steps").fetchone()[0]
                args = ["cutover", "--to", other, "--force", "--yes", "-i", inv]
                kill_when(args, db, "SELECT count(*) FROM steps", before + k)
                with SqliteJournal(tmp_path / "state") as journal:
                    open_one = journal.latest(state="running")
                assert open_one is not None, f"round {k}: the swap finished before the kill"
                status = json.loads(kdctl("status", "-i", inv, "--json", "--timeout", "5").out)
                answer = status["answers"]["serving"]
                if answer["state"] == "serving":
                    up = {e["name"] for e in answer["engines"] if e["generated"]}
                    assert answer["backend"] in up, (k, answer["detail"])
                else:
                    assert "draining" in answer["detail"], (k, answer["detail"])
                if k % 2:
                    run = kdctl("cutover", "--resume", "--yes", "-i", inv, timeout=600)
                    assert run.code == 0, (k, run.out, run.err)
                    serving, other = other, serving
                else:
                    back = kdctl("rollback", "--yes", "-i", inv, timeout=600)
                    assert back.code == 0, (k, back.out, back.err)
                assert weights(swap.include) == {serving: 100}, k
                assert httpx.get(swap.url(serving) + "/health").status_code == 200, k
                assert not (tmp_path / f"{other}.pid").exists(), k
                with SqliteJournal(tmp_path / "state") as journal:
                    last = journal.get(open_one.id)
                want = "succeeded" if k % 2 else "rolled_back"
                assert last is not None and last.state == want, k
                after = json.loads(kdctl("status", "-i", inv, "--json").out)["answers"]["serving"]
                assert (after["state"], after["backend"]) == ("serving", serving), k
        report(
            f"swap, SIGKILL at each of {ROWS_PER_RUN - 1} journal rows: {load.sent} requests "
            f"through the front, {len(load.failures)} failed, {load.retried} retries of a "
            "draining front's 503 with Retry-After"
        )
        assert load.sent > 0 and not load.failures, load.failures[:5]
