"""How each SGLang release answers, so the reference server can answer as it does
(`kdctl reference serve --sglang-version V`) and kdctl's client is tested against every shape.

Taken from SGLang's source, release by release (docs/sglang-compatibility.md cites the files),
not captured from a live SGLang, which needs its CUDA kernels. tests/fixtures/sglang/generate/
holds one recorded answer of each shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

IdsInStream = Literal["none", "new", "all"]


@dataclass(frozen=True)
class Shape:
    version: str
    # `output_ids` on /generate: absent (0.4.x), only this event's new ids in a stream (0.5.1 to
    # 0.5.5), or all of them so far (0.5.6 on); a whole answer has all of them unless absent.
    output_ids: IdsInStream
    # Streamed `text`: all of it so far (every default), or only what is new (0.5.10 on, with
    # --incremental-streaming-output).
    incremental_text: bool
    # /model_info and /server_info beside /get_model_info and /get_server_info (0.5.6 on).
    info_routes: bool
    # A /generate body that is not the request schema: FastAPI's 422 {"detail": [...]} (0.4.3
    # to 0.4.6), the flat OpenAI error object (0.4.10 to 0.5.10), {"error": "<text>"} (0.5.23).
    schema_error: Literal["detail", "flat", "text"]
    # /health: a plain 200 (0.4.3 to 0.4.6), or only when a generation can run (0.4.10 on).
    health_generates: bool
    # meta_info.spec_accept_length and spec_accept_rate on every answer, 0 without
    # verification (0.5.4 to 0.5.10); later only when a verification ran.
    spec_always: bool = False
    # An error event in a stream carries type, code and retryable beside its message (0.5.23).
    rich_stream_error: bool = False
    # meta_info.completion_tokens_wo_jump_forward, from the constrained decoding of 0.4.x.
    wo_jump_forward: bool = False


SHAPES: dict[str, Shape] = {
    s.version: s
    for s in (
        Shape(
            "0.4.3", "none", False, False, "detail", health_generates=False, wo_jump_forward=True
        ),
        Shape("0.4.10", "none", False, False, "flat", health_generates=True),
        Shape("0.5.1", "new", False, False, "flat", health_generates=True),
        Shape("0.5.6", "all", False, True, "flat", health_generates=True, spec_always=True),
        Shape("0.5.23", "all", False, True, "text", health_generates=True, rich_stream_error=True),
        Shape(
            "0.5.23-incremental",
            "new",
            True,
            True,
            "text",
            health_generates=True,
            rich_stream_error=True,
        ),
    )
}
# What the reference server answers like unless told otherwise.
DEFAULT_VERSION = "0.5.6"
