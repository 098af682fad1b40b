from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from kdctl.errors import CommandTimeout, TransportError
from kdctl.transports._base import CommandResult, Transport


class LocalTransport(Transport):
    """Runs commands with subprocess on the machine kdctl runs on."""

    def connect(self) -> None:
        return None

    def run(
        self, argv: Sequence[str], *, timeout: float = 30.0, stdin: bytes | None = None
    ) -> CommandResult:
        args = tuple(argv)
        started = time.monotonic()
        try:
            # A session of its own, so a timeout kills the whole tree, not just its parent.
            proc = subprocess.Popen(
                args,
                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except FileNotFoundError:
            return self._result(args, 127, "", f"{args[0]}: command not found", started)
        except PermissionError as exc:
            return self._result(args, 126, "", f"{args[0]}: {exc.strerror}", started)
        except OSError as exc:
            raise TransportError(self.name, f"cannot run {args[0]}: {exc}") from None
        try:
            out, err = proc.communicate(stdin, timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            # A grandchild in a session of its own (torchrun's workers) may keep the pipes
            # open: stop waiting for them rather than hang past the deadline.
            try:
                proc.communicate(timeout=5)
            except subprocess.TimeoutExpired:
                proc.wait()
            raise CommandTimeout(self.name, args, timeout) from None
        return self._result(
            args,
            proc.returncode,
            out.decode(errors="replace"),
            err.decode(errors="replace"),
            started,
        )

    def _result(
        self, argv: tuple[str, ...], code: int, out: str, err: str, started: float
    ) -> CommandResult:
        return CommandResult(self.name, argv, code, out, err, time.monotonic() - started)

    def put(self, local: Path, remote: str, *, mode: int | None = None) -> None:
        target = Path(remote)
        try:
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
            os.close(fd)
            shutil.copyfile(local, tmp)
            if mode is not None:
                os.chmod(tmp, mode)
            os.replace(tmp, target)
        except OSError as exc:
            raise TransportError(self.name, f"cannot write {remote}: {exc}") from None

    def get(self, remote: str, local: Path) -> None:
        try:
            shutil.copyfile(remote, local)
        except OSError as exc:
            raise TransportError(self.name, f"cannot read {remote}: {exc}") from None
