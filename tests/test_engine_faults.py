"""Engines that misbehave at the HTTP level, met by every gate and probe through the real CLI:
one that accepts TCP and never answers, one that answers 200 with a body that is not JSON,
one that streams forever, and a wedged one whose reads work (forwarded to a real reference
server) while every generation hangs. Each gate and probe must end by the backend's deadline
with an error naming the backend, and nothing may be recorded as a pass."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import Served, kdctl, need_module, write_inventory
from tests.support.faulty import Endless, NotJson, Quiet, serve

need_module("torch", "reference")

TIMEOUT_S = 2.0


def _wedged(upstream: str) -> type[Quiet]:
    class Wedged(Quiet):
        """Reads answered by a real engine; a generation is taken and never answered."""

        def do_GET(self) -> None:
            got = httpx.get(upstream + self.path, timeout=10)
            self.send_response(got.status_code)
            self.send_header("Content-Type", got.headers.get("content-type", "application/json"))
            self.send_header("Content-Length", str(len(got.content)))
            self.end_headers()
            self.wfile.write(got.content)

        def do_POST(self) -> None:
            self.drain()
            time.sleep(3600)

    return Wedged


@pytest.fixture(scope="module")
def engines(reference_server: Served) -> Iterator[dict[str, str]]:
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)  # the TCP handshake completes; nothing is ever read or sent
    servers = [serve(handler) for handler in (NotJson, Endless, _wedged(reference_server.url))]
    urls = [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
    yield {
        "silent": f"http://127.0.0.1:{silent.getsockname()[1]}",
        "notjson": urls[0],
        "endless": urls[1],
        "wedged": urls[2],
    }
    for server in servers:
        server.shutdown()
        server.server_close()
    silent.close()


@pytest.fixture(scope="module")
def inventory(
    engines: dict[str, str], reference_server: Served, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    root = tmp_path_factory.mktemp("faulty-engines")
    backends: dict[str, Any] = {
        "baseline": {"kind": "sglang", "host": "local", "url": reference_server.url},
    }
    for name, url in engines.items():
        backends[name] = {
            "kind": "sglang",
            "host": "local",
            "url": url,
            "request_timeout_s": TIMEOUT_S,
        }
    inv = write_inventory(
        root / "inventory.yaml",
        {
            "hosts": {"local": {"transport": "local"}},
            "backends": backends,
            "gates": {
                "exactness": {"max_new_tokens": 4, "mode": "strict", "top_k": 2},
                "throughput": {
                    "request_timeout_s": TIMEOUT_S,
                    "workload": {
                        "input_len": 16,
                        "output_len": 8,
                        "num_prompts": 4,
                        "concurrency": [2],
                    },
                },
            },
            "state_dir": "state",
        },
    )
    recorded = kdctl("baseline", "record", "-b", "baseline", "-i", str(inv), timeout=600)
    assert recorded.code == 0, recorded.out + recorded.err
    return inv


# A gate's own deadline, its baseline's recorded answers read from the store, and a margin
# for starting Python: far below the 60 s an engine would otherwise be given per request.
GATE_BOUND_S = 4 * TIMEOUT_S + 10


@pytest.mark.parametrize("engine", ["silent", "notjson", "endless", "wedged"])
def test_every_gate_ends_by_the_deadline_naming_the_backend(
    inventory: Path, engine: str, report: Any
) -> None:
    took: dict[str, float] = {}
    for gate in ("health", "api-conformance", "exactness", "throughput"):
        started = time.monotonic()
        run = kdctl(
            "gate", "run", gate, "-b", engine, "--baseline", "baseline", "-i", str(inventory),
            "--json", timeout=120,
        )  # fmt: skip
        took[gate] = time.monotonic() - started
        assert run.code in (1, 3), (gate, run.code, run.out, run.err)
        (result,) = json.loads(run.out)["results"]
        assert result["verdict"] in ("error", "fail"), (gate, result)
        said = " ".join(result["reasons"])
        assert result["backend"] == engine
        # A backend's typed error names it; so do the load generator's counted failures; a
        # health probe that got no status names its deadline.
        assert (
            f"backend {engine} (" in said
            or f"requests to {engine} failed" in said
            or (gate == "health" and "no answer within" in said)
        ), (gate, said)
        assert took[gate] < GATE_BOUND_S, (gate, took[gate], said)
    report(
        f"{engine} engine: "
        + ", ".join(f"{gate} ended in {s:.1f}s" for gate, s in took.items())
        + f" (deadline {TIMEOUT_S:g}s per answer)"
    )
    listed = kdctl("evidence", "list", "--backend", engine, "-i", str(inventory), "--json")
    verdicts = [r["verdict"] for r in json.loads(listed.out)["results"]]
    assert len(verdicts) == 4 and "pass" not in verdicts


def test_status_counts_only_engines_that_generate(inventory: Path, report: Any) -> None:
    """No router: "answering" means a one-token generation came back, not a 200 on /health
    (the non-JSON and endless engines answer /health; the wedged one forwards it)."""
    started = time.monotonic()
    run = kdctl("status", "-i", str(inventory), "--json", "--timeout", "2")
    took = time.monotonic() - started
    assert run.out, run.err
    serving = json.loads(run.out)["answers"]["serving"]
    by_name = {e["name"]: e for e in serving["engines"]}
    assert by_name["baseline"]["generated"] is True
    assert serving["backend"] == "baseline" and serving["state"] == "serving"
    assert "answering on their own URLs: baseline;" in serving["detail"]
    for name in ("silent", "notjson", "endless", "wedged"):
        assert by_name[name]["generated"] is not True, by_name[name]
        assert f"{name} is " in serving["detail"]
    for name in ("notjson", "wedged"):
        assert f"{name} is up, not generating" in serving["detail"], serving["detail"]
    report(f"status over four misbehaving engines and one healthy: {took:.1f}s (--timeout 2)")
    assert took < 30
