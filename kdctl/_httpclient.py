"""The HTTP clients kdctl talks to engines and routers with.

SGLang and vLLM serve through uvicorn, which closes a connection idle for 5 s
(SGLANG_TIMEOUT_KEEP_ALIVE, VLLM_HTTP_TIMEOUT_KEEP_ALIVE); httpx keeps an idle connection for
5 s as well. A request sent on a pooled connection at about its fifth idle second meets the
server's close and fails with "Server disconnected without sending a response" (or a reset):
a probe polling every few seconds on a loaded machine meets it, and would report a healthy
engine as failing. So connections are kept idle for less than any of those servers keeps them,
and a request the server dropped before answering anything is sent once more, on a new
connection, as browsers and urllib3 do: the server never took it, so nothing is measured twice.
A second drop is the engine's answer and is reported.
"""

from __future__ import annotations

from typing import Any

import httpx

# Below uvicorn's default 5 s, with room for a loaded machine's late timers.
KEEPALIVE_EXPIRY_S = 2.0


def _dropped(request: httpx.Request, exc: httpx.TransportError) -> bool:
    """The server closed the connection before a byte of its answer, and the request's body
    can be sent again (kdctl's JSON bodies are bytes; a streamed upload is not replayable)."""
    if not isinstance(request.stream, httpx.ByteStream):
        return False
    if isinstance(exc, httpx.RemoteProtocolError):
        return "without sending a response" in str(exc)
    return isinstance(exc, httpx.ReadError | httpx.WriteError)


class ResendingTransport(httpx.HTTPTransport):
    def handle_request(self, request: httpx.Request) -> httpx.Response:
        try:
            return super().handle_request(request)
        except httpx.TransportError as exc:
            if not _dropped(request, exc):
                raise
        return super().handle_request(request)


class AsyncResendingTransport(httpx.AsyncHTTPTransport):
    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            return await super().handle_async_request(request)
        except httpx.TransportError as exc:
            if not _dropped(request, exc):
                raise
        return await super().handle_async_request(request)


def _limits(connections: int | None) -> httpx.Limits:
    if connections is None:  # httpx's own pool sizes
        return httpx.Limits(
            max_connections=100, max_keepalive_connections=20, keepalive_expiry=KEEPALIVE_EXPIRY_S
        )
    return httpx.Limits(
        max_connections=connections,
        max_keepalive_connections=connections,
        keepalive_expiry=KEEPALIVE_EXPIRY_S,
    )


def http_client(*, connections: int | None = None, **kwargs: Any) -> httpx.Client:
    """An httpx.Client (its other arguments as httpx takes them) on the resending transport."""
    return httpx.Client(transport=ResendingTransport(limits=_limits(connections)), **kwargs)


def async_http_client(*, connections: int | None = None, **kwargs: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=AsyncResendingTransport(limits=_limits(connections)), **kwargs
    )
