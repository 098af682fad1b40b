"""Whether an engine's service runs: `systemctl show` for a unit, the pidfile for a command."""

from __future__ import annotations

import posixpath
from datetime import datetime, timezone
from typing import Literal

from pydantic import BaseModel

from kdctl.errors import TransportError
from kdctl.inventory import CommandService, SystemdService
from kdctl.transports import Transport

_SYSTEMD_PROPS = (
    "LoadState,ActiveState,SubState,MainPID,ExecMainStartTimestamp,Result,StateChangeTimestamp"
)

State = Literal["running", "stopped", "failed", "starting", "unknown"]


class ServiceState(BaseModel):
    kind: Literal["systemd", "command"]
    name: str
    state: State
    pid: int | None = None
    detail: str | None = None
    # When the unit last changed state (started, stopped, failed), by systemd's own clock.
    since: datetime | None = None


def probe_service(
    transport: Transport, service: SystemdService | CommandService, *, timeout: float = 10.0
) -> ServiceState:
    try:
        if isinstance(service, SystemdService):
            return _systemd(transport, service, timeout)
        return _command(transport, service, timeout)
    except TransportError as exc:
        name = service.systemd if isinstance(service, SystemdService) else service.pidfile
        kind: Literal["systemd", "command"] = (
            "systemd" if isinstance(service, SystemdService) else "command"
        )
        return ServiceState(kind=kind, name=name, state="unknown", detail=str(exc))


def _systemd(transport: Transport, service: SystemdService, timeout: float) -> ServiceState:
    argv = ["systemctl"]
    if service.scope == "user":
        argv.append("--user")
    argv += ["show", f"--property={_SYSTEMD_PROPS}", "--no-pager", "--", service.systemd]
    # Seconds since the epoch (systemd 248 and later): a zone name such as "CET" would not say
    # which offset it means.
    result = transport.run([*argv[:-2], "--timestamp=unix", *argv[-2:]], timeout=timeout)
    if not result.ok and "timestamp" in result.stderr:
        result = transport.run(argv, timeout=timeout)
    name = service.systemd
    if not result.ok:
        why = (result.stderr.strip().splitlines() or [f"exit {result.exit_code}"])[-1]
        return ServiceState(kind="systemd", name=name, state="unknown", detail=why)
    props = dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)
    return parse_systemd_show(name, props)


def parse_systemd_show(name: str, props: dict[str, str]) -> ServiceState:
    if props.get("LoadState") == "not-found":
        return ServiceState(kind="systemd", name=name, state="unknown", detail="unit not found")
    active = props.get("ActiveState", "")
    state: State = {
        "active": "running",
        "reloading": "running",
        "activating": "starting",
        "inactive": "stopped",
        "deactivating": "stopped",
        "failed": "failed",
    }.get(active, "unknown")  # type: ignore[assignment]
    pid = int(props.get("MainPID") or 0) or None
    detail = f"{active}/{props.get('SubState', '?')}"
    if props.get("Result") not in (None, "", "success"):
        detail += f", last result {props['Result']}"
    since = _timestamp(props.get("StateChangeTimestamp", ""))
    return ServiceState(kind="systemd", name=name, state=state, pid=pid, detail=detail, since=since)


def _timestamp(text: str) -> datetime | None:
    """systemd's `@SECONDS` (--timestamp=unix), or its default form where the zone is UTC;
    None for any other zone or an empty value (the unit never changed state)."""
    text = text.strip()
    if text.startswith("@") and text[1:].isdigit():
        return datetime.fromtimestamp(int(text[1:]), tz=timezone.utc)
    if text.endswith((" UTC", " GMT")):
        try:
            return datetime.strptime(text[:-4], "%a %Y-%m-%d %H:%M:%S").replace(tzinfo=timezone.utc)
        except ValueError:
            return None
    return None


def _command(transport: Transport, service: CommandService, timeout: float) -> ServiceState:
    name = service.pidfile
    read = transport.run(["cat", "--", service.pidfile], timeout=timeout)
    if not read.ok:
        return ServiceState(kind="command", name=name, state="stopped", detail="no pidfile")
    text = read.stdout.strip()
    if not text.isdigit():
        return ServiceState(
            kind="command", name=name, state="unknown", detail=f"pidfile holds {text[:40]!r}"
        )
    pid = int(text)
    cmdline = transport.run(["cat", "--", f"/proc/{pid}/cmdline"], timeout=timeout)
    if not cmdline.ok:
        return ServiceState(
            kind="command", name=name, state="stopped", pid=pid, detail="stale pidfile"
        )
    # A pid outlives its process and gets reused: check it is still the program we started.
    running = [a for a in cmdline.stdout.split("\x00") if a]
    if not running:
        # A zombie keeps its /proc entry with an empty command line until it is reaped.
        return ServiceState(
            kind="command", name=name, state="stopped", pid=pid, detail=f"pid {pid} has exited"
        )
    wanted = posixpath.basename(service.argv[0])
    names = {posixpath.basename(a) for a in running[:3]}
    if running and wanted not in names:
        return ServiceState(
            kind="command",
            name=name,
            state="stopped",
            pid=pid,
            detail=f"stale pidfile: pid {pid} is now {posixpath.basename(running[0])}",
        )
    return ServiceState(kind="command", name=name, state="running", pid=pid)
