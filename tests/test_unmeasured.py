"""Unmeasured is never a pass: the one rule every gate's verdict follows, and the command and
promotion gates held to it through the real CLI and the function the cutover records with."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kdctl.checks.promotion import promotion_result
from kdctl.inventory import load_inventory
from kdctl.records import Metric, decide, utcnow
from tests.conftest import kdctl, write_inventory


def test_only_a_finite_number_against_its_threshold_passes() -> None:
    def at_least_500(value: Any) -> Metric:
        return Metric(name="tflops", value=value, threshold=500, comparison=">=")

    assert at_least_500(512.5).passed is True and at_least_500(499).passed is False
    for value in (None, float("inf"), float("nan"), "fast"):
        m = at_least_500(value)
        assert m.passed is None and m.unmeasured, value
    # A value with no threshold is information, not an unmeasured threshold.
    assert not Metric(name="gpus", value=None).unmeasured

    held, broken, missing = at_least_500(600), at_least_500(100), at_least_500(None)
    assert decide([held]) == "pass"
    assert decide([held, broken]) == "fail"
    assert decide([held], ["GPU 1 expected but not visible"]) == "fail"
    assert decide([held, missing]) == "inconclusive"
    assert decide([missing]) == "inconclusive"
    # Nothing judged at all is not a pass either.
    assert decide([]) == decide([Metric(name="gpus", value=8)]) == "inconclusive"


def inventory(tmp_path: Path, commands: dict[str, Any]) -> Path:
    return write_inventory(
        tmp_path / "inventory.yaml",
        {
            "hosts": {"box": {"transport": "local"}},
            "backends": {"native": {"kind": "native", "host": "box", "url": "http://127.0.0.1:9"}},
            "gates": {"commands": commands},
            "state_dir": "state",
        },
    )


def command_gate(inv: Path) -> tuple[int, dict[str, Any]]:
    run = kdctl("gate", "run", "command", "-b", "native", "-i", str(inv), "--json")
    assert run.out, run.err
    (result,) = json.loads(run.out)["results"]
    return run.code, result


def test_a_benchmark_that_printed_infinity_measured_nothing(tmp_path: Path) -> None:
    """A kernel timed at zero seconds prints Infinity TFLOP/s (Python's json reads it): it
    would clear any lower bound, and JSON evidence cannot even hold it."""
    bench = 'echo \'{"metrics": {"gemm_w4a16_tflops": Infinity, "failed_tests": 0}}\''
    inv = inventory(
        tmp_path,
        {
            "kernels": {
                "command": ["sh", "-c", bench],
                "thresholds": {"gemm_w4a16_tflops": ">= 500", "failed_tests": "== 0"},
            }
        },
    )
    code, result = command_gate(inv)
    assert code == 1 and result["verdict"] == "inconclusive", result["reasons"]
    assert result["details"]["kernels"]["verdict"] == "inconclusive"
    assert result["reasons"] == [
        "kernels: metric 'gemm_w4a16_tflops' is Infinity, not a finite number: '>= 500' not judged",
        "native did not say what it serves: this result is tied to its host and checkpoint, "
        "not to an engine build",
    ]
    values = {m["name"]: m["value"] for m in result["metrics"]}
    assert values == {"kernels.gemm_w4a16_tflops": None, "kernels.failed_tests": 0}


def test_a_program_that_printed_no_metrics_is_inconclusive_and_a_crash_fails(
    tmp_path: Path,
) -> None:
    """Exit 0 and no JSON: the thresholds were never judged, which is not a pass, nor a finding
    about the engine. A program that exits non-zero has said it failed."""
    inv = inventory(
        tmp_path,
        {
            "silent": {
                "command": ["sh", "-c", "echo done"],
                "thresholds": {"failed_tests": "== 0"},
            },
        },
    )
    code, result = command_gate(inv)
    assert code == 1 and result["verdict"] == "inconclusive", result["reasons"]
    assert result["reasons"] == [
        "silent: no JSON object on stdout",
        "silent: metric 'failed_tests' is missing: '== 0' not judged",
        "native did not say what it serves: this result is tied to its host and checkpoint, "
        "not to an engine build",
    ]
    crashed = inventory(
        tmp_path,
        {"crash": {"command": ["sh", "-c", "exit 3"], "thresholds": {"failed_tests": "== 0"}}},
    )
    code, result = command_gate(crashed)
    assert code == 1 and result["verdict"] == "fail"
    assert result["details"]["crash"]["verdict"] == "fail"


def test_a_cutover_that_sent_no_probe_claims_no_probe_held(tmp_path: Path) -> None:
    """Blue-green moves all traffic at once, with no watch: no probe was sent, so none failing
    is no finding; a canary's watches are."""
    inv = load_inventory(
        write_inventory(
            tmp_path / "inventory.yaml",
            {
                "hosts": {"local": {"transport": "local"}},
                "backends": {
                    "baseline": {"kind": "sglang", "host": "local", "url": "http://127.0.0.1:8"},
                    "candidate": {"kind": "sglang", "host": "local", "url": "http://127.0.0.1:9"},
                },
            },
        )
    )

    def promoted(watches: list[dict[str, Any]]) -> dict[str, Metric]:
        result = promotion_result(
            inv,
            "candidate",
            verdict="pass",
            reason="all traffic moved to candidate",
            cutover="c0",
            from_backend="baseline",
            strategy="canary" if watches else "blue-green",
            weights={"baseline": 0, "candidate": 100},
            started_at=utcnow(),
            watches=watches,
        )
        return {m.name: m for m in result.metrics}

    blue_green = promoted([])
    assert blue_green["probe_requests"].value == 0
    assert blue_green["probe_failed"].value is None and blue_green["probe_failed"].passed is None
    assert blue_green["weight"].passed is True
    canary = promoted([{"sent": 40, "failed": 0}, {"sent": 38, "failed": 0}])
    assert canary["probe_requests"].value == 78 and canary["probe_failed"].passed is True
    # Without the candidate's own counter, how many probes it served is not known.
    assert canary["engine_requests"].value is None

    # Every probe answered by the baseline: the record says the candidate served none.
    none_served = "candidate served no request in the window (its own counter)"
    result = promotion_result(
        inv,
        "candidate",
        verdict="pass",
        reason="all traffic moved to candidate",
        cutover="c1",
        from_backend="baseline",
        strategy="canary",
        weights={"baseline": 0, "candidate": 100},
        started_at=utcnow(),
        watches=[{"sent": 8, "failed": 0, "engine_requests": 0, "engine_note": none_served}],
    )
    metrics = {m.name: m.value for m in result.metrics}
    assert metrics["engine_requests"] == 0 and none_served in result.reasons
    # Its none failed are the baseline's: shown, held to no threshold.
    failed = next(m for m in result.metrics if m.name == "probe_failed")
    assert (failed.value, failed.threshold, failed.passed) == (0, None, None), failed
