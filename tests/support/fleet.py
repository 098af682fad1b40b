"""A fleet on this machine: boxes that are network namespaces with their own sshd (box.py),
each seeing a folder of its own at BOX_DIR, where two engines of kdctl's reference server, an
old pool's and a new pool's, cannot run at once: each holds the box's GPU stand-in, a lock the
other's start needs (flock -n), as an engine holds its GPUs. kdctl starts them through the box's
SSH login; SGLang's router fronts the old pool. What tests/test_rolling*.py and
benchmarks/rolling_capacity.py run."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kdctl.backends import wait_http
from kdctl.backends.reference import serve_argv
from kdctl.inventory import LoadedInventory, load_inventory
from kdctl.traffic import router_argv
from tests.support.box import Box, make_box
from tests.support.sshd import free_port

BOX_DIR = "/var/lib/kdctl-box"
OLD_PORT, NEW_PORT = 30000, 30001


@dataclass
class Fleet:
    boxes: list[Box]
    inventory: Path
    front: str
    # Each box's folder, seen on the box at BOX_DIR.
    dirs: list[Path]


def _service(port: int, name: str, wrap: Callable[[list[str]], list[str]]) -> dict[str, Any]:
    """An engine's service on a box: it starts only while the box's GPU lock is free, and
    holds it while it runs; it serves the checkpoint the box's `NAME-model` link points at."""
    model = f"{BOX_DIR}/{name}-model"
    serve = [*serve_argv(model, port, served_name="tiny"), "--host", "0.0.0.0"]
    return {
        "command": ["flock", "-n", f"{BOX_DIR}/gpu.lock", *wrap(serve)],
        "pidfile": f"{BOX_DIR}/{name}.pid",
        "log": f"{BOX_DIR}/{name}.log",
    }


def bench_model(bench: str) -> Path:
    """A benchmark's tiny model, made in a folder of its own; the benchmark ends where this
    machine cannot make boxes (network namespaces need root)."""
    if os.geteuid() != 0:
        sys.exit(f"{bench}: boxes are network namespaces, which need root")
    model = Path(tempfile.mkdtemp(prefix="kdctl-bench-")) / "tiny-deepseek-v3"
    subprocess.run(
        [sys.executable, "-m", "kdctl", "reference", "make-model", "--arch", "deepseek_v3",
         "--out", str(model)],
        check=True, capture_output=True,
    )  # fmt: skip
    return model


def _all_registered(inv: LoadedInventory, names: list[str]) -> None:
    """Every worker the router was started with, in its registry: it adds them by background
    jobs that check each worker first, and on a loaded machine a check can time out and leave
    one out (seen once in a whole-suite run). One left out is added by kdctl's own driver, the
    change read back."""
    from kdctl.traffic import make_router
    from kdctl.transports import TransportPool

    with TransportPool(inv) as pool:
        router = make_router(inv, pool)
        deadline = time.monotonic() + 30
        while sorted(router.read().serving) != sorted(names):
            if time.monotonic() > deadline:
                router.set_members(names)
                return
            time.sleep(0.5)


@contextlib.contextmanager
def rolling_fleet(
    model: Path,
    *,
    tag: str,
    size: int = 4,
    wrap: Callable[[list[str]], list[str]] = list,
) -> Iterator[Fleet]:
    """`size` boxes running pool `sglang`, pool `native` stopped, SGLang's router in front of
    the first; `tag` keeps two runs' boxes apart, `wrap` turns an engine's command line into
    the one its service runs."""
    root = Path(tempfile.mkdtemp(prefix="kdctl-rolling-"))
    root.chmod(0o755)
    Path(BOX_DIR).mkdir(parents=True, exist_ok=True)
    boxes: list[Box] = []
    router: subprocess.Popen[bytes] | None = None
    inv_path = root / "inv.yaml"
    names = [f"box{i}" for i in range(1, size + 1)]
    try:
        for i, name in enumerate(names, 1):
            own = root / name
            own.mkdir(mode=0o755)
            for pool in ("sglang", "native"):
                (own / f"{pool}-model").symlink_to(model)
            # This machine's root runs `pyenv init` in its .bashrc, which bash reads for every
            # command sshd runs: 0.1 s of CPU an SSH command that a box's root does not spend.
            (own / ".bashrc").touch()
            mounts = {BOX_DIR: own, "/root/.bashrc": own / ".bashrc"}
            boxes.append(make_box(root / f"b{i}", f"rl{i}{tag}"[:9], mounts=mounts))
        port = free_port()
        data: dict[str, Any] = {
            # Each box's engines are reached directly, every run: under `auto` one direct
            # connect that failed on the loaded machine sent a smoke throughput run through
            # the SSH tunnel, and against the replaced replica's run recorded directly it was
            # inconclusive (two paths), which paused a rollout.
            "hosts": {
                n: b.host_entry(user="root", http="direct")
                for n, b in zip(names, boxes, strict=True)
            },
            "groups": {"boxes": names},
            "backends": {
                pool: {
                    "kind": kind,
                    "model": f"{BOX_DIR}/{pool}-model",
                    "gpus": [0],
                    "replicas": {"group": "boxes", "port": p},
                    "service": _service(p, pool, wrap),
                }
                for pool, kind, p in (
                    ("sglang", "sglang", OLD_PORT),
                    ("native", "native", NEW_PORT),
                )
            },
            "router": {
                "kind": "sglang-router",
                "host": "local-router",
                "listen": f"127.0.0.1:{port}",
                "serving": "sglang",
            },
            "gates": {
                "exactness": {"max_new_tokens": 4, "top_k": 3},
                # Short, so a rolling cutover's smoke run of it is; a run that short on shared
                # cores is noisy, so the bar catches only a build several times slower.
                "throughput": {
                    "min_ratio": 0.25,
                    "workload": {
                        "input_len": 16,
                        "output_len": 8,
                        "concurrency": [2],
                        "num_prompts": 6,
                    },
                },
            },
            "state_dir": str(root / "state"),
        }
        data["hosts"]["local-router"] = {"transport": "local"}
        inv_path.write_text(yaml.safe_dump(data, sort_keys=False))
        inv = load_inventory(inv_path)
        from kdctl.cutover.runner import change_engine
        from kdctl.session import Session

        with Session(inv) as session, ThreadPoolExecutor(size) as pool:
            started = pool.map(
                lambda n: change_engine(inv, session, n, "start"), inv.pools["sglang"]
            )
            assert all("ready" in s for s in started)
        urls = [inv.backends[n].url or "" for n in inv.pools["sglang"]]
        router = subprocess.Popen(
            router_argv(port, urls, prometheus_port=free_port()),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_http(f"http://127.0.0.1:{port}/readiness", deadline_s=60)
        _all_registered(inv, list(inv.pools["sglang"]))
        yield Fleet(boxes, inv_path, f"http://127.0.0.1:{port}", [root / n for n in names])
    finally:
        if router is not None:
            router.terminate()
            router.wait(10)
        # Whatever still runs on a box (its pidfile says) goes with the box: the whole process
        # group kdctl started it in (setsid), as its stop would, or flock's child outlives it.
        for pidfile in root.glob("box*/*.pid"):
            with contextlib.suppress(OSError, ValueError):
                os.killpg(int(pidfile.read_text().split()[0]), signal.SIGKILL)
        for box in boxes:
            box.close()
        shutil.rmtree(root, ignore_errors=True)


def four_boxes(models: dict[str, Path]) -> Iterator[Fleet]:
    """A test module's fleet (`fleet = pytest.fixture(scope="module", name="fleet")(four_boxes)`):
    four boxes running the old engine, SGLang's router in front of the four, the boxes' engines
    forks of the test worker's warm engine server."""
    import pytest

    from tests.conftest import need_sglang_router, warm_argv

    if os.geteuid() != 0:
        pytest.skip("a network namespace needs root")
    need_sglang_router()
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with rolling_fleet(models["dsv3"], tag=worker, wrap=warm_argv) as fleet:
        yield fleet


def router_serves(fleet: Fleet) -> list[str]:
    """The replicas the fleet's router sends to, as it says when read."""
    from kdctl.traffic import make_router
    from kdctl.transports import TransportPool

    inv = load_inventory(fleet.inventory)
    with TransportPool(inv) as pool:
        return make_router(inv, pool).read().serving
