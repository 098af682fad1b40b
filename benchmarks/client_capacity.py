"""Which HTTP client keeps up as kdctl's load generator: httpx against aiohttp, side by side.

A paced server on loopback (its own process) answers SGLang's streaming `/generate` with one
cumulative event every ITL milliseconds, so the true inter-token latency and the least possible
run time are known. kdctl's load generator then drives it through each client at several
concurrencies, alternating clients so machine noise lands on both. A client keeps up when its
measured ITL stays near the paced one and the run takes little longer than the ideal.

Figures printed: ideal and measured duration, output tokens/s, mean and p99 ITL as the client
saw it, each client's ratio against the ideal, and aiohttp's throughput over httpx's.
Run: python benchmarks/client_capacity.py [--itl-ms 5] [--tokens 64] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import socket
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kdctl.backends import GenerateRequest, make_backend  # noqa: E402
from kdctl.inventory import BackendSpec  # noqa: E402
from kdctl.load import BenchMetrics, LoadPlan, run_load  # noqa: E402


def _events(tokens: int) -> list[bytes]:
    out = []
    for n in range(1, tokens + 1):
        event = {
            "text": "x" * n,
            "output_ids": list(range(100, 100 + n)),
            "meta_info": {
                "prompt_tokens": 8,
                "completion_tokens": n,
                "finish_reason": {"type": "length", "length": tokens} if n == tokens else None,
            },
        }
        data = f"data: {json.dumps(event)}\n\n".encode()
        out.append(f"{len(data):x}\r\n".encode() + data + b"\r\n")
    done = b"data: [DONE]\n\n"
    out.append(f"{len(done):x}\r\n".encode() + done + b"\r\n0\r\n\r\n")
    return out


def _serve(sock: socket.socket, tokens: int, itl_s: float) -> None:
    events = _events(tokens)
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                header = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in header.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                writer.write(head)
                loop = asyncio.get_running_loop()
                start = loop.time()
                for i, event in enumerate(events):
                    # Paced against the start, so server-side jitter does not accumulate.
                    delay = start + (i + 1) * itl_s - loop.time()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    writer.write(event)
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, sock=sock, backlog=1024)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--itl-ms", type=float, default=5.0)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--requests-per-slot", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    port = sock.getsockname()[1]
    server = multiprocessing.Process(
        target=_serve, args=(sock, args.tokens, args.itl_ms / 1000.0), daemon=True
    )
    server.start()
    spec = BackendSpec(kind="sglang", host="local", url=f"http://127.0.0.1:{port}")
    backend = make_backend("paced", spec)
    print(
        f"paced SGLang stream: {args.tokens} tokens at {args.itl_ms} ms ITL "
        f"(one request ideally {args.tokens * args.itl_ms / 1000:.3f} s); "
        f"{args.repeat} alternating repeats, medians"
    )
    header = (
        f"{'conc':>5} {'client':>8} {'ideal s':>8} {'run s':>8} {'x ideal':>8} "
        f"{'out tok/s':>10} {'ITL mean':>9} {'ITL p99':>8} {'fail':>5}"
    )
    print(header)
    summary = []
    try:
        for conc in args.concurrency:
            n = conc * args.requests_per_slot
            reqs = [
                GenerateRequest(input_ids=[1] * 8, max_new_tokens=args.tokens, ignore_eos=True)
                for _ in range(n)
            ]
            ideal = args.requests_per_slot * (args.tokens + 1) * args.itl_ms / 1000.0
            runs: dict[str, list] = {"httpx": [], "aiohttp": []}
            for _ in range(args.repeat):
                for client in runs:
                    plan = LoadPlan(max_concurrency=conc, client=client, warmup_requests=conc)
                    runs[client].append(run_load(backend, reqs, plan))
            tput = {}
            for client, results in runs.items():

                def med(f: Callable[[BenchMetrics], float], rs: list = results) -> float:
                    return statistics.median(f(r) for r in rs)

                dur = med(lambda r: r.duration_s)
                tput[client] = med(lambda r: r.output_throughput)
                print(
                    f"{conc:>5} {client:>8} {ideal:>8.3f} {dur:>8.3f} {dur / ideal:>8.2f} "
                    f"{tput[client]:>10.0f} {med(lambda r: r.itl_ms.mean):>9.2f} "
                    f"{med(lambda r: r.itl_ms.p99):>8.2f} {sum(r.failed for r in results):>5}"
                )
            summary.append((conc, tput["aiohttp"] / tput["httpx"]))
    finally:
        backend.close()
        server.terminate()
    for conc, ratio in summary:
        print(f"concurrency {conc}: aiohttp/httpx output throughput ratio {ratio:.2f}x")


if __name__ == "__main__":
    main()
