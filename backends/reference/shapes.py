"""How each SGLang release answers, so the reference server can answer as it does
(`kdctl reference serve --sglang-version V`) and kdctl's client is tested against every shape.

Taken from SGLang's source, release by release (docs/sglang-compatibility.md cites the files),
then held against what live SGLang servers answered where that was captured
(tests/fixtures/sglang/captured/, from SGLang's executed documentation): the key sets of
/generate's answer and of /get_model_info follow those captures. tests/fixtures/sglang/generate/
holds one answer of each shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

IdsInStream = Literal["none", "new", "all"]


@dataclass(frozen=True)
class Shape:
    version: str
    # `output_ids` on /generate: absent (0.4.3), only this event's new ids in a stream (0.4.10
    # to 0.5.5), or all of them so far (0.5.6 on); a whole answer has all of them unless absent.
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
    # An error event in a stream carries type, code and retryable beside its message (0.5.23).
    rich_stream_error: bool = False
    # meta_info keys beyond the ones kdctl reads, as a live server of the release sent them.
    meta_extra: tuple[str, ...] = ()
    # /get_model_info's keys, in the order the release sends them.
    model_info: tuple[str, ...] = ("model_path", "tokenizer_path", "is_generation")


# /get_model_info grew by appending: 0.4.9 added preferred_sampling_params, 0.5.2
# weight_version, 0.5.6 the last four (captured from 0.4.0.post2 to main of April 2026).
_MODEL_INFO = (
    "model_path",
    "tokenizer_path",
    "is_generation",
    "preferred_sampling_params",
    "weight_version",
    "has_image_understanding",
    "has_audio_understanding",
    "model_type",
    "architectures",
)


SHAPES: dict[str, Shape] = {
    s.version: s
    for s in (
        Shape("0.4.3", "none", False, False, "detail", health_generates=False),
        # A live 0.4.10.post2 sent output_ids in its whole answer; how its stream sends them
        # was not captured, and is taken as 0.5.1's.
        Shape(
            "0.4.10",
            "new",
            False,
            False,
            "flat",
            health_generates=True,
            model_info=_MODEL_INFO[:4],
        ),
        Shape(
            "0.5.1", "new", False, False, "flat", health_generates=True, model_info=_MODEL_INFO[:4]
        ),
        Shape(
            "0.5.6",
            "all",
            False,
            True,
            "flat",
            health_generates=True,
            meta_extra=("weight_version", "total_retractions", "response_sent_to_client_ts"),
            model_info=_MODEL_INFO,
        ),
        Shape(
            "0.5.23",
            "all",
            False,
            True,
            "text",
            health_generates=True,
            rich_stream_error=True,
            model_info=_MODEL_INFO,
        ),
        Shape(
            "0.5.23-incremental",
            "new",
            True,
            True,
            "text",
            health_generates=True,
            rich_stream_error=True,
            model_info=_MODEL_INFO,
        ),
    )
}
# What the reference server answers like unless told otherwise.
DEFAULT_VERSION = "0.5.6"
