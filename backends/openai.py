"""Any OpenAI-compatible server (vLLM, TensorRT-LLM, SGLang's /v1 routes)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from kdctl.backends._base import HttpBackend, StreamCall
from kdctl.backends._types import (
    EngineInfo,
    GenerateRequest,
    GenerateResult,
    StreamChunk,
    TokenLogprob,
    count,
)
from kdctl.backends.errors import BackendAuthError, BackendError, BackendProtocolError


class ChatResult(BaseModel):
    content: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    first_token_at: float | None = None


_TOKEN_ID = re.compile(r"^token_id:(\d+)$")

# vLLM's `vllm:cache_config_info` labels that are figures of one start (the blocks its memory
# allowed), not how it was started: two starts of one configuration differ in them.
_PER_START = frozenset(
    {
        "engine",
        "num_gpu_blocks",
        "num_cpu_blocks",
        "kv_cache_size_tokens",
        "kv_cache_max_concurrency",
    }
)


class OpenAIBackend(HttpBackend):
    kind = "openai"
    # vLLM's names (vllm/v1/metrics/loggers.py); another OpenAI-compatible engine may export
    # neither, and its counters are then not read.
    requests_counter = "vllm:request_success"
    ttft_histogram = "vllm:time_to_first_token_seconds"
    running_gauge = "vllm:num_requests_running"
    queued_gauge = "vllm:num_requests_waiting"
    # Renamed in vLLM's V1 engine; the older name where it is the one exported.
    token_usage_gauges = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    _model: str | None = None

    def _card(self) -> dict[str, Any]:
        data = self.http.json("GET", "/v1/models")
        cards = data.get("data") if isinstance(data, dict) else None
        if not cards or not isinstance(cards[0], dict) or "id" not in cards[0]:
            raise BackendProtocolError(self.name, self.http.url("/v1/models"), "no model listed")
        card: dict[str, Any] = cards[0]
        return card

    @property
    def model(self) -> str:
        """The name requests must carry: the inventory's, else the server's first card."""
        if self._model is None:
            self._model = self.spec.served_model_name or str(self._card()["id"])
        return self._model

    def info(self) -> EngineInfo:
        card = self._card()
        version = None
        try:
            answer = self.http.json("GET", "/version")  # vLLM's; others may not have it
            version = answer.get("version") if isinstance(answer, dict) else None
        except BackendError:
            pass  # optional: SGLang has no /version and may want a key for it
        try:
            return EngineInfo(
                model=card.get("root") or card.get("id"),
                served_name=card.get("id"),
                version=version if isinstance(version, str) else None,
                # The OpenAI API does not say how the model is split: unknown, not the
                # inventory's figure.
                tp_size=None,
                context_length=card.get("max_model_len"),
                settings=self._cache_settings(),
            )
        except ValidationError as exc:
            raise BackendProtocolError(
                self.name, self.http.url("/v1/models"), f"unexpected model card: {exc}"
            ) from None

    def _cache_settings(self) -> dict[str, Any] | None:
        """vLLM's cache configuration, the part of how it was started that its API reports
        (the labels of its `vllm:cache_config_info` gauge: block size, KV cache dtype, prefix
        caching, memory fraction, ...); None for an engine that exports none or keeps its metrics
        behind a key kdctl does not hold. Its TP size and drafting configuration it does not
        report. A failure to read them otherwise is the engine's answer, not "none": settings
        read as missing would make every result look measured under others."""
        try:
            family = self.metrics().get("vllm:cache_config_info")
        except BackendAuthError:
            return None
        if family is None or not family.samples:
            return None
        labels: dict[str, str] = family.samples[0].labels
        return {
            f"cache_config.{k}": v
            for k, v in sorted(labels.items())
            if k not in _PER_START and not k.startswith("_")
        }

    def _body(self, req: GenerateRequest, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": req.input_ids if req.input_ids is not None else req.text,
            "max_tokens": req.max_new_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "stream": stream,
            # Token ids instead of strings: vLLM's `return_tokens_as_token_ids` for logprob
            # entries, and `return_token_ids` (vLLM and SGLang) for the output itself.
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
        }
        # Only where a gate reads them: SGLang builds every stream event's logprobs from the
        # whole list so far. The output's ids come back through return_token_ids.
        if req.logprobs or req.top_logprobs:
            body["logprobs"] = max(req.top_logprobs, 1)
        if req.top_k > 0:
            body["top_k"] = req.top_k
        if req.ignore_eos:
            body["ignore_eos"] = True
        if req.stop:
            body["stop"] = req.stop
        if req.stop_token_ids:
            body["stop_token_ids"] = req.stop_token_ids
        if req.seed is not None:
            body["seed"] = req.seed
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    def _logprobs(self, choice: dict[str, Any], k: int) -> list[TokenLogprob]:
        lp = choice.get("logprobs") or {}
        tokens = lp.get("tokens") or []
        values = lp.get("token_logprobs") or []
        tops = lp.get("top_logprobs") or [None] * len(tokens)
        ids = choice.get("token_ids") or lp.get("token_ids")
        out = []
        for i, (tok, value, top) in enumerate(zip(tokens, values, tops, strict=False)):
            token_id = int(ids[i]) if ids and i < len(ids) else _token_id(tok)
            if token_id is None:
                # SGLang's OpenAI routes key logprobs by token text and have no
                # return_tokens_as_token_ids (docs/sglang-compatibility.md).
                raise TextKeyedLogprobs(tok)
            ranked = []
            for t, v in (top or {}).items() if k else ():
                tid = _token_id(t)
                if tid is None:
                    # The alternatives are named by text: dropping them would leave a top-k
                    # that looks measured and is empty.
                    raise TextKeyedLogprobs(t)
                ranked.append((tid, float(v)))
            ranked.sort(key=lambda p: -p[1])
            out.append(
                TokenLogprob(token_id=token_id, logprob=float(value), top=ranked[:k] if k else [])
            )
        return out

    def generate(self, req: GenerateRequest) -> GenerateResult:
        url = self.http.url("/v1/completions")
        data = self.http.json("POST", "/v1/completions", self._body(req, stream=False))
        try:
            choice = data["choices"][0]
            usage = data.get("usage") or {}
            try:
                logprobs = self._logprobs(choice, req.top_logprobs)
            except TextKeyedLogprobs as exc:
                raise BackendProtocolError(
                    self.name,
                    url,
                    f"its logprobs name tokens by text ({exc.token!r}), not by id (SGLang's "
                    "OpenAI routes do): ids cannot be compared; use the sglang kind",
                ) from None
            ids = [int(i) for i in choice.get("token_ids") or [t.token_id for t in logprobs]]
            reason = choice.get("finish_reason") or "length"
            return GenerateResult(
                output_ids=ids,
                text=choice.get("text") or "",
                finish_reason=reason if reason in ("length", "stop") else "abort",
                matched_stop=choice.get("stop_reason", choice.get("matched_stop")),
                prompt_tokens=int(usage.get("prompt_tokens") or 0),
                completion_tokens=int(usage.get("completion_tokens") or len(ids)),
                logprobs=logprobs,
            )
        except (TypeError, ValueError, KeyError, IndexError) as exc:
            raise BackendProtocolError(self.name, url, f"malformed answer: {exc}") from None

    def stream_call(self, req: GenerateRequest) -> StreamCall:
        return StreamCall("/v1/completions", self._body(req, stream=True), self._read)

    def _read(self, at: float, data: Any) -> StreamChunk | None:
        # Called once per token of every stream by the load generator: kept to the lookups
        # each event needs.
        choices = data.get("choices")
        if not choices:
            usage = data.get("usage")
            if not usage:
                return None
            return StreamChunk(
                at,
                prompt_tokens=count(usage.get("prompt_tokens")),
                completion_tokens=count(usage.get("completion_tokens")),
            )
        choice = choices[0]
        ids = choice.get("token_ids")
        if ids is None:
            try:
                ids = [t.token_id for t in self._logprobs(choice, 0)]
            except TextKeyedLogprobs:
                ids = []  # counted from the server's usage at the end
        if not all(type(i) is int for i in ids):
            raise ValueError(f"token_ids are not integers: {ids!r}")
        reason = choice.get("finish_reason")
        return StreamChunk(
            at,
            ids,
            choice.get("text") or "",
            (reason if reason in ("length", "stop") else "abort") if reason else None,
        )

    def chat(
        self, messages: list[dict[str, str]], *, max_tokens: int = 16, temperature: float = 0.0
    ) -> ChatResult:
        """One chat completion, streamed with `include_usage`, as chat clients call it."""
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        parts: list[str] = []
        first: float | None = None
        finish = None
        usage: dict[str, Any] = {}
        for at, data in self.http.events("/v1/chat/completions", body):
            for choice in data.get("choices") or []:
                delta = (choice.get("delta") or {}).get("content") or ""
                if delta and first is None:
                    first = at
                parts.append(delta)
                finish = choice.get("finish_reason") or finish
            usage = data.get("usage") or usage
        if not usage:
            raise BackendProtocolError(
                self.name, self.http.url("/v1/chat/completions"), "no usage chunk in the stream"
            )
        return ChatResult(
            content="".join(parts),
            finish_reason=finish,
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
            first_token_at=first,
        )


class TextKeyedLogprobs(ValueError):
    def __init__(self, token: str) -> None:
        super().__init__(token)
        self.token = token


def _token_id(token: str) -> int | None:
    match = _TOKEN_ID.match(token)
    return int(match.group(1)) if match else None


def vllm_argv(
    python: Path | str,
    model: Path | str,
    port: int,
    *,
    served_name: str,
    max_model_len: int = 1024,
    extra: Sequence[str] = (),
) -> list[str]:
    """The command line of vLLM's OpenAI-compatible server on loopback, as the tests and the
    benchmarks start it (its CPU build: a modest share of memory, a short context)."""
    return [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        served_name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(max_model_len),
        "--gpu-memory-utilization",
        "0.3",
        *extra,
    ]
