"""A rolling cutover stopped (the fleet of tests/support/fleet.py, as tests/test_rolling.py
rolls it): by --on-fail abort, by its progress deadline, by the headroom rule before a wave or
a move back, by a person's pause and abort."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kdctl.inventory import load_inventory
from tests.conftest import kdctl, kdctl_start, write_inventory
from tests.support.fleet import Fleet, four_boxes, router_serves
from tests.support.traffic import Load

fleet = pytest.fixture(scope="module", name="fleet")(four_boxes)


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


def test_on_fail_abort_moves_every_box_back(fleet: Fleet, tmp_path: Path, report: Any) -> None:
    """--on-fail abort: box 3's new engine, judged alone, is slower than its smoke throughput
    run allows against what box 3's old engine recorded (the bar set at 5x, out of reach), so
    it goes back, then every box moved before it, the last moved first; the rollout ends
    rolled back, not paused."""
    import yaml

    serving = router_serves(fleet)
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
    assert router_serves(fleet) == serving
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
    serving = router_serves(fleet)
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
    assert router_serves(fleet) == serving
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

    serving = router_serves(fleet)
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
    assert router_serves(fleet) == serving

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
    assert router_serves(fleet) == serving


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
    serving = router_serves(fleet)
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
    assert router_serves(fleet) == sorted([f"{new}@box1", *serving[1:]])

    # With a long request on each engine and one request per replica as the capacity, the
    # three boxes left while one goes back could not carry the four: the abort is held, as
    # the wave was, with the figures, and nothing moves.
    tight = _tight(fleet, tmp_path)
    now = router_serves(fleet)
    with _one_long_request_each(tight, now):
        held = kdctl("cutover", "abort", "--yes", "-i", tight, timeout=300)
    assert held.code == 1, held.out + held.err
    said = " ".join(held.err.split())
    assert "moving the boxes back held, headroom: load 4 requests" in said, said
    assert "the 3 left carry 3 (" in said and f"taking out {new}@box1 refused" in said, said
    assert router_serves(fleet) == now
    with SqliteJournal(state) as journal:
        assert journal.get(record.id).state == "paused"  # type: ignore[union-attr]

    aborted = kdctl("cutover", "abort", "--yes", "-i", inv, timeout=300)
    assert aborted.code == 0, aborted.out + aborted.err
    assert router_serves(fleet) == serving
    with SqliteJournal(state) as journal:
        assert journal.get(record.id).state == "rolled_back"  # type: ignore[union-attr]
