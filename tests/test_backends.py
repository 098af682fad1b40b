"""The sglang, native and openai kinds against the reference server over real HTTP."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from kdctl.backends import GenerateRequest, backend_class, make_backend
from kdctl.backends.errors import (
    BackendAuthError,
    BackendHTTPError,
    BackendNotReady,
    BackendProtocolError,
    BackendTimeout,
    BackendUnavailable,
)
from kdctl.errors import InputError
from kdctl.inventory import BackendSpec
from tests.conftest import FIXTURES, Served, kdctl, need_module, write_inventory
from tests.support.faulty import Bursty, Endless, closing, recorded, replay, serve
from tests.support.nginx import start_nginx, stop_nginx
from tests.support.sshd import free_port

need_module("torch", "reference")


def spec(kind: str, url: str, **extra: object) -> BackendSpec:
    return BackendSpec.model_validate({"kind": kind, "host": "local", "url": url, **extra})


@pytest.fixture(scope="module")
def engine(models: dict[str, Path]):  # type: ignore[no-untyped-def]
    from kdctl.backends.reference.engine import ReferenceEngine

    return ReferenceEngine(models["dsv3"])


GREEDY = GenerateRequest(
    input_ids=[40, 41, 42, 43, 44], max_new_tokens=12, top_logprobs=5, ignore_eos=True
)


# The openai kind's ids and logprobs are held to a real vLLM (tests/test_vllm.py): SGLang's
# OpenAI routes, which the reference server imitates, name tokens by text and return no ids.
@pytest.mark.parametrize("kind", ["sglang", "native"])
def test_greedy_matches_the_in_process_reference(
    kind: str,
    reference_server: Served,
    engine,  # type: ignore[no-untyped-def]
) -> None:
    want = engine.generate(GREEDY)
    with make_backend(kind, spec(kind, reference_server.url)) as be:
        got = be.generate(GREEDY)
    assert got.output_ids == want.output_ids
    assert (got.prompt_tokens, got.completion_tokens) == (5, 12)
    assert got.finish_reason == "length"
    assert len(got.logprobs) == 12
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        assert a.token_id == b.token_id
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert len(a.top) == 5


@pytest.mark.parametrize("kind", ["sglang", "openai"])
def test_text_prompt_stop_and_seed(kind: str, reference_server: Served) -> None:
    with make_backend(kind, spec(kind, reference_server.url)) as be:
        base = be.generate(
            GenerateRequest(text="def __init__(self", max_new_tokens=16, ignore_eos=True)
        )
        assert base.text and base.prompt_tokens > 0
        stop = base.text[4:6]
        stopped = be.generate(
            GenerateRequest(text="def __init__(self", max_new_tokens=16, stop=[stop])
        )
        assert stopped.finish_reason == "stop" and stop not in stopped.text
        sampled = [
            be.generate(
                GenerateRequest(
                    text="import ", max_new_tokens=10, temperature=1.0, seed=s, ignore_eos=True
                )
            ).text
            for s in (7, 7, 8)
        ]
        assert sampled[0] == sampled[1] != sampled[2]


@pytest.mark.parametrize("kind", ["sglang", "openai"])
def test_streaming_matches_and_is_timed(kind: str, reference_server: Served) -> None:
    plain = GREEDY.model_copy(update={"top_logprobs": 0})
    with make_backend(kind, spec(kind, reference_server.url)) as be:
        whole = be.generate(plain)
        chunks = list(be.stream(plain))
    ids = [i for c in chunks for i in c.output_ids]
    assert ids == whole.output_ids
    assert "".join(c.text for c in chunks) == whole.text and whole.text
    stamps = [c.received_at for c in chunks]
    assert stamps == sorted(stamps)
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["length"]
    assert chunks[-1].completion_tokens == 12  # sglang: running count; openai: the usage chunk
    if kind == "sglang":
        assert len([c for c in chunks if c.output_ids]) == 12
    else:
        # SGLang's OpenAI routes return no ids: the tokens are counted from its usage.
        assert ids == [] and whole.completion_tokens == 12


def test_info_and_metrics(reference_server: Served, models: dict[str, Path]) -> None:
    with make_backend("sglang", spec("sglang", reference_server.url)) as be:
        info = be.info()
        assert info.model == str(models["dsv3"])
        assert info.version and info.version.startswith("kdctl-reference")
        assert info.tp_size == 1 and info.context_length == 2048
        before = be.metrics()["sglang:generation_tokens"].samples[0].value
        be.generate(GenerateRequest(input_ids=[5], max_new_tokens=3, ignore_eos=True))
        after = be.metrics()["sglang:generation_tokens"]
        assert after.samples[0].value == before + 3
        assert after.samples[0].labels["model_name"] == models["dsv3"].name
        assert be.health().state == "up"
    with make_backend("openai", spec("openai", reference_server.url)) as be:
        oi = be.info()
        assert oi.served_name == models["dsv3"].name and oi.context_length == 2048


def test_api_key(keyed_server: Served) -> None:
    url = keyed_server.url
    good = make_backend(
        "sglang", spec("sglang", url), api_key=SecretStr(keyed_server.api_key or "")
    )
    assert good.generate(GenerateRequest(input_ids=[3], max_new_tokens=2)).completion_tokens == 2
    for kind in ("sglang", "openai"):
        bad = make_backend(kind, spec(kind, url), api_key=SecretStr("sk-wrong"))
        with pytest.raises(BackendAuthError, match="authentication failed") as exc:
            bad.generate(GenerateRequest(input_ids=[3], max_new_tokens=2))
        assert "sk-wrong" not in str(exc.value) and url in str(exc.value)
        assert bad.health().state == "up"  # /health is exempt from the key, as in SGLang


def test_bad_request_is_typed(reference_server: Served) -> None:
    with make_backend("sglang", spec("sglang", reference_server.url)) as be:
        with pytest.raises(BackendHTTPError) as exc:
            be.generate(GenerateRequest(input_ids=[999_999], max_new_tokens=2))
        assert exc.value.status == 400 and "input_ids" in str(exc.value)


def test_starting_server_is_not_ready_not_down(models: dict[str, Path]) -> None:
    import uvicorn

    from kdctl.backends.reference.server import create_app

    port = free_port()
    app = create_app(models["dsv3"], load_delay_s=4)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.02)
        with make_backend("sglang", spec("sglang", f"http://127.0.0.1:{port}")) as be:
            assert be.health().state == "starting"
            with pytest.raises(BackendNotReady, match="not ready yet"):
                be.generate(GenerateRequest(input_ids=[1], max_new_tokens=1))
            deadline = time.monotonic() + 60
            while be.health().state != "up" and time.monotonic() < deadline:
                time.sleep(0.2)
            assert (
                be.generate(GenerateRequest(input_ids=[1], max_new_tokens=1)).completion_tokens == 1
            )
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory, need_nginx: str) -> Iterator[str]:
    """A real nginx answering like a broken engine: 500s, bad JSON, a stream cut short."""
    port = free_port()
    event = '{\\"text\\": \\"a\\", \\"output_ids\\": [1], \\"meta_info\\": {}}'
    servers = f"""
  server {{
    listen 127.0.0.1:{port};
    location = /err/generate {{ return 500 "internal error"; }}
    location = /bad/generate {{ default_type application/json; return 200 "{{not json"; }}
    location = /short/generate {{
      default_type text/event-stream;
      return 200 "data: {event}\\n\\n";
    }}
    location = /odd/generate {{ default_type application/json; return 200 "[1, 2]"; }}
  }}
"""
    pid = start_nginx(tmp_path_factory.mktemp("faulty"), servers, [port])
    yield f"http://127.0.0.1:{port}"
    stop_nginx(pid)


def test_faults_are_typed_errors_naming_backend_and_url(faulty: str) -> None:
    req = GenerateRequest(input_ids=[1], max_new_tokens=2)
    cases = [
        ("err", BackendHTTPError, "HTTP 500"),
        ("bad", BackendProtocolError, "not JSON"),
        ("odd", BackendProtocolError, "no meta_info"),
    ]
    for path, error, needle in cases:
        be = make_backend("sglang", spec("sglang", f"{faulty}/{path}"))
        with pytest.raises(error, match=needle) as exc:
            be.generate(req)
        assert f"backend sglang ({faulty}/{path}/generate)" in str(exc.value)
    short = make_backend("sglang", spec("sglang", f"{faulty}/short"))
    with pytest.raises(BackendProtocolError, match=r"ended without \[DONE\]"):
        list(short.stream(req))
    gone = make_backend("sglang", spec("sglang", f"http://127.0.0.1:{free_port()}"))
    with pytest.raises(BackendUnavailable):
        gone.generate(req)


def test_hang_past_the_deadline_times_out() -> None:
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        be = make_backend("sglang", spec("sglang", url), timeout=1.0)
        started = time.monotonic()
        with pytest.raises(BackendTimeout, match="no answer within 1s"):
            be.generate(GenerateRequest(input_ids=[1], max_new_tokens=1))
        with pytest.raises(BackendTimeout):
            list(be.stream(GenerateRequest(input_ids=[1], max_new_tokens=1)))
        assert time.monotonic() - started < 5


def test_registry() -> None:
    assert backend_class("native").kind == "native"
    assert backend_class("reference").kind == "reference"
    with pytest.raises(InputError, match="unknown backend kind 'tgi'"):
        backend_class("tgi")


def test_status_shows_model_version_and_tp(
    reference_server: Served, keyed_server: Served, models: dict[str, Path], tmp_path: Path
) -> None:
    import json

    inv = write_inventory(
        tmp_path / "inv.yaml",
        {
            "hosts": {"local": {"transport": "local"}},
            "backends": {
                "baseline": {"kind": "sglang", "host": "local", "url": reference_server.url},
                "candidate": {
                    "kind": "native",
                    "host": "local",
                    "url": keyed_server.url,
                    "api_key_env": "KDCTL_TEST_CANDIDATE_KEY",
                    "tp_size": 2,
                    "gpus": [0, 1],
                },
            },
        },
    )
    run = kdctl(
        "status", "-i", str(inv), "--json", env={"KDCTL_TEST_CANDIDATE_KEY": "sk-test-7f1e"}
    )
    assert run.code == 0, run.err
    backends = {b["name"]: b for b in json.loads(run.out)["backends"]}
    base, cand = backends["baseline"], backends["candidate"]
    assert (base["state"], base["identity"], base["tp_size"]) == ("up", "live", 1)
    assert base["model"] == str(models["dsv3"]) and base["version"].startswith("kdctl-reference")
    assert base["context_length"] == 2048 and base["latency_ms"] > 0
    # The inventory says TP 2; the engine says 1: the live answer wins and the gap is named.
    assert cand["model"] == str(models["dsv3-int4"]) and cand["tp_size"] == 1
    assert cand["detail"] == "engine reports TP 1, inventory says 2"
    assert "sk-test-7f1e" not in run.out + run.err


def test_sglang_health_generate_and_openai_routes(reference_server: Served) -> None:
    with make_backend("sglang", spec("sglang", reference_server.url)) as be:
        assert be.health(generate=True).state == "up"  # type: ignore[call-arg]
        oa = be.openai()  # type: ignore[attr-defined]
        chat = oa.chat([{"role": "user", "content": "def main():"}], max_tokens=6)
        assert chat.completion_tokens == 6 and chat.prompt_tokens > 0
        assert chat.finish_reason == "length" and chat.first_token_at is not None
        plain = GREEDY.model_copy(update={"top_logprobs": 0})
        completion = oa.generate(plain)
        assert completion.text == be.generate(plain).text and completion.completion_tokens == 12
        # Its top logprobs are named by text, as SGLang's are: no ids to compare.
        with pytest.raises(BackendProtocolError, match="use the sglang kind"):
            oa.generate(GREEDY)


def test_the_health_gate_on_sglangs_openai_routes(reference_server: Served, tmp_path: Path) -> None:
    """The openai kind on SGLang's OpenAI routes gets no token ids back: the one-token health
    check is judged on the server's own count, and passes."""
    inv = write_inventory(
        tmp_path / "inv.yaml",
        {
            "hosts": {"local": {"transport": "local"}},
            "backends": {"v1": {"kind": "openai", "host": "local", "url": reference_server.url}},
            "state_dir": "state",
        },
    )
    run = kdctl("gate", "run", "health", "-b", "v1", "-i", str(inv), "--json")
    (result,) = json.loads(run.out)["results"]
    assert run.code == 0 and result["verdict"] == "pass", result["reasons"]
    assert {m["name"]: m["value"] for m in result["metrics"]}["one_token_completion_tokens"] == 1


def test_concurrent_requests_are_each_correct(reference_server: Served, engine) -> None:  # type: ignore[no-untyped-def]
    from concurrent.futures import ThreadPoolExecutor

    prompts = [[10 + i, 20 + i, 30 + i] for i in range(6)]
    reqs = [GenerateRequest(input_ids=p, max_new_tokens=6, ignore_eos=True) for p in prompts]
    want = [engine.generate(r).output_ids for r in reqs]
    with (
        make_backend("sglang", spec("sglang", reference_server.url)) as be,
        ThreadPoolExecutor(6) as pool,
    ):
        got = list(pool.map(lambda r: be.generate(r).output_ids, reqs))
        streamed = list(pool.map(lambda r: [i for c in be.stream(r) for i in c.output_ids], reqs))
    assert got == want and streamed == want


def test_reference_kind_in_process(models: dict[str, Path], engine) -> None:  # type: ignore[no-untyped-def]
    be = make_backend(
        "oracle",
        BackendSpec.model_validate(
            {"kind": "reference", "host": "local", "model": str(models["dsv3"])}
        ),
    )
    assert be.health().state == "up"
    info = be.info()
    assert info.model == str(models["dsv3"]) and info.context_length == 2048 and info.tp_size == 1
    got = be.generate(GREEDY)
    assert got.output_ids == engine.generate(GREEDY).output_ids
    assert [c.output_ids for c in be.stream(GREEDY)] == [got.output_ids]


def test_backend_kinds_from_entry_points(tmp_path: Path) -> None:
    """A kind another distribution registers is known to the registry and the inventory."""
    import subprocess
    import sys
    import textwrap

    (tmp_path / "kdctl_tgi").mkdir()
    (tmp_path / "kdctl_tgi" / "__init__.py").write_text(
        "from kdctl.backends.openai import OpenAIBackend\n"
        "class TGIBackend(OpenAIBackend):\n    kind = 'tgi'\n"
    )
    dist = tmp_path / "kdctl_tgi-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kdctl-tgi\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[kdctl.backends]\ntgi = kdctl_tgi:TGIBackend\n")
    (tmp_path / "inv.yaml").write_text(
        "hosts: {h: {transport: local}}\nbackends: {t: {kind: tgi, host: h, url: 'http://127.0.0.1:1'}}\n"
    )
    code = textwrap.dedent(
        f"""
        import sys; sys.path.insert(0, {str(tmp_path)!r})
        from pathlib import Path
        from kdctl.backends import backend_class
        from kdctl.inventory import load_inventory, backend_kinds
        assert "tgi" in backend_kinds()
        assert backend_class("tgi").__name__ == "TGIBackend"
        inv = load_inventory(Path({str(tmp_path / "inv.yaml")!r}))
        print(inv.backends["t"].kind)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "tgi"


def test_a_dropped_stream_leaves_the_engine_serving(models: dict[str, Path], report: Any) -> None:
    """A client that closes a stream after its first event: the next requests are answered,
    and /health tells the truth."""
    import socket

    from tests.conftest import serve_reference

    served = serve_reference(models["dsv3"])
    try:
        host, port = served.url.removeprefix("http://").split(":")
        body = json.dumps(
            {
                "input_ids": [11, 12, 13],
                "sampling_params": {"max_new_tokens": 200, "ignore_eos": True},
                "stream": True,
            }
        ).encode()
        for _ in range(3):
            with socket.create_connection((host, int(port)), timeout=10) as raw:
                raw.sendall(
                    b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                got = b""
                while b"data:" not in got:  # the first event, then hang up
                    chunk = raw.recv(4096)
                    assert chunk, got
                    got += chunk
        started = time.monotonic()
        with make_backend("sglang", spec("sglang", served.url), timeout=20) as be:
            assert be.health().state == "up"
            answer = be.generate(GenerateRequest(input_ids=[11, 12], max_new_tokens=4))
        took = time.monotonic() - started
        report(f"reference server after 3 dropped streams: health and a generation in {took:.2f}s")
        assert answer.completion_tokens == 4 and took < 20
    finally:
        served.proc.terminate()
        served.proc.wait(10)


def test_a_stream_that_never_ends_is_stopped_at_the_deadline(report: Any) -> None:
    """An engine that sends an event every 50 ms and never [DONE]: the stream ends with a typed
    timeout naming the backend, at the session's deadline."""
    server = serve(Endless)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        be = make_backend("sglang", spec("sglang", url), timeout=1.5)
        started = time.monotonic()
        with pytest.raises(BackendTimeout, match=r"did not end within 1\.5s") as exc:
            list(be.stream(GenerateRequest(input_ids=[1], max_new_tokens=1)))
        took = time.monotonic() - started
        assert f"backend sglang ({url}/generate)" in str(exc.value)
        report(f"endless stream: typed timeout after {took:.2f}s (deadline 1.5s)")
        assert took < 4
    finally:
        server.shutdown()


def _events(*events: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + (
        b"data: [DONE]\n\n"
    )


@pytest.mark.parametrize("incremental", [True, False])
def test_streamed_text_is_read_as_the_servers_arguments_say(incremental: bool) -> None:
    """Blank lines first: with --incremental-streaming-output the second delta "\n" repeats
    all the text so far, which a reader guessing from prefixes takes for cumulative text. The
    server's own `incremental_streaming_output` argument decides; both modes give the same."""
    deltas = ["\n", "\n", "x"]
    texts = deltas if incremental else ["\n", "\n\n", "\n\nx"]
    events = [
        {
            "text": t,
            "output_ids": [10 + i],
            "meta_info": {
                "prompt_tokens": 2,
                "completion_tokens": i + 1,
                "finish_reason": {"type": "length", "length": 3} if i == 2 else None,
            },
        }
        for i, t in enumerate(texts)
    ]
    info = json.dumps({"incremental_streaming_output": incremental}).encode()
    server = serve(
        replay(
            {
                ("GET", "/server_info"): (200, info, "application/json"),
                ("POST", "/generate"): (200, _events(*events), "text/event-stream"),
            }
        )
    )
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        with make_backend("s", BackendSpec(kind="sglang", host="local", url=url)) as be:
            chunks = list(be.stream(GenerateRequest(input_ids=[1, 2], max_new_tokens=3)))
    finally:
        server.shutdown()
    assert "".join(c.text for c in chunks) == "\n\nx"
    assert [i for c in chunks for i in c.output_ids] == [10, 11, 12]


def test_a_front_to_several_engines_reads_each_stream_by_its_own_shape() -> None:
    """Through a canary's front, the server info that answers may be the other engine's: one
    that streams deltas, while this stream (a newer SGLang) is cumulative. Read by that word
    the text would double; a backend told its URL reaches several engines reads each stream
    by its shape."""
    events = [
        {
            "text": "abc"[: i + 1],
            "output_ids": [10, 11, 12][: i + 1],
            "meta_info": {
                "prompt_tokens": 2,
                "completion_tokens": i + 1,
                "finish_reason": {"type": "length", "length": 3} if i == 2 else None,
            },
        }
        for i in range(3)
    ]
    info = json.dumps({"incremental_streaming_output": True}).encode()
    server = serve(
        replay(
            {
                ("GET", "/server_info"): (200, info, "application/json"),
                ("POST", "/generate"): (200, _events(*events), "text/event-stream"),
            }
        )
    )
    texts = {}
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        for one in (True, False):
            with make_backend("front", BackendSpec(kind="sglang", host="local", url=url)) as be:
                be.one_engine = one  # type: ignore[attr-defined]
                chunks = list(be.stream(GenerateRequest(input_ids=[1, 2], max_new_tokens=3)))
            texts[one] = "".join(c.text for c in chunks)
            assert [i for c in chunks for i in c.output_ids] == [10, 11, 12]
    finally:
        server.shutdown()
    assert texts == {True: "aababc", False: "abc"}


def test_an_event_of_several_tokens_spreads_its_gap_over_them() -> None:
    """Three tokens to an event, 60 ms apart: nine inter-token gaps of about 20 ms (the first
    event's tokens are the TTFT), as SGLang's bench_serving counts them, not three of 60."""
    from kdctl.backends import HttpBackend
    from kdctl.loadgen import LoadPlan, run_load

    server = serve(Bursty)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        be = make_backend("bursty", BackendSpec(kind="sglang", host="local", url=url))
        assert isinstance(be, HttpBackend)
        req = GenerateRequest(input_ids=[1, 2, 3, 4], max_new_tokens=12, ignore_eos=True)
        m = run_load(be, [req], LoadPlan(max_concurrency=1, timeout_s=10))
        be.close()
    finally:
        server.shutdown()
    assert (m.completed, m.failed, m.total_output_tokens) == (1, 0, 12)
    assert m.itl_ms.p50 is not None and 12 < m.itl_ms.p50 < 40, m.itl_ms
    assert m.tpot_ms.mean is not None and 12 < m.tpot_ms.mean < 40
    # Its verification steps, reported on the last event, give the accept length.
    assert m.spec_accept_length == 3.0

    # Judged on random token ids, a speculative decoder's speed is inconclusive, whatever
    # the figures; on a text corpus, the figures decide.
    from kdctl.checks.throughput import judge
    from kdctl.inventory.models import ThroughputSettings

    settings = ThroughputSettings(slo_ttft_ms=60_000)
    metrics, reasons, verdict = judge(settings, [m], None, backend="bursty", random_ids=True)
    assert verdict == "inconclusive" and "bursty decode speculatively" in reasons[0]
    assert any(x.name == "c1.spec_accept_length" and x.value == 3.0 for x in metrics)
    assert judge(settings, [m], None, backend="bursty", random_ids=False)[2] == "pass"


def test_every_sglang_error_body_shape_gives_its_message() -> None:
    """The error bodies SGLang's source shows across versions (tests/fixtures/sglang), each
    read down to its message, never shown as raw JSON."""
    from kdctl.backends._http import error_message

    shapes = json.loads((FIXTURES / "sglang" / "error-bodies.json").read_text())
    assert len(shapes) == 5
    for shape in shapes:
        assert error_message(json.dumps(shape["body"])) == shape["message"], shape["versions"]
    assert error_message("<html>502</html>") == "<html>502</html>"


def test_the_openai_kind_on_text_keyed_logprobs_says_so() -> None:
    """SGLang's OpenAI routes name logprob tokens by text (recorded shape): the openai kind
    cannot compare ids from them, and says which kind to use instead of a bare parse error."""
    body = json.loads((FIXTURES / "sglang" / "completions-text-logprobs.json").read_text())
    server = serve(recorded(body))
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        spec = BackendSpec(kind="openai", host="local", url=url)
        req = GenerateRequest(input_ids=[1, 2, 3], max_new_tokens=2, top_logprobs=2)
        with make_backend("sglang-v1", spec) as be, pytest.raises(BackendProtocolError) as got:
            be.generate(req)
        assert "name tokens by text (' the')" in str(got.value)
        assert "use the sglang kind" in str(got.value)
    finally:
        server.shutdown()


def test_a_request_dropped_unanswered_is_sent_once_more_and_twice_is_reported() -> None:
    """SGLang and vLLM close a connection idle for 5 s, and httpx keeps one as long: a request
    sent on it as the server closes it is dropped unanswered (a probe polling every few seconds
    meets it). kdctl sends it once more on a new connection; dropped again, it is the engine's
    failure, reported typed, after exactly two tries."""
    import httpx

    body = json.loads((FIXTURES / "sglang" / "generate" / "0.5.23.json").read_text())["answer"]
    req = GenerateRequest(input_ids=[1, 2, 3], max_new_tokens=4)
    kept = closing(recorded(body), answered=1)
    server = serve(kept)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        # What a plain client meets: the second request on the kept connection fails.
        with httpx.Client() as plain:
            assert plain.post(url + "/generate", json={}).status_code == 200
            with pytest.raises(httpx.RemoteProtocolError, match="without sending a response"):
                plain.post(url + "/generate", json={})
        before = kept.dropped
        with make_backend("sglang", spec("sglang", url)) as be:
            answers = [be.generate(req) for _ in range(3)]
        assert [a.output_ids for a in answers] == [body["output_ids"]] * 3
        assert (
            kept.dropped - before == 2
        )  # the second and third each met a close, and were sent again
    finally:
        server.shutdown()
        server.server_close()

    never = closing(recorded(body), answered=0)
    server = serve(never)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with (
            make_backend("sglang", spec("sglang", url)) as be,
            pytest.raises(BackendProtocolError) as got,
        ):
            be.generate(req)
        assert f"backend sglang ({url}/generate)" in str(got.value)
        assert "without sending a response" in str(got.value)
        assert never.dropped == 2
    finally:
        server.shutdown()
        server.server_close()


def test_status_says_an_engine_was_heard_on_its_health_only(
    keyed_server: Served, tmp_path: Path
) -> None:
    """No router, and an engine whose generation wants a key kdctl was not given: its
    health answers, so it is listed as answering, and the line says it was heard on its
    health alone, never as if it had generated."""
    from tests.conftest import kdctl, write_inventory

    inv = write_inventory(
        tmp_path / "inv.yaml",
        {
            "hosts": {"local": {"transport": "local"}},
            "backends": {"keyed": {"kind": "sglang", "host": "local", "url": keyed_server.url}},
            "state_dir": "state",
        },
    )
    serving = json.loads(kdctl("status", "-i", str(inv), "--json").out)["answers"]["serving"]
    (engine,) = serving["engines"]
    assert (engine["state"], engine["generated"]) == ("up", None), engine
    assert (
        "answering on their own URLs: keyed (health only: health answers; generation "
        in (serving["detail"])
    ), serving["detail"]
