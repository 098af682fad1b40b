"""tp-health: the all-reduce probe on gloo across CPU processes (the same code that runs on
NCCL), its watchdog, and the GPU rules on the H200's recorded nvidia-smi output and edited
copies of it, replayed on the host the gate runs on; and the whole gate on the H200 captured
busy under the reference engine, with the report its NCCL probe printed there."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from kdctl.checks.tp_health import (
    gpu_findings,
    memory_findings,
    probe_failure,
    topology_findings,
)
from kdctl.probes.gpus import parse_compute_apps, parse_query_gpu
from kdctl.probes.topology import parse_topo
from tests.conftest import FIXTURES, kdctl, need_module, write_inventory
from tests.support.sshd import SshdFleet

need_module("torch", "reference")
H200 = FIXTURES / "nvidia-smi" / "h200-1gpu"
IDLE = FIXTURES / "nvidia-smi" / "h200-idle"
BUSY = FIXTURES / "nvidia-smi" / "h200-busy"
REPLAY = FIXTURES / "bin"
FAULTS = FIXTURES / "h200-faults"
XID_79 = (
    "[ 8812.101934] NVRM: Xid (PCI:0000:00:06): 79, pid=2231, name=python, "
    "GPU has fallen off the bus."
)


def inventory(tmp_path: Path, *, tp: int, gpus: int = 0, **settings: Any) -> Path:
    return write_inventory(
        tmp_path / "inventory.yaml",
        {
            "hosts": {"box": {"transport": "local", "gpus": gpus}},
            "backends": {
                "engine": {
                    "kind": "sglang",
                    "host": "box",
                    "url": "http://127.0.0.1:9",
                    "tp_size": tp,
                    **({"gpus": list(range(gpus))} if gpus else {}),
                }
            },
            "gates": {
                "tp_health": {
                    "python": sys.executable,
                    "large_size_mib": 2,
                    "small_size_kib": 16,
                    "iters": 5,
                    "warmup": 2,
                    "min_busbw_gbps": 0.001,
                    "max_small_latency_us": 1_000_000,
                    "timeout_s": 90,
                    **settings,
                }
            },
            "state_dir": "state",
        },
    )


def busy_inventory(tmp_path: Path) -> Path:
    """One rank on the busy H200's GPU, its NCCL probe replayed, with the budgets it ran under."""
    return inventory(
        tmp_path,
        tp=1,
        gpus=1,
        python=str(REPLAY / "allreduce-replay"),
        max_small_latency_us=30,
        min_busbw_gbps=35,
    )


def tp_health(inv: Path, env: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    run = kdctl("gate", "run", "tp-health", "-b", "engine", "-i", str(inv), "--json", env=env)
    assert run.out, run.err
    (result,) = json.loads(run.out)["results"]
    return run.code, result


def test_allreduce_on_gloo_across_cpu_ranks(tmp_path: Path, report: Any) -> None:
    """TP 8, the box's shape, as eight CPU ranks on gloo."""
    ranks = 8
    env = {"NCCL_VERSION": "2.28.3-1", "NCCL_DEBUG": "WARN"}
    code, result = tp_health(inventory(tmp_path, tp=ranks), env=env)
    assert code == 0 and result["verdict"] == "pass", result["reasons"]
    probe = result["details"]["allreduce"]
    assert (probe["backend"], probe["world"]) == ("gloo", ranks)
    small, large = probe["points"]
    assert (small["bytes"], large["bytes"]) == (16 << 10, 2 << 20)
    assert small["wrong"] == large["wrong"] == 0
    # busbw rescales algbw by 2(n-1)/n, nccl-tests' all_reduce factor.
    assert large["busbw_gbps"] == pytest.approx(
        large["algbw_gbps"] * 2 * (ranks - 1) / ranks, abs=2e-3
    )
    assert small["timer"] == "wall-clock" and small["wall_us"] == small["time_us"]
    # NCCL_VERSION is the CUDA image's label, not a setting: only the variables NCCL reads.
    assert probe["env"].get("NCCL_DEBUG") == "WARN" and "NCCL_VERSION" not in probe["env"]
    assert any("has no GPUs" in r for r in result["reasons"])
    report(
        f"tp-health on gloo, {ranks} CPU ranks: busbw {large['busbw_gbps']} GB/s at 2 MiB, "
        f"{small['time_us']} us at 16 KiB"
    )


def test_one_rank_without_gpus_measures_nothing_and_says_so(tmp_path: Path) -> None:
    """The sandbox's box: no GPU, one rank. No GPU rule applies and an all-reduce over one rank
    crosses no link, so there is nothing to judge: skipped, saying why, never a pass with a bus
    bandwidth of 0 GB/s."""
    code, result = tp_health(inventory(tmp_path, tp=1))
    assert result["verdict"] == "skipped" and code == 0, result["reasons"]
    (reason,) = result["reasons"]
    assert "box shows no GPUs and engine runs one rank" in reason
    assert "no bus bandwidth or latency to measure" in reason
    assert result["metrics"] == [] and "allreduce" not in result["details"]


def test_a_rank_that_never_joins_trips_the_watchdog(tmp_path: Path) -> None:
    inv = inventory(tmp_path, tp=4, timeout_s=12)
    code, result = tp_health(inv, env={"KDCTL_PROBE_STALL_RANK": "2"})
    assert code == 1 and result["verdict"] == "fail"
    assert any("did not finish within 12s" in r for r in result["reasons"])
    # The watchdog takes the whole torchrun process group down with it: none of this run's
    # ranks is left (they carry its stall variable; other tests' probes may run meanwhile).
    assert _stalled_probes() == []


def _stalled_probes() -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
            environ = (proc / "environ").read_bytes()
        except OSError:
            continue
        if b"kdctl-allreduce-" in cmdline and b"KDCTL_PROBE_STALL_RANK=2" in environ:
            found.append(int(proc.name))
    return found


def test_thresholds_decide(tmp_path: Path) -> None:
    code, result = tp_health(inventory(tmp_path, tp=2, min_busbw_gbps=10_000))
    assert code == 1 and any("busbw_gbps" in r and ">= 10000" in r for r in result["reasons"])


def _copy_capture(tmp_path: Path, *, edit: dict[str, str] | None = None, apps: str = "") -> Path:
    d = tmp_path / "capture"
    shutil.copytree(H200, d)
    header, row = (H200 / "query-gpu.csv").read_text().splitlines()
    cells = [c.strip() for c in row.split(",")]
    names = [n.strip() for n in header.split(",")]
    for field, value in (edit or {}).items():
        cells[next(i for i, n in enumerate(names) if n.startswith(field))] = value
    (d / "query-gpu.csv").write_text(header + "\n" + ", ".join(cells) + "\n")
    (d / "query-apps.csv").write_text((H200 / "query-apps.csv").read_text() + apps)
    return d


def _replay_env(capture: Path) -> dict[str, str]:
    return {"PATH": f"{REPLAY}:{os.environ['PATH']}", "KDCTL_NVSMI_FIXTURES": str(capture)}


ENGINE_ON_GPU0 = "4242, python, 130000 MiB, GPU-153acc0c-7fe0-cdf5-d6c9-0c6edf250206\n"


def test_gpu_rules_on_the_h200_capture_and_edited_copies(tmp_path: Path) -> None:
    healthy = parse_query_gpu((H200 / "query-gpu.csv").read_text())
    assert gpu_findings(healthy, [0]) == []
    assert gpu_findings(healthy, [0, 1]) == ["GPU 1 expected but not visible"]
    cases = {
        "ecc.errors.uncorrected.volatile.total": ("3", "3 uncorrected ECC errors"),
        "clocks_event_reasons.active": ("0x0000000000000040", "hardware thermal slowdown"),
        "remapped_rows.pending": ("Yes", "row remap is pending"),
        "remapped_rows.failure": ("Yes", "row remapping failed"),
        "persistence_mode": ("Disabled", "persistence mode is off"),
    }
    for field, (value, finding) in cases.items():
        capture = _copy_capture(tmp_path / field, edit={field: value})
        (gpu,) = parse_query_gpu((capture / "query-gpu.csv").read_text())
        assert any(finding in f for f in gpu_findings([gpu], [0])), field
    # A busy GPU (no idle bit) whose link trained below its max is a finding; an idle one is not.
    capture = _copy_capture(
        tmp_path / "pcie",
        edit={"pcie.link.gen.current": "3", "clocks_event_reasons.active": "0x0000000000000000"},
    )
    (gpu,) = parse_query_gpu((capture / "query-gpu.csv").read_text())
    assert gpu_findings([gpu], [0]) == ["GPU 0: PCIe generation 3 below its max 5"]
    assert gpu_findings([gpu.model_copy(update={"clock_event_reasons": 1})], [0]) == []


def test_memory_and_topology_rules() -> None:
    gpus = parse_query_gpu((H200 / "query-gpu.csv").read_text())
    busy = parse_compute_apps(
        "pid, process_name, used_gpu_memory [MiB], gpu_uuid\n" + ENGINE_ON_GPU0, gpus
    )
    assert memory_findings(busy, [0]) == []
    assert memory_findings([], [0]) == [
        "GPU 0: no process holds memory (is the engine running on this rank?)"
    ]
    one = parse_topo((H200 / "topo.txt").read_text())
    assert one.gpus == [0] and topology_findings(one, [0], require_nvlink=True) == []
    mixed = parse_topo(
        "\tGPU0\tGPU1\tGPU2\tCPU Affinity\nGPU0\t X \tNV18\tNV18\t0-15\n"
        "GPU1\tNV18\t X \tSYS\t0-15\nGPU2\tNV18\tSYS\t X \t0-15\n"
    )
    assert topology_findings(mixed, [0, 1, 2], require_nvlink=True) == [
        "GPU 1 and GPU 2 are linked by SYS, not NVLink"
    ]


def test_gate_on_a_replayed_h200_host(tmp_path: Path) -> None:
    """The whole gate on the recorded H200: GPU rules pass, but no engine holds memory and
    this machine's torch has no CUDA, so the NCCL probe fails, and both are named; then an Xid
    79 appears in the kernel log and is reported as new, once."""
    capture = _copy_capture(tmp_path)
    inv = inventory(tmp_path, tp=1, gpus=1)
    code, result = tp_health(inv, env=_replay_env(capture))
    assert code == 1 and result["verdict"] == "fail"
    reasons = " | ".join(result["reasons"])
    assert "GPU 0: no process holds memory" in reasons
    assert "all-reduce probe failed" in reasons and "expected but not visible" not in reasons
    assert result["metrics"][0] == {**result["metrics"][0], "name": "new_xids", "value": 0}

    with (capture / "dmesg-xid.txt").open("a") as log:
        log.write(XID_79 + "\n")
    (capture / "query-apps.csv").write_text((H200 / "query-apps.csv").read_text() + ENGINE_ON_GPU0)
    # The probe's part is told above: from here its NCCL report is the busy H200's, replayed,
    # rather than two more failing torch runs.
    shutil.copy(BUSY / "allreduce-nccl.txt", capture)
    inv = inventory(tmp_path, tp=1, gpus=1, python=str(REPLAY / "allreduce-replay"))
    code, result = tp_health(inv, env=_replay_env(capture))
    reasons = " | ".join(result["reasons"])
    assert f"new Xid: {XID_79}" in reasons and "no process holds memory" not in reasons
    code, result = tp_health(inv, env=_replay_env(capture))
    assert "new Xid" not in " | ".join(result["reasons"])


def test_gpu_rules_on_the_live_idle_and_busy_captures() -> None:
    """The captures' GPU passes every rule, idle and busy. Busy, with the idle bit clear, its
    PCIe link is judged, and held at gen 5 x16 under load; only the busy one has an engine."""
    (idle,) = parse_query_gpu((IDLE / "query-gpu-nounits.csv").read_text())
    (busy,) = parse_query_gpu((BUSY / "query-gpu-nounits.csv").read_text())
    assert not (busy.clock_event_reasons or 0) & 0x1
    assert gpu_findings([idle], [0]) == gpu_findings([busy], [0]) == []
    trained_down = busy.model_copy(update={"pcie_width_current": 8})
    assert gpu_findings([trained_down], [0]) == ["GPU 0: PCIe width 8 below its max 16"]
    procs = parse_compute_apps((BUSY / "query-apps-nounits.csv").read_text(), [busy])
    assert memory_findings(procs, [0]) == []
    assert memory_findings(parse_compute_apps((IDLE / "query-apps-nounits.csv").read_text()), [0])


def test_gate_on_the_replayed_busy_h200(tmp_path: Path) -> None:
    """The whole gate on the busy H200, with one rank as it ran there: GPU rules from the
    replayed nvidia-smi, the engines' memory, no Xid, and rank 0's NCCL report as the real
    probe printed it (its host's python3 replayed). It passes on what was measured there; over
    one rank no link is crossed, so bus bandwidth is not measured (not 0 GB/s) and neither the
    sums nor the latency of torch's no-op launch (57 us, against a 30 us budget for a link) is
    judged."""
    inv = busy_inventory(tmp_path)
    code, result = tp_health(inv, env=_replay_env(BUSY))
    assert code == 0 and result["verdict"] == "pass", result["reasons"]
    metrics = {m["name"]: (m["value"], m["threshold"]) for m in result["metrics"]}
    assert metrics == {
        "new_xids": (0, 0),
        "gpus_visible": (1, None),
        "allreduce_wrong_elements": (0, None),
        "busbw_gbps": (None, None),
        "small_latency_us": (57.131, None),  # torch's launch of a one-rank no-op
    }
    # No service in the inventory: whose memory it is cannot be told, and the result says so.
    assert result["reasons"][0] == (
        "engine memory: any process's counts; engine's processes could not be told apart (no "
        "service in the inventory, or its state unknown)"
    )
    assert result["reasons"][1].startswith(
        "all-reduce on nccl on one rank: it runs, 57.1 us at 16 KiB; NCCL 2.28.9"
    )
    assert result["reasons"][2] == (
        "one rank: no link is crossed, so bus bandwidth was not measured, and neither the sums "
        "nor the small-message latency is judged"
    )
    assert not any("GB/s" in r for r in result["reasons"])
    assert len(result["details"]["gpu_probe"]["processes"]) == 2
    small = result["details"]["allreduce"]["points"][0]
    assert (small["timer"], small["wall_us"]) == ("cuda-events", 89.248)

    # The engines gone (the idle capture's empty process list): the same box fails.
    capture = tmp_path / "stopped"
    shutil.copytree(BUSY, capture)
    shutil.copy(IDLE / "query-apps-nounits.csv", capture / "query-apps-nounits.csv")
    code, result = tp_health(inv, env=_replay_env(capture))
    assert code == 1 and result["reasons"][0] == (
        "GPU 0: no process holds memory (is the engine running on this rank?)"
    )


def test_engine_memory_is_the_engines_own_processes(tmp_path: Path) -> None:
    """With a service in the inventory, memory on a TP GPU counts only when the engine's own
    process tree holds it: the busy H200 replayed, its two processes relabelled first as a
    child of the engine's running service here, then left as another program's."""
    engine = subprocess.Popen(["sh", "-c", "sleep 120 & wait"])
    try:
        time.sleep(0.3)
        child = int(
            subprocess.run(
                ["ps", "-o", "pid=", "--ppid", str(engine.pid)],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.split()[0]
        )
        pidfile = tmp_path / "engine.pid"
        pidfile.write_text(str(engine.pid))
        inv = busy_inventory(tmp_path)
        data = yaml.safe_load(inv.read_text())
        data["backends"]["engine"]["service"] = {
            "command": "sh -c 'sleep 120 & wait'",
            "pidfile": str(pidfile),
            "log": str(tmp_path / "engine.log"),
        }
        write_inventory(inv, data)
        apps = (BUSY / "query-apps-nounits.csv").read_text()
        owned = tmp_path / "owned"
        shutil.copytree(BUSY, owned)
        (owned / "query-apps-nounits.csv").write_text(apps.replace("538,", f"{child},", 1))
        code, result = tp_health(inv, env=_replay_env(owned))
        assert code == 0 and result["verdict"] == "pass", result["reasons"]
        assert not any("any process's counts" in r for r in result["reasons"])
        code, result = tp_health(inv, env=_replay_env(BUSY))
        assert code == 1, result["reasons"]
        assert result["reasons"][0] == (
            "GPU 0: memory is held by pid 538, 540, none of them in the engine's process tree "
            "(another engine on this rank, or one in a container?)"
        )
    finally:
        engine.kill()
        engine.wait()


def test_a_kernel_log_it_cannot_read_is_not_taken_for_no_xids(fleet: SshdFleet) -> None:
    """The busy H200 replayed behind a real sshd whose login is not root, with the kernel's own
    dmesg (kernel.dmesg_restrict) and journalctl: neither lets it read the log. Every other
    rule holds, but no new Xid is not shown, so the gate cannot pass."""
    if Path("/proc/sys/kernel/dmesg_restrict").read_text().strip() != "1":
        pytest.skip("kernel.dmesg_restrict is off: the test login can read the kernel log")
    # nvidia-smi replayed; dmesg and journalctl the system's own.
    tools = fleet.root / "nvidia-smi-only"
    tools.mkdir(exist_ok=True)
    if not (tools / "nvidia-smi").exists():
        (tools / "nvidia-smi").symlink_to(REPLAY / "nvidia-smi")
    name = "gpu-restricted-log"
    if name not in fleet.hosts:
        fleet.add(
            name,
            env={
                "PATH": f"{tools}:/usr/local/bin:/usr/bin:/bin",
                "KDCTL_NVSMI_FIXTURES": str(BUSY),
            },
        )
    inv = write_inventory(
        fleet.root / "restricted-log.yaml",
        {
            "hosts": {"box": fleet.host_entry(name, gpus=1)},
            "backends": {
                "engine": {
                    "kind": "sglang",
                    "host": "box",
                    "url": "http://127.0.0.1:9",
                    "tp_size": 1,
                    "gpus": [0],
                }
            },
            "gates": {"tp_health": {"python": str(REPLAY / "allreduce-replay"), "timeout_s": 60}},
            "state_dir": str(fleet.root / "restricted-log-state"),
        },
    )
    code, result = tp_health(inv)
    assert code == 1 and result["verdict"] == "inconclusive", result["reasons"]
    metrics = {m["name"]: (m["value"], m["threshold"]) for m in result["metrics"]}
    assert metrics["new_xids"] == (None, 0)
    reasons = " | ".join(result["reasons"])
    assert "dmesg: dmesg: read kernel buffer failed: Operation not permitted" in reasons
    assert "new_xids was not measured: '== 0' could not be judged" in reasons
    assert result["details"]["xid_lines"] == []


def test_why_the_probe_failed_on_the_h200_when_a_rank_had_no_gpu() -> None:
    """torchrun's own stderr on the H200 (two ranks, one GPU): its summary says only that a
    child failed; the cause is the rank's exception, printed earlier."""
    stderr = (FAULTS / "torchrun-missing-gpu.stderr").read_text()
    assert "ChildFailedError" in stderr
    why = probe_failure(stderr)
    assert why == "rank 1 exited 1: torch.AcceleratorError: CUDA error: invalid device ordinal"
    # The gate said the same there (scripts/gpu-validate faults), beside the missing GPU.
    (live,) = json.loads((FAULTS / "tp-health-missing-gpu.json").read_text())["results"]
    assert live["verdict"] == "fail"
    assert "GPU 1 expected but not visible" in live["reasons"]
    assert f"all-reduce probe failed (exit 1): {why}" in live["reasons"]
    # With no summary at all, the last lines are still shown rather than nothing.
    assert probe_failure("boom\nsegfault") == "boom | segfault"


def test_the_watchdog_on_the_h200_left_nothing_on_the_gpu() -> None:
    (live,) = json.loads((FAULTS / "tp-health-stalled-rank.json").read_text())["results"]
    assert live["verdict"] == "fail"
    assert any("did not finish within 20s" in r for r in live["reasons"])
    apps = parse_compute_apps((FAULTS / "apps-after-watchdog.csv").read_text())
    assert apps == []


def test_gpus_the_inventory_does_not_name_are_not_checked_as_the_engines(tmp_path: Path) -> None:
    """The host shows GPUs, but neither the backend nor the host names any: the rules looked
    at none of the engine's ranks, and the gate says so instead of passing on them."""
    capture = _copy_capture(tmp_path)
    inv = inventory(tmp_path, tp=1, gpus=0)
    code, result = tp_health(inv, env=_replay_env(capture))
    assert code == 1 and result["verdict"] != "pass", result
    reasons = " | ".join(result["reasons"])
    assert "no GPUs named for engine (backends.engine.gpus, or the host's gpus)" in reasons
    metrics = {m["name"]: m for m in result["metrics"]}
    assert metrics["gpus_checked"]["value"] is None and metrics["gpus_checked"]["threshold"] == 1
