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

HTTP over SSH: a GPU box often opens its SSH port and nothing else, and an engine may listen
only on the box's own loopback. The command's session registers here (`Tunnels`) the origins
of the engines and router of every host whose HTTP may go through its SSH connection, with a
way to open a channel of that connection to a host and port as the box dials them. Every
client made here sends a registered origin's requests through such channels (httpx mounts,
whose network backend consults the route on each connect) and every other origin as before,
environment proxies included. A route says which path its requests took (`reach`,
`http_path`), so what was measured through a tunnel is recorded as such.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shutil
import socket
import ssl
import tempfile
import threading
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import anyio
import anyio.to_thread
import httpcore
import httpx

from kdctl.errors import InputError, KdctlError

# Below uvicorn's default 5 s, with room for a loaded machine's late timers.
KEEPALIVE_EXPIRY_S = 2.0

# How long `auto` gives a direct connect before trying the tunnel: a LAN answers a SYN in
# milliseconds, and a firewall that drops it would otherwise cost a request's whole timeout.
DIRECT_TRY_S = 3.0

# The longest a connection of the tunnel's socket waits for its channel to open.
_OPEN_S = 30.0

# One read from either end of a carried connection.
_CHUNK = 65536


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


_SSL_CONTEXTS: dict[tuple[Any, ...], ssl.SSLContext] = {}


def ssl_context(verify: ssl.SSLContext | str | bool = True) -> ssl.SSLContext:
    """One SSL context per `verify` setting (and CA variables) for the whole process. httpx
    builds one in every transport it makes, plain-HTTP ones included, reading the CA bundle
    each time (24 ms of CPU here): a status command makes several clients, a gate more."""
    if isinstance(verify, ssl.SSLContext):
        return verify
    key = (verify, os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
    ctx = _SSL_CONTEXTS.get(key)
    if ctx is None:
        ctx = _SSL_CONTEXTS[key] = httpx.create_ssl_context(verify=verify)
    return ctx


def http_client(*, resend: bool = True, **kwargs: Any) -> httpx.Client:
    """An httpx.Client (its arguments as httpx takes them, proxies from the environment
    included) keeping idle connections below the engines' keep-alive, and sending the origins
    registered for SSH through their host's connection; with `resend`, a request dropped
    unanswered is sent once more."""
    cls = _Resending if resend else httpx.Client
    limits = _limits(None)
    kwargs["verify"] = verify = ssl_context(kwargs.get("verify", True))
    if "transport" not in kwargs:
        mounts = {p: _SyncRouteTransport(r, limits, verify) for p, r in _mountable()}
        kwargs["mounts"] = {**mounts, **kwargs.get("mounts", {})}
    return cls(limits=limits, **kwargs)


def async_http_client(*, connections: int, **kwargs: Any) -> httpx.AsyncClient:
    """The load generator's client: idle connections below the engines' keep-alive, no
    resend, so that a run counts every drop a client would meet, and the origins registered
    for SSH through their host's connection."""
    limits = _limits(connections)
    kwargs["verify"] = verify = ssl_context(kwargs.get("verify", True))
    if "transport" not in kwargs:
        mounts = {p: _AsyncRouteTransport(r, limits, verify) for p, r in _mountable()}
        kwargs["mounts"] = {**mounts, **kwargs.get("mounts", {})}
    return httpx.AsyncClient(limits=limits, **kwargs)


# --- HTTP over SSH ------------------------------------------------------------------------


class TcpChannel(Protocol):
    """A connection to one TCP endpoint carried by another connection (an SSH channel): the
    calls kdctl's HTTP makes on it, a socket's and a paramiko Channel's.

    Never its fileno(): paramiko makes a pipe for it, which Channel.close() closes while the
    transport's thread may still write to it as data arrives; the EPIPE that write then meets
    ends the whole SSH connection, every other channel with it (seen under load: a few runs
    in ten). Readiness is asked with recv_ready() and the end flags instead."""

    @property
    def closed(self) -> bool: ...

    @property
    def eof_received(self) -> int: ...

    def settimeout(self, timeout: float | None) -> None: ...

    def recv(self, nbytes: int) -> bytes: ...

    def recv_ready(self) -> bool: ...

    def sendall(self, s: bytes) -> None: ...

    def close(self) -> None: ...


# (host, port, timeout) -> a channel to host:port as the far host dials it. Raises KdctlError
# where the channel itself cannot be had (the SSH connection, forwarding refused), OSError
# (ConnectionRefusedError, TimeoutError) where the far host tried and its connect failed.
ChannelOpener = Callable[[str, int, float], TcpChannel]

HttpMode = Literal["auto", "ssh"]
Way = Literal["direct", "ssh"]
Origin = tuple[str, str, int]


@dataclass(frozen=True)
class Reach:
    """How requests to one URL travel now."""

    # "direct" or "ssh"; None while `auto` has not connected yet, or no path worked.
    path: Way | None
    # The inventory host whose SSH connection carries them.
    via: str
    # Why the tunnel, where it is used ("its URL names the box's own loopback"; "direct
    # connect refused"): what a reader is told beside what answered.
    why: str | None = None
    # What the far host said when it tried the URL itself and could not connect: the engine's
    # own absence, seen from its box, not a path that failed.
    box_said: str | None = None
    # Why the tunnel could not be opened, the last time it was tried.
    tunnel_error: str | None = None

    @property
    def note(self) -> str | None:
        """What status and serving output say of a tunnelled path; why, where it was a
        fallback from a direct connect that failed (the surprise a reader must be told)."""
        if self.path != "ssh":
            return None
        fallback = self.why is not None and self.why.startswith(("direct connect", "no direct"))
        return f"reached through SSH to {self.via}" + (f": {self.why}" if fallback else "")

    @property
    def http_path(self) -> str | None:
        """What a measurement records of its path: "direct" or "ssh:HOST"."""
        if self.path is None:
            return None
        return "direct" if self.path == "direct" else f"ssh:{self.via}"


def origin_of(url: str) -> Origin:
    u = httpx.URL(url)
    return u.scheme, u.host.lower(), u.port or (443 if u.scheme == "https" else 80)


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost" or host.lower().endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _why_not(exc: BaseException) -> str:
    """A failed direct connect in a reader's words."""
    text = str(exc).lower()
    if isinstance(exc, httpcore.ConnectTimeout | TimeoutError):
        return "direct connect timed out"
    if "refused" in text:
        return "direct connect refused"
    if "no route" in text or "unreachable" in text:
        return "no direct route"
    return f"direct connect failed ({exc})"


class _Route:
    """One origin's way through one host's SSH connection, and what happened on it."""

    def __init__(
        self,
        origin: Origin,
        *,
        via: str,
        mode: HttpMode,
        ssh_address: str | None,
        opener: ChannelOpener,
    ) -> None:
        self.origin = origin
        self.via = via
        self.opener = opener
        self.mode = mode
        self.path: Way | None = None
        self.why: str | None = None
        self.box_said: str | None = None
        self.tunnel_error: str | None = None
        # Why the last direct connect under `auto` failed, before any path worked.
        self.direct_failed: str | None = None
        # Why the last channel that could not be had was not: a client of the forwarder sees
        # only its connection close.
        self.last_failure: str | None = None
        self._lock = threading.Lock()
        self._forwarder: _Forwarder | None = None
        host = origin[1]
        if mode == "ssh":
            self.path, self.why = "ssh", None
        elif is_loopback(host) and not is_loopback(ssh_address or ""):
            # 127.0.0.1 in the inventory of a remote box is that box's loopback: dialled from
            # here it would reach this machine's own.
            self.path, self.why = "ssh", "its URL names the box's own loopback"

    def reach(self) -> Reach:
        return Reach(self.path, self.via, self.why, self.box_said, self.tunnel_error)

    def _decided(self, path: Way, why: str | None = None) -> None:
        with self._lock:
            if self.path is None:
                self.path, self.why = path, why

    def limit(self, timeout: float | None) -> float:
        return DIRECT_TRY_S if timeout is None else min(timeout, DIRECT_TRY_S)

    def went_direct(self) -> None:
        self._decided("direct")

    def channel(self, timeout: float | None) -> TcpChannel:
        """A channel to the origin through the host's connection, as an httpcore error where
        it cannot be had (with the direct failure that sent it here, if any)."""
        _, host, port = self.origin
        direct_failed = self.direct_failed if self.path is None else None
        lead = f"{direct_failed}; " if direct_failed else ""
        if self.mode == "auto" and self.path is None and self.tunnel_error is not None:
            # Tried once this command and no channel came: each retry would cost the SSH
            # connect's own timeout again, for the same answer.
            raise httpcore.ConnectError(f"{lead}through SSH to {self.via}: {self.tunnel_error}")
        try:
            chan = self.opener(host, port, _OPEN_S if timeout is None else timeout)
        except KdctlError as exc:
            self.tunnel_error = str(exc)
            self.last_failure = f"through SSH to {self.via}: {exc}"
            raise httpcore.ConnectError(lead + self.last_failure) from None
        except OSError as exc:
            # The box tried and nobody answers there: the engine's own absence.
            self.box_said = str(exc)
            self.tunnel_error = None
            self.last_failure = f"through SSH to {self.via}: {exc}"
            raise httpcore.ConnectError(lead + self.last_failure) from None
        self.box_said = self.tunnel_error = None
        self._decided("ssh", direct_failed)
        return chan

    def socket_path(self, timeout: float | None) -> str | None:
        """For clients that need a socket of their own (aiohttp, TLS): the Unix socket whose
        connections are carried to the origin, or None where requests go directly."""
        if self.path == "direct":
            return None
        if self.path is None:
            why = direct_failure(_url(self.origin), self.limit(timeout))
            if why is None:
                self.went_direct()
                return None
            self.direct_failed = why
        with self._lock:
            if self._forwarder is None:
                self._forwarder = _Forwarder(self, min(timeout or _OPEN_S, _OPEN_S))
            return self._forwarder.path

    def close(self) -> None:
        with self._lock:
            forwarder, self._forwarder = self._forwarder, None
        if forwarder is not None:
            forwarder.close()


_routes: dict[Origin, list[_Route]] = {}
_routes_lock = threading.Lock()


def _route(url: str) -> _Route | None:
    try:
        origin = origin_of(url)
    except (httpx.InvalidURL, TypeError):
        return None
    with _routes_lock:
        stack = _routes.get(origin)
        return stack[-1] if stack else None


def _url(origin: Origin) -> str:
    scheme, host, port = origin
    shown = f"[{host}]" if ":" in host else host
    return f"{scheme}://{shown}:{port}"


def _pattern(origin: Origin) -> str:
    scheme, host, port = origin
    shown = f"[{host}]" if ":" in host else host
    default = 443 if scheme == "https" else 80
    return f"{scheme}://{shown}" + ("" if port == default else f":{port}")


def _env_proxied(origin: Origin) -> bool:
    """Whether the environment sends this origin through a proxy (as httpx reads it): there
    the user chose the path, and `auto` leaves it to them."""
    scheme, host, _ = origin
    proxies = urllib.request.getproxies_environment()
    if not (proxies.get(scheme) or proxies.get("all")):
        return False
    return not urllib.request.proxy_bypass(host)


def _mountable() -> list[tuple[str, _Route]]:
    with _routes_lock:
        routes = [stack[-1] for stack in _routes.values() if stack]
    return [
        (_pattern(r.origin), r)
        for r in routes
        if r.path == "ssh" or r.mode == "ssh" or not _env_proxied(r.origin)
    ]


def reach(url: str) -> Reach | None:
    """How requests to `url` travel now; None where it is not registered for SSH (direct)."""
    route = _route(url)
    return route.reach() if route is not None else None


def http_path(url: str | None) -> str | None:
    """What a measurement of `url` records of its path: "direct", "ssh:HOST", or None where
    there is no URL or `auto` found no working path yet."""
    if url is None:
        return None
    found = reach(url)
    return "direct" if found is None else found.http_path


def tunnel_socket(url: str, timeout: float | None = None) -> str | None:
    """The Unix socket (in a folder only this user opens) carrying connections to `url`'s
    origin through SSH, for a client that takes no network backend (aiohttp); None where its
    requests go directly. Under `auto` this decides the path first."""
    route = _route(url)
    return None if route is None else route.socket_path(timeout)


def tunnel_failure(url: str) -> str | None:
    """Why the last channel to `url`'s origin could not be had this command, if one could
    not: what a client of the tunnel's socket saw only as its connection closing."""
    route = _route(url)
    return None if route is None else route.last_failure


def direct_failure(url: str, timeout: float = DIRECT_TRY_S) -> str | None:
    """Why a plain TCP connect from here to `url`'s origin fails ("direct connect refused"),
    or None where it connects: an engine that does not answer its health may still be one
    that is reachable and failing."""
    _, host, port = origin_of(url)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        return _why_not(exc)
    return None


class Tunnels:
    """The origins one command sends through SSH, registered while it runs: the session makes
    one and closes it with its connections."""

    def __init__(self) -> None:
        self._mine: list[_Route] = []
        self._claimed: dict[Origin, str] = {}

    def claim(self, url: str, host: str) -> None:
        """`url` names a place on `host` that is reached directly: no other host's tunnel may
        take the same origin, since one URL cannot name two places."""
        self._claimed.setdefault(origin_of(url), host)

    def add(
        self,
        url: str,
        *,
        via: str,
        mode: HttpMode,
        ssh_address: str | None,
        opener: ChannelOpener,
    ) -> None:
        """Send `url`'s origin through `via`'s SSH connection, under `mode`; InputError where
        it must go there and another host's URL is the same origin."""
        origin = origin_of(url)
        route = _Route(origin, via=via, mode=mode, ssh_address=ssh_address, opener=opener)
        other = self._claimed.setdefault(origin, via)
        if other != via:
            if route.path is None:
                # `auto` that would only fall back: the origin stays direct, as it always was.
                return
            raise InputError(
                f"{_pattern(origin)} names a place on {other} and on {via}, whose HTTP goes "
                "through SSH (where a loopback URL is the box's own): give one of them an "
                "address of its host, or set http: direct on the host reached directly"
            )
        if any(r.origin == origin for r in self._mine):
            return
        self._mine.append(route)
        with _routes_lock:
            _routes.setdefault(origin, []).append(route)

    def close(self) -> None:
        with _routes_lock:
            for route in self._mine:
                stack = _routes.get(route.origin, [])
                if route in stack:
                    stack.remove(route)
                if not stack:
                    _routes.pop(route.origin, None)
        for route in self._mine:
            route.close()
        self._mine = []


# --- the pieces httpx and httpcore take -------------------------------------------------


class _ChannelStream(httpcore.NetworkStream):
    """httpcore's stream over a channel: what its socket stream does on a socket."""

    def __init__(self, chan: TcpChannel) -> None:
        self._chan = chan

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        try:
            self._chan.settimeout(timeout)
            return self._chan.recv(max_bytes)
        except TimeoutError:
            raise httpcore.ReadTimeout("no answer through the SSH channel in time") from None
        except (OSError, EOFError) as exc:
            raise httpcore.ReadError(str(exc) or type(exc).__name__) from None

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        try:
            self._chan.settimeout(timeout)
            self._chan.sendall(buffer)
        except TimeoutError:
            raise httpcore.WriteTimeout("the SSH channel took no more in time") from None
        except (OSError, EOFError) as exc:
            raise httpcore.WriteError(str(exc) or type(exc).__name__) from None

    def close(self) -> None:
        self._chan.close()

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable":
            # An idle pooled connection that is readable was closed by the server.
            chan = self._chan
            return chan.recv_ready() or chan.eof_received or chan.closed
        return None


class _SyncRouteBackend(httpcore.NetworkBackend):
    def __init__(self, route: _Route) -> None:
        self._route = route
        self._plain = httpcore.SyncBackend()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        route = self._route
        if route.path == "direct":
            return self._plain.connect_tcp(host, port, timeout, local_address, socket_options)
        if route.path is None:
            try:
                stream = self._plain.connect_tcp(
                    host, port, route.limit(timeout), local_address, socket_options
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                route.direct_failed = _why_not(exc)
            else:
                route.went_direct()
                return stream
        if route.origin[0] == "https":
            # TLS wants a real socket: the forwarder's, whose far end is the channel.
            path = route.socket_path(timeout)
            if path is None:
                return self._plain.connect_tcp(host, port, timeout, local_address, socket_options)
            return self._plain.connect_unix_socket(path, timeout)
        return _ChannelStream(route.channel(timeout))

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.NetworkStream:
        return self._plain.connect_unix_socket(path, timeout, socket_options)

    def sleep(self, seconds: float) -> None:
        self._plain.sleep(seconds)


class _AsyncChannelStream(httpcore.AsyncNetworkStream):
    """httpcore's async stream over a channel: each read and write in a thread (paramiko's
    calls block; its descriptor is not to be used, see TcpChannel). A stream has a limiter
    of its own, so a read waiting for its next token never holds a worker another stream's
    read needs, as anyio's shared 40 would at more streams than that. At 64 streams from a
    server that streams as fast as the socket takes it (benchmarks/tunnel_cost.py --server
    fast --client httpx): 0.96 +/- 0.07 of the direct path's rate, about 35,000 tok/s; in
    one interleaved comparison, 33,500 this way against 24,700 through the forwarder's
    socket."""

    def __init__(self, chan: TcpChannel) -> None:
        self._chan = chan
        self._sync = _ChannelStream(chan)
        self._limiter = anyio.CapacityLimiter(1)

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return await anyio.to_thread.run_sync(
            self._sync.read, max_bytes, timeout, limiter=self._limiter
        )

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if buffer:
            await anyio.to_thread.run_sync(self._sync.write, buffer, timeout, limiter=self._limiter)

    async def aclose(self) -> None:
        self._chan.close()

    def get_extra_info(self, info: str) -> Any:
        return self._sync.get_extra_info(info)


class _AsyncRouteBackend(httpcore.AsyncNetworkBackend):
    """The async clients' connects, as the sync ones: a tunnelled origin over a channel (TLS
    through the route's forwarder, which gives it a socket)."""

    def __init__(self, route: _Route) -> None:
        self._route = route
        self._plain = httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        route = self._route
        if route.path == "direct":
            return await self._plain.connect_tcp(host, port, timeout, local_address, socket_options)
        if route.path is None:
            try:
                stream = await self._plain.connect_tcp(
                    host, port, route.limit(timeout), local_address, socket_options
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                route.direct_failed = _why_not(exc)
            else:
                route.went_direct()
                return stream
        if route.origin[0] == "https":
            path = await anyio.to_thread.run_sync(route.socket_path, timeout)
            if path is None:
                return await self._plain.connect_tcp(
                    host, port, timeout, local_address, socket_options
                )
            return await self._plain.connect_unix_socket(path, timeout)
        # Opening waits for the box's answer: off the event loop.
        chan = await anyio.to_thread.run_sync(route.channel, timeout)
        return _AsyncChannelStream(chan)

    async def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.AsyncNetworkStream:
        return await self._plain.connect_unix_socket(path, timeout, socket_options)

    async def sleep(self, seconds: float) -> None:
        await self._plain.sleep(seconds)


def _pool_settings(limits: httpx.Limits, verify: Any) -> dict[str, Any]:
    return {
        "ssl_context": ssl_context(verify),
        "max_connections": limits.max_connections,
        "max_keepalive_connections": limits.max_keepalive_connections,
        "keepalive_expiry": limits.keepalive_expiry,
    }


class _SyncRouteTransport(httpx.HTTPTransport):
    """httpx's own transport (its request mapping and error types) over a pool whose connects
    take the route: httpx takes no network backend, its pool does."""

    def __init__(self, route: _Route, limits: httpx.Limits, verify: Any) -> None:
        super().__init__(limits=limits, verify=verify)
        self._pool = httpcore.ConnectionPool(
            **_pool_settings(limits, verify), network_backend=_SyncRouteBackend(route)
        )


class _AsyncRouteTransport(httpx.AsyncHTTPTransport):
    def __init__(self, route: _Route, limits: httpx.Limits, verify: Any) -> None:
        super().__init__(limits=limits, verify=verify)
        self._pool = httpcore.AsyncConnectionPool(
            **_pool_settings(limits, verify), network_backend=_AsyncRouteBackend(route)
        )


class _Forwarder:
    """A Unix socket whose every connection is carried to the route's origin by a channel of
    its own: for clients that take no network backend (aiohttp) or need a real socket (TLS).
    It lives in a folder made for it (mode 0700), so no other user of this machine reaches the
    box through the operator's SSH login, as a TCP port on loopback would let them."""

    def __init__(self, route: _Route, timeout: float | None) -> None:
        self._route = route
        self._timeout = timeout
        self._dir = tempfile.mkdtemp(prefix="kdctl-ssh-")
        self.path = os.path.join(self._dir, "http.sock")
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(self.path)
        self._server.listen(512)
        self._live: set[socket.socket | TcpChannel] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._serve, name=f"kdctl-ssh-{route.via}", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._carry, args=(conn,), daemon=True).start()

    def _carry(self, conn: socket.socket) -> None:
        with self._lock:
            self._live.add(conn)
        try:
            # The client sees the connection close unanswered; why is on the route, where
            # the load generator reads it.
            chan = self._route.channel(self._timeout)
        except httpcore.ConnectError:
            self._end(conn)
            return
        with self._lock:
            self._live.add(chan)
        # One thread each way, blocking: paramiko's calls block, and its descriptor is not
        # to be used (see TcpChannel).
        threading.Thread(target=self._to_box, args=(conn, chan), daemon=True).start()
        try:
            while data := chan.recv(_CHUNK):
                conn.sendall(data)
        except (OSError, EOFError):
            pass  # either end gone: both are ended below
        finally:
            self._end(conn, chan)

    def _to_box(self, conn: socket.socket, chan: TcpChannel) -> None:
        try:
            while data := conn.recv(_CHUNK):
                if chan.eof_received or chan.closed:
                    # The box's end finished this connection: what the client sends now
                    # would follow it, for a channel sshd may already have let go of.
                    break
                chan.sendall(data)
        except (OSError, EOFError):
            pass  # either end gone: both are ended below
        finally:
            self._end(conn, chan)

    def _end(self, conn: socket.socket, chan: TcpChannel | None = None) -> None:
        """Both ends closed, once, whichever direction ends first: an HTTP exchange has no
        half-closed state worth keeping. shutdown() wakes the other direction's recv()."""
        with self._lock:
            self._live.discard(conn)
            if chan is not None:
                self._live.discard(chan)
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)
        conn.close()
        if chan is not None:
            with contextlib.suppress(OSError, EOFError):
                chan.close()

    def close(self) -> None:
        # shutdown() wakes the accept() of the serving thread on Linux; close() alone does not.
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)
        self._server.close()
        with self._lock:
            live, self._live = list(self._live), set()
        for end in live:
            with contextlib.suppress(OSError, EOFError):
                end.close()
        shutil.rmtree(self._dir, ignore_errors=True)
