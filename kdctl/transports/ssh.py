"""SSH through paramiko: one connection per host, reused, with host keys always checked."""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import re
import select
import shlex
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import paramiko
from paramiko.common import (
    OPEN_FAILED_ADMINISTRATIVELY_PROHIBITED,
    OPEN_FAILED_CONNECT_FAILED,
)

from kdctl._httpclient import TcpChannel
from kdctl.errors import CommandTimeout, HostKeyError, TransportError
from kdctl.inventory.models import HostSpec
from kdctl.transports._base import CommandResult, Transport

KEEPALIVE_S = 15
# The remote `timeout` ends the command itself; the local deadline is a little later so the
# remote side normally wins and nothing is left running there.
_REMOTE_GRACE_S = 2.0


# paramiko logs a channel the server would not open as an ERROR, which Python's last-resort
# handler prints on kdctl's stderr; kdctl says it itself, in the words of the host's sshd, which
# only that log line holds ("Connection refused"; paramiko's exception says "Connect failed").
_LOG_CHANNEL = "paramiko.transport.kdctl"
_OPEN_FAILED = re.compile(r"open FAILED: (.*): [^:]*$")
# The transport thread that logged it -> what sshd said, read by the thread that asked.
_refusals: weakref.WeakKeyDictionary[threading.Thread, str] = weakref.WeakKeyDictionary()


class _ChannelRefusals(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        said = _OPEN_FAILED.search(record.getMessage())
        if said is None:
            return True
        _refusals[threading.current_thread()] = said.group(1)
        return False


logging.getLogger(_LOG_CHANNEL).addFilter(_ChannelRefusals())


def _marked(known_hosts: Path, marker: str) -> Iterator[tuple[int, list[str]]]:
    """(line number, fields) of the known_hosts lines that begin with `marker`: OpenSSH syntax
    that paramiko's own parser skips."""
    try:
        lines = known_hosts.read_text().splitlines()
    except OSError:
        return
    for no, line in enumerate(lines, 1):
        fields = line.split()
        if fields and fields[0] == marker:
            yield no, fields


def is_revoked(known_hosts: Path, key: paramiko.PKey) -> bool:
    """paramiko skips `@revoked` lines of known_hosts; OpenSSH refuses those keys, and so do we."""
    blob = key.get_base64()
    return any(blob in fields for _, fields in _marked(known_hosts, "@revoked"))


def _glob(pattern: str, hostname: str) -> bool:
    # OpenSSH's globs know `*` and `?` only: the brackets of `[host]:port` are literal.
    regex = re.escape(pattern).replace(r"\*", ".*").replace(r"\?", ".")
    return re.fullmatch(regex, hostname, re.IGNORECASE) is not None


def _matches(patterns: str, hostname: str) -> bool:
    """OpenSSH's known_hosts host field: comma-separated globs, `!` negates, `|1|` is hashed."""
    hit = False
    for pattern in patterns.split(","):
        if pattern.startswith("|1|"):
            salt = pattern.split("|")[2]
            hit = hit or paramiko.HostKeys.hash_host(hostname, salt) == pattern
        elif pattern.startswith("!"):
            if _glob(pattern[1:], hostname):
                return False
        else:
            hit = hit or _glob(pattern, hostname)
    return hit


def cert_authority_line(known_hosts: Path, hostname: str) -> int | None:
    """The line of a `@cert-authority` entry that covers `hostname`, if any."""
    for no, fields in _marked(known_hosts, "@cert-authority"):
        if len(fields) >= 2 and _matches(fields[1], hostname):
            return no
    return None


@dataclass(frozen=True)
class KnownHost:
    """One plain known_hosts line: where it is, its host patterns, its key."""

    line: int
    patterns: str
    key: paramiko.PKey


class _HostKeyPolicy(paramiko.MissingHostKeyPolicy):
    """Refuses unknown keys, or with `accept-new` records them, as OpenSSH's option does.

    A key that differs from the recorded one never reaches this policy: paramiko raises
    BadHostKeyException for it whatever the policy, which is what accept-new means too.
    """

    def __init__(
        self, name: str, spec: HostSpec, known_hosts: Path, entries: list[KnownHost]
    ) -> None:
        self.name = name
        self.spec = spec
        self.known_hosts = known_hosts
        self.entries = entries

    def missing_host_key(
        self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey
    ) -> None:
        fingerprint = f"{key.get_name()} {key.fingerprint}"
        # Every line whose host patterns cover this host, as OpenSSH matches them (globs,
        # negation, hashed names): paramiko's own lookup knows exact names only, so a key
        # under `*` would look unknown and accept-new would record a changed one.
        covering = [e for e in self.entries if _matches(e.patterns, hostname)]
        if any(e.key.get_name() == key.get_name() and e.key == key for e in covering):
            if is_revoked(self.known_hosts, key):
                raise HostKeyError(
                    self.name,
                    f"host key {fingerprint} is marked @revoked in {self.known_hosts}",
                    fingerprint,
                )
            return
        if covering:
            first = covering[0]
            want = f"{first.key.get_name()} {first.key.fingerprint}"
            raise HostKeyError(
                self.name,
                f"HOST KEY CHANGED for {hostname}: it presented {fingerprint}, "
                f"{self.known_hosts}:{first.line} ({first.patterns}) has {want}. Refusing to "
                "connect: this can be an attack; if the host was reinstalled, remove the old "
                "line from known_hosts",
                fingerprint,
            )
        if is_revoked(self.known_hosts, key):
            raise HostKeyError(
                self.name,
                f"host key {fingerprint} is marked @revoked in {self.known_hosts}",
                fingerprint,
            )
        ca_line = cert_authority_line(self.known_hosts, hostname)
        if ca_line is not None:
            # Recording the bare key under accept-new would drop the trust the CA was meant to
            # give; paramiko cannot check host certificates, so the only safe answer is no.
            raise HostKeyError(
                self.name,
                f"{self.known_hosts}:{ca_line} trusts a certificate authority (@cert-authority) "
                f"for {hostname}, and kdctl checks plain host keys only: verify the host's key "
                f"({fingerprint}) and add it to known_hosts as its own line",
                fingerprint,
            )
        if self.spec.host_key_policy != "accept-new":
            raise HostKeyError(
                self.name,
                f"host key of {hostname} is not in {self.known_hosts} ({fingerprint}); "
                "verify it and add it to known_hosts, or set host_key_policy: accept-new",
                fingerprint,
            )
        self.known_hosts.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.known_hosts, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "a") as fh:
            fh.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
        client.get_host_keys().add(hostname, key.get_name(), key)


class SSHTransport(Transport):
    def __init__(self, name: str, spec: HostSpec, *, known_hosts: Path, identity_file: Path | None):
        super().__init__(name)
        if not spec.address:
            raise TransportError(name, "no address to connect to")
        self.spec = spec
        self.known_hosts = known_hosts
        self.identity_file = identity_file
        self._client: paramiko.SSHClient | None = None
        self._pending: socket.socket | None = None
        self._lock = threading.Lock()

    def connect(self) -> None:
        self._connected()

    def _connected(self) -> paramiko.SSHClient:
        with self._lock:
            client = self._client
            transport = client.get_transport() if client else None
            if client is not None and transport is not None and transport.is_active():
                return client
            self._client = self._open()
            return self._client

    def _socket(self, timeout: float) -> socket.socket:
        # Published before connect() so that close() can abandon a host that drops SYNs.
        info = socket.getaddrinfo(self.spec.address, self.spec.port, type=socket.SOCK_STREAM)
        family, kind, proto, _, addr = info[0]
        sock = socket.socket(family, kind, proto)
        self._pending = sock
        sock.settimeout(timeout)
        sock.connect(addr)
        return sock

    def _load_known_hosts(self) -> list[KnownHost]:
        """OpenSSH's file, read line by line: marker lines (`@revoked`, `@cert-authority`) are
        OpenSSH syntax paramiko cannot parse; revoked keys are checked by `is_revoked`. None of
        it goes into paramiko's own table, so every key is judged by the policy's matching."""
        if not self.known_hosts.is_file():
            return []
        try:
            text = self.known_hosts.read_text()
        except OSError as exc:
            raise TransportError(self.name, f"cannot read {self.known_hosts}: {exc}") from None
        entries: list[KnownHost] = []
        for no, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith(("#", "@")):
                continue
            try:
                entry = paramiko.hostkeys.HostKeyEntry.from_line(line, no)
            except (paramiko.SSHException, paramiko.hostkeys.InvalidHostKey, ValueError) as exc:
                raise TransportError(
                    self.name, f"{self.known_hosts}:{no}: unreadable host key line: {exc}"
                ) from None
            if entry is None or entry.key is None:
                continue
            entries.append(KnownHost(no, ",".join(entry.hostnames), entry.key))
        return entries

    def _open(self) -> paramiko.SSHClient:
        spec = self.spec
        assert spec.address is not None
        client = paramiko.SSHClient()
        client.set_log_channel(_LOG_CHANNEL)
        client.set_missing_host_key_policy(
            _HostKeyPolicy(self.name, spec, self.known_hosts, self._load_known_hosts())
        )
        timeout = spec.connect_timeout_s
        try:
            sock = self._pending = socket.create_connection(
                (spec.address, spec.port), timeout=timeout
            )
            # Without it, Nagle and delayed ACKs add 40 ms to every small request.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            client.connect(
                spec.address,
                port=spec.port,
                username=spec.user,
                key_filename=str(self.identity_file) if self.identity_file else None,
                allow_agent=self.identity_file is None,
                look_for_keys=self.identity_file is None,
                timeout=timeout,
                banner_timeout=timeout,
                auth_timeout=timeout,
                channel_timeout=timeout,
                sock=sock,
            )
        except HostKeyError:
            client.close()
            raise
        except paramiko.BadHostKeyException as exc:
            client.close()
            got = f"{exc.key.get_name()} {exc.key.fingerprint}"
            want = f"{exc.expected_key.get_name()} {exc.expected_key.fingerprint}"
            raise HostKeyError(
                self.name,
                f"HOST KEY CHANGED for {exc.hostname}: it presented {got}, {self.known_hosts} "
                f"has {want}. Refusing to connect: this can be an attack; if the host was "
                "reinstalled, remove the old line from known_hosts",
                got,
            ) from None
        except paramiko.AuthenticationException as exc:
            client.close()
            raise TransportError(
                self.name, f"authentication failed for {spec.target}: {exc}"
            ) from None
        except (OSError, paramiko.SSHException, EOFError) as exc:
            client.close()
            reason = str(exc) or type(exc).__name__
            raise TransportError(self.name, f"cannot connect to {spec.target}: {reason}") from None
        finally:
            self._pending = None
        transport = client.get_transport()
        if transport is not None:
            key = transport.get_remote_server_key()
            if is_revoked(self.known_hosts, key):
                client.close()
                fp = f"{key.get_name()} {key.fingerprint}"
                raise HostKeyError(
                    self.name, f"host key {fp} is marked @revoked in {self.known_hosts}", fp
                )
            transport.set_keepalive(KEEPALIVE_S)
        return client

    def run(
        self, argv: Sequence[str], *, timeout: float = 30.0, stdin: bytes | None = None
    ) -> CommandResult:
        args = tuple(argv)
        if not args:
            raise TransportError(self.name, "empty command")
        client = self._connected()
        # The remote side is a shell: every argument is quoted, so it arrives as one literal.
        # stdin never ends with an EOF from here: paramiko sends a channel's EOF outside its
        # lock, so it can follow the CLOSE of a command that already exited, and sshd then
        # drops the whole connection with every other thread's command on it. The remote end
        # reads exactly the bytes sent, or nothing.
        if stdin is None:
            command = f"timeout -k 1 {timeout:g} {shlex.join(args)} </dev/null"
        else:
            feed = shlex.quote(f'head -c {len(stdin)} | "$@"')
            command = f"timeout -k 1 {timeout:g} sh -c {feed} sh {shlex.join(args)}"
        started = time.monotonic()
        deadline = started + timeout + _REMOTE_GRACE_S
        try:
            transport = client.get_transport()
            if transport is None:
                raise TransportError(self.name, "connection closed")
            chan = transport.open_session(timeout=self.spec.connect_timeout_s)
        except (paramiko.SSHException, OSError, EOFError) as exc:
            with self._lock:
                if self._client is client:
                    client.close()
                    self._client = None
            raise TransportError(self.name, f"cannot open a session: {exc}") from None
        out, err = bytearray(), bytearray()
        try:
            chan.exec_command(command)
            if stdin:
                chan.sendall(stdin)
            while True:
                while chan.recv_ready():
                    out += chan.recv(65536)
                while chan.recv_stderr_ready():
                    err += chan.recv_stderr(65536)
                # sshd sends exit-status when the child exits, possibly before the rest of its
                # output has left the pipe; only EOF says that all of it has arrived.
                if (
                    chan.exit_status_ready()
                    and chan.eof_received
                    and not chan.recv_ready()
                    and not chan.recv_stderr_ready()
                ):
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CommandTimeout(self.name, args, timeout)
                select.select([chan], [], [], min(remaining, 1.0))
            code = chan.recv_exit_status()
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise TransportError(self.name, f"{args[0]} failed in transit: {exc}") from None
        finally:
            chan.close()
        # 124 is what the remote `timeout` returns; a command may return it too, so it counts
        # as a timeout only when the time was indeed used up.
        if code == 124 and time.monotonic() - started >= timeout:
            raise CommandTimeout(self.name, args, timeout)
        return CommandResult(
            self.name,
            args,
            code,
            out.decode(errors="replace"),
            err.decode(errors="replace"),
            time.monotonic() - started,
        )

    def open_channel(self, host: str, port: int, *, timeout: float) -> TcpChannel:
        """A direct-tcpip channel of this host's one connection to host:port, which the host's
        sshd dials (127.0.0.1 is the host's own loopback): many at once share the connection."""
        client = self._connected()
        transport = client.get_transport()
        if transport is None or not transport.is_active():
            raise TransportError(self.name, "connection closed")
        try:
            return transport.open_channel(
                "direct-tcpip", (host, port), ("127.0.0.1", 0), timeout=timeout
            )
        except paramiko.ChannelException as exc:
            said = _refusals.pop(transport, None) or exc.text
            if exc.code == OPEN_FAILED_CONNECT_FAILED:
                words = said.lower()
                kind: type[OSError] = (
                    ConnectionRefusedError
                    if "refused" in words
                    else TimeoutError
                    if "timed out" in words
                    else OSError
                )
                raise kind(f"{host}:{port} on {self.name}: {words}") from None
            if exc.code == OPEN_FAILED_ADMINISTRATIVELY_PROHIBITED:
                raise TransportError(
                    self.name,
                    f"its sshd does not forward TCP to {host}:{port} ({said}: AllowTcpForwarding "
                    "or PermitOpen in its sshd_config)",
                ) from None
            raise TransportError(self.name, f"no channel to {host}:{port}: {said}") from None
        except (paramiko.SSHException, OSError, EOFError) as exc:
            if not transport.is_active():
                with self._lock:
                    if self._client is client:
                        client.close()
                        self._client = None
            raise TransportError(self.name, f"no channel to {host}:{port}: {exc}") from None

    def _sftp(self) -> paramiko.SFTPClient:
        try:
            return self._connected().open_sftp()
        except (paramiko.SSHException, OSError) as exc:
            raise TransportError(self.name, f"cannot open SFTP: {exc}") from None

    def put(self, local: Path, remote: str, *, mode: int | None = None) -> None:
        tmp = posixpath.join(
            posixpath.dirname(remote), f".{posixpath.basename(remote)}.{uuid.uuid4().hex[:8]}"
        )
        sftp = self._sftp()
        try:
            sftp.put(str(local), tmp)
            if mode is not None:
                sftp.chmod(tmp, mode)
            sftp.posix_rename(tmp, remote)
        except (OSError, paramiko.SSHException) as exc:
            with contextlib.suppress(OSError, paramiko.SSHException):
                sftp.remove(tmp)
            raise TransportError(self.name, f"cannot write {remote}: {exc}") from None
        finally:
            sftp.close()

    def get(self, remote: str, local: Path) -> None:
        sftp = self._sftp()
        try:
            sftp.get(remote, str(local))
        except (OSError, paramiko.SSHException) as exc:
            raise TransportError(self.name, f"cannot read {remote}: {exc}") from None
        finally:
            sftp.close()

    def close(self) -> None:
        pending = self._pending
        if pending is not None:
            # A connect still in progress holds the lock; closing its socket ends it now
            # instead of after its timeout, so giving up on a hung host costs nothing more.
            with contextlib.suppress(OSError):
                pending.close()
        if not self._lock.acquire(timeout=0 if pending is not None else 5):
            return
        try:
            if self._client is not None:
                self._client.close()
                self._client = None
        finally:
            self._lock.release()
