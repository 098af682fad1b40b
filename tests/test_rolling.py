"""A rolling cutover of a fleet (tests/support/fleet.py): four boxes, each a network
namespace with its own sshd and a folder of its own, SGLang's real router in front, on each box
an old and a new engine (kdctl's reference server, started by kdctl through the box's SSH
login) that cannot run at once: each holds the box's GPU stand-in, a lock the other's start
needs (flock -n), as an engine holds its GPUs. Rolled forward and back under load, killed and
resumed, a box failing its smoke gate, behind nginx; tests/test_rolling_stops.py stops one."""

from __future__ import annotations

import contextlib
import json
import os
import random
from pathlib import Path
from typing import Any

import pytest

from kdctl.inventory import load_inventory
from tests.conftest import kdctl, write_inventory
from tests.support.fleet import Fleet, four_boxes, router_serves
from tests.support.traffic import Load, kill_when

fleet = pytest.fixture(scope="module", name="fleet")(four_boxes)


def test_a_fleet_rolls_box_by_box_under_load_and_back(fleet: Fleet, report: Any) -> None:
    """Under a steady load through the front: box by box, out of the router, drained,
    stopped, the new engine started on the freed GPUs and judged alone, put back; never
    more than one box out. Every request answered. Then rolled back, box by box."""
    inv = str(fleet.inventory)
    plan = kdctl("cutover", "--to", "native", "--dry-run", "--json", "-i", inv)
    assert plan.code == 0, plan.err
    steps = json.loads(plan.out)["steps"]
    assert json.loads(plan.out)["strategy"] == "rolling"
    kinds = [s["kind"] for s in steps]
    per_box = ["remove-from-routers", "drain-engine", "stop", "gpus-free", "start"]
    per_box += ["smoke-gate", "add-to-routers"]
    assert kinds == [k for _ in range(4) for k in ("headroom", *per_box, "soak")], kinds

    # SIGKILLed twice at random journal rows, each time status checked against what every
    # box runs and the rollout resumed; then rolled back, killed once more and resumed.
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    db = load_inventory(fleet.inventory).state_dir / "traffic.sqlite"
    rows = "SELECT count(*) FROM steps"
    start = ["cutover", "--to", "native", "--watch", "2", "--force", "--yes", "-i", inv]
    resume = ["cutover", "--resume", "--yes", "-i", inv]
    kills = []
    with Load(fleet.front) as load:
        for args in (start, resume):
            at = _rows(db) + rng.randint(4, 30)
            kill_when(args, db, rows, at)
            kills.append(at)
            _true_to_the_boxes(fleet, f"seed {seed}, killed at row {at}")
        run = kdctl(*resume, timeout=600)
    assert run.code == 0, f"seed {seed}: " + run.out + run.err
    assert load.sent > 0 and load.failures == [], (seed, load.failures[:5])
    status = json.loads(kdctl("status", "--json", "-i", inv).out)
    pools = {p["name"]: p["summary"] for p in status["pools"]}
    assert pools == {"sglang": "0/4 replicas up", "native": "4/4 replicas up"}, pools
    report(
        f"rolling cutover of 4 boxes under load: {load.sent} requests through SGLang's router, "
        f"{len(load.failures)} failed"
    )

    with Load(fleet.front) as load:
        at = _rows(db) + rng.randint(2, 12)
        kill_when(["rollback", "--yes", "-i", inv], db, rows, at)
        _true_to_the_boxes(fleet, f"seed {seed}, rollback killed at row {at}")
        back = kdctl(*resume, timeout=600)
    # A resumed rollback ends as the cutover's rollback: exit 1, rolled back.
    assert back.code == 1 and "rolled_back: rollback resumed" in back.out, (
        f"seed {seed}: " + back.out + back.err
    )
    assert load.failures == [], (seed, load.failures[:5])
    assert router_serves(fleet) == [f"sglang@box{i}" for i in range(1, 5)]
    report(
        f"rolling cutover killed at journal rows {kills}, its rollback at {at} (seed {seed}): "
        "status true to every box each time, resumed to the end, 0 failed requests"
    )


def _rows(db: Path) -> int:
    import sqlite3

    with contextlib.closing(sqlite3.connect(db)) as conn:
        return int(conn.execute("SELECT count(*) FROM steps").fetchone()[0])


def _true_to_the_boxes(fleet: Fleet, said: str) -> None:
    """status after a kill: the rollout's table names, for every box, the engine the router
    sends to there, and that engine answers; a box the router sends to neither is between
    engines, and said so."""
    doc = json.loads(kdctl("status", "--json", "-i", str(fleet.inventory)).out)
    rollout = doc["traffic"]["cutover_in_progress"]
    assert rollout is not None and rollout["state"] == "running", (said, rollout)
    states = {b["name"]: b["state"] for b in doc["backends"]}
    routed = set(router_serves(fleet))
    for box in rollout["boxes"]:
        in_router = {n for n in routed if n.endswith(f"@{box['host']}")}
        if box["engine"] is None:
            assert not in_router, (said, box, routed)
            continue
        replica = f"{box['engine']}@{box['host']}"
        assert replica in routed and states[replica] == "up", (said, box, states)


def test_a_box_that_fails_its_smoke_gate_goes_back_and_the_rollout_pauses(
    fleet: Fleet, models: dict[str, Path], report: Any
) -> None:
    """Box 3's new engine serves another checkpoint: its smoke gate fails against the golden
    outputs its old engine recorded. Box 3 goes back on its old engine, the rollout pauses with
    boxes 1 and 2 moved and box 4 untouched, and status says so; with box 3 mended, --resume
    goes on from box 3 and finishes."""
    inv = str(fleet.inventory)
    assert router_serves(fleet) == [f"sglang@box{i}" for i in range(1, 5)]
    recorded = kdctl("baseline", "record", "-b", "sglang@box3", "--only", "golden", "-i", inv)
    assert recorded.code == 0, recorded.out + recorded.err
    wrong = fleet.dirs[2] / "native-model"
    wrong.unlink()
    wrong.symlink_to(models["dsv3-draft"])
    with Load(fleet.front) as load:
        run = kdctl("cutover", "--to", "native", "--watch", "1", "--force", "--yes", "-i", inv)
    assert run.code == 1, run.out + run.err
    assert load.failures == [], load.failures[:5]
    assert "paused" in run.out and "smoke gate failed" in run.out, run.out
    assert router_serves(fleet) == ["native@box1", "native@box2", "sglang@box3", "sglang@box4"]
    doc = json.loads(kdctl("status", "--json", "-i", inv).out)
    rollout = doc["traffic"]["cutover_in_progress"]
    assert rollout["state"] == "paused" and rollout["strategy"] == "rolling", rollout
    boxes = {b["host"]: b["engine"] for b in rollout["boxes"]}
    assert boxes == {"box1": "native", "box2": "native", "box3": "sglang", "box4": "sglang"}
    serving = doc["answers"]["serving"]
    assert serving["mix"] == "native on 2/4 boxes, sglang on 2/4", serving
    text = " ".join(kdctl("status", "-i", inv).out.split())
    assert "Serving now: native on 2/4 boxes, sglang on 2/4 through sglang-router" in text, text
    assert "Cutover paused" in text and "Wave 3 of 4" in text and "box3: sglang" in text, text
    # Behind SGLang's gateway, a pool's share is its share of the healthy workers, said so.
    assert "(native 50% on 2 replicas; sglang 50% on 2 replicas: " in text, text
    assert "a pool's share is its share of the healthy workers" in text, text
    # The report carries the same table.
    out = fleet.dirs[0].parent / "report"
    made = kdctl("report", "-f", "markdown,json", "-o", str(out), "-i", inv)
    assert made.code == 1, made.out + made.err  # no roadmap: no target reachable
    shown = json.loads((out / "report.json").read_text())["cutover_in_progress"]
    assert [b["engine"] for b in shown["boxes"]] == ["native", "native", "sglang", "sglang"]
    markdown = (out / "report.md").read_text()
    assert "Wave 3 of 4" in markdown and "| box3 | sglang |" in markdown, markdown

    wrong.unlink()
    wrong.symlink_to(models["dsv3"])
    with Load(fleet.front) as load:
        resumed = kdctl("cutover", "--resume", "--force", "--yes", "-i", inv, timeout=600)
    assert resumed.code == 0, resumed.out + resumed.err
    assert load.failures == [], load.failures[:5]
    assert router_serves(fleet) == [f"native@box{i}" for i in range(1, 5)]
    report(
        "rolling cutover, box 3's smoke gate failed: box 3 back on sglang, paused at "
        "native on 2/4 boxes; resumed after the fix, all 4 moved; 0 failed requests"
    )


def test_a_fleet_rolls_behind_nginx_one_server_per_replica(
    fleet: Fleet, tmp_path: Path, report: Any
) -> None:
    """The same boxes behind a real nginx instead (kdctl's own upstream, one server per
    replica): rolled forward under a load that counts who answered, by the header nginx adds
    to each answer, every replica of both pools among them; then rolled back. Last in the
    file: it moves the boxes behind SGLang's router's back, and puts them back."""
    import yaml

    from kdctl.traffic import equal_shares
    from tests.support.nginx import NGINX, kdctl_front, router_entry
    from tests.support.sshd import free_port
    from tests.support.traffic import weights

    serving = router_serves(fleet)
    old = serving[0].partition("@")[0]
    new = "sglang" if old == "native" else "native"
    data = yaml.safe_load(fleet.inventory.read_text())
    root = tmp_path / "nginx"
    root.mkdir()
    data["router"] = router_entry(NGINX, root, free_port(), serving=old)
    data["hosts"]["local"] = {"transport": "local"}
    inv = str(write_inventory(tmp_path / "nginx.yaml", data))
    include = root / "kdctl.conf"
    with kdctl_front(Path(inv), equal_shares(serving)) as front:
        with Load(front) as load:
            run = kdctl("cutover", "--to", new, "--watch", "1", "--force", "--yes", "-i", inv)
        assert run.code == 0, run.out + run.err
        assert load.sent > 0 and load.failures == [], load.failures[:5]
        moved = [f"{new}@box{i}" for i in range(1, 5)]
        assert weights(include) == equal_shares(moved)
        answered = {n: c for n, c in load.served_by.items() if c}
        assert set(answered) == {*serving, *moved}, answered
        # Box by box: the first box moved answered longest on its new engine, the last on
        # its old one.
        assert answered[moved[0]] > answered[moved[-1]], answered
        assert answered[serving[-1]] > answered[serving[0]], answered
        with Load(front) as back_load:
            back = kdctl("rollback", "--yes", "-i", inv, timeout=600)
        assert back.code == 0, back.out + back.err
        assert back_load.failures == [], back_load.failures[:5]
        assert weights(include) == equal_shares(serving)
    assert router_serves(fleet) == serving
    report(
        f"rolling cutover of 4 boxes behind nginx: {load.sent} requests, 0 failed, answered "
        f"by {dict(sorted(answered.items()))}; rolled back under load, 0 failed"
    )
