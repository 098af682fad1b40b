"""api-conformance between two reference servers, and its shape comparison."""

from __future__ import annotations

import json
from pathlib import Path

from kdctl.checks.api_conformance import compare, differences, merge, shape
from tests.conftest import Served, engine_pair, kdctl, need_module, write_inventory

need_module("torch", "reference")


def test_the_same_api_conforms(
    reference_server: Served, twin_server: Served, tmp_path: Path
) -> None:
    inv = write_inventory(
        tmp_path / "inv.yaml",
        {
            "hosts": {"local": {"transport": "local"}},
            "backends": engine_pair(reference_server.url, twin_server.url),
            "state_dir": "state",
        },
    )
    run = kdctl(
        "gate",
        "run",
        "api-conformance",
        "-b",
        "candidate",
        "--baseline",
        "baseline",
        "-i",
        str(inv),
        "--json",
    )
    assert run.code == 0, run.out + run.err
    (result,) = json.loads(run.out)["results"]
    assert result["reasons"][0] == "14/14 probes answered as baseline's live answers"
    base = result["details"]["baseline"]
    # What the expectations were generated from: SGLang's framing as the baseline served it.
    assert base["generate_stream"]["ends_with_done"] is True
    assert base["generate_stream"]["event"]["meta_info"]["finish_reason"] == {
        "length": "number",
        "type": "str",
    }
    assert base["completions_stream"]["event"]["usage"]["completion_tokens"] == "number"
    assert base["error_not_json"]["status"] == 400


def test_a_baseline_that_answered_nothing_holds_the_candidate_to_nothing(
    reference_server: Served, tmp_path: Path
) -> None:
    """The baseline is down: none of its answers exists to compare with, so a live candidate
    conforms to nothing, and the gate says so instead of passing with 0/0."""
    inv = write_inventory(
        tmp_path / "inv.yaml",
        {
            "hosts": {"local": {"transport": "local"}},
            "backends": engine_pair("http://127.0.0.1:9", reference_server.url),
            "state_dir": "state",
        },
    )
    run = kdctl(
        "gate",
        "run",
        "api-conformance",
        "-b",
        "candidate",
        "--baseline",
        "baseline",
        "-i",
        str(inv),
        "--json",
    )
    assert run.code == 1, run.out + run.err
    (result,) = json.loads(run.out)["results"]
    assert result["verdict"] == "inconclusive", result["reasons"]
    assert result["reasons"][0] == "0/0 probes answered as baseline's live answers"
    assert result["reasons"][1].startswith(
        "14 of 14 probes not compared: baseline did not answer them (ConnectError"
    )
    metrics = {m["name"]: (m["value"], m["threshold"]) for m in result["metrics"]}
    assert metrics == {"probes": (0, None), "nonconforming": (None, 0)}


def test_shapes_compare_keys_types_and_framing() -> None:
    want = shape({"choices": [{"text": "a", "index": 0}], "usage": {"total": 3}})
    assert (
        differences(
            want, shape({"choices": [{"text": "b", "index": 1, "extra": 1}], "usage": {"total": 9}})
        )
        == []
    )
    assert differences(want, shape({"choices": [{"text": 5}], "usage": None})) == [
        "choices[0].index: missing",
        "choices[0].text: str in the baseline, number here",
    ]
    events = merge(
        shape({"choices": [{"finish_reason": None}]}),
        shape({"choices": [{"finish_reason": "length"}], "usage": {}}),
    )
    assert events == {"choices": [{"finish_reason": "str"}], "usage": {}}
    found = compare(
        {
            "s": {
                "status": 200,
                "content_type": "text/event-stream",
                "event": {"a": "str"},
                "ends_with_done": True,
            }
        },
        {
            "s": {
                "status": 200,
                "content_type": "text/event-stream",
                "event": {"a": "str"},
                "ends_with_done": False,
            }
        },
    )
    assert found == {"s": ["the stream does not end with data: [DONE]"]}


def test_a_pass_of_the_few_probes_the_baseline_answered_is_inconclusive(
    reference_server: Served, twin_server: Served, tmp_path: Path
) -> None:
    """The baseline answers its read routes (forwarded to a real engine) and drops every
    generation unanswered: the candidate matches it on those, but generation, completions and
    streams were never compared, so the API is not called conformant."""
    import httpx

    from tests.support.faulty import Quiet, serve

    class ReadsOnly(Quiet):
        def do_GET(self) -> None:
            got = httpx.get(reference_server.url + self.path, timeout=30)
            self.send_response(got.status_code)
            if "content-type" in got.headers:
                self.send_header("Content-Type", got.headers["content-type"])
            self.send_header("Content-Length", str(len(got.content)))
            self.end_headers()
            self.wfile.write(got.content)

        def do_POST(self) -> None:
            self.close_connection = True  # read, never answered

    server = serve(ReadsOnly)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        inv = write_inventory(
            tmp_path / "inv.yaml",
            {
                "hosts": {"local": {"transport": "local"}},
                "backends": engine_pair(url, twin_server.url),
                "state_dir": "state",
            },
        )
        args = ("api-conformance", "-b", "candidate", "--baseline", "baseline", "-i", str(inv))
        run = kdctl("gate", "run", *args, "--json")
    finally:
        server.shutdown()
        server.server_close()
    assert run.code == 1, run.out + run.err
    (result,) = json.loads(run.out)["results"]
    assert result["verdict"] == "inconclusive", result["reasons"]
    held = result["reasons"][0]
    assert held.endswith("probes answered as baseline's live answers") and held[0] != "0", held
    assert any("probes not compared: baseline did not answer them" in r for r in result["reasons"])
