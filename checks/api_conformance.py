"""api-conformance: the candidate answers what clients and routers use, as the baseline does.

The expectations are not a fixed list: the probes below are sent to the baseline, live or as
recorded by `kdctl baseline record`, and what it answers (status, content type, the shape of
every JSON body and stream event, how a stream ends) is what the candidate must match. Values
differ between engines and are not compared; keys, types, status codes and framing are. One
value is kept beside them: the KV cache's size each engine's /server_info says, as SGLang's
`max_total_num_tokens`, for a roadmap to hold the candidate's to the baseline's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx

from kdctl._httpclient import http_client
from kdctl.backends import Backend, HttpBackend
from kdctl.backends.errors import BackendError, BackendHTTPError, BackendTimeout
from kdctl.backends.health import bearer
from kdctl.checks._base import Gate, GateContext, provenance_of
from kdctl.errors import InputError, KdctlError
from kdctl.records import Baseline, GateResult, Metric, content_hash, decide, utcnow

MODEL = "{model}"  # replaced by each engine's own served model name


@dataclass(frozen=True)
class Probe:
    name: str
    method: str
    path: str
    body: Any = None
    # Sent as raw bytes instead of JSON, for the malformed-body probe.
    raw: bytes | None = None
    # Asked when `path` answers 404: SGLang before 0.5.6 serves only the /get_* names.
    fallback: str | None = None
    # The only top-level keys compared: /server_info holds every server argument, hundreds
    # that change by release; kdctl reads these.
    keys: tuple[str, ...] | None = None


_GEN = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
_CMPL = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0}
_CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 3,
    "temperature": 0,
}
PROBES = (
    Probe("health", "GET", "/health"),
    Probe("health_generate", "GET", "/health_generate"),
    Probe("models", "GET", "/v1/models"),
    Probe("model_info", "GET", "/model_info", fallback="/get_model_info"),
    Probe(
        "server_info",
        "GET",
        "/server_info",
        fallback="/get_server_info",
        keys=("model_path", "served_model_name", "version", "tp_size", "context_length"),
    ),
    Probe("generate", "POST", "/generate", _GEN),
    Probe("generate_stream", "POST", "/generate", {**_GEN, "stream": True}),
    Probe("completions", "POST", "/v1/completions", _CMPL),
    Probe(
        "completions_stream",
        "POST",
        "/v1/completions",
        {**_CMPL, "stream": True, "stream_options": {"include_usage": True}},
    ),
    Probe("chat", "POST", "/v1/chat/completions", _CHAT),
    Probe(
        "chat_stream",
        "POST",
        "/v1/chat/completions",
        {**_CHAT, "stream": True, "stream_options": {"include_usage": True}},
    ),
    # SGLang ignores a model it does not serve and answers (docs/sglang-compatibility.md).
    Probe("unknown_model", "POST", "/v1/completions", {**_CMPL, "model": "no-such-model"}),
    Probe("error_not_json", "POST", "/generate", raw=b"{not json"),
    Probe("error_unknown_route", "GET", "/no/such/route"),
)


def shape(value: Any) -> Any:
    """A value's structure: dicts by key, lists by their first element, scalars by type."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    if value is None:
        return "null"
    return "str"


def merge(a: Any, b: Any) -> Any:
    """The union of two shapes: stream events differ (the last one carries usage)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: merge(a[k], b[k]) if k in a and k in b else a.get(k, b.get(k)) for k in a | b}
    if isinstance(a, list) and isinstance(b, list):
        return [merge(a[0], b[0])] if a and b else a or b
    if a == "null":
        return b
    return a


def differences(want: Any, got: Any, path: str = "") -> list[str]:
    """What the baseline's shape has and the candidate's lacks. Extra keys are allowed; a null
    on either side matches any type, and a key null in the baseline may be absent."""
    if want == "null" or got == "null":
        return []
    if isinstance(want, dict):
        if not isinstance(got, dict):
            return [f"{path or 'body'}: an object in the baseline, {_kind(got)} here"]
        out = []
        for key, sub in want.items():
            # A key the baseline sent as null is optional: an engine may leave it out.
            if key in got:
                out += differences(sub, got[key], f"{path}.{key}")
            elif sub != "null":
                out.append(f"{path}.{key}".lstrip(".") + ": missing")
        return out
    if isinstance(want, list):
        if not isinstance(got, list):
            return [f"{path}: a list in the baseline, {_kind(got)} here"]
        return differences(want[0], got[0], f"{path}[0]") if want and got else []
    if want != got:
        return [f"{path.lstrip('.')}: {want} in the baseline, {_kind(got)} here"]
    return []


def _kind(s: Any) -> str:
    return "an object" if isinstance(s, dict) else "a list" if isinstance(s, list) else str(s)


def _fill(body: Any, model: str) -> Any:
    if isinstance(body, dict):
        return {k: _fill(v, model) for k, v in body.items()}
    return model if body == MODEL else body


def answer(client: httpx.Client, be: HttpBackend, probe: Probe, model: str) -> dict[str, Any]:
    """One probe's answer, reduced to what conformance compares. A refused connection is an
    answer to compare; an answer that does not end by the backend's deadline ends the gate."""
    got = _answer(client, be, probe, probe.path, model)
    if got.get("status") == 404 and probe.fallback is not None:
        got = _answer(client, be, probe, probe.fallback, model) | {"path": probe.fallback}
    if probe.keys is not None and isinstance(got.get("body"), dict):
        got["body"] = {k: v for k, v in got["body"].items() if k in probe.keys}
    return got


def _answer(
    client: httpx.Client, be: HttpBackend, probe: Probe, path: str, model: str
) -> dict[str, Any]:
    http = be.http
    headers = {**bearer(be.api_key)}
    kwargs: dict[str, Any] = {"headers": headers}
    if probe.raw is not None:
        kwargs["content"] = probe.raw
        headers["content-type"] = "application/json"
    elif probe.body is not None:
        kwargs["json"] = _fill(probe.body, model)
    deadline = http.deadline()
    try:
        with client.stream(probe.method, http.url(path), **kwargs) as resp:
            ctype = resp.headers.get("content-type", "").split(";")[0].strip()
            out: dict[str, Any] = {"status": resp.status_code, "content_type": ctype}
            if ctype == "text/event-stream":
                events: Any = {}
                done = False
                for line in http.lines(resp, path, deadline):
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        done = True
                        continue
                    try:
                        events = merge(events, shape(json.loads(payload)))
                    except json.JSONDecodeError:
                        out["bad_event"] = payload[:80]
                out.update(event=events, ends_with_done=done)
            else:
                content = http.read_body(resp, path, deadline)
                try:
                    out["body"] = shape(json.loads(content)) if content else None
                except (json.JSONDecodeError, UnicodeDecodeError):
                    out["body"] = "not json"
            return out
    except httpx.TimeoutException:
        raise BackendTimeout(
            be.name, http.url(path), f"no answer within {http.timeout:g}s"
        ) from None
    except httpx.HTTPError as exc:
        return {"status": None, "error": f"{type(exc).__name__}: {exc}"}


def _served_model(be: HttpBackend) -> str:
    try:
        return str(be.http.json("GET", "/v1/models")["data"][0]["id"])
    except BackendTimeout:
        raise
    except (BackendError, KeyError, IndexError, TypeError):
        return be.spec.served_model_name or be.spec.model or "default"


def observe(be: Backend) -> dict[str, Any]:
    if not isinstance(be, HttpBackend):
        raise InputError(f"backend {be.name}: api-conformance needs a served HTTP API")
    model = _served_model(be)
    with http_client(timeout=be.http.timeout) as client:
        return {p.name: answer(client, be, p, model) for p in PROBES}


# What SGLang's /server_info says of its KV cache: the tokens its pool holds, sized at each start
# from the memory left after the weights (every captured release has it at the top level).
KV_CAPACITY = "max_total_num_tokens"


def kv_capacity(be: Backend) -> int | None:
    """The tokens the engine's KV cache holds, as its /server_info (or /get_server_info) says;
    None where it does not say, or cannot be asked. A figure the API may lack, not a probe."""
    if not isinstance(be, HttpBackend):
        return None
    for path in ("/server_info", "/get_server_info"):
        try:
            info = be.http.json("GET", path)
        except BackendHTTPError as exc:
            if exc.status == 404:
                continue
            return None
        except KdctlError:
            return None
        value = info.get(KV_CAPACITY) if isinstance(info, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
        return None
    return None


def kv_findings(
    kv: int | None, base_kv: int | None, backend: str, baseline: str
) -> tuple[list[Metric], list[str]]:
    """The candidate's KV capacity beside the baseline's, for a roadmap to hold to (the gate
    judges none of it); nothing where neither engine says its own."""
    if kv is None and base_kv is None:
        return [], []
    ratio = round(kv / base_kv, 4) if kv is not None and base_kv is not None else None
    metrics = [
        Metric(name="kv_capacity_tokens", value=kv, unit="tokens"),
        Metric(name="baseline_kv_capacity_tokens", value=base_kv, unit="tokens"),
        Metric(name="kv_capacity_ratio", value=ratio),
    ]
    if ratio is not None:
        said = f"KV cache: {kv} tokens against {baseline}'s {base_kv} ({ratio:.2f}x)"
    else:
        silent = backend if kv is None else baseline
        said = f"KV cache: {silent} does not say its {KV_CAPACITY} on /server_info, so no ratio"
    return metrics, [said]


def compare(want: dict[str, Any], got: dict[str, Any]) -> dict[str, list[str]]:
    """Per probe, how the candidate's answer departs from the baseline's."""
    found: dict[str, list[str]] = {}
    for name, base in want.items():
        cand = got.get(name, {})
        diffs: list[str] = []
        if base.get("status") is None:
            continue  # the baseline itself did not answer this probe: nothing to hold to
        if cand.get("status") != base["status"]:
            diffs.append(
                f"HTTP {cand.get('status') or cand.get('error')}, baseline {base['status']}"
            )
        elif base["status"] < 400 and cand.get("content_type") != base.get("content_type"):
            diffs.append(
                f"content type {cand.get('content_type')!r}, baseline {base.get('content_type')!r}"
            )
        elif "event" in base:
            diffs += differences(base["event"], cand.get("event", {}), "event")
            if base.get("ends_with_done") and not cand.get("ends_with_done"):
                diffs.append("the stream does not end with data: [DONE]")
        elif base.get("status", 500) < 400:
            diffs += differences(base.get("body"), cand.get("body"))
        if diffs:
            found[name] = diffs
    return found


API_WORKLOAD = content_hash([p.__dict__ for p in PROBES])[:16]


def record_api(ctx: GateContext, backend: str) -> Baseline:
    with ctx.backend(backend) as be:
        info = be.info()
        answers = observe(be)
        kv = kv_capacity(be)
    return Baseline(
        backend=backend,
        kind="api",
        workload_hash=API_WORKLOAD,
        provenance=provenance_of(ctx, backend, info, API_WORKLOAD),
        payload={"answers": answers, "kv_capacity_tokens": kv},
    )


class ApiConformanceGate(Gate):
    name = "api-conformance"
    description = "the routes, fields, streaming format and error codes the baseline serves"
    needs_baseline = True

    def run(self, ctx: GateContext, backend: str, baseline: str | None) -> GateResult:
        started = utcnow()
        if baseline is None:
            raise InputError("api-conformance needs --baseline: whose API to match")
        info = None
        try:
            recorded = ctx.baseline_lookup(baseline, "api", API_WORKLOAD)
            if recorded is not None:
                want = recorded.payload["answers"]
                # Recorded before the figure was kept: none.
                base_kv = recorded.payload.get("kv_capacity_tokens")
                source = f"{baseline}'s answers recorded {recorded.created_at:%Y-%m-%d %H:%M}Z"
            else:
                with ctx.backend(baseline) as base_be:
                    want = observe(base_be)
                    base_kv = kv_capacity(base_be)
                source = f"{baseline}'s live answers"
            with ctx.backend(backend) as be:
                info = be.info()
                got = observe(be)
                kv = kv_capacity(be)
        except KdctlError as exc:
            return self.errored(
                ctx, backend, baseline, exc, info=info, workload=API_WORKLOAD, started=started
            )
        found = compare(want, got)
        held = [n for n, a in want.items() if a.get("status") is not None]
        unanswered = [n for n in want if n not in held]
        metrics = [
            Metric(name="probes", value=len(held)),
            # With no answer of the baseline's to hold the candidate to, nothing was compared.
            Metric(
                name="nonconforming",
                value=len(found) if held else None,
                threshold=0,
                comparison="==",
            ),
        ]
        capacity, said = kv_findings(kv, base_kv, backend, baseline)
        metrics += capacity
        reasons = [f"{len(held) - len(found)}/{len(held)} probes answered as {source}"]
        reasons += [f"{name}: {'; '.join(d[:4])}" for name, d in found.items()]
        # The API is conformant only as far as it was compared: a pass of the few probes the
        # baseline answered says nothing of the routes it did not.
        unjudged = (
            [
                f"{len(unanswered)} of {len(want)} probes not compared: {baseline} did not answer "
                f"them ({_first_error(want, unanswered)})"
            ]
            if unanswered
            else []
        )
        reasons += unjudged + said
        return self.result(
            ctx,
            backend,
            started=started,
            baseline=baseline,
            verdict=decide(metrics, unjudged=unjudged),
            metrics=metrics,
            reasons=reasons,
            info=info,
            workload=API_WORKLOAD,
            details={"baseline": want, "candidate": got, "differences": found},
        )


def _first_error(answers: dict[str, Any], names: list[str]) -> str:
    return str(answers[names[0]].get("error") or "no answer")
