"""kdctl's SGLang client against every release's answer shape (tests/fixtures/sglang/generate/:
0.5.23's recorded from SGLang itself on the CPU, the older ones written from SGLang's source),
first replayed as recorded, then answered live by the reference server switched to that
release's shape."""

from __future__ import annotations

import json
from collections.abc import Iterator
from itertools import chain
from pathlib import Path
from typing import Any

import httpx
import pytest

from kdctl.backends import GenerateRequest, HttpBackend, make_backend
from kdctl.backends.errors import BackendError
from kdctl.backends.reference.shapes import SHAPES
from kdctl.inventory import BackendSpec
from kdctl.loadgen import LoadPlan, run_load
from tests.conftest import FIXTURES, need_module
from tests.support.faulty import release, serve

RELEASES = sorted(p.stem for p in (FIXTURES / "sglang" / "generate").glob("*.json"))


def fixture(version: str) -> dict[str, Any]:
    return dict(json.loads((FIXTURES / "sglang" / "generate" / f"{version}.json").read_text()))


def client(url: str) -> HttpBackend:
    be = make_backend("sglang", BackendSpec(kind="sglang", host="local", url=url), timeout=30)
    assert isinstance(be, HttpBackend)
    return be


def test_every_shape_has_a_recorded_fixture_and_the_reverse() -> None:
    assert set(RELEASES) == set(SHAPES)
    for version in RELEASES:
        doc = fixture(version)
        assert doc["sglang"] == version and "source" in doc
        # Written from SGLang's source, except where SGLang itself answered (0.5.23).
        assert ("not captured" in doc["note"]) != ("recorded from a live SGLang" in doc["note"])


def _check_client(be: HttpBackend, doc: dict[str, Any]) -> None:
    """What the client makes of one release's answers, whole and streamed."""
    final = json.loads(doc["stream"][-2][5:])
    whole_text = doc["answer"]["text"]
    req = GenerateRequest(text="Q: name a capital. A:", max_new_tokens=4, temperature=0)
    result = be.generate(req)
    assert result.text == whole_text and result.completion_tokens == 4
    assert result.finish_reason == "length"
    assert result.output_ids == doc["answer"].get("output_ids", [])

    chunks = list(be.stream(req))
    assert "".join(c.text for c in chunks) == whole_text, chunks
    assert sum(len(c.output_ids) for c in chunks) in (0, 4)
    assert chunks[-1].completion_tokens == final["meta_info"]["completion_tokens"]
    m = run_load(be, [req] * 3, LoadPlan(max_concurrency=2, warmup_requests=0, timeout_s=30))
    assert (m.completed, m.failed, m.total_output_tokens) == (3, 0, 12), m.errors

    with pytest.raises(BackendError) as exc:
        be.generate(GenerateRequest(text="too long", max_new_tokens=4))
    assert "context length" in str(exc.value)
    with pytest.raises(BackendError) as exc:
        list(be.stream(GenerateRequest(text="too long", max_new_tokens=4)))
    assert "context length" in str(exc.value)

    info = be.info()
    assert info.served_name and info.context_length == 2048


@pytest.mark.parametrize("version", RELEASES)
def test_the_client_reads_each_recorded_release(version: str) -> None:
    doc = fixture(version)
    server = serve(release(doc))
    try:
        with client(f"http://127.0.0.1:{server.server_address[1]}") as be:
            _check_client(be, doc)
    finally:
        server.shutdown()


@pytest.fixture(scope="module", params=RELEASES)
def shaped(request: pytest.FixtureRequest, models: dict[str, Path]) -> Iterator[tuple[str, str]]:
    """The reference server's app in this release's shape, served by uvicorn on a thread of
    the test process: six shapes cost one torch import, not six."""
    need_module("torch", "reference")
    import threading

    import uvicorn

    from kdctl.backends import wait_http
    from kdctl.backends.reference.server import create_app
    from tests.support.sshd import free_port

    app = create_app(models["dsv3"], served_name="tiny", sglang_version=request.param)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/health", deadline_s=120)
    yield request.param, url
    server.should_exit = True
    thread.join(10)


def _keys(answer: dict[str, Any]) -> tuple[set[str], set[str]]:
    return set(answer) - {"meta_info"}, set(answer["meta_info"])


def test_the_reference_server_answers_in_each_releases_shape(shaped: tuple[str, str]) -> None:
    version, url = shaped
    doc = fixture(version)
    body = {
        "text": "def add(a, b):",
        "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
    }
    whole = httpx.post(f"{url}/generate", json=body, timeout=30).json()
    assert _keys(whole) == _keys(doc["answer"]), version

    events = []
    with httpx.stream("POST", f"{url}/generate", json={**body, "stream": True}) as r:
        events = [json.loads(ln[5:]) for ln in r.iter_lines() if ln.startswith("data: {")]
    recorded = [json.loads(e[5:]) for e in doc["stream"][:-1]]
    assert [_keys(e) for e in events[-1:]] == [_keys(recorded[-1])], version
    ids = whole.get("output_ids")
    if SHAPES[version].output_ids == "new":
        assert list(chain.from_iterable(e["output_ids"] for e in events)) == ids
    elif SHAPES[version].output_ids == "all":
        assert events[-1]["output_ids"] == ids
    text = "".join(e["text"] for e in events)
    assert (text if SHAPES[version].incremental_text else events[-1]["text"]) == whole["text"]

    for route, status in doc["routes"].items():
        assert httpx.get(f"{url}{route}").status_code == status, (version, route)
    # The release's keys, held to a live server's where one was captured (test_sglang_captured).
    assert tuple(httpx.get(f"{url}/get_model_info").json()) == SHAPES[version].model_info
    bad = httpx.post(f"{url}/generate", content=b"{not json", timeout=10)
    assert bad.status_code == doc["schema_error"]["status"]
    assert set(bad.json()) == set(doc["schema_error"]["body"]), bad.json()
    long = {**body, "input_ids": [5] * 2100}
    del long["text"]
    over = httpx.post(f"{url}/generate", json=long, timeout=10)
    assert over.status_code == 400 and set(over.json()["error"]) == {"message"}
    with httpx.stream("POST", f"{url}/generate", json={**long, "stream": True}) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data:")]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]"
    recorded_err = json.loads(doc["bad_input_stream"]["events"][0][5:])
    assert set(json.loads(lines[0][5:])["error"]) == set(recorded_err["error"])

    # The client, live, against this shape.
    with client(url) as be:
        req = GenerateRequest(text="def add(a, b):", max_new_tokens=6, temperature=0)
        assert be.generate(req).completion_tokens == 6
        chunks = list(be.stream(req))
        assert "".join(c.text for c in chunks) == whole["text"]
        m = run_load(be, [req] * 3, LoadPlan(max_concurrency=2, warmup_requests=0, timeout_s=60))
        assert (m.completed, m.failed, m.total_output_tokens) == (3, 0, 18), m.errors
        assert be.info().context_length == 2048

        # api-conformance's info probes: the /get_ names where the release has only those,
        # and of /server_info (hundreds of server arguments, changing by release) only the
        # keys it compares.
        from kdctl.checks.api_conformance import PROBES, answer

        probes = {p.name: p for p in PROBES}
        with httpx.Client() as c:
            for name, old in (
                ("model_info", "/get_model_info"),
                ("server_info", "/get_server_info"),
            ):
                got = answer(c, be, probes[name], "tiny")
                assert got["status"] == 200, (version, name, got)
                assert got.get("path") == (None if SHAPES[version].info_routes else old), version
        assert set(got["body"]) == set(probes["server_info"].keys or ()), got["body"]
