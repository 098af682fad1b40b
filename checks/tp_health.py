"""tp-health: is the box fit to run the backend across its TP ranks?

On the backend's host, through its transport: GPU rules from nvidia-smi, Xids since the last
check, the topology, an all-reduce probe launched with torchrun across the TP ranks (NCCL on
GPUs, gloo across CPU processes where there are none, the same code either way) under a
wall-clock watchdog, and whether the engine holds memory on every one of its GPUs (unless
`engine_memory: false`: the box checked before the engine can run on it).
"""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import uuid
from datetime import timedelta
from importlib.resources import files
from pathlib import Path
from typing import Any

from kdctl.checks._base import Gate, GateContext, engine_now
from kdctl.errors import CommandTimeout, KdctlError, TransportError
from kdctl.inventory.models import TpHealthSettings
from kdctl.probes.gpus import GpuInfo, GpuProbe, GpuProcess, probe_gpus
from kdctl.probes.kernel import XidProbe, probe_xids
from kdctl.probes.services import probe_service
from kdctl.probes.topology import Topology, probe_topology
from kdctl.records import GateResult, Metric, decide, not_measured, utcnow
from kdctl.transports import Transport

# nvml's clocks_event_reasons bits (nvml.h); 0x1 (idle) is the only one that is not a slowdown.
CLOCK_EVENTS = {
    0x2: "applications clocks setting",
    0x4: "software power cap",
    0x8: "hardware slowdown",
    0x10: "sync boost",
    0x20: "software thermal slowdown",
    0x40: "hardware thermal slowdown",
    0x80: "hardware power brake",
}
PROBE_MARK = "KDCTL_ALLREDUCE "


def gpu_findings(gpus: list[GpuInfo], expected: list[int]) -> list[str]:
    """What is wrong with the GPUs a backend runs on; empty when nothing is."""
    found: list[str] = []
    by_index = {g.index: g for g in gpus}
    missing = [i for i in expected if i not in by_index]
    if missing:
        found.append(f"GPU {', '.join(map(str, missing))} expected but not visible")
    for i in expected:
        g = by_index.get(i)
        if g is None:
            continue
        if g.ecc_uncorrected_volatile:
            found.append(f"GPU {i}: {g.ecc_uncorrected_volatile} uncorrected ECC errors")
        if g.remapped_rows_pending:
            found.append(f"GPU {i}: a row remap is pending (the GPU needs a reset)")
        if g.remapped_rows_failure:
            found.append(f"GPU {i}: row remapping failed")
        if g.retired_pages_pending:
            found.append(f"GPU {i}: a page retirement is pending")
        reasons = [name for bit, name in CLOCK_EVENTS.items() if (g.clock_event_reasons or 0) & bit]
        if reasons:
            found.append(f"GPU {i}: clocks held back by {', '.join(reasons)}")
        idle = bool((g.clock_event_reasons or 0) & 0x1)
        for what, cur, top in (
            ("PCIe generation", g.pcie_gen_current, g.pcie_gen_max),
            ("PCIe width", g.pcie_width_current, g.pcie_width_max),
        ):
            # An idle GPU may train its link down to save power: only a busy one is judged.
            if cur is not None and top is not None and cur < top and not idle:
                found.append(f"GPU {i}: {what} {cur} below its max {top}")
        if g.persistence_mode is False:
            found.append(f"GPU {i}: persistence mode is off")
    return found


def topology_findings(topo: Topology, gpus: list[int], require_nvlink: bool) -> list[str]:
    if not require_nvlink or len(gpus) < 2:
        return []
    if topo.error:
        return [f"topology unreadable: {topo.error}"]
    found = []
    for a in gpus:
        for b in gpus:
            link = topo.link(a, b) if a < b else "NV"
            if link is None or not link.startswith("NV"):
                found.append(f"GPU {a} and GPU {b} are linked by {link or 'nothing'}, not NVLink")
    return found


def memory_findings(
    processes: list[GpuProcess], gpus: list[int], engine: set[int] | None = None
) -> list[str]:
    """The engine runs on all its ranks only if its processes hold memory on every TP GPU.
    `engine` is its process tree (main pid and descendants); None where it cannot be told
    apart, and then any process's memory counts, which the gate says."""
    found = []
    for i in gpus:
        here = sorted(p.pid for p in processes if p.gpu_index == i and (p.used_memory_mib or 0))
        if not here:
            found.append(f"GPU {i}: no process holds memory (is the engine running on this rank?)")
        elif engine is not None and not engine:
            found.append(f"GPU {i}: memory is held, but the engine's service is stopped")
        elif engine is not None and not engine.intersection(here):
            found.append(
                f"GPU {i}: memory is held by pid {', '.join(map(str, here))}, none of them in "
                "the engine's process tree (another engine on this rank, or one in a container?)"
            )
    return found


def engine_processes(transport: Transport, service: Any) -> set[int] | None:
    """The engine's process tree on its host, from its service's main pid: TP ranks are its
    children. None where the inventory names no service or it shows no pid; empty where the
    service is not running."""
    if service is None:
        return None
    state = probe_service(transport, service)
    if state.state == "stopped":
        return set()
    if state.state != "running" or state.pid is None:
        return None  # unknown or starting: whose memory it is cannot be told
    try:
        listed = transport.run(["ps", "-e", "-o", "pid=,ppid="], timeout=10)
    except KdctlError:
        return None
    if not listed.ok:
        return None
    children: dict[int, list[int]] = {}
    for line in listed.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            children.setdefault(int(parts[1]), []).append(int(parts[0]))
    tree, todo = set(), [state.pid]
    while todo:
        pid = todo.pop()
        if pid not in tree:
            tree.add(pid)
            todo += children.get(pid, [])
    return tree


def new_xids(xids: XidProbe, previous: GateResult | None) -> tuple[list[str], list[str]]:
    """(new Xid lines since the last tp-health check, problems reading the log)."""
    if not xids.readable:
        return [], [f"Xids: {xids.error}"]
    seen = set(previous.details.get("xid_lines", [])) if previous else set()
    return [e.line for e in xids.events if e.line not in seen], []


def probe_command(
    settings: TpHealthSettings, script: str, world: int, backend: str, gpus: list[int]
) -> list[str]:
    large = int(settings.large_size_mib * (1 << 20))
    small = int(settings.small_size_kib * (1 << 10))
    # coreutils' timeout is the watchdog on the host itself: it signals torchrun, which takes
    # its workers down with it, and then kills it outright; exit 124 says it fired.
    argv = ["timeout", "-k", "10", f"{settings.timeout_s:g}", "env"]
    if gpus:
        argv.append("CUDA_VISIBLE_DEVICES=" + ",".join(map(str, gpus)))
    argv += [
        settings.python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={world}",
        script,
        f"--backend={backend}",
        f"--iters={settings.iters}",
        f"--warmup={settings.warmup}",
        f"--init-timeout-s={settings.timeout_s:g}",
        "--sizes",
        str(small),
        str(large),
    ]
    return argv


def run_allreduce(
    transport: Transport, settings: TpHealthSettings, world: int, backend: str, gpus: list[int]
) -> dict[str, Any]:
    """Copy the probe to the host, run it under the watchdog, and read rank 0's report."""
    local = Path(str(files("kdctl.checks").joinpath("_allreduce_probe.py")))
    remote = f"/tmp/kdctl-allreduce-{uuid.uuid4().hex[:12]}.py"
    transport.put(local, remote, mode=0o600)
    try:
        argv = probe_command(settings, remote, world, backend, gpus)
        result = transport.run(argv, timeout=settings.timeout_s + 30)
    finally:
        with contextlib.suppress(TransportError):
            transport.run(["rm", "-f", remote], timeout=15)
    if result.exit_code in (124, 137):
        raise CommandTimeout(transport.name, tuple(argv), settings.timeout_s)
    line = next((ln for ln in result.stdout.splitlines() if ln.startswith(PROBE_MARK)), None)
    if not result.ok or line is None:
        raise _ProbeFailed(
            f"all-reduce probe failed (exit {result.exit_code}): "
            + probe_failure(result.stderr)[:400],
            " ".join(shlex.quote(a) for a in argv),
        )
    report: dict[str, Any] = json.loads(line[len(PROBE_MARK) :])
    report["command"] = " ".join(shlex.quote(a) for a in argv)
    return report


# torchrun's summary names the first rank that failed; the rank's own traceback, printed above
# it, ends in the exception that says why.
_ROOT_RANK = re.compile(r"Root Cause.*?\brank\s*:\s*(\d+).*?\bexitcode\s*:\s*(-?\d+)", re.S)
_EXCEPTION = re.compile(r"^(?:\[rank\d+\]:\s*)?((?:[A-Za-z_]\w*\.)*\w*(?:Error|Exception)\b.*)$")


def probe_failure(stderr: str) -> str:
    """Why the probe failed, from its stderr: the root-cause rank torchrun names and the last
    exception a rank raised; torchrun's own ChildFailedError says nothing of the cause."""
    root = _ROOT_RANK.search(stderr)
    causes = [
        m.group(1).strip()
        for line in stderr.splitlines()
        if (m := _EXCEPTION.match(line.strip())) and "ChildFailedError" not in m.group(1)
    ]
    parts = []
    if root:
        parts.append(f"rank {root.group(1)} exited {root.group(2)}")
    if causes:
        parts.append(causes[-1])
    if not parts:
        lines = stderr.strip().splitlines()
        return " | ".join(lines[-3:]) if lines else "no output"
    return ": ".join(parts)


def allreduce_metrics(
    report: dict[str, Any], settings: TpHealthSettings, world: int
) -> list[Metric]:
    """The probe's figures as metrics. Over one rank nothing crosses a link: the sums come back
    unchanged whatever the box, there is no bus bandwidth (0 by definition is no measurement),
    and the small all-reduce times torch's launch of a no-op (35 us on an idle H200, 57 us
    beside a busy engine), so no threshold judges them."""
    small, large = report["points"][0], report["points"][-1]
    wrong = sum(p["wrong"] for p in report["points"])
    across = world > 1
    return [
        Metric(
            name="allreduce_wrong_elements",
            value=wrong,
            threshold=0 if across else None,
            comparison="==" if across else None,
        ),
        Metric(
            name="busbw_gbps",
            value=large["busbw_gbps"] if across else None,
            unit="GB/s",
            threshold=settings.min_busbw_gbps if across else None,
            comparison=">=" if across else None,
        ),
        Metric(
            name="small_latency_us",
            value=small["time_us"],
            unit="us",
            threshold=settings.max_small_latency_us if across else None,
            comparison="<=" if across else None,
        ),
    ]


def allreduce_reasons(report: dict[str, Any], world: int) -> list[str]:
    small, large = report["points"][0], report["points"][-1]
    wrong = sum(p["wrong"] for p in report["points"])
    setup = (f"; NCCL {report['nccl']}" if report.get("nccl") else "") + (
        f"; {', '.join(f'{k}={v}' for k, v in report['env'].items())}" if report["env"] else ""
    )
    if world > 1:
        return [
            f"all-reduce on {report['backend']} across {report['world']} ranks: "
            f"busbw {large['busbw_gbps']:.2f} GB/s at {large['bytes'] >> 20} MiB, "
            f"{small['time_us']:.1f} us at {small['bytes'] >> 10} KiB, {wrong} wrong" + setup
        ]
    return [
        f"all-reduce on {report['backend']} on one rank: it runs, "
        f"{small['time_us']:.1f} us at {small['bytes'] >> 10} KiB" + setup,
        "one rank: no link is crossed, so bus bandwidth was not measured, and neither the sums "
        "nor the small-message latency is judged",
    ]


class _ProbeFailed(Exception):
    def __init__(self, message: str, command: str) -> None:
        super().__init__(message)
        self.command = command


class TpHealthGate(Gate):
    name = "tp-health"
    asks_engine = False
    settings_field = "tp_health"
    freshness_window = timedelta(hours=24)
    description = "GPU rules, Xids, topology, an all-reduce across the TP ranks, engine memory"

    def run(self, ctx: GateContext, backend: str, baseline: str | None) -> GateResult:
        started = utcnow()
        settings = ctx.inventory.spec.gates.tp_health
        spec = ctx.inventory.backends[backend]
        host = ctx.inventory.spec.hosts[spec.host]
        world = spec.tp_size
        tp_gpus = list(spec.gpus) or (list(range(world)) if host.gpus else [])
        reasons: list[str] = []
        failures: list[str] = []
        metrics: list[Metric] = []
        details: dict[str, Any] = {"tp_size": world, "gpus": tp_gpus}
        info = engine_now(ctx, backend)
        reported = info.tp_size if info is not None else None
        if reported is not None and reported != world:
            failures.append(
                f"{backend} reports TP {reported}, but the inventory's {world} ranks are "
                "what this check looks at"
            )
        elif reported is None and world > 1:
            reasons.append(f"TP {world} is the inventory's: {backend} does not report its own")
        assert ctx.transport is not None
        try:
            transport = ctx.transport(spec.host)
            probe: GpuProbe = probe_gpus(transport)
            details["gpu_probe"] = probe.model_dump(mode="json")
            if probe.visible and not tp_gpus:
                # Neither the backend nor its host names GPUs: the rules, topology and engine
                # memory below cover none of the engine's ranks.
                reasons.append(
                    f"no GPUs named for {backend} (backends.{backend}.gpus, or the host's gpus): "
                    "the GPU rules, topology and engine memory looked at none of its ranks"
                )
                # Unmeasured, so never a pass: nothing said these GPUs are the engine's.
                metrics.append(
                    Metric(name="gpus_checked", value=None, threshold=1, comparison=">=")
                )
            if probe.visible:
                failures += gpu_findings(probe.gpus, tp_gpus)
                failures += topology_findings(
                    probe_topology(transport), tp_gpus, settings.require_nvlink
                )
                if settings.engine_memory is not False:
                    owners = engine_processes(transport, spec.service)
                    failures += memory_findings(probe.processes, tp_gpus, owners)
                    if owners is None and tp_gpus:
                        reasons.append(
                            f"engine memory: any process's counts; {backend}'s processes could "
                            "not be told apart (no service in the inventory, or its state unknown)"
                        )
                else:
                    reasons.append(
                        "engine memory not judged (gates.tp_health.engine_memory: false): the box "
                        f"is checked for {backend} before it runs on these GPUs"
                    )
                xids = probe_xids(transport)
                fresh, unreadable = new_xids(
                    xids, ctx.last_result(self.name, backend) if ctx.last_result else None
                )
                details["xid_lines"] = [e.line for e in xids.events]
                failures += [f"new Xid: {line}" for line in fresh]
                reasons += unreadable
                # A log that could not be read shows no Xid, and that is not the same as none.
                metrics.append(
                    Metric(
                        name="new_xids",
                        value=len(fresh) if xids.readable else None,
                        threshold=0,
                        comparison="==",
                    )
                )
                metrics.append(Metric(name="gpus_visible", value=len(probe.gpus)))
                comm = "nccl"
            elif tp_gpus:
                failures.append(
                    f"{spec.host} should have GPUs {tp_gpus} but shows none: "
                    f"{probe.error or probe.note}"
                )
                comm = ""
            elif world == 1:
                # gloo on one CPU process would time a no-op: no probe, and nothing to judge.
                reasons.append(
                    f"{spec.host} shows no GPUs and {backend} runs one rank: no GPU rules apply, "
                    "and an all-reduce over one rank crosses no link, so there is no bus "
                    "bandwidth or latency to measure"
                )
                comm = ""
            else:
                reasons.append(f"{spec.host} has no GPUs: GPU rules do not apply; gloo on CPU")
                comm = "gloo"
            # No all-reduce on NCCL where the GPUs it would use are not there.
            if comm:
                report = run_allreduce(
                    transport, settings, world, comm, tp_gpus if comm == "nccl" else []
                )
                details["allreduce"] = report
                metrics += allreduce_metrics(report, settings, world)
                reasons += allreduce_reasons(report, world)
        except CommandTimeout:
            failures.append(
                f"the all-reduce did not finish within {settings.timeout_s:g}s: a rank hangs "
                "(broken P2P hangs without an Xid)"
            )
        except _ProbeFailed as exc:
            failures.append(str(exc))
            details["command"] = exc.command
        except KdctlError as exc:
            return self.result(
                ctx,
                backend,
                started=started,
                verdict="error",
                metrics=metrics,
                reasons=[str(exc)],
                details=details,
                info=info,
            )
        for m in metrics:
            if m.passed is False and not any(m.name in f for f in failures):
                failures.append(f"{m.name} {m.value} not {m.comparison} {m.threshold}")
        if not failures and not any(m.judged for m in metrics):
            return self.result(
                ctx,
                backend,
                started=started,
                verdict="skipped",
                metrics=metrics,
                reasons=reasons,
                details=details,
                info=info,
            )
        verdict = decide(metrics, failures)
        reasons += [not_measured(m) for m in metrics if m.unmeasured]
        return self.result(
            ctx,
            backend,
            started=started,
            verdict=verdict,
            metrics=metrics,
            reasons=failures + reasons,
            details=details,
            info=info,
        )
