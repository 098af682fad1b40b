"""The load generator: requests sent at fixed concurrency or on Poisson (gamma) arrivals, each
one streamed and timed on arrival of every chunk."""

from __future__ import annotations

import asyncio
import gc
import itertools
import random
import time
from collections.abc import Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass

from kdctl._httpclient import http_path, tunnel_failure, tunnel_socket
from kdctl.backends import DONE, GenerateRequest, HttpBackend, sse_data
from kdctl.backends.errors import BackendError
from kdctl.backends.health import bearer
from kdctl.loadgen._clients import RequestFailed, StreamClient, client_class
from kdctl.loadgen._stats import SLO, BenchMetrics, RequestRecord

# The longest the tunnel's socket waits for a channel of the SSH connection to open.
_CHANNEL_OPEN_S = 30.0

# (requests finished, requests in the run): called on the event loop after each one.
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class LoadPlan:
    max_concurrency: int
    # Requests a second; None sends every request at once and lets the concurrency cap pace them.
    request_rate: float | None = None
    # The gamma shape of arrival gaps: 1 is Poisson, below 1 burstier, above 1 more regular.
    burstiness: float = 1.0
    warmup_requests: int = 0
    seed: int = 0
    client: str = "aiohttp"
    timeout_s: float = 600.0  # the longest one request may take
    slo: SLO | None = None
    # With ignore_eos every request should produce this many tokens; fewer is reported.
    output_len: int | None = None


def arrival_offsets(n: int, rate: float | None, burstiness: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent.

    Gaps are gamma(shape=burstiness, scale=1/(rate*burstiness)) and then rescaled so that the
    whole schedule lasts n/rate, as `vllm bench serve` does, which keeps runs of different seeds
    comparable.
    """
    if rate is None or n == 0:
        return [0.0] * n
    rng = random.Random(seed)  # noqa: S311 - arrival times, not a secret
    gaps = [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(n)]
    cumulative = list(itertools.accumulate(gaps))
    scale = (n / rate) / cumulative[-1]
    return [c * scale for c in cumulative]


async def _one(
    backend: HttpBackend, client: StreamClient, req: GenerateRequest, rec: RequestRecord
) -> None:
    call = backend.stream_call(req)
    url = backend.http.url(call.path)
    # Bound once: the loop below runs for every token of every stream, and at a few hundred
    # streams its lookups are part of what decides whether kdctl or the server is the limit.
    name, decode, gap, now = backend.name, call.decode, rec.itl_s.append, time.perf_counter
    rec.started_at = start = time.perf_counter()
    last = start
    streamed = 0
    server_out: int | None = None
    server_in: int | None = None
    finish = None
    ended = False
    try:
        async with aclosing(client.lines(url, call.body)) as batches:
            async for lines in batches:
                for line in lines:
                    data = sse_data(name, url, line)
                    if data is None:
                        continue
                    if data is DONE:
                        ended = True
                        break
                    # Stamped once parsed, event by event, as `vllm bench serve` stamps them:
                    # events that came in one read are apart by the time it took to parse them.
                    at = now()
                    chunk = decode(at, data)
                    if chunk is None:
                        continue
                    if chunk.output_ids or chunk.text:
                        # Tokens this event brought: its ids, else what the server's count
                        # moved by (an engine that streams text only), else one.
                        n = len(chunk.output_ids) or (
                            chunk.completion_tokens - (server_out or 0)
                            if chunk.completion_tokens is not None
                            else 0
                        )
                        n = max(n, 1)
                        if rec.ttft_s is None:
                            rec.ttft_s = at - start
                        elif n == 1:
                            gap(at - last)
                        else:
                            # Several tokens in one event (speculative decoding accepting a
                            # draft, stream_interval > 1): the gap is spread over them, as
                            # SGLang's bench_serving does, not counted as one long token.
                            spread = (at - last) / n
                            for _ in range(n):
                                gap(spread)
                        last = at
                        streamed += len(chunk.output_ids)
                    if chunk.completion_tokens is not None:
                        server_out = chunk.completion_tokens
                    if chunk.prompt_tokens is not None:
                        server_in = chunk.prompt_tokens
                    if chunk.spec_verify_ct is not None:
                        rec.spec_verify_ct = chunk.spec_verify_ct
                    finish = chunk.finish_reason or finish
                if ended:
                    break
        if not ended:
            raise RequestFailed("the stream ended without [DONE]")
        if finish == "abort":
            raise RequestFailed("the server aborted the request")
        rec.e2el_s = time.perf_counter() - start
        # A stream of text alone (SGLang's OpenAI routes carry no ids) has nothing to count
        # the server's figure against: not checked, rather than a mismatch.
        rec.streamed_tokens = streamed if streamed or server_out is None else None
        rec.server_tokens = server_out
        rec.output_tokens = streamed if rec.streamed_tokens is not None else (server_out or 0)
        rec.prompt_tokens = server_in if server_in is not None else len(req.input_ids or [])
        rec.ok = True
    except (RequestFailed, BackendError) as exc:
        rec.error = str(exc)
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
        rec.error = f"malformed stream event: {exc}"


async def _run(
    backend: HttpBackend,
    requests: Sequence[GenerateRequest],
    plan: LoadPlan,
    on_progress: Progress | None,
) -> tuple[list[RequestRecord], float, str]:
    cls = client_class(plan.client)
    # Through SSH where the engine's host says so: a client that takes no network backend
    # (aiohttp) connects to the tunnel's local socket instead. Deciding may dial: off the loop.
    via = await asyncio.to_thread(
        tunnel_socket, backend.http.base_url, min(plan.timeout_s, _CHANNEL_OPEN_S)
    )
    client = cls(
        bearer(backend.api_key),
        connections=plan.max_concurrency,
        timeout=plan.timeout_s,
        unix_socket=via,
    )
    gate = asyncio.Semaphore(plan.max_concurrency)
    froze = False

    async def limited(req: GenerateRequest, rec: RequestRecord) -> None:
        async with gate:
            await _one(backend, client, req, rec)

    try:
        if plan.warmup_requests and requests:
            warm = [RequestRecord(started_at=0.0) for _ in range(plan.warmup_requests)]
            await asyncio.gather(*(limited(requests[0], r) for r in warm))
        records = [RequestRecord(started_at=0.0) for _ in requests]
        offsets = arrival_offsets(len(requests), plan.request_rate, plan.burstiness, plan.seed)
        done = 0

        def finished(_: object) -> None:
            nonlocal done
            done += 1
            if on_progress:
                on_progress(done, len(requests))

        # What exists now (the requests, their records, the imported modules) lives through
        # the run: kept out of the collector's full passes, which otherwise rescan all of it
        # while streams wait, as `vllm bench serve` does with its heap. Not where the caller
        # froze a heap of its own: unfreezing afterwards would undo theirs.
        if gc.get_freeze_count() == 0:
            gc.collect()
            gc.freeze()
            froze = True
        t0 = time.perf_counter()
        tasks = []
        for req, rec, offset in zip(requests, records, offsets, strict=True):
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(limited(req, rec))
            task.add_done_callback(finished)
            tasks.append(task)
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    finally:
        if froze:
            gc.unfreeze()
        await client.aclose()
    return records, duration, cls.name


def run_load(
    backend: HttpBackend,
    requests: Sequence[GenerateRequest],
    plan: LoadPlan,
    *,
    on_progress: Progress | None = None,
) -> BenchMetrics:
    """Send `requests` through the backend's own streaming protocol and measure them."""
    records, duration, client = asyncio.run(_run(backend, requests, plan, on_progress))
    why = tunnel_failure(backend.http.base_url)
    if why is not None:
        # A request the tunnel could not carry saw its connection close unanswered.
        for rec in records:
            if rec.error is not None and not rec.ok:
                rec.error = f"{rec.error} ({why})"
    return BenchMetrics.of(
        records,
        duration,
        max_concurrency=plan.max_concurrency,
        request_rate=plan.request_rate,
        burstiness=plan.burstiness,
        client=client,
        output_len=plan.output_len,
        slo=plan.slo,
        http_path=http_path(backend.http.base_url),
    )
