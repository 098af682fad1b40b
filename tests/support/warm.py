"""kdctl's CLI kept warm: its modules imported once in a server process, each command run in a
fresh fork of it.

A cold `python -m kdctl ...` spends most of its half second importing httpx, pydantic, typer
and rich; the suite runs the CLI some seven hundred times on two cores. A fork is still a
process of its own, running `kdctl.cli.main()` with the command's argv, environment, working
directory and its own stdout and stderr files, exiting with the CLI's exit code; only the
imports are shared. Commands whose interpreter start-up differs (a PYTHONPATH of their own, as
the plugin tests use) run cold.

A second server, with torch, transformers and the reference server's modules imported too,
starts the reference servers the tests run themselves (`WarmCli("engine").start`): each is
`kdctl reference serve` in a fork of its own, handled as subprocess.Popen handles a child, and
saves the engine's three seconds of imports. The engines kdctl itself starts in the tests
(a service's command, a command-mode engine) are `python tests/support/warm_exec.py SOCKET
ARGS`: a stand-in that has the same server fork `kdctl ARGS` and stands for it (stdin and
output passed on, signals forwarded, its exit code; killed, the fork is killed too; started on
a test box, the fork joins the box's network and mount namespaces). The sandbox's engines
start cold, as they would anywhere, but in the demo's test, whose sandbox runs them under an
interpreter that hands `-m kdctl` to warm_exec.py (conftest.warm_python).

Protocol, over a Unix socket: the client sends one JSON line (argv, env, cwd) with its stdout
and stderr file descriptors (SCM_RIGHTS); the fork writes its pid as a line and runs; the
server, which reaps it, writes `exit N` with the code subprocess would report (minus the
signal for a killed one). The fork ends as an interpreter does. What it cannot differ in from a
cold start: its hash seed is the server's, so set and dict orders repeat between commands.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, TextIO

# Variables read when an interpreter starts, not when a command runs: a command that sets one
# differently from the server's must start cold to see it.
_STARTUP = ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH", "PYTHONNOUSERSITE", "PYTHONUSERBASE")
_PRELOAD = (
    "kdctl.cli",
    "kdctl.status",
    "kdctl.readiness",
    "kdctl.serving",
    "kdctl.recording",
    "kdctl.report",
    "kdctl.sandbox",
    "kdctl.session",
    "kdctl.traffic",
    "kdctl.cutover",
    "kdctl.traffic.nginx",
    "kdctl.traffic.sglang_router",
    "kdctl.evidence",
    "kdctl.evidence.transfer",
    "kdctl.roadmap",
    "kdctl.checks",
    "kdctl.backends",
    "kdctl.probes",
    "kdctl.loadgen",
    "kdctl.transports.ssh",
    "kdctl.tables",
    "kdctl.checks.health",
    "kdctl.checks.tp_health",
    "kdctl.checks.command",
    "kdctl.checks.exactness",
    "kdctl.checks.throughput",
    "kdctl.checks.api_conformance",
    "kdctl.probes.topology",
    "kdctl.backends.reference.backend",
    "pydantic.type_adapter",
    "rich._emoji_codes",
    "encodings.idna",
)
# Torch is not imported by the CLI's own server: the core CLI does not load it, and a test may
# hold it to that.
_PRELOAD_ENGINE = (
    *_PRELOAD,
    "torch",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.deepseek_v3.modeling_deepseek_v3",
    "transformers.models.llama.modeling_llama",
    "uvicorn",
    "starlette.applications",
    "kdctl.backends.reference.server",
    "kdctl.backends.reference.speculative",
)


def _serve(path: str, preload: tuple[str, ...]) -> None:
    import importlib
    import select

    for name in preload:
        importlib.import_module(name)
    # What each process makes once, made here so that the forks share it: the click command
    # typer builds from the app, and the SSL context every HTTP client takes.
    from kdctl._httpclient import ssl_context
    from kdctl.cli import command

    command()
    ssl_context()
    sys.stdout.flush()
    sys.stderr.flush()
    parent = os.getppid()
    # An ended command wakes the loop at once (its status is the client's answer).
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # Listening before the path appears: a client that sees it can connect.
    listener.bind(path + ".new")
    listener.listen(16)
    os.rename(path + ".new", path)
    children: dict[int, socket.socket] = {}
    own = {k: os.environ.get(k) for k in _STARTUP}
    while os.getppid() == parent:  # else the test worker is gone
        ready, _, _ = select.select([listener, wake_r], [], [], 1.0)
        if wake_r in ready:
            os.read(wake_r, 512)
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                conn = children.pop(pid)
                # As subprocess reports it: the exit status, or minus the signal.
                code = os.waitstatus_to_exitcode(status)
                with contextlib.suppress(OSError):
                    conn.sendall(f"exit {code}\n".encode())
                conn.close()
        if listener not in ready:
            continue
        conn, _ = listener.accept()
        try:
            conn.settimeout(5)
            msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            request = json.loads(msg)
            if len(fds) not in (2, 3):
                raise ValueError(f"{len(fds)} file descriptors")
            if any(request["env"].get(k) != own.get(k) for k in _STARTUP):
                raise ValueError("another interpreter set-up: run it cold")
            int(request.get("tied", 0))
        except (OSError, ValueError) as exc:
            with contextlib.suppress(OSError):
                conn.sendall(f"error {exc}\n".encode())
            conn.close()
            continue
        # Everything the server holds, out of the fork's garbage collections: a collection
        # in the fork otherwise walks the preloaded modules' objects and writes to each one's
        # header, copying every page of them (Python's gc.freeze documents the pattern). A
        # `kdctl --version` in a fork of the engine server: 1.5 s of CPU without, 0.3 s with.
        gc.freeze()
        pid = os.fork()
        if pid == 0:
            # The server's signal plumbing is not the command's (and its fds may be reused).
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in (wake_r, wake_w):
                os.close(fd)
            listener.close()
            for other in children.values():
                other.close()
            _run(conn, request, fds)  # leaves by SystemExit, as a process does
        for fd in fds:
            os.close(fd)
        children[pid] = conn


def _run(conn: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
    """The command, in the fork: its pid to the client, then the CLI as `python -m kdctl`
    runs it. It ends the way an interpreter does (threads joined, atexit run, streams
    flushed), and the server reports its wait status. Given three descriptors they are its
    stdin, stdout and stderr, else stdin is empty; `tied` names a process (warm_exec.py's)
    whose end kills it."""
    conn.sendall(f"{os.getpid()}\n".encode())
    conn.close()
    os.setpgid(0, 0)  # the client may kill it without reaching the server
    if len(fds) == 2:
        fds = [os.open(os.devnull, os.O_RDONLY), *fds]
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    if request.get("tied"):
        # Before any thread starts: a namespace is entered by a process of one thread.
        _join_box(int(request["tied"]))
        _tie(int(request["tied"]))
    try:
        os.chdir(request["cwd"])
    except OSError as exc:
        raise SystemExit(f"kdctl: {exc}") from None
    os.environ.clear()
    os.environ.update(request["env"])
    # As `python -m kdctl` leaves them: click names the program from these in its usage, and
    # the working directory leads the import path.
    sys.argv = [str(Path(__file__).resolve().parents[2] / "kdctl" / "__main__.py")]
    sys.argv += request["argv"]
    sys.path[0] = os.getcwd()
    sys.modules["__main__"].__package__ = "kdctl"
    from kdctl.cli import main

    main()
    raise SystemExit(0)


# setns(2)'s namespace types.
_NAMESPACES = {"net": 0x40000000, "mnt": 0x00020000}


def _join_box(pid: int) -> None:
    """Into the network and mount namespaces of `pid`, where they differ from this one's: a
    command started on a test box (tests/support/box.py) listens, connects and sees files
    there, as the cold command in its place would."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for kind, flag in _NAMESPACES.items():
        theirs, ours = f"/proc/{pid}/ns/{kind}", f"/proc/self/ns/{kind}"
        try:
            if os.readlink(theirs) == os.readlink(ours):
                continue
            fd = os.open(theirs, os.O_RDONLY)
        except OSError as exc:
            raise SystemExit(f"kdctl: the starting process's {kind} namespace: {exc}") from None
        if libc.setns(fd, flag) != 0:
            raise SystemExit(f"kdctl: setns {kind}: {os.strerror(ctypes.get_errno())}")
        os.close(fd)


def _tie(pid: int) -> None:
    """Killed as soon as `pid` ends, however it ends (SIGKILL included)."""
    import select

    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGKILL)
        raise

    def watch() -> None:
        select.select([pidfd], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True).start()


class WarmProcess:
    """A command forked by the warm server, handled as subprocess.Popen handles a child: the
    server reaps it and reports its exit code, which a thread here waits for. Signals go
    through a pidfd taken at once, so they reach this process or none, never a later one
    given the same pid."""

    def __init__(self, args: list[str], conn: socket.socket, reader: TextIO, pid: int) -> None:
        self.args = args
        self.pid = pid
        self.returncode: int | None = None
        self._pidfd = os.pidfd_open(pid)
        self._done = threading.Event()
        threading.Thread(target=self._reap, args=(conn, reader), daemon=True).start()

    def _reap(self, conn: socket.socket, reader: TextIO) -> None:
        import select

        with conn, reader:
            code = _exit_code(reader.readline())
        if code is not None:
            self.returncode = code
        else:
            # The server is gone and cannot report it: wait for the process itself to end
            # (its pidfd turns readable); its code is not known, and -1 says so.
            select.select([self._pidfd], [], [])
            self.returncode = -1
        self._done.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, OSError):
            signal.pidfd_send_signal(self._pidfd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class WarmCli:
    """One server per test process, started on first use."""

    def __init__(self, preload: str = "cli") -> None:
        self._preload = preload
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.mkdtemp(prefix="kdctl-warm-")
        self._path = os.path.join(self._dir, "sock")
        self._env = {k: os.environ.get(k) for k in _STARTUP}
        self._lock = threading.Lock()

    def _start(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        for stale in (self._path, self._path + ".new"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(stale)
        repo = Path(__file__).resolve().parents[2]
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.warm", self._path, self._preload], cwd=repo
        )
        deadline = time.monotonic() + 60
        while not os.path.exists(self._path):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the warm kdctl server did not start")
            time.sleep(0.02)

    def suits(self, env: dict[str, str]) -> bool:
        return all(env.get(k) == v for k, v in self._env.items())

    def run(
        self, args: list[str], env: dict[str, str], cwd: str, timeout: float
    ) -> tuple[int, str, str]:
        with (
            tempfile.TemporaryFile() as stdout,
            tempfile.TemporaryFile() as stderr,
            self._connect() as conn,
        ):
            conn.settimeout(timeout)
            pid = None
            try:
                reader, pid = _fork(conn, args, env, cwd, (stdout.fileno(), stderr.fileno()))
                code = _exit_code(reader.readline())
            except TimeoutError as exc:
                if pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, signal.SIGKILL)
                raise subprocess.TimeoutExpired(["kdctl", *args], timeout) from exc
            if code is None:
                raise RuntimeError(f"the warm kdctl server ended before command {pid} did")
            stdout.seek(0)
            stderr.seek(0)
            return code, _text(stdout.read()), _text(stderr.read())

    def start(self, args: list[str], env: dict[str, str], cwd: str) -> WarmProcess:
        """`python -m kdctl ARGS` in a fork, not waited for; its output discarded."""
        conn = self._connect()
        try:
            conn.settimeout(60)
            with open(os.devnull, "wb") as null:
                reader, pid = _fork(conn, args, env, cwd, (null.fileno(), null.fileno()))
            conn.settimeout(None)
            return WarmProcess(["kdctl", *args], conn, reader, pid)
        except BaseException:
            conn.close()
            raise

    def socket_path(self) -> str:
        """The server's socket path, the server started if it is not running."""
        with self._lock:
            self._start()
        return self._path

    def _connect(self) -> socket.socket:
        """A connection to the server, (re)started where it is not running."""
        for attempt in (1, 2):
            with self._lock:
                self._start()
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                conn.connect(self._path)
            except (ConnectionRefusedError, FileNotFoundError):
                conn.close()
                if attempt == 2:
                    raise
                continue
            return conn
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(5)
        with contextlib.suppress(OSError):
            os.unlink(self._path)
            os.rmdir(self._dir)


def _fork(
    conn: socket.socket, args: list[str], env: dict[str, str], cwd: str, fds: tuple[int, int]
) -> tuple[TextIO, int]:
    """Ask the server for a fork running `args` with these stdout and stderr; its pid, and
    the reader its exit line will come on."""
    request = json.dumps({"argv": args, "env": env, "cwd": cwd}).encode()
    socket.send_fds(conn, [request], list(fds))
    reader = conn.makefile("r")
    first = reader.readline()
    if first.startswith("error "):
        raise RuntimeError(f"the warm kdctl server refused: {first[6:].strip()}")
    if not first:
        raise RuntimeError("the warm kdctl server closed before forking")
    return reader, int(first)


def _exit_code(line: str) -> int | None:
    """The code in the server's `exit N` line; None where it ended without one."""
    words = line.split()
    return int(words[1]) if len(words) == 2 and words[0] == "exit" else None


def _text(data: bytes) -> str:
    # As subprocess.run(text=True) reads it: universal newlines.
    return data.decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n")


if __name__ == "__main__":
    _serve(sys.argv[1], _PRELOAD_ENGINE if sys.argv[2:] == ["engine"] else _PRELOAD)
