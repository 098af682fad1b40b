"""The reference server: the reference engine behind SGLang's HTTP API.

Native routes (`/generate`, `/health`, `/model_info`, `/server_info` and their older names)
and OpenAI routes (`/v1/models`, `/v1/completions`, `/v1/chat/completions`), streaming as
SGLang streams, an API key checked as SGLang checks it, and 503 until the model is loaded.
It is what the sandbox and the tests run as a local engine; it makes no claim to be fast.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from pydantic import ValidationError

from kdctl import __version__
from kdctl.backends._types import GenerateRequest, GenerateResult
from kdctl.backends.reference import require_extra
from kdctl.backends.reference.engine import ReferenceEngine, final
from kdctl.backends.reference.shapes import DEFAULT_VERSION, EMBEDDING_0523, SHAPES
from kdctl.backends.reference.speculative import open_engine, reference_settings
from kdctl.errors import InputError

VERSION = f"kdctl-reference {__version__}"
# How long /health waits for the engine to be free for one step before it says "stuck": far
# above one step of the tiny models, and short enough that a stuck engine says so quickly.
HEALTH_WAIT_S = 3.0


# SGLang's default histogram bounds (metrics/collector.py, TokenizerMetricsCollector): its TTFT
# buckets start at 0.1 s, so whatever reads them meets the same coarseness on both engines.
TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
E2E_BUCKETS = (*TTFT_BUCKETS, 600, 1200, 1800, 2400)


class _State:
    def __init__(
        self,
        model_dir: Path,
        served_name: str,
        device: str,
        dtype: str,
        draft: Path | None = None,
        draft_tokens: int = 4,
    ) -> None:
        self.model_dir = model_dir
        self.served_name = served_name
        self.device = device
        self.dtype = dtype
        self.draft = draft
        self.draft_tokens = draft_tokens
        self.engine: ReferenceEngine | None = None
        self.load_error: str | None = None
        # SGLang's own metric names, so a dashboard or gate reads both engines alike.
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.running = Gauge(
            "sglang:num_running_reqs", "Running requests", labels, registry=self.registry
        ).labels(served_name)
        self.requests = Counter(
            "sglang:num_requests", "Requests finished", labels, registry=self.registry
        ).labels(served_name)
        self.prompt_tokens = Counter(
            "sglang:prompt_tokens", "Prompt tokens processed", labels, registry=self.registry
        ).labels(served_name)
        self.generation_tokens = Counter(
            "sglang:generation_tokens", "Tokens generated", labels, registry=self.registry
        ).labels(served_name)
        self.ttft = Histogram(
            "sglang:time_to_first_token_seconds",
            "Time to first token",
            labels,
            registry=self.registry,
            buckets=TTFT_BUCKETS,
        ).labels(served_name)
        self.e2e = Histogram(
            "sglang:e2e_request_latency_seconds",
            "End-to-end latency",
            labels,
            registry=self.registry,
            buckets=E2E_BUCKETS,
        ).labels(served_name)
        # Tokens made by verification steps, and those steps, over every request decoded
        # speculatively since start: SGLang's count leaves out each request's prefill token.
        self.spec_tokens = 0
        self.spec_steps = 0
        self.spec_lock = threading.Lock()

    def accept_state(self) -> dict[str, float]:
        """SGLang's internal state for speculation: its lifetime tokens per verification step,
        once a step has run."""
        if not self.spec_steps:
            return {}
        return {"avg_spec_accept_length": self.spec_tokens / self.spec_steps}

    def load(self, ready_line: str | None) -> None:
        try:
            self.engine = open_engine(
                self.model_dir,
                self.draft,
                draft_tokens=self.draft_tokens,
                device=self.device,
                dtype=self.dtype,
            )
        except Exception as exc:  # reported on /health, the server keeps answering
            self.load_error = f"{type(exc).__name__}: {exc}"
            print(
                f"kdctl reference server: cannot load the model: {self.load_error}",
                file=sys.stderr,
                flush=True,
            )
            return
        if ready_line:
            # What a log watcher waits for, as SGLang's "fired up and ready to roll".
            print(ready_line, file=sys.stderr, flush=True)


def create_app(
    model_dir: Path,
    *,
    served_name: str | None = None,
    api_key: str | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    load_delay_s: float = 0.0,
    ready_line: str | None = None,
    draft: Path | None = None,
    draft_tokens: int = 4,
    sglang_version: str = DEFAULT_VERSION,
) -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    state = _State(model_dir, served_name or str(model_dir), device, dtype, draft, draft_tokens)
    shape = SHAPES[sglang_version]
    # How this server runs, fixed at its start: /server_info says it on every call.
    settings = reference_settings(model_dir, draft, draft_tokens, device=device, dtype=dtype)

    def _load() -> None:
        time.sleep(load_delay_s)
        state.load(ready_line)

    threading.Thread(target=_load, name="kdctl-reference-load", daemon=True).start()

    def error(status: int, message: str, kind: str = "BadRequestError") -> JSONResponse:
        return JSONResponse(
            {"object": "error", "message": message, "type": kind, "param": None, "code": status},
            status,
        )

    def engine_or_503() -> ReferenceEngine | JSONResponse:
        if state.engine is None:
            msg = state.load_error or "the model is still loading"
            return error(503, msg, "ServiceUnavailable")
        return state.engine

    async def body(request: Request) -> dict[str, Any] | JSONResponse:
        try:
            data = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return error(400, "the body is not JSON")
        if not isinstance(data, dict):
            return error(400, "the body must be a JSON object")
        return data

    def run(engine: ReferenceEngine, req: GenerateRequest) -> Iterator[tuple[GenerateResult, bool]]:
        started = time.perf_counter()
        last = None
        state.running.inc()
        try:
            for last, done in engine.steps(req):
                if last.completion_tokens == 1:
                    state.ttft.observe(time.perf_counter() - started)
                yield last, done
        finally:
            state.running.dec()
            if last is not None:
                if last.spec_verify_ct:
                    with state.spec_lock:
                        state.spec_tokens += last.completion_tokens - 1
                        state.spec_steps += last.spec_verify_ct
                state.requests.inc()
                state.prompt_tokens.inc(last.prompt_tokens)
                state.generation_tokens.inc(last.completion_tokens)
                state.e2e.observe(time.perf_counter() - started)

    async def health(request: Request) -> Response:
        got = engine_or_503()
        if isinstance(got, JSONResponse):
            return got
        if not shape.health_generates:
            return Response(status_code=200)
        # Healthy means a generation could run now, not only that HTTP answers.
        if not await _in_thread(lambda: got.responsive(HEALTH_WAIT_S)):
            return error(503, "generation is stuck: no step could start", "ServiceUnavailable")
        if request.url.path == "/health_generate":
            req = GenerateRequest(input_ids=[0], max_new_tokens=1)
            await _in_thread(lambda: got.generate(req))
        return Response(status_code=200)

    async def model_info(request: Request) -> Response:
        config = json.loads((model_dir / "config.json").read_text())
        known = {
            "model_path": str(model_dir),
            "tokenizer_path": str(model_dir),
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": config.get("model_type"),
            "architectures": config.get("architectures"),
            "served_model_name": state.served_name,
            "load_format": "auto",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "embedding": EMBEDDING_0523,
        }
        return JSONResponse({k: known[k] for k in shape.model_info})

    async def server_info(request: Request) -> Response:
        ctx = state.engine.context_length if state.engine else None
        return JSONResponse(
            {
                "model_path": str(model_dir),
                "served_model_name": state.served_name,
                **settings,
                # Null, as SGLang's is unless --context-length was given (every captured
                # server's): the window is on /v1/models.
                "context_length": None,
                "max_req_input_len": ctx,
                "version": VERSION,
                # A server argument since 0.5.10; older releases stream cumulative text.
                "incremental_streaming_output": shape.incremental_text,
                "internal_states": [state.accept_state()],
            }
        )

    def schema_error(message: str, *, parsed: bool = True) -> JSONResponse:
        form = shape.schema_error if parsed else (shape.body_error or shape.schema_error)
        if form == "detail":
            detail = [{"type": "value_error", "loc": ["body"], "msg": message, "input": None}]
            return JSONResponse({"detail": detail}, 422)
        if form == "text":
            return JSONResponse({"error": message}, 400)
        return error(400, message)

    async def generate(request: Request) -> Response:
        try:
            data = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return schema_error("the body is not JSON", parsed=False)
        if not isinstance(data, dict):
            return schema_error("the body must be a JSON object", parsed=False)
        got = engine_or_503()
        if isinstance(got, JSONResponse):
            return got
        sp = data.get("sampling_params") or {}
        stream = bool(data.get("stream"))
        unknown = sorted(set(sp) - _SAMPLING_KEYS) if isinstance(sp, dict) else []
        if shape.strict_sampling and unknown:
            return schema_error(
                f"unknown field `{unknown[0]}`, expected one of "
                + ", ".join(f"`{k}`" for k in sorted(_SAMPLING_KEYS))
            )
        try:
            req = GenerateRequest(
                text=data.get("text"),
                input_ids=data.get("input_ids"),
                max_new_tokens=sp.get("max_new_tokens", 128),
                temperature=sp.get("temperature", 1.0),
                top_p=sp.get("top_p", 1.0),
                top_k=sp.get("top_k", -1),
                seed=sp.get("sampling_seed"),
                stop=_listify(sp.get("stop")),
                stop_token_ids=sp.get("stop_token_ids") or [],
                ignore_eos=bool(sp.get("ignore_eos", False)),
                top_logprobs=int(data.get("top_logprobs_num") or 0),
            )
        except ValidationError as exc:
            if any(e["type"].endswith(("_type", "_parsing")) for e in exc.errors()):
                return schema_error(_message(exc))
            return bad_input(_message(exc), stream)
        except (TypeError, ValueError) as exc:
            return schema_error(_message(exc))
        try:
            _check(got, req)
        except InputError as exc:
            return bad_input(str(exc), stream)
        rid = str(data.get("rid") or uuid.uuid4().hex)
        want_lp = bool(data.get("return_logprob"))
        started = time.perf_counter()
        clock = _Clock(time.time(), started)

        sent = {"ids": 0, "text": 0}

        def native(result: GenerateResult, done: bool, streamed: bool) -> dict[str, Any]:
            meta: dict[str, Any] = {
                "id": rid,
                "prompt_tokens": result.prompt_tokens,
                "completion_tokens": result.completion_tokens,
                "cached_tokens": 0,
                "finish_reason": _finish(result) if done else None,
            }
            if done:
                meta["e2e_latency"] = time.perf_counter() - started
            if result.spec_verify_ct is not None:
                meta["spec_verify_ct"] = result.spec_verify_ct
            if result.spec_verify_ct:
                meta.update(_accept(result, getattr(got, "draft_tokens", 0)))
            meta.update({k: _META_EXTRA[k](result, clock) for k in shape.meta_extra})
            if done:
                meta.update({k: _META_EXTRA[k](result, clock) for k in shape.meta_done_extra})
            if want_lp:
                meta.update({k: _META_EXTRA[k](result, clock) for k in shape.logprob_extra})
                meta["output_token_logprobs"] = [
                    [t.logprob, t.token_id, None] for t in result.logprobs
                ]
                if req.top_logprobs:
                    meta["output_top_logprobs"] = [
                        [[lp, tid, None] for tid, lp in t.top] for t in result.logprobs
                    ]
            answer: dict[str, Any] = {"text": result.text}
            if streamed and shape.incremental_text:
                answer["text"] = result.text[sent["text"] :]
                sent["text"] = len(result.text)
            if shape.output_ids != "none":
                answer["output_ids"] = result.output_ids
                if streamed and shape.output_ids == "new":
                    answer["output_ids"] = result.output_ids[sent["ids"] :]
                    sent["ids"] = len(result.output_ids)
            answer["meta_info"] = meta
            return answer

        if stream:

            def events() -> Iterator[str]:
                for result, done in run(got, req):
                    yield f"data: {json.dumps(native(result, done, True))}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(_closing(events()), media_type="text/event-stream")
        last = await _in_thread(lambda: final(run(got, req)))
        return JSONResponse(native(last, True, False))

    def bad_input(message: str, stream: bool) -> Response:
        """What SGLang answers to a request it cannot serve (a prompt over the context, bad
        sampling values): 400, or in a stream that has begun, an error event and [DONE]."""
        if not stream:
            return JSONResponse({"error": {"message": message}}, 400)
        err: dict[str, Any] = {"message": message}
        if shape.rich_stream_error:
            err.update(type="invalid_request_error", code=400, retryable=False)
        events = f"data: {json.dumps({'error': err})}\n\ndata: [DONE]\n\n"
        return Response(events, 200, media_type="text/event-stream")

    async def models(request: Request) -> Response:
        ctx = state.engine.context_length if state.engine else None
        card = {
            "id": state.served_name,
            "object": "model",
            "created": 0,
            "owned_by": "kdctl",
            "root": str(model_dir),
            "max_model_len": ctx,
        }
        if shape.openai_extra:
            card["parent"] = None
        return JSONResponse({"object": "list", "data": [card]})

    async def completions(request: Request) -> Response:
        return await _openai(request, chat=False)

    async def chat(request: Request) -> Response:
        return await _openai(request, chat=True)

    async def _openai(request: Request, *, chat: bool) -> Response:
        data = await body(request)
        if isinstance(data, JSONResponse):
            return data
        got = engine_or_503()
        if isinstance(got, JSONResponse):
            return got
        # As SGLang does, the request's model is not checked: one it does not serve is answered.
        try:
            if chat:
                messages = data.get("messages")
                if not isinstance(messages, list) or not messages:
                    raise ValueError("messages must be a non-empty list")
                prompt: Any = _chat_prompt(got, messages)
            else:
                prompt = data.get("prompt")
            text = prompt if isinstance(prompt, str) else None
            ids = prompt if isinstance(prompt, list) else None
            if text is None and ids is None:
                raise ValueError("prompt must be a string or a list of token ids")
            k = data.get("top_logprobs") if chat else data.get("logprobs")
            req = GenerateRequest(
                text=text,
                input_ids=ids,
                max_new_tokens=data.get("max_completion_tokens") or data.get("max_tokens") or 16,
                temperature=data.get("temperature", 1.0),
                top_p=data.get("top_p", 1.0),
                top_k=data.get("top_k", -1),
                seed=data.get("seed"),
                stop=_listify(data.get("stop")),
                ignore_eos=bool(data.get("ignore_eos", False)),
                top_logprobs=int(k or 0),
            )
            _check(got, req)
        except (ValidationError, InputError, TypeError, ValueError) as exc:
            return error(400, _message(exc))
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        obj = "chat.completion" if chat else "text_completion"
        want_lp = (data.get("logprobs") is True) if chat else (data.get("logprobs") is not None)

        def tok(token_id: int) -> str:
            # By text, as SGLang's OpenAI routes name them: it has no vLLM-style
            # return_tokens_as_token_ids (docs/sglang-compatibility.md).
            return got.decode([token_id])

        def usage(r: GenerateResult) -> dict[str, int]:
            counts = {
                "prompt_tokens": r.prompt_tokens,
                "completion_tokens": r.completion_tokens,
                "total_tokens": r.prompt_tokens + r.completion_tokens,
            }
            if shape.openai_extra:
                counts["reasoning_tokens"] = 0
            return counts

        def logprobs(r: GenerateResult, start: int) -> dict[str, Any] | None:
            if not want_lp:
                return None
            part = r.logprobs[start:]
            if chat:
                return {
                    "content": [
                        {
                            "token": got.decode([t.token_id]),
                            "logprob": t.logprob,
                            "top_logprobs": [
                                {"token": got.decode([i]), "logprob": lp} for i, lp in t.top
                            ],
                        }
                        for t in part
                    ]
                }
            return {
                "tokens": [tok(t.token_id) for t in part],
                "token_logprobs": [t.logprob for t in part],
                "top_logprobs": [{tok(i): lp for i, lp in t.top} for t in part],
            }

        def choice(
            r: GenerateResult, text: str, start: int, done: bool, stream: bool
        ) -> dict[str, Any]:
            c: dict[str, Any] = {"index": 0, "logprobs": logprobs(r, start)}
            if chat:
                c["delta" if stream else "message"] = {"role": "assistant", "content": text}
            else:
                c["text"] = text
            c["finish_reason"] = r.finish_reason if done else None
            c["matched_stop"] = r.matched_stop if done else None
            return c

        if data.get("stream"):
            include_usage = bool((data.get("stream_options") or {}).get("include_usage"))

            def events() -> Iterator[str]:
                sent_text, sent_ids = "", 0
                for result, done in run(got, req):
                    delta = result.text[len(sent_text) :]
                    yield _sse(
                        obj, rid, state.served_name, choice(result, delta, sent_ids, done, True)
                    )
                    sent_text, sent_ids = result.text, len(result.output_ids)
                    if done and include_usage:
                        yield _sse(obj, rid, state.served_name, None, usage(result))
                yield "data: [DONE]\n\n"

            return StreamingResponse(_closing(events()), media_type="text/event-stream")
        last = await _in_thread(lambda: final(run(got, req)))
        return JSONResponse(
            {
                "id": rid,
                "object": obj,
                "created": int(time.time()),
                "model": state.served_name,
                "choices": [choice(last, last.text, 0, True, False)],
                "usage": usage(last),
                **({"metadata": _weights(last)} if shape.openai_extra else {}),
            }
        )

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/health_generate", health, methods=["GET"]),
        Route("/get_model_info", model_info, methods=["GET"]),
        Route("/get_server_info", server_info, methods=["GET"]),
        *(
            [
                Route("/model_info", model_info, methods=["GET"]),
                Route("/server_info", server_info, methods=["GET"]),
            ]
            if shape.info_routes
            else []
        ),
        Route("/generate", generate, methods=["POST", "PUT"]),
        Route("/v1/models", models, methods=["GET"]),
        *([Route("/ready", health, methods=["GET"])] if shape.ready_route else []),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = Starlette(routes=routes)
    if api_key:
        app.add_middleware(_ApiKey, api_key=api_key)
    return app


class _ApiKey:
    """SGLang's rule: `Authorization: Bearer KEY` on every path but /health* and /metrics."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS":
            path = scope["path"]
            if not (path.startswith("/health") or path.startswith("/metrics")):
                headers = dict(scope["headers"])
                if headers.get(b"authorization") != self.expected:
                    from starlette.responses import JSONResponse

                    await JSONResponse({"error": "Unauthorized"}, 401)(scope, receive, send)
                    return
        await self.app(scope, receive, send)


async def _closing(chunks: Iterator[str]) -> Any:
    """Stream `chunks`, and close them when the client goes away mid-stream, so the request's
    own clean-up (its running count) happens then rather than never."""
    from starlette.concurrency import iterate_in_threadpool

    try:
        async for chunk in iterate_in_threadpool(chunks):
            yield chunk
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            with contextlib.suppress(ValueError):  # still running in its worker thread
                close()


async def _in_thread(fn: Any) -> Any:
    from starlette.concurrency import run_in_threadpool

    return await run_in_threadpool(fn)


def _check(engine: ReferenceEngine, req: GenerateRequest) -> None:
    ids = req.input_ids if req.input_ids is not None else engine.encode(req.text or "")
    vocab = int(engine.config.get("vocab_size") or 0)
    if not ids:
        raise InputError("the prompt is empty")
    if vocab and any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
        raise InputError(f"input_ids must be integers in [0, {vocab})")
    if len(ids) + req.max_new_tokens > engine.context_length:
        raise InputError(
            f"prompt ({len(ids)}) + max_new_tokens ({req.max_new_tokens}) exceeds the "
            f"context length {engine.context_length}"
        )


# What a live SGLang sent under these names on a plain answer (captured 0.5.6.post2).
@dataclass(frozen=True)
class _Clock:
    received: float  # wall clock
    started: float  # perf counter


def _weights(r: GenerateResult) -> dict[str, Any]:
    return {
        "weight_version": "default",
        "weight_versions": [{"version": "default", "start": 0, "end": r.completion_tokens}],
    }


# SGLang's meta_info keys that kdctl does not read, with values of their kind; the timing
# stamps are the ones its --enable-metrics adds (the reference server always exports metrics).
_META_EXTRA: dict[str, Callable[[GenerateResult, _Clock], Any]] = {
    "weight_version": lambda r, c: "default",
    "weight_versions": lambda r, c: _weights(r)["weight_versions"],
    "total_retractions": lambda r, c: 0,
    "num_retractions": lambda r, c: 0,
    "reasoning_tokens": lambda r, c: 0,
    "cached_tokens_details": lambda r, c: None,
    "dp_rank": lambda r, c: None,
    "storage_prefetch_wait": lambda r, c: 0.0,
    "storage_staging_wait": lambda r, c: 0.0,
    "queue_time": lambda r, c: 0.0,
    "request_received_ts": lambda r, c: c.received,
    "api_server_dispatch_finish_ts": lambda r, c: c.received,
    "forward_entry_time": lambda r, c: c.received,
    "prefill_finished_time": lambda r, c: time.time(),
    "first_token_latency": lambda r, c: time.perf_counter() - c.started,
    "decode_throughput": lambda r, c: (
        r.completion_tokens / max(time.perf_counter() - c.started, 1e-9)
    ),
    "request_finished_ts": lambda r, c: time.time(),
    "response_sent_to_client_ts": lambda r, c: time.time(),
    "input_token_logprobs": lambda r, c: [],
    "input_top_logprobs": lambda r, c: [],
    "output_token_logprobs_length": lambda r, c: len(r.logprobs),
}
# The keys of 0.5.23's sampling_params schema, which refuses any other.
_SAMPLING_KEYS = frozenset(
    (
        "max_new_tokens",
        "stop",
        "stop_token_ids",
        "stop_regex",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "min_new_tokens",
        "n",
        "json_schema",
        "regex",
        "ebnf",
        "structural_tag",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "stream_interval",
        "logit_bias",
        "sampling_seed",
        "custom_params",
        "beam_width",
        "watermark",
        "choice",
    )
)


def _accept(result: GenerateResult, draft_tokens: int) -> dict[str, float]:
    """SGLang's accept figures: tokens per verification, and the share of drafted tokens the
    target kept (each verification adds one token of its own; the prefill made the first)."""
    verified = result.spec_verify_ct or 0
    accepted = max(result.completion_tokens - verified - 1, 0)
    rate = accepted / (verified * draft_tokens) if draft_tokens else 0.0
    return {
        "spec_accept_length": result.completion_tokens / verified,
        "spec_accept_rate": rate,
        "spec_accept_token_num": accepted,
        "spec_draft_token_num": verified * draft_tokens,
    }


def _finish(result: GenerateResult) -> dict[str, Any]:
    if result.finish_reason == "length":
        return {"type": "length", "length": result.completion_tokens}
    return {"type": result.finish_reason, "matched": result.matched_stop}


def _listify(value: Any) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def _message(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        return "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors()
        )
    return str(exc)


def _chat_prompt(engine: ReferenceEngine, messages: list[Any]) -> str:
    """The tokenizer's own chat template applied, as SGLang does; a tokenizer without one is
    refused with transformers' ValueError, as SGLang refuses it."""
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise ValueError("each message needs a role and string content")
    return str(
        engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )


def _sse(obj: str, rid: str, model: str, choice: dict[str, Any] | None, usage: Any = None) -> str:
    chunk: dict[str, Any] = {
        "id": rid,
        "object": f"{obj}.chunk" if obj == "chat.completion" else obj,
        "created": int(time.time()),
        "model": model,
        "choices": [choice] if choice is not None else [],
    }
    if usage is not None:
        chunk["usage"] = usage
    return f"data: {json.dumps(chunk)}\n\n"


def serve(
    model_dir: Path,
    *,
    host: str,
    port: int,
    served_name: str | None,
    api_key_env: str | None,
    device: str,
    dtype: str,
    draft: Path | None = None,
    draft_tokens: int = 4,
    sglang_version: str | None = None,
) -> None:
    require_extra()
    sglang_version = sglang_version or DEFAULT_VERSION
    import uvicorn

    api_key = os.environ.get(api_key_env) if api_key_env else None
    if api_key_env and not api_key:
        raise InputError(f"--api-key-env: environment variable {api_key_env} is not set")
    if not (model_dir / "config.json").is_file():
        raise InputError(f"--model: {model_dir} is not a model folder (no config.json)")
    if draft is not None and not (draft / "config.json").is_file():
        raise InputError(f"--draft-model: {draft} is not a model folder (no config.json)")
    if sglang_version not in SHAPES:
        known = ", ".join(SHAPES)
        raise InputError(f"--sglang-version: {sglang_version!r} is not one of {known}")
    app = create_app(
        model_dir,
        served_name=served_name,
        api_key=api_key,
        device=device,
        dtype=dtype,
        ready_line=f"kdctl reference server: ready: http://{host}:{port}",
        draft=draft,
        draft_tokens=draft_tokens,
        sglang_version=sglang_version,
    )
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
