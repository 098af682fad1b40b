"""The error types every layer raises, each carrying the exit code the CLI ends with.

Exit codes are part of the contract (docs/reference/cli.md, exit codes): 1 a negative verdict,
2 bad input, 3 an infrastructure failure. Anything a user can cause ends in one of these,
never a traceback.
"""

from __future__ import annotations


class KdctlError(Exception):
    """Base of every error kdctl reports to a user."""

    exit_code = 1

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class InputError(KdctlError):
    """Bad configuration or arguments: nothing was changed."""

    exit_code = 2


class InfraError(KdctlError):
    """A host, transport or server could not be reached or did not answer in time."""

    exit_code = 3


class TransportError(InfraError):
    """A transport could not run a command or move a file on its host."""

    def __init__(self, host: str, message: str) -> None:
        super().__init__(f"{host}: {message}")
        self.host = host


class CommandTimeout(TransportError):
    def __init__(self, host: str, argv: tuple[str, ...], timeout_s: float) -> None:
        super().__init__(host, f"{argv[0] if argv else 'command'} did not finish in {timeout_s:g}s")
        self.argv = argv
        self.timeout_s = timeout_s


class HostKeyError(TransportError):
    """The host's SSH key is unknown or differs from known_hosts: refused, never guessed."""

    def __init__(self, host: str, message: str, fingerprint: str) -> None:
        super().__init__(host, message)
        self.fingerprint = fingerprint
