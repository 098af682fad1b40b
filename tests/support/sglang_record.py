"""One SGLang release's answers, recorded from a live server in the form of
tests/fixtures/sglang/generate/<release>.json: a whole /generate answer, its stream as the lines
were sent, a prompt over the context whole and streamed, a body that is not JSON, and which info
routes answer.

    python -m tests.support.sglang_record URL RELEASE OUT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import httpx

REQUEST = {
    "text": "Q: name a capital. A:",
    "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
}
INFO_ROUTES = ("/get_model_info", "/get_server_info", "/model_info", "/server_info")


def _lines(c: httpx.Client, body: dict[str, Any]) -> tuple[int, list[str]]:
    with c.stream("POST", "/generate", json={**body, "stream": True}) as r:
        return r.status_code, [ln for ln in r.iter_lines() if ln]


def record(url: str, release: str) -> dict[str, Any]:
    with httpx.Client(base_url=url, timeout=60) as c:
        server = c.get("/get_server_info").json()
        answer = c.post("/generate", json=REQUEST).json()
        _, stream = _lines(c, REQUEST)
        over = {**REQUEST, "input_ids": [5] * (server["max_req_input_len"] + 10)}
        del over["text"]
        bad = c.post("/generate", json=over)
        bad_status, bad_events = _lines(c, over)
        schema = c.post(
            "/generate", content=b"{not json", headers={"content-type": "application/json"}
        )
        routes = {route: c.get(route).status_code for route in INFO_ROUTES}
    mode = " --incremental-streaming-output" if server.get("incremental_streaming_output") else ""
    return {
        "sglang": release,
        "source": f"SGLang {server['version']} itself, on the CPU{mode}",
        "note": (
            "recorded from a live SGLang by tests/support/sglang_record.py, serving kdctl's tiny "
            "Llama with --enable-metrics; docs/sglang-compatibility.md"
        ),
        "request": REQUEST,
        "routes": routes,
        "answer": answer,
        "stream": stream,
        "bad_input": {"status": bad.status_code, "body": bad.json()},
        "bad_input_stream": {"status": bad_status, "events": bad_events},
        "schema_error": {"status": schema.status_code, "body": schema.json()},
    }


if __name__ == "__main__":
    url, release, out = sys.argv[1:4]
    Path(out).write_text(json.dumps(record(url, release), indent=2) + "\n")
