"""Speed before a server: a command-mode engine measured by its own timings of batch runs,
against the baseline's recorded served run of the same prompts."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kdctl.backends import GenerateRequest, make_backend
from kdctl.backends.contract import ResponseFile
from kdctl.backends.errors import BackendProtocolError
from kdctl.inventory import BackendSpec
from kdctl.transports import LocalTransport
from tests.conftest import Served, kdctl, need_module, warm_argv, write_inventory

need_module("torch", "reference")
OUTPUT_LEN = 6
PROMPTS = 6
CONCURRENCY = [1, 3]


def command_engine(argv: list[str], workdir: Path) -> dict[str, Any]:
    return {
        "kind": "native",
        "mode": "command",
        "host": "local",
        "command": warm_argv(argv),
        "workdir": str(workdir),
    }


def inventory(tmp_path: Path, baseline_url: str, engine: dict[str, Any]) -> Path:
    roadmap = tmp_path / "roadmap.yaml"
    roadmap.write_text(
        yaml.safe_dump(
            {
                "title": "speed before and after a server",
                "serving": "baseline",
                "candidate": "candidate",
                "phases": [
                    {
                        "id": "offline-speed",
                        "title": "The engine's own batch timings within reach of the baseline",
                        "criteria": [
                            {
                                "name": "offline",
                                "gate": "throughput",
                                "settings": {"mode": "offline-batch"},
                                "require": {"b*.ratio": ">= 0.05"},
                            }
                        ],
                    },
                    {
                        "id": "served-speed",
                        "title": "Served throughput within reach of the baseline",
                        "criteria": [
                            {
                                "name": "served",
                                "gate": "throughput",
                                "require": {"*.ratio": ">= 0.05"},
                            }
                        ],
                    },
                ],
            },
            sort_keys=False,
        )
    )
    return write_inventory(
        tmp_path / "inventory.yaml",
        {
            "hosts": {"local": {"transport": "local"}},
            "backends": {
                "baseline": {"kind": "sglang", "host": "local", "url": baseline_url},
                "candidate": engine,
            },
            "gates": {
                "throughput": {
                    "workload": {
                        "input_len": 16,
                        "output_len": OUTPUT_LEN,
                        "concurrency": CONCURRENCY,
                        "num_prompts": PROMPTS,
                    },
                    "min_ratio": 0.05,
                }
            },
            "roadmap": str(roadmap),
            "state_dir": "state",
        },
    )


def criteria(inv: Path) -> dict[str, dict[str, Any]]:
    run = kdctl("phases", "-i", str(inv), "--json")
    assert run.out, run.err
    return {c["name"]: c for p in json.loads(run.out)["phases"] for c in p["criteria"]}


def test_a_command_mode_engine_against_the_recorded_served_baseline(
    models: dict[str, Path], reference_server: Served, tmp_path: Path, report: Any
) -> None:
    """`kdctl reference batch` timed by itself at batch 1 and 3, against the reference server's
    recorded served run of the same prompts: a ratio per batch size, judged; the criterion
    that pins the offline comparison is met by it, the served one is not."""
    argv = [sys.executable, "-m", "kdctl", "reference", "batch", "--model", str(models["dsv3"])]
    inv = inventory(tmp_path, reference_server.url, command_engine(argv, tmp_path))
    rec = kdctl("baseline", "record", "-b", "baseline", "--only", "throughput", "-i", str(inv))
    assert rec.code == 0, rec.err

    # A command-mode engine has no server for the served comparison, and says what can be done.
    run = kdctl("gate", "run", "throughput", "-b", "candidate", "-i", str(inv), "--json")
    (served,) = json.loads(run.out)["results"]
    assert run.code == 3 and served["verdict"] == "error"
    assert "mode: offline-batch" in served["reasons"][0]

    ran = kdctl("phases", "-i", str(inv), "--run", "--phase", "offline-speed", "--json")
    assert ran.out, ran.err
    (result,) = [r for r in _results(inv) if r["settings"].get("mode") == "offline-batch"]
    assert result["verdict"] == "pass", result["reasons"]
    assert result["details"]["mode"] == "offline-batch"
    assert result["reasons"][0].startswith("offline batch: the figures are candidate's own timings")
    assert "not kdctl's measurement of a served load" in result["reasons"][0]
    assert "run recorded" in result["reasons"][1]
    metrics = {m["name"]: m for m in result["metrics"]}
    assert not any(name.startswith("c") for name in metrics)  # no served figure stands in
    ratios = []
    for size, point, base in zip(
        CONCURRENCY, result["details"]["points"], result["details"]["baseline_points"], strict=True
    ):
        assert point["max_concurrency"] == base["max_concurrency"] == size
        assert point["client"] == "engine timings" and base["client"] == "aiohttp"
        assert (
            point["completed"] == PROMPTS and point["total_output_tokens"] == PROMPTS * OUTPUT_LEN
        )
        assert 0 < point["ttft_ms"]["p50"] < point["e2el_ms"]["p50"] and point["tpot_ms"]["p50"] > 0
        assert point["itl_ms"]["p50"] is None and f"b{size}.median_itl_ms" not in metrics
        ratio = metrics[f"b{size}.ratio"]
        assert ratio["threshold"] == 0.05 and ratio["comparison"] == ">="
        assert ratio["value"] == pytest.approx(
            point["output_throughput"] / base["output_throughput"], rel=1e-3
        )
        assert metrics[f"b{size}.output_throughput"]["unit"] == "tok/s"
        assert f"b{size}.median_ttft_ms" in metrics and f"b{size}.median_tpot_ms" in metrics
        line = next(r for r in result["reasons"] if r.startswith(f"batch {size}: "))
        assert f"(its served load at concurrency {size})" in line and "holds 0.05" in line
        ratios.append(
            f"batch {size}: {point['output_throughput']:.0f} tok/s against "
            f"{base['output_throughput']:.0f} served, ratio {ratio['value']:.2f}"
        )
    b1, b3 = (p["output_throughput"] for p in result["details"]["points"])
    assert metrics["scaling"]["value"] == pytest.approx(b3 / b1, rel=1e-2)
    assert any(r.startswith("scaling: batch 3 delivers") for r in result["reasons"])
    report("reference batch (CPU) against its served run: " + "; ".join(ratios))

    # The offline result meets the criterion that asks for it; the served one is not met by it.
    found = criteria(inv)
    assert found["offline"]["met"] and found["offline"]["evidence_id"] == result["id"]
    assert not found["served"]["met"] and found["served"]["evidence_id"] != result["id"]
    assert found["served"]["pinned"]["mode"] is None


def _results(inv: Path) -> list[dict[str, Any]]:
    from kdctl.evidence import open_store
    from kdctl.inventory import load_inventory

    with open_store(load_inventory(inv)) as store:
        return [r.model_dump(mode="json") for r in store.results(gate="throughput")]


OLD_ENGINE = """\
import json, sys
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
requests = json.load(open(args["--request"]))["requests"]
results = [
    {"id": r["id"], "output_ids": [7] * r["max_new_tokens"], "text": "",
     "finish_reason": "length", "prompt_tokens": len(r["input_ids"]),
     "completion_tokens": r["max_new_tokens"], **EXTRA}
    for r in requests
]
engine = {"model": "/models/old", "version": "kdtree 0.1.0"}
json.dump({"contract": 1, "engine": engine, "results": results}, open(args["--response"], "w"))
"""


def scripted_engine(tmp_path: Path, extra: dict[str, Any]) -> dict[str, Any]:
    """An engine that answers every request with the same tokens, and `extra` in each result."""
    script = tmp_path / "engine.py"
    script.write_text(f"EXTRA = {extra!r}\n{OLD_ENGINE}")
    return command_engine([sys.executable, str(script)], tmp_path)


def run_batch(engine: dict[str, Any]) -> ResponseFile:
    be = make_backend("old", BackendSpec.model_validate(engine), transport=LocalTransport("local"))
    return be.run_batch([GenerateRequest(input_ids=[1, 2], max_new_tokens=3)])  # type: ignore[attr-defined,no-any-return]


def test_an_engine_without_timings_validates_and_its_speed_is_not_measured(
    tmp_path: Path,
) -> None:
    """An engine older than the timings: its answers still meet the contract, and the
    throughput gate says it cannot measure its speed: inconclusive, never a pass."""
    engine = scripted_engine(tmp_path, {})
    (answer,) = run_batch(engine).results
    assert answer.timings is None and answer.completion_tokens == 3

    inv = inventory(tmp_path, "http://127.0.0.1:9", engine)
    data = yaml.safe_load(inv.read_text())
    data["gates"]["throughput"]["mode"] = "offline-batch"
    write_inventory(inv, data)
    run = kdctl("gate", "run", "throughput", "-b", "candidate", "-i", str(inv), "--json")
    (result,) = json.loads(run.out)["results"]
    assert run.code == 1 and result["verdict"] == "inconclusive"
    assert result["settings"]["mode"] == "offline-batch"
    assert "carry no timings" in result["reasons"][0]
    assert "cannot be measured before it serves" in result["reasons"][0]


def test_timings_that_break_the_contract_are_named(tmp_path: Path) -> None:
    timings = {"start_s": 0.0, "ttft_s": -1.0, "decode_s": 0.1, "decode_steps": 2}
    with pytest.raises(BackendProtocolError, match=r"results\.0\.timings\.ttft_s"):
        run_batch(scripted_engine(tmp_path, {"timings": timings}))


def test_a_paced_workload_and_an_unpinned_batch_are_shown_not_judged() -> None:
    """Batch 1 beside a workload that pins only concurrency 4 has no served run to divide by;
    a workload paced by request rate is no comparison for a batch run, which admits requests
    as places free: both ratios are shown, and neither passes."""
    from kdctl.checks.throughput import ENGINE_TIMINGS, judge
    from kdctl.inventory.models import ThroughputSettings
    from kdctl.loadgen import BenchMetrics, RequestRecord

    def point(size: int, client: str, seconds: float) -> BenchMetrics:
        records = [
            RequestRecord(started_at=0.0, ok=True, output_tokens=8, ttft_s=0.01, e2el_s=0.05)
            for _ in range(4)
        ]
        return BenchMetrics.of(
            records,
            seconds,
            max_concurrency=size,
            request_rate=None,
            burstiness=1.0,
            client=client,
            output_len=8,
            slo=None,
        )

    mine = [point(1, ENGINE_TIMINGS, 0.4), point(4, ENGINE_TIMINGS, 0.1)]
    served = [point(4, "aiohttp", 0.2)]
    settings = ThroughputSettings.model_validate(
        {"mode": "offline-batch", "min_ratio": 1.0, "workload": {"concurrency": [4]}}
    )
    metrics, reasons, verdict = judge(
        settings, mine, served, backend="candidate", random_ids=True, offline=True
    )
    ratios = {m.name: m for m in metrics if m.name.endswith(".ratio")}
    assert verdict == "pass" and list(ratios) == ["b4.ratio"] and ratios["b4.ratio"].value == 2.0
    assert any(r.startswith("batch 1: 80.0 tok/s, shown, not compared") for r in reasons)

    paced = settings.model_copy(
        update={"workload": settings.workload.model_copy(update={"request_rate": 2.0})}
    )
    metrics, reasons, verdict = judge(
        paced, mine, served, backend="candidate", random_ids=True, offline=True
    )
    assert verdict == "inconclusive"
    assert any("paced at 2 requests a second" in r for r in reasons)
    assert {m.name: m for m in metrics}["b4.ratio"].threshold is None
