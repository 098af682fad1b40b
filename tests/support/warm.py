"""kdctl's CLI kept warm: its modules imported once in a server process, each command run in a
fresh fork of it.

A cold `python -m kdctl ...` spends most of its half second importing httpx, pydantic, typer
and rich; the suite runs the CLI some seven hundred times on two cores. A fork is still a
process of its own, running `kdctl.cli.main()` with the command's argv, environment, working
directory and its own stdout and stderr files, exiting with the CLI's exit code; only the
imports are shared. Commands whose interpreter start-up differs (a PYTHONPATH of their own, as
the plugin tests use) run cold.

Protocol, over a Unix socket: the client sends one JSON line (argv, env, cwd) with its stdout
and stderr file descriptors (SCM_RIGHTS); the forked command writes its pid as a line, then,
when it ends, its exit code as a line. A command killed by a signal sends no code: the client
reports the signal as subprocess does (-SIGNUM), from the server's wait status.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

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
    "kdctl.traffic.operations",
    "kdctl.traffic.runner",
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
)


def _serve(path: str) -> None:
    import importlib

    for name in _PRELOAD:
        importlib.import_module(name)
    sys.stdout.flush()
    sys.stderr.flush()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    listener.settimeout(0.5)
    children: dict[int, socket.socket] = {}
    while True:
        # Reap ended commands; one killed by a signal gets its status sent by the server,
        # since it could not send its own.
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                conn = children.pop(pid)
                if os.WIFSIGNALED(status):
                    with contextlib.suppress(OSError):
                        conn.sendall(f"signal {os.WTERMSIG(status)}\n".encode())
                conn.close()
        if os.getppid() == 1:
            return  # the test worker is gone
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        conn.settimeout(None)
        msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
        pid = os.fork()
        if pid == 0:
            listener.close()
            for other in children.values():
                other.close()
            _run(conn, json.loads(msg), fds)  # never returns
        for fd in fds:
            os.close(fd)
        children[pid] = conn


def _run(conn: socket.socket, request: dict[str, object], fds: list[int]) -> None:
    code = 1
    try:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(
                sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
            )
        os.setpgid(0, 0)  # the client may kill it without reaching the server
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in (null, *fds):
            os.close(fd)
        os.chdir(str(request["cwd"]))
        os.environ.clear()
        os.environ.update(request["env"])  # type: ignore[arg-type]
        # As `python -m kdctl` leaves them: click names the program from these in its usage.
        sys.argv = [str(Path(__file__).resolve().parents[2] / "kdctl" / "__main__.py")]
        sys.argv += request["argv"]  # type: ignore[arg-type]
        sys.modules["__main__"].__package__ = "kdctl"
        conn.sendall(f"{os.getpid()}\n".encode())
        from kdctl.cli import main

        try:
            main()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if exc.code is not None and not isinstance(exc.code, int):
                sys.stderr.write(f"{exc.code}\n")
        except BaseException:
            traceback.print_exc()
            code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        with contextlib.suppress(Exception):
            conn.sendall(f"exit {code}\n".encode())
        os._exit(code)


class WarmCli:
    """One server per test process, started on first use."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.mkdtemp(prefix="kdctl-warm-")
        self._path = os.path.join(self._dir, "sock")
        self._env = {k: os.environ.get(k) for k in _STARTUP}
        self._lock = threading.Lock()

    def _start(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)
        repo = Path(__file__).resolve().parents[2]
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.warm", self._path], cwd=repo
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
        with self._lock:
            self._start()
        with (
            tempfile.TemporaryFile() as stdout,
            tempfile.TemporaryFile() as stderr,
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn,
        ):
            conn.connect(self._path)
            request = json.dumps({"argv": args, "env": env, "cwd": cwd}).encode()
            socket.send_fds(conn, [request], [stdout.fileno(), stderr.fileno()])
            conn.settimeout(timeout)
            reader = conn.makefile("r")
            pid = None
            try:
                pid = int(reader.readline())
                last = reader.readline().split()
            except (TimeoutError, OSError, ValueError) as exc:
                if pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, signal.SIGKILL)
                raise subprocess.TimeoutExpired(["kdctl", *args], timeout) from exc
            code = int(last[1]) if last and last[0] == "exit" else -int(last[1]) if last else -9
            stdout.seek(0)
            stderr.seek(0)
            return code, _text(stdout.read()), _text(stderr.read())

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(5)
        with contextlib.suppress(OSError):
            os.unlink(self._path)
            os.rmdir(self._dir)


def _text(data: bytes) -> str:
    # As subprocess.run(text=True) reads it: universal newlines.
    return data.decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n")


if __name__ == "__main__":
    _serve(sys.argv[1])
