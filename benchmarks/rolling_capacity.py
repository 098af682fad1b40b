"""The capacity curve of a rolling cutover: requests served per second through the front while
each box is out, against the whole fleet's rate before, beside the ideal (N-k)/N.

Four boxes (network namespaces with their own sshd, tests/support/fleet.py) run kdctl's
reference server as the old pool, SGLang's router in front; a closed-loop load of eight client
threads sends short generations through the router without pause. First the full fleet's rate
over a window, then `kdctl cutover --to native` box by box (one at a time) under the same load.
From the journal: each box's window out of the router (its removal read back, to its return
read back); from the load: the requests answered in it. Figures per box: the rate, its ratio to
the full fleet's, the ideal 3/4; and the failed requests (target: 0).

The engines share this machine's cores: where they are the bottleneck the curve follows the
ideal; where the cores are, a box's absence takes less than its share.
Run (as root: boxes are network namespaces): python benchmarks/rolling_capacity.py
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kdctl.inventory import load_inventory  # noqa: E402
from kdctl.traffic import SqliteJournal  # noqa: E402
from tests.support.fleet import bench_model, rolling_fleet  # noqa: E402


class Load:
    """Closed-loop clients through the front: each answer's end time, and every failure."""

    def __init__(self, url: str, clients: int) -> None:
        self.url = url
        self.done: list[float] = []
        self.failed: list[str] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(clients)
        ]

    def _loop(self, i: int) -> None:
        body = {
            "input_ids": [11 + i, 12, 13],
            "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True},
        }
        with httpx.Client(timeout=60) as client:
            while not self._stop.is_set():
                try:
                    r = client.post(self.url + "/generate", json=body)
                    if r.status_code == 200:
                        self.done.append(time.time())
                    else:
                        self.failed.append(f"HTTP {r.status_code}")
                except httpx.HTTPError as exc:
                    self.failed.append(type(exc).__name__)

    def rate(self, start: float, end: float) -> float:
        return sum(start <= t < end for t in self.done) / max(end - start, 1e-9)

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)


def _at(dt: datetime) -> float:
    return dt.replace(tzinfo=dt.tzinfo or UTC).timestamp()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--window", type=float, default=15.0, help="seconds of the full rate")
    args = parser.parse_args()
    model = bench_model("rolling_capacity")
    with rolling_fleet(model, tag="bench") as fleet, Load(fleet.front, args.clients) as load:
        time.sleep(3)  # every client going
        full_from = time.time()
        time.sleep(args.window)
        full = load.rate(full_from, time.time())
        run = subprocess.run(
            [sys.executable, "-m", "kdctl", "cutover", "--to", "native", "--watch", "5",
             "--force", "--yes", "-i", str(fleet.inventory)],
            capture_output=True, text=True,
        )  # fmt: skip
        if run.returncode != 0:
            sys.exit(f"rolling_capacity: the cutover failed: {run.stdout}{run.stderr}")
        with SqliteJournal(load_inventory(fleet.inventory).state_dir) as journal:
            record = journal.latest()
    assert record is not None
    out = {
        s.detail.get("backend"): _at(s.at)
        for s in record.steps
        if s.kind == "remove-from-routers" and s.phase == "done"
    }
    back = {
        s.detail.get("backend"): _at(s.at)
        for s in record.steps
        if s.kind == "add-to-routers" and s.phase == "done"
    }
    n = len(out)
    print(f"full fleet ({n} boxes): {full:.1f} requests/s over {args.window:g}s")
    print(f"{'box out':<14}{'seconds':>9}{'req/s':>9}{'ratio':>8}{'ideal':>8}")
    for old, start in out.items():
        box = str(old).partition("@")[2]
        end = next(t for name, t in back.items() if str(name).endswith(f"@{box}"))
        rate = load.rate(start, end)
        print(f"{box:<14}{end - start:>9.1f}{rate:>9.1f}{rate / full:>8.2f}{(n - 1) / n:>8.2f}")
    print(f"failed requests: {len(load.failed)} of {len(load.done) + len(load.failed)}")


if __name__ == "__main__":
    main()
