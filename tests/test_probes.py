"""Host probes parsed against output recorded from the real nvidia-smi on an NVIDIA H200
(driver 580.159.04); no GPU is needed here. Edited copies stand for the failures.

h200-idle and h200-busy were captured with kdctl's own field lists (scripts/gpu-validate,
docs/gpu-validation.md): the GPU with nothing on it, then the same GPU with the reference
server's bf16 and fp32 engines on it answering the exactness gate, plus a timeline of samples
every 0.5 s through that run and the throughput gate."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from kdctl.inventory.models import CommandService
from kdctl.probes import (
    parse_compute_apps,
    parse_query_gpu,
    parse_xids,
    probe_gpus,
    probe_reachability,
    probe_service,
    probe_xids,
)
from kdctl.probes.gpus import APP_FIELDS, CORE_GPU_FIELDS, GPU_FIELDS, NO_GPUS
from kdctl.probes.services import parse_systemd_show
from kdctl.probes.topology import parse_topo
from kdctl.transports import LocalTransport
from tests.conftest import FIXTURES, H200

IDLE = FIXTURES / "nvidia-smi" / "h200-idle"
BUSY = FIXTURES / "nvidia-smi" / "h200-busy"
BUSY_UUID = "GPU-5f8e4153-1e95-a501-0466-2831a98f16f3"


def test_field_names_exist_in_the_drivers_help() -> None:
    helptext = (FIXTURES / "nvidia-smi" / "help-query-gpu.driver580.txt").read_text()
    # Lines such as `"uuid" or "gpu_uuid"` name a field and its aliases.
    quoted = {
        name
        for line in helptext.splitlines()
        if line.startswith('"')
        for name in re.findall(r'"([^"]+)"', line)
    }
    for name in (*GPU_FIELDS, *CORE_GPU_FIELDS):
        assert name in quoted, name
    # Compute-app fields live in another help page: the H200 answered a query of exactly
    # these fields, so its CSV header (units stripped) names them in order.
    header = (FIXTURES / "nvidia-smi" / "h200-busy" / "query-apps.csv").read_text()
    answered = [f.split(" [")[0].strip() for f in header.splitlines()[0].split(",")]
    assert tuple(answered) == APP_FIELDS


def test_query_gpu_capture_with_units() -> None:
    (gpu,) = parse_query_gpu((H200 / "query-gpu.csv").read_text())
    assert gpu.index == 0
    assert gpu.uuid == "GPU-153acc0c-7fe0-cdf5-d6c9-0c6edf250206"
    assert gpu.name == "NVIDIA H200"
    assert gpu.pci_bus_id == "00000000:00:06.0"
    assert gpu.driver_version == "580.159.04"
    assert (gpu.memory_used_mib, gpu.memory_total_mib) == (0, 143771)
    assert gpu.power_draw_w == pytest.approx(81.82)
    assert gpu.power_limit_w == 700
    assert gpu.utilization_pct == 0
    assert gpu.temperature_c == 36
    assert gpu.clock_event_reasons == 0x1  # idle only
    assert (gpu.pcie_gen_current, gpu.pcie_gen_max) == (5, 5)
    assert (gpu.pcie_width_current, gpu.pcie_width_max) == (16, 16)
    assert gpu.ecc_uncorrected_volatile == 0
    assert gpu.retired_pages_pending is None  # [N/A]: H200 remaps rows instead
    assert gpu.remapped_rows_pending is False and gpu.remapped_rows_failure is False
    assert gpu.persistence_mode is True
    assert gpu.sm_clock_mhz == 345 and gpu.sm_clock_max_mhz == 1980


def test_query_gpu_without_units_and_eight_gpus() -> None:
    row = (H200 / "query-gpu.csv").read_text().splitlines()
    header = (
        row[0].replace(" [W]", "").replace(" [MiB]", "").replace(" [%]", "").replace(" [MHz]", "")
    )
    body = row[1].replace(" W,", ",").replace(" MiB", "").replace(" %", "").replace(" MHz", "")
    lines = [header] + [body.replace("0, GPU-153", f"{i}, GPU-15{i}", 1) for i in range(8)]
    gpus = parse_query_gpu("\n".join(lines))
    assert [g.index for g in gpus] == list(range(8))
    assert gpus[7].power_draw_w == pytest.approx(81.82) and gpus[7].memory_total_mib == 143771


def test_busy_gpu_processes_map_to_indices() -> None:
    gpus = parse_query_gpu((H200 / "query-gpu.csv").read_text())
    assert parse_compute_apps((H200 / "query-apps.csv").read_text(), gpus) == []
    busy = (H200 / "query-apps.csv").read_text() + (
        "4242, python3, 80123 MiB, GPU-153acc0c-7fe0-cdf5-d6c9-0c6edf250206\n"
    )
    (proc,) = parse_compute_apps(busy, gpus)
    assert (proc.pid, proc.process_name, proc.used_memory_mib, proc.gpu_index) == (
        4242,
        "python3",
        80123,
        0,
    )


def test_kdctls_own_query_as_the_driver_answered_it() -> None:
    """The live captures asked for exactly GPU_FIELDS. The driver names `clocks.sm` back as
    `clocks.current.sm` and keeps the units in the header even with `nounits`; every column
    still lands, with units and without, and only the H200's retired-pages field is N/A."""
    for capture in (IDLE, BUSY):
        header = (capture / "query-gpu-nounits.csv").read_text().splitlines()[0]
        names = [re.sub(r"\s*\[[^\]]*\]$", "", n.strip()) for n in header.split(",")]
        assert len(names) == len(GPU_FIELDS)
        assert "clocks.current.sm" in names and "clocks.sm" not in names
        assert "memory.used [MiB]" in header  # units in the header of a nounits answer
        (bare,) = parse_query_gpu((capture / "query-gpu-nounits.csv").read_text())
        (units,) = parse_query_gpu((capture / "query-gpu.csv").read_text())
        assert {k for k, v in bare.model_dump().items() if v is None} == {"retired_pages_pending"}
        # Two samples a moment apart: the same GPU and settings; power and load may move.
        steady = {"power_draw_w", "temperature_c", "utilization_pct", "memory_used_mib"}
        assert bare.model_dump(exclude=steady) == units.model_dump(exclude=steady)


def test_the_same_h200_idle_then_busy() -> None:
    (idle,) = parse_query_gpu((IDLE / "query-gpu-nounits.csv").read_text())
    (busy,) = parse_query_gpu((BUSY / "query-gpu-nounits.csv").read_text())
    assert idle.uuid == busy.uuid == BUSY_UUID
    assert (idle.memory_used_mib, idle.sm_clock_mhz, idle.clock_event_reasons) == (0, 345, 0x1)
    assert idle.power_draw_w == pytest.approx(81.57)
    # Under load the idle bit clears, and no slowdown bit takes its place.
    assert (busy.memory_used_mib, busy.utilization_pct, busy.clock_event_reasons) == (10189, 4, 0)
    assert busy.sm_clock_mhz == busy.sm_clock_max_mhz == 1980
    assert busy.power_draw_w == pytest.approx(128.08) and busy.temperature_c == 42
    assert (busy.pcie_gen_current, busy.pcie_width_current) == (5, 16)
    assert parse_compute_apps((IDLE / "query-apps-nounits.csv").read_text(), [idle]) == []
    procs = parse_compute_apps((BUSY / "query-apps-nounits.csv").read_text(), [busy])
    assert [(p.pid, p.used_memory_mib, p.gpu_index) for p in procs] == [
        (538, 3700, 0),  # the bf16 server
        (540, 6474, 0),  # the fp32 server
    ]
    assert {p.process_name for p in procs} == {"/opt/torch/.venv/bin/python3"}
    assert parse_compute_apps((BUSY / "query-apps.csv").read_text(), [busy]) == procs
    assert sum(p.used_memory_mib or 0 for p in procs) <= (busy.memory_used_mib or 0)
    # nvidia-smi's own table lists the same processes and memory as the CSV kdctl reads.
    table = re.findall(
        r"\|\s+0\s+N/A\s+N/A\s+(\d+)\s+C\s+\S+\s+(\d+)MiB", (BUSY / "nvidia-smi.txt").read_text()
    )
    assert [(int(pid), int(mib)) for pid, mib in table] == [(538, 3700), (540, 6474)]


def test_busy_timeline_samples_parse_as_gpus() -> None:
    """Every 0.5 s through the exactness and throughput gates: a timestamp column kdctl does not
    know is skipped, and every sample shows a loaded GPU at full clock with nothing held back."""
    samples = parse_query_gpu((BUSY / "timeline.csv").read_text())
    assert len(samples) == 282 and {s.index for s in samples} == {0}
    assert max(s.utilization_pct or 0 for s in samples) == 23
    assert min(s.memory_used_mib or 0 for s in samples) >= 9985
    assert {(s.sm_clock_mhz, s.clock_event_reasons) for s in samples} == {(1980, 0)}
    assert {(s.pcie_gen_current, s.pcie_width_current) for s in samples} == {(5, 16)}


def test_probe_gpus_on_the_replayed_busy_h200(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", f"{FIXTURES / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setenv("KDCTL_NVSMI_FIXTURES", str(BUSY))
    probe = probe_gpus(LocalTransport("local"))
    assert probe.visible and probe.error is None
    assert [(g.uuid, g.memory_used_mib) for g in probe.gpus] == [(BUSY_UUID, 10189)]
    assert [(p.pid, p.gpu_index) for p in probe.processes] == [(538, 0), (540, 0)]
    xids = probe_xids(LocalTransport("local"))
    assert xids.readable and xids.events == []
    assert "NVRM: loading NVIDIA UNIX Open Kernel Module" in (BUSY / "dmesg-xid.txt").read_text()
    topo = parse_topo((BUSY / "topo.txt").read_text())
    assert (topo.gpus, topo.links, topo.error) == ([0], {}, None)


def test_xids_from_the_kernel_log() -> None:
    clean = (H200 / "dmesg-xid.txt").read_text()
    assert parse_xids(clean) == []  # NVRM lines, but no Xid among them
    edited = clean + (
        "[ 8812.101934] NVRM: Xid (PCI:0000:00:06): 79, pid=1234, name=python3, "
        "GPU has fallen off the bus.\n"
        "[ 8813.5] NVRM: Xid (PCI:0000:00:07): 48, pid='<unknown>', name=<unknown>, "
        "An uncorrectable double bit error\n"
    )
    first, second = parse_xids(edited)
    assert (first.code, first.pci, first.uptime_s) == (79, "PCI:0000:00:06", 8812.101934)
    assert "fallen off the bus" in first.detail
    assert second.code == 48


def _replay(tmp_path: Path, script: str) -> dict[str, str]:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    tool = bindir / "nvidia-smi"
    tool.write_text("#!/bin/sh\n" + script)
    tool.chmod(0o755)
    return {"PATH": f"{bindir}:{os.environ['PATH']}"}


def test_probe_gpus_through_a_transport(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", f"{FIXTURES / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setenv("KDCTL_NVSMI_FIXTURES", str(H200))
    probe = probe_gpus(LocalTransport("local"))
    assert probe.visible and [g.name for g in probe.gpus] == ["NVIDIA H200"]
    assert probe.processes == [] and probe.error is None
    xids = probe_xids(LocalTransport("local"))
    assert xids.readable and xids.source == "dmesg" and xids.events == []


def test_host_without_nvidia_smi_has_no_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    probe = probe_gpus(LocalTransport("local"))
    assert (probe.visible, probe.note, probe.error) == (False, NO_GPUS, None)


def test_broken_driver_is_an_error_not_no_gpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = _replay(
        tmp_path,
        'echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver."\n'
        "exit 9\n",
    )
    monkeypatch.setenv("PATH", env["PATH"])
    probe = probe_gpus(LocalTransport("local"))
    assert not probe.visible and probe.note is None
    assert probe.error and "couldn't communicate with the NVIDIA driver" in probe.error


def test_older_driver_falls_back_to_core_fields(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = _replay(
        tmp_path,
        'case "$1" in *clocks_event_reasons*) echo \'Field "clocks_event_reasons.active" '
        "is not a valid field to query.'; exit 2;; esac\n"
        'case "$1" in --query-gpu=*) printf "index, uuid, name, memory.used [MiB], '
        'memory.total [MiB], utilization.gpu [%%]\\n0, GPU-1, Tesla V100, 10, 16384, 3\\n";; '
        '*) printf "pid, process_name, used_gpu_memory [MiB], gpu_uuid\\n";; esac\n',
    )
    monkeypatch.setenv("PATH", env["PATH"])
    probe = probe_gpus(LocalTransport("local"))
    assert probe.visible, probe
    assert probe.gpus[0].name == "Tesla V100" and probe.gpus[0].clock_event_reasons is None


def test_reachability_of_the_local_host() -> None:
    reach = probe_reachability(LocalTransport("local"))
    assert reach.reachable and reach.rtt_ms is not None and reach.rtt_ms > 0


def test_command_service_states(tmp_path: Path) -> None:
    t = LocalTransport("local")
    pidfile = tmp_path / "engine.pid"
    service = CommandService(command="sleep 300", pidfile=str(pidfile), log=str(tmp_path / "log"))
    assert probe_service(t, service).state == "stopped"  # no pidfile: not running, not an error
    proc = subprocess.Popen(["sleep", "300"])
    try:
        pidfile.write_text(f"{proc.pid}\n")
        state = probe_service(t, service)
        assert (state.state, state.pid) == ("running", proc.pid)
        other = CommandService(command="kdtree-serve", pidfile=str(pidfile), log="/dev/null")
        reused = probe_service(t, other)
        assert reused.state == "stopped" and "stale pidfile" in (reused.detail or "")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    time.sleep(0.05)
    assert probe_service(t, service).detail == "stale pidfile"
    pidfile.write_text("garbage")
    assert probe_service(t, service).state == "unknown"


def test_systemd_show_parsing() -> None:
    # The property set `systemctl show --property=...` prints for a running unit.
    running = parse_systemd_show(
        "sglang.service",
        {
            "LoadState": "loaded",
            "ActiveState": "active",
            "SubState": "running",
            "MainPID": "8812",
            "Result": "success",
        },
    )
    assert (running.state, running.pid, running.detail) == ("running", 8812, "active/running")
    failed = parse_systemd_show(
        "sglang.service",
        {
            "LoadState": "loaded",
            "ActiveState": "failed",
            "SubState": "failed",
            "MainPID": "0",
            "Result": "exit-code",
        },
    )
    assert failed.state == "failed" and failed.pid is None and "exit-code" in (failed.detail or "")
    assert parse_systemd_show("x.service", {"LoadState": "not-found"}).state == "unknown"
    assert (
        parse_systemd_show("x.service", {"LoadState": "loaded", "ActiveState": "activating"}).state
        == "starting"
    )


def test_systemd_state_change_time() -> None:
    """When a unit last changed state, in the two forms systemd prints it: `@SECONDS` under
    `--timestamp=unix` (systemd 248 and later), else its own clock text, taken only in UTC (a
    zone abbreviation such as CET does not say its offset). No systemd runs here: the values
    are written as systemd(1)'s `systemctl show` prints them."""
    stopped = {"LoadState": "loaded", "ActiveState": "inactive", "SubState": "dead"}
    unix = parse_systemd_show("sglang.service", {**stopped, "StateChangeTimestamp": "@1796116320"})
    assert unix.state == "stopped"
    assert unix.since == datetime(2026, 12, 1, 9, 12, tzinfo=timezone.utc)
    utc = parse_systemd_show(
        "sglang.service", {**stopped, "StateChangeTimestamp": "Tue 2026-12-01 09:12:00 UTC"}
    )
    assert utc.since == unix.since
    cet = parse_systemd_show(
        "sglang.service", {**stopped, "StateChangeTimestamp": "Tue 2026-12-01 10:12:00 CET"}
    )
    assert cet.since is None
    assert parse_systemd_show("x.service", {**stopped, "StateChangeTimestamp": ""}).since is None
