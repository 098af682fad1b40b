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
    """Connect, then time one round trip on the warm connection."""
    started = time.monotonic()
    try:
        transport.connect()
        connected = time.monotonic()
        rtt = transport.round_trip(timeout=timeout)
    except KdctlError as exc:
        return Reachability(reachable=False, error=str(exc))
    return Reachability(
        reachable=True,
        connect_ms=round((connected - started) * 1000, 2),
        rtt_ms=round(rtt * 1000, 2),
    )
