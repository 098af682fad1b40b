"""The all-reduce probe, run on the backend's host by torchrun, one process per TP rank.

Standalone on purpose: it is copied to the host and run with the host's own Python and torch,
so it imports nothing from kdctl. Rank 0 prints one line, `KDCTL_ALLREDUCE {json}`.

Correctness is exact: each rank contributes small integers in float32, whose sum is exactly
representable, and every element is compared with the closed form. Timing follows nccl-tests'
blocking mode: one all_reduce at a time, synchronised, the slowest rank's mean time counted;
busbw = algbw * 2(n-1)/n. On GPUs each all_reduce is timed by CUDA events on its stream, as
nccl-tests times it: a host clock around it also counts the synchronisation, 19-32 us more on an
H200 with one rank (docs/gpu-validation.md), against a small-message budget of about 30 us.
`wall_us` keeps the host-clock figure beside it. Events still count a launch the idle GPU waits
for: torch's one-rank no-op took 27-57 us by them.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

# NCCL_* variables that NCCL does not read: NVIDIA's CUDA images set NCCL_VERSION as a label
# (2.28.3-1 on the H200 machine, whose torch loaded NCCL 2.28.9), not a setting in force.
NOT_SETTINGS = {"NCCL_VERSION"}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _point(
    nbytes: int, device: torch.device, world: int, rank: int, iters: int, warmup: int
) -> dict[str, float | int | str]:
    n = max(1, nbytes // 4)
    pattern = torch.arange(n, device=device, dtype=torch.int64) % 7
    data = (pattern + rank).to(torch.float32)
    dist.all_reduce(data)
    expected = (pattern * world + world * (world - 1) // 2).to(torch.float32)
    wrong = torch.tensor([int((data != expected).sum().item())], device=device)
    buf = torch.zeros(n, device=device, dtype=torch.float32)
    for _ in range(warmup):
        dist.all_reduce(buf)
    _sync(device)
    cuda = device.type == "cuda"
    times, walls = [], []
    for _ in range(iters):
        _sync(device)
        start = time.perf_counter()
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            dist.all_reduce(buf)
            end.record()
            end.synchronize()
            walls.append(time.perf_counter() - start)
            times.append(begin.elapsed_time(end) / 1e3)  # milliseconds
        else:
            dist.all_reduce(buf)
            walls.append(time.perf_counter() - start)
            times.append(walls[-1])
    mean = torch.tensor(
        [sum(times) / len(times), sum(walls) / len(walls)], device=device, dtype=torch.float64
    )
    dist.all_reduce(mean, op=dist.ReduceOp.MAX)
    dist.all_reduce(wrong)
    seconds, wall = (float(x) for x in mean.tolist())
    algbw = n * 4 / seconds / 1e9
    return {
        "bytes": n * 4,
        "time_us": round(seconds * 1e6, 3),
        "wall_us": round(wall * 1e6, 3),
        "timer": "cuda-events" if cuda else "wall-clock",
        "algbw_gbps": round(algbw, 3),
        "busbw_gbps": round(algbw * 2 * (world - 1) / world, 3),
        "wrong": int(wrong.item()),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=["nccl", "gloo"], required=True)
    ap.add_argument("--sizes", type=int, nargs="+", required=True, help="bytes per all_reduce")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--init-timeout-s", type=float, default=60.0)
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    # Fault injection for the watchdog's own test: this rank never joins, as a rank stuck on a
    # broken P2P path never does.
    if os.environ.get("KDCTL_PROBE_STALL_RANK") == str(rank):
        time.sleep(10**6)
    if args.backend == "nccl":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    dist.init_process_group(args.backend, timeout=timedelta(seconds=args.init_timeout_s))
    points = [_point(s, device, world, rank, args.iters, args.warmup) for s in args.sizes]
    if rank == 0:
        nccl = None
        if args.backend == "nccl":
            v = torch.cuda.nccl.version()
            nccl = ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
        print(
            "KDCTL_ALLREDUCE "
            + json.dumps(
                {
                    "backend": args.backend,
                    "world": world,
                    "device": torch.cuda.get_device_name(device)
                    if device.type == "cuda"
                    else "cpu",
                    "torch": torch.__version__,
                    "nccl": nccl,
                    "env": {
                        k: v
                        for k, v in sorted(os.environ.items())
                        if k.startswith("NCCL_") and k not in NOT_SETTINGS
                    },
                    "points": points,
                }
            ),
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
