"""SGLang's gateway (sglang-router, smg) over its three worker API generations: found by
probing once, each change confirmed by reading every gateway's registry back and by a
generation through each front. Against the real releases: 0.1.9 (add_worker) and 0.2.4
(workers by URL), installed by scripts/bootstrap-routers, and the sglang-router kdctl's venv
has (0.3.2, workers by id), two replicas of it in one test; and against every recorded
release's own answers (tests/fixtures/sglang-router/, scripts/capture-router-api)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import httpx
import pytest

from kdctl.backends import wait_http
from kdctl.inventory import load_inventory
from kdctl.traffic import RouterError, router_argv
from kdctl.traffic.sglang_router import SGLangRouter, probe_worker_api
from kdctl.transports import TransportPool
from tests.conftest import REPO, Served, engine_pair, need_sglang_router, write_inventory
from tests.support.sshd import free_port

RECORDED = sorted((REPO / "tests" / "fixtures" / "sglang-router").glob("*.json"))
ROUTERS = Path(os.environ.get("KDCTL_ROUTERS", Path.home() / ".cache/kdctl/sglang-routers"))


def _replay(doc: dict[str, Any], step: str) -> Any:
    """A `call` answering as the recorded release did to each request of `step`."""
    answers = {(e["method"], e["path"]): e for e in doc["exchanges"] if e["step"] == step}

    def call(method: str, path: str, **_: Any) -> httpx.Response:
        e = answers.get((method, path))
        if e is None:
            raise AssertionError(f"{doc['version']}: {method} {unquote(path)} was not recorded")
        body = e["body"]
        content = json.dumps(body) if not isinstance(body, str) else body
        request = httpx.Request(method, "http://recorded" + path)
        return httpx.Response(e["status"], content=content.encode(), request=request)

    return call


@pytest.mark.parametrize("path", RECORDED, ids=[p.stem for p in RECORDED])
def test_each_recorded_release_is_told_apart_by_its_own_answers(path: Path) -> None:
    doc = json.loads(path.read_text())
    call = _replay(doc, "probe")
    if not doc.get("can_list_workers", True):
        with pytest.raises(RouterError, match="has no worker list"):
            probe_worker_api(call, doc["version"])
        return
    api = probe_worker_api(call, doc["version"])
    assert api.generation == doc["generation"]
    assert [w.url for w in api.list()] == [doc["workers"]["W1"]]


def test_a_queued_job_that_failed_is_read_where_the_release_keeps_it() -> None:
    """0.2 answers 202 to a dead worker's add and keeps the failure only on the worker's
    own route for a while; the registry alone would only show it absent."""
    doc = json.loads((REPO / "tests/fixtures/sglang-router/0.2.4.json").read_text())
    failed = [
        e
        for e in doc["exchanges"]
        if e["step"] == "4-get-dead"
        and (e["body"].get("job_status") or {}).get("status") == "failed"
    ]
    assert failed, "the recording holds the failed job"
    api = probe_worker_api(_replay(doc, "probe"), "0.2.4")
    api._call = lambda method, path, **_: httpx.Response(200, json=failed[-1]["body"])
    said = api.job_failure(doc["workers"]["dead"])
    assert said is not None and said == failed[-1]["body"]["job_status"]["message"]


def _router(version: str, port: int, workers: list[str]) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    if version != "current":
        release = ROUTERS / version
        if not (release / ".complete").exists():
            if os.environ.get("CI"):
                pytest.fail(f"{release} is not installed; scripts/bootstrap-routers installs it")
            pytest.skip(f"{release} is not installed (scripts/bootstrap-routers installs it)")
        env["PYTHONPATH"] = str(release)
    return subprocess.Popen(
        router_argv(port, workers, prometheus_port=free_port()),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


@pytest.fixture
def gateways(request: pytest.FixtureRequest, reference_server: Served) -> Iterator[list[str]]:
    """`count` gateways of one release in front of the reference server."""
    need_sglang_router()
    version, count = request.param
    procs, fronts = [], []
    try:
        for _ in range(count):
            port = free_port()
            procs.append(_router(version, port, [reference_server.url]))
            fronts.append(f"127.0.0.1:{port}")
        for front in fronts:
            wait_http(f"http://{front}/readiness", deadline_s=60)
        yield fronts
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)


GENERATIONS = [
    (("0.1.9", 1), "add_worker"),
    (("0.2.4", 1), "workers-by-url"),
    (("current", 2), "workers-by-id"),
]


@pytest.mark.parametrize(
    ("gateways", "generation"),
    GENERATIONS,
    ids=[f"{v}x{n}" for (v, n), _ in GENERATIONS],
    indirect=["gateways"],
)
def test_a_switch_on_every_gateway_confirmed_by_read_back_and_generation(
    gateways: list[str],
    generation: str,
    reference_server: Served,
    twin_server: Served,
    tmp_path: Path,
) -> None:
    """The worker API generation found by probing; the candidate added and the baseline
    removed on every gateway, each registry read back and a generation through each front;
    then back. A gateway whose registry was changed behind kdctl's back fails the
    confirmation, naming it."""
    first, *peers = gateways
    inv = load_inventory(
        write_inventory(
            tmp_path / "inv.yaml",
            {
                "hosts": {"local": {"transport": "local"}},
                "backends": engine_pair(reference_server.url, twin_server.url),
                "router": {
                    "kind": "sglang-router",
                    "host": "local",
                    "listen": first,
                    "serving": "baseline",
                    "peers": [{"host": "local", "listen": p} for p in peers],
                },
            },
        )
    )
    assert inv.spec.router is not None
    with TransportPool(inv) as pool:
        router = SGLangRouter(inv, inv.spec.router, pool.get("local"))
        assert set(router.generations().values()) == {generation}
        assert router.read().weights == {"baseline": 100}
        assert router.apply({"candidate": 100}).weights == {"candidate": 100}
        for front in router.fronts:
            listed = httpx.get(
                f"{front}/{'list_workers' if generation == 'add_worker' else 'workers'}"
            )
            assert twin_server.url in listed.text and reference_server.url not in listed.text
        assert router.apply({"baseline": 100}).weights == {"baseline": 100}
        if peers:
            # The second gateway's registry changed by hand: the two no longer agree.
            peer = f"http://{peers[0]}"
            httpx.post(f"{peer}/workers", json={"url": twin_server.url}).raise_for_status()
            wait = httpx.get(f"{peer}/workers").json()["workers"]
            assert len(wait) >= 1
            with pytest.raises(RouterError, match=f"sglang-router at {peer} lists"):
                for _ in range(50):
                    router.confirm({"baseline": 100})
