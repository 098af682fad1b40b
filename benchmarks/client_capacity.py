"""Whether kdctl's load generator can be the bottleneck it measures: its token rate against
vLLM's own bench client (`vllm bench serve`) on a server that streams as fast as it can.

The server (its own process, so neither client is charged for it) answers OpenAI streaming
`/v1/completions` as vLLM does (a chunk per token with its text and `token_ids`, a usage chunk,
`[DONE]`) with no model and no pacing: every token is written as soon as the socket takes it,
so the rate a client reports is the rate at which it can read and time streams. Both clients
send the same workload (16 prompt tokens, TOKENS output tokens, ignore_eos, one warm-up request
per stream) and read the same bytes. kdctl runs its load generator through the `openai` backend
kind, as the throughput gate does, with aiohttp (its default) and httpx; vLLM's client runs in
vLLM's own environment with the tiny model's tokenizer. Every run is a fresh process, the
kinds alternate within each repeat so machine noise lands on all of them, and the peak RSS of
each process comes from wait4. Finally kdctl alone drives 512 concurrent streams.

Figures printed: output tokens/s, run time and peak RSS of each client (medians of the
repeats); kdctl's rate over vLLM's client's, and aiohttp's over httpx's.
Targets: kdctl/vLLM >= 1.0 at 64 and 256 streams; kdctl's peak RSS at 512 streams < 300 MB.
Run: python benchmarks/client_capacity.py [--tokens 128] [--prompts 2048] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import socket
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks._vllm import (  # noqa: E402
    VLLM_PYTHON,
    bench_serve,
    make_tiny_llama,
    require_vllm,
    run_measured,
    tail,
)

PROMPT_LEN = 16
SERVED = "fast"
RSS_LIMIT_MB = 300.0


def _chunk(event: dict[str, Any] | str) -> bytes:
    """One server-sent event in its own HTTP/1.1 chunk."""
    body = event if isinstance(event, str) else json.dumps(event, separators=(",", ":"))
    data = f"data: {body}\n\n".encode()
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _token_event(finish: str | None) -> bytes:
    return _chunk(
        {
            "id": "cmpl-fast",
            "object": "text_completion",
            "created": 0,
            "model": SERVED,
            "choices": [
                {
                    "index": 0,
                    "text": " tok",
                    "logprobs": None,
                    "finish_reason": finish,
                    "stop_reason": None,
                    "token_ids": [42],
                }
            ],
            "usage": None,
        }
    )


def _usage_event(prompt: int | None, completion: int) -> bytes:
    return _chunk(
        {
            "id": "cmpl-fast",
            "object": "text_completion",
            "created": 0,
            "model": SERVED,
            "choices": [],
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": (prompt or 0) + completion,
            },
        }
    )


def _json_response(payload: dict[str, Any]) -> bytes:
    body = json.dumps(payload).encode()
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
        + f"content-length: {len(body)}\r\n\r\n".encode()
        + body
    )


def _serve(sock: socket.socket) -> None:
    """The fast server: GET /v1/models and streaming POST /v1/completions, keep-alive."""
    token = _token_event(None)
    last = _token_event("length")
    done = _chunk("[DONE]") + b"0\r\n\r\n"
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    models = _json_response(
        {"object": "list", "data": [{"id": SERVED, "object": "model", "max_model_len": 4096}]}
    )

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                header = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in header.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length)
                if header.startswith(b"GET /v1/models "):
                    writer.write(models)
                    continue
                if not header.startswith(b"POST /v1/completions "):
                    # vLLM's client also asks for /tokenize and /metrics, which this server
                    # does not have, as a server may not: it carries on without them.
                    writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                    continue
                req = json.loads(body)
                n = int(req["max_tokens"])
                prompt = req.get("prompt")
                # Token-id prompts are counted; a text prompt is not tokenized here, so its
                # count is left to the client (None), as a server without a tokenizer would.
                prompt_tokens = len(prompt) if isinstance(prompt, list) else None
                writer.write(head)
                for _ in range(n - 1):
                    writer.write(token)
                    # Returns at once unless the client has fallen behind: then the server
                    # waits for it, so its memory stays bounded and its speed is the client's.
                    await writer.drain()
                writer.write(last + _usage_event(prompt_tokens, n) + done)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, sock=sock, backlog=2048)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def _child(url: str, concurrency: int, prompts: int, tokens: int, client: str) -> None:
    """One kdctl run in this (child) process; its metrics as one JSON line on stdout."""
    from kdctl.backends import GenerateRequest, HttpBackend, make_backend
    from kdctl.inventory import BackendSpec
    from kdctl.loadgen import LoadPlan, run_load

    spec = BackendSpec(kind="openai", host="local", url=url)
    backend = make_backend("fast", spec)
    assert isinstance(backend, HttpBackend)
    reqs = [
        GenerateRequest(
            input_ids=[10 + (i + j) % 1000 for j in range(PROMPT_LEN)],
            max_new_tokens=tokens,
            ignore_eos=True,
        )
        for i in range(prompts)
    ]
    # As the throughput gate plans it: one warm-up request per stream, excluded.
    plan = LoadPlan(
        max_concurrency=concurrency,
        warmup_requests=concurrency,
        client=client,
        output_len=tokens,
    )
    with backend:
        metrics = run_load(backend, reqs, plan)
    print(metrics.model_dump_json())


def run_kdctl(
    url: str, conc: int, prompts: int, tokens: int, client: str, work: Path
) -> dict[str, Any]:
    log = work / f"kdctl-{client}-{conc}.log"
    cmd = [
        sys.executable,
        __file__,
        "--child",
        url,
        "--child-args",
        str(conc),
        str(prompts),
        str(tokens),
        client,
    ]
    code, maxrss_kb = run_measured(cmd, log)
    if code != 0:
        raise SystemExit(f"kdctl's run failed ({code}):\n{tail(log)}")
    m: dict[str, Any] = json.loads(log.read_text().strip().splitlines()[-1])
    return {
        "tok_s": m["output_throughput"],
        "duration": m["duration_s"],
        "failed": m["failed"],
        "tokens": m["total_output_tokens"],
        "rss_mb": maxrss_kb / 1024,
    }


def run_vllm(
    url: str, conc: int, prompts: int, tokens: int, tokenizer: Path, work: Path, n: int
) -> dict[str, Any]:
    r = bench_serve(
        url,
        [
            "--backend",
            "openai",
            "--model",
            str(tokenizer),
            "--served-model-name",
            SERVED,
            "--tokenizer",
            str(tokenizer),
            "--dataset-name",
            "random",
            "--random-input-len",
            str(PROMPT_LEN),
            "--random-output-len",
            str(tokens),
            "--num-prompts",
            str(prompts),
            "--max-concurrency",
            str(conc),
            "--num-warmups",
            str(conc),
            "--ignore-eos",
        ],
        work / "vllm",
        f"vllm-{conc}-{n}",
    )
    return {
        "tok_s": r["output_throughput"],
        "duration": r["duration"],
        "failed": r["failed"],
        "tokens": r["total_output_tokens"],
        "rss_mb": r["_rusage_maxrss_kb"] / 1024,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    ap.add_argument("--prompts", type=int, default=2048, help="requests per run")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--rss-streams", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-args", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        conc, prompts, tokens, client = args.child_args
        _child(args.child, int(conc), int(prompts), int(tokens), client)
        return
    require_vllm()

    work = Path(tempfile.mkdtemp(prefix="kdctl-capacity-"))
    # vLLM's client builds its random prompts with a tokenizer: the tiny model's, untrained.
    tokenizer = make_tiny_llama(work / "tiny-llama", train_steps=0)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(2048)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = multiprocessing.Process(target=_serve, args=(sock,), daemon=True)
    server.start()
    print(
        f"fast OpenAI stream server: {args.tokens} tokens a request, {args.prompts} requests "
        f"a run; {args.repeat} alternating repeats, medians; vLLM client: {VLLM_PYTHON}"
    )
    print(
        f"{'streams':>7} {'client':>16} {'out tok/s':>10} {'run s':>7} {'failed':>6} "
        f"{'peak RSS MB':>11}"
    )
    kinds = ["kdctl aiohttp", "kdctl httpx", "vllm bench"]
    summary = []
    try:
        for conc in args.concurrency:
            runs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
            for n in range(args.repeat):
                # Each repeat starts with another client, so none always runs after the same.
                for kind in kinds[n % 3 :] + kinds[: n % 3]:
                    if kind == "vllm bench":
                        r = run_vllm(url, conc, args.prompts, args.tokens, tokenizer, work, n)
                    else:
                        client = kind.split()[1]
                        r = run_kdctl(url, conc, args.prompts, args.tokens, client, work)
                    if r["tokens"] != args.prompts * args.tokens:
                        raise SystemExit(f"{kind} at {conc}: {r['tokens']} tokens counted")
                    runs[kind].append(r)
            rate = {}
            for kind, rs in runs.items():
                rate[kind] = statistics.median(r["tok_s"] for r in rs)
                print(
                    f"{conc:>7} {kind:>16} {rate[kind]:>10.0f} "
                    f"{statistics.median(r['duration'] for r in rs):>7.2f} "
                    f"{sum(r['failed'] for r in rs):>6} "
                    f"{statistics.median(r['rss_mb'] for r in rs):>11.1f}"
                )
            summary.append(
                (
                    conc,
                    rate["kdctl aiohttp"] / rate["vllm bench"],
                    rate["kdctl aiohttp"] / rate["kdctl httpx"],
                )
            )
        big = run_kdctl(url, args.rss_streams, args.rss_streams * 4, args.tokens, "aiohttp", work)
        print(
            f"{args.rss_streams:>7} {'kdctl aiohttp':>16} {big['tok_s']:>10.0f} "
            f"{big['duration']:>7.2f} {big['failed']:>6} {big['rss_mb']:>11.1f}"
        )
    finally:
        server.terminate()
        server.join()
    for conc, vs_vllm, vs_httpx in summary:
        verdict = "meets" if vs_vllm >= 1.0 else "misses"
        print(
            f"{conc} streams: kdctl/vLLM token rate {vs_vllm:.2f}x ({verdict} >= 1.0); "
            f"aiohttp/httpx {vs_httpx:.2f}x"
        )
    print("(vllm bench's RSS is mostly vLLM and torch, imported before it sends anything)")
    verdict = "meets" if big["rss_mb"] < RSS_LIMIT_MB else "misses"
    print(
        f"{args.rss_streams} streams: kdctl peak RSS {big['rss_mb']:.1f} MB "
        f"({verdict} < {RSS_LIMIT_MB:.0f} MB), {big['failed']} failed"
    )


if __name__ == "__main__":
    main()
