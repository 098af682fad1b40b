from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kdctl._httpclient import TcpChannel
from kdctl.errors import TransportError


@dataclass(frozen=True)
class CommandResult:
    """What one command did on its host."""

    host: str
    argv: tuple[str, ...]
    exit_code: int
    stdout: str
    stderr: str
    duration_s: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @property
    def not_found(self) -> bool:
        """The program does not exist on the host (the shell's 127)."""
        return self.exit_code == 127


class Transport(abc.ABC):
    """Runs commands and moves files on one host: the only way kdctl touches a host.

    Commands are argument lists, never shell strings: a transport that needs a shell quotes
    every argument, so a value from an inventory reaches the program as one literal argument.
    """

    def __init__(self, name: str) -> None:
        self.name = name

    @abc.abstractmethod
    def connect(self) -> None:
        """Open the connection now, so its cost and its failure show up in one place."""

    @abc.abstractmethod
    def run(
        self, argv: Sequence[str], *, timeout: float = 30.0, stdin: bytes | None = None
    ) -> CommandResult:
        """Run `argv`; raise CommandTimeout past `timeout`, TransportError when it cannot run."""

    def round_trip(self, *, timeout: float = 10.0) -> float:
        """Seconds for one request to the host and back; raises when it cannot be made."""
        result = self.run(["true"], timeout=timeout)
        if not result.ok:
            raise TransportError(self.name, f"`true` exited {result.exit_code}")
        return result.duration_s

    @abc.abstractmethod
    def put(self, local: Path, remote: str, *, mode: int | None = None) -> None:
        """Copy a file to the host; the remote file appears whole or not at all."""

    @abc.abstractmethod
    def get(self, remote: str, local: Path) -> None:
        """Copy a file from the host."""

    def open_channel(self, host: str, port: int, *, timeout: float) -> TcpChannel:
        """A TCP connection to host:port as this host dials it, carried by the connection to
        the host (an SSH channel): TransportError where there is none to carry it, OSError
        (ConnectionRefusedError, TimeoutError) where the host tried and could not connect."""
        raise TransportError(
            self.name, "this transport carries no TCP connections: http: ssh needs transport: ssh"
        )

    def close(self) -> None:  # noqa: B027 - most transports hold nothing open
        """Release the connection, if any."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
