"""`python tests/support/warm_exec.py SOCKET ARGS...`: `python -m kdctl ARGS` for the command
lines kdctl runs itself in the tests (an engine's service, a command-mode engine), run in a
fork of the test worker's warm engine server (warm.py) instead of a cold interpreter.

This process stands for the fork, as the process kdctl started and signals: it passes on its
stdin, stdout, stderr, environment and working directory; forwards the signals a service is
stopped with; and ends as the fork ended (its exit code, or killed by the same signal). Killed
itself (SIGKILL, which it cannot forward), the fork is killed too: the server ties the fork to
this process. Where the server is gone or started under another interpreter set-up, it becomes
the cold command instead (exec). It imports nothing heavy: it starts in milliseconds.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys

_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)


def main() -> None:
    path, args = sys.argv[1], sys.argv[2:]
    request = {"argv": args, "env": dict(os.environ), "cwd": os.getcwd(), "tied": os.getpid()}
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(path)
        socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
        reader = conn.makefile("r")
        pid = int(reader.readline())
    except (OSError, ValueError):
        os.execv(sys.executable, [sys.executable, "-m", "kdctl", *args])
    try:
        pidfd: int | None = os.pidfd_open(pid)
    except ProcessLookupError:  # already ended and reaped: its exit line is on its way
        pidfd = None

    def forward(sig: int, _frame: object) -> None:
        if pidfd is None:
            return
        try:
            signal.pidfd_send_signal(pidfd, sig)
        except ProcessLookupError:
            return

    for sig in _FORWARDED:
        signal.signal(sig, forward)
    words = reader.readline().split()  # the server's `exit N` once the fork has ended
    if len(words) == 2 and words[0] == "exit":
        code = int(words[1])
    else:  # the server is gone: wait for the fork itself; its code is not known
        if pidfd is not None:
            select.select([pidfd], [], [])
        code = 1
    if code < 0:  # killed by a signal: end the same way
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()
