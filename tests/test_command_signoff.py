"""The command gate (a program on the backend's host prints JSON metrics) and sign-off, through
the real CLI, over the local transport and over a real sshd."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kdctl.checks.command import read_metrics
from tests.conftest import Served, kdctl, write_inventory
from tests.support.sshd import SshdFleet

BENCH = (
    "echo 'warming up the kernels'; "
    'echo \'{"metrics": {"gemm_w4a16_tflops": 512.5, "failed_tests": 0}}\''
)


def inventory(tmp_path: Path, host: dict[str, Any], commands: dict[str, Any]) -> Path:
    return write_inventory(
        tmp_path / "inventory.yaml",
        {
            "hosts": {"box": host},
            "backends": {
                "native": {"kind": "native", "host": "box", "url": "http://127.0.0.1:9"},
                "other": {"kind": "sglang", "host": "box", "url": "http://127.0.0.1:8"},
            },
            "gates": {"commands": commands},
            "state_dir": "state",
        },
    )


def command_gate(inv: Path, backend: str = "native") -> tuple[int, dict[str, Any]]:
    run = kdctl("gate", "run", "command", "-b", backend, "-i", str(inv), "--json")
    assert run.out, run.err
    (result,) = json.loads(run.out)["results"]
    return run.code, result


def test_thresholds_on_a_programs_json(tmp_path: Path) -> None:
    inv = inventory(
        tmp_path,
        {"transport": "local"},
        {
            "kernels": {
                "command": ["sh", "-c", BENCH],
                "workdir": str(tmp_path),
                "thresholds": {"gemm_w4a16_tflops": ">= 500", "failed_tests": "== 0"},
                "backends": ["native"],
            }
        },
    )
    code, result = command_gate(inv)
    assert code == 0 and result["verdict"] == "pass", result["reasons"]
    values = {m["name"]: m["value"] for m in result["metrics"]}
    assert values == {"kernels.gemm_w4a16_tflops": 512.5, "kernels.failed_tests": 0}
    # Nothing listens on native's URL: the figures are not tied to a build, and say so.
    assert "native did not say what it serves" in result["reasons"][-1]
    assert (
        "engine_version" not in result["provenance"] or not result["provenance"]["engine_version"]
    )
    code, result = command_gate(inv, "other")
    assert (
        result["verdict"] == "skipped"
        and "no command checks apply to other" in result["reasons"][0]
    )


def test_a_result_is_bound_to_the_engine_build_that_answered(
    tmp_path: Path, reference_server: Served
) -> None:
    """A rebuilt engine makes a program's figures about the old build stale: the result
    records the version the engine reported while its checks ran."""
    inv = write_inventory(
        tmp_path / "inventory.yaml",
        {
            "hosts": {"box": {"transport": "local"}},
            "backends": {"engine": {"kind": "sglang", "host": "box", "url": reference_server.url}},
            "gates": {
                "commands": {
                    "kernels": {
                        "command": ["sh", "-c", BENCH],
                        "thresholds": {"failed_tests": "== 0"},
                    }
                }
            },
            "state_dir": "state",
        },
    )
    code, result = command_gate(inv, "engine")
    assert code == 0, result["reasons"]
    assert result["provenance"]["engine_version"].startswith("kdctl-reference")
    assert not any("did not say what it serves" in r for r in result["reasons"])


def test_a_missed_threshold_a_missing_metric_and_a_failing_exit(tmp_path: Path) -> None:
    inv = inventory(
        tmp_path,
        {"transport": "local"},
        {
            "slow": {"command": ["sh", "-c", BENCH], "thresholds": {"gemm_w4a16_tflops": "> 900"}},
            "absent": {"command": ["sh", "-c", BENCH], "thresholds": {"latency_us": "< 5"}},
            "crash": {
                "command": ["sh", "-c", "echo 'CUDA error: misaligned address' >&2; exit 3"],
                "thresholds": {"failed_tests": "== 0"},
            },
        },
    )
    code, result = command_gate(inv)
    assert code == 1 and result["verdict"] == "fail"
    reasons = " | ".join(result["reasons"])
    assert "slow: gemm_w4a16_tflops = 512.5 is not > 900" in reasons
    assert "absent: metric 'latency_us' is missing" in reasons
    assert "crash: exited 3: CUDA error: misaligned address" in reasons


def test_over_ssh_arguments_stay_words(fleet: SshdFleet, tmp_path: Path) -> None:
    inv = inventory(
        tmp_path,
        fleet.host_entry("plain"),
        {
            "quoted": {
                # One argument: were `;` to reach the remote shell unquoted, the second echo
                # would print a passing JSON line.
                "command": ["echo", "x; echo '{\"n\": 1}'"],
                "thresholds": {"n": "== 1"},
            }
        },
    )
    code, result = command_gate(inv)
    assert code == 1 and any("no JSON object" in r for r in result["reasons"])
    assert result["details"]["quoted"]["stdout_tail"] == "x; echo '{\"n\": 1}'\n"


def test_bad_thresholds_and_unknown_backends_are_refused(tmp_path: Path) -> None:
    bad = inventory(
        tmp_path,
        {"transport": "local"},
        {"k": {"command": "true", "thresholds": {"x": "at least 5"}}},
    )
    run = kdctl("inventory", "check", "-i", str(bad))
    assert run.code == 2 and "gates.commands.k.thresholds.x" in run.err
    assert "'at least 5' is not a threshold" in run.err
    unknown = inventory(
        tmp_path,
        {"transport": "local"},
        {"k": {"command": "true", "thresholds": {"x": ">= 5"}, "backends": ["nativ"]}},
    )
    run = kdctl("inventory", "check", "-i", str(unknown))
    assert run.code == 2 and "gates.commands.k.backends[0]" in run.err
    assert "unknown backend 'nativ'" in run.err and "did you mean 'native'" in run.err


def test_sign_off_is_recorded_and_not_run(tmp_path: Path) -> None:
    inv = inventory(tmp_path, {"transport": "local"}, {})
    run = kdctl(
        "signoff",
        "-b",
        "native",
        "--by",
        "Ada Lovelace",
        "--note",
        "soak of 24 h within SLOs",
        "-i",
        str(inv),
        "--json",
    )
    assert run.code == 0, run.err
    doc = json.loads(run.out)
    assert (doc["gate"], doc["verdict"]) == ("sign-off", "pass")
    assert doc["details"] == {"by": "Ada Lovelace", "note": "soak of 24 h within SLOs"}
    shown = kdctl("evidence", "list", "-i", str(inv), "--json")
    assert any(r["gate"] == "sign-off" for r in json.loads(shown.out)["results"])
    refused = kdctl("signoff", "-b", "native", "--by", " ", "--note", "x", "-i", str(inv))
    assert refused.code == 2 and "--by" in refused.err
    run_it = kdctl("gate", "run", "sign-off", "-b", "native", "-i", str(inv))
    assert run_it.code == 2 and "given by a person" in run_it.err
    run_it = kdctl("gate", "run", "promotion", "-b", "native", "-i", str(inv))
    assert run_it.code == 2 and "recorded by the cutover that makes it" in run_it.err


def test_read_metrics_takes_the_last_json_object() -> None:
    assert read_metrics('log\n{"a": 1}\nnoise\n{"metrics": {"b": 2}}\n') == {"b": 2}
    with pytest.raises(ValueError):
        read_metrics("[1, 2]\n")
