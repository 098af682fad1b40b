"""Pools: the same engine on several boxes, each replica a backend of its own (POOL@HOST) with
its own health, identity and evidence, rolled up per pool. The boxes are network namespaces
with their own sshd and machine id; the engines kdctl's reference server on each box, reached
through the box's SSH connection."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kdctl.backends.reference import serve_argv
from kdctl.inventory import load_inventory
from tests.conftest import kdctl, write_inventory
from tests.support.box import Box, make_box

POOLS = """\
hosts:
  box1: {address: 10.0.0.1, gpus: 8}
  box2: {address: 10.0.0.2, gpus: 8}
  box3: {address: 10.0.0.3, gpus: 8}
groups:
  boxes: [box1, box2, box3]
backends:
  sglang:
    kind: sglang
    gpus: [0, 1, 2, 3, 4, 5, 6, 7]
    tp_size: 8
    api_key_env: POOL_TEST_KEY
    replicas:
      - {host: box1, url: "http://10.0.0.1:30000"}
      - {host: box2, url: "http://10.0.0.2:30000", gpus: [0, 1, 2, 3, 4, 5, 6, 7]}
  native:
    kind: native
    replicas: {group: boxes, port: 30001}
  solo:
    kind: sglang
    host: box3
    url: http://10.0.0.3:30002
"""


def test_a_pool_is_one_backend_per_replica(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each replica is an ordinary backend named POOL@HOST with the pool's settings, its own
    host and URL; a group gives one per host, at the host's address; a single-URL backend
    stays as it is."""
    monkeypatch.setenv("POOL_TEST_KEY", "sk-pool")
    path = tmp_path / "inv.yaml"
    path.write_text(POOLS)
    inv = load_inventory(path)
    assert dict(inv.pools) == {
        "sglang": ("sglang@box1", "sglang@box2"),
        "native": ("native@box1", "native@box2", "native@box3"),
    }
    assert list(inv.backends) == [*inv.pools["sglang"], *inv.pools["native"], "solo"]
    one = inv.backends["sglang@box2"]
    assert (one.kind, one.host, one.url, one.tp_size) == (
        "sglang",
        "box2",
        "http://10.0.0.2:30000",
        8,
    )
    assert [inv.backends[n].url for n in inv.pools["native"]] == [
        f"http://10.0.0.{i}:30001" for i in (1, 2, 3)
    ]
    assert inv.members("sglang") == ("sglang@box1", "sglang@box2")
    assert inv.members("solo") == ("solo",)
    assert inv.pool_of("native@box3") == "native" and inv.pool_of("solo") is None
    key = inv.api_key("sglang@box1")
    assert key is not None and key.get_secret_value() == "sk-pool"


BAD = [
    (
        "unknown host",
        "replicas:\n      - {host: box1, url: http://127.0.0.1:1}\n      - {host: bx2, url: http://127.0.0.1:1}",
        15,
        "backends.p.replicas[1].host: unknown host 'bx2'",
    ),
    (
        "two on one host",
        "replicas:\n      - {host: box1, url: http://127.0.0.1:1}\n      - {host: box1, url: http://127.0.0.1:2}",
        15,
        "backends.p.replicas[1].host: box1 already runs a replica of p",
    ),
    ("unknown group", "replicas: {group: racks, port: 1}", 13, "unknown group 'racks'"),
    ("empty", "replicas: []", 13, "backends.p.replicas"),
    (
        "host and replicas",
        "host: box1\n    replicas: {group: boxes, port: 1}",
        13,
        "backends.p.host: unknown field",
    ),
    (
        "one replica's url",
        "replicas:\n      - {host: box1}\n      - {host: box2, url: http://127.0.0.1:1}",
        14,
        "backends.p.replicas[0].url: a 'sglang' backend needs a 'url'",
    ),
    (
        "one replica's GPUs",
        "replicas:\n      - {host: box1, url: http://127.0.0.1:1, gpus: [9]}",
        14,
        "backends.p.replicas[0].gpus[0]: GPU 9 does not exist: host 'box1' has 8 GPU(s)",
    ),
]


@pytest.mark.parametrize(("name", "entry", "line", "needle"), BAD, ids=[b[0] for b in BAD])
def test_a_bad_pool_is_refused_with_line_and_field(
    tmp_path: Path, name: str, entry: str, line: int, needle: str
) -> None:
    text = (
        textwrap.dedent(
            """\
        hosts:
          box1: {address: 10.0.0.1, gpus: 8}
          box2: {address: 10.0.0.2, gpus: 8}
        groups:
          boxes: [box1, box2]
        backends:
          solo:
            kind: sglang
            host: box1
            url: http://10.0.0.1:30000
          p:
            kind: sglang
        """
        )
        + f"    {entry}\n"
    )
    path = tmp_path / "inv.yaml"
    path.write_text(text)
    run = kdctl("inventory", "check", "-i", str(path))
    assert run.code == 2 and "Traceback" not in run.err, run.err
    assert f"{path}:{line}: " in run.err and needle in run.err, run.err


def test_a_router_serves_a_backend_a_pool_or_a_replica(tmp_path: Path) -> None:
    path = tmp_path / "inv.yaml"
    path.write_text(
        POOLS.replace("    api_key_env: POOL_TEST_KEY\n", "")
        + "router: {kind: nginx, host: box1, listen: '127.0.0.1:8000', serving: sglang}\n"
    )
    for serving in ("sglang", "sglang@box2", "solo"):
        text = path.read_text().replace("serving: sglang}", f"serving: {serving}}}")
        (tmp_path / "one.yaml").write_text(text)
        run = kdctl("inventory", "check", "-i", str(tmp_path / "one.yaml"))
        assert run.code == 0, (serving, run.err)
    text = path.read_text().replace("serving: sglang}", "serving: sglang@box9}")
    (tmp_path / "bad.yaml").write_text(text)
    run = kdctl("inventory", "check", "-i", str(tmp_path / "bad.yaml"))
    assert (
        run.code == 2 and f"{tmp_path / 'bad.yaml'}:22: router.serving: unknown backend" in run.err
    )
    run = kdctl("gate", "run", "health", "-b", "sglang@box9", "-i", str(path))
    assert run.code == 2 and "unknown backend 'sglang@box9'" in run.err, run.err


# --- three boxes, two engines -----------------------------------------------------------------

PORT = 31000


@dataclass
class Fleet:
    boxes: list[Box]
    inventory: Path


@pytest.fixture(scope="module")
def fleet3(models: dict[str, Path]) -> Iterator[Fleet]:
    """Three boxes, each with a machine id of its own; the reference server on the first two,
    on the box's address, nothing on the third's (its engine is stopped). kdctl's HTTP to them
    goes through each box's SSH connection (the box's sshd dials its own address)."""
    if os.geteuid() != 0:
        pytest.skip("a network namespace needs root")
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    root = Path(tempfile.mkdtemp(prefix="kdctl-pool-"))
    root.chmod(0o755)
    boxes: list[Box] = []
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i in range(3):
            machine_id = root / f"machine-id-{i}"
            machine_id.write_text(f"{i:032x}\n")
            machine_id.chmod(0o644)
            boxes.append(
                make_box(
                    root / f"b{i}", f"pl{i}{worker}"[:9], mounts={"/etc/machine-id": machine_id}
                )
            )
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        for box in boxes[:2]:
            argv = [*serve_argv(models["dsv3"], PORT, served_name="tiny"), "--host", "0.0.0.0"]
            procs.append(
                box.popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )
        for box in boxes[:2]:
            box.wait_ready(PORT)
        data: dict[str, Any] = {
            "hosts": {f"box{i}": b.host_entry(http="ssh") for i, b in enumerate(boxes, 1)},
            "groups": {"boxes": ["box1", "box2", "box3"]},
            "backends": {
                "sglang": {
                    "kind": "sglang",
                    "model": str(models["dsv3"]),
                    "replicas": {"group": "boxes", "port": PORT},
                }
            },
            "state_dir": str(root / "state"),
        }
        yield Fleet(boxes, write_inventory(root / "inv.yaml", data))
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)
        for box in boxes:
            box.close()
        shutil.rmtree(root, ignore_errors=True)


def test_status_and_gates_work_per_replica_and_roll_up_per_pool(fleet3: Fleet) -> None:
    """status asks every replica through its own box's SSH connection and rolls the pool up;
    a gate run on the pool runs on each replica, and each result is bound to the box it ran
    on (its own machine id)."""
    inv = str(fleet3.inventory)
    run = kdctl("status", "--json", "-i", inv)
    assert run.out, run.err
    doc = json.loads(run.out)
    (pool,) = doc["pools"]
    assert pool["replicas"] == ["sglang@box1", "sglang@box2", "sglang@box3"], pool
    assert pool["up"] == ["sglang@box1", "sglang@box2"] and pool["summary"] == "2/3 replicas up"
    states = {b["name"]: (b["state"], b["identity"], b["host"]) for b in doc["backends"]}
    assert states == {
        "sglang@box1": ("up", "live", "box1"),
        "sglang@box2": ("up", "live", "box2"),
        "sglang@box3": ("down", "declared", "box3"),
    }, doc["backends"]
    text = kdctl("status", "-i", inv).out
    assert "Pool sglang: 2/3 replicas up; sglang@box3 down" in " ".join(text.split()), text

    gate = kdctl("gate", "run", "health", "-b", "sglang", "--json", "-i", inv)
    assert gate.code == 1, gate.out + gate.err  # one replica is down
    results = {r["backend"]: r for r in json.loads(gate.out)["results"]}
    assert {b: r["verdict"] for b, r in results.items()} == {
        "sglang@box1": "pass",
        "sglang@box2": "pass",
        "sglang@box3": "fail",
    }
    hosts = {b: (r["provenance"]["host"], r["provenance"]["host_id"]) for b, r in results.items()}
    assert [h for h, _ in hosts.values()] == ["box1", "box2", "box3"]
    assert len({i for _, i in hosts.values()}) == 3 and None not in {i for _, i in hosts.values()}


def test_a_canary_between_pools_behind_nginx_weighs_each_pool(
    models: dict[str, Path], need_nginx: str, tmp_path: Path, report: Any
) -> None:
    """Two pools on GPUs of their own, kdctl's nginx in front: a canary moves the pools'
    weights, each pool's weight split over its replicas (one server each in the upstream),
    under a load through the front with every request answered; then rolled back. Where the
    pools need the same GPUs, a canary is refused: only rolling can move them."""
    from kdctl.traffic import SqliteJournal
    from tests.conftest import serve_reference
    from tests.support.nginx import kdctl_front, router_entry
    from tests.support.sshd import free_port
    from tests.support.traffic import Load, weights

    names = ("old-a", "old-b", "new-a", "new-b")
    servers = {n: serve_reference(models["dsv3"]) for n in names}
    try:
        root = tmp_path / "nginx"
        root.mkdir()

        def pool(side: str, gpu: int) -> dict[str, Any]:
            return {
                "kind": "sglang",
                "model": str(models["dsv3"]),
                "gpus": [gpu],
                "replicas": [
                    {"host": f"host-{box}", "url": servers[f"{side}-{box}"].url}
                    for box in ("a", "b")
                ],
            }

        data: dict[str, Any] = {
            "hosts": {
                "host-a": {"transport": "local", "gpus": 2},
                "host-b": {"transport": "local", "gpus": 2},
                "local": {"transport": "local"},
            },
            "backends": {"old": pool("old", 0), "new": pool("new", 1)},
            "router": router_entry(need_nginx, root, free_port(), serving="old"),
            "state_dir": str(tmp_path / "state"),
        }
        inv = str(write_inventory(tmp_path / "inv.yaml", data))
        canary = ["cutover", "--to", "new", "--strategy", "canary", "--steps", "10,50,100"]
        with kdctl_front(Path(inv), {"old@host-a": 50, "old@host-b": 50}) as front:
            plan = json.loads(kdctl(*canary, "--dry-run", "--json", "-i", inv).out)
            assert [s["weights"] for s in plan["steps"] if s["kind"] == "set-weights"] == [
                {"old": 90, "new": 10},
                {"old": 50, "new": 50},
                {"old": 0, "new": 100},
            ]
            with Load(front) as load:
                run = kdctl(*canary, "--watch", "1", "--force", "--yes", "-i", inv)
            assert run.code == 0, run.out + run.err
            assert load.sent > 0 and load.failures == [], load.failures[:5]
            include = root / "kdctl.conf"
            assert weights(include) == {"new@host-a": 50, "new@host-b": 50}
            with SqliteJournal(tmp_path / "state") as journal:
                record = journal.latest()
            assert record is not None
            read_back = [
                s.note for s in record.steps if s.kind == "set-weights" and s.phase == "done"
            ]
            first = "{'new@host-a': 5, 'new@host-b': 5, 'old@host-a': 45, 'old@host-b': 45}"
            assert read_back[0] == f"read back {first}", read_back
            promoted = json.loads(
                kdctl("evidence", "list", "--gate", "promotion", "--json", "-i", inv).out
            )["results"]
            assert sorted((r["backend"], r["verdict"]) for r in promoted) == [
                ("new@host-a", "pass"),
                ("new@host-b", "pass"),
            ]
            with Load(front) as back_load:
                back = kdctl("rollback", "--yes", "-i", inv)
            assert back.code == 0, back.out + back.err
            assert back_load.failures == [], back_load.failures[:5]
            assert weights(include) == {"old@host-a": 50, "old@host-b": 50}

        data["backends"]["new"]["gpus"] = [0]
        shared = str(write_inventory(tmp_path / "shared.yaml", data))
        refused = kdctl(*canary, "--dry-run", "-i", shared)
        assert refused.code == 2, refused.out + refused.err
        assert "old@host-a and new@host-a need the same GPUs on host-a" in refused.err
    finally:
        for served in servers.values():
            served.proc.terminate()
            served.proc.wait(10)
    report(
        f"canary between two pools behind nginx (10, 50, 100%): {load.sent} requests, 0 "
        "failed; at 10% each new replica 5, each old 45; rolled back, 0 failed"
    )
