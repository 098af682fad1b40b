"""`kdctl status` against 1 and against 16 loopback sshd hosts, side by side in one run.

Every host is a real OpenSSH sshd replaying an H200's recorded nvidia-smi output, so each one
costs kdctl a connection, a round trip and the GPU, Xid and service probes. Runs alternate
between the two sizes so machine noise lands on both alike; medians are compared.

Targets: 16 hosts cost at most 2x one host; one host takes under 1.5 s of wall time.
Run as root (it starts sshd): python benchmarks/status_fanout.py [--repeat N]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

from tests.support.sshd import SshdFleet  # noqa: E402

FIXTURES = REPO / "tests" / "fixtures"


def status_once(inventory: Path) -> tuple[float, dict]:
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "kdctl", "status", "--json", "-i", str(inventory)],
        capture_output=True,
        text=True,
        check=False,
    )
    elapsed = time.perf_counter() - started
    if proc.returncode != 0:
        down = [h for h in json.loads(proc.stdout)["hosts"] if not h["reachable"]]
        raise SystemExit(f"kdctl status failed ({proc.returncode}): {proc.stderr} {down}")
    return elapsed, json.loads(proc.stdout)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--hosts", type=int, default=16)
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="kdctl-bench-"))
    root.chmod(0o755)  # the probe login reads the fleet's authorized_keys below it
    fleet = SshdFleet(root / "fleet")
    try:
        env = {
            "PATH": f"{FIXTURES / 'bin'}:/usr/local/bin:/usr/bin:/bin",
            "KDCTL_NVSMI_FIXTURES": str(FIXTURES / "nvidia-smi" / "h200-1gpu"),
        }
        names = [f"h{i:02d}" for i in range(args.hosts)]
        for name in names:
            fleet.add(name, env=env)
        inventories = {}
        for count in (1, args.hosts):
            hosts = {n: fleet.host_entry(n, gpus=1) for n in names[:count]}
            path = root / f"inventory-{count}.yaml"
            path.write_text(yaml.safe_dump({"hosts": hosts}))
            inventories[count] = path

        status_once(inventories[1])  # warm the page cache and sshd's first fork
        times: dict[int, list[float]] = {1: [], args.hosts: []}
        for _ in range(args.repeat):
            for count, path in inventories.items():
                elapsed, doc = status_once(path)
                seen = [h for h in doc["hosts"] if h["reachable"] and h["gpus"]["visible"]]
                assert len(seen) == count, f"only {len(seen)} of {count} hosts answered"
                times[count].append(elapsed)
    finally:
        fleet.stop()
        shutil.rmtree(root, ignore_errors=True)

    one = statistics.median(times[1])
    many = statistics.median(times[args.hosts])
    ratio = many / one
    print(f"kdctl status, median of {args.repeat} runs each, alternating:")
    print(f"  1 host:   {one:.3f} s   (runs: {', '.join(f'{t:.3f}' for t in times[1])})")
    print(
        f"  {args.hosts} hosts: {many:.3f} s   "
        f"(runs: {', '.join(f'{t:.3f}' for t in times[args.hosts])})"
    )
    print(f"  ratio {args.hosts}/1: {ratio:.2f}x")
    ok_ratio = ratio <= 2.0
    ok_one = one < 1.5
    print(f"target {args.hosts} hosts <= 2x one host: {'met' if ok_ratio else 'MISSED'}")
    print(f"target one host < 1.5 s: {'met' if ok_one else 'MISSED'}")
    return 0 if ok_ratio and ok_one else 1


if __name__ == "__main__":
    raise SystemExit(main())
