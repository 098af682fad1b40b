"""The shipped Kimi K2.6 roadmap: it loads against examples/ct200-8gpu.yaml, its phases come in
an order that can pass, and its prompt files are what it says; beside it, the two gate changes
it needs: tp-health with the engine's memory rule off, and the KV capacity SGLang's /server_info
reports, kept by api-conformance. The walk through it with this machine's engines is
tests/test_phases.py's test_ct200_roadmap_with_imported_evidence."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import (
    FIXTURES,
    REPLAY_BIN,
    REPO,
    Served,
    kdctl,
    ssh_home,
    write_inventory,
)

EXAMPLE = REPO / "examples" / "ct200-8gpu.yaml"
ROADMAP = REPO / "roadmap" / "kimi-k26-native.yaml"
PROMPTS = REPO / "roadmap" / "prompts"
KEYS = {"SGLANG_API_KEY": "sk-sglang-test", "NATIVE_API_KEY": "sk-native-test"}


def _env(tmp_path: Path) -> dict[str, str]:
    return {**KEYS, **ssh_home(tmp_path)}


# --- the roadmap as shipped ---------------------------------------------------------------------


def _loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, roadmap: Path = ROADMAP) -> Any:
    from kdctl.inventory import load_inventory
    from kdctl.roadmap import load_roadmap

    for name, value in _env(tmp_path).items():
        monkeypatch.setenv(name, value)
    inv = load_inventory(EXAMPLE)
    return inv, load_roadmap(roadmap, inv)


def _needs_serving(c: Any, inv: Any) -> bool:
    """Whether a criterion can be met only with its engine served over HTTP on the box: a
    served gate on an HTTP engine, or tp-health holding the engine's memory on its GPUs."""
    spec = inv.backends[c.backend]
    served = spec.kind != "native" or spec.mode != "command"
    if c.gate == "tp-health":
        merged = inv.spec.gates.tp_health.model_dump() | c.spec.settings
        return merged["engine_memory"] is not False
    if c.gate == "throughput":
        return served and c.spec.settings.get("mode") != "offline-batch"
    return served and c.gate in ("health", "api-conformance", "exactness", "promotion")


def order_problems(inv: Any, roadmap: Any) -> list[str]:
    """Why the roadmap's order cannot pass: a phase listed before one it depends on, or a
    criterion that needs the candidate served in a phase that does not come after the one
    whose health criterion first shows it served."""
    problems = []
    seen: set[str] = set()
    for phase in roadmap.phases:
        problems += [
            f"{phase.id} depends on {d}, listed after it" for d in phase.depends_on if d not in seen
        ]
        seen.add(phase.id)
    criteria = roadmap.criteria()
    serving = next(
        p.id
        for p in roadmap.phases
        if any(c.gate == "health" and c.backend == roadmap.spec.candidate for c in criteria[p.id])
    )
    for phase in roadmap.phases:
        before = set(roadmap.prerequisites(phase.id))
        for c in criteria[phase.id]:
            if _needs_serving(c, inv) and phase.id != serving and serving not in before:
                problems.append(
                    f"{phase.id}/{c.name} needs {c.backend} served, which {serving} first shows, "
                    f"and {phase.id} does not come after {serving}"
                )
    return problems


def test_the_k26_roadmap_loads_and_its_order_can_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, report: Any
) -> None:
    inv, roadmap = _loaded(tmp_path, monkeypatch)
    ids = [p.id for p in roadmap.phases]
    # Acyclic (the loader refuses a cycle) and listed in an order every dependency precedes.
    assert order_problems(inv, roadmap) == []
    # Every phase leads to the cutover: none is left off the critical path's graph.
    assert set(roadmap.prerequisites("cutover")) == set(ids) - {"cutover"}
    assert [p.label for p in roadmap.phases] == [f"Phase {n}" for n in range(1, len(ids) + 1)]
    assert all(p.estimate for p in roadmap.phases)
    assert all(p.owner is None and p.target is None for p in roadmap.phases)

    # The order the roadmap had before: the TP-8 phase's tp-health held the engine's memory on
    # its 8 GPUs, which only the later http-server phase puts there. The check names it.
    old = yaml.safe_load(ROADMAP.read_text())
    tp8 = next(p for p in old["phases"] if p["id"] == "tp8")
    tp8["criteria"][0]["settings"].pop("engine_memory")
    planted = tmp_path / "planted.yaml"
    planted.write_text(yaml.safe_dump(old, sort_keys=False))
    _, before = _loaded(tmp_path, monkeypatch, planted)
    assert order_problems(inv, before) == [
        "tp8/box-tp8-health needs native served, which http-server first shows, and tp8 does "
        "not come after http-server"
    ]

    # The CLI's check of the shipped example (a schema failure exits 2). `kdctl phases` on it
    # runs in tests/test_phases.py's walk, judging the evidence made there.
    check = kdctl("inventory", "check", "-i", str(EXAMPLE), env=_env(tmp_path))
    assert check.code == 0, check.out + check.err
    assert "roadmap: roadmap/kimi-k26-native.yaml" in check.out
    report(f"K2.6 roadmap: {len(ids)} phases, listed in an order that can pass")


def test_the_k26_prompt_files() -> None:
    from kdctl.checks.exactness import load_corpus

    rows = [json.loads(line) for line in (PROMPTS / "k26.jsonl").read_text().splitlines()]
    assert len(load_corpus(PROMPTS / "k26.jsonl")) == len(rows) >= 100
    by = {c: sum(r["category"] == c for r in rows) for c in {r["category"] for r in rows}}
    assert set(by) == {"chat", "code", "math", "long", "tool"} and min(by.values()) >= 15, by
    assert all(r["id"].startswith(f"k26-{r['category']}-") for r in rows)
    assert len({r["prompt"] for r in rows}) == len(rows)
    # A tool call gives the tools as JSON and asks for one JSON object back.
    for r in rows:
        if r["category"] == "tool":
            tools = r["prompt"].split("Tools:\n")[1].split("\n\nUser: ")[0].splitlines()
            assert all(json.loads(t)["name"] for t in tools), r["id"]

    long = load_corpus(PROMPTS / "k26-long.jsonl")
    sizes = [len(p["prompt"]) for p in long]
    assert len(long) == 4 and sizes == sorted(sizes) and 30_000 <= sizes[0] < sizes[-1] < 450_000
    assert all("Question:" in p["prompt"][-400:] for p in long)


# --- tp-health with the engine's memory rule off --------------------------------------------------


def test_tp_health_without_the_engines_memory(tmp_path: Path) -> None:
    """The busy H200 replayed with the idle capture's process list: no engine holds memory.
    With the rule on (the default) the box fails for it; with `engine_memory: false` the same
    box passes on its GPU rules, Xids and all-reduce, and says what it did not judge."""
    capture = tmp_path / "no-engine"
    shutil.copytree(FIXTURES / "nvidia-smi" / "h200-busy", capture)
    idle = FIXTURES / "nvidia-smi" / "h200-idle" / "query-apps-nounits.csv"
    shutil.copy(idle, capture / "query-apps-nounits.csv")
    env = {"PATH": f"{REPLAY_BIN}:{os.environ['PATH']}", "KDCTL_NVSMI_FIXTURES": str(capture)}

    def run(**settings: Any) -> tuple[int, dict[str, Any]]:
        inv = write_inventory(
            tmp_path / "inv.yaml",
            {
                "hosts": {"box": {"transport": "local", "gpus": 1}},
                "backends": {
                    "engine": {
                        "kind": "sglang",
                        "host": "box",
                        "url": "http://127.0.0.1:9",
                        "gpus": [0],
                    }
                },
                "gates": {
                    "tp_health": {"python": str(REPLAY_BIN / "allreduce-replay"), **settings}
                },
                "state_dir": "state",
            },
        )
        got = kdctl("gate", "run", "tp-health", "-b", "engine", "-i", str(inv), "--json", env=env)
        (result,) = json.loads(got.out)["results"]
        return got.code, result

    code, result = run()
    assert code == 1 and result["reasons"][0] == (
        "GPU 0: no process holds memory (is the engine running on this rank?)"
    )
    # Judged is no value at all, as results recorded before the setting have it.
    assert result["settings"]["engine_memory"] is None
    code, result = run(engine_memory=False)
    assert code == 0 and result["verdict"] == "pass", result["reasons"]
    assert result["settings"]["engine_memory"] is False
    assert result["reasons"][0] == (
        "engine memory not judged (gates.tp_health.engine_memory: false): the box is checked "
        "for engine before it runs on these GPUs"
    )
    assert not any("holds memory" in r for r in result["reasons"])


# --- the KV capacity of /server_info -----------------------------------------------------------

CAPTURED = FIXTURES / "sglang" / "captured"


def _captured(version: str, route: str) -> bytes:
    """What the captured release answered on /get_ROUTE (or /ROUTE, as newer ones name it)."""
    doc = json.loads((CAPTURED / f"{version}.json").read_text())
    ex = next(e for e in doc["exchanges"] if e["path"] in (f"/get_{route}", f"/{route}"))
    return (ex["body_text"] if "body_text" in ex else json.dumps(ex["body"])).encode()


def _replaying(version: str) -> Any:
    """A server answering the info routes, under both names, as the captured release did, and
    404 elsewhere."""
    from tests.support.faulty import replay, serve

    answers = {
        ("GET", path): (200, _captured(version, route), "application/json")
        for route in ("server_info", "model_info")
        for path in (f"/{route}", f"/get_{route}")
    }
    return serve(replay(answers))


@pytest.fixture
def sglang_infos() -> Iterator[dict[str, str]]:
    servers = {v: _replaying(v) for v in ("0.5.9", "0.4.0.post2")}
    yield {v: f"http://127.0.0.1:{s.server_address[1]}" for v, s in servers.items()}
    for s in servers.values():
        s.shutdown()


def test_kv_capacity_read_as_sglang_reports_it(
    tmp_path: Path, sglang_infos: dict[str, str], reference_server: Served
) -> None:
    """Every captured release's /server_info carries `max_total_num_tokens`; kdctl reads it
    there, and reads nothing from kdctl's reference server, which does not report one."""
    from kdctl.backends import make_backend
    from kdctl.checks.api_conformance import kv_capacity
    from kdctl.inventory import BackendSpec

    def read(url: str) -> int | None:
        with make_backend("sglang", BackendSpec(kind="sglang", host="local", url=url)) as be:
            return kv_capacity(be)

    for path in sorted(CAPTURED.glob("*.json")):
        said = json.loads(_captured(path.stem, "server_info"))["max_total_num_tokens"]
        server = _replaying(path.stem)
        try:
            assert read(f"http://127.0.0.1:{server.server_address[1]}") == said > 0, path.stem
        finally:
            server.shutdown()
    assert read(reference_server.url) is None

    # Through the gate: the baseline's figure live, then as `baseline record` kept it.
    inv = write_inventory(
        tmp_path / "inv.yaml",
        {
            "hosts": {"local": {"transport": "local"}},
            "backends": {
                "baseline": {"kind": "sglang", "host": "local", "url": sglang_infos["0.5.9"]},
                "candidate": {
                    "kind": "sglang",
                    "host": "local",
                    "url": sglang_infos["0.4.0.post2"],
                },
                "reference": {"kind": "sglang", "host": "local", "url": reference_server.url},
            },
            "state_dir": "state",
        },
    )

    def gate(backend: str) -> dict[str, Any]:
        run = kdctl(
            "gate", "run", "api-conformance", "-b", backend, "--baseline", "baseline",
            "-i", str(inv), "--json",
        )  # fmt: skip
        (result,) = json.loads(run.out)["results"]
        return result

    def kv(result: dict[str, Any]) -> dict[str, Any]:
        return {m["name"]: m["value"] for m in result["metrics"] if "kv_" in m["name"]}

    live = gate("candidate")
    assert kv(live) == {
        "kv_capacity_tokens": 2193171,
        "baseline_kv_capacity_tokens": 20480,
        "kv_capacity_ratio": 107.0884,
    }
    assert "KV cache: 2193171 tokens against baseline's 20480 (107.09x)" in live["reasons"]
    assert all(m["threshold"] is None for m in live["metrics"] if "kv_" in m["name"])
    recorded = kdctl("baseline", "record", "-b", "baseline", "--only", "api", "-i", str(inv))
    assert recorded.code == 0, recorded.out + recorded.err
    silent = gate("reference")
    assert "recorded" in silent["reasons"][0], silent["reasons"]
    assert kv(silent) == {
        "kv_capacity_tokens": None,
        "baseline_kv_capacity_tokens": 20480,
        "kv_capacity_ratio": None,
    }
    assert silent["reasons"][-1] == (
        "KV cache: reference does not say its max_total_num_tokens on /server_info, so no ratio"
    )
