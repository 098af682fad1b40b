"""`kdctl status` of the sandbox with its evidence, beside the same HTTP requests made alone.

The floor is a fresh Python process that imports httpx and sends, eight at a time as status
does, exactly the requests a status of the sandbox sends (read off a status run with every
request counted): each engine's health, model and server info, its one-token generation, and
one generation through the router's front. What status costs above that is kdctl's own: its
imports, the inventory, the evidence and roadmap, the trends, the tables. Runs alternate
between the two so machine noise lands on both alike; medians are compared.

Target: a status takes at most 1.0 s of wall time on a 2-core machine.
Run: python benchmarks/status_time.py [--dir sandbox] (brings the sandbox up, with its history,
where it is not up)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# The floor: what a status of the sandbox sends, alone, as it sends it.
FLOOR = r"""
import json, sys
from concurrent.futures import ThreadPoolExecutor
import httpx
gets, posts = json.loads(sys.argv[1])
body = {"input_ids": [1], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
with httpx.Client(timeout=20) as client:
    def get(url):
        return client.get(url).status_code
    def post(url):
        return client.post(url, json=body).status_code
    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(get, gets)) + list(pool.map(post, posts))
bad = [c for c in codes if c >= 400]
sys.exit(1 if bad else 0)
"""

# A status made with every request it sends counted.
COUNT = r"""
import collections, json, sys
import httpx
seen = []
send = httpx.Client.send
def counted(self, request, **kw):
    seen.append((request.method, str(request.url)))
    return send(self, request, **kw)
httpx.Client.send = counted
sys.argv = ["kdctl", "status", "--json"]
from kdctl.cli import main
try:
    main()
except SystemExit:
    pass
sys.stderr.write(json.dumps(seen))
"""


def timed(argv: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    elapsed = time.perf_counter() - started
    if proc.returncode not in (0, 1):
        raise SystemExit(f"{argv[:4]} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, default=REPO / "sandbox")
    parser.add_argument("--repeat", type=int, default=11)
    args = parser.parse_args()
    inventory = args.dir / "inventory.yaml"
    env = {**os.environ, "KDCTL_INVENTORY": str(inventory), "COLUMNS": "160"}
    up = subprocess.run(
        [sys.executable, "-m", "kdctl", "sandbox", "status", "--dir", str(args.dir)],
        capture_output=True,
        env=env,
        check=False,
    )
    if up.returncode != 0:
        # Engines, a router and a history of evidence to judge (about a minute and a half).
        for step in (["up"], ["history"]):
            cmd = [sys.executable, "-m", "kdctl", "sandbox", *step, "--dir", str(args.dir)]
            subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)

    counted = subprocess.run(
        [sys.executable, "-c", COUNT], capture_output=True, text=True, env=env, check=False
    )
    sent = json.loads(counted.stderr.strip().splitlines()[-1])
    gets = [url for method, url in sent if method == "GET"]
    posts = [url for method, url in sent if method == "POST"]
    if len(gets) + len(posts) != len(sent):
        raise SystemExit(f"status sent requests the floor does not make: {sent}")
    doc = json.loads(counted.stdout)
    evidence = len(doc.get("gates") or [])
    print(f"a status of {inventory} sends {len(gets)} GETs and {len(posts)} POSTs")
    print(f"its evidence: {evidence} latest verdicts")

    status_argv = [sys.executable, "-m", "kdctl", "status"]
    floor_argv = [sys.executable, "-c", FLOOR, json.dumps([gets, posts])]
    statuses, floors = [], []
    for _ in range(args.repeat):
        statuses.append(timed(status_argv, env))
        floors.append(timed(floor_argv, env))
    status_s, floor_s = statistics.median(statuses), statistics.median(floors)
    print(
        f"kdctl status: median {status_s:.3f} s (min {min(statuses):.3f}, max {max(statuses):.3f})"
    )
    print(f"the same requests alone: median {floor_s:.3f} s (min {min(floors):.3f})")
    print(
        f"status / floor: {status_s / floor_s:.2f}x; kdctl's own share {status_s - floor_s:.3f} s"
    )
    met = status_s <= 1.0
    print(f"target: status at most 1.0 s: {'met' if met else 'MISSED'} ({status_s:.3f} s)")
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
