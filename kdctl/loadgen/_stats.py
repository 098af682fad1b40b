"""The metrics record of a load run, with the names `vllm bench serve` and SGLang's
bench_serving use: TTFT, ITL, TPOT, E2EL, throughput and goodput."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict


@dataclass
class RequestRecord:
    """One timed request, as the client saw it (times in seconds, time.perf_counter())."""

    started_at: float
    ok: bool = False
    error: str | None = None
    prompt_tokens: int = 0
    # What the figures count: the token ids the stream delivered, where it carries ids; the
    # server's own count only where it carries text alone (SGLang's OpenAI routes).
    output_tokens: int = 0
    # The ids streamed (None: the stream carries none), and the server's own count (usage /
    # meta_info; None: it gave none). An engine that counts more than it sends (draft tokens
    # counted as output) would otherwise be measured faster than it is.
    streamed_tokens: int | None = 0
    server_tokens: int | None = None
    ttft_s: float | None = None
    e2el_s: float | None = None
    # Gaps between successive token-bearing chunks, pooled over requests as vLLM does.
    itl_s: list[float] = field(default_factory=list)
    # The engine's speculative verification steps, where it reports them.
    spec_verify_ct: int | None = None

    @property
    def tpot_s(self) -> float | None:
        """(E2EL - TTFT) / (output tokens - 1), defined only beyond one output token."""
        if self.ttft_s is None or self.e2el_s is None or self.output_tokens <= 1:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)


class Stats(BaseModel):
    """mean, p50, p90, p99 of one latency metric, in milliseconds."""

    model_config = ConfigDict(extra="forbid")

    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None

    @classmethod
    def of(cls, seconds: Sequence[float]) -> Stats:
        if not seconds:
            return cls()
        ms = sorted(s * 1000.0 for s in seconds)
        return cls(
            mean=round(sum(ms) / len(ms), 3),
            p50=round(percentile(ms, 50), 3),
            p90=round(percentile(ms, 90), 3),
            p99=round(percentile(ms, 99), 3),
        )


def percentile(ordered: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks, as numpy.percentile does by default."""
    if not ordered:
        raise ValueError("no values")
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """The q-quantile (0..1) of a Prometheus histogram from its cumulative bucket counts
    ({upper bound `le`: count}), as PromQL's histogram_quantile estimates it: linear within
    the bucket the rank falls in, the lowest bucket starting at 0, and the last finite bound
    where the rank falls in +Inf. None with no observations."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    total = buckets[bounds[-1]]
    rank = q * total
    lower, below = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lower
            if count == below:
                return le
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower


def past_last_bucket(q: float, buckets: dict[float, float]) -> bool:
    """Whether the q-quantile's rank falls in the +Inf bucket, where histogram_quantile can
    only answer the last finite bound, a floor."""
    finite = [le for le in buckets if not math.isinf(le)]
    total = max(buckets.values(), default=0.0)
    if not finite or total <= 0:
        return False
    return buckets[max(finite)] < q * total


def resolution(buckets: dict[float, float]) -> float | None:
    """The first finite bucket's upper bound: below it, a histogram cannot tell values apart."""
    finite = [le for le in buckets if le > 0 and not math.isinf(le)]
    return min(finite) if finite else None


class SLO(BaseModel):
    """Per-request service levels: a request is good only if it meets every one given."""

    model_config = ConfigDict(extra="forbid")

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def met_by(self, r: RequestRecord) -> bool:
        checks = (
            (self.ttft_ms, r.ttft_s),
            # A request with one output token has TPOT 0 for goodput, as in vLLM.
            (self.tpot_ms, r.tpot_s if r.tpot_s is not None else 0.0),
            (self.e2el_ms, r.e2el_s),
        )
        return all(
            limit is None or (value is not None and value * 1000.0 <= limit)
            for limit, value in checks
        )


class BenchMetrics(BaseModel):
    """One load run at one concurrency (or request rate), warm-up excluded."""

    model_config = ConfigDict(extra="forbid")

    max_concurrency: int
    request_rate: float | None = None
    burstiness: float = 1.0
    client: str
    requests: int
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    request_goodput: float | None = None
    ttft_ms: Stats
    tpot_ms: Stats
    itl_ms: Stats
    e2el_ms: Stats
    # A speculative decoder's mean accepted tokens per verification step (output tokens over
    # verification steps, over the requests that report them), as SGLang's bench_serving
    # reports accept length; None for an engine that reports no verification steps.
    spec_accept_length: float | None = None
    # Where the accept length was read: "requests" (each answer's verification count, as
    # SGLang gives it) or "engine counters" (the engine's own totals over the run, as vLLM
    # exports them). None where the engine said nothing of drafting.
    spec_accept_from: Literal["requests", "engine counters"] | None = None
    # Why an engine that drafts has no accept length for the run (its counters also grew by
    # traffic the load did not send).
    spec_accept_note: str | None = None
    # Requests whose streamed token count disagreed with the server's own count (the figures
    # count the streamed ones).
    token_count_mismatches: int = 0
    # Requests that stopped before the asked output length although `ignore_eos` was set.
    short_outputs: int = 0
    errors: list[str] = []
    # How the requests reached the engine: "direct", or "ssh:HOST" through a channel of
    # HOST's SSH connection (kdctl/_httpclient.py); None in runs recorded before it was said.
    http_path: str | None = None

    @classmethod
    def of(
        cls,
        records: Sequence[RequestRecord],
        duration_s: float,
        *,
        max_concurrency: int,
        request_rate: float | None,
        burstiness: float,
        client: str,
        output_len: int | None,
        slo: SLO | None,
        http_path: str | None = None,
    ) -> BenchMetrics:
        done = [r for r in records if r.ok]
        failed = [r for r in records if not r.ok]
        dur = max(duration_s, 1e-9)
        out_tokens = sum(r.output_tokens for r in done)
        in_tokens = sum(r.prompt_tokens for r in done)
        wanted_slo = slo is not None and any(
            v is not None for v in (slo.ttft_ms, slo.tpot_ms, slo.e2el_ms)
        )
        good = sum(1 for r in done if slo is not None and slo.met_by(r)) if wanted_slo else None
        distinct_errors = sorted({r.error or "failed" for r in failed})
        return cls(
            max_concurrency=max_concurrency,
            request_rate=request_rate,
            burstiness=burstiness,
            client=client,
            requests=len(records),
            completed=len(done),
            failed=len(failed),
            duration_s=round(duration_s, 4),
            total_input_tokens=in_tokens,
            total_output_tokens=out_tokens,
            request_throughput=round(len(done) / dur, 4),
            output_throughput=round(out_tokens / dur, 3),
            total_token_throughput=round((in_tokens + out_tokens) / dur, 3),
            request_goodput=None if good is None else round(good / dur, 4),
            ttft_ms=Stats.of([r.ttft_s for r in done if r.ttft_s is not None]),
            tpot_ms=Stats.of([t for r in done if (t := r.tpot_s) is not None]),
            itl_ms=Stats.of([g for r in done for g in r.itl_s]),
            e2el_ms=Stats.of([r.e2el_s for r in done if r.e2el_s is not None]),
            spec_accept_length=_accept_length(done),
            spec_accept_from="requests" if any(r.spec_verify_ct for r in done) else None,
            token_count_mismatches=sum(
                1
                for r in done
                if r.streamed_tokens is not None
                and r.server_tokens is not None
                and r.streamed_tokens != r.server_tokens
            ),
            short_outputs=sum(
                1 for r in done if output_len is not None and r.output_tokens < output_len
            ),
            errors=distinct_errors[:10],
            http_path=http_path,
        )


def _accept_length(done: Sequence[RequestRecord]) -> float | None:
    spec = [r for r in done if r.spec_verify_ct]
    steps = sum(r.spec_verify_ct or 0 for r in spec)
    return round(sum(r.output_tokens for r in spec) / steps, 3) if steps else None
