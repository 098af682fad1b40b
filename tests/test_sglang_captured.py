"""kdctl's SGLang client against what live SGLang servers answered.

Of the releases before 0.5.23 none runs here (their CPU engines need SGLang's compiled kernels;
0.5.23 runs in tests/test_sglang_live.py), but SGLang's documentation build runs notebooks
against a live server started from its main branch and keeps every cell's output; from those,
release by release, tests/fixtures/sglang/captured/ holds /generate, /get_model_info,
/get_server_info and /health as they were sent (the version is the one that server's own
/get_server_info printed). tests/fixtures/sglang/metrics/ holds two /metrics scrapes its
developers pasted into its docs, tests/fixtures/sglang/excerpts/ the tail of a speculative
server's answer pasted into a pull request. The shapes the reference server imitates, written
from SGLang's source, are held to the capture of the same release."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from kdctl.backends import GenerateRequest, GenerateResult, HttpBackend, make_backend
from kdctl.backends.reference.shapes import SHAPES
from kdctl.cutover.analysis import engine_counters, engine_ttft
from kdctl.inventory import BackendSpec, load_inventory
from kdctl.loadgen import BenchMetrics, RequestRecord
from tests.conftest import FIXTURES, write_inventory
from tests.support.faulty import replay, serve

SGLANG = FIXTURES / "sglang"
CAPTURED = sorted(p.stem for p in (SGLANG / "captured").glob("*.json"))
JSON = "application/json"


def captured(version: str) -> dict[str, Any]:
    return dict(json.loads((SGLANG / "captured" / f"{version}.json").read_text()))


def exchange(doc: dict[str, Any], *paths: str) -> dict[str, Any]:
    return next(e for e in doc["exchanges"] if e["path"] in paths)


def body(ex: dict[str, Any]) -> Any:
    return json.loads(ex["body_text"]) if "body_text" in ex else ex["body"]


def raw(ex: dict[str, Any]) -> bytes:
    # A body printed through response.text is the one sent; one printed as response.json()
    # is sent again as JSON.
    return (ex["body_text"] if "body_text" in ex else json.dumps(ex["body"])).encode()


@contextmanager
def replayed(answers: dict[tuple[str, str], tuple[int, bytes, str]]) -> Iterator[HttpBackend]:
    server = serve(replay(answers))
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        be = make_backend("sglang", BackendSpec(kind="sglang", host="local", url=url), timeout=10)
        assert isinstance(be, HttpBackend)
        with be:
            yield be
    finally:
        server.shutdown()


def test_the_captures_are_what_a_live_server_sent() -> None:
    assert len(CAPTURED) >= 10
    for version in CAPTURED:
        doc = captured(version)
        assert doc["source"].startswith("https://github.com/") and "live SGLang" in doc["note"]
        info = body(exchange(doc, "/get_server_info", "/server_info"))
        assert version.split("-")[-1] in info["version"], (version, info["version"])
        assert {e["path"] for e in doc["exchanges"]} >= {"/generate", "/health"}


@pytest.mark.parametrize("version", CAPTURED)
def test_the_client_reads_each_captured_release(version: str) -> None:
    doc = captured(version)
    answers = {
        (e["method"], e["path"]): (e["status"] or 200, raw(e), JSON) for e in doc["exchanges"]
    }
    gen = exchange(doc, "/generate")
    answer, meta = gen["body"], gen["body"]["meta_info"]
    server_info = body(exchange(doc, "/get_server_info", "/server_info"))
    model_info = body(exchange(doc, "/get_model_info", "/model_info"))
    with replayed(answers) as be:
        result = be.generate(GenerateRequest(text=gen["request"]["text"], max_new_tokens=128))
        assert result.text == answer["text"]
        assert result.output_ids == answer.get("output_ids", [])
        assert (result.prompt_tokens, result.completion_tokens) == (
            meta["prompt_tokens"],
            meta["completion_tokens"],
        )
        assert result.finish_reason == meta["finish_reason"]["type"]
        assert result.matched_stop == meta["finish_reason"].get("matched")
        # A plain server reports no verification steps: no acceptance is made up for it.
        assert result.spec_verify_ct is None

        info = be.info()
        assert info.model == model_info["model_path"]
        assert info.served_name == server_info["served_model_name"]
        assert (info.version, info.tp_size) == (server_info["version"], server_info["tp_size"])
        # Null in /get_server_info (no --context-length) and /v1/models not captured: unknown,
        # not guessed.
        assert server_info["context_length"] is None and info.context_length is None

        health = be.health()
        assert (health.state, health.status_code) == ("up", 200), health


def _release(version: str) -> str:
    """0.4.3.post4 -> 0.4.3, 0.5.10rc0 -> 0.5.10."""
    return re.sub(r"(\.post\d+|rc\d+)$", "", version)


def test_the_imitated_shapes_match_the_capture_of_their_release() -> None:
    """Both written from notes, the imitation and the client could agree and both be wrong;
    where a live server of the release was captured, its answer decides."""
    compared = []
    for version in CAPTURED:
        shape = SHAPES.get(_release(version))
        if shape is None:
            continue
        written = json.loads((SGLANG / "generate" / f"{shape.version}.json").read_text())
        live = exchange(captured(version), "/generate")["body"]
        assert set(written["answer"]) == set(live), version
        assert set(written["answer"]["meta_info"]) == set(live["meta_info"]), version
        model_info = body(exchange(captured(version), "/get_model_info", "/model_info"))
        assert shape.model_info == tuple(model_info), version
        compared.append(version)
    assert compared == ["0.4.10.post2", "0.4.3.post4", "0.5.6.post2"]


def test_speculative_acceptance_as_a_live_sglang_reported_it() -> None:
    """A speculative server's answer (its tail, as pasted): the client reads its verification
    count, and kdctl's accept length (tokens per verification step) is the one SGLang itself
    reported beside it."""
    doc = json.loads((SGLANG / "excerpts" / "spec-pr13754.json").read_text())
    # The two repairs the excerpt needs, and only those: the word its retrieval broke, and the
    # cut at both ends (the meta_info object, less its last, truncated, field).
    text = doc["excerpt"].replace('"t\nype"', '"type"')
    start = text.index('"meta_info":') + len('"meta_info":')
    meta = json.loads(text[start : text.rindex(',"response_sent_to_client_ts"')] + "}")
    answers = {
        ("POST", "/generate"): (200, json.dumps({"text": "", "meta_info": meta}).encode(), JSON)
    }
    with replayed(answers) as be:
        result = be.generate(GenerateRequest(text="x", max_new_tokens=200))
    assert (result.spec_verify_ct, result.completion_tokens) == (188, 200)
    record = RequestRecord(
        started_at=0.0, ok=True, output_tokens=200, spec_verify_ct=result.spec_verify_ct
    )
    metrics = BenchMetrics.of(
        [record],
        1.0,
        max_concurrency=1,
        request_rate=None,
        burstiness=1.0,
        client="sglang",
        output_len=None,
        slo=None,
    )
    assert metrics.spec_accept_length == round(meta["spec_accept_length"], 3) == 1.064

    # The reference server's speculative decoder reports SGLang's four figures; given the same
    # counts (five drafted tokens per verification), they are the ones SGLang sent.
    from kdctl.backends.reference.server import _accept

    counts = GenerateResult(
        output_ids=[], text="", finish_reason="length", prompt_tokens=171, completion_tokens=200
    )
    figures = _accept(counts.model_copy(update={"spec_verify_ct": 188}), 5)
    assert figures == {k: meta[k] for k in figures}


def _scrape(tmp_path: Path, name: str) -> Any:
    text = (SGLANG / "metrics" / f"{name}.prom").read_bytes()
    answers = {("GET", "/metrics"): (200, text, "text/plain; version=0.0.4; charset=utf-8")}
    server = serve(replay(answers))
    url = f"http://127.0.0.1:{server.server_address[1]}"
    inv = load_inventory(
        write_inventory(
            tmp_path / "inventory.yaml",
            {
                "hosts": {"local": {"transport": "local"}},
                "backends": {"baseline": {"kind": "sglang", "host": "local", "url": url}},
            },
        )
    )
    try:
        return engine_counters(inv, "baseline")
    finally:
        server.shutdown()


def test_an_engines_load_is_read_from_sglangs_own_gauges_as_scraped(tmp_path: Path) -> None:
    """What a rolling cutover's headroom and drain read of an engine: its running and queued
    requests and the share of its KV cache in use, from a busy SGLang's own scrape."""
    from kdctl.backends import EngineLoad

    text = (SGLANG / "metrics" / "docs-2025-03-03.prom").read_bytes()
    answers = {("GET", "/metrics"): (200, text, "text/plain; version=0.0.4; charset=utf-8")}
    server = serve(replay(answers))
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with make_backend("busy", BackendSpec(kind="sglang", host="local", url=url)) as be:
            load = be.load()
    finally:
        server.shutdown()
    assert load == EngineLoad(running=162.0, queued=2826.0, token_usage=0.28)


def test_the_canary_reads_sglangs_own_metrics_as_scraped(tmp_path: Path) -> None:
    """Scrapes of early-2025 SGLang: no request counter yet (not counted is not zero), TTFT
    buckets from 1 ms, so a 50 ms SLO is judged from them; where a percentile lies past the
    last finite bucket, the histogram gives a floor, not a figure."""
    small = _scrape(tmp_path, "docs-2024-12-22")
    assert small is not None and small.requests is None
    assert min(small.ttft_buckets) == 0.001 and small.ttft_buckets[float("inf")] == 1
    ms, note, breach = engine_ttft(small, "p99", 50)
    assert ms is not None and 250 < ms <= 500 and not note
    assert breach == "TTFT p99 498 ms over the window exceeds the SLO of 50 ms"

    busy = _scrape(tmp_path, "docs-2025-03-03")
    assert busy is not None and busy.requests is None
    # 2513 of 11008 first tokens within 30 s, the last finite bucket: p50 lies past it.
    assert engine_ttft(busy, "p50", 60_000) == (
        None,
        "TTFT histogram puts p50 past its last finite bucket (30000 ms): not measured there; "
        "judged by the probes",
        "",
    )
    ms, note, breach = engine_ttft(busy, "p50", 10_000)
    assert ms == 30_000 and not note
    assert breach == (
        "TTFT p50 over 30000 ms (past the histogram's last finite bucket) exceeds the SLO of "
        "10000 ms"
    )
    # Any SLO under that floor is broken, whatever lies past it.
    ms, note, breach = engine_ttft(busy, "p50", 100)
    assert ms == 30_000 and breach.startswith("TTFT p50 over 30000 ms")


@pytest.mark.parametrize("version", CAPTURED)
def test_settings_and_acceptance_from_each_captured_server_info(version: str) -> None:
    """Every release's server info gives settings to bind evidence to, never its version or
    figures of that start, and no accept length for a server that does not draft."""
    from kdctl.backends.sglang import _accept_length, engine_settings

    info = body(exchange(captured(version), "/get_server_info", "/server_info"))
    settings = engine_settings(info)
    assert settings and "version" not in settings and "port" not in settings
    assert not {"random_seed", "max_total_num_tokens", "internal_states"} & set(settings)
    assert _accept_length(info) is None
    drafting = {
        **info,
        "internal_states": [{"avg_spec_accept_length": 2.5}, {}, {"avg_spec_accept_length": 3.5}],
    }
    assert _accept_length(drafting) == 3.0
    assert _accept_length({"avg_spec_accept_length": 1.75}) == 1.75  # 0.4.3's flat key
