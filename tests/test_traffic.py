"""Cutover and rollback through a real nginx on loopback in front of reference servers, under a
steady load of streaming and non-streaming requests; SGLang's real router for blue-green."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import yaml

from kdctl.backends import wait_http
from kdctl.traffic import router_argv
from tests.conftest import (
    Served,
    engine_pair,
    kdctl,
    need_module,
    need_sglang_router,
    serve_reference,
    write_inventory,
)
from tests.support.postgres import Cluster
from tests.support.sshd import free_port
from tests.support.traffic import ROADMAP, Load, promotion, weights

need_module("torch", "reference")


def _promotion_details(inv: str) -> dict[str, Any]:
    """The newest promotion result's record of the cutover it ends: its id, strategy and the
    backend traffic moved from."""
    listed = kdctl("evidence", "list", "--gate", "promotion", "--json", "-i", inv)
    return dict(json.loads(listed.out)["results"][0]["details"])


def test_gated_blue_green_canary_and_rollback_drop_no_request(front: dict[str, Any]) -> None:
    inv = str(front["inv"])
    refused = kdctl("cutover", "--to", "candidate", "--yes", "-i", inv)
    assert refused.code == 1, refused.out + refused.err
    assert "cutover to candidate refused" in refused.err and "exactness" in refused.err
    assert weights(front["include"]) == {"baseline": 100}

    plan = kdctl("cutover", "--to", "candidate", "--dry-run", "-i", inv)
    assert plan.code == 0 and "plan: canary from baseline to candidate" in plan.out
    assert "set weights baseline 95%, candidate 5%" in plan.out

    assert kdctl("baseline", "record", "-b", "baseline", "--only", "golden", "-i", inv).code == 0
    assert kdctl("phases", "--run", "-i", inv).code == 0
    # No terminal and no --yes: refused rather than waiting for an answer.
    unasked = kdctl("cutover", "--to", "candidate", "--strategy", "blue-green", "-i", inv)
    assert unasked.code == 1 and "No terminal to ask and no --yes" in unasked.err

    with Load(front["url"]) as load:
        time.sleep(1)
        bg = kdctl("cutover", "--to", "candidate", "--strategy", "blue-green", "--yes", "-i", inv)
        assert bg.code == 0, bg.out + bg.err
        assert "succeeded" in bg.out and weights(front["include"]) == {"candidate": 100}
        from kdctl.traffic import SqliteJournal

        with SqliteJournal(front["inv"].parent / "state") as journal:
            moved_bg = journal.latest()
        assert moved_bg is not None and moved_bg.state == "succeeded", moved_bg
        promoted = promotion(inv)
        assert (promoted["verdict"], promoted["weight"]) == ("pass", 100)
        bg_details = {"cutover": moved_bg.id, "from": "baseline", "strategy": "blue-green"}
        assert _promotion_details(inv) == bg_details
        time.sleep(1)
        back = kdctl("rollback", "--yes", "-i", inv)
        assert back.code == 0, back.out + back.err
        assert weights(front["include"]) == {"baseline": 100}
        demoted = promotion(inv)
        assert (demoted["verdict"], demoted["weight"]) == ("fail", 0)
        assert _promotion_details(inv) == bg_details  # the same cutover, undone
        assert demoted["reason"].endswith("rolled back to baseline (kdctl rollback)")
        time.sleep(1)
        canary = kdctl(
            "cutover",
            "--to",
            "candidate",
            "--steps",
            "25,50,100",
            "--watch",
            "2",
            "--yes",
            "-i",
            inv,
            "--json",
        )
        assert canary.code == 0, canary.out + canary.err
        time.sleep(1)
    outcome = json.loads(canary.out)
    assert outcome["state"] == "succeeded" and outcome["router"]["weights"] == {"candidate": 100}
    assert [w["failed"] for w in outcome["watches"]] == [0, 0]
    promoted = promotion(inv)
    assert promoted["verdict"] == "pass" and promoted["probe_failed"] == 0
    assert promoted["probe_requests"] == sum(w["sent"] for w in outcome["watches"]) > 0
    # The candidate's own counters saw the canary's share of the traffic.
    assert all(w["engine_requests"] > 0 for w in outcome["watches"]), outcome["watches"]
    assert promoted["engine_requests"] == sum(w["engine_requests"] for w in outcome["watches"])
    assert all(w["engine_ttft_p99_ms"] > 0 for w in outcome["watches"])
    assert load.sent > 30 and not load.failures, load.failures[:5]
    assert load.served_by.get("baseline") and load.served_by.get("candidate")

    status = kdctl("status", "-i", inv, "--json")
    assert json.loads(status.out)["traffic"]["weights"] == {"candidate": 100}

    # The promotion ends a phase only while the front still answers from the candidate: once
    # traffic is moved back outside kdctl (nginx's file restored by hand), it no longer holds.
    promoted_roadmap = front["root"].parent / "promoted.yaml"
    promoted_roadmap.write_text(
        yaml.safe_dump(
            {
                "title": "Promotion",
                "serving": "baseline",
                "candidate": "candidate",
                "phases": [{"id": "moved", "title": "Moved", "criteria": [{"gate": "promotion"}]}],
            }
        )
    )

    def moved() -> dict[str, Any]:
        run = kdctl("phases", "-i", inv, "--roadmap", str(promoted_roadmap), "--json")
        (phase,) = json.loads(run.out)["phases"]
        return dict(phase["criteria"][0])

    assert moved()["state"] == "pass"
    # nginx runs on, answering from the candidate, but its file cannot be read back: one
    # answer shows the candidate serving, not that it serves all traffic.
    hidden = front["include"].with_suffix(".away")
    front["include"].rename(hidden)
    try:
        unread = moved()
    finally:
        hidden.rename(front["include"])
    assert unread["state"] == "stale" and unread["stale_by"] == ["front"], unread
    assert "the router's weights could not be read (" in unread["reason"], unread["reason"]
    from kdctl.inventory import load_inventory
    from kdctl.traffic.nginx import NginxRouter
    from kdctl.transports import TransportPool

    loaded = load_inventory(front["inv"])
    with TransportPool(loaded) as pool:
        router = NginxRouter(loaded, loaded.spec.router, pool.get("local"))  # type: ignore[arg-type]
        router.apply({"baseline": 100})
    held = moved()
    assert held["state"] == "stale" and held["stale_by"] == ["front"], held
    assert "the front answers from baseline now" in held["reason"], held["reason"]


def test_second_cutover_is_refused_while_one_holds_the_lock(front: dict[str, Any]) -> None:
    from kdctl.traffic import SqliteJournal

    inv = str(front["inv"])
    with SqliteJournal(front["inv"].parent / "state") as journal, journal.locked():
        run = kdctl("cutover", "--to", "candidate", "--force", "--yes", "-i", inv)
    assert run.code == 1, run.out + run.err
    assert "another cutover holds the traffic lock" in run.err
    assert f"pid {os.getpid()}" in run.err and " since " in run.err
    assert weights(front["include"]) == {"baseline": 100}


def test_a_config_nginx_refuses_is_never_applied(front: dict[str, Any], tmp_path: Path) -> None:
    data = json.loads(json.dumps(front["data"]))
    # A name nginx cannot resolve: `nginx -t` fails on it; the inventory cannot know.
    data["backends"]["candidate"]["url"] = "http://kdctl-no-such-host.invalid:31999"
    inv = write_inventory(tmp_path / "bad.yaml", data)
    before = front["include"].read_text()
    run = kdctl(
        "cutover",
        "--to",
        "candidate",
        "--strategy",
        "blue-green",
        "--force",
        "--yes",
        "-i",
        str(inv),
    )
    assert run.code == 1, run.out + run.err
    assert "nginx -t refused the new configuration" in run.out + run.err
    assert front["include"].read_text() == before
    with httpx.Client() as client:
        r = client.get(front["url"] + "/health")
    assert r.status_code == 200 and r.headers["x-kdctl-backend"] == "baseline"


def test_values_that_would_inject_directives_are_rejected(front: dict[str, Any]) -> None:
    from kdctl.errors import InputError
    from kdctl.inventory import BackendSpec, load_inventory
    from kdctl.traffic.nginx import NginxRouter
    from kdctl.transports import TransportPool

    data = json.loads(json.dumps(front["data"]))
    data["router"]["listen"] = "127.0.0.1:80; include /etc/shadow"
    bad = write_inventory(front["inv"].parent / "inject.yaml", data)
    run = kdctl("inventory", "check", "-i", str(bad))
    assert run.code == 2 and "router.listen" in run.err
    # Past the inventory's checks (a plugin, a hand-built spec): the driver refuses too.
    inv = load_inventory(front["inv"])
    evil = BackendSpec.model_construct(
        kind="sglang", host="local", url="http://127.0.0.1:1/;}server{listen 9", gpus=[], tp_size=1
    )
    inv.engines["baseline"] = evil  # type: ignore[index]
    with TransportPool(inv) as pool:
        router = NginxRouter(inv, inv.spec.router, pool.get("local"))  # type: ignore[arg-type]
        with pytest.raises(InputError, match="nginx fronts plain"):
            router.render({"baseline": 100})


def test_candidate_killed_mid_canary_rolls_back(
    front: dict[str, Any], models: dict[str, Path], tmp_path: Path, report: Any
) -> None:
    victim = serve_reference(models["dsv3"])
    data = json.loads(json.dumps(front["data"]))
    data["backends"]["candidate"]["url"] = victim.url
    inv = str(write_inventory(tmp_path / "victim.yaml", data))
    killer = threading.Timer(3.0, victim.proc.kill)
    with Load(front["url"]) as load:
        killer.start()
        run = kdctl(
            "cutover",
            "--to",
            "candidate",
            "--steps",
            "50,100",
            "--watch",
            "8",
            "--force",
            "--yes",
            "-i",
            inv,
            "--json",
        )
    victim.proc.wait(10)
    assert run.code == 1, run.out + run.err
    outcome = json.loads(run.out)
    assert outcome["state"] == "rolled_back"
    # The window that ended the canary names the SLOs it broke.
    assert outcome["watches"] and outcome["watches"][-1].get("broke"), outcome["watches"]
    demoted = promotion(inv)
    assert (demoted["verdict"], demoted["weight"]) == ("fail", 0)
    assert "rolled back to baseline: SLO breach during the canary" in demoted["reason"]
    assert outcome["router"]["weights"] == {"baseline": 100}
    assert outcome["watches"] and "failed" in outcome["watches"][-1]
    assert weights(front["include"]) == {"baseline": 100}
    assert load.sent > 0
    report(
        f"candidate killed mid-canary: rolled back ({outcome['reason'][:120]}); the watch saw "
        f"{outcome['watches'][-1]['failed']} failed probe requests, the client load "
        f"{len(load.failures)} of {load.sent}"
    )


@dataclass
class RouterUnderTest:
    url: str
    # The key the router requires of every client, where it was started with one.
    key: str | None


@pytest.fixture(params=[None, "router-secret-7f3a"], ids=["open", "api-key"])
def sglang_router(
    reference_server: Served, request: pytest.FixtureRequest
) -> Iterator[RouterUnderTest]:
    need_sglang_router()
    port = free_port()
    key: str | None = request.param
    proc = subprocess.Popen(
        router_argv(port, [reference_server.url], prometheus_port=free_port(), api_key=key),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/readiness", deadline_s=60)
        yield RouterUnderTest(url, key)
    finally:
        proc.terminate()
        proc.wait(10)


def test_sglang_router_blue_green_and_rollback(
    sglang_router: RouterUnderTest, reference_server: Served, twin_server: Served, tmp_path: Path
) -> None:
    """Against SGLang's router as it runs, open and with --api-key: with a key, kdctl's worker
    API calls carry it from router.api_key_env, and without it kdctl says what is missing."""
    router = sglang_router
    host, port = router.url.removeprefix("http://").split(":")
    (tmp_path / "roadmap.yaml").write_text(yaml.safe_dump(ROADMAP, sort_keys=False))
    spec: dict[str, Any] = {
        "hosts": {"local": {"transport": "local"}},
        "backends": engine_pair(reference_server.url, twin_server.url),
        "router": {
            "kind": "sglang-router",
            "host": "local",
            "listen": f"{host}:{port}",
            "serving": "baseline",
        },
        "roadmap": "roadmap.yaml",
        "state_dir": "state",
    }
    env = {}
    if router.key:
        keyless = str(write_inventory(tmp_path / "keyless.yaml", spec))
        refused = kdctl("cutover", "--to", "candidate", "--force", "--yes", "-i", keyless)
        assert refused.code == 3, refused.out + refused.err
        assert "GET /workers: HTTP 401: it wants an API key (router.api_key_env" in refused.err
        # Its generation refused, the router's own /health (200 whatever its workers do)
        # is no engine's answer: who serves is not known from here.
        status = kdctl("status", "-i", keyless, "--json", "--timeout", "5")
        serving = json.loads(status.out)["answers"]["serving"]
        assert (serving["state"], serving["answered"], serving["backend"]) == (
            "unknown",
            None,
            None,
        ), serving
        assert "own /health answers whatever its workers do" in serving["detail"], serving
        spec["router"]["api_key_env"] = "KDCTL_TEST_ROUTER_KEY"
        env = {"KDCTL_TEST_ROUTER_KEY": router.key}
    inv = str(write_inventory(tmp_path / "inv.yaml", spec))
    plan = kdctl("cutover", "--to", "candidate", "--dry-run", "-i", inv, env=env)
    assert plan.code == 0 and "plan: blue-green" in plan.out and "has no weights" in plan.out
    canary = kdctl(
        "cutover", "--to", "candidate", "--strategy", "canary", "--dry-run", "-i", inv, env=env
    )
    assert canary.code == 2 and "sglang-router has no traffic weights" in canary.err
    with Load(router.url, api_key=router.key) as load:
        run = kdctl(
            "cutover", "--to", "candidate", "--force", "--yes", "-i", inv, "--json", env=env
        )
        assert run.code == 0, run.out + run.err
        assert json.loads(run.out)["router"]["weights"] == {"candidate": 100}
        back = kdctl("rollback", "--yes", "-i", inv, "--json", env=env)
        assert back.code == 0, back.out + back.err
    assert json.loads(back.out)["router"]["weights"] == {"baseline": 100}
    headers = {"Authorization": f"Bearer {router.key}"} if router.key else {}
    workers = httpx.get(router.url + "/workers", headers=headers).json()["workers"]
    assert [w["url"] for w in workers] == [reference_server.url]
    assert load.sent > 10 and not load.failures, load.failures[:5]
    assert router.key is None or router.key not in run.out + run.err + back.out + back.err


def test_sglang_router_confirms_only_an_engine_that_generates_through_it(
    models: dict[str, Path], twin_server: Served, tmp_path: Path
) -> None:
    """SGLang's router keeps listing a worker whose engine has died (until its health checks
    fail): read back alone, a rollback to it would be said done with nothing serving. The
    confirmation is a generation through the router."""
    from kdctl.inventory import load_inventory
    from kdctl.traffic import RouterError
    from kdctl.traffic.sglang_router import SGLangRouter
    from kdctl.transports import TransportPool

    need_sglang_router()
    engine = serve_reference(models["dsv3"])
    port = free_port()
    proc = subprocess.Popen(
        router_argv(port, [engine.url], prometheus_port=free_port()),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/readiness", deadline_s=60)
        inv = write_inventory(
            tmp_path / "inv.yaml",
            {
                "hosts": {"local": {"transport": "local"}},
                "backends": engine_pair(engine.url, twin_server.url),
                "router": {
                    "kind": "sglang-router",
                    "host": "local",
                    "listen": f"127.0.0.1:{port}",
                    "serving": "baseline",
                },
            },
        )
        loaded = load_inventory(inv)
        with TransportPool(loaded) as pool:
            router = SGLangRouter(loaded, loaded.spec.router, pool.get("local"))  # type: ignore[arg-type]
            assert router.confirm({"baseline": 100}).weights == {"baseline": 100}
            answer = json.loads(kdctl("status", "-i", str(inv), "--json").out)["answers"]
            assert answer["serving"]["backend"] == "baseline", answer["serving"]

            # A worker registered by an address no backend has: the answers through the
            # router are no longer credited to the one the inventory knows.
            front = f"http://127.0.0.1:{port}"
            stranger = twin_server.url.replace("127.0.0.1", "localhost")
            assert httpx.post(front + "/workers", json={"url": stranger}).status_code < 300
            deadline = time.monotonic() + 30
            while len(httpx.get(front + "/workers").json()["workers"]) < 2:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            serving = json.loads(kdctl("status", "-i", str(inv), "--json").out)["answers"][
                "serving"
            ]
            assert serving["backend"] is None, serving
            routed = {name.rstrip("/") for name in serving["routed"]["weights"]}
            assert routed == {"baseline", stranger}, serving["routed"]
            assert f"the router also sends traffic to {stranger}" in serving["detail"], serving
            (listed,) = [
                w for w in httpx.get(front + "/workers").json()["workers"] if w["url"] == stranger
            ]
            httpx.delete(f"{front}/workers/{listed.get('id') or quote(stranger, safe='')}")
            while len(httpx.get(front + "/workers").json()["workers"]) > 1:
                assert time.monotonic() < deadline
                time.sleep(0.1)

            engine.proc.kill()
            engine.proc.wait(10)
            assert router.read().weights == {"baseline": 100}  # still listed
            # Already listed: nothing to add, and still refused.
            with pytest.MonkeyPatch.context() as mp, pytest.raises(RouterError) as got:
                mp.setattr(SGLangRouter, "confirm_s", 2.0)
                router.apply({"baseline": 100})
            assert "no generation from baseline directly succeeded" in str(got.value)
    finally:
        proc.terminate()
        proc.wait(10)
        engine.proc.kill()


def test_drain_answers_503_with_retry_after(front: dict[str, Any]) -> None:
    from kdctl.inventory import load_inventory
    from kdctl.traffic.nginx import NginxRouter
    from kdctl.transports import TransportPool

    inv = load_inventory(front["inv"])
    master = int((front["root"] / "nginx.pid").read_text())

    def workers() -> dict[int, str]:
        ps = subprocess.run(
            ["ps", "-o", "pid=,args=", "--ppid", str(master)], capture_output=True, text=True
        )
        return {int(ln.split()[0]): ln for ln in ps.stdout.splitlines() if ln.strip()}

    # A stream in flight through a worker of the old file when the drain starts: that worker
    # finishes it after the reload, so the drain returns only once it has (an engine stopped
    # after the drain would otherwise end it, and nginx answer 502).
    streaming, ended = threading.Event(), {}

    def stream() -> None:
        body = {
            "input_ids": [11, 12, 13],
            "sampling_params": {"max_new_tokens": 600, "temperature": 0, "ignore_eos": True},
            "stream": True,
        }
        with httpx.stream("POST", front["url"] + "/generate", json=body, timeout=60) as r:
            lines = []
            for line in r.iter_lines():
                streaming.set()
                if line.startswith("data:"):
                    lines.append(line)
        ended.update(at=time.monotonic(), status=r.status_code, last=lines[-1:])

    with TransportPool(inv) as pool:
        router = NginxRouter(inv, inv.spec.router, pool.get("local"))  # type: ignore[arg-type]
        before = workers()
        reader = threading.Thread(target=stream)
        reader.start()
        assert streaming.wait(30)
        assert router.drain().draining
        drained_at = time.monotonic()
        reader.join(60)
        assert ended["status"] == 200 and ended["last"] == ["data: [DONE]"], ended
        assert ended["at"] <= drained_at, "the drain returned with a request in flight"
        # No worker of the old file may still take a connection once drain() returns: each
        # has finished what it took and is gone.
        after = workers()
        assert before and not before.keys() & after.keys(), after
        deadline = time.monotonic() + 10
        while True:  # the reload's new workers take over shortly after it returns
            r = httpx.get(front["url"] + "/generate")
            if r.status_code == 503 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert r.status_code == 503 and r.headers["retry-after"] == "30"
        status = kdctl("status", "-i", str(front["inv"]), "--json")
        assert json.loads(status.out)["traffic"]["draining"] is True
        assert router.apply({"baseline": 100}).weights == {"baseline": 100}
    assert httpx.get(front["url"] + "/health").headers["x-kdctl-backend"] == "baseline"


def test_the_journal_and_its_lock_in_the_shared_store(
    front: dict[str, Any], postgres: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a PostgreSQL evidence store the journal lives there too, and the traffic lock is
    the session's advisory lock: a second cutover is refused naming the holder, and a SIGKILLed
    cutover's lock goes with its session, so the rollback that repairs it is not kept out."""
    from kdctl.traffic import PostgresJournal

    url = postgres.create_database()
    monkeypatch.setenv("KDCTL_EVIDENCE_URL", url)
    monkeypatch.setenv("PGPASSWORD", postgres.password)
    inv = str(front["inv"])
    canary = ["cutover", "--to", "candidate", "--force", "--yes", "--steps", "50,100"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kdctl", *canary, "--watch", "30", "-i", inv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while weights(front["include"]) != {"baseline": 50, "candidate": 50}:
            assert proc.poll() is None and time.monotonic() < deadline, "the canary never began"
            time.sleep(0.1)
        second = kdctl("cutover", "--to", "candidate", "--force", "--yes", "-i", inv)
        assert second.code == 1, second.out + second.err
        assert "another cutover holds the traffic lock" in second.err
        assert f"pid {proc.pid}" in second.err
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while True:  # the server drops the lock once it sees the session gone
        back = kdctl("rollback", "--yes", "-i", inv)
        if back.code == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert back.code == 0, back.out + back.err
    assert weights(front["include"]) == {"baseline": 100}
    with PostgresJournal(url, password=postgres.password) as journal:
        assert journal.latest(state="running") is None
        latest = journal.latest()
        assert latest is not None and latest.to_backend == "candidate"
        assert any(s.kind == "set-weights" for s in latest.steps)
    assert not (front["inv"].parent / "state" / "traffic.sqlite").exists()


def test_a_ttft_slo_under_the_engines_first_bucket_is_left_to_the_probes(
    reference_server: Served, tmp_path: Path
) -> None:
    """The reference server keeps SGLang's TTFT buckets (the first ends at 0.1 s). Over a
    window of real requests its histogram reads a p99 near 100 ms, whatever the requests
    took: a 50 ms SLO judged from it would breach on every window, so the canary leaves such an
    SLO to its probes and says so; one the buckets can judge is judged from them."""
    from kdctl.backends import GenerateRequest, make_backend
    from kdctl.cutover.analysis import EngineCounters, engine_counters, engine_ttft
    from kdctl.inventory import load_inventory

    inv = load_inventory(
        write_inventory(
            tmp_path / "inventory.yaml",
            {
                "hosts": {"local": {"transport": "local"}},
                "backends": {
                    "baseline": {"kind": "sglang", "host": "local", "url": reference_server.url}
                },
            },
        )
    )
    before = engine_counters(inv, "baseline")
    with make_backend("baseline", inv.backends["baseline"]) as be:
        for i in range(4):
            be.generate(GenerateRequest(input_ids=[11 + i, 12, 13], max_new_tokens=2))
    after = engine_counters(inv, "baseline")
    assert before is not None and after is not None
    window = after.minus(before)
    assert window.requests is not None and window.requests >= 4
    assert min(window.ttft_buckets) == 0.1

    ms, note, breach = engine_ttft(window, "p99", 50)
    assert ms is not None and 50 < ms <= 100 and not breach
    assert note == (
        "TTFT histogram cannot judge an SLO of 50 ms: its first bucket ends at 100 ms; "
        "judged by the probes"
    )
    assert engine_ttft(window, "p99", 150) == (ms, "", "")
    # Requests that took 0.4 to 0.6 s, as an engine's own buckets would count them.
    slow = EngineCounters(requests=4, ttft_buckets={0.1: 0, 0.2: 0, 0.4: 0, 0.6: 4, 1.0: 4})
    ms, note, breach = engine_ttft(slow, "p99", 300)
    assert ms is not None and 400 < ms <= 600 and not note
    assert breach.startswith("TTFT p99 ") and "exceeds the SLO of 300 ms" in breach


def _held_to(port: int) -> int:
    """Established TCP connections to a local port, as the kernel lists them."""
    out = subprocess.run(
        ["ss", "-Htn", "state", "established", f"( dport = :{port} )"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return len(out.splitlines())


def test_the_front_lets_go_of_an_idle_engine_connection_before_the_engine_does(
    front: dict[str, Any], reference_server: Served
) -> None:
    """SGLang 0.5.23 (SGLANG_TIMEOUT_KEEP_ALIVE), vLLM (VLLM_HTTP_TIMEOUT_KEEP_ALIVE) and
    uvicorn close a connection idle for 5 s, and a request nginx sends on one as it closes is
    answered 502. The front's own keep-alive toward the engines ends first: kept after a
    request through it, gone 4.6 s later."""
    from urllib.parse import urlsplit

    port = urlsplit(reference_server.url).port
    assert port is not None
    body = {"input_ids": [11, 12, 13], "sampling_params": {"max_new_tokens": 2}}
    assert httpx.post(front["url"] + "/generate", json=body, timeout=30).status_code == 200
    assert _held_to(port) >= 1  # kept alive: the case at issue
    time.sleep(4.6)
    assert _held_to(port) == 0
