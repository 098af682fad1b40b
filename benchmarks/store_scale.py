"""`kdctl status` and `kdctl phases` with 10,000 results in the evidence store, SQLite and
PostgreSQL side by side in one run.

Both stores hold the same 10,000 results (five gates over the sandbox roadmap's three
backends, the criteria's own settings on a share of them, spread over 90 days). Each round
runs the status assessment and the phases assessment in this process against each store in
turn, with every store method timed: the figure is the store's time (queries and decoding the
records it returns), the median of the rounds, next to the whole command's wall time. The
engines are not running (their ports refuse at once), so the rest is small and alike.

Target: each command under one second of store time on either store.
Run as root (it starts a PostgreSQL cluster of its own): python benchmarks/store_scale.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

from kdctl.checks import gate_settings  # noqa: E402
from kdctl.evidence import EvidenceStore, SqliteStore, open_url  # noqa: E402
from kdctl.inventory import load_inventory  # noqa: E402
from kdctl.readiness import assess_phases  # noqa: E402
from kdctl.records import GateResult, Metric, utcnow  # noqa: E402
from kdctl.status import status_report  # noqa: E402
from tests.support.postgres import start_cluster, stop_cluster  # noqa: E402
from tests.support.sshd import free_port  # noqa: E402

TIMED = ("results", "get", "baselines", "latest", "count")


def inventory(root: Path) -> Path:
    backends = {
        name: {"kind": "sglang", "host": "local", "url": f"http://127.0.0.1:{free_port()}"}
        for name in ("baseline", "candidate", "candidate-int4")
    }
    doc = {
        "hosts": {"local": {"transport": "local"}},
        "backends": backends,
        "roadmap": str(REPO / "roadmap" / "sandbox.yaml"),
        "state_dir": str(root / "state"),
    }
    path = root / "inventory.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def results(inv_path: Path, n: int) -> list[GateResult]:
    inv = load_inventory(inv_path)
    gates = ("health", "exactness", "throughput", "api-conformance", "promotion")
    backends = ("candidate", "candidate-int4", "baseline")
    now = utcnow()
    made = []
    for i in range(n):
        gate, backend = gates[i % len(gates)], backends[(i // len(gates)) % len(backends)]
        ended = now - timedelta(minutes=13 * (n - i))
        made.append(
            GateResult(
                gate=gate,
                backend=backend,
                baseline=None if gate == "health" else "baseline",
                verdict="pass" if i % 3 else "fail",
                metrics=[
                    Metric(
                        name="c4.ratio", value=0.5 + i / (2 * n), threshold=0.8, comparison=">="
                    ),
                    Metric(name="match_rate", value=i / n, threshold=1.0, comparison=">="),
                ],
                reasons=[f"result {i}"],
                settings=gate_settings(inv, gate) if i % 2 else {},
                started_at=ended - timedelta(minutes=2),
                ended_at=ended,
            )
        )
    return made


def timed(store: EvidenceStore) -> dict[str, float]:
    spent = {"s": 0.0}
    for name in TIMED:
        method: Callable[..., Any] = getattr(store, name)

        def wrapper(*args: Any, _m: Callable[..., Any] = method, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return _m(*args, **kwargs)
            finally:
                spent["s"] += time.perf_counter() - started

        setattr(store, name, wrapper)
    return spent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--results", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="kdctl-store-scale-"))
    inv_path = inventory(root)
    inv = load_inventory(inv_path)
    made = results(inv_path, args.results)
    cluster = start_cluster()
    try:
        url = cluster.create_database()
        stores: dict[str, EvidenceStore] = {
            "sqlite": SqliteStore(root / "evidence.sqlite"),
            "postgresql": open_url(url, password=cluster.password),
        }
        for store in stores.values():
            store.merge(made, [], source="benchmark")
            assert store.count() == (args.results, 0)
        figures: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for _ in range(args.rounds):
            for kind, store in stores.items():
                for command, run in (
                    ("status", lambda s: status_report(inv, s, deadline_s=2)),
                    ("phases", lambda s: assess_phases(inv, s)),
                ):
                    spent = timed(store)
                    started = time.perf_counter()
                    run(store)
                    wall = time.perf_counter() - started
                    for name in TIMED:  # the instance's wrappers off again
                        delattr(store, name)
                    figures.setdefault((kind, command), []).append((spent["s"], wall))
        for store in stores.values():
            store.close()
    finally:
        stop_cluster(cluster)
    print(f"{args.results} results in each store, median of {args.rounds} rounds")
    print(f"{'store':<11} {'command':<8} {'store s':>8} {'wall s':>8}  under 1 s of store time")
    for (kind, command), rows in sorted(figures.items()):
        store_s = statistics.median(r[0] for r in rows)
        wall_s = statistics.median(r[1] for r in rows)
        verdict = "yes" if store_s < 1.0 else "NO"
        print(f"{kind:<11} {command:<8} {store_s:8.3f} {wall_s:8.3f}  {verdict}")
    for command in ("status", "phases"):
        pg = statistics.median(r[0] for r in figures[("postgresql", command)])
        lite = statistics.median(r[0] for r in figures[("sqlite", command)])
        print(f"{command}: PostgreSQL over SQLite store time {pg / lite:.2f}x")


if __name__ == "__main__":
    main()
