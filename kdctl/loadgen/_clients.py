"""Asynchronous HTTP clients for the load generator, one narrow interface: POST a JSON body and
yield the lines of the event stream as they arrive.

Two implementations, because a load generator must not be the bottleneck it measures:
`benchmarks/client_capacity.py` drives a server that streams as fast as it can through both,
beside vLLM's own bench client. aiohttp is the default: at 64 and 256 concurrent streams it read
four to six times the tokens a second httpx did, and more than vLLM's client.
"""

from __future__ import annotations

import abc
import time
from collections.abc import AsyncGenerator
from typing import Any, ClassVar

from kdctl.errors import InputError


class RequestFailed(Exception):
    """A request the server refused or broke: counted as a failure, never retried."""


class LineSplitter:
    """Bytes as they come off the socket, cut into the stream's complete lines.

    A load generator reads what each receive brought in one go and splits it itself: reading
    line by line through the client's own reader costs an await and a buffer search per line,
    and at a few hundred streams that, not the server, was what limited kdctl's token rate.
    """

    def __init__(self) -> None:
        # An unfinished line's pieces, joined only once its end arrives (SGLang's cumulative
        # events with logprobs run to megabytes, so repeated concatenation would be quadratic).
        self._pending: list[bytes] = []

    def feed(self, data: bytes) -> list[str]:
        """The lines completed by `data`, without their line ends; empty lines dropped (they
        only separate server-sent events)."""
        end = data.rfind(b"\n")
        if end < 0:
            if data:
                self._pending.append(data)
            return []
        done = data[:end]
        if self._pending:
            done = b"".join([*self._pending, done])
            self._pending = []
        if end + 1 < len(data):
            self._pending.append(data[end + 1 :])
        # Decoded once for the whole read: only complete lines, so no character is cut.
        text = done.decode()
        if "\r" in text:
            return [line for raw in text.split("\n") if (line := raw.rstrip("\r"))]
        return [line for line in text.split("\n") if line]

    def close(self) -> list[str]:
        """What is left when the stream ends: a last line without its line end."""
        rest = b"".join(self._pending).decode().rstrip("\r")
        self._pending = []
        return [rest] if rest else []


class StreamClient(abc.ABC):
    name: ClassVar[str]

    def __init__(
        self,
        headers: dict[str, str],
        *,
        connections: int,
        timeout: float,
        unix_socket: str | None = None,
    ) -> None:
        """`unix_socket`: where the engine's origin is carried through SSH, the local socket
        of that tunnel (kdctl._httpclient.tunnel_socket), for a client that cannot be given
        kdctl's own connects."""
        self.headers = {"Accept": "text/event-stream", **headers}
        self.connections = connections
        self.timeout = timeout
        self.unix_socket = unix_socket

    @abc.abstractmethod
    def lines(self, url: str, body: dict[str, Any]) -> AsyncGenerator[list[str], None]:
        """POST `body` and yield the response's lines as they arrive, in batches: each one what
        a read from the socket completed. The caller stamps them as it handles them."""

    @abc.abstractmethod
    async def aclose(self) -> None: ...

    def failure(self, exc: BaseException) -> RequestFailed:
        # A timeout's own text is empty; what it means is the limit that ran out.
        if isinstance(exc, TimeoutError):
            return RequestFailed(f"no answer within {self.timeout:g}s")
        return RequestFailed(f"{type(exc).__name__}: {exc}")


class HttpxClient(StreamClient):
    name = "httpx"

    def __init__(
        self,
        headers: dict[str, str],
        *,
        connections: int,
        timeout: float,
        unix_socket: str | None = None,
    ) -> None:
        import httpx

        from kdctl._httpclient import async_http_client

        # kdctl's own client takes the tunnel from the registry: `unix_socket` is not needed.
        super().__init__(headers, connections=connections, timeout=timeout)
        self._httpx = httpx
        self._client = async_http_client(connections=connections, timeout=httpx.Timeout(timeout))

    async def lines(self, url: str, body: dict[str, Any]) -> AsyncGenerator[list[str], None]:
        splitter = LineSplitter()
        try:
            # httpx bounds each read; the whole request is bounded here, as aiohttp's total
            # does, so an engine that streams forever is stopped.
            deadline = time.monotonic() + self.timeout
            async with self._client.stream("POST", url, json=body, headers=self.headers) as resp:
                if resp.status_code >= 400:
                    text = (await resp.aread()).decode(errors="replace")[:200]
                    raise RequestFailed(f"HTTP {resp.status_code}: {text}".strip())
                async for data in resp.aiter_bytes():
                    if time.monotonic() > deadline:
                        raise RequestFailed(f"the stream did not end within {self.timeout:g}s")
                    if batch := splitter.feed(data):
                        yield batch
                if batch := splitter.close():
                    yield batch
        except self._httpx.TimeoutException:
            raise RequestFailed(f"no answer within {self.timeout:g}s") from None
        except self._httpx.HTTPError as exc:
            raise self.failure(exc) from None

    async def aclose(self) -> None:
        await self._client.aclose()


class AiohttpClient(StreamClient):
    name = "aiohttp"

    def __init__(
        self,
        headers: dict[str, str],
        *,
        connections: int,
        timeout: float,
        unix_socket: str | None = None,
    ) -> None:
        import aiohttp

        super().__init__(headers, connections=connections, timeout=timeout, unix_socket=unix_socket)
        self._aiohttp = aiohttp
        connector = (
            aiohttp.UnixConnector(path=unix_socket, limit=connections)
            if unix_socket is not None
            else aiohttp.TCPConnector(limit=connections)
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            # A limit on the whole request, as vLLM's and SGLang's bench clients set it: a limit
            # on each read re-arms a timer for every chunk, which cost about a tenth of the
            # client's time per token.
            timeout=aiohttp.ClientTimeout(total=timeout, sock_connect=min(timeout, 30.0)),
        )

    async def lines(self, url: str, body: dict[str, Any]) -> AsyncGenerator[list[str], None]:
        splitter = LineSplitter()
        try:
            async with self._session.post(url, json=body, headers=self.headers) as resp:
                if resp.status >= 400:
                    text = (await resp.read()).decode(errors="replace")[:200]
                    raise RequestFailed(f"HTTP {resp.status}: {text}".strip())
                # Everything buffered so far, in one call.
                async for data in resp.content.iter_any():
                    if batch := splitter.feed(data):
                        yield batch
                if batch := splitter.close():
                    yield batch
        except (self._aiohttp.ClientError, TimeoutError) as exc:
            raise self.failure(exc) from None

    async def aclose(self) -> None:
        await self._session.close()


CLIENTS: dict[str, type[StreamClient]] = {"aiohttp": AiohttpClient, "httpx": HttpxClient}


def client_class(name: str) -> type[StreamClient]:
    if name not in CLIENTS:
        raise InputError(f"unknown load client {name!r} (known: {', '.join(CLIENTS)})")
    return CLIENTS[name]
