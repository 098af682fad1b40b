"""Transports: run a command and move a file on a host, locally or over SSH.

Everything host-side (nvidia-smi, systemctl, torchrun, nginx) goes through one of these, so the
same code runs against the GPU box and against loopback in tests.
"""

from __future__ import annotations

import threading
from types import TracebackType

from kdctl.inventory import LoadedInventory, local_path
from kdctl.transports._base import CommandResult, Transport
from kdctl.transports._fanout import Outcome, fan_out
from kdctl.transports.local import LocalTransport

__all__ = [
    "CommandResult",
    "LocalTransport",
    "Outcome",
    "Transport",
    "TransportPool",
    "fan_out",
]


class TransportPool:
    """One transport per inventory host, opened on first use and closed together."""

    def __init__(self, inventory: LoadedInventory) -> None:
        self.inventory = inventory
        self._transports: dict[str, Transport] = {}
        self._lock = threading.Lock()

    def get(self, host: str) -> Transport:
        with self._lock:
            existing = self._transports.get(host)
            if existing is None:
                existing = self._transports[host] = self._make(host)
            return existing

    def _make(self, host: str) -> Transport:
        spec = self.inventory.hosts[host]
        if spec.transport == "local":
            return LocalTransport(host)
        from kdctl.transports.ssh import SSHTransport  # paramiko's import is not free

        base = self.inventory.path.parent
        return SSHTransport(
            host,
            spec,
            known_hosts=local_path(spec.known_hosts, base),
            identity_file=local_path(spec.identity_file, base) if spec.identity_file else None,
        )

    def close(self) -> None:
        with self._lock:
            transports, self._transports = list(self._transports.values()), {}
        for transport in transports:
            transport.close()

    def __enter__(self) -> TransportPool:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
