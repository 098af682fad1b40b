"""`kdctl sandbox`: the embedded default. On this machine, on loopback: the tiny Kimi-K2
architecture model (deepseek_v3) and its INT4 W4A16 variant, three reference servers as the
engines (`baseline` speaks for SGLang, `candidate` is the native engine on the same weights,
`candidate-int4` the native engine on the quantized ones), and a router in front: nginx when it
is installed, else SGLang's router. Every process is started through a pidfile kdctl owns, so
`down` stops exactly what `up` started; `up` again reuses what runs."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from contextlib import ExitStack
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel

from kdctl.backends import make_backend, wait_http
from kdctl.backends.reference import batch_argv, serve_argv
from kdctl.checks import with_settings
from kdctl.errors import InfraError, InputError
from kdctl.evidence import DB_NAME, EvidenceStore, SqliteStore, open_store
from kdctl.inventory import LoadedInventory, NginxRouterSpec, load_inventory
from kdctl.recording import run_gates
from kdctl.records import GateResult, utcnow
from kdctl.roadmap import load_roadmap, roadmap_path
from kdctl.traffic import router_argv
from kdctl.transports import TransportPool

# The INT4 W4A16 build the sandbox serves as candidate-int4: quantization groups of 4.
INT4_GROUP = 4
# Its earlier builds, coarser groups, and how many days back each is dated in the history.
HISTORY_BUILDS = ((32, 21), (16, 14), (8, 7))
HISTORY_PORT = 31002
# The roadmap criterion the history is recorded for (roadmap/sandbox.yaml).
HISTORY_PHASE, HISTORY_CRITERION = "int4", "int4-logprobs"

ENGINES = {
    "baseline": ("sglang", "tiny-deepseek-v3", 30000),
    "candidate": ("native", "tiny-deepseek-v3", 31000),
    "candidate-int4": ("native", "tiny-deepseek-v3-w4a16", 31001),
}
# The candidate decodes speculatively, as the team's engine does: this one-layer model of the
# same tokenizer drafts, the target verifies.
DRAFT = "tiny-deepseek-v3-draft"
DRAFT_CONFIG = {"num_hidden_layers": 1}
DRAFT_TOKENS = 4
SPECULATIVE = {"candidate"}
# The native engine as it was before it had a server: a program that answers a request file
# (the command contract), here `kdctl reference batch` on the candidate's weights. Its speed
# is its own timings of batch runs, compared with the baseline's served run of the prompts.
BATCH_ENGINE = "candidate-batch"
FRONT_PORT = 8000
# SGLang's router's Prometheus port, where it is the front.
ROUTER_METRICS_PORT = 29100
# Every port above moved by `up --port-offset`: a sandbox beside another one, or beside an
# SGLang already on :30000 (its default port), without editing anything.
MAX_PORT_OFFSET = 65535 - max(HISTORY_PORT, *(port for _, _, port in ENGINES.values()))
# Where scripts/bootstrap-sglang installs SGLang's CPU build, and the stand-in for its CUDA
# kernel package that it runs with (scripts/sglang_cpu: also routes its CPU prefill of a
# DeepSeek model through its own MLA path; docs/sglang-compatibility.md says why).
SGLANG_VERSION = "0.5.23"
SGLANG_CPU = Path(__file__).resolve().parent.parent / "scripts" / "sglang_cpu"
BaselineChoice = Literal["reference", "sglang"]


def sglang_venv() -> Path:
    default = Path.home() / ".cache" / "kdctl" / f"sglang-cpu-{SGLANG_VERSION}"
    return Path(os.environ.get("KDCTL_SGLANG_VENV", default))


def _sglang_python() -> Path:
    """SGLang's CPU build's interpreter; InputError where scripts/bootstrap-sglang has not
    installed it (completely) or the checkout's stand-in is not there."""
    venv = sglang_venv()
    python = venv / "bin" / "python"
    if not (venv / ".complete").is_file() or not python.exists() or not SGLANG_CPU.is_dir():
        raise InputError(
            f"--baseline sglang: SGLang {SGLANG_VERSION}'s CPU build is not installed at {venv} "
            "(scripts/bootstrap-sglang installs it, from a checkout of kdctl)"
        )
    return python


def _k2_configured(config: Path) -> None:
    """A sandbox's model made before its config carried K2's fields stops SGLang's DeepSeek
    path at load (`assert rope_scaling is not None`, its CPU rotary embedding): said here,
    since remaking it under the sandbox would change the weights its evidence was taken on."""
    if config.is_file() and "rope_scaling" not in json.loads(config.read_text()):
        models = config.parent.parent
        raise InputError(
            f"--baseline sglang: {config} has no rope_scaling, which SGLang's DeepSeek model "
            f"needs: it was made by an earlier kdctl; remove {models} (after kdctl sandbox "
            "down) to have the models made again"
        )


def _sglang_service(root: Path, model: str, port: int) -> dict[str, Any]:
    """The baseline as SGLang itself: its CPU build on the sandbox's weights, as the tests
    run it."""
    return {
        "command": [
            str(_sglang_python()),
            *("-m", "sglang.launch_server", "--model-path", str(root / "models" / model)),
            *("--served-model-name", model, "--host", "127.0.0.1", "--port", str(port)),
            *("--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph"),
            *("--grammar-backend", "none", "--max-total-tokens", "8192", "--enable-metrics"),
            # Its scheduler otherwise polls for work on a whole core while idle.
            "--sleep-on-idle",
        ],
        "env": {
            "SGLANG_USE_CPU_ENGINE": "1",
            "PYTHONPATH": str(SGLANG_CPU),
            "HF_HUB_OFFLINE": "1",
        },
        "pidfile": str(root / "run" / "baseline.pid"),
        "log": str(root / "log" / "baseline.log"),
    }


class ProcessState(BaseModel):
    name: str
    pid: int | None
    running: bool
    url: str | None = None


class SandboxStatus(BaseModel):
    dir: str
    inventory: str
    router: Literal["nginx", "sglang-router"]
    processes: list[ProcessState]

    @property
    def up(self) -> bool:
        return all(p.running for p in self.processes)


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _router_kind() -> Literal["nginx", "sglang-router"]:
    if shutil.which("nginx") or Path("/usr/sbin/nginx").exists():
        return "nginx"
    import importlib.util

    if importlib.util.find_spec("sglang_router") is None:
        raise InputError(
            "the sandbox needs a router: install nginx (apt-get install nginx) or the "
            "router extra (pip install 'kdctl[router]')"
        )
    return "sglang-router"


def _engine_python() -> str | None:
    """The interpreter $KDCTL_SANDBOX_PYTHON asks the sandbox's reference engines to run under
    (one with kdctl installed; another venv's, with CUDA's torch, say); None where it is unset:
    kdctl's own."""
    chosen = os.environ.get("KDCTL_SANDBOX_PYTHON")
    if not chosen:
        return None
    if not (os.path.isabs(chosen) and os.path.isfile(chosen) and os.access(chosen, os.X_OK)):
        raise InputError(f"KDCTL_SANDBOX_PYTHON={chosen}: not the absolute path of a program")
    return chosen


def _inventory(
    root: Path,
    router: str,
    baseline: BaselineChoice = "reference",
    offset: int = 0,
    python: str | None = None,
) -> dict[str, Any]:
    """The top-level inventory.yaml's setup, with the absolute paths of this folder and every
    port moved by `offset`; the reference engines run under `python`."""
    shipped = Path(__file__).resolve().parent.parent / "inventory.yaml"
    base: dict[str, Any] = yaml.safe_load(shipped.read_text()) if shipped.is_file() else {}
    backends = {}
    for name, (kind, model, default_port) in ENGINES.items():
        port = default_port + offset
        spec: dict[str, Any] = {
            "kind": kind,
            "host": "local",
            "url": f"http://127.0.0.1:{port}",
            "tp_size": 1,
            "model": str(root / "models" / model),
            "service": {
                "command": serve_argv(
                    root / "models" / model,
                    port,
                    served_name=model,
                    draft=root / "models" / DRAFT if name in SPECULATIVE else None,
                    draft_tokens=DRAFT_TOKENS if name in SPECULATIVE else None,
                    # Against SGLang itself, the native engine speaks its API as of its
                    # release, as the team's would: the api-conformance gate holds it to that.
                    sglang_version=SGLANG_VERSION if baseline == "sglang" else None,
                    python=python,
                ),
                "pidfile": str(root / "run" / f"{name}.pid"),
                "log": str(root / "log" / f"{name}.log"),
            },
        }
        if kind == "native":
            spec["mode"] = "http"
        if name == "baseline" and baseline == "sglang":
            spec["service"] = _sglang_service(root, model, port)
        backends[name] = spec
    batch_model = root / "models" / ENGINES["candidate"][1]
    backends[BATCH_ENGINE] = {
        "kind": "native",
        "mode": "command",
        "host": "local",
        "tp_size": 1,
        "model": str(batch_model),
        "command": batch_argv(batch_model, python),
        "workdir": str(root / "run"),
    }
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    router_spec: dict[str, Any] = {
        "kind": router,
        "host": "local",
        "listen": f"127.0.0.1:{FRONT_PORT + offset}",
        "serving": "baseline",
    }
    if router == "nginx":
        router_spec.update(
            include=str(root / "nginx" / "kdctl.conf"),
            nginx=nginx,
            prefix=str(root / "nginx"),
            conf=str(root / "nginx" / "nginx.conf"),
        )
    return {
        "hosts": {"local": {"transport": "local"}},
        "backends": backends,
        "router": router_spec,
        "gates": base.get("gates", {}),
        "roadmap": str(Path(__file__).resolve().parent.parent / "roadmap" / "sandbox.yaml"),
        "state_dir": str(root / "state"),
    }


def _nginx_main(root: Path) -> str:
    temp = "\n".join(
        f"  {kind}_temp_path {root / 'nginx' / 'tmp' / kind};"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    return (
        "worker_processes 1;\n"
        f"pid {root / 'nginx' / 'nginx.pid'};\n"
        f"error_log {root / 'nginx' / 'error.log'} warn;\n"
        "events { worker_connections 1024; }\n"
        "http {\n  access_log off;\n"
        f"{temp}\n  include {root / 'nginx' / 'kdctl.conf'};\n}}\n"
    )


RouterChoice = Literal["auto", "nginx", "sglang-router"]


def _baseline_of(inventory: dict[str, Any]) -> BaselineChoice:
    command = inventory["backends"]["baseline"]["service"]["command"]
    return "sglang" if "sglang.launch_server" in command else "reference"


def _python_of(inventory: dict[str, Any]) -> str:
    """The interpreter a sandbox's inventory runs its reference engines under."""
    return str(inventory["backends"]["candidate"]["service"]["command"][0])


def _offset_of(listen: str) -> int:
    """The port offset a sandbox's inventory was written with, read off its front's address."""
    return int(listen.rpartition(":")[2]) - FRONT_PORT


def _keeps(root: Path, asked: object, running: object, said: str) -> None:
    """A second `up` reuses the sandbox as it runs: another router, baseline, ports or
    interpreter would change them under running engines."""
    if asked is not None and asked != running:
        raise InputError(f"{root} already runs {said}; kdctl sandbox down --dir {root} first")


def up(
    root: Path,
    *,
    router_choice: RouterChoice = "auto",
    baseline: BaselineChoice | None = None,
    port_offset: int | None = None,
    progress: Any = None,
) -> SandboxStatus:
    """`baseline`: what serves as `baseline`, kdctl's reference server (the default) or SGLang
    itself; `port_offset`: added to every port the sandbox binds (default 0). None keeps what a
    sandbox already up has."""
    root = root.resolve()
    if port_offset is not None and not 0 <= port_offset <= MAX_PORT_OFFSET:
        raise InputError(
            f"--port-offset {port_offset}: must be 0 to {MAX_PORT_OFFSET}, so that the "
            f"sandbox's highest port, {HISTORY_PORT}, moved by it is still a port"
        )
    # Each refused before anything is made.
    python = _engine_python()
    if baseline == "sglang":
        _sglang_python()
        _k2_configured(root / "models" / ENGINES["baseline"][1] / "config.json")
    for sub in ("models", "run", "log", "nginx/tmp", "state"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    existing = root / "inventory.yaml"
    if existing.exists():
        # Reused as it is: a second `up` must not swap the router, the baseline or the
        # engines' interpreter under running engines.
        old = yaml.safe_load(existing.read_text())
        router = old["router"]["kind"]
        _keeps(root, None if router_choice == "auto" else router_choice, router, f"with {router}")
        running, ports = _baseline_of(old), _offset_of(old["router"]["listen"])
        _keeps(root, baseline, running, f"{running} as its baseline")
        _keeps(root, port_offset, ports, f"with --port-offset {ports}")
        ran = _python_of(old)
        _keeps(root, python, ran, f"its engines under {ran}")
        baseline, port_offset, python = running, ports, ran
    else:
        router = _router_kind() if router_choice == "auto" else router_choice
    inv_path = root / "inventory.yaml"
    written = _inventory(root, router, baseline or "reference", port_offset or 0, python)
    inv_path.write_text(yaml.safe_dump(written, sort_keys=False))
    make_models(root, progress)
    inv = load_inventory(inv_path)
    with TransportPool(inv) as pool, ExitStack() as open_backends:
        # Started together, then waited for: the three load their weights side by side.
        controls = []
        for name in ENGINES:
            be = open_backends.enter_context(make_backend(name, inv.backends[name]))
            control = be.lifecycle(pool.get("local"))
            control.start()  # a running one is left as it is
            controls.append(control)
        for i, control in enumerate(controls):
            if progress:
                progress("engines ready", i, len(controls))
            # SGLang on two cores takes a minute or two.
            control.wait_ready(deadline_s=600)
        if progress:
            progress("engines ready", len(controls), len(controls))
        _start_router(inv, root, router, pool)
    return status(root)


def make_models(root: Path, progress: Any = None) -> None:
    """The tiny deepseek_v3, its one-layer draft and its INT4 W4A16 variant under
    `root/models`, unless there."""
    from kdctl.backends.reference.model import make_model

    plain = root / "models" / "tiny-deepseek-v3"
    steps: list[tuple[Path, dict[str, Any]]] = [
        (plain, {}),
        (root / "models" / DRAFT, {"config_overrides": DRAFT_CONFIG}),
        (
            root / "models" / "tiny-deepseek-v3-w4a16",
            {"quantize": "w4a16", "group_size": INT4_GROUP, "from_model": plain},
        ),
    ]
    for i, (out, kwargs) in enumerate(steps):
        if not (out / "config.json").exists():
            if progress:
                progress("models", i, len(steps))
            make_model("deepseek_v3", out, **kwargs)
    if progress:
        progress("models", len(steps), len(steps))


def _start_router(inv: LoadedInventory, root: Path, router: str, pool: TransportPool) -> None:
    assert inv.spec.router is not None
    listen = inv.spec.router.listen
    if router == "nginx":
        from kdctl.traffic.nginx import NginxRouter

        pidfile = root / "nginx" / "nginx.pid"
        include = root / "nginx" / "kdctl.conf"
        if not include.exists():
            include.write_text(
                NginxRouter(inv, inv.spec.router, pool.get("local")).render({"baseline": 100})
            )
        conf = root / "nginx" / "nginx.conf"
        conf.write_text(_nginx_main(root))
        if _alive(_pid(pidfile)):
            return
        nginx = inv.spec.router.nginx if isinstance(inv.spec.router, NginxRouterSpec) else "nginx"
        run = subprocess.run(
            [nginx, "-p", str(root / "nginx"), "-c", str(conf)], capture_output=True, text=True
        )
        if run.returncode != 0:
            raise InfraError(f"nginx did not start: {run.stderr.strip()[-400:]}")
        # Through the front to the baseline, which is ready by now.
        wait_http(f"http://{listen}/health", deadline_s=60)
    else:
        pidfile = root / "run" / "router.pid"
        if _alive(_pid(pidfile)):
            return
        log = (root / "log" / "router.log").open("ab")
        offset = _offset_of(listen)
        proc = subprocess.Popen(
            router_argv(
                FRONT_PORT + offset,
                [inv.backends["baseline"].url or ""],
                prometheus_port=ROUTER_METRICS_PORT + offset,
            ),
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
        pidfile.write_text(f"{proc.pid}\n")
        wait_http(
            f"http://{listen}/readiness",
            deadline_s=60,
            proc=proc,
            log=root / "log" / "router.log",
        )


def _router_pidfile(root: Path) -> Path:
    nginx = root / "nginx" / "nginx.pid"
    return nginx if nginx.exists() else root / "run" / "router.pid"


def status(root: Path) -> SandboxStatus:
    root = root.resolve()
    inv_path = root / "inventory.yaml"
    if not inv_path.exists():
        raise InputError(f"{root}: no sandbox here (kdctl sandbox up --dir {root})")
    data = yaml.safe_load(inv_path.read_text())
    procs = []
    for name in ENGINES:
        pid = _pid(root / "run" / f"{name}.pid")
        url = data["backends"][name]["url"]
        procs.append(ProcessState(name=name, pid=pid, running=_alive(pid), url=url))
    pid = _pid(_router_pidfile(root))
    procs.append(
        ProcessState(
            name=data["router"]["kind"],
            pid=pid,
            running=_alive(pid),
            url=f"http://{data['router']['listen']}",
        )
    )
    return SandboxStatus(
        dir=str(root), inventory=str(inv_path), router=data["router"]["kind"], processes=procs
    )


def down(root: Path) -> SandboxStatus:
    """Stop everything `up` started, by its pidfile: the engines (their whole process groups),
    then the router; nothing else is touched."""
    root = root.resolve()
    current = status(root)
    inv = load_inventory(root / "inventory.yaml")
    with TransportPool(inv) as pool:
        for name in ENGINES:
            with make_backend(name, inv.backends[name]) as be:
                be.lifecycle(pool.get("local")).stop()
    router_pidfile = _router_pidfile(root)
    pid = _pid(router_pidfile)
    if _alive(pid):
        assert pid is not None
        # nginx: SIGQUIT is its graceful shutdown; the router leads its own session.
        os.kill(pid, signal.SIGQUIT if current.router == "nginx" else signal.SIGTERM)
        deadline = time.monotonic() + 20
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    router_pidfile.unlink(missing_ok=True)
    return status(root)


class HistoryPoint(BaseModel):
    build: str
    dated: datetime
    measured_at: datetime
    verdict: str
    metrics: dict[str, float | int | None]


def record_history(root: Path, *, progress: Any = None) -> list[HistoryPoint]:
    """The INT4 engine's history for `kdctl status` and `phases` to forecast from: its earlier
    builds (coarser quantization groups) and the one it serves now, each served here and
    measured now by the roadmap's int4 criterion, the earlier ones dated a week apart into the
    past (said so in each result's details). Recorded once; a second call lists what is there."""
    root = root.resolve()
    inv_path = root / "inventory.yaml"
    if not inv_path.exists():
        raise InputError(f"{root}: no sandbox here (kdctl sandbox up --dir {root})")
    inv = load_inventory(inv_path)
    path = roadmap_path(inv)
    assert path is not None
    criterion = next(
        c
        for cs in load_roadmap(path, inv).criteria(None).values()
        for c in cs
        if (c.phase, c.name) == (HISTORY_PHASE, HISTORY_CRITERION)
    )
    settings = dict(criterion.spec.settings)
    with open_store(inv) as store:
        kept = [
            r
            for r in store.results(gate=criterion.gate, backend=criterion.backend)
            if "history" in r.details
        ]
        if not kept:
            kept = _measure_history(root, inv, criterion.gate, settings, store, progress)
    return [
        HistoryPoint(
            build=str(r.details["history"]["build"]),
            dated=r.ended_at,
            measured_at=datetime.fromisoformat(r.details["history"]["measured_at"]),
            verdict=r.verdict,
            metrics={m.name: m.value for m in r.metrics if not isinstance(m.value, str)},
        )
        for r in sorted(kept, key=lambda r: r.ended_at)
    ]


def _measure_history(
    root: Path,
    inv: LoadedInventory,
    gate: str,
    settings: dict[str, Any],
    store: EvidenceStore,
    progress: Any,
) -> list[GateResult]:
    from kdctl.backends.reference.model import make_model

    plain = root / "models" / "tiny-deepseek-v3"
    work = root / "history"
    kept: list[GateResult] = []
    builds = [*HISTORY_BUILDS, (INT4_GROUP, 0)]
    for i, (group, days) in enumerate(builds):
        if progress:
            progress("INT4 builds measured", i, len(builds))
        build = f"w4a16 g{group}"
        if days == 0:
            # The build serving now, at its own URL.
            with SqliteStore(work / "state-now" / "evidence.sqlite") as own:
                measured = _run(inv, gate, settings, own)
        else:
            model = work / "models" / f"tiny-deepseek-v3-w4a16-g{group}"
            if not (model / "config.json").exists():
                make_model(
                    "deepseek_v3", model, quantize="w4a16", group_size=group, from_model=plain
                )
            measured = _measure_build(root, work, model, gate, settings, group)
        ended = utcnow()
        for r in measured:
            dated = r.model_copy(
                update={
                    "started_at": r.started_at - timedelta(days=days),
                    "ended_at": r.ended_at - timedelta(days=days),
                    "details": {
                        **r.details,
                        "history": {
                            "build": build,
                            "measured_at": ended.isoformat(),
                            "dated_back_days": days,
                        },
                    },
                }
            )
            store.record(dated)
            kept.append(dated)
    if progress:
        progress("INT4 builds measured", len(builds), len(builds))
    return kept


def _measure_build(
    root: Path, work: Path, model: Path, gate: str, settings: dict[str, Any], group: int
) -> list[GateResult]:
    """An earlier build served on a spare port under candidate-int4's name, measured into a
    store of its own (its results are dated back before they join the sandbox's)."""
    doc = yaml.safe_load((root / "inventory.yaml").read_text())
    port = HISTORY_PORT + _offset_of(doc["router"]["listen"])
    spec = doc["backends"]["candidate-int4"]
    spec["url"] = f"http://127.0.0.1:{port}"
    spec["model"] = str(model)
    spec.pop("service", None)
    doc["state_dir"] = str(work / f"state-g{group}")
    inv_path = work / f"inventory-g{group}.yaml"
    inv_path.write_text(yaml.safe_dump(doc, sort_keys=False))
    inv = load_inventory(inv_path)
    log = work / f"serve-g{group}.log"
    with log.open("wb") as fh:
        proc = subprocess.Popen(
            # Under the interpreter the build serving now runs under.
            serve_argv(model, port, served_name=model.name, python=_python_of(doc)),
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_http(f"http://127.0.0.1:{port}/health", deadline_s=300, proc=proc, log=log)
        with SqliteStore(inv.state_dir / DB_NAME) as own:
            return _run(inv, gate, settings, own)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def _run(
    inv: LoadedInventory, gate: str, settings: dict[str, Any], store: EvidenceStore
) -> list[GateResult]:
    return run_gates(with_settings(inv, gate, settings), store, gate, "candidate-int4", "baseline")
