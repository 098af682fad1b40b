from __future__ import annotations

import atexit
import os
import re

# Every engine the tests start (reference servers, the sandbox's, vLLM) shares two cores with the
# others and with kdctl: one thread each, or their OpenMP pools spin against one another and a
# throughput measured during someone else's burst reads a tenth of itself.
os.environ.setdefault("OMP_NUM_THREADS", "1")
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from kdctl.backends import wait_http
from kdctl.backends.reference import serve_argv
from kdctl.errors import InfraError
from tests.support.postgres import Cluster, pg_bin, start_cluster, stop_cluster
from tests.support.sshd import SSHD, SshdFleet
from tests.support.warm import WarmCli, WarmProcess

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"
H200 = FIXTURES / "nvidia-smi" / "h200-1gpu"
REPLAY_BIN = FIXTURES / "bin"


def _need(binary: str, what: str) -> None:
    if os.path.exists(binary) or shutil.which(binary):
        return
    # CI installs every real part; a skip there would hide a missing install step.
    if os.environ.get("CI"):
        pytest.fail(f"{what} is not installed ({binary}); .ci/run must install it")
    pytest.skip(f"{what} is not installed ({binary})")


def need_module(module: str, extra: str) -> None:
    """A library a real part needs (torch for the reference engine, scipy for trends): missing
    under CI fails the run, as a missing server does, instead of skipping its tests."""
    import importlib.util

    if importlib.util.find_spec(module) is not None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{module} (the {extra} extra) is not installed; .ci/run must install it")
    pytest.skip(f"{module} (the {extra} extra) is not installed")


def need_engine(python: Path, bootstrap: str) -> None:
    """An engine in a venv of its own (vLLM's, SGLang's CPU builds), complete as its bootstrap
    script marks it: missing under CI fails the run, elsewhere its tests skip, naming the
    script that installs it."""
    if python.exists() and (python.parents[1] / ".complete").exists():
        return
    if os.environ.get("CI"):
        pytest.fail(f"{python} is not installed; {bootstrap} installs it")
    pytest.skip(f"{python} is not installed ({bootstrap} installs it)")


def need_sglang_router() -> None:
    """SGLang's router is a real part the tests run."""
    need_module("sglang_router", "router")


@dataclass
class Run:
    code: int
    out: str
    err: str


_WARM: WarmCli | None = None
_WARM_LOCK = threading.Lock()
_ENGINES: WarmCli | None = None


def _warm_cli() -> WarmCli:
    global _WARM
    with _WARM_LOCK:  # the first callers may be threads (the models fixture's)
        if _WARM is None:
            _WARM = WarmCli()
            atexit.register(_WARM.close)
        return _WARM


def kdctl(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 120
) -> Run:
    """Run the real CLI in a new process, as a user would: a fork of a server that has
    imported kdctl already (tests/support/warm.py; for `kdctl reference`, torch too), or a
    cold `python -m kdctl` where the command's interpreter start-up would differ, or
    KDCTL_TEST_COLD_CLI is set."""
    # Wide and fixed, whatever the runner's terminal (pytest-xdist's workers have 80 columns).
    full_env = {**os.environ, "COLUMNS": "200", **(env or {})}
    if not os.environ.get("KDCTL_TEST_COLD_CLI"):
        # `kdctl reference ...` imports torch and transformers: the engine server has them.
        warm = _warm_engines() if args[:1] == ("reference",) else _warm_cli()
        if warm is not None and warm.suits(full_env):
            return Run(*warm.run(list(args), full_env, str(cwd or Path.cwd()), timeout))
    proc = subprocess.run(
        [sys.executable, "-m", "kdctl", *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd,
        timeout=timeout,
    )
    return Run(proc.returncode, proc.stdout, proc.stderr)


def kdctl_start(*args: str) -> subprocess.Popen[bytes] | WarmProcess:
    """Start the real CLI and leave it running, its output discarded: a fork of the warm
    server, as `kdctl` runs a command, or a cold `python -m kdctl` where that cannot be."""
    env = {**os.environ, "COLUMNS": "200"}
    if not os.environ.get("KDCTL_TEST_COLD_CLI") and _warm_cli().suits(env):
        return _warm_cli().start(list(args), env, str(Path.cwd()))
    return subprocess.Popen(
        [sys.executable, "-m", "kdctl", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )


def native_http(url: str, **extra: Any) -> dict[str, Any]:
    """An inventory entry for the native engine behind its HTTP server on this machine."""
    return {"kind": "native", "mode": "http", "host": "local", "url": url, **extra}


def engine_pair(baseline_url: str, candidate_url: str) -> dict[str, dict[str, Any]]:
    """The two engines most tests compare: SGLang serving today and the native candidate."""
    return {
        "baseline": {"kind": "sglang", "host": "local", "url": baseline_url},
        "candidate": native_http(candidate_url),
    }


def ssh_home(root: Path) -> dict[str, str]:
    """A HOME holding the key and known_hosts files examples/ct200-8gpu.yaml names, which
    `inventory check` requires to exist: the environment for commands run on that example."""
    ssh = root / "home" / ".ssh"
    ssh.mkdir(parents=True, exist_ok=True)
    for name in ("id_ed25519", "known_hosts"):
        (ssh / name).touch()
    return {"HOME": str(root / "home")}


def local_host_id() -> str | None:
    """This machine's identity as kdctl reads it: what a result measured here carries, so
    that a hand-made record stands for one a gate run here would have made."""
    from kdctl.probes.identity import probe_host_identity
    from kdctl.transports.local import LocalTransport

    return probe_host_identity(LocalTransport("local"))


def write_inventory(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture(scope="session")
def postgres() -> Iterator[Cluster]:
    """A real PostgreSQL cluster on loopback, for the shared evidence store."""
    if os.geteuid() != 0:
        pytest.skip("the PostgreSQL fixture runs initdb as the postgres user, which needs root")
    _need(
        str(pg_bin() or "/usr/lib/postgresql/VERSION/bin/initdb"),
        "PostgreSQL (apt-get install postgresql)",
    )
    need_module("psycopg", "postgres")
    cluster = start_cluster()
    yield cluster
    stop_cluster(cluster)


@pytest.fixture
def pg_url(postgres: Cluster) -> str:
    """A fresh database of the cluster for one test."""
    return postgres.create_database()


@pytest.fixture(scope="session")
def fleet() -> Iterator[SshdFleet]:
    """Three real sshd hosts on loopback: `gpu` replays the H200 capture, the others have none."""
    if os.geteuid() != 0:
        pytest.skip("the sshd fixture runs sshd and adds a login, which needs root")
    _need(SSHD, "OpenSSH's sshd (apt-get install openssh-server)")
    root = Path(tempfile.mkdtemp(prefix="kdctl-sshd-"))
    fleet = SshdFleet(root)
    try:
        fleet.add(
            "gpu",
            env={
                "PATH": f"{REPLAY_BIN}:/usr/local/bin:/usr/bin:/bin",
                "KDCTL_NVSMI_FIXTURES": str(H200),
            },
        )
        fleet.add("plain")
        fleet.add("plain2")
        yield fleet
    finally:
        fleet.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def need_nginx() -> str:
    _need("/usr/sbin/nginx", "nginx (apt-get install nginx)")
    return shutil.which("nginx") or "/usr/sbin/nginx"


def shared_dir(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A folder every xdist worker of this run sees (their base temps share a parent)."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    path = root / name
    path.mkdir(exist_ok=True)
    return path


def built_once(root: Path, name: str, build: Callable[[Path], None]) -> Path:
    """`root/name`, built by `build(folder)` by the first worker to ask (into a partial folder,
    renamed when whole) and read by the rest."""
    import fcntl

    out = root / name
    with (root / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():
            tmp = root / f"{name}.partial"
            shutil.rmtree(tmp, ignore_errors=True)
            build(tmp)
            tmp.rename(out)
    return out


def made_once(root: Path, name: str, *args: str) -> Path:
    """`kdctl reference make-model ... --out root/name`, made once a run (built_once): training
    a model is the suite's costliest start-up, and the same arguments give the same bytes."""

    def make(out: Path) -> None:
        run = kdctl("reference", "make-model", *args, "--out", str(out))
        assert run.code == 0, run.err

    return built_once(root, name, make)


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny models, made once per run through the real CLI: deepseek_v3 and its W4A16
    variant."""
    need_module("torch", "reference")
    from concurrent.futures import ThreadPoolExecutor

    root = shared_dir(tmp_path_factory, "models")
    with ThreadPoolExecutor(2) as pool:
        # A draft for speculative decoding: one layer, the same tokenizer (the sandbox's own).
        # Trained beside the target, on the other core, while every worker waits for both.
        drafting = pool.submit(
            made_once,
            root,
            "tiny-deepseek-v3-draft",
            *("--arch", "deepseek_v3", "--set", "num_hidden_layers=1"),
        )
        plain = made_once(root, "tiny-deepseek-v3", "--arch", "deepseek_v3")
        int4 = made_once(
            root,
            "tiny-deepseek-v3-w4a16",
            *("--arch", "deepseek_v3", "--from", str(plain), "--quantize", "w4a16"),
            *("--group-size", "16"),
        )
        draft = drafting.result()
    return {"dsv3": plain, "dsv3-int4": int4, "dsv3-draft": draft}


@pytest.fixture(scope="session")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama, the architecture vLLM's and SGLang's CPU engines both run."""
    need_module("torch", "reference")
    return made_once(shared_dir(tmp_path_factory, "models"), "tiny-llama", "--arch", "llama")


@dataclass
class Served:
    url: str
    model: Path
    api_key: str | None
    proc: subprocess.Popen[bytes] | WarmProcess


def _warm_engines() -> WarmCli | None:
    """The worker's warm engine server (tests/support/warm.py); None with KDCTL_TEST_COLD_CLI."""
    global _ENGINES
    if os.environ.get("KDCTL_TEST_COLD_CLI"):
        return None
    with _WARM_LOCK:
        if _ENGINES is None:
            _ENGINES = WarmCli("engine")
            atexit.register(_ENGINES.close)
    return _ENGINES


def _start_engine(argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes] | WarmProcess:
    """`kdctl reference serve` as a process of its own: a fork of a server that has imported
    torch, transformers and the reference server once (tests/support/warm.py), or a cold one
    where its interpreter start-up would differ, or KDCTL_TEST_COLD_CLI is set."""
    engines = _warm_engines() if argv[:3] == [sys.executable, "-m", "kdctl"] else None
    if engines is not None and engines.suits(env):
        return engines.start(argv[3:], env, str(Path.cwd()))
    return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def warm_argv(argv: list[str]) -> list[str]:
    """A `python -m kdctl ...` command line that kdctl itself will run (an engine's service, a
    command-mode engine), as tests/support/warm_exec.py, which runs it in a fork of the warm
    engine server and stands for it: the same process to start, signal and wait for."""
    engines = _warm_engines()
    if engines is None or argv[:3] != [sys.executable, "-m", "kdctl"]:
        return argv
    return [
        sys.executable,
        str(Path(__file__).parent / "support" / "warm_exec.py"),
        engines.socket_path(),
        *argv[3:],
    ]


def warm_python(folder: Path) -> dict[str, str]:
    """The environment in which `kdctl sandbox` runs its engines (KDCTL_SANDBOX_PYTHON) as
    warm_argv runs an inventory's: `folder/bin/python -m kdctl ARGS` is warm_exec.py in a fork
    of the warm engine server, anything else the real interpreter. Named python, as what it
    stands for is, for the process checks that read an engine's command line. Empty with
    KDCTL_TEST_COLD_CLI: the engines start cold."""
    import shlex

    engines = _warm_engines()
    if engines is None:
        return {}
    warm = warm_argv([sys.executable, "-m", "kdctl"])
    wrapper = folder / "bin" / "python"
    wrapper.parent.mkdir(parents=True, exist_ok=True)
    wrapper.write_text(
        "#!/bin/sh\n"
        f'[ "$1" = -m ] && [ "$2" = kdctl ] && shift 2 && exec {shlex.join(warm)} "$@"\n'
        f'exec {shlex.quote(sys.executable)} "$@"\n'
    )
    wrapper.chmod(0o755)
    return {"KDCTL_SANDBOX_PYTHON": str(wrapper)}


def serve_reference(
    model: Path,
    *,
    api_key: str | None = None,
    draft: Path | None = None,
    sglang_version: str | None = None,
) -> Served:
    from tests.support.sshd import free_port

    port = free_port()
    env = {**os.environ}
    key_env = "KDCTL_TEST_SERVE_KEY" if api_key else None
    if api_key:
        env["KDCTL_TEST_SERVE_KEY"] = api_key
    args = serve_argv(
        model,
        port,
        served_name=model.name,
        api_key_env=key_env,
        draft=draft,
        sglang_version=sglang_version,
    )
    proc = _start_engine(args, env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/health", proc=proc)
    except InfraError:
        proc.kill()
        raise
    return Served(url, model, api_key, proc)


@pytest.fixture(scope="session")
def reference_server(models: dict[str, Path]) -> Iterator[Served]:
    served = serve_reference(models["dsv3"])
    yield served
    served.proc.terminate()
    served.proc.wait(10)


@pytest.fixture(scope="session")
def keyed_server(models: dict[str, Path]) -> Iterator[Served]:
    served = serve_reference(models["dsv3-int4"], api_key="sk-test-7f1e")
    yield served
    served.proc.terminate()
    served.proc.wait(10)


_FINDINGS: list[str] = []


@pytest.fixture
def report(request: pytest.FixtureRequest) -> Any:
    """Record a measured finding; they are printed together at the end of the run. Kept on
    the test's report, so findings from pytest-xdist's workers reach the summary too."""

    def add(text: str) -> None:
        request.node.user_properties.append(("finding", text))

    return add


def pytest_configure(config: pytest.Config) -> None:
    """kdctl's own sources compiled to bytecode once, before any worker starts. The suite starts
    hundreds of interpreters (engines, CLI runs, batch programs); where PYTHONDONTWRITEBYTECODE
    is set, as on this project's CI machines, none of them leaves its compiled modules behind
    and each compiles kdctl again (test_layers' import of every module alone took 16 s instead
    of 11). The site-packages are compiled already, by pip."""
    if hasattr(config, "workerinput"):  # an xdist worker: the controller compiled
        return
    import compileall

    # In this process: a pool of workers costs more to start (0.14 s a run) than compiling
    # everything takes when nothing changed (0.007 s); from a fresh clone it is 0.5 s.
    for folder in ("kdctl", "backends", "checks", "roadmap", "templates", "tests"):
        compileall.compile_dir(REPO / folder, quiet=1)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "teardown":
        _FINDINGS.extend(str(v) for k, v in report.user_properties if k == "finding")


# The longest files first (pyproject's --no-loadscope-reorder keeps this order; xdist would put
# the files with most tests first): with a file per worker at a time, one started last would run
# alone at the end. By the seconds each file's tests took in a whole-suite run (four workers on
# two cores, --durations=0), longest first; a file not named here (each under 25 s) comes after.
_LONGEST_FIRST = (
    "test_sandbox.py",  # 276 s, the demo alone 274
    "test_rolling.py",  # 180
    "test_serving.py",  # 178, mostly deadlines waited out
    "test_vllm.py",  # 177
    # A real SGLang and nginx in a box, reference servers in another.
    "test_init.py",  # 116
    "test_sandbox_sglang.py",  # 103
    "test_traffic_faults.py",  # 101
    "test_phases.py",  # 92
    "test_tp_health.py",  # 83
    "test_rolling_stops.py",  # 75
    "test_trends.py",  # 68
    "test_sglang_live.py",  # 65
    "test_swap_kills.py",  # 65
    "test_traffic.py",  # 55
    "test_engine_faults.py",  # 55
    "test_throughput.py",  # 45
    "test_native_command.py",  # 40
    "test_evidence_binding.py",  # 39
    "test_swap.py",  # 33
    "test_reference_model.py",  # 30
    "test_backends.py",  # 28
    "test_http_over_ssh.py",  # 26
    "test_lifecycle.py",  # 25
)


# Fixtures that start a server or make a model. A test that needs none of them (through any
# fixture it uses) in a module that starts none in its tests' bodies is marked `unit`:
# `pytest -m unit` is the subset that runs in seconds.
_SERVER_FIXTURES = frozenset(
    {"postgres", "pg_url", "fleet", "need_nginx", "models", "llama", "reference_server",
     "keyed_server", "twin_server"}
)  # fmt: skip
_STARTS_SERVERS = re.compile(
    r"start_nginx\(|Popen\(|serve_reference\(|make_box\(|free_port\(|\"sandbox\"|\"serve\"|"
    r"WarmCli\(|need_engine\(|need_sglang_router\("
)


def _starts_servers(path: Path, seen: dict[Path, bool]) -> bool:
    if path not in seen:
        seen[path] = bool(_STARTS_SERVERS.search(path.read_text()))
    return seen[path]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return _LONGEST_FIRST.index(name) if name in _LONGEST_FIRST else len(_LONGEST_FIRST)

    items.sort(key=rank)  # stable: each file keeps its own order
    seen: dict[Path, bool] = {}
    for item in items:
        needs = set(getattr(item, "fixturenames", ()))
        if not needs & _SERVER_FIXTURES and not _starts_servers(item.path, seen):
            item.add_marker(pytest.mark.unit)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _FINDINGS:
        terminalreporter.section("findings")
        for line in _FINDINGS:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def twin_server(models: dict[str, Path]) -> Iterator[Served]:
    """The same model as `reference_server`, served a second time."""
    served = serve_reference(models["dsv3"])
    yield served
    served.proc.terminate()
    served.proc.wait(10)


@pytest.fixture
def front(
    tmp_path: Path, need_nginx: str, reference_server: Served, twin_server: Served
) -> Iterator[dict[str, Any]]:
    """nginx with kdctl's configuration in front of the reference server (`baseline`) and its
    twin (`candidate`), all traffic to the baseline (tests/support/traffic.py)."""
    from tests.support.traffic import nginx_front

    yield from nginx_front(tmp_path, need_nginx, reference_server.url, twin_server.url)
