"""`kdctl status` over a fleet of 16 boxes, each serving a replica of one pool, beside the same
status over one of those boxes.

Sixteen boxes (network namespaces with their own sshd, tests/support/fleet.py), each running
kdctl's reference server as a replica of pool `sglang` (a second pool stopped), SGLang's router
in front of the sixteen. A status asks every replica its health, model, server info and a
one-token generation, reads each box's engine service, machine identity and GPUs over SSH, and
reads the router's registry back. Runs alternate between the 16-box inventory and one naming
only the first box, so machine noise lands on both alike; medians are compared. Each 16-box run
also counts the SSH logins every box's sshd accepted. The boxes' root reads an empty .bashrc
(tests/support/fleet.py), not this machine's, whose `pyenv init` costs 0.1 s a command.

Target: a status of the 16 boxes answers within 2.0 s of wall time on a 2-core machine, with
one SSH connection per box.
Run (as root: boxes are network namespaces): python benchmarks/status_fleet.py [--runs 5]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.support.fleet import bench_model, rolling_fleet  # noqa: E402
from tests.support.warm import WarmCli  # noqa: E402

BOXES = 16


def _status(inventory: Path) -> float:
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "kdctl", "status", "--json", "-i", str(inventory)],
        capture_output=True,
        text=True,
    )
    took = time.perf_counter() - started
    if not done.stdout:
        sys.exit(f"status_fleet: status printed nothing: {done.stderr[-2000:]}")
    return took


def _runs(times: list[float]) -> str:
    return ", ".join(f"{t:.2f}" for t in times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    model = bench_model("status_fleet")
    work = model.parent
    # Sixteen cold engine starts at once would load two cores for a minute: each engine is a
    # fork of a server that imported torch and the reference server once, as in the tests.
    engines = WarmCli("engine")

    def warm(argv: list[str]) -> list[str]:
        stand_in = REPO / "tests" / "support" / "warm_exec.py"
        return [sys.executable, str(stand_in), engines.socket_path(), *argv[3:]]

    with contextlib.ExitStack() as stack:
        stack.callback(engines.close)
        fleet = stack.enter_context(rolling_fleet(model, tag="st", size=BOXES, wrap=warm))
        one = work / "one-box.yaml"
        data = yaml.safe_load(fleet.inventory.read_text())
        data["groups"]["boxes"] = data["groups"]["boxes"][:1]
        one.write_text(yaml.safe_dump(data, sort_keys=False))
        logs = [box.root / "sshd.log" for box in fleet.boxes]

        def logins() -> list[int]:
            return [p.read_text().count("Accepted publickey") for p in logs]

        _status(fleet.inventory)  # the page cache warm for both
        full: list[float] = []
        single: list[float] = []
        per_box: list[int] = []
        for _ in range(args.runs):
            before = logins()
            full.append(_status(fleet.inventory))
            per_box += [a - b for a, b in zip(logins(), before, strict=True)]
            single.append(_status(one))
    f, s = statistics.median(full), statistics.median(single)
    print(f"status over {BOXES} boxes: median {f:.2f} s  (runs: {_runs(full)})")
    print(f"status over 1 box:    median {s:.2f} s  (runs: {_runs(single)})")
    print(f"ratio {BOXES} boxes / 1 box: {f / s:.2f}; target: {BOXES} boxes within 2.0 s")
    print(f"SSH logins per box per status: min {min(per_box)}, max {max(per_box)} (target: 1)")


if __name__ == "__main__":
    main()
