"""SGLang's HTTP API, as SGLang serves it (see shared reference: sglang-api.md)."""

from __future__ import annotations

from functools import cached_property
from typing import Any

from pydantic import ValidationError

from kdctl.backends._base import HttpBackend, StreamCall
from kdctl.backends._types import (
    EngineInfo,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    StreamChunk,
    TokenLogprob,
    count,
)
from kdctl.backends.errors import BackendError, BackendHTTPError, BackendProtocolError
from kdctl.backends.health import HealthResult
from kdctl.backends.openai import OpenAIBackend


class SGLangBackend(HttpBackend):
    kind = "sglang"
    requests_counter = "sglang:num_requests"
    ttft_histogram = "sglang:time_to_first_token_seconds"
    running_gauge = "sglang:num_running_reqs"
    queued_gauge = "sglang:num_queue_reqs"
    token_usage_gauges = ("sglang:token_usage",)
    # Whether the URL reaches one engine, whose server arguments then say how every stream
    # from it reads. A router's front may reach several (a canary's two engines, of two
    # releases): there each stream is read by its own shape, never by one engine's word.
    one_engine = True

    def health(self, *, generate: bool = False) -> HealthResult:
        """`/health`, or with `generate` `/health_generate`, which SGLang always answers by
        running a one-token generation (newer releases may skip it on plain `/health`)."""
        return self.http.health("/health_generate" if generate else "/health")

    def openai(self) -> OpenAIBackend:
        """The same server through its OpenAI routes (`/v1/completions`, `/v1/chat/...`)."""
        return OpenAIBackend(
            self.name,
            self.spec,
            api_key=self.api_key,
            timeout=self.timeout,
            client=self.http._client,
        )

    def _info(self, new: str, old: str) -> dict[str, Any]:
        # Newer SGLang serves /server_info and /model_info, older only the /get_ names.
        try:
            data = self.http.json("GET", new)
        except BackendHTTPError as exc:
            if exc.status != 404:
                raise
            data = self.http.json("GET", old)
        if not isinstance(data, dict):
            raise BackendProtocolError(self.name, self.http.url(new), "expected a JSON object")
        return data

    def info(self) -> EngineInfo:
        server = self._info("/server_info", "/get_server_info")
        model = self._info("/model_info", "/get_model_info")
        try:
            info = self._engine_info(server, model)
            if info.context_length is None:
                # Null there unless --context-length was given; /v1/models says what runs.
                info.context_length = self._served_context_length()
            return info
        except ValidationError as exc:
            raise BackendProtocolError(
                self.name, self.http.url("/server_info"), f"unexpected server info: {exc}"
            ) from None

    def _served_context_length(self) -> int | None:
        try:
            cards = self.http.json("GET", "/v1/models").get("data") or []
            value = cards[0].get("max_model_len") if cards else None
        except (BackendError, AttributeError, TypeError):
            return None
        return int(value) if isinstance(value, int) else None

    def _engine_info(self, server: dict[str, Any], model: dict[str, Any]) -> EngineInfo:
        return EngineInfo(
            model=model.get("model_path") or server.get("model_path"),
            served_name=server.get("served_model_name"),
            version=server.get("version"),
            tp_size=server.get("tp_size"),
            # Not max_req_input_len: that is the longest prompt, a smaller number.
            context_length=server.get("context_length"),
            settings=engine_settings(server),
            spec_accept_length=_accept_length(server),
        )

    def _body(self, req: GenerateRequest, stream: bool) -> dict[str, Any]:
        sp: dict[str, Any] = {
            "max_new_tokens": req.max_new_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,
            "ignore_eos": req.ignore_eos,
        }
        if req.stop:
            sp["stop"] = req.stop
        if req.stop_token_ids:
            sp["stop_token_ids"] = req.stop_token_ids
        if req.seed is not None:
            sp["sampling_seed"] = req.seed
        body: dict[str, Any] = {"sampling_params": sp, "stream": stream}
        # Only where a gate reads them: they cost SGLang a quadratic re-send in a stream.
        if req.logprobs or req.top_logprobs:
            body["return_logprob"] = True
            body["top_logprobs_num"] = req.top_logprobs
        if req.input_ids is not None:
            body["input_ids"] = req.input_ids
        else:
            body["text"] = req.text
        return body

    def _result(self, data: Any) -> GenerateResult:
        url = self.http.url("/generate")
        if not isinstance(data, dict) or "meta_info" not in data:
            raise BackendProtocolError(self.name, url, "no meta_info in the answer")
        meta = data["meta_info"]
        try:
            ids = [int(i) for i in data.get("output_ids") or []]
            tokens = meta.get("output_token_logprobs") or []
            tops = meta.get("output_top_logprobs") or [None] * len(tokens)
            logprobs = [
                TokenLogprob(
                    token_id=int(tok[1]),
                    logprob=float(tok[0]),
                    top=[(int(t[1]), float(t[0])) for t in (top or [])],
                )
                for tok, top in zip(tokens, tops, strict=False)
            ]
            finish = meta.get("finish_reason")
            reason, matched = _finish(finish)
            return GenerateResult(
                output_ids=ids or [t.token_id for t in logprobs],
                text=data.get("text") or "",
                finish_reason=reason,
                matched_stop=matched,
                prompt_tokens=int(meta.get("prompt_tokens") or 0),
                completion_tokens=int(meta.get("completion_tokens") or len(ids)),
                logprobs=logprobs,
                spec_verify_ct=count(meta.get("spec_verify_ct")),
            )
        except (TypeError, ValueError, IndexError, KeyError) as exc:
            raise BackendProtocolError(self.name, url, f"malformed answer: {exc}") from None

    def generate(self, req: GenerateRequest) -> GenerateResult:
        return self._result(self.http.json("POST", "/generate", self._body(req, stream=False)))

    def stream_call(self, req: GenerateRequest) -> StreamCall:
        reader = _CumulativeReader(incremental=self._incremental_text)
        return StreamCall("/generate", self._body(req, stream=True), reader.read)

    @cached_property
    def _incremental_text(self) -> bool | None:
        """Whether streamed text is only what is new, as the server's own arguments say
        (`incremental_streaming_output`), asked once; None where it does not say, or where
        the URL may reach another engine than the one that would answer."""
        if not self.one_engine:
            return None
        try:
            flag = self._info("/server_info", "/get_server_info").get(
                "incremental_streaming_output"
            )
        except BackendError:
            return None
        return flag if isinstance(flag, bool) else None


class _CumulativeReader:
    """SGLang's stream events, as each release sends them, to chunks of only what is new.

    Text is cumulative in every release's default; output_ids are absent (0.4.3), only the new
    ids (0.4.10 to 0.5.5, and with --incremental-streaming-output) or cumulative (0.5.6 on).
    Which one the server sends is its `incremental_streaming_output` argument, read from its
    server info. Where that is not known, incremental text comes only with incremental ids, so
    only then is the text asked whether it still extends what came before; once it does not,
    the stream is read as incremental to its end (a delta that happens to repeat all the text
    so far, as blank lines at the start can, is read as cumulative: hence the flag first)."""

    def __init__(self, incremental: bool | None = None) -> None:
        self.seen_ids = 0
        self.seen_text = ""
        self.incremental_text = bool(incremental)
        self.known = incremental is not None

    def read(self, at: float, data: Any) -> StreamChunk:
        if not isinstance(data, dict):
            raise ValueError("an event is not a JSON object")
        ids = data.get("output_ids") or []
        text = data.get("text") or ""
        meta = data.get("meta_info") or {}
        finish = meta.get("finish_reason")
        done = meta.get("completion_tokens")
        # Incremental ids fall behind the running count, which cumulative ones keep up with.
        new_only = isinstance(done, int) and self.seen_ids > 0 and done > len(ids)
        new_ids = list(ids) if new_only else list(ids[self.seen_ids :])
        if not self.known and new_only and not text.startswith(self.seen_text):
            self.incremental_text = True
        new_text = text if self.incremental_text else text[len(self.seen_text) :]
        self.seen_ids += len(new_ids)
        self.seen_text = self.seen_text + text if self.incremental_text else text
        return StreamChunk(
            received_at=at,
            output_ids=new_ids,
            text=new_text,
            finish_reason=_finish(finish)[0] if finish else None,
            prompt_tokens=count(meta.get("prompt_tokens")),
            completion_tokens=count(done),
            spec_verify_ct=count(meta.get("spec_verify_ct")) if finish else None,
        )


def _finish(finish: Any) -> tuple[FinishReason, int | str | None]:
    """SGLang's dict-shaped finish_reason: {"type": "length"|"stop"|"abort", ...}."""
    if isinstance(finish, dict):
        kind = finish.get("type")
        matched = finish.get("matched")
    else:
        kind, matched = finish, None
    if kind not in ("length", "stop", "abort"):
        kind = "abort" if kind else "length"
    return kind, matched  # type: ignore[return-value]


# What /server_info holds beside the server arguments (figures of this start, the version,
# scheduler state), and the arguments that say nothing of how the engine computes: where it
# listens, what it logs and exports, its keys, a seed drawn afresh at each start.
_NOT_SETTINGS = frozenset(
    {
        "version",
        "internal_states",
        "avg_spec_accept_length",
        "startup_time",
        "memory_usage",
        "last_gen_throughput",
        "effective_max_running_requests_per_dp",
        "decode_cuda_graph_bs",
        "decode_cuda_graph_memory_gb",
        "max_total_num_tokens",
        "max_req_input_len",
        "status",
        # The command line again (0.5.23): its port, and any key given on it.
        "launch_command",
        "host",
        "port",
        "nccl_port",
        "dist_init_addr",
        "fastapi_root_path",
        "random_seed",
        "watchdog_timeout",
        "soft_watchdog_timeout",
        "file_storage_path",
        "download_dir",
        "crash_dump_folder",
        "decode_log_interval",
        "show_time_cost",
        "enable_metrics",
        "enable_metrics_for_all_schedulers",
        "enable_request_time_stats_logging",
        "enable_trace",
        "trace_modules",
        "gc_warning_threshold_secs",
        "kv_events_config",
        "load_snapshot_publish_interval",
        "extra_metric_labels",
        "uvicorn_access_log_exclude_prefixes",
    }
)
_NOT_SETTINGS_PREFIXES = (
    "log_",
    "ssl_",
    "otlp_",
    "oltp_",  # 0.5.2's spelling
    "bucket_",
    "export_metrics",
    "tokenizer_metrics",
)


def _accept_length(server: dict[str, Any]) -> float | None:
    """SGLang's lifetime accept length, averaged over its data-parallel ranks (a top-level key
    in 0.4.3); absent until a speculative step has run."""
    states = server.get("internal_states")
    found = (
        [s.get("avg_spec_accept_length") for s in states if isinstance(s, dict)]
        if isinstance(states, list)
        else []
    )
    found.append(server.get("avg_spec_accept_length"))
    values = [float(v) for v in found if isinstance(v, int | float) and not isinstance(v, bool)]
    return sum(values) / len(values) if values else None


def engine_settings(server: dict[str, Any]) -> dict[str, Any]:
    """The server arguments SGLang reports that bear on what it computes and how fast, keys and
    passwords left out whatever they hold (several releases print them)."""
    return {
        k: v
        for k, v in sorted(server.items())
        if k not in _NOT_SETTINGS
        and not k.startswith(_NOT_SETTINGS_PREFIXES)
        and not any(secret in k for secret in ("api_key", "password", "secret", "watermark_key"))
    }
