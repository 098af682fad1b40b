"""GPUs and the processes on them, from nvidia-smi's CSV query interface."""

from __future__ import annotations

import csv
import io
import re
from typing import Any

from pydantic import BaseModel

from kdctl.errors import TransportError
from kdctl.transports import Transport

# Field names checked against `nvidia-smi --help-query-gpu` on driver 580.
GPU_FIELDS = (
    "index",
    "uuid",
    "name",
    "pci.bus_id",
    "driver_version",
    "memory.used",
    "memory.total",
    "utilization.gpu",
    "utilization.memory",
    "temperature.gpu",
    "power.draw",
    "power.limit",
    "pstate",
    "clocks.sm",
    "clocks.max.sm",
    "clocks_event_reasons.active",
    "ecc.mode.current",
    "ecc.errors.uncorrected.volatile.total",
    "ecc.errors.corrected.volatile.total",
    "retired_pages.pending",
    "remapped_rows.pending",
    "remapped_rows.failure",
    "pcie.link.gen.current",
    "pcie.link.gen.max",
    "pcie.link.width.current",
    "pcie.link.width.max",
    "persistence_mode",
)
# What every driver since the 450 series answers: the fallback when a newer name is refused.
CORE_GPU_FIELDS = ("index", "uuid", "name", "memory.used", "memory.total", "utilization.gpu")
APP_FIELDS = ("pid", "process_name", "used_gpu_memory", "gpu_uuid")

NO_GPUS = "no NVIDIA GPUs visible"
_NA = {"", "n/a", "[n/a]", "[not supported]", "not supported", "[unknown error]", "[no data]"}
_UNIT = re.compile(r"\s*\[[^\]]*\]$")
_NUMBER = re.compile(r"^(-?\d+(?:\.\d+)?)(?:\s*(?:%|W|MiB|MHz|C))?$")


class GpuInfo(BaseModel):
    index: int
    uuid: str | None = None
    name: str | None = None
    pci_bus_id: str | None = None
    driver_version: str | None = None
    memory_used_mib: float | None = None
    memory_total_mib: float | None = None
    utilization_pct: float | None = None
    memory_utilization_pct: float | None = None
    temperature_c: float | None = None
    power_draw_w: float | None = None
    power_limit_w: float | None = None
    pstate: str | None = None
    sm_clock_mhz: float | None = None
    sm_clock_max_mhz: float | None = None
    clock_event_reasons: int | None = None
    ecc_mode: str | None = None
    ecc_uncorrected_volatile: int | None = None
    ecc_corrected_volatile: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failure: bool | None = None
    pcie_gen_current: int | None = None
    pcie_gen_max: int | None = None
    pcie_width_current: int | None = None
    pcie_width_max: int | None = None
    persistence_mode: bool | None = None


class GpuProcess(BaseModel):
    pid: int
    process_name: str
    used_memory_mib: float | None = None
    gpu_uuid: str
    gpu_index: int | None = None


class GpuProbe(BaseModel):
    """The GPUs of one host; `visible` is false on a host without NVIDIA GPUs, not an error."""

    visible: bool
    gpus: list[GpuInfo] = []
    processes: list[GpuProcess] = []
    note: str | None = None
    error: str | None = None


# CSV column -> (GpuInfo attribute, value type)
_COLUMNS: dict[str, tuple[str, str]] = {
    "index": ("index", "int"),
    "uuid": ("uuid", "str"),
    "name": ("name", "str"),
    "pci.bus_id": ("pci_bus_id", "str"),
    "driver_version": ("driver_version", "str"),
    "memory.used": ("memory_used_mib", "float"),
    "memory.total": ("memory_total_mib", "float"),
    "utilization.gpu": ("utilization_pct", "float"),
    "utilization.memory": ("memory_utilization_pct", "float"),
    "temperature.gpu": ("temperature_c", "float"),
    "power.draw": ("power_draw_w", "float"),
    "power.limit": ("power_limit_w", "float"),
    "pstate": ("pstate", "str"),
    "clocks.sm": ("sm_clock_mhz", "float"),
    "clocks.current.sm": ("sm_clock_mhz", "float"),
    "clocks.max.sm": ("sm_clock_max_mhz", "float"),
    "clocks_event_reasons.active": ("clock_event_reasons", "hex"),
    "clocks_throttle_reasons.active": ("clock_event_reasons", "hex"),
    "ecc.mode.current": ("ecc_mode", "str"),
    "ecc.errors.uncorrected.volatile.total": ("ecc_uncorrected_volatile", "int"),
    "ecc.errors.corrected.volatile.total": ("ecc_corrected_volatile", "int"),
    "retired_pages.pending": ("retired_pages_pending", "bool"),
    "remapped_rows.pending": ("remapped_rows_pending", "bool"),
    "remapped_rows.failure": ("remapped_rows_failure", "bool"),
    "pcie.link.gen.current": ("pcie_gen_current", "int"),
    "pcie.link.gen.gpucurrent": ("pcie_gen_current", "int"),
    "pcie.link.gen.max": ("pcie_gen_max", "int"),
    "pcie.link.width.current": ("pcie_width_current", "int"),
    "pcie.link.width.max": ("pcie_width_max", "int"),
    "persistence_mode": ("persistence_mode", "bool"),
}


def _value(raw: str, kind: str) -> Any:
    text = raw.strip()
    if text.lower() in _NA:
        return None
    if kind == "str":
        return text
    if kind == "bool":
        lowered = text.lower()
        if lowered in ("yes", "enabled", "on", "true"):
            return True
        if lowered in ("no", "disabled", "off", "false"):
            return False
        return None
    if kind == "hex":
        return int(text, 16) if text.lower().startswith("0x") else int(text)
    match = _NUMBER.match(text)
    if not match:
        return None
    number = float(match.group(1))
    return int(number) if kind == "int" else number


def _rows(text: str) -> tuple[list[str], list[list[str]]]:
    reader = csv.reader(io.StringIO(text.strip()), skipinitialspace=True)
    lines = [row for row in reader if row]
    if not lines:
        return [], []
    header = [_UNIT.sub("", name.strip()) for name in lines[0]]
    return header, lines[1:]


def parse_query_gpu(text: str) -> list[GpuInfo]:
    """Parse `nvidia-smi --query-gpu=... --format=csv[,nounits]` (with its header line).

    Columns are read by name, with or without units, so the parser takes both what kdctl asks
    for and a capture someone made with their own field list.
    """
    header, rows = _rows(text)
    gpus = []
    for row in rows:
        fields: dict[str, Any] = {}
        for name, raw in zip(header, row, strict=False):
            column = _COLUMNS.get(name)
            if column and fields.get(column[0]) is None:
                fields[column[0]] = _value(raw, column[1])
        if fields.get("index") is not None:
            gpus.append(GpuInfo(**fields))
    return gpus


def parse_compute_apps(text: str, gpus: list[GpuInfo] | None = None) -> list[GpuProcess]:
    """Parse `nvidia-smi --query-compute-apps=pid,process_name,used_gpu_memory,gpu_uuid`."""
    header, rows = _rows(text)
    by_uuid = {g.uuid: g.index for g in gpus or [] if g.uuid}
    procs = []
    for row in rows:
        rec = dict(zip(header, (cell.strip() for cell in row), strict=False))
        pid = _value(rec.get("pid", ""), "int")
        uuid = rec.get("gpu_uuid", "")
        if pid is None or not uuid:
            continue
        procs.append(
            GpuProcess(
                pid=pid,
                process_name=rec.get("process_name", ""),
                used_memory_mib=_value(rec.get("used_gpu_memory", ""), "float"),
                gpu_uuid=uuid,
                gpu_index=by_uuid.get(uuid),
            )
        )
    return procs


def _query(transport: Transport, flag: str, fields: tuple[str, ...], timeout: float) -> str:
    result = transport.run(
        ["nvidia-smi", f"{flag}={','.join(fields)}", "--format=csv,nounits"], timeout=timeout
    )
    if not result.ok:
        detail = (result.stdout + result.stderr).strip().splitlines()
        raise _SmiFailed(result.exit_code, detail[-1] if detail else f"exit {result.exit_code}")
    return result.stdout


class _SmiFailed(Exception):
    def __init__(self, code: int, detail: str) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail


def probe_gpus(transport: Transport, *, timeout: float = 15.0) -> GpuProbe:
    """GPUs and their compute processes; a host without nvidia-smi has none, and says so."""
    try:
        try:
            text = _query(transport, "--query-gpu", GPU_FIELDS, timeout)
        except _SmiFailed as exc:
            if exc.code == 127:
                return GpuProbe(visible=False, note=NO_GPUS)
            if "not a valid field" not in exc.detail.lower():
                raise
            text = _query(transport, "--query-gpu", CORE_GPU_FIELDS, timeout)
        gpus = parse_query_gpu(text)
        if not gpus:
            return GpuProbe(visible=False, note=NO_GPUS)
        apps = _query(transport, "--query-compute-apps", APP_FIELDS, timeout)
        return GpuProbe(visible=True, gpus=gpus, processes=parse_compute_apps(apps, gpus))
    except _SmiFailed as exc:
        # nvidia-smi exists but the driver does not answer: that is a finding, not "no GPUs".
        return GpuProbe(visible=False, error=f"nvidia-smi failed: {exc.detail}")
    except TransportError as exc:
        return GpuProbe(visible=False, error=str(exc))
