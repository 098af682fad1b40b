"""The HTTP clients kdctl talks to engines and routers with.

SGLang and vLLM serve through uvicorn, which closes a connection idle for 5 s
(SGLANG_TIMEOUT_KEEP_ALIVE, VLLM_HTTP_TIMEOUT_KEEP_ALIVE); httpx keeps an idle connection for
5 s as well. A request sent on a pooled connection at about its fifth idle second meets the
server's close and fails with "Server disconnected without sending a response" (or a reset): a
probe polling every few seconds on a loaded machine meets it, and would report a healthy
engine as failing. So connections are kept idle for less than those servers keep them, and a
request the server dropped before answering anything is sent once more: any read (GET, HEAD)
dropped or reset, a generation only where the server closed without a byte of answer. A second
drop is the engine's answer and is reported. The load generator and a router's worker API
never resend: a load counts every drop a client would meet, and a worker added or removed
twice is not the same as once.
"""

from __future__ import annotations

from typing import Any

import httpx

# Below uvicorn's default 5 s, with room for a loaded machine's late timers.
KEEPALIVE_EXPIRY_S = 2.0


def _dropped(request: httpx.Request, exc: Exception) -> bool:
    """Whether the server closed the connection before a byte of its answer, where sending
    the request again cannot do twice what was asked (its body is bytes kdctl holds)."""
    if not isinstance(request.stream, httpx.ByteStream):
        return False
    if isinstance(exc, httpx.RemoteProtocolError):
        return "without sending a response" in str(exc)
    return isinstance(exc, httpx.ReadError | httpx.WriteError) and request.method in ("GET", "HEAD")


class _Resending(httpx.Client):
    def send(self, request: httpx.Request, **kwargs: Any) -> httpx.Response:
        try:
            return super().send(request, **kwargs)
        except httpx.TransportError as exc:
            if not _dropped(request, exc):
                raise
        return super().send(request, **kwargs)


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


def http_client(*, resend: bool = True, **kwargs: Any) -> httpx.Client:
    """An httpx.Client (its arguments as httpx takes them, proxies from the environment
    included) keeping idle connections below the engines' keep-alive; with `resend`, a request
    dropped unanswered is sent once more."""
    cls = _Resending if resend else httpx.Client
    return cls(limits=_limits(None), **kwargs)


def async_http_client(*, connections: int, **kwargs: Any) -> httpx.AsyncClient:
    """The load generator's client: idle connections below the engines' keep-alive, and no
    resend, so that a run counts every drop a client would meet."""
    return httpx.AsyncClient(limits=_limits(connections), **kwargs)
