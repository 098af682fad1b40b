"""The Backend interface and the registry of kinds."""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import httpx
from pydantic import SecretStr

from kdctl.backends._types import (
    EngineCounters,
    EngineInfo,
    EngineLoad,
    GenerateRequest,
    GenerateResult,
    SpecCounters,
    StreamChunk,
)
from kdctl.backends.errors import BackendProtocolError
from kdctl.backends.health import HealthResult
from kdctl.errors import InputError
from kdctl.inventory import BackendSpec
from kdctl.transports import Transport

if TYPE_CHECKING:
    from kdctl.backends.lifecycle import ServiceControl

# vLLM's speculative decoding counters (families as the Prometheus parser names them, without
# `_total`): vllm/v1/spec_decode/metrics.py registers the first two only when it drafts; the
# third is every generated token (vllm/v1/metrics/loggers.py).
_SPEC_COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_accepted_tokens",
    "vllm:generation_tokens",
)


class Backend(abc.ABC):
    """One engine, whatever its kind: health, identity, generation, metrics."""

    kind: ClassVar[str]
    # The metric families (as the Prometheus parser names them) of the engine's count of
    # requests served and of its TTFT histogram, where its kind exports them.
    requests_counter: ClassVar[str | None] = None
    ttft_histogram: ClassVar[str | None] = None
    # The gauges of requests running and waiting (SGLang's num_running_reqs, vLLM's
    # num_requests_running): what a drain waits on and what headroom is judged by.
    running_gauge: ClassVar[str | None] = None
    queued_gauge: ClassVar[str | None] = None
    # The fraction of its KV cache in use; the first of these the engine exports.
    token_usage_gauges: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        name: str,
        spec: BackendSpec,
        *,
        api_key: SecretStr | None = None,
        timeout: float | None = None,
        client: httpx.Client | None = None,
    ) -> None:
        self.name = name
        self.spec = spec
        self.api_key = api_key
        # A probe passes its own, shorter deadline; gates and cutovers keep the engine's.
        self.timeout = spec.request_timeout_s if timeout is None else timeout

    @property
    def where(self) -> str:
        return self.spec.url or self.name

    @abc.abstractmethod
    def health(self) -> HealthResult: ...

    @abc.abstractmethod
    def info(self) -> EngineInfo: ...

    @abc.abstractmethod
    def generate(self, req: GenerateRequest) -> GenerateResult: ...

    def generate_batch(
        self, reqs: Sequence[GenerateRequest], *, concurrency: int = 4
    ) -> list[GenerateResult]:
        """Many generations, results in request order. Served engines take them as
        concurrent requests; an engine run per batch (native command mode) takes them at once."""
        with ThreadPoolExecutor(max(1, concurrency)) as pool:
            return list(pool.map(self.generate, reqs))

    def stream(self, req: GenerateRequest) -> Iterator[StreamChunk]:
        """Stream a generation; engines without streaming yield the whole result as one chunk."""
        import time

        result = self.generate(req)
        yield StreamChunk(
            received_at=time.perf_counter(),
            output_ids=result.output_ids,
            text=result.text,
            finish_reason=result.finish_reason,
            prompt_tokens=result.prompt_tokens,
            completion_tokens=result.completion_tokens,
        )

    def metrics(self) -> dict[str, Any]:
        """Prometheus metric families by name; empty where the engine exports none."""
        return {}

    def counters(self) -> EngineCounters | None:
        """The engine's request counter and TTFT histogram buckets, summed over labels, from
        its metrics; None where it exports neither."""
        if self.requests_counter is None and self.ttft_histogram is None:
            return None
        requests: float | None = None
        buckets: dict[float, float] = {}
        for family in self.metrics().values():
            for sample in family.samples:
                if sample.name == f"{self.requests_counter}_total":
                    requests = (requests or 0.0) + float(sample.value)
                elif sample.name == f"{self.ttft_histogram}_bucket" and "le" in sample.labels:
                    le = float(sample.labels["le"])
                    buckets[le] = buckets.get(le, 0.0) + float(sample.value)
        if requests is None and not buckets:
            return None
        return EngineCounters(requests=requests, ttft_buckets=buckets)

    def load(self) -> EngineLoad | None:
        """Requests running and queued now, summed over labels, from the engine's metrics;
        None where it exports no running gauge."""
        if self.running_gauge is None:
            return None
        families = self.metrics()

        def gauge(name: str | None) -> float | None:
            family = families.get(name or "")
            if family is None:
                return None
            return float(sum(s.value for s in family.samples if s.name == name))

        running = gauge(self.running_gauge)
        if running is None:
            return None
        usage = next(
            (u for u in map(gauge, self.token_usage_gauges) if u is not None),
            None,
        )
        return EngineLoad(running=running, queued=gauge(self.queued_gauge), token_usage=usage)

    def spec_counters(self) -> SpecCounters | None:
        """The engine's running totals of speculative decoding, where its metrics export them
        (vLLM does, only when it drafts); None for an engine that exports none."""
        families = self.metrics()
        totals = []
        for name in _SPEC_COUNTERS:
            family = families.get(name)
            if family is None:
                return None
            totals.append(sum(s.value for s in family.samples if s.name == f"{name}_total"))
        return SpecCounters(drafts=totals[0], accepted=totals[1], generated=totals[2])

    def lifecycle(self, transport: Transport) -> ServiceControl:
        """Start, stop, restart and wait for this engine through its service on `transport`."""
        from kdctl.backends.lifecycle import ServiceControl

        return ServiceControl(self.name, self.spec, transport, self.health, self.api_key)

    def close(self) -> None:  # noqa: B027 - most backends hold nothing open
        pass

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class StreamCall:
    """A streamed generation on the wire: the route, the body, and how to read each event.

    Kept apart from any HTTP client so that the load generator's asynchronous clients speak
    each engine's protocol through the same code as the backend itself.
    """

    path: str
    body: dict[str, Any]
    # One parsed event and its arrival time in, a chunk (or None for a bookkeeping event) out.
    decode: Callable[[float, Any], StreamChunk | None]


class HttpBackend(Backend):
    """A served engine: one HTTP session to its URL, health from `/health`, metrics."""

    def __init__(
        self,
        name: str,
        spec: BackendSpec,
        *,
        api_key: SecretStr | None = None,
        timeout: float | None = None,
        client: httpx.Client | None = None,
    ) -> None:
        super().__init__(name, spec, api_key=api_key, timeout=timeout)
        if not spec.url:
            raise InputError(f"backend {name} has no url")
        from kdctl.backends._http import HttpSession

        self.http = HttpSession(
            name, spec.url, api_key=api_key, timeout=self.timeout, client=client
        )

    def close(self) -> None:
        self.http.close()

    @abc.abstractmethod
    def stream_call(self, req: GenerateRequest) -> StreamCall: ...

    def stream(self, req: GenerateRequest) -> Iterator[StreamChunk]:
        call = self.stream_call(req)
        try:
            for at, data in self.http.events(call.path, call.body):
                chunk = call.decode(at, data)
                if chunk is not None:
                    yield chunk
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise BackendProtocolError(
                self.name, self.http.url(call.path), f"malformed stream event: {exc}"
            ) from None

    def health(self) -> HealthResult:
        return self.http.health()

    def metrics(self) -> dict[str, Any]:
        return self.http.metrics()
