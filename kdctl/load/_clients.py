"""Asynchronous HTTP clients for the load generator, one narrow interface: POST a JSON body and
yield the lines of the event stream with their arrival times.

Two implementations, because a load generator must not be the bottleneck it measures:
`benchmarks/client_capacity.py` drives a paced server through both. aiohttp is the default: at
256 concurrent streams it kept within 1.5x of the ideal run time where httpx took 4x.
"""

from __future__ import annotations

import abc
import time
from collections.abc import AsyncGenerator
from typing import Any, ClassVar

from kdctl.errors import InputError


class RequestFailed(Exception):
    """A request the server refused or broke: counted as a failure, never retried."""


class StreamClient(abc.ABC):
    name: ClassVar[str]

    def __init__(self, headers: dict[str, str], *, connections: int, timeout: float) -> None:
        self.headers = {"Accept": "text/event-stream", **headers}
        self.connections = connections
        self.timeout = timeout

    @abc.abstractmethod
    def lines(self, url: str, body: dict[str, Any]) -> AsyncGenerator[tuple[float, str], None]: ...

    @abc.abstractmethod
    async def aclose(self) -> None: ...


class HttpxClient(StreamClient):
    name = "httpx"

    def __init__(self, headers: dict[str, str], *, connections: int, timeout: float) -> None:
        import httpx

        super().__init__(headers, connections=connections, timeout=timeout)
        self._httpx = httpx
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout),
            limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
        )

    async def lines(
        self, url: str, body: dict[str, Any]
    ) -> AsyncGenerator[tuple[float, str], None]:
        try:
            async with self._client.stream("POST", url, json=body, headers=self.headers) as resp:
                if resp.status_code >= 400:
                    text = (await resp.aread()).decode(errors="replace")[:200]
                    raise RequestFailed(f"HTTP {resp.status_code}: {text}".strip())
                async for line in resp.aiter_lines():
                    yield time.perf_counter(), line
        except self._httpx.HTTPError as exc:
            raise RequestFailed(f"{type(exc).__name__}: {exc}") from None

    async def aclose(self) -> None:
        await self._client.aclose()


class AiohttpClient(StreamClient):
    name = "aiohttp"

    def __init__(self, headers: dict[str, str], *, connections: int, timeout: float) -> None:
        import aiohttp

        super().__init__(headers, connections=connections, timeout=timeout)
        self._aiohttp = aiohttp
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=connections),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout),
            # SGLang's cumulative events with logprobs outgrow aiohttp's 64 KiB line buffer.
            read_bufsize=1 << 22,
        )

    async def lines(
        self, url: str, body: dict[str, Any]
    ) -> AsyncGenerator[tuple[float, str], None]:
        try:
            async with self._session.post(url, json=body, headers=self.headers) as resp:
                if resp.status >= 400:
                    text = (await resp.read()).decode(errors="replace")[:200]
                    raise RequestFailed(f"HTTP {resp.status}: {text}".strip())
                async for raw in resp.content:
                    yield time.perf_counter(), raw.decode().rstrip("\r\n")
        except (self._aiohttp.ClientError, TimeoutError) as exc:
            raise RequestFailed(f"{type(exc).__name__}: {exc}") from None

    async def aclose(self) -> None:
        await self._session.close()


CLIENTS: dict[str, type[StreamClient]] = {"aiohttp": AiohttpClient, "httpx": HttpxClient}


def client_class(name: str) -> type[StreamClient]:
    if name not in CLIENTS:
        raise InputError(f"unknown load client {name!r} (known: {', '.join(CLIENTS)})")
    return CLIENTS[name]
