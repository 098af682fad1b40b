"""Xid errors from the kernel log: the driver's own record of what went wrong on a GPU."""

from __future__ import annotations

import re

from pydantic import BaseModel

from kdctl.errors import TransportError
from kdctl.transports import Transport

# `[  123.456] NVRM: Xid (PCI:0000:18:00): 79, pid=1234, name=python, GPU has fallen off the bus.`
_XID = re.compile(r"NVRM: Xid \((?P<pci>[^)]*)\): (?P<code>\d+)(?:, (?P<detail>.*))?$")
_STAMP = re.compile(r"^\[\s*(?P<secs>\d+\.\d+)\]")

# Where a kernel log can be read from, in order; the first that answers wins.
_SOURCES: tuple[tuple[str, ...], ...] = (
    ("dmesg",),
    ("journalctl", "-k", "-b", "--no-pager", "-o", "short-monotonic"),
)


class XidEvent(BaseModel):
    code: int
    pci: str
    detail: str
    uptime_s: float | None = None
    line: str


class XidProbe(BaseModel):
    readable: bool
    source: str | None = None
    events: list[XidEvent] = []
    error: str | None = None


def parse_xids(text: str) -> list[XidEvent]:
    events = []
    for raw in text.splitlines():
        line = raw.rstrip()
        match = _XID.search(line)
        if not match:
            continue
        stamp = _STAMP.match(line)
        events.append(
            XidEvent(
                code=int(match["code"]),
                pci=match["pci"],
                detail=(match["detail"] or "").strip(),
                uptime_s=float(stamp["secs"]) if stamp else None,
                line=line,
            )
        )
    return events


def probe_xids(transport: Transport, *, timeout: float = 15.0) -> XidProbe:
    """Xid lines from dmesg, else journalctl; 'unreadable' is reported, never taken as none."""
    failures = []
    for argv in _SOURCES:
        try:
            result = transport.run(argv, timeout=timeout)
        except TransportError as exc:
            return XidProbe(readable=False, error=str(exc))
        lines = [ln for ln in result.stdout.splitlines() if ln.strip() != "-- No entries --"]
        # journalctl exits 0 having read nothing when the journal is missing or off-limits;
        # a booted kernel always logs, so an empty answer means "could not look".
        if result.ok and lines:
            return XidProbe(readable=True, source=argv[0], events=parse_xids(result.stdout))
        last = (result.stderr.strip().splitlines() or [f"exit {result.exit_code}, no lines"])[-1]
        failures.append(f"{argv[0]}: {last}")
    return XidProbe(readable=False, error="kernel log unreadable (" + "; ".join(failures) + ")")
