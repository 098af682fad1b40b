"""The HTTP plumbing every served backend shares: one client, typed errors, SSE reading."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr

from kdctl._httpclient import http_client
from kdctl._limits import load_json
from kdctl.backends.errors import (
    BackendAuthError,
    BackendError,
    BackendHTTPError,
    BackendNotReady,
    BackendProtocolError,
    BackendTimeout,
    BackendUnavailable,
)
from kdctl.backends.health import (
    HEALTH_TIMEOUT_S,
    HealthResult,
    bearer,
    connect_refused,
    probe_health,
)
from kdctl.errors import InputError

# One engine answer (a batch of generations with top-k logprobs): far below this.
MAX_ANSWER_BYTES = 64 << 20


class HttpSession:
    def __init__(
        self,
        backend: str,
        base_url: str,
        *,
        api_key: SecretStr | None = None,
        timeout: float = 60.0,
        client: httpx.Client | None = None,
    ) -> None:
        self.backend = backend
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._key = api_key
        self._headers = bearer(api_key)
        self._client = client or http_client(timeout=timeout)
        self._owns_client = client is None

    def close(self) -> None:
        if self._owns_client:
            self._client.close()

    def url(self, path: str) -> str:
        return f"{self.base_url}{path}"

    def _fail(self, path: str, exc: Exception) -> BackendError:
        url = self.url(path)
        if isinstance(exc, httpx.ConnectError):
            refused = connect_refused(exc)
            why = "connection refused" if refused else f"host unreachable: {exc}"
            return BackendUnavailable(self.backend, url, why, refused=refused)
        if isinstance(exc, httpx.TimeoutException):
            return BackendTimeout(self.backend, url, f"no answer within {self.timeout:g}s")
        return BackendProtocolError(self.backend, url, f"{type(exc).__name__}: {exc}")

    def _check(self, path: str, resp: httpx.Response) -> None:
        if resp.status_code < 400:
            return
        url = self.url(path)
        try:
            # Enough to parse a whole error object; the message shown is cut after.
            body = _prefix(resp, 4096)
        except httpx.HTTPError:
            body = ""
        if resp.status_code in (401, 403):
            raise BackendAuthError(
                self.backend, url, f"authentication failed (HTTP {resp.status_code})"
            )
        said = error_message(body)[:300]
        if resp.status_code == 503:
            raise BackendNotReady(
                self.backend,
                url,
                f"not ready yet (HTTP 503) {said}".strip(),
                draining="draining" in said.lower(),
            )
        raise BackendHTTPError(self.backend, url, resp.status_code, said)

    def deadline(self) -> float:
        """When an exchange begun now must have ended: the session's timeout bounds the whole
        answer, not each read, so an engine that trickles bytes forever is stopped too."""
        return time.perf_counter() + self.timeout

    def read_body(self, resp: httpx.Response, path: str, deadline: float) -> bytes:
        """A response's whole body, by the deadline and within MAX_ANSWER_BYTES."""
        buf = bytearray()
        for chunk in resp.iter_bytes():
            buf += chunk
            if len(buf) > MAX_ANSWER_BYTES:
                raise BackendProtocolError(
                    self.backend,
                    self.url(path),
                    f"the answer exceeds {MAX_ANSWER_BYTES >> 20} MiB, more than any engine's "
                    "answer holds",
                )
            if time.perf_counter() > deadline:
                raise BackendTimeout(
                    self.backend, self.url(path), f"the answer did not end within {self.timeout:g}s"
                )
        return bytes(buf)

    def lines(self, resp: httpx.Response, path: str, deadline: float) -> Iterator[str]:
        """A streamed response's lines, until the deadline."""
        for line in resp.iter_lines():
            if time.perf_counter() > deadline:
                raise BackendTimeout(
                    self.backend, self.url(path), f"the stream did not end within {self.timeout:g}s"
                )
            yield line

    def fetch(self, method: str, path: str, body: dict[str, Any] | None = None) -> bytes:
        """The body of a successful answer; a failure of any kind as a typed error."""
        deadline = self.deadline()
        try:
            with self._client.stream(
                method, self.url(path), json=body, headers=self._headers, timeout=self.timeout
            ) as resp:
                self._check(path, resp)
                return self.read_body(resp, path, deadline)
        except httpx.HTTPError as exc:
            raise self._fail(path, exc) from None

    def health(self, path: str = "/health") -> HealthResult:
        # SGLang's generating /health may take its 20 s; never longer than this backend's
        # own request deadline.
        return probe_health(
            self._client,
            self.base_url,
            api_key=self._key,
            path=path,
            timeout=min(self.timeout, HEALTH_TIMEOUT_S),
        )

    def metrics(self) -> dict[str, Any]:
        """Prometheus families by name; `{}` where the engine exports none (SGLang mounts
        /metrics only with --enable-metrics)."""
        try:
            text = self.fetch("GET", "/metrics").decode(errors="replace")
        except BackendHTTPError as exc:
            if exc.status == 404:
                return {}
            raise
        try:
            return {f.name: f for f in text_string_to_metric_families(text)}
        except ValueError as exc:
            raise BackendProtocolError(self.backend, self.url("/metrics"), str(exc)) from None

    def json(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        content = self.fetch(method, path, body)
        try:
            return load_json(content, self.url(path), max_bytes=MAX_ANSWER_BYTES)
        except InputError as exc:
            raise BackendProtocolError(self.backend, self.url(path), str(exc)) from None
        except (json.JSONDecodeError, UnicodeDecodeError):
            text = content[:120].decode(errors="replace")
            raise BackendProtocolError(
                self.backend, self.url(path), f"answer is not JSON: {text!r}"
            ) from None

    def events(self, path: str, body: dict[str, Any]) -> Iterator[tuple[float, Any]]:
        """POST and read server-sent events: (arrival time, parsed JSON) until `[DONE]`.

        A stream that ends without `[DONE]` was cut off, and says so.
        """
        url = self.url(path)
        deadline = self.deadline()
        try:
            with self._client.stream(
                "POST", url, json=body, headers=self._headers, timeout=self.timeout
            ) as resp:
                self._check(path, resp)
                for line in self.lines(resp, path, deadline):
                    arrived = time.perf_counter()
                    data = sse_data(self.backend, url, line)
                    if data is DONE:
                        return
                    if data is not None:
                        yield arrived, data
        except httpx.HTTPError as exc:
            raise self._fail(path, exc) from None
        raise BackendProtocolError(self.backend, url, "the stream ended without [DONE]")


def _prefix(resp: httpx.Response, size: int) -> str:
    """The start of an error's body, for the message; the rest is never read."""
    buf = b""
    for chunk in resp.iter_bytes():
        buf += chunk
        if len(buf) >= size:
            break
    return buf[:size].decode(errors="replace")


# The end-of-stream marker SGLang, vLLM and OpenAI send as `data: [DONE]`.
DONE: Any = object()


def sse_data(backend: str, url: str, line: str) -> Any:
    """One line of a server-sent event stream: its JSON, `DONE`, or None for other lines.

    An error event raises, so a stream that fails midway is never read as a short answer.
    """
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if payload == "[DONE]":
        return DONE
    try:
        # orjson: a load generator parses one event per token of every stream, and the standard
        # library's parser took nearly three times as long on vLLM's events (3.7 against 1.3 us).
        data = orjson.loads(payload)
    except orjson.JSONDecodeError:
        raise BackendProtocolError(
            backend, url, f"stream event is not JSON: {payload[:120]!r}"
        ) from None
    if _is_error(data):
        err = data.get("error", data)
        msg = err.get("message") if isinstance(err, dict) else err
        raise BackendHTTPError(backend, url, 500, f"error in stream: {msg}")
    return data


def error_message(body: str) -> str:
    """What an engine's error body says, in each shape SGLang has used (docs/sglang-
    compatibility.md): {"error": {"message": ...}} (/generate), {"error": "..."} (0.5.23's
    request schema), the flat {"object": "error", "message": ...} (0.4.10 on: validation, the
    OpenAI routes), FastAPI's {"detail": ...} (0.4.3 to 0.4.6); else the body as it came."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body
    if not isinstance(data, dict):
        return body
    err = data.get("error")
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        return str(err["message"])
    if isinstance(err, str):
        return err
    if data.get("object") == "error" and isinstance(data.get("message"), str):
        return str(data["message"])
    detail = data.get("detail")
    if isinstance(detail, str):
        return detail
    if isinstance(detail, list) and detail:
        first = detail[0]
        if isinstance(first, dict) and "msg" in first:
            where = ".".join(str(p) for p in first.get("loc", []))
            return f"{where}: {first['msg']}" if where else str(first["msg"])
    return body


def _is_error(data: Any) -> bool:
    """An error event: SGLang's {"error": ...}, or an OpenAI-style error object."""
    if not isinstance(data, dict):
        return False
    if data.get("object") == "error":
        return True
    return "error" in data and "choices" not in data and "meta_info" not in data
