from __future__ import annotations

import time

from pydantic import BaseModel

from kdctl.errors import KdctlError
from kdctl.transports import Transport


class Reachability(BaseModel):
    reachable: bool
    connect_ms: float | None = None
    rtt_ms: float | None = None
    error: str | None = None


def probe_reachability(transport: Transport, *, timeout: float = 10.0) -> Reachability:
    """Connect, then time one trivial command: the round trip on a warm connection."""
    started = time.monotonic()
    try:
        transport.connect()
        connected = time.monotonic()
        result = transport.run(["true"], timeout=timeout)
    except KdctlError as exc:
        return Reachability(reachable=False, error=str(exc))
    if not result.ok:
        return Reachability(reachable=False, error=f"`true` exited {result.exit_code}")
    return Reachability(
        reachable=True,
        connect_ms=round((connected - started) * 1000, 2),
        rtt_ms=round(result.duration_s * 1000, 2),
    )
