"""The first answer, "who serves now", measured through the front door: a real nginx on
loopback with kdctl's own configuration in front of reference servers, and closed ports where
an engine is stopped. In every situation `status`, `phases` and `report` agree, line 1 and
JSON alike, and their exit codes agree with answer 3."""

from __future__ import annotations

import html
import json
import re
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import Served, engine_pair, kdctl, need_module, write_inventory
from tests.support.faulty import replay, serve
from tests.support.nginx import router_entry, start_nginx, stop_nginx
from tests.support.sshd import free_port

need_module("torch", "reference")

WORKLOAD = {"input_len": 8, "output_len": 4, "concurrency": [2], "num_prompts": 8}
ROADMAP = {
    "title": "Serving test",
    "serving": "baseline",
    "candidate": "candidate",
    "speed": "throughput:candidate",
    "phases": [
        {"id": "serving", "title": "Healthy", "criteria": [{"gate": "health"}]},
        {
            "id": "speed",
            "title": "As fast as the baseline",
            "depends_on": ["serving"],
            "criteria": [
                {
                    "gate": "throughput",
                    # Twins of one model: only the machine's load parts them (0.19 seen).
                    "settings": {"workload": WORKLOAD, "min_ratio": 0.05},
                    "require": {"*.ratio": ">= 0.05", "*.failed": "== 0"},
                }
            ],
        },
    ],
}


class Front:
    """An inventory, and nginx running kdctl's configuration for it."""

    def __init__(self, root: Path, nginx: str, urls: dict[str, str], router: bool = True):
        self.root = root
        self.port = free_port()
        self.include = root / "nginx" / "kdctl.conf"
        self.include.parent.mkdir(parents=True)
        (root / "roadmap.yaml").write_text(yaml.safe_dump(ROADMAP, sort_keys=False))
        data: dict[str, Any] = {
            "hosts": {"local": {"transport": "local"}},
            "backends": engine_pair(urls["baseline"], urls["candidate"]),
            "gates": {"throughput": {"workload": WORKLOAD, "min_ratio": 0.05}},
            "roadmap": "roadmap.yaml",
            "state_dir": "state",
        }
        if router:
            data["router"] = router_entry(nginx, self.include.parent, self.port)
        self.inv = write_inventory(root / "inv.yaml", data)
        self.nginx = nginx
        self.pidfile: Path | None = None

    def render(self, weights: dict[str, int]) -> str:
        from kdctl.inventory import load_inventory
        from kdctl.traffic.nginx import NginxRouter
        from kdctl.transports import TransportPool

        inv = load_inventory(self.inv)
        with TransportPool(inv) as pool:
            router = NginxRouter(inv, inv.spec.router, pool.get("local"))  # type: ignore[arg-type]
            return router.render(weights)

    def start(self, weights: dict[str, int]) -> None:
        self.include.write_text(self.render(weights))
        self.pidfile = start_nginx(self.include.parent, f"  include {self.include};", [self.port])

    def reload(self) -> None:
        conf = self.include.parent / "nginx.conf"
        subprocess.run(
            [self.nginx, "-p", str(conf.parent), "-c", str(conf), "-s", "reload"], check=True
        )
        time.sleep(0.5)

    def stop(self) -> None:
        if self.pidfile is not None:
            stop_nginx(self.pidfile)
            self.pidfile = None

    def ask_while_up(self, weights: dict[str, int]) -> dict[str, Any]:
        """nginx started sending `weights`, asked, stopped."""
        self.start(weights)
        try:
            return self.ask()
        finally:
            self.stop()

    def ask(self) -> dict[str, Any]:
        """status, phases and report, each as JSON and as text; they must agree."""
        inv = str(self.inv)
        status = kdctl("status", "-i", inv, "--json", "--timeout", "2")
        status_text = kdctl("status", "-i", inv, "--timeout", "2")
        phases = kdctl("phases", "-i", inv, "--json")
        phases_text = kdctl("phases", "-i", inv)
        report = kdctl("report", "-i", inv, "-o", str(self.root / "report"), "--json")
        assert status.code == 0, status.err
        docs = {
            "status": json.loads(status.out)["answers"],
            "phases": json.loads(phases.out)["answers"],
            "report": json.loads(report.out)["answers"],
            "report.json": json.loads((self.root / "report" / "report.json").read_text())[
                "answers"
            ],
        }
        serving = {k: _stable(d["serving"]) for k, d in docs.items()}
        assert len({json.dumps(v, sort_keys=True) for v in serving.values()}) == 1, serving
        line1 = [_line1(out) for out in (status_text.out, phases_text.out, _md(self.root))]
        # Latency figures differ between runs; the words must not.
        assert len({_words(ln) for ln in line1}) == 1, "\n".join(line1)
        # Exit codes agree with answer 3, whatever the text around it.
        can = docs["phases"]["cutover"]["can_cut_over"]
        assert phases.code == report.code == (0 if can else 1), (phases.code, report.code)
        said = line1[0] + " " + _details(status_text.out)
        return {
            "serving": docs["status"]["serving"],
            "line": line1[0],
            "said": said,
            "cutover": can,
        }


def _stable(serving: dict[str, Any]) -> dict[str, Any]:
    keep = ("state", "answered", "backend", "routed", "speed_optimized")
    return {k: serving[k] for k in keep}


def _line1(text: str) -> str:
    """Answer 1 as printed, unwrapped (a terminal table wraps long lines)."""
    start = text.index("Serving now:")
    end = text.index("2. Phases", start)
    return "1. " + " ".join(text[start:end].split())


def _details(text: str) -> str:
    """What status prints below the three answers of who serves: the probe's whole detail and
    the speed, unwrapped."""
    start = text.index("\nServing: ") + 1
    end = text.index("\nHosts", start)
    return " ".join(text[start:end].split())


def _engines(serving: dict[str, Any]) -> dict[str, tuple[str, int, bool | None]]:
    """Each engine asked on its own URL: its state, routed weight, and whether it generated."""
    return {e["name"]: (e["state"], e["weight"], e["generated"]) for e in serving["engines"]}


def _words(line: str) -> str:
    return re.sub(r"measured [\w ]+ ago", "measured N ago", re.sub(r"\d+ ms", "N ms", line))


def _md(root: Path) -> str:
    # Markdown escapes its punctuation; the words are the same.
    text = re.sub(r"\\(.)", r"\1", (root / "report" / "report.md").read_text())
    return html.unescape(text)


@pytest.fixture
def closed_port() -> str:
    """An engine that is stopped: nothing listens on its port."""
    return f"http://127.0.0.1:{free_port()}"


@pytest.fixture
def silent_engine() -> Iterator[str]:
    """An engine that accepts connections and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(sock.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    stop.set()
    t.join(2)
    for c in held:
        c.close()
    sock.close()


def test_baseline_stopped_router_up_is_nothing(
    tmp_path: Path, need_nginx: str, twin_server: Served, closed_port: str
) -> None:
    front = Front(tmp_path, need_nginx, {"baseline": closed_port, "candidate": twin_server.url})
    got = front.ask_while_up({"baseline": 100})
    s = got["serving"]
    assert (s["state"], s["answered"], s["backend"]) == ("nothing", False, None)
    assert s["routed"]["weights"] == {"baseline": 100}
    assert "intended" in s["routed"]["source"]
    assert s["speed_optimized"] is None
    assert got["line"] == "1. Serving now: nothing (the router on 127.0.0.1:" + str(front.port) + (
        " answered HTTP 502: no engine behind it answered; baseline down)."
    ), got["line"]
    # nginx's 502: the front answered, no engine behind it did.
    assert s["front"]["status_code"] == 502 and s["front"]["failure"] is None, s["front"]
    assert _engines(s) == {"baseline": ("down", 100, None), "candidate": ("up", 0, True)}, s
    assert "baseline (weight 100) is down (connection refused)" in got["said"]
    assert "candidate is up and receives no traffic" in got["said"]


@pytest.fixture
def failing_engine() -> Iterator[str]:
    """An engine whose health route answers 200 and which fails every generation with HTTP
    500, as SGLang does once a CUDA error has poisoned its scheduler."""
    server = serve(
        replay(
            {
                ("GET", "/health"): (200, b"", "text/plain"),
                ("POST", "/generate"): (
                    500,
                    b'{"error": {"message": "CUDA error: an illegal memory access"}}',
                    "application/json",
                ),
            }
        )
    )
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_an_engine_that_fails_every_generation_serves_nothing(
    tmp_path: Path, need_nginx: str, twin_server: Served, failing_engine: str
) -> None:
    """Its health says up; what a client gets is a 500. The health route stands in for
    generation only where generation is not there (404, 405) or kdctl lacks the key."""
    front = Front(tmp_path, need_nginx, {"baseline": failing_engine, "candidate": twin_server.url})
    got = front.ask_while_up({"baseline": 100})
    s = got["serving"]
    assert (s["state"], s["answered"], s["backend"]) == ("nothing", False, None), s
    assert s["front"]["route"] == "/generate" and s["front"]["status_code"] == 500
    assert "answered HTTP 500 to /generate" in got["said"], got["line"]
    # Its health answers; its one-token generation fails.
    assert _engines(s)["baseline"] == ("up", 100, False), s["engines"]
    assert "a one-token generation fails" in got["said"], got["line"]
    assert got["cutover"] is False


def test_a_changed_router_is_confirmed_only_by_an_engines_answer(
    tmp_path: Path, need_nginx: str, twin_server: Served, closed_port: str
) -> None:
    """nginx names the upstream it tried on its 502 too: the read-back of a change to a dead
    engine must not take that 502 for the engine's answer."""
    from kdctl.inventory import load_inventory
    from kdctl.traffic import RouterError
    from kdctl.traffic.nginx import NginxRouter
    from kdctl.transports import TransportPool

    front = Front(tmp_path, need_nginx, {"baseline": twin_server.url, "candidate": closed_port})
    front.start({"candidate": 100})
    try:
        inv = load_inventory(front.inv)
        with TransportPool(inv) as pool:
            router = NginxRouter(inv, inv.spec.router, pool.get("local"))  # type: ignore[arg-type]
            with pytest.raises(RouterError, match="still answers from \\[None"):
                router.confirm({"candidate": 100}, deadline_s=1.0)
            front.include.write_text(front.render({"baseline": 100}))
            front.reload()
            assert router.confirm({"baseline": 100}).weights == {"baseline": 100}
    finally:
        front.stop()


def test_sglang_routers_worker_api_faults_are_router_errors(
    tmp_path: Path, silent_engine: str, closed_port: str
) -> None:
    """SGLang's router refusing connections, or taking them and never answering: each is a
    RouterError naming the router and the call, never an httpx error escaping untyped."""
    from kdctl.inventory import load_inventory
    from kdctl.traffic import RouterError
    from kdctl.traffic.sglang_router import SGLangRouter
    from kdctl.transports import TransportPool

    for url, said in ((closed_port, "ConnectError"), (silent_engine, "ReadTimeout")):
        listen = url.removeprefix("http://")
        inv = write_inventory(
            tmp_path / f"{said}.yaml",
            {
                "hosts": {"local": {"transport": "local"}},
                "backends": engine_pair(closed_port, f"http://127.0.0.1:{free_port()}"),
                "router": {
                    "kind": "sglang-router",
                    "host": "local",
                    "listen": listen,
                    "serving": "baseline",
                },
            },
        )
        loaded = load_inventory(inv)
        with TransportPool(loaded) as pool, pytest.MonkeyPatch.context() as mp:
            mp.setattr(SGLangRouter, "call_timeout_s", 0.5)
            router = SGLangRouter(loaded, loaded.spec.router, pool.get("local"))  # type: ignore[arg-type]
            with pytest.raises(RouterError) as got:
                router.read()
        assert f"sglang-router at {url}: GET /workers: {said}" in str(got.value)


def test_router_stopped_is_nothing_even_with_engines_up(
    tmp_path: Path, need_nginx: str, reference_server: Served, twin_server: Served
) -> None:
    urls = {"baseline": reference_server.url, "candidate": twin_server.url}
    front = Front(tmp_path, need_nginx, urls)
    front.start({"baseline": 100})
    front.stop()  # the configuration file stays, naming baseline at 100
    got = front.ask()
    s = got["serving"]
    assert (s["state"], s["answered"], s["backend"]) == ("nothing", False, None)
    assert s["routed"]["weights"] == {"baseline": 100}
    assert s["front"]["failure"] == "refused", s["front"]
    assert f"The router on 127.0.0.1:{front.port} refuses connections" in got["said"]
    assert "baseline" not in got["said"].split("Serving: ")[1].split(".")[0]


def test_both_stopped_is_nothing(tmp_path: Path, need_nginx: str, closed_port: str) -> None:
    other = f"http://127.0.0.1:{free_port()}"
    front = Front(tmp_path, need_nginx, {"baseline": closed_port, "candidate": other})
    front.start({"baseline": 100})
    front.stop()
    got = front.ask()
    s = got["serving"]
    assert (s["state"], s["answered"]) == ("nothing", False)
    assert s["front"]["failure"] == "refused", s["front"]
    assert _engines(s) == {"baseline": ("down", 100, None), "candidate": ("down", 0, None)}, s
    assert got["cutover"] is False


def test_candidate_up_but_routed_nothing(
    tmp_path: Path, need_nginx: str, reference_server: Served, twin_server: Served
) -> None:
    urls = {"baseline": reference_server.url, "candidate": twin_server.url}
    front = Front(tmp_path, need_nginx, urls)
    got = front.ask_while_up({"baseline": 100})
    s = got["serving"]
    assert (s["state"], s["answered"], s["backend"]) == ("serving", True, "baseline")
    assert s["front"]["route"] == "/generate" and s["front"]["status_code"] == 200
    assert s["speed_optimized"] == "baseline"
    assert got["line"] == (
        f"1. Serving now: baseline through nginx on 127.0.0.1:{front.port}; speed: the baseline."
    )
    assert (
        f"Serving: baseline through nginx on 127.0.0.1:{front.port} (answered /generate in"
        in (got["said"])
    )
    assert _engines(s)["candidate"] == ("up", 0, True), s["engines"]


def test_a_split_says_so_and_judges_the_engine_carrying_most(
    tmp_path: Path, need_nginx: str, reference_server: Served, twin_server: Served
) -> None:
    """A canary at 95/5: the probe's one answer may come from either engine, so line 1 names
    the split, and the speed it judges is that of the engine carrying most of the traffic."""
    urls = {"baseline": reference_server.url, "candidate": twin_server.url}
    front = Front(tmp_path, need_nginx, urls)
    front.start({"baseline": 95, "candidate": 5})
    try:
        run = kdctl("status", "-i", str(front.inv), "--json", "--timeout", "2")
        text = kdctl("status", "-i", str(front.inv), "--timeout", "2").out
    finally:
        front.stop()
    s = json.loads(run.out)["answers"]["serving"]
    assert s["state"] == "serving" and s["backend"] in ("baseline", "candidate")
    assert s["routed"]["weights"] == {"baseline": 95, "candidate": 5}, s["routed"]
    assert "the router splits traffic (baseline 95%, candidate 5%)" in s["detail"]
    assert (s["speed_of"], s["speed_share"], s["speed_optimized"]) == ("baseline", 95, "baseline")
    assert "speed of baseline, 95% of traffic: the baseline" in " ".join(text.split())


def test_hand_edited_config_reports_what_runs(
    tmp_path: Path, need_nginx: str, reference_server: Served, closed_port: str
) -> None:
    """The file names a backend that is down. Not reloaded: the front still answers from the
    old one, and that is what is reported. Reloaded: nothing serves."""
    urls = {"baseline": reference_server.url, "candidate": closed_port}
    front = Front(tmp_path, need_nginx, urls)
    front.start({"baseline": 100})
    try:
        front.include.write_text(front.render({"candidate": 100}))
        written = front.ask()
        front.reload()
        applied = front.ask()
    finally:
        front.stop()
    s = written["serving"]
    assert (s["state"], s["answered"], s["backend"]) == ("serving", True, "baseline")
    assert s["routed"]["weights"] == {"candidate": 100}
    assert "written, not applied" in written["said"]
    s = applied["serving"]
    assert (s["state"], s["answered"], s["backend"]) == ("nothing", False, None)
    assert _engines(s)["candidate"] == ("down", 100, None), s["engines"]


def test_rollback_to_an_engine_that_does_not_answer_is_not_said_done(
    tmp_path: Path, need_nginx: str, twin_server: Served, closed_port: str
) -> None:
    """The router already sends everything back to the baseline (changed by hand), and the
    baseline is down: the rollback has nothing to write, and still does not say "rolled back"
    until the baseline answers through the front; it says what the front does instead."""
    front = Front(tmp_path, need_nginx, {"baseline": closed_port, "candidate": twin_server.url})
    front.start({"baseline": 100})
    inv = str(front.inv)
    try:
        # A cutover in the journal, from the dead baseline to the candidate.
        moved = kdctl(
            "cutover", "--to", "candidate", "--strategy", "blue-green", "--force", "--yes",
            "-i", inv,
        )  # fmt: skip
        assert moved.code == 0, moved.out + moved.err
        from kdctl.inventory import load_inventory
        from kdctl.traffic import RouterError, SqliteJournal
        from kdctl.traffic.nginx import NginxRouter
        from kdctl.transports import TransportPool

        loaded = load_inventory(front.inv)
        with TransportPool(loaded) as pool:
            router = NginxRouter(loaded, loaded.spec.router, pool.get("local"))  # type: ignore[arg-type]
            # Written and applied by hand; the dead baseline cannot confirm it.
            with pytest.raises(RouterError):
                router.apply({"baseline": 100})
        back = kdctl("rollback", "--yes", "-i", inv)
    finally:
        front.stop()
    assert back.code == 3, back.out + back.err
    assert "rolled back" not in back.out
    with SqliteJournal(tmp_path / "state") as journal:
        latest = journal.latest()
    # Nothing to write: the router was not touched, only asked.
    assert latest is not None
    assert not any(s.kind == "rollback-set-weights" for s in latest.steps), latest.steps
    # Not said done: the cutover stands in the journal as it was, not rolled back.
    assert latest.state == "succeeded", latest
    assert "still answers from [None, None, None], not only ['baseline']" in back.err, back.err


def test_no_router_reports_which_engines_answer(
    tmp_path: Path, need_nginx: str, reference_server: Served, closed_port: str
) -> None:
    urls = {"baseline": reference_server.url, "candidate": closed_port}
    front = Front(tmp_path, need_nginx, urls, router=False)
    got = front.ask()
    s = got["serving"]
    assert (s["state"], s["answered"], s["backend"], s["routed"]) == (
        "serving",
        True,
        "baseline",
        None,
    )
    assert "no router in the inventory; answering on their own URLs: baseline" in got["said"]
    assert _engines(s)["candidate"] == ("down", 0, None), s["engines"]


def test_engine_that_never_answers_ends_within_the_deadline(
    tmp_path: Path, need_nginx: str, silent_engine: str, twin_server: Served
) -> None:
    front = Front(tmp_path, need_nginx, {"baseline": silent_engine, "candidate": twin_server.url})
    front.start({"baseline": 100})
    try:
        started = time.monotonic()
        run = kdctl("status", "-i", str(front.inv), "--json", "--timeout", "2")
        elapsed = time.monotonic() - started
    finally:
        front.stop()
    assert run.code == 0, run.err
    s = json.loads(run.out)["answers"]["serving"]
    assert (s["state"], s["answered"]) == ("nothing", False)
    assert s["front"]["failure"] == "timeout", s["front"]
    assert "did not answer within 2s" in s["detail"]
    baseline = next(e for e in s["engines"] if e["name"] == "baseline")
    assert baseline["state"] == "unknown" and "no answer within" in baseline["detail"]
    # Host probes, engine probes and the front each bounded by the deadline: never hung.
    assert elapsed < 15, elapsed


def test_speed_comes_from_the_roadmaps_criterion_only(
    tmp_path: Path, need_nginx: str, reference_server: Served, twin_server: Served
) -> None:
    urls = {"baseline": reference_server.url, "candidate": twin_server.url}
    front = Front(tmp_path, need_nginx, urls)
    inv = str(front.inv)
    front.start({"candidate": 100})
    try:
        recorded = kdctl("baseline", "record", "-b", "baseline", "--only", "throughput", "-i", inv)
        assert recorded.code == 0, recorded.err
        # A throughput pass under another workload: not the criterion's, so not "yes".
        other = dict(WORKLOAD, output_len=2)
        data = yaml.safe_load(front.inv.read_text())
        data["gates"]["throughput"]["workload"] = other
        loose = write_inventory(tmp_path / "loose.yaml", data)
        assert (
            kdctl(
                "baseline", "record", "-b", "baseline", "--only", "throughput", "-i", str(loose)
            ).code
            == 0
        )
        run = kdctl(
            "gate",
            "run",
            "throughput",
            "-b",
            "candidate",
            "--baseline",
            "baseline",
            "-i",
            str(loose),
        )
        assert run.code == 0, run.out + run.err
        unmeasured = front.ask()
        run = kdctl(
            "gate", "run", "throughput", "-b", "candidate", "--baseline", "baseline", "-i", inv
        )
        assert run.code == 0, run.out + run.err
        measured = front.ask()
        # One token a request: its ITL cannot be measured, so the SLO set on it is not judged
        # and the run is inconclusive, while the ratio it shows meets the criterion's bar.
        plan = yaml.safe_load((tmp_path / "roadmap.yaml").read_text())
        (criterion,) = plan["phases"][1]["criteria"]
        criterion["settings"] = {
            "workload": dict(WORKLOAD, output_len=1),
            "min_ratio": 0.05,
            "slo_itl_ms": 60_000,
        }
        # And a cutover phase after it, whose prerequisites answer 3 holds to.
        after = {"id": "cutover", "title": "Cut over", "depends_on": ["speed"]}
        plan["phases"].append({**after, "criteria": [{"name": "soak", "gate": "sign-off"}]})
        (tmp_path / "roadmap.yaml").write_text(yaml.safe_dump(plan, sort_keys=False))
        data = yaml.safe_load(front.inv.read_text())
        data["gates"]["throughput"] = criterion["settings"]
        write_inventory(front.inv, data)
        assert kdctl("baseline", "record", "-b", "baseline", "--only", "throughput",
                     "-i", inv).code == 0  # fmt: skip
        run = kdctl(
            "gate", "run", "throughput", "-b", "candidate", "--baseline", "baseline", "-i", inv,
            "--json",
        )  # fmt: skip
        (result,) = json.loads(run.out)["results"]
        assert result["verdict"] == "inconclusive", result["reasons"]
        ratio = next(m["value"] for m in result["metrics"] if m["name"] == "c2.ratio")
        assert ratio >= 0.05, result["metrics"]
        unjudged = front.ask()
    finally:
        front.stop()
    # The front down, the cutover is not done: the result stands in answer 3 for what it is.
    assert kdctl("gate", "run", "health", "-b", "candidate", "-i", inv).code == 0
    status = json.loads(kdctl("status", "-i", inv, "--json", "--timeout", "2").out)
    blockers = status["answers"]["cutover"]["blockers"]
    # Not a measured "no" beside a ratio that meets its bar: nothing was judged.
    s = unjudged["serving"]
    assert (s["backend"], s["speed_optimized"]) == ("candidate", "unmeasured"), s
    said = unjudged["said"]
    assert "speed: not judged (" in said and "x baseline shown; inconclusive)" in said, said
    speed = next((b for b in blockers if b["criterion"] == "throughput:candidate"), None)
    assert speed is not None, blockers
    assert (speed["kind"], speed["verdict"]) == ("fail", "inconclusive"), speed
    text = " ".join(kdctl("status", "-i", inv, "--timeout", "2").out.split())
    assert "speed/throughput:candidate is inconclusive" in text, text
    s = unmeasured["serving"]
    assert (s["state"], s["backend"], s["speed_optimized"]) == (
        "serving",
        "candidate",
        "unmeasured",
    )
    assert s["speed_criterion"] == "throughput:candidate", s
    assert "unmeasured by throughput:candidate" in unmeasured["said"]
    s = measured["serving"]
    assert (s["backend"], s["speed_optimized"]) == ("candidate", "yes")
    assert s["speed_criterion"] == "throughput:candidate" and s["evidence_id"]
    assert (
        "x baseline on throughput:candidate's workload (needs *.ratio >= 0.05" in measured["said"]
    )


def test_candidate_wedged_or_down_blocks_the_cutover_in_every_answer(
    tmp_path: Path, need_nginx: str, reference_server: Served, twin_server: Served
) -> None:
    """The candidate's evidence passes; then it fails every generation with HTTP 500 while
    its health and info routes answer (SGLang once a CUDA error has poisoned its scheduler);
    then its health route answers 503 (SGLang's answer when its health generation times out)
    while it still describes itself; then it stops. status, phases, report and their exit
    codes say no each time."""
    wedge_port = free_port()
    wedge_root = tmp_path / "wedge"
    poisoned = '{"error": {"message": "CUDA error: an illegal memory access"}}'

    def wedge(fault: str | None) -> str:
        route = {
            None: "",
            "generate": f"location = /generate {{ return 500 '{poisoned}'; }}",
            "health": "location = /health { return 503; }",
        }[fault]
        upstream = twin_server.url.removeprefix("http://")
        return (
            f"  server {{ listen 127.0.0.1:{wedge_port}; {route}\n"
            f"    location / {{ proxy_pass http://{upstream}; }} }}\n"
        )

    def reload(old: str | None, new: str | None) -> None:
        conf = wedge_root / "nginx.conf"
        conf.write_text(conf.read_text().replace(wedge(old), wedge(new)))
        subprocess.run(
            [need_nginx, "-p", str(wedge_root), "-c", str(conf), "-s", "reload"], check=True
        )
        time.sleep(0.5)

    pidfile = start_nginx(wedge_root, wedge(None), [wedge_port])
    urls = {"baseline": reference_server.url, "candidate": f"http://127.0.0.1:{wedge_port}"}
    (tmp_path / "front").mkdir()
    front = Front(tmp_path / "front", need_nginx, urls)
    front.start({"baseline": 100})
    try:
        inv = str(front.inv)
        assert kdctl("gate", "run", "health", "-b", "candidate", "-i", inv).code == 0
        ready = front.ask()
        reload(None, "generate")
        failing = front.ask()
        failing_json = json.loads(kdctl("status", "-i", inv, "--json", "--timeout", "2").out)
        failing_text = kdctl("status", "-i", inv, "--timeout", "2").out
        # Forced past that answer, the cutover's own check through the front generates: the
        # health answering through nginx does not make it done.
        forced = kdctl("cutover", "--to", "candidate", "--strategy", "blue-green", "--force",
                       "--yes", "-i", inv, "--json")  # fmt: skip
        assert forced.code == 1, forced.out + forced.err
        outcome = json.loads(forced.out)
        assert outcome["state"] == "rolled_back", outcome
        assert "no generation from candidate through the front" in outcome["reason"], outcome
        assert outcome["router"]["weights"] == {"baseline": 100}, outcome
        reload("generate", "health")
        wedged = front.ask()
        stop_nginx(pidfile)
        down = front.ask()
    finally:
        stop_nginx(pidfile)
        front.stop()
    assert ready["cutover"] is True
    for got in (failing, wedged, down):
        assert got["cutover"] is False
        assert got["serving"]["backend"] == "baseline"
    # Health up, generation failing: a blocker, and neither its row nor its pool says up.
    (blocker,) = failing_json["answers"]["cutover"]["blockers"]
    assert blocker["kind"] == "not-answering", blocker
    assert blocker["reason"].startswith("candidate is not generating: health answers, but a "
                                        "one-token generation fails"), blocker  # fmt: skip
    assert "CUDA error" in blocker["reason"], blocker
    (row,) = (b for b in failing_json["backends"] if b["name"] == "candidate")
    assert (row["state"], row["generates"]) == ("up", False), row
    assert "CUDA error" in row["detail"], row
    assert {p["name"]: p["up"] for p in failing_json["pools"]}.get("candidate", []) == [], (
        failing_json["pools"]
    )
    assert re.search(r"^│ candidate\s+│[^\n]*? up, not generating\s+│", failing_text, re.M), (
        failing_text
    )
    assert "3. Cut over to candidate now: no; 1 blocker, first: candidate is not generating" in (
        " ".join(failing_text.split())
    ), failing_text
    status = kdctl("status", "-i", str(front.inv), "--json", "--timeout", "2")
    blockers = json.loads(status.out)["answers"]["cutover"]["blockers"]
    # Traffic cannot move to an engine that does not answer: the first blocker.
    assert blockers[0]["kind"] == "not-answering", blockers
    assert blockers[0]["reason"].startswith("candidate is not answering"), blockers


def test_a_split_whose_heavier_engine_has_died_judges_no_speed(
    tmp_path: Path, need_nginx: str, reference_server: Served, twin_server: Served
) -> None:
    """75% of the traffic by weight to a candidate with passing speed evidence, which then
    dies: nginx retries its requests on the baseline, so the weight is not its share, and
    line 1 does not call what serves speed-optimized."""
    proxy_port, proxy_root = free_port(), tmp_path / "candidate"
    upstream = twin_server.url.removeprefix("http://")
    pidfile = start_nginx(
        proxy_root,
        f"  server {{ listen 127.0.0.1:{proxy_port};\n"
        f"    location / {{ proxy_pass http://{upstream}; }} }}\n",
        [proxy_port],
    )
    urls = {"baseline": reference_server.url, "candidate": f"http://127.0.0.1:{proxy_port}"}
    (tmp_path / "front").mkdir()
    front = Front(tmp_path / "front", need_nginx, urls)
    inv = str(front.inv)
    front.start({"baseline": 25, "candidate": 75})
    try:
        recorded = kdctl("baseline", "record", "-b", "baseline", "--only", "throughput", "-i", inv)
        assert recorded.code == 0, recorded.err
        run = kdctl(
            "gate", "run", "throughput", "-b", "candidate", "--baseline", "baseline", "-i", inv
        )
        assert run.code == 0, run.out + run.err

        def serving() -> dict[str, Any]:
            status = kdctl("status", "-i", inv, "--json", "--timeout", "2")
            return json.loads(status.out)["answers"]["serving"]  # type: ignore[no-any-return]

        alive = serving()
        stop_nginx(pidfile)
        s = serving()
    finally:
        stop_nginx(pidfile)
        front.stop()
    assert alive["speed_optimized"] == "yes", alive
    assert (s["speed_of"], s["speed_share"], s["speed_optimized"]) == (
        "candidate",
        75,
        "unmeasured",
    ), s
    assert _engines(s)["candidate"][:2] == ("down", 75), s["engines"]
    assert "candidate, 75% of the traffic by the router's weights, does not generate" in s["speed"]
