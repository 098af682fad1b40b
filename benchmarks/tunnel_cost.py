"""What HTTP over SSH costs the throughput gate: kdctl's load generator on one reference server,
directly and through the SSH tunnel to its box, round after round in one run.

The box is a network namespace with its own sshd (tests/support/box.py), as a GPU box reached
over a network; one `kdctl reference serve` (a Llama made here, random weights) listens inside
it on all its addresses, so one URL, the box's address, is reached both ways: `http: direct`
dials it from here, `http: ssh` has the box's sshd dial it, every request carried by a
direct-tcpip channel of kdctl's one SSH connection to the box (through the tunnel's local
socket, as the load generator's aiohttp client takes it). Each run is the throughput gate's own
measurement (`checks.throughput.build_requests` and `measure`), in a session of its own, so the
tunnel's connection and channels are set up in the run's warm-up, as in a gate.

The workload: 64 prompts of 64 random token ids, 64 output tokens each with ignore_eos, at most
8 in flight, greedy, after 8 warm-up requests. The server runs on the first half of this
machine's CPUs, this process (the client and its end of the tunnel) on the rest (`--no-pin`
turns this off); the box's sshd, the tunnel's far end, is the box's, unpinned. The two paths
alternate, who goes first swapping every round, so machine noise lands on both.

With `--server fast`, the server is benchmarks/client_capacity.py's, which streams OpenAI
completions as fast as the socket takes them (no model, no pacing), at 64 streams of 128 tokens:
the rate a path then carries is the most it can carry, where the reference server's rate is the
engine's own and a path's cost shows only as latency.

Figures printed: output token throughput, median TTFT, median and mean ITL of each run; the tunnel's
over the direct path's in each round, and the median of those ratios with two standard errors
(1.2533 * 1.4826 MAD / sqrt(n)), as benchmarks/bench_vs_vllm.py judges its rounds.
Run as root (it makes a network namespace and starts sshd):
python benchmarks/tunnel_cost.py [--rounds 8] [--prompts N] [--client aiohttp|httpx]
[--server reference|fast]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from benchmarks._vllm import make_tiny_llama, split_cpus  # noqa: E402
from kdctl.backends.reference import serve_argv  # noqa: E402
from kdctl.checks._base import GateContext  # noqa: E402
from kdctl.checks.throughput import build_requests, measure  # noqa: E402
from kdctl.inventory import LoadedInventory  # noqa: E402
from kdctl.inventory.models import Inventory  # noqa: E402
from kdctl.session import Session  # noqa: E402
from tests.support.box import Box, make_box  # noqa: E402
from tests.support.sshd import free_port  # noqa: E402

# (input tokens, output tokens, streams, prompts) for each server.
WORKLOADS = {"reference": (64, 64, 8, 64), "fast": (16, 128, 64, 512)}
FIGURES = ("output tok/s", "median TTFT ms", "median ITL ms", "mean ITL ms")
HEADER = (
    f"{'round':>6} {'path':>7} {'tok/s':>9} {'TTFT ms':>9} {'ITL ms':>8} {'mean ITL':>8} "
    f"{'failed':>6} {'via':>8}"
)


@dataclass
class Run:
    path: str
    round: int
    tok_s: float
    ttft_ms: float
    itl_ms: float
    # The mean beside the median: a path that delivers events in clumps (several in one
    # read) lowers the median gap and leaves the mean, the time per token, as it was.
    itl_mean_ms: float
    failed: int
    http_path: str | None

    def figure(self, name: str) -> float:
        return {
            "output tok/s": self.tok_s,
            "median TTFT ms": self.ttft_ms,
            "median ITL ms": self.itl_ms,
            "mean ITL ms": self.itl_mean_ms,
        }[name]


def inventory(
    box: Box, port: int, http: str, server: str, prompts: int, client: str, work: Path
) -> Inventory:
    input_len, output_len, streams, _ = WORKLOADS[server]
    kind = "sglang" if server == "reference" else "openai"
    return Inventory.model_validate(
        {
            "hosts": {"box": box.host_entry(http=http)},
            "backends": {
                "engine": {"kind": kind, "host": "box", "url": f"http://{box.address}:{port}"}
            },
            "gates": {
                "throughput": {
                    "workload": {
                        "input_len": input_len,
                        "output_len": output_len,
                        "concurrency": [streams],
                        "num_prompts": prompts,
                        "ignore_eos": True,
                        "source": "random-ids",
                    },
                    "client": client,
                }
            },
            "state_dir": str(work / "state"),
        }
    )


def run_once(spec: Inventory, work: Path, path: str, n: int) -> Run:
    """The throughput gate's measurement, in a session of its own (its SSH connection and
    channels set up in the warm-up, as in a gate)."""
    inv = LoadedInventory(spec=spec, path=work / f"{path}.yaml", state_dir=work / "state")
    with Session(inv) as session:
        ctx = GateContext(inventory=inv, backend=session.backend, baseline_lookup=lambda *_: None)
        settings = spec.gates.throughput
        requests, _ = build_requests(inv, settings)
        with ctx.backend("engine") as be:
            ((runs,),) = measure(ctx, [be], settings, requests)
    m = runs.median
    if m.ttft_ms.p50 is None or m.itl_ms.p50 is None:
        raise SystemExit(f"the {path} run measured nothing: {m.errors}")
    return Run(
        path,
        n,
        m.output_throughput,
        m.ttft_ms.p50,
        m.itl_ms.p50,
        m.itl_ms.mean or float("nan"),
        m.failed,
        m.http_path,
    )


# benchmarks/client_capacity.py's server, on every address of the box.
FAST_SERVER = """
import socket, sys
sys.path.insert(0, {repo!r})
from benchmarks.client_capacity import _serve
_serve(socket.create_server(("0.0.0.0", {port}), backlog=2048))
"""


def wait_ready(box: Box, port: int, proc: subprocess.Popen[bytes], log: Path, route: str) -> None:
    """Until the server answers `route` with 200 on the box's address (reached directly)."""
    box.wait_listening(port)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://{box.address}:{port}{route}", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit("the server did not become ready in 300 s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8, help="runs of each path, alternated")
    ap.add_argument("--prompts", type=int, help="requests per run (64; fast: 512)")
    ap.add_argument("--client", choices=("aiohttp", "httpx"), default="aiohttp")
    ap.add_argument("--server", choices=tuple(WORKLOADS), default="reference")
    ap.add_argument("--no-pin", dest="pin", action="store_false", help="share every CPU")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: it makes a network namespace and starts sshd")

    input_len, output_len, streams, prompts = WORKLOADS[args.server]
    prompts = args.prompts or prompts
    work = Path(tempfile.mkdtemp(prefix="kdctl-tunnel-cost-"))
    work.chmod(0o755)
    server_cpus, client_cpus = split_cpus() if args.pin else (None, None)
    box = make_box(work / "box", "tunnelcost")
    port = free_port()
    log = work / "server.log"
    if args.server == "reference":
        model = make_tiny_llama(work / "llama", 0)
        argv = [*serve_argv(model, port, served_name="llama"), "--host", "0.0.0.0"]
    else:
        argv = [sys.executable, "-c", FAST_SERVER.format(repo=str(REPO), port=port)]
    if server_cpus:
        argv = ["taskset", "-c", ",".join(map(str, server_cpus)), *argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with log.open("wb") as out:
        server = box.popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    runs: list[Run] = []
    try:
        wait_ready(
            box, port, server, log, "/health" if args.server == "reference" else "/v1/models"
        )
        if client_cpus:
            os.sched_setaffinity(0, client_cpus)
        specs = {
            path: inventory(box, port, http, args.server, prompts, args.client, work)
            for path, http in (("direct", "direct"), ("tunnel", "ssh"))
        }
        placement = (
            f"server on CPUs {server_cpus}, client on {client_cpus}"
            if server_cpus
            else "server and client on every CPU"
        )
        print(
            f"{args.server} server in box {box.netns} at {box.address}:{port} ({placement}); "
            f"{prompts} prompts of {input_len} random tokens, {output_len} out, "
            f"concurrency {streams}, {streams} warm-up requests, ignore_eos, greedy, "
            f"client {args.client}; {args.rounds} rounds, paths alternated"
        )
        print(HEADER)
        # The server's first runs are slower (its allocator grows, its caches warm).
        for path in ("direct", "tunnel"):
            run_once(specs[path], work, path, 0)
        for n in range(1, args.rounds + 1):
            order = ("direct", "tunnel") if n % 2 else ("tunnel", "direct")
            for path in order:
                r = run_once(specs[path], work, path, n)
                runs.append(r)
                print(
                    f"{n:>6} {path:>7} {r.tok_s:>9.1f} {r.ttft_ms:>9.1f} {r.itl_ms:>8.2f} "
                    f"{r.itl_mean_ms:>8.2f} {r.failed:>6} {r.http_path or '?':>8}",
                    flush=True,
                )
    finally:
        server.terminate()
        server.wait(10)
        box.close()
        shutil.rmtree(work, ignore_errors=True)
    for path in ("direct", "tunnel"):
        m = {
            name: statistics.median(r.figure(name) for r in runs if r.path == path)
            for name in FIGURES
        }
        print(
            f"{'median':>6} {path:>7} {m['output tok/s']:>9.1f} {m['median TTFT ms']:>9.1f} "
            f"{m['median ITL ms']:>8.2f} {m['mean ITL ms']:>8.2f}"
        )
    by_round = {(r.round, r.path): r for r in runs}
    rounds = sorted({r.round for r in runs})
    for name in FIGURES:
        ratios = [
            by_round[n, "tunnel"].figure(name) / by_round[n, "direct"].figure(name) for n in rounds
        ]
        ratio = statistics.median(ratios)
        mad = statistics.median(abs(x - ratio) for x in ratios)
        error = 1.2533 * 1.4826 * mad / len(ratios) ** 0.5
        shown = " ".join(f"{x:.2f}" for x in ratios)
        print(
            f"tunnel/direct {name}: median of rounds {ratio:.3f} +/- {2 * error:.3f}; "
            f"rounds: {shown}"
        )
    failed = sum(r.failed for r in runs)
    paths = sorted({f"{r.path}={r.http_path}" for r in runs})
    print(f"failed requests: {failed}; recorded paths: {', '.join(paths)}")


if __name__ == "__main__":
    main()
