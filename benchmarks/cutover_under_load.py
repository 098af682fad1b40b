"""Switch and rollback under load, for each router driver: nginx and SGLang's router.

Two reference servers (the same tiny model) sit behind each router on loopback. Eight client
threads send completions, a third of them streamed, through the router's front without pause;
kdctl's driver switches all traffic to
the candidate, then rolls it back. Figures, per driver:
- switch: with nginx, from the call to the first request after which every request sent was
  answered by the candidate (its X-Kdctl-Backend header says which); SGLang's router names no
  backend in its answers and routes by the request's model, so both engines serve one name and
  its figure is the time until its worker registry, read back, lists the candidate alone;
- rollback: the same, back to the baseline;
- failed requests out of all sent (at least 2000 across both changes): non-2xx, cut streams,
  connection errors.
Targets: 0 failed requests; blue-green switch and rollback under 1 s each with nginx.
Run: python benchmarks/cutover_under_load.py [--requests 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kdctl.backends import wait_http  # noqa: E402
from kdctl.backends.reference import serve_argv  # noqa: E402
from kdctl.inventory import load_inventory  # noqa: E402
from kdctl.traffic import make_router, router_argv  # noqa: E402
from kdctl.transports import TransportPool  # noqa: E402
from tests.support.nginx import NGINX, start_nginx, stop_nginx  # noqa: E402
from tests.support.sshd import free_port  # noqa: E402

SERVED = "tiny"


def serve(model: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(
        serve_argv(model, port, served_name=SERVED),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return proc, f"http://127.0.0.1:{port}"


class Load:
    """(send time, who answered or None on failure, error) for every request."""

    def __init__(self, front: str, threads: int = 8) -> None:
        self.front = front
        self.records: list[tuple[float, str | None, str | None]] = []
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=self.loop, args=(i,), daemon=True) for i in range(threads)
        ]

    def one(self, client: httpx.Client, stream: bool) -> tuple[str | None, str | None]:
        body = {
            "model": SERVED,
            "prompt": "def f(x):",
            "max_tokens": 2,
            "temperature": 0,
            "stream": stream,
        }
        try:
            if not stream:
                r = client.post(self.front + "/v1/completions", json=body)
                if r.status_code != 200 or not r.json().get("choices"):
                    return None, f"HTTP {r.status_code}"
                return r.headers.get("x-kdctl-backend", "?"), None
            with client.stream("POST", self.front + "/v1/completions", json=body) as r:
                lines = [ln for ln in r.iter_lines() if ln.startswith("data:")]
            if r.status_code != 200 or not lines or lines[-1] != "data: [DONE]":
                return None, f"stream HTTP {r.status_code} ended {lines[-1:]}"
            return r.headers.get("x-kdctl-backend", "?"), None
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            return None, f"{type(exc).__name__}: {exc}"

    def loop(self, i: int) -> None:
        with httpx.Client(timeout=30) as client:
            n = 0
            while not self.stop.is_set():
                sent = time.monotonic()
                who, error = self.one(client, stream=(n + i) % 3 == 0)
                self.records.append((sent, who, error))
                n += 1

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


def settle(records: list[tuple[float, str | None, str | None]], t0: float, to: str) -> float:
    """Seconds from t0 to the first request after which every request went to `to`."""
    after = sorted(r for r in records if r[0] >= t0)
    last_other = max((s for s, who, _ in after if who != to), default=t0)
    first_all = min((s for s, who, _ in after if s > last_other), default=float("nan"))
    return max(0.0, first_all - t0)


def run_driver(kind: str, models: Path, work: Path, requests: int) -> dict[str, object]:
    base_proc, base_url = serve(models)
    cand_proc, cand_url = serve(models)
    router_proc = None
    pidfile = None
    try:
        wait_http(base_url + "/health", deadline_s=180)
        wait_http(cand_url + "/health", deadline_s=180)
        port = free_port()
        router: dict[str, object] = {
            "kind": kind,
            "host": "local",
            "listen": f"127.0.0.1:{port}",
            "serving": "baseline",
        }
        root = work / kind
        root.mkdir()
        if kind == "nginx":
            router.update(
                include=str(root / "kdctl.conf"),
                nginx=NGINX,
                prefix=str(root),
                conf=str(root / "nginx.conf"),
            )
        inv_path = root / "inv.yaml"
        inv_path.write_text(
            json.dumps(
                {
                    "hosts": {"local": {"transport": "local"}},
                    "backends": {
                        "baseline": {"kind": "sglang", "host": "local", "url": base_url},
                        "candidate": {"kind": "sglang", "host": "local", "url": cand_url},
                    },
                    "router": router,
                    "state_dir": str(root / "state"),
                }
            )
        )
        inv = load_inventory(inv_path)
        if kind == "nginx":
            with TransportPool(inv) as pool:
                first = make_router(inv, pool).render({"baseline": 100})  # type: ignore[attr-defined]
            (root / "kdctl.conf").write_text(first)
            pidfile = start_nginx(root, f"  include {root / 'kdctl.conf'};", [port])
        else:
            router_proc = subprocess.Popen(
                router_argv(port, [base_url], prometheus_port=free_port()),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            wait_http(f"http://127.0.0.1:{port}/readiness", deadline_s=60)
        front = f"http://127.0.0.1:{port}"
        with TransportPool(inv) as pool, Load(front) as load:
            driver = make_router(inv, pool)
            while len(load.records) < requests // 4:
                time.sleep(0.05)
            t_switch = time.monotonic()
            driver.apply({"baseline": 0, "candidate": 100})
            applied_switch = time.monotonic() - t_switch
            while len(load.records) < requests // 2:
                time.sleep(0.05)
            t_back = time.monotonic()
            driver.apply({"baseline": 100, "candidate": 0})
            applied_back = time.monotonic() - t_back
            while len(load.records) < requests:
                time.sleep(0.05)
        records = list(load.records)
        mid = [r for r in records if r[0] < t_back]
        by_header = kind == "nginx"
        return {
            "switch_s": settle(mid, t_switch, "candidate") if by_header else applied_switch,
            "rollback_s": settle(records, t_back, "baseline") if by_header else applied_back,
            "measured": "responses" if by_header else "registry",
            "sent": len(records),
            "failed": sum(1 for r in records if r[2] is not None),
            "errors": sorted({r[2] for r in records if r[2]})[:3],  # type: ignore[dict-item]
        }
    finally:
        if pidfile is not None:
            stop_nginx(pidfile)
        for proc in (router_proc, base_proc, cand_proc):
            if proc is not None:
                proc.terminate()
                proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--drivers", nargs="+", default=["nginx", "sglang-router"])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kdctl-bench-") as tmp:
        work = Path(tmp)
        model = work / "model"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "kdctl",
                "reference",
                "make-model",
                "--arch",
                "deepseek_v3",
                "--out",
                str(model),
                "--train-steps",
                "0",
            ],
            check=True,
            capture_output=True,
            env={**os.environ},
        )
        results = {d: run_driver(d, model, work, args.requests) for d in args.drivers}
    print(
        f"{'driver':<14} {'switch s':>9} {'rollback s':>11} {'failed':>7} {'sent':>6}  measured by"
    )
    for d, r in results.items():
        print(
            f"{d:<14} {r['switch_s']:>9.3f} {r['rollback_s']:>11.3f} {r['failed']:>7} "
            f"{r['sent']:>6}  {r['measured']}"
        )
        if r["failed"]:
            print(f"  errors: {r['errors']}")
    ok = all(r["failed"] == 0 for r in results.values())
    ng = results.get("nginx")
    fast = ng is None or (float(ng["switch_s"]) < 1.0 and float(ng["rollback_s"]) < 1.0)
    print(
        f"targets: 0 failed: {'met' if ok else 'MISSED'}; nginx switch and rollback < 1 s: "
        f"{'met' if fast else 'MISSED'}"
    )


if __name__ == "__main__":
    main()
