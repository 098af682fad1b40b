"""A rolling cutover of a fleet (tests/support/fleet.py): four boxes, each a network
namespace with its own sshd and a folder of its own, SGLang's real router in front, on each box
an old and a new engine (kdctl's reference server, started by kdctl through the box's SSH
login) that cannot run at once: each holds the box's GPU stand-in, a lock the other's start
needs (flock -n), as an engine holds its GPUs."""

from __future__ import annotations

import contextlib
import json
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kdctl.inventory import load_inventory
from kdctl.transports import TransportPool
from tests.conftest import kdctl, kdctl_start, need_sglang_router, warm_argv, write_inventory
from tests.support.fleet import Fleet, rolling_fleet
from tests.support.traffic import Load, kill_when


@pytest.fixture(scope="module")
def fleet(models: dict[str, Path]) -> Iterator[Fleet]:
    """Four boxes running the old engine, SGLang's router in front of the four."""
    if os.geteuid() != 0:
        pytest.skip("a network namespace needs root")
    need_sglang_router()
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with rolling_fleet(models["dsv3"], tag=worker, wrap=warm_argv) as fleet:
        yield fleet


def _router_serves(fleet: Fleet) -> list[str]:
    from kdctl.traffic import make_router

    inv = load_inventory(fleet.inventory)
    with TransportPool(inv) as pool:
        return make_router(inv, pool).read().serving


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
    assert _router_serves(fleet) == [f"sglang@box{i}" for i in range(1, 5)]
    report(
        f"rolling cutover killed at journal rows {kills}, its rollback at {at} (seed {seed}): "
        "status true to every box each time, resumed to the end, 0 failed requests"
    )


def _tight(fleet: Fleet, tmp_path: Path) -> str:
    """The fleet's inventory with one request per replica as each pool's capacity."""
    import yaml

    data = yaml.safe_load(fleet.inventory.read_text())
    for spec in data["backends"].values():
        spec["capacity_per_replica"] = 1
    return str(write_inventory(tmp_path / "tight.yaml", data))


@contextlib.contextmanager
def _one_long_request_each(inv: str, engines: list[str]) -> Iterator[None]:
    """A long generation running on each engine (its first token seen) while the body runs,
    then left: the client goes away, as clients do, and the engine stops generating for it."""
    import threading

    import httpx

    loaded = load_inventory(Path(inv))
    urls = [loaded.backends[n].url for n in engines]
    body = {
        "input_ids": [11, 12, 13],
        "sampling_params": {"max_new_tokens": 1900, "temperature": 0, "ignore_eos": True},
        "stream": True,
    }
    started = threading.Barrier(len(urls) + 1, timeout=60)
    leave = threading.Event()

    def generate(url: str | None) -> None:
        with httpx.stream("POST", f"{url}/generate", json=body, timeout=120) as r:
            lines = r.iter_lines()
            next(lines)  # the first token: running now
            started.wait()
            for _ in lines:
                if leave.is_set():
                    break

    threads = [threading.Thread(target=generate, args=(u,), daemon=True) for u in urls]
    for t in threads:
        t.start()
    started.wait()
    try:
        yield
    finally:
        leave.set()
        for t in threads:
            t.join(120)


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
    routed = set(_router_serves(fleet))
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
    assert _router_serves(fleet) == [f"sglang@box{i}" for i in range(1, 5)]
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
    assert _router_serves(fleet) == ["native@box1", "native@box2", "sglang@box3", "sglang@box4"]
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
    assert _router_serves(fleet) == [f"native@box{i}" for i in range(1, 5)]
    report(
        "rolling cutover, box 3's smoke gate failed: box 3 back on sglang, paused at "
        "native on 2/4 boxes; resumed after the fix, all 4 moved; 0 failed requests"
    )


def test_on_fail_abort_moves_every_box_back(fleet: Fleet, tmp_path: Path, report: Any) -> None:
    """--on-fail abort: box 3's new engine, judged alone, is slower than its smoke throughput
    run allows against what box 3's old engine recorded (the bar set at 5x, out of reach), so
    it goes back, then every box moved before it, the last moved first; the rollout ends
    rolled back, not paused."""
    import yaml

    serving = _router_serves(fleet)
    old = serving[0].partition("@")[0]
    new = "sglang" if old == "native" else "native"
    data = yaml.safe_load(fleet.inventory.read_text())
    data["gates"]["throughput"]["min_ratio"] = 5.0
    inv = str(write_inventory(tmp_path / "fast.yaml", data))
    for kind in ("golden", "throughput"):
        recorded = kdctl("baseline", "record", "-b", f"{old}@box3", "--only", kind, "-i", inv)
        assert recorded.code == 0, recorded.out + recorded.err
    with Load(fleet.front) as load:
        run = kdctl(
            "cutover", "--to", new, "--on-fail", "abort", "--watch", "1", "--force", "--yes",
            "-i", inv, timeout=600,
        )  # fmt: skip
    assert run.code == 1, run.out + run.err
    said = " ".join(run.out.split())
    assert "rolled_back" in said and "smoke gate failed: throughput fail" in said, said
    assert "is below 5" in said, said
    assert load.failures == [], load.failures[:5]
    assert _router_serves(fleet) == serving
    report(f"--on-fail abort: box 3 failed its smoke throughput run, boxes 3, 2, 1 back on {old}")


def test_a_step_stuck_past_the_progress_deadline_aborts_the_rollout(
    fleet: Fleet, report: Any
) -> None:
    """Clients that talk to box 1's engine directly, past the router, keep it busy: its drain
    (a 60 s deadline of its own) is not done by the rollout's 5 s progress deadline, so the
    rollout aborts, box 1 back in the router, the load through the front unharmed."""
    import threading

    import httpx

    inv = str(fleet.inventory)
    serving = _router_serves(fleet)
    old = serving[0].partition("@")[0]
    new = "sglang" if old == "native" else "native"
    url = load_inventory(fleet.inventory).backends[serving[0]].url
    body = {
        "input_ids": [11, 12, 13],
        "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True},
    }
    stop = threading.Event()

    def busy() -> None:
        with httpx.Client(timeout=120) as client:
            while not stop.is_set():
                client.post(f"{url}/generate", json=body)

    # Three overlapping, so its running gauge never reads 0.
    threads = [threading.Thread(target=busy, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        with Load(fleet.front) as load:
            run = kdctl(
                "cutover", "--to", new, "--progress-deadline", "5s", "--watch", "1", "--force",
                "--yes", "-i", inv, timeout=600,
            )  # fmt: skip
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    assert run.code == 1, run.out + run.err
    said = " ".join(run.out.split())
    assert "rolled_back" in said and f"drain {serving[0]}" in said, said
    assert "not done 5s after it began (the progress deadline)" in said, said
    assert load.failures == [], load.failures[:5]
    assert _router_serves(fleet) == serving
    report(f"progress deadline 5 s: {serving[0]}'s drain stuck, the rollout aborted, box 1 back")


def test_a_wave_the_boxes_left_could_not_carry_is_refused_with_the_figures(
    fleet: Fleet, tmp_path: Path
) -> None:
    """Each of the four engines serving has a long generation running (by its own gauge);
    with one request per replica as the pool's capacity, the three boxes left could not carry
    the four: the first wave is refused with those figures and nothing moves. The same with
    no capacity set, where each replica's recorded throughput run at concurrency 1 is what it
    was measured carrying."""
    import yaml

    serving = _router_serves(fleet)
    pool = serving[0].partition("@")[0]
    other = "sglang" if pool == "native" else "native"
    inv = _tight(fleet, tmp_path)
    with _one_long_request_each(inv, serving):
        run = kdctl("cutover", "--to", other, "--watch", "1", "--force", "--yes", "-i", inv)
    assert run.code == 1, run.out + run.err
    said = " ".join(run.out.split())
    assert "headroom: load 4 requests (running and queued) on 4 engines; the 3 left carry 3" in said
    assert f"({pool}: 1 a replica by its capacity_per_replica)" in said, said
    assert f"taking out {serving[0]} refused" in said, said
    assert _router_serves(fleet) == serving

    data = yaml.safe_load(fleet.inventory.read_text())
    data["gates"]["throughput"]["workload"]["concurrency"] = [1]
    measured = str(write_inventory(tmp_path / "measured.yaml", data))
    for name in serving:
        recorded = kdctl("baseline", "record", "-b", name, "--only", "throughput", "-i", measured)
        assert recorded.code == 0, recorded.out + recorded.err
    with _one_long_request_each(measured, serving):
        run = kdctl("cutover", "--to", other, "--watch", "1", "--force", "--yes", "-i", measured)
    assert run.code == 1, run.out + run.err
    said = " ".join(run.out.split())
    assert "on 4 engines; the 3 left carry 3 (" in said, said
    assert f"{pool}: 1 a replica, measured ({pool}@box" in said, said
    assert "no SLO set: every request served" in said, said
    assert _router_serves(fleet) == serving


def test_a_replica_carries_the_highest_concurrency_that_held_every_slo() -> None:
    """The measured peak headroom counts by: at concurrency 8 the TTFT SLO broke, at 4 one
    request failed where none may: 2 is what was carried. With no SLO set, any concurrency
    served without a failure counts (4 failed one), so 8."""
    from kdctl.checks.throughput import carried
    from kdctl.inventory.models import ThroughputSettings
    from kdctl.loadgen import BenchMetrics, RequestRecord

    def point(size: int, ttft_s: float, failed: int = 0) -> BenchMetrics:
        records = [
            RequestRecord(started_at=0.0, ok=i >= failed, output_tokens=8, ttft_s=ttft_s, e2el_s=1)
            for i in range(4)
        ]
        return BenchMetrics.of(
            records, 1.0, max_concurrency=size, request_rate=None, burstiness=1.0,
            client="httpx", output_len=8, slo=None,
        )  # fmt: skip

    points = [point(1, 0.1), point(2, 0.2), point(4, 0.3, failed=1), point(8, 0.9)]
    peak = carried(ThroughputSettings(slo_ttft_ms=500), points)
    assert peak == (2, "every SLO held (p99 TTFT <= 500 ms)"), peak
    assert carried(ThroughputSettings(), points) == (8, "no SLO set: every request served")
    assert carried(ThroughputSettings(slo_ttft_ms=50), points) is None


def test_a_person_pauses_a_running_rollout_then_aborts_it(fleet: Fleet, tmp_path: Path) -> None:
    """`kdctl cutover pause` while another process rolls: heeded at its next box, the boxes
    moved stay moved; `kdctl cutover abort` then moves every box back, once the boxes left
    while each goes back can carry the load."""
    import time

    from kdctl.traffic import SqliteJournal

    inv = str(fleet.inventory)
    serving = _router_serves(fleet)
    old = serving[0].partition("@")[0]
    new = "sglang" if old == "native" else "native"
    state = load_inventory(fleet.inventory).state_dir
    rolling = kdctl_start("cutover", "--to", new, "--watch", "1", "--force", "--yes", "-i", inv)
    deadline = time.monotonic() + 300
    moved_one = False
    while time.monotonic() < deadline and rolling.poll() is None and not moved_one:
        with SqliteJournal(state) as journal:
            record = journal.latest()
        moved_one = record is not None and any(
            s.kind == "add-to-routers" and s.phase == "done" for s in record.steps
        )
        time.sleep(0.2)
    assert moved_one, "the first box was never put back"
    paused = kdctl("cutover", "pause", "-i", inv)
    assert paused.code == 0 and "pause ordered" in paused.out, paused.out + paused.err
    assert rolling.wait(300) == 1
    with SqliteJournal(state) as journal:
        record = journal.latest()
    assert record is not None and record.state == "paused", record
    assert record.reason is not None and "pause ordered by a person" in record.reason
    assert _router_serves(fleet) == sorted([f"{new}@box1", *serving[1:]])

    # With a long request on each engine and one request per replica as the capacity, the
    # three boxes left while one goes back could not carry the four: the abort is held, as
    # the wave was, with the figures, and nothing moves.
    tight = _tight(fleet, tmp_path)
    now = _router_serves(fleet)
    with _one_long_request_each(tight, now):
        held = kdctl("cutover", "abort", "--yes", "-i", tight, timeout=300)
    assert held.code == 1, held.out + held.err
    said = " ".join(held.err.split())
    assert "moving the boxes back held, headroom: load 4 requests" in said, said
    assert "the 3 left carry 3 (" in said and f"taking out {new}@box1 refused" in said, said
    assert _router_serves(fleet) == now
    with SqliteJournal(state) as journal:
        assert journal.get(record.id).state == "paused"  # type: ignore[union-attr]

    aborted = kdctl("cutover", "abort", "--yes", "-i", inv, timeout=300)
    assert aborted.code == 0, aborted.out + aborted.err
    assert _router_serves(fleet) == serving
    with SqliteJournal(state) as journal:
        assert journal.get(record.id).state == "rolled_back"  # type: ignore[union-attr]


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

    serving = _router_serves(fleet)
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
    assert _router_serves(fleet) == serving
    report(
        f"rolling cutover of 4 boxes behind nginx: {load.sent} requests, 0 failed, answered "
        f"by {dict(sorted(answered.items()))}; rolled back under load, 0 failed"
    )
