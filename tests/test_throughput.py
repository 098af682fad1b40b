"""The throughput gate and its load generator, against live reference servers."""

from __future__ import annotations

import json
import socketserver
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import SecretStr

from kdctl.backends import GenerateRequest, HttpBackend, make_backend
from kdctl.inventory import BackendSpec
from kdctl.loadgen import (
    LineSplitter,
    LoadPlan,
    arrival_offsets,
    histogram_quantile,
    percentile,
    run_load,
)
from tests.conftest import Served, engine_pair, kdctl, need_module, write_inventory
from tests.support.faulty import miscounting, serve

need_module("torch", "reference")
OUTPUT_LEN = 6
PROMPTS = 8


@pytest.fixture
def inventory(tmp_path: Path, reference_server: Served, twin_server: Served):  # type: ignore[no-untyped-def]
    def make(**throughput: Any) -> Path:
        return write_inventory(
            tmp_path / "inventory.yaml",
            {
                "hosts": {"local": {"transport": "local"}},
                "backends": {
                    **engine_pair(reference_server.url, twin_server.url),
                    "down": {"kind": "sglang", "host": "local", "url": "http://127.0.0.1:9"},
                },
                "gates": {
                    "throughput": {
                        "workload": {
                            "input_len": 24,
                            "output_len": OUTPUT_LEN,
                            "concurrency": [1, 4],
                            "num_prompts": PROMPTS,
                        },
                        **throughput,
                    }
                },
                "state_dir": "state",
            },
        )

    return make


def gate(inv: Path, backend: str, *extra: str) -> tuple[int, dict[str, Any]]:
    run = kdctl("gate", "run", "throughput", "-b", backend, *extra, "-i", str(inv), "--json")
    assert run.out, run.err
    (result,) = json.loads(run.out)["results"]
    return run.code, result


def test_candidate_against_the_recorded_baseline_run(inventory: Any, report: Any) -> None:
    # Both engines serve the same model, so the ratio is the machine's: here the candidate is
    # measured minutes after the baseline's recorded run, and a loaded two-core machine has
    # moved one side 4.8x between them. What is held is the comparison, not the bar.
    inv = inventory(min_ratio=0.05, slo_ttft_ms=60_000)
    rec = kdctl("baseline", "record", "-b", "baseline", "--only", "throughput", "-i", str(inv))
    assert rec.code == 0, rec.err
    assert "recorded throughput baseline" in rec.out and "concurrency 4:" in rec.out

    code, result = gate(inv, "candidate", "--baseline", "baseline")
    assert code == 0 and result["verdict"] == "pass", result["reasons"]
    assert "run recorded" in result["reasons"][0]
    metrics = {m["name"]: m for m in result["metrics"]}
    for c in ("c1", "c4"):
        assert metrics[f"{c}.ratio"]["threshold"] == 0.05 and metrics[f"{c}.ratio"]["value"] > 0
        assert metrics[f"{c}.p99_ttft_ms"]["threshold"] == 60_000
    for point in result["details"]["points"]:
        # Every request asked for OUTPUT_LEN tokens with ignore_eos, and the server's usage and
        # the streamed chunks agree on how many came.
        assert point["completed"] == PROMPTS and point["failed"] == 0
        assert point["total_output_tokens"] == PROMPTS * OUTPUT_LEN
        assert point["token_count_mismatches"] == 0 and point["short_outputs"] == 0
        assert point["client"] == "aiohttp"
        assert 0 < point["ttft_ms"]["p50"] <= point["e2el_ms"]["p50"]
        assert point["itl_ms"]["p50"] > 0 and point["tpot_ms"]["mean"] > 0
        assert point["request_goodput"] == pytest.approx(point["request_throughput"])
    c1, c4 = result["details"]["points"]
    # Concurrency 4 over 1, shown for a roadmap to hold: the reference server generates one
    # request at a time, so serving four together pays it little.
    scaling = metrics["scaling"]
    assert scaling["value"] == pytest.approx(
        c4["output_throughput"] / c1["output_throughput"], rel=1e-2
    )
    assert scaling["threshold"] is None and scaling["unit"] == "x"
    assert any(r.startswith("scaling: concurrency 4 delivers") for r in result["reasons"])
    report(
        f"throughput on the reference server (CPU): {c1['output_throughput']:.0f} tok/s at "
        f"concurrency 1, {c4['output_throughput']:.0f} at 4 (scaling {scaling['value']:.2f}x); "
        f"ratios {metrics['c1.ratio']['value']:.2f}, {metrics['c4.ratio']['value']:.2f}"
    )


def test_a_run_recorded_on_another_checkpoint_is_not_the_baseline_now(
    inventory: Any, keyed_server: Served, reference_server: Served
) -> None:
    """The baseline's run is recorded, then the baseline is redeployed on another checkpoint
    (INT4, the same model name): the recorded run measured something else, so the baseline is
    measured now, and the result is bound to what it was compared against."""
    import yaml

    inv = inventory(min_ratio=0.05)
    rec = kdctl("baseline", "record", "-b", "baseline", "--only", "throughput", "-i", str(inv))
    assert rec.code == 0, rec.err
    data = yaml.safe_load(inv.read_text())
    data["backends"]["baseline"].update(url=keyed_server.url, api_key_env="KDCTL_TEST_INT4_KEY")
    write_inventory(inv, data)
    env = {"KDCTL_TEST_INT4_KEY": keyed_server.api_key or ""}
    run = kdctl(
        "gate", "run", "throughput", "-b", "candidate", "--baseline", "baseline",
        "-i", str(inv), "--json", env=env,
    )  # fmt: skip
    (result,) = json.loads(run.out)["results"]
    assert "baseline measured now" in result["reasons"][0], result["reasons"]
    assert "no recorded run of this workload matches what it serves now" in result["reasons"][0]
    from kdctl.evidence import open_store
    from kdctl.inventory import load_inventory

    with open_store(load_inventory(inv)) as store:
        recorded = store.baselines(backend="baseline", kind="throughput")
        latest = store.latest("throughput", "candidate")
    assert latest is not None and latest.provenance.baseline_weights is not None
    assert recorded and all(
        b.provenance.weights not in (None, latest.provenance.baseline_weights) for b in recorded
    )

    def listed() -> dict[str, Any]:
        status = kdctl("status", "-i", str(inv), "--json", env=env)
        (got,) = [
            v
            for v in json.loads(status.out)["gates"]
            if (v["backend"], v["gate"]) == ("candidate", "throughput")
        ]
        return got

    assert listed()["fresh"] is True
    # The baseline goes back to the first checkpoint: the verdict, measured against the INT4
    # one, no longer describes what would be compared.
    data["backends"]["baseline"] = {"kind": "sglang", "host": "local", "url": reference_server.url}
    write_inventory(inv, data)
    stale = listed()
    assert stale["fresh"] is False and "baseline_weights" in stale["freshness"], stale


def test_a_broken_slo_fails_and_says_which(inventory: Any) -> None:
    inv = inventory(slo_ttft_ms=0.001, slo_percentile="p50")
    code, result = gate(inv, "candidate")
    assert code == 1 and result["verdict"] == "fail"
    # Which SLO broke: each concurrency's p50 TTFT, above its threshold.
    ttft = [m for m in result["metrics"] if m["name"].endswith(".p50_ttft_ms")]
    assert [m["name"] for m in ttft] == ["c1.p50_ttft_ms", "c4.p50_ttft_ms"], ttft
    assert all(m["threshold"] == 0.001 and m["value"] > 0.001 for m in ttft), ttft
    assert any("p50 TTFT" in r and "breaks the SLO of 0.001 ms" in r for r in result["reasons"])


def test_nothing_to_compare_with_is_inconclusive_not_pass(inventory: Any) -> None:
    code, result = gate(inventory(), "candidate")
    assert code == 1 and result["verdict"] == "inconclusive"
    # No baseline, no SLO: no ratio, and no figure with a threshold but the failures allowed.
    assert result["baseline"] is None and result["metrics"], result
    judged = {m["name"] for m in result["metrics"] if m["threshold"] is not None}
    assert judged == {"c1.failed", "c4.failed"}, result["metrics"]


def test_a_live_baseline_when_none_is_recorded_and_a_down_candidate(inventory: Any) -> None:
    # One run a side of the same model: the ratio is the machine's moment (0.22 seen on two
    # loaded cores), so the bar only holds the comparison, which is checked figure by figure.
    inv = inventory(min_ratio=0.05)
    code, result = gate(inv, "candidate", "--baseline", "baseline")
    assert code == 0 and "baseline measured now, taking turns" in result["reasons"][0]
    metrics = {m["name"]: m["value"] for m in result["metrics"]}
    for at, c in enumerate((1, 4)):
        ours = result["details"]["points"][at]["output_throughput"]
        theirs = result["details"]["baseline_points"][at]["output_throughput"]
        assert metrics[f"c{c}.ratio"] == pytest.approx(ours / theirs, abs=5e-5)
    code, result = gate(inv, "down", "--baseline", "baseline")
    assert code == 3 and result["verdict"] == "error"
    assert "connection refused" in result["reasons"][0]


def test_interleaved_repeats_measure_both_engines_side_by_side(inventory: Any) -> None:
    """baseline_run: interleaved measures the baseline now, though a run of it is recorded, the
    two engines taking turns run by run; with repeats, each one's median run is judged."""
    from kdctl.evidence import open_store
    from kdctl.inventory import load_inventory
    from kdctl.recording import run_gates

    inv = inventory(min_ratio=0.05, repeats=3, baseline_run="recorded")
    rec = kdctl("baseline", "record", "-b", "baseline", "--only", "throughput", "-i", str(inv))
    assert rec.code == 0, rec.err
    code, result = gate(inv, "candidate", "--baseline", "baseline")
    assert code == 0 and "run recorded" in result["reasons"][0], result["reasons"]
    assert "median of" not in result["reasons"][0]
    code, result = gate(inventory(min_ratio=0.05), "candidate", "--baseline", "baseline")
    assert code == 0, result["reasons"]
    assert "the median of 3 runs per concurrency where this one takes 1" in result["reasons"][0]

    inv = inventory(min_ratio=0.05, repeats=3, baseline_run="interleaved")
    loaded = load_inventory(inv)
    started: list[str] = []

    def progress(what: str, done: int, total: int) -> None:
        if done == 0:
            started.append(what)

    with open_store(loaded) as store:
        (res,) = run_gates(loaded, store, "throughput", "candidate", "baseline", progress=progress)
    assert res.verdict == "pass", res.reasons
    assert "baseline measured now, taking turns" in res.reasons[0]
    assert "baseline_run asks" in res.reasons[0]
    assert started == [
        f"throughput {who} at concurrency {c}, run {r} of 3"
        for c in (1, 4)
        for r in (1, 2, 3)
        for who in ("baseline", "candidate")
    ]
    for at, c in enumerate((1, 4)):
        (line,) = [r for r in res.reasons if r.startswith(f"concurrency {c}: candidate median")]
        assert line.count("median of 3 runs") == 2, line
        figures = [float(f) for f in line.split("(")[1].split(" tok/s")[0].split(", ")]
        median = res.details["points"][at]["output_throughput"]
        # The run judged is one that was measured, the middle one of the three.
        assert sorted(figures)[1] == float(f"{median:.1f}")  # as printed, one decimal
        base = res.details["baseline_points"][at]["output_throughput"]
        ratio = {m.name: m.value for m in res.metrics}[f"c{c}.ratio"]
        assert ratio == pytest.approx(median / base, abs=5e-5)


def test_a_run_whose_every_request_failed_fails_whatever_the_allowance(inventory: Any) -> None:
    """Token ids beyond the model's vocabulary: the engine refuses every request, so no TTFT
    was measured and the SLO on it is neither met nor broken. An allowance of failures as large
    as the run does not make a run without one success a pass."""
    workload = {"input_len": 24, "output_len": OUTPUT_LEN, "concurrency": [1, 4]}
    inv = inventory(
        workload={**workload, "num_prompts": PROMPTS, "token_range": [5000, 5001]},
        slo_ttft_ms=60_000,
        max_failed_requests=1000,
    )
    code, result = gate(inv, "candidate")
    assert code == 1 and result["verdict"] == "fail", result["reasons"]
    points = result["details"]["points"]
    assert [(p["completed"], p["failed"]) for p in points] == [(0, PROMPTS)] * 2, points
    for c in (1, 4):
        assert any(
            r.startswith(
                f"concurrency {c}: {PROMPTS} of {PROMPTS} requests to candidate failed, so nothing"
            )
            # SGLang refuses a streamed request it cannot serve in an error event (HTTP 200).
            and "input_ids must be integers in [0, 2048)" in r
            for r in result["reasons"]
        ), result["reasons"]
    metrics = {m["name"]: m for m in result["metrics"]}
    assert metrics["c1.p99_ttft_ms"]["value"] is None
    assert metrics["c1.p99_ttft_ms"]["threshold"] == 60_000


def test_an_slo_that_could_not_be_measured_is_inconclusive(inventory: Any) -> None:
    """One output token a request: every request succeeds, but there is no gap between tokens,
    so an ITL SLO has nothing to judge, and the gate does not pass on it."""
    inv = inventory(
        workload={"input_len": 24, "output_len": 1, "concurrency": [2], "num_prompts": 4},
        slo_itl_ms=60_000,
    )
    code, result = gate(inv, "candidate")
    assert code == 1 and result["verdict"] == "inconclusive", result["reasons"]
    (point,) = result["details"]["points"]
    assert point["completed"] == 4 and point["failed"] == 0
    itl = {m["name"]: m for m in result["metrics"]}["c2.p99_itl_ms"]
    assert (itl["value"], itl["threshold"]) == (None, 60_000), itl
    assert (
        "concurrency 2: p99 ITL was not measured (no request streamed a second token), so its "
        "SLO of 60000 ms could not be judged"
    ) in result["reasons"]


def test_a_baseline_that_produced_nothing_gives_no_ratio_to_pass(
    inventory: Any, keyed_server: Served
) -> None:
    """The baseline measured live answers every request 401 (its key is not given): there is no
    throughput to divide by. An SLO the candidate meets does not make up for the missing ratio."""
    inv = inventory(min_ratio=0.25, slo_e2el_ms=60_000)
    data = yaml.safe_load(inv.read_text())
    data["backends"]["keyed"] = {"kind": "sglang", "host": "local", "url": keyed_server.url}
    write_inventory(inv, data)
    code, result = gate(inv, "candidate", "--baseline", "keyed")
    assert code == 1 and result["verdict"] == "inconclusive", result["reasons"]
    metrics = {m["name"]: m for m in result["metrics"]}
    for c in (1, 4):
        assert metrics[f"c{c}.ratio"]["value"] is None
        assert metrics[f"c{c}.ratio"]["threshold"] == 0.25
        assert metrics[f"c{c}.p99_e2el_ms"]["value"] > 0
        assert (
            f"concurrency {c}: the baseline produced no tokens ({PROMPTS} of {PROMPTS} requests "
            "failed), so there is no ratio to judge"
        ) in result["reasons"]


@pytest.mark.parametrize("client", ["aiohttp", "httpx"])
def test_refused_requests_are_counted_as_failures(keyed_server: Served, client: str) -> None:
    spec = BackendSpec(kind="sglang", host="local", url=keyed_server.url)
    backend = make_backend("keyed", spec, api_key=SecretStr("sk-wrong"))
    assert isinstance(backend, HttpBackend)
    reqs = [GenerateRequest(input_ids=[5, 6, 7], max_new_tokens=2) for _ in range(3)]
    with backend:
        m = run_load(backend, reqs, LoadPlan(max_concurrency=2, client=client))
    assert (m.completed, m.failed) == (0, 3)
    assert m.errors and m.errors[0].startswith("HTTP 401")
    assert m.output_throughput == 0 and m.ttft_ms.p50 is None


def test_openai_route_and_poisson_arrivals(reference_server: Served) -> None:
    spec = BackendSpec(kind="openai", host="local", url=reference_server.url)
    backend = make_backend("oai", spec)
    assert isinstance(backend, HttpBackend)
    n, rate = 6, 8.0
    reqs = [GenerateRequest(input_ids=[9, 10, 11], max_new_tokens=4, ignore_eos=True)] * n
    with backend:
        m = run_load(backend, reqs, LoadPlan(max_concurrency=n, request_rate=rate, output_len=4))
    assert m.completed == n and m.total_output_tokens == n * 4
    assert m.token_count_mismatches == 0
    # The last request is sent n/rate seconds after the start, so the run cannot be shorter.
    assert m.duration_s >= n / rate


def test_arrival_schedule_lasts_n_over_rate_and_burstiness_spreads_it() -> None:
    assert arrival_offsets(4, None, 1.0, 0) == [0.0] * 4
    for burstiness in (0.3, 1.0, 4.0):
        offsets = arrival_offsets(200, 10.0, burstiness, seed=1)
        assert offsets == sorted(offsets) and offsets[-1] == pytest.approx(20.0)

    def cv(burstiness: float) -> float:
        offs = arrival_offsets(2000, 10.0, burstiness, seed=2)
        gaps = [b - a for a, b in zip([0.0, *offs], offs, strict=False)]
        return statistics.stdev(gaps) / statistics.mean(gaps)

    # A gamma gap's coefficient of variation is 1/sqrt(shape): 1 for Poisson.
    assert cv(0.25) == pytest.approx(2.0, rel=0.15)
    assert cv(1.0) == pytest.approx(1.0, rel=0.1)
    assert cv(4.0) == pytest.approx(0.5, rel=0.1)


def test_percentiles_interpolate_as_numpy_does() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)
    assert percentile([7.0], 99) == 7.0


def test_histogram_quantiles_as_promql_estimates_them() -> None:
    """An engine's TTFT histogram read as PromQL's histogram_quantile reads it, from the text
    prometheus_client exposes (the reference server's own registry type)."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    registry = CollectorRegistry()
    h = Histogram("ttft_seconds", "TTFT", buckets=(0.1, 0.5, 1.0), registry=registry)
    for v in (0.05, 0.07, 0.2, 0.3, 0.4, 0.45, 0.6, 0.7, 0.8, 0.9):
        h.observe(v)
    text = generate_latest(registry).decode()
    buckets = {
        float(s.labels["le"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "ttft_seconds_bucket"
    }
    assert buckets == {0.1: 2, 0.5: 6, 1.0: 10, float("inf"): 10}
    # Rank 5 of 10 falls in (0.1, 0.5], which holds ranks 3 to 6.
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * 3 / 4)
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.5 + 0.5 * 3.9 / 4)
    # A rank in +Inf answers the last finite bound; no observations, no answer.
    assert histogram_quantile(0.9, {0.1: 1, float("inf"): 4}) == 0.1
    assert histogram_quantile(0.5, {0.1: 0, float("inf"): 0}) is None


def test_lines_are_cut_from_reads_whatever_their_boundaries() -> None:
    """The clients hand the runner whole lines, however the socket split the bytes."""
    event = 'data: {"text": "é", "output_ids": [7]}'
    stream = f"{event}\r\n\r\n{event}\n\ndata: [DONE]".encode()
    for size in (1, 2, 5, 64, len(stream)):
        splitter = LineSplitter()
        got = [
            line
            for i in range(0, len(stream), size)
            for line in splitter.feed(stream[i : i + size])
        ]
        # A multi-byte character cut between reads, CRLF or LF endings, blank separators
        # dropped, and a last line without its line end, given when the stream closes.
        assert got + splitter.close() == [event, event, "data: [DONE]"], size


def test_an_event_far_larger_than_a_read_comes_out_whole() -> None:
    """SGLang's cumulative events with logprobs run to megabytes; no line limit applies."""
    big = "data: " + "x" * (5 << 20)
    splitter = LineSplitter()
    data = (big + "\n\n").encode()
    pieces = [splitter.feed(data[i : i + 65536]) for i in range(0, len(data), 65536)]
    assert [line for p in pieces for line in p] == [big]
    assert splitter.close() == []


class _StallingServer(socketserver.ThreadingTCPServer):
    """Answers a streamed completion with one token and then sends nothing more: a hung engine
    (a stuck collective holds every stream open without a byte), which no real engine here can
    be made to do on purpose."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        self.release = threading.Event()

        server = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                while self.rfile.readline() not in (b"\r\n", b""):
                    pass
                event = {"choices": [{"text": "a", "token_ids": [7], "finish_reason": None}]}
                body = f"data: {json.dumps(event)}\n\n".encode()
                self.wfile.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n"
                    + f"{len(body):x}\r\n".encode()
                    + body
                    + b"\r\n"
                )
                self.wfile.flush()
                server.release.wait(30)

        super().__init__(("127.0.0.1", 0), Handler)


@pytest.mark.parametrize("client", ["aiohttp", "httpx"])
def test_a_stream_that_stalls_fails_at_the_request_timeout(client: str) -> None:
    server = _StallingServer()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    spec = BackendSpec(kind="openai", host="local", url=url, served_model_name="m")
    backend = make_backend("hung", spec)
    assert isinstance(backend, HttpBackend)
    reqs = [GenerateRequest(input_ids=[1, 2], max_new_tokens=4)] * 2
    try:
        with backend:
            t0 = time.perf_counter()
            m = run_load(backend, reqs, LoadPlan(max_concurrency=2, client=client, timeout_s=1.0))
            took = time.perf_counter() - t0
    finally:
        server.release.set()
        server.shutdown()
        server.server_close()
    assert (m.completed, m.failed) == (0, 2)
    assert m.errors == ["no answer within 1s"]
    assert took < 10


def test_figures_count_the_tokens_delivered_and_a_short_run_is_not_judged(
    inventory: Any,
) -> None:
    """An engine whose own count is twice the tokens it streams (draft tokens counted as
    output) is measured by what it delivered, and says so; one that stops short of the length
    asked although ignore_eos is set ran another workload: its ratio is not a verdict."""
    over = serve(miscounting(streamed=OUTPUT_LEN, claimed=2 * OUTPUT_LEN))
    short = serve(miscounting(streamed=OUTPUT_LEN // 2, claimed=OUTPUT_LEN // 2))
    try:
        inv = inventory(min_ratio=0.01)
        data = yaml.safe_load(inv.read_text())
        for name, server in (("over", over), ("short", short)):
            url = f"http://127.0.0.1:{server.server_address[1]}"
            data["backends"][name] = {"kind": "sglang", "host": "local", "url": url}
        write_inventory(inv, data)
        code, result = gate(inv, "over", "--baseline", "baseline")
        for p in result["details"]["points"]:
            assert p["total_output_tokens"] == PROMPTS * OUTPUT_LEN, p
            assert p["token_count_mismatches"] == PROMPTS and p["short_outputs"] == 0, p
        assert code == 0 and result["verdict"] == "pass", result["reasons"]
        assert (
            f"concurrency 1: {PROMPTS} of {PROMPTS} streams delivered a number of tokens other "
            "than the server's own count; the figures count the tokens delivered"
        ) in result["reasons"]
        code, result = gate(inv, "short", "--baseline", "baseline")
        assert code == 1 and result["verdict"] == "inconclusive", result["reasons"]
        points = result["details"]["points"]
        assert [p["short_outputs"] for p in points] == [PROMPTS] * 2, points
        assert (
            f"concurrency 4: {PROMPTS} of {PROMPTS} requests to short stopped before the "
            f"{OUTPUT_LEN} output tokens asked (ignore_eos is set), so it ran a shorter workload "
            "than the one judged"
        ) in result["reasons"]
        # Held to a ratio it cannot meet, it is still not judged on other lengths: no fail.
        data["gates"]["throughput"]["min_ratio"] = 100
        write_inventory(inv, data)
        code, result = gate(inv, "short", "--baseline", "baseline")
        assert code == 1 and result["verdict"] == "inconclusive", result["reasons"]
        ratio = {m["name"]: m for m in result["metrics"]}["c4.ratio"]
        assert ratio["value"] > 0 and ratio["threshold"] is None, ratio
        assert any("not judged: the outputs were of other lengths" in r for r in result["reasons"])
    finally:
        for server in (over, short):
            server.shutdown()
            server.server_close()


def test_a_run_recorded_before_the_throughput_window_is_not_the_baseline_now(
    inventory: Any,
) -> None:
    """The same build, checkpoint and host, but a run older than the throughput gate's own
    window: a speed is the machine's too (drivers, clocks), so the baseline is measured now."""
    import yaml

    inv = inventory(min_ratio=0.05)
    rec = kdctl("baseline", "record", "-b", "baseline", "--only", "throughput", "-i", str(inv))
    assert rec.code == 0, rec.err
    data = yaml.safe_load(inv.read_text())
    data["gates"]["freshness"] = {"throughput": "1s"}
    write_inventory(inv, data)
    time.sleep(1.5)
    _, result = gate(inv, "candidate", "--baseline", "baseline")
    assert "baseline measured now" in result["reasons"][0], result["reasons"]
    assert "past the throughput window of 1s" in " ".join(result["reasons"]), result["reasons"]


def test_a_baseline_that_lost_requests_gives_no_ratio_to_judge() -> None:
    """Output tokens a second count the requests served: a baseline measured now that lost
    half its requests (timeouts under load, say) reads at half its speed, and the candidate
    at twice the baseline's. The ratio is shown, not judged, and the run says why."""
    from kdctl.checks.throughput import judge
    from kdctl.inventory.models import ThroughputSettings
    from kdctl.loadgen import BenchMetrics, RequestRecord

    def point(served: int, lost: int) -> BenchMetrics:
        ok = RequestRecord(started_at=0.0, ok=True, output_tokens=8, ttft_s=0.01, e2el_s=0.05)
        failed = RequestRecord(started_at=0.0, error="ReadTimeout")
        return BenchMetrics.of(
            [ok] * served + [failed] * lost,
            1.0,
            max_concurrency=8,
            request_rate=None,
            burstiness=1.0,
            client="aiohttp",
            output_len=8,
            slo=None,
        )

    settings = ThroughputSettings.model_validate(
        {"min_ratio": 1.0, "workload": {"concurrency": [8]}}
    )
    candidate, lossy, whole = point(200, 0), point(100, 100), point(200, 0)
    metrics, reasons, verdict = judge(
        settings, [candidate], [lossy], backend="candidate", random_ids=True
    )
    ratio = {m.name: m for m in metrics}["c8.ratio"]
    assert verdict == "inconclusive" and ratio.value == 2.0 and ratio.threshold is None, reasons
    assert reasons[0] == (
        "concurrency 8: 100 of 200 requests to the baseline failed (ReadTimeout), so its "
        "figure counts only those it served"
    ), reasons
    # The same candidate against a baseline that served every request: judged.
    assert judge(settings, [candidate], [whole], backend="candidate", random_ids=True)[2] == "pass"
