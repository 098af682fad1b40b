"""How each SGLang release answers, so the reference server can answer as it does
(`kdctl reference serve --sglang-version V`) and kdctl's client is tested against every shape.

Taken from SGLang's source, release by release (docs/sglang-compatibility.md cites the files),
then held against what live SGLang servers answered where that was captured
(tests/fixtures/sglang/captured/, from SGLang's executed documentation): the key sets of
/generate's answer and of /get_model_info follow those captures. tests/fixtures/sglang/generate/
holds one answer of each shape.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
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
    # A body that is not a JSON object, where the release parses it apart from its request
    # schema: FastAPI's flat error object in 0.5.23. None: as `schema_error`.
    body_error: Literal["detail", "flat", "text"] | None = None
    # An unknown `sampling_params` key refused, 400 {"error": text} (0.5.23's request schema).
    strict_sampling: bool = False
    # An error event in a stream carries type, code and retryable beside its message (0.5.23).
    rich_stream_error: bool = False
    # meta_info keys beyond the ones kdctl reads, as a live server of the release sent them.
    meta_extra: tuple[str, ...] = ()
    # ...and only on a request's last event or whole answer.
    meta_done_extra: tuple[str, ...] = ()
    # ...and with return_logprob, beside the output logprobs.
    logprob_extra: tuple[str, ...] = ()
    # GET /ready (0.5.23).
    ready_route: bool = False
    # OpenAI answers with `metadata` (weight versions) and `usage.reasoning_tokens`, model
    # cards with `parent` (0.5.23).
    openai_extra: bool = False
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


# 0.5.23 as SGLang 0.5.23 itself answered, on the CPU with --enable-metrics (which adds the
# timing stamps), in tests/test_sglang_live.py.
_MODEL_INFO_0523 = (
    "model_path",
    "served_model_name",
    "tokenizer_path",
    "is_generation",
    "preferred_sampling_params",
    "weight_version",
    "load_format",
    "reasoning_parser",
    "tool_call_parser",
    "disaggregation_mode",
    "has_image_understanding",
    "has_audio_understanding",
    "model_type",
    "architectures",
    "embedding",
)
# What 0.5.23's /get_model_info says of a generation model under `embedding` (its capture
# batch sizes shortened: only their kind is compared).
EMBEDDING_0523 = {
    "family": "none",
    "task": "none",
    "execution": "none",
    "attention": "none",
    "pooling": "model_defined",
    "normalize": False,
    "postprocessor": "none",
    "tokenizer_special_tokens": "model_default",
    "supports_dimensions": False,
    "supports_token_embeddings": False,
    "supports_multimodal": False,
    "requires_embedding_flag": False,
    "auto_enable_embedding": False,
    "bcg_eligibility": "disabled",
    "safe_disable_kv_cache": False,
    "safe_disable_radix_cache": False,
    "safe_disable_chunked_prefill": False,
    "enabled": False,
    "matryoshka_dimensions": [],
    "bcg": {
        "prefill_backend": "disabled",
        "enabled": False,
        "capture_token_budget": 4096,
        "capture_batch_sizes": [4, 8, 12, 16],
    },
    "cache": {
        "kv_cache_disabled": False,
        "radix_cache_disabled": False,
        "chunked_prefill_disabled": False,
    },
}
_META_0523 = (
    "weight_version",
    "num_retractions",
    "storage_prefetch_wait",
    "storage_staging_wait",
    "forward_entry_time",
    "prefill_finished_time",
    "queue_time",
    "reasoning_tokens",
    "cached_tokens_details",
    "dp_rank",
    "response_sent_to_client_ts",
)
_META_DONE_0523 = (
    "weight_versions",
    "request_received_ts",
    "first_token_latency",
    "api_server_dispatch_finish_ts",
    "request_finished_ts",
    "decode_throughput",
)
_0523 = Shape(
    "0.5.23",
    "all",
    False,
    True,
    "text",
    health_generates=True,
    body_error="flat",
    strict_sampling=True,
    rich_stream_error=True,
    meta_extra=_META_0523,
    meta_done_extra=_META_DONE_0523,
    logprob_extra=("input_token_logprobs", "input_top_logprobs", "output_token_logprobs_length"),
    ready_route=True,
    openai_extra=True,
    model_info=_MODEL_INFO_0523,
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
        _0523,
        replace(_0523, version="0.5.23-incremental", output_ids="new", incremental_text=True),
    )
}
# What the reference server answers like unless told otherwise.
DEFAULT_VERSION = "0.5.6"
