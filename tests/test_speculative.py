"""Speculative decoding measured as such: the reference engine drafting with a one-layer model
of the same tokenizer and verifying with the target, against the plain engine on the same
weights; and the throughput gate choosing its workload by what the engines answer."""

from __future__ import annotations

import json
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx
import pytest

from kdctl.backends import GenerateRequest, make_backend
from kdctl.inventory import BackendSpec
from tests.conftest import (
    Served,
    engine_pair,
    kdctl,
    need_module,
    serve_reference,
    write_inventory,
)
from tests.test_throughput import gate

need_module("torch", "reference")

PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n",
    "class Config:\n    def __init__(self",
    "Explain what a KV cache is.",
]


@pytest.fixture(scope="module")
def speculative(models: dict[str, Path]) -> Iterator[Served]:
    served = serve_reference(models["dsv3"], draft=models["dsv3-draft"])
    yield served
    served.proc.terminate()
    served.proc.wait(10)


def _generate(url: str, prompt: str, *, stream: bool) -> list[dict[str, Any]]:
    body = {
        "text": prompt,
        "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
        "stream": stream,
    }
    if not stream:
        r = httpx.post(f"{url}/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return [r.json()]
    events = []
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                events.append(json.loads(line[5:]))
    return events


def test_speculative_output_is_the_targets_own_and_its_acceptance_is_measured(
    reference_server: Served, speculative: Served, report: Any
) -> None:
    tokens = steps = 0
    for prompt in PROMPTS:
        (plain,) = _generate(reference_server.url, prompt, stream=False)
        (spec,) = _generate(speculative.url, prompt, stream=False)
        assert spec["output_ids"] == plain["output_ids"], prompt
        pairs = zip(
            plain["meta_info"]["output_token_logprobs"],
            spec["meta_info"]["output_token_logprobs"],
            strict=True,
        )
        assert all(abs(a[0] - b[0]) < 1e-4 for a, b in pairs), prompt
        assert "spec_verify_ct" not in plain["meta_info"]
        verified = spec["meta_info"]["spec_verify_ct"]
        assert 1 <= verified < spec["meta_info"]["completion_tokens"], spec["meta_info"]
        tokens += spec["meta_info"]["completion_tokens"]
        steps += verified

        # Streamed, a verification pass that accepts several tokens sends them in one event.
        events = _generate(speculative.url, prompt, stream=True)
        counts = [e["meta_info"]["completion_tokens"] for e in events]
        assert events[-1]["output_ids"] == plain["output_ids"]
        assert max(b - a for a, b in pairwise(counts)) > 1, counts
        assert events[-1]["meta_info"]["spec_verify_ct"] == verified

    # The client reads the count as SGLang reports it.
    be = make_backend(
        "spec",
        BackendSpec.model_validate({"kind": "native", "host": "local", "url": speculative.url}),
    )
    result = be.generate(GenerateRequest(text=PROMPTS[0], max_new_tokens=24, temperature=0))
    assert result.spec_verify_ct is not None and result.spec_verify_ct < result.completion_tokens
    report(
        f"speculative reference engine, draft of 4: {tokens / steps:.2f} tokens per verification"
    )


def _inventory(tmp_path: Path, baseline: Served, candidate: Served, **workload: Any) -> Path:
    return write_inventory(
        tmp_path / "inventory.yaml",
        {
            "hosts": {"local": {"transport": "local"}},
            "backends": engine_pair(baseline.url, candidate.url),
            "gates": {
                "throughput": {
                    "workload": {
                        "output_len": 12,
                        "concurrency": [2],
                        "num_prompts": 6,
                        **workload,
                    },
                    "min_ratio": 0.05,
                }
            },
            "state_dir": "state",
        },
    )


def _gate(inv: Path) -> dict[str, Any]:
    return gate(inv, "candidate", "--baseline", "baseline")[1]


def test_a_speculative_candidate_is_measured_on_text_and_random_ids_are_inconclusive(
    tmp_path: Path, reference_server: Served, twin_server: Served, speculative: Served
) -> None:
    inv = _inventory(tmp_path, reference_server, speculative)
    # Recorded before the candidate is asked anything: on random ids and on the text corpus.
    rec = kdctl("baseline", "record", "-b", "baseline", "--only", "throughput", "-i", str(inv))
    assert rec.code == 0, rec.err
    assert rec.out.count("recorded throughput baseline") == 2, rec.out

    result = _gate(inv)
    assert result["verdict"] == "pass", result["reasons"]
    assert "shipped text corpus mixed.jsonl" in result["reasons"][0]
    assert "candidate decodes speculatively" in result["reasons"][0]
    assert "run recorded" in result["reasons"][1]
    metrics = {m["name"]: m["value"] for m in result["metrics"]}
    assert metrics["c2.spec_accept_length"] > 1.0, metrics
    assert metrics["c2.ratio"] >= 0.05

    # The same engines on random token ids: the figures are kept, the speed is not judged.
    rand = _gate(_inventory(tmp_path, reference_server, speculative, source="random-ids"))
    assert rand["verdict"] == "inconclusive", rand["reasons"]
    why = " ".join(rand["reasons"])
    assert "candidate decode speculatively, and the workload is random token ids" in why
    assert any(m["name"] == "c2.spec_accept_length" for m in rand["metrics"])

    # Two plain engines keep the random-id workload: nothing drafts, nothing to switch for.
    plain = _gate(_inventory(tmp_path, reference_server, twin_server))
    assert not any("text corpus" in r for r in plain["reasons"]), plain["reasons"]
    assert not any(m["name"].endswith("spec_accept_length") for m in plain["metrics"])


def test_the_shipped_text_corpus_is_what_its_readme_says() -> None:
    """roadmap/README.md describes mixed.jsonl by its counts: held to the file, so neither
    drifts from the other."""
    import collections

    from kdctl.roadmap import __file__ as roadmap_init

    folder = Path(roadmap_init).parent
    rows = [json.loads(line) for line in (folder / "prompts" / "mixed.jsonl").open()]
    assert len({r["id"] for r in rows}) == len(rows) == 320
    assert collections.Counter(r["category"] for r in rows) == {
        "chat": 110,
        "code": 100,
        "math": 70,
        "long": 40,
    }
    assert len({r["prompt"] for r in rows}) == 320
    assert max(len(r["prompt"]) for r in rows) <= 2300
    readme = (folder / "README.md").read_text()
    assert "320 prompts, 110 chat, 100 code, 70 math and 40 long" in readme


def test_an_accept_length_from_engine_counters_is_the_loads_own_or_none() -> None:
    """vLLM counts drafting for the whole engine: over a run, tokens per decoding step is the
    generated tokens over the steps (generated less accepted), steps that drafted nothing
    included; where the engine generated more than the load and its warm-up did, other
    traffic shares the window and no figure is given, with the reason."""
    from kdctl.backends import SpecCounters
    from kdctl.checks.throughput import _with_engine_acceptance
    from kdctl.loadgen import BenchMetrics, RequestRecord

    run = BenchMetrics.of(
        [RequestRecord(started_at=0.0, ok=True, output_tokens=40) for _ in range(3)],
        1.0,
        max_concurrency=1,
        request_rate=None,
        burstiness=1.0,
        client="openai",
        output_len=None,
        slo=None,
    )
    assert run.spec_accept_from is None  # no request counted verification steps
    before = SpecCounters(drafts=10, accepted=20, generated=100)
    # 120 of the load's tokens and 40 of warm-up; 80 of them accepted: 80 steps.
    after = SpecCounters(drafts=50, accepted=100, generated=260)
    judged = _with_engine_acceptance(run, before, after, warmup=40)
    assert (judged.spec_accept_from, judged.spec_accept_length) == ("engine counters", 2.0)
    assert judged.spec_accept_note is None
    crowded = _with_engine_acceptance(run, before, after, warmup=0)
    assert crowded.spec_accept_length is None and crowded.spec_accept_from == "engine counters"
    assert "grew by 160 tokens over the run, the load's 120" in (crowded.spec_accept_note or "")
    restarted = _with_engine_acceptance(run, after, before, warmup=40)
    assert restarted.spec_accept_length is None and restarted.spec_accept_note
    # No drafting at all in the window: one token a step, measured, not missing.
    idle = SpecCounters(drafts=10, accepted=20, generated=220)
    assert _with_engine_acceptance(run, before, idle, warmup=0).spec_accept_length == 1.0


def test_status_says_which_engine_drafts_by_its_own_word(
    speculative: Served, reference_server: Served, tmp_path: Path
) -> None:
    """`kdctl status` reads speculative decoding from each engine's server arguments, and the
    accept length from its own lifetime count, which SGLang keeps in /server_info."""
    inv = write_inventory(
        tmp_path / "inv.yaml",
        {
            "hosts": {"local": {"transport": "local"}},
            "backends": {
                "drafting": {"kind": "sglang", "host": "local", "url": speculative.url},
                "plain": {"kind": "sglang", "host": "local", "url": reference_server.url},
            },
        },
    )
    _generate(speculative.url, "def fib(n):", stream=False)
    info = httpx.get(f"{speculative.url}/server_info").json()
    (state,) = info["internal_states"]
    run = kdctl("status", "-i", str(inv), "--json")
    assert run.code == 0, run.err
    backends = {b["name"]: b for b in json.loads(run.out)["backends"]}
    assert backends["drafting"]["speculative"] == "STANDALONE"
    # Its count since start (this request's and the module's earlier ones), as the engine
    # said it: at least the one token a verification always adds, at most the draft's four more.
    said = backends["drafting"]["spec_accept_length"]
    assert said == pytest.approx(state["avg_spec_accept_length"]) and 1 <= said <= 5
    assert backends["plain"]["speculative"] == "none"
    assert backends["plain"]["spec_accept_length"] is None
    table = kdctl("status", "-i", str(inv), env={"COLUMNS": "300"})
    assert "STANDALONE, " in table.out and "tok/step (its own count)" in table.out
