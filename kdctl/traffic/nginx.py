"""The nginx driver: a file kdctl owns (upstream with weights, a map naming the backend that
answered, the front server with stream-safe proxy settings), checked with `nginx -t`, written
whole and swapped in by rename, then applied by a graceful reload, on the router's host."""

from __future__ import annotations

import hashlib
import json
import re
import socket
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import ClassVar

import httpx
from jinja2 import Environment, PackageLoader, StrictUndefined

from kdctl._httpclient import http_client
from kdctl.errors import InputError, KdctlError
from kdctl.inventory import LoadedInventory, NginxRouterSpec, RouterSpec
from kdctl.traffic._router import (
    BACKEND_HEADER,
    Capabilities,
    Router,
    RouterError,
    RouterState,
    check_weights,
)
from kdctl.transports import Transport

# What may reach the file: every value is checked against these before rendering, so no
# inventory value can close a directive and open another.
_ADDRESS = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):[0-9]{1,5}$")
# A backend's name, a pool's replica's (POOL@HOST) included.
_NAME = re.compile(r"^[A-Za-z0-9_.-]+(@[A-Za-z0-9_.-]+)?$")
_WEIGHTS_LINE = re.compile(r"^# kdctl-weights: (\{.*\})$", re.MULTILINE)
_SERVER = re.compile(r"^\s*server (\S+) weight=(\d+);$", re.MULTILINE)
_DRAINING = re.compile(r"^\s*return 503 ", re.MULTILINE)
_PID_DIRECTIVE = re.compile(r"^\s*pid\s+([^;\s]+)\s*;", re.MULTILINE)
# The title nginx gives a worker once it has taken the reload's signal: it accepts nothing new.
_SHUTTING_DOWN = "worker process is shutting down"
# The file kdctl writes names every upstream address nginx tried, the answering one last
# (beside BACKEND_HEADER, the name its map gives a single address).
UPSTREAM_HEADER = "X-Kdctl-Upstream"


def _env() -> Environment:
    # Not HTML: values are validated above instead of escaped (nginx has no escaping).
    return Environment(  # noqa: S701
        loader=PackageLoader("kdctl.templates", ""),
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )


class NginxRouter(Router):
    kind = "nginx"
    writes_then_applies = True
    capabilities: ClassVar[Capabilities] = Capabilities(
        weights=True, blue_green=True, read_back=True, drain=True
    )
    spec: NginxRouterSpec

    def __init__(self, inv: LoadedInventory, spec: RouterSpec, transport: Transport) -> None:
        if not isinstance(spec, NginxRouterSpec):
            raise InputError(f"router kind {spec.kind!r}: the nginx driver takes nginx's spec")
        super().__init__(inv, spec, transport)

    def _nginx(self, *args: str) -> list[str]:
        argv = [self.spec.nginx]
        if self.spec.prefix:
            argv += ["-p", self.spec.prefix]
        if self.spec.conf:
            argv += ["-c", self.spec.conf]
        return [*argv, *args]

    def _address(self, name: str) -> str:
        url = self.inv.backends[name].url
        if url is None:
            raise InputError(f"backend {name} has no url: nginx cannot send traffic to it")
        parsed = httpx.URL(url)
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        host = parsed.host if ":" not in parsed.host else f"[{parsed.host}]"
        address = f"{host}:{port}"
        if parsed.scheme != "http" or parsed.path not in ("", "/"):
            raise InputError(f"backend {name}: nginx fronts plain http://HOST:PORT engines ({url})")
        if not _ADDRESS.match(address) or not _NAME.match(name):
            raise InputError(f"backend {name}: {address!r} cannot go into an nginx config")
        return address

    def render(self, weights: dict[str, int], *, draining: bool = False) -> str:
        check_weights(self.inv, weights)
        if not _ADDRESS.match(self.spec.listen):
            raise InputError(f"router.listen: {self.spec.listen!r} cannot go into an nginx config")
        servers = [
            {"name": name, "address": self._address(name), "weight": w}
            for name, w in sorted(weights.items())
            if w > 0
        ]
        return (
            _env()
            .get_template("nginx-kdctl.conf.j2")
            .render(
                weights_json=json.dumps({k: v for k, v in sorted(weights.items()) if v > 0}),
                servers=servers,
                listen=self.spec.listen,
                keepalive=self.spec.keepalive,
                draining=draining,
                retry_after=30,
            )
        )

    def describe_source(self, state: RouterState) -> str:
        if state.applied is None:
            # kdctl has not reloaded nginx with a file it wrote: nothing records what it loaded.
            return (
                f"{state.source} (the configuration file: intended weights; whether nginx "
                "loaded it is not known)"
            )
        return f"{state.source} (the configuration file: intended weights)"

    def answered_by(
        self, resp: httpx.Response, serving: Sequence[str], unknown_workers: Sequence[str] = ()
    ) -> str | None:
        """From the addresses nginx tried, the answering one last; else the name its map
        gave a single address."""
        tried = resp.headers.get(UPSTREAM_HEADER, "")
        # "a:1, b:2 : c:3": the last address is the one whose answer came back.
        addr = tried.replace(" : ", ", ").split(",")[-1].strip() if tried else ""
        if addr:
            return backend_at(self.inv, addr)
        return resp.headers.get(BACKEND_HEADER) or None

    @property
    def _applied_path(self) -> str:
        # The checksum of the file as nginx last validated and reloaded it: nginx keeps no
        # record of what its running master loaded that can be read back.
        return self.spec.include + ".applied"

    def read(self) -> RouterState:
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp) / "kdctl.conf"
            try:
                self.transport.get(self.spec.include, local)
            except KdctlError as exc:
                # The transport's message names the host, the path and why.
                raise RouterError(f"nginx: {exc}") from None
            text = local.read_text()
            record = Path(tmp) / "applied"
            try:
                self.transport.get(self._applied_path, record)
                applied: bool | None = record.read_text().strip() == _digest(text)
            except KdctlError:
                applied = None
        state = parse_config(text, source=f"{self.spec.host}:{self.spec.include}")
        return state.model_copy(update={"applied": applied})

    def _check_and_reload(self) -> tuple[int, set[int]] | None:
        """nginx's master and the workers of the configuration the reload replaced (None where
        no master is found)."""
        test = self.transport.run(self._nginx("-t"), timeout=30)
        if not test.ok:
            raise RouterError(
                f"nginx -t refused the new configuration: {test.stderr.strip()[-600:]}"
            )
        master = self._master_pid()
        previous = set(self._workers(master)) if master else set()
        reload = self.transport.run(self._nginx("-s", "reload"), timeout=30)
        if not reload.ok:
            raise RouterError(f"nginx -s reload failed: {reload.stderr.strip()[-600:]}")
        if not master:
            return None
        self._await_previous_workers(master, previous)
        return master, previous

    def _await_previous_workers(self, master: int, previous: set[int]) -> None:
        """Until each worker of the previous configuration has taken the reload's signal (or
        exited): before that, on a busy host, it still accepts a client's new connection and
        sends it where the old file said, to an engine about to stop. Answers through the front
        cannot show this: they may all reach the new workers while an old one lingers."""
        deadline = time.monotonic() + 10
        while True:
            lingering = [
                pid
                for pid, args in self._workers(master).items()
                if pid in previous and _SHUTTING_DOWN not in args
            ]
            if not lingering:
                return
            if time.monotonic() > deadline:
                raise RouterError(
                    f"nginx on {self.spec.host}: worker(s) {lingering} of the previous "
                    "configuration have not taken the reload after 10s"
                )
            time.sleep(0.02)

    def _master_pid(self) -> int | None:
        """nginx's master, from the pid file its configuration names (`pid`, relative to the
        prefix), else the one it was built with; None where there is none to read."""
        path: str | None = None
        if self.spec.conf:
            conf = self.transport.run(["cat", "--", self.spec.conf], timeout=30)
            m = _PID_DIRECTIVE.search(conf.stdout) if conf.ok else None
            if m:
                path = m.group(1)
        if path is None:
            built = self.transport.run([self.spec.nginx, "-V"], timeout=30)
            m = re.search(r"--pid-path=(\S+)", built.stdout + built.stderr)
            path = m.group(1) if m else None
        if path is None:
            return None
        if not path.startswith("/") and self.spec.prefix:
            path = f"{self.spec.prefix.rstrip('/')}/{path}"
        pid = self.transport.run(["cat", "--", path], timeout=30)
        text = pid.stdout.strip()
        return int(text) if pid.ok and text.isdigit() else None

    def _workers(self, master: int) -> dict[int, str]:
        """The master's children by pid, with their titles."""
        ps = self.transport.run(["ps", "-o", "pid=,args=", "--ppid", str(master)], timeout=30)
        workers = {}
        for line in ps.stdout.splitlines():
            pid, _, args = line.strip().partition(" ")
            if pid.isdigit():
                workers[int(pid)] = args
        return workers

    def _write(
        self, text: str, on_written: Callable[[], None] | None = None
    ) -> tuple[int, set[int]] | None:
        """New file in, `nginx -t`; on refusal the previous file goes back and nginx, never
        reloaded, keeps serving the old one. After the reload, the file's checksum is recorded
        as what nginx runs. The replaced workers, as _check_and_reload gives them."""
        include = self.spec.include
        previous = include + ".prev"
        self.transport.run(["cp", "-p", "--", include, previous], timeout=30)
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp) / "kdctl.conf"
            local.write_text(text)
            self.transport.put(local, include, mode=0o644)
            if on_written is not None:
                on_written()
            try:
                replaced = self._check_and_reload()
            except RouterError:
                self.transport.run(["cp", "-p", "--", previous, include], timeout=30)
                raise
            record = Path(tmp) / "applied"
            record.write_text(_digest(text) + "\n")
            self.transport.put(record, self._applied_path, mode=0o644)
        return replaced

    def apply(
        self, weights: dict[str, int], *, on_written: Callable[[], None] | None = None
    ) -> RouterState:
        self._write(self.render(weights), on_written)
        return self.confirm(weights)

    def drain(self, *, deadline_s: float = 10.0) -> RouterState:
        """Every new request answered 503 with Retry-After. It returns once the front says so
        a few times in a row and the old workers have ended the requests they hold: a reload
        returns before the new workers take connections, and an engine stopped while the old
        ones still take or carry requests turns clients' requests into 502s."""
        current = self.read()
        replaced = self._write(self.render(current.weights, draining=True))
        deadline = time.monotonic() + deadline_s
        with http_client() as client:
            while not all(self._draining(client) for _ in range(3)):
                if time.monotonic() > deadline:
                    raise RouterError(f"nginx front {self.front_url} does not answer as drained")
                time.sleep(0.05)
        if replaced is not None:
            self._await_exited(*replaced, deadline)
        return self.read()

    def _await_exited(self, master: int, previous: set[int], deadline: float) -> None:
        """Until the previous configuration's workers have exited, or the deadline: a worker
        shutting down still finishes the requests it took before the reload, sending them to
        the engine a drain precedes stopping; stopped under them, they end in 502s. Past the
        deadline (a long stream), the drain ends anyway, as a grace period does."""
        while previous & self._workers(master).keys() and time.monotonic() < deadline:
            time.sleep(0.05)

    def _draining(self, client: httpx.Client) -> bool:
        try:
            r = client.get(self.front_url + "/health", timeout=5)
        except httpx.HTTPError:
            return False
        return r.status_code == 503 and "retry-after" in r.headers

    def confirm(self, weights: dict[str, int], *, deadline_s: float = 10.0) -> RouterState:
        """Read the live file back, then probe the front until the new workers answer: a reload
        returns before the new workers take connections. All traffic on one backend, a
        one-token generation through the front too: its health answering is not its serving
        what clients send (a route or a key the front passes and the engine refuses)."""
        state = super().confirm(weights)
        serving = set(state.weights)
        # One backend: every answer must come from it, a few in a row.
        tries = 3 if len(serving) == 1 else 1
        deadline = time.monotonic() + deadline_s
        with http_client() as client:
            while True:
                got = [self.probe(client) for _ in range(tries)]
                if all(g in serving for g in got):
                    break
                if time.monotonic() > deadline:
                    raise RouterError(
                        f"nginx front {self.front_url} still answers from {got}, "
                        f"not only {sorted(serving)}"
                    )
                time.sleep(0.05)
        if len(serving) == 1:
            (target,) = serving
            left = max(deadline - time.monotonic(), 1.0)
            self._generates_through(self.front_url, target, "through the front", left)
        return state


def backend_at(inv: LoadedInventory, address: str) -> str | None:
    """The backend whose URL is this host:port; nginx reports resolved addresses, so a name in
    the inventory is resolved here too."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    for name, spec in inv.backends.items():
        if not spec.url:
            continue
        u = httpx.URL(spec.url)
        their_port = u.port or (443 if u.scheme == "https" else 80)
        if str(their_port) != port:
            continue
        if u.host == host:
            return name
        try:
            resolved = {a[4][0] for a in socket.getaddrinfo(u.host, their_port)}
        except OSError:
            continue
        if host in resolved:
            return name
    return None


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def parse_config(text: str, *, source: str) -> RouterState:
    m = _WEIGHTS_LINE.search(text)
    if m is None:
        raise RouterError(f"{source}: not a file kdctl wrote (no kdctl-weights line)")
    declared = {k: int(v) for k, v in json.loads(m.group(1)).items() if int(v) > 0}
    servers = _SERVER.findall(text)
    if len(servers) != len(declared) or sorted(int(w) for _, w in servers) != sorted(
        declared.values()
    ):
        raise RouterError(f"{source}: its server lines do not match its kdctl-weights line")
    return RouterState(weights=declared, draining=bool(_DRAINING.search(text)), source=source)
