"""Backends: one interface over every inference engine kdctl manages.

Kinds: `sglang`, `openai`, `native` and `reference`. Other distributions
add kinds through the `kdctl.backends` entry-point group.
"""

from kdctl.backends._base import Backend, HttpBackend, StreamCall
from kdctl.backends._http import DONE, sse_data
from kdctl.backends._registry import backend_class, make_backend
from kdctl.backends._types import (
    EngineCounters,
    EngineInfo,
    EngineLoad,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    SpecCounters,
    StreamChunk,
    TokenLogprob,
)
from kdctl.backends.health import (
    HEALTH_TIMEOUT_S,
    HealthResult,
    bearer,
    probe_health,
    wait_http,
)
from kdctl.backends.openai import vllm_argv

__all__ = [
    "DONE",
    "HEALTH_TIMEOUT_S",
    "Backend",
    "EngineCounters",
    "EngineInfo",
    "EngineLoad",
    "FinishReason",
    "GenerateRequest",
    "GenerateResult",
    "HealthResult",
    "HttpBackend",
    "SpecCounters",
    "StreamCall",
    "StreamChunk",
    "TokenLogprob",
    "backend_class",
    "bearer",
    "make_backend",
    "probe_health",
    "sse_data",
    "vllm_argv",
    "wait_http",
]
