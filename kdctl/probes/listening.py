"""Whether something listens on a TCP port of a host: `ss`, read from the host itself, so a
port closed to this machine (a firewall, the host's loopback) still shows what runs there."""

from __future__ import annotations

from pydantic import BaseModel

from kdctl.errors import KdctlError
from kdctl.transports import Transport


class Listening(BaseModel):
    port: int
    # True: a socket listens on the port; False: none does; None: the host could not say.
    listening: bool | None
    # The local addresses it listens on, as ss prints them ("127.0.0.1:30000", "*:30000").
    addresses: list[str] = []
    detail: str | None = None


def parse_ss_listening(text: str) -> list[str]:
    """The local address:port of each line of `ss -Hltn` (State Recv-Q Send-Q Local Peer)."""
    found = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 5:
            found.append(fields[3])
    return found


def probe_listening(transport: Transport, port: int, *, timeout: float = 10.0) -> Listening:
    """Listening TCP sockets on `port` of the host, of any process and any address."""
    try:
        result = transport.run(["ss", "-Hltn", f"sport = :{port}"], timeout=timeout)
    except KdctlError as exc:
        return Listening(port=port, listening=None, detail=str(exc))
    if not result.ok:
        why = "ss is not installed" if result.not_found else f"ss exited {result.exit_code}"
        return Listening(port=port, listening=None, detail=why)
    addresses = parse_ss_listening(result.stdout)
    return Listening(port=port, listening=bool(addresses), addresses=addresses)
