"""Gates run from the CLI against live reference servers; results land in the evidence store."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from kdctl.checks.exactness import compare_prompt
from kdctl.evidence import SqliteStore
from tests.conftest import Served, kdctl, native_http, need_module, warm_argv, write_inventory

need_module("torch", "reference")
KEY = "sk-test-7f1e"


@pytest.fixture
def inventory(tmp_path: Path, reference_server: Served, twin_server: Served, keyed_server: Served):  # type: ignore[no-untyped-def]
    def make(mode: str = "strict", **exactness: Any) -> Path:
        return write_inventory(
            tmp_path / f"inv-{mode}.yaml",
            {
                "hosts": {"local": {"transport": "local"}},
                "backends": {
                    "baseline": {
                        "kind": "sglang",
                        "host": "local",
                        "url": reference_server.url,
                        "model": str(reference_server.model),
                    },
                    "candidate": native_http(twin_server.url, model=str(twin_server.model)),
                    "candidate-int4": native_http(
                        keyed_server.url, api_key_env="KDCTL_TEST_INT4_KEY"
                    ),
                    "down": {"kind": "sglang", "host": "local", "url": "http://127.0.0.1:9"},
                },
                "gates": {
                    "exactness": {"mode": mode, "max_new_tokens": 12, "top_k": 5, **exactness},
                    "throughput": {
                        "workload": {
                            "input_len": 16,
                            "output_len": 6,
                            "concurrency": [2],
                            "num_prompts": 4,
                        },
                        # The same model on both sides: only the machine's load parts them
                        # (0.19 seen with the suite running beside).
                        "min_ratio": 0.05,
                    },
                },
                "state_dir": "state",
            },
        )

    return make


ENV = {"KDCTL_TEST_INT4_KEY": KEY}


def test_exactness_passes_for_the_same_model_served_twice(inventory: Any, tmp_path: Path) -> None:
    inv = inventory()
    run = kdctl(
        "gate",
        "run",
        "exactness",
        "--backend",
        "candidate",
        "--baseline",
        "baseline",
        "-i",
        str(inv),
        "--json",
        env=ENV,
    )
    assert run.code == 0, run.out + run.err
    (result,) = json.loads(run.out)["results"]
    assert result["verdict"] == "pass"
    metrics = {m["name"]: m["value"] for m in result["metrics"]}
    assert (
        metrics["match_rate"] == 1.0 and metrics["prompts"] == 16 and metrics["exact_prompts"] == 16
    )
    assert "against live outputs of baseline" in result["reasons"][0]
    prov = result["provenance"]
    assert prov["engine_version"].startswith("kdctl-reference") and prov["config_hash"]
    assert prov["model_path"] == str(Path(tmp_path).parent / "x") or prov["model_path"].endswith(
        "tiny-deepseek-v3"
    )
    with SqliteStore(tmp_path / "state" / "evidence.sqlite") as store:
        assert store.latest("exactness", "candidate").id == result["id"]  # type: ignore[union-attr]


def test_strict_exactness_fails_for_int4_naming_the_divergence(
    inventory: Any, tmp_path: Path
) -> None:
    inv = inventory()
    recorded = kdctl("baseline", "record", "--backend", "baseline", "-i", str(inv), env=ENV)
    assert recorded.code == 0, recorded.err
    run = kdctl(
        "gate",
        "run",
        "exactness",
        "--backend",
        "candidate-int4",
        "--baseline",
        "baseline",
        "-i",
        str(inv),
        "--json",
        env=ENV,
    )
    assert run.code == 1, run.out + run.err
    (result,) = json.loads(run.out)["results"]
    assert result["verdict"] == "fail"
    assert "golden outputs recorded" in result["reasons"][0]
    diverged = [p for p in result["details"]["prompts"] if p["first_divergence"] is not None]
    assert diverged, "INT4 weights should change some greedy token"
    first = diverged[0]
    assert first["candidate_token"] != first["baseline_token"]
    assert isinstance(first["candidate_logprob"], float) and isinstance(
        first["baseline_logprob"], float
    )
    assert any(
        f"first divergence at token {first['first_divergence']}" in r for r in result["reasons"]
    )
    table = kdctl(
        "gate",
        "run",
        "exactness",
        "--backend",
        "candidate-int4",
        "--baseline",
        "baseline",
        "-i",
        str(inv),
        env=ENV,
    )
    assert table.code == 1 and "fail" in table.out

    # logprob-close on the same pair: a prompt passes only when its first divergence is a
    # near-tie, each side's token in the other's top-k.
    close = kdctl(
        "gate",
        "run",
        "exactness",
        "--backend",
        "candidate-int4",
        "--baseline",
        "baseline",
        "-i",
        str(inventory("logprob-close")),
        "--json",
        env=ENV,
    )
    (lc,) = json.loads(close.out)["results"]
    for p in lc["details"]["prompts"]:
        if p["first_divergence"] is not None:
            assert p["ok"] == (
                p["candidate_in_baseline_top_k"] and p["baseline_in_candidate_top_k"]
            )


def test_logprob_close_rule_on_a_near_tie() -> None:
    base = {
        "id": "p",
        "output_ids": [5, 7, 9],
        "logprobs": [-0.1, -0.69, -0.2],
        "top": [[[5, -0.1], [6, -2.5]], [[7, -0.69], [8, -0.70]], [[9, -0.2], [1, -3.0]]],
    }
    tie = {
        "id": "p",
        "output_ids": [5, 8, 3],
        "logprobs": [-0.1, -0.68, -0.5],
        "top": [[[5, -0.1], [6, -2.6]], [[8, -0.68], [7, -0.71]], [[3, -0.5], [9, -1.0]]],
    }
    far = {
        "id": "p",
        "output_ids": [5, 4, 3],
        "logprobs": [-0.1, -0.3, -0.5],
        "top": [[[5, -0.1], [6, -2.6]], [[4, -0.3], [2, -3.1]], [[3, -0.5], [9, -1.0]]],
    }
    strict = compare_prompt(tie, base, "strict")
    assert not strict["ok"] and strict["first_divergence"] == 1 and strict["matched_tokens"] == 1
    close = compare_prompt(tie, base, "logprob-close")
    assert close["ok"] and close["candidate_token"] == 8 and close["baseline_token"] == 7
    assert close["max_top_logprob_diff"] == pytest.approx(0.1)  # token 6 at position 0
    # After the first divergence nothing is compared: position 2 differs wildly and still passes.
    assert compare_prompt(far, base, "logprob-close")["ok"] is False  # 4 is not in base's top-k
    same = compare_prompt(base, base, "strict")
    assert same["ok"] and same["first_divergence"] is None and same["matched_tokens"] == 3


def test_two_empty_outputs_are_no_match() -> None:
    """Nothing generated on either side compares nothing: the prompt does not count as matching
    (nor as exact), in either mode."""
    empty = {"id": "p", "output_ids": [], "logprobs": [], "top": []}
    for mode in ("strict", "logprob-close"):
        got = compare_prompt(empty, empty, mode)
        assert got["ok"] is False and got["matched_tokens"] == 0 and got["tokens"] == 0


def test_health_of_an_engine_that_does_not_name_its_model_is_inconclusive(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """The reference engine in command mode, its answer's `engine.model` withheld (the contract
    allows it): it is up and generates, but the inventory's model was never confirmed."""
    engine = tmp_path / "unnamed-engine.py"
    engine.write_text(
        "import json, subprocess, sys\n"
        f"cmd = [*{warm_argv([sys.executable, '-m', 'kdctl', 'reference', 'batch'])!r}, "
        f"'--model', {str(models['dsv3'])!r}, *sys.argv[1:]]\n"
        "code = subprocess.call(cmd)\n"
        "response = sys.argv[sys.argv.index('--response') + 1]\n"
        "with open(response) as f:\n"
        "    doc = json.load(f)\n"
        "doc['engine']['model'] = None\n"
        "with open(response, 'w') as f:\n"
        "    json.dump(doc, f)\n"
        "sys.exit(code)\n"
    )
    inv = write_inventory(
        tmp_path / "unnamed.yaml",
        {
            "hosts": {"local": {"transport": "local"}},
            "backends": {
                "native": {
                    "kind": "native",
                    "mode": "command",
                    "host": "local",
                    "command": [sys.executable, str(engine)],
                    "workdir": str(tmp_path),
                    "model": str(models["dsv3"]),
                }
            },
            "state_dir": "state",
        },
    )
    run = kdctl("gate", "run", "health", "-b", "native", "-i", str(inv), "--json")
    assert run.code == 1, run.out + run.err
    (r,) = json.loads(run.out)["results"]
    assert r["verdict"] == "inconclusive", r["reasons"]
    assert (
        f"the engine does not say which model it serves; the inventory says {models['dsv3']}"
        in (r["reasons"])
    )
    metrics = {m["name"]: (m["value"], m["threshold"]) for m in r["metrics"]}
    assert metrics["one_token_completion_tokens"] == (1, 1)
    assert metrics["model_matches"] == (None, 1)


def test_health_gate_and_exit_codes(inventory: Any) -> None:
    inv = inventory()
    ok = kdctl("gate", "run", "health", "--backend", "candidate", "-i", str(inv), "--json", env=ENV)
    assert ok.code == 0, ok.err
    (r,) = json.loads(ok.out)["results"]
    assert r["verdict"] == "pass" and r["provenance"]["model_path"].endswith("tiny-deepseek-v3")
    down = kdctl("gate", "run", "health", "--backend", "down", "-i", str(inv), "--json", env=ENV)
    assert down.code == 1 and json.loads(down.out)["results"][0]["verdict"] == "fail"
    wrong = kdctl(
        "gate",
        "run",
        "health",
        "--backend",
        "candidate-int4",
        "-i",
        str(inv),
        "--json",
        env={"KDCTL_TEST_INT4_KEY": "sk-wrong"},
    )
    assert wrong.code == 3 and "authentication failed" in wrong.out and "sk-wrong" not in wrong.out
    allrun = kdctl(
        "gate", "run", "all", "--backend", "candidate", "-i", str(inv), "--json", env=ENV
    )
    verdicts = {x["gate"]: x["verdict"] for x in json.loads(allrun.out)["results"]}
    # Without --baseline the comparing gates are skipped; a person's sign-off is never run.
    assert verdicts["exactness"] == verdicts["api-conformance"] == "skipped"
    assert verdicts["health"] == "pass" and verdicts["command"] == "skipped"
    assert verdicts["throughput"] == "inconclusive" and "tp-health" in verdicts
    assert "sign-off" not in verdicts
    assert kdctl("gate", "run", "nope", "--backend", "candidate", "-i", str(inv), env=ENV).code == 2
    ghost = kdctl("gate", "run", "health", "--backend", "ghost", "-i", str(inv), env=ENV)
    assert ghost.code == 2 and "unknown backend 'ghost'" in ghost.err
    listed = kdctl("gate", "list", "--json")
    assert {g["name"] for g in json.loads(listed.out)["gates"]} >= {"health", "exactness"}


def test_freshness_windows_per_gate(tmp_path: Path) -> None:
    from datetime import timedelta

    from kdctl.checks import freshness_window
    from kdctl.inventory import load_inventory

    inv_path = write_inventory(
        tmp_path / "inv.yaml",
        {"hosts": {"local": {"transport": "local"}}, "gates": {"freshness": {"throughput": "3d"}}},
    )
    inv = load_inventory(inv_path)
    assert freshness_window(inv, "throughput") == timedelta(days=3)
    assert freshness_window(inv, "health") == timedelta(minutes=15)
    assert freshness_window(inv, "tp-health") == timedelta(hours=24)
    bad = write_inventory(
        tmp_path / "bad.yaml",
        {"hosts": {"local": {"transport": "local"}}, "gates": {"freshness": {"health": "soon"}}},
    )
    run = kdctl("inventory", "check", "-i", str(bad))
    assert run.code == 2 and "gates.freshness.health: 'soon' is not a duration" in run.err
