"""The canary's analysis: a probe load through the front for a window, judged against the
inventory's SLOs (error rate, TTFT, ITL), beside the candidate's own view of the window from its
counters (requests served, TTFT from its histogram), as Argo Rollouts' AnalysisRun judges a
step from its metrics."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, model_serializer

from kdctl._httpclient import http_client
from kdctl.backends import EngineCounters, GenerateRequest, HttpBackend, make_backend
from kdctl.backends.health import probe_health
from kdctl.backends.sglang import SGLangBackend
from kdctl.errors import InputError, KdctlError
from kdctl.inventory import LoadedInventory
from kdctl.loadgen import (
    BenchMetrics,
    LoadPlan,
    histogram_quantile,
    past_last_bucket,
    resolution,
    run_load,
)
from kdctl.serving import front_api_key
from kdctl.traffic import Router


class AnalysisFailed(KdctlError):
    """A step's analysis judged the new backend unfit (the smoke gate, the canary's SLO watch):
    a negative verdict, not a broken router, so traffic goes back and the exit is 1."""

    exit_code = 1


class WatchResult(BaseModel):
    """One window of a canary: what the probes through the front measured, the SLOs they
    broke, and the candidate's own view of the window. Recorded (the cutover's outcome, the
    promotion's evidence) under the keys evidence has always had, the percentile in the
    names: `ttft_p99_ms`, `engine_ttft_p99_ms`."""

    percentile: str
    sent: int
    failed: int
    ttft_ms: float | None = None
    itl_ms: float | None = None
    broke: list[str] = []
    # The candidate's own counters over the window; None where they were not read.
    engine_requests: float | None = None
    engine_ttft_ms: float | None = None
    engine_note: str | None = None
    engine_ttft_note: str | None = None

    @model_serializer
    def _recorded(self) -> dict[str, Any]:
        pct = self.percentile
        out: dict[str, Any] = {
            "sent": self.sent,
            "failed": self.failed,
            f"ttft_{pct}_ms": self.ttft_ms,
            f"itl_{pct}_ms": self.itl_ms,
        }
        if self.engine_note is not None:
            out["engine_note"] = self.engine_note
        if self.engine_requests is not None:
            out["engine_requests"] = self.engine_requests
        if self.engine_ttft_ms is not None:
            out[f"engine_ttft_{pct}_ms"] = self.engine_ttft_ms
        if self.engine_ttft_note is not None:
            out["engine_ttft_note"] = self.engine_ttft_note
        if self.broke:
            out["broke"] = self.broke
        return out

    def said(self) -> str:
        pct = self.percentile
        ttft = "not measured" if self.ttft_ms is None else f"{self.ttft_ms:.0f} ms"
        itl = "not measured" if self.itl_ms is None else f"{self.itl_ms:.1f} ms"
        said = (
            f"{self.sent} probe requests, {self.failed} failed, TTFT {pct} {ttft}, ITL {pct} {itl}"
        )
        return said + (f"; {self.engine_note}" if self.engine_note else "")


def watch_front(
    inv: LoadedInventory,
    router: Router,
    to: str,
    seconds: float,
    *,
    also_healthy: Sequence[str] = (),
) -> WatchResult:
    """A probe load through the front for `seconds`: every request must succeed, and TTFT
    and ITL must hold the inventory's SLOs; the candidate `to` (and `also_healthy`) must stay
    healthy. The first window that breaks one ends the watch, its breaches in the result."""
    settings = inv.spec.gates.throughput
    pct = settings.slo_percentile
    # The probes speak the candidate's protocol (SGLang's /generate, the OpenAI API, ...)
    # to the front, as its clients do once it takes their traffic.
    front = inv.backends[to].model_copy(update={"host": router.spec.host, "url": router.front_url})
    # The probes carry the key clients send through the front: the router's own, else the
    # candidate's, which must also open the baseline for clients to survive the cutover.
    key = front_api_key(inv, {to: 100})
    be = make_backend("router-front", front, api_key=key)
    if not isinstance(be, HttpBackend):
        raise InputError(f"{to} is not served over HTTP: no canary to watch")
    if isinstance(be, SGLangBackend):
        be.one_engine = False  # both engines answer through it during a canary
    engine_before = engine_counters(inv, to)
    deadline = time.monotonic() + seconds
    failed = sent = 0
    # None until a window measures one: an unmeasured percentile is not 0 ms.
    worst_ttft: float | None = None
    worst_itl: float | None = None
    try:
        while time.monotonic() < deadline:
            reqs = [
                GenerateRequest(input_ids=[11 + i, 12, 13, 14], max_new_tokens=8, ignore_eos=True)
                for i in range(4)
            ]
            m = run_load(be, reqs, LoadPlan(max_concurrency=2, timeout_s=60))
            sent += m.requests
            failed += m.failed
            worst_ttft = _worst(worst_ttft, getattr(m.ttft_ms, pct))
            worst_itl = _worst(worst_itl, getattr(m.itl_ms, pct))
            broke = _breaches(m, pct, settings.slo_ttft_ms, settings.slo_itl_ms)
            with http_client() as client:
                for name in (to, *also_healthy):
                    url = inv.backends[name].url or ""
                    health = probe_health(client, url, api_key=inv.api_key(name))
                    if health.state != "up":
                        broke.append(f"{name} health {health.state}: {health.detail}")
            if broke:
                return WatchResult(
                    percentile=pct,
                    sent=sent,
                    failed=failed,
                    ttft_ms=worst_ttft,
                    itl_ms=worst_itl,
                    broke=broke,
                )
    finally:
        be.close()
    result = WatchResult(
        percentile=pct, sent=sent, failed=failed, ttft_ms=worst_ttft, itl_ms=worst_itl
    )
    # The candidate's own view of the window: how many requests it served (all traffic,
    # not only the probe's), and their TTFT percentile from its histogram's buckets.
    engine_after = engine_counters(inv, to)
    window = (
        engine_after.minus(engine_before)
        if engine_before is not None and engine_after is not None
        else None
    )
    unknown_share = (
        f"{to}'s metrics gave no request counter kdctl reads: how many of the probes it served "
        "is not known"
    )
    if window is None:
        result.engine_note = unknown_share
        return result
    if window.went_back():
        # Counters only rise: lower ones mean another process (a restart) behind the URL.
        result.engine_note = (
            f"{to}'s counters went back during the window (restarted?): its own view of it was "
            "not read"
        )
        return result
    if window.requests is None:
        result.engine_note = unknown_share
    else:
        result.engine_requests = window.requests
        if window.requests <= 0:
            result.engine_note = (
                f"{to} served no request in the window (its own counter): its share of the "
                "probes was not measured"
            )
    engine_ms, note, breach = engine_ttft(window, pct, settings.slo_ttft_ms)
    if engine_ms is not None:
        result.engine_ttft_ms = round(engine_ms, 2)
    if note:
        result.engine_ttft_note = f"{to}'s {note}"
    if breach:
        result.broke.append(f"{to}'s own {breach}")
    return result


def _worst(so_far: float | None, now: float | None) -> float | None:
    return now if so_far is None else so_far if now is None else max(so_far, now)


def engine_ttft(
    window: EngineCounters, pct: str, slo_ms: float | None
) -> tuple[float | None, str, str]:
    """An engine's TTFT percentile over a window, from its histogram's buckets; a note where
    the buckets are too coarse to judge `slo_ms` (SGLang's start at 0.1 s: every request under
    it counts as up to 100 ms there, so a tighter SLO would breach on every window, and is left
    to the probes, which time each request); and a breach where they judge it broken."""
    seconds_at = histogram_quantile(int(pct[1:]) / 100, window.ttft_buckets)
    if seconds_at is None:
        return None, "", ""
    engine_ms = seconds_at * 1000
    finest = resolution(window.ttft_buckets)
    if past_last_bucket(int(pct[1:]) / 100, window.ttft_buckets):
        # PromQL's estimate is then the last finite bound, a floor: the percentile is over it,
        # by how much the histogram cannot say.
        if slo_ms is not None and engine_ms >= slo_ms:
            return (
                engine_ms,
                "",
                (
                    f"TTFT {pct} over {engine_ms:.0f} ms (past the histogram's last finite bucket) "
                    f"exceeds the SLO of {slo_ms:g} ms"
                ),
            )
        return (
            None,
            f"TTFT histogram puts {pct} past its last finite bucket ({engine_ms:g} ms): "
            "not measured there; judged by the probes",
            "",
        )
    if slo_ms is not None and finest is not None and slo_ms / 1000 < finest:
        return (
            engine_ms,
            f"TTFT histogram cannot judge an SLO of {slo_ms:g} ms: its first bucket ends at "
            f"{finest * 1000:g} ms; judged by the probes",
            "",
        )
    if slo_ms is not None and engine_ms > slo_ms:
        return (
            engine_ms,
            "",
            f"TTFT {pct} {engine_ms:.0f} ms over the window exceeds the SLO of {slo_ms:g} ms",
        )
    return engine_ms, "", ""


def engine_counters(inv: LoadedInventory, name: str) -> EngineCounters | None:
    """The engine's request counter and TTFT histogram, read through its backend; None when
    it exports neither or does not answer."""
    spec = inv.backends[name]
    try:
        with make_backend(name, spec, api_key=inv.api_key(name), timeout=5) as be:
            return be.counters()
    except KdctlError:
        return None


def _breaches(m: BenchMetrics, pct: str, ttft_ms: float | None, itl_ms: float | None) -> list[str]:
    broke = []
    if m.failed:
        errors = "; ".join(m.errors[:2])
        broke.append(f"error rate: {m.failed}/{m.requests} requests failed ({errors})")
    ttft, itl = getattr(m.ttft_ms, pct), getattr(m.itl_ms, pct)
    if ttft_ms is not None and ttft is not None and ttft > ttft_ms:
        broke.append(f"TTFT {pct} {ttft:.0f} ms over the SLO of {ttft_ms:g} ms")
    if itl_ms is not None and itl is not None and itl > itl_ms:
        broke.append(f"ITL {pct} {itl:.1f} ms over the SLO of {itl_ms:g} ms")
    return broke
