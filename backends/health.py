"""The HTTP health probe that every served engine answers: SGLang, vLLM and the native one."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Literal

import httpx
from pydantic import BaseModel, SecretStr

from kdctl.errors import InfraError

BackendState = Literal["up", "starting", "down", "unknown"]


# Why nothing answered, for code to branch on (the detail says it in words).
Failure = Literal["refused", "unreachable", "timeout"]


class HealthResult(BaseModel):
    state: BackendState
    latency_ms: float | None = None
    status_code: int | None = None
    detail: str | None = None
    failure: Failure | None = None


def connect_refused(exc: httpx.ConnectError) -> bool:
    """Refused: the host said no one listens; any other failure to connect (a name that does
    not resolve, no route) says only that it cannot be reached from here. httpx says which
    only in the words of the OS's error."""
    return "refused" in str(exc).lower()


def bearer(api_key: SecretStr | None) -> dict[str, str]:
    """The header SGLang and OpenAI-compatible servers take an API key in."""
    return {"Authorization": f"Bearer {api_key.get_secret_value()}"} if api_key else {}


# SGLang's generating /health may take its 20 s SGLANG_HEALTH_CHECK_TIMEOUT: every health
# probe waits this long, never the few seconds a plain route would need.
HEALTH_TIMEOUT_S = 25.0


def probe_health(
    client: httpx.Client,
    url: str,
    *,
    api_key: SecretStr | None = None,
    timeout: float = HEALTH_TIMEOUT_S,
    path: str = "/health",
) -> HealthResult:
    """GET `{url}/health`: 200 is up; 503 is starting, draining or unhealthy.

    SGLang's /health is a plain 200 in 0.4.3 to 0.4.6; from 0.4.10 it generates a token, which
    takes at least a second and up to its 20 s SGLANG_HEALTH_CHECK_TIMEOUT, and answers 503
    until its warm-up ends (docs/sglang-compatibility.md): hence the 25 s default. It listens
    only once its weights are loaded, so down (nothing listens) is also what a loading engine
    looks like; status tells them apart by the engine's service. Unknown means something
    answered that is not an engine's health (auth refused, another status, a timeout).
    """
    headers = bearer(api_key)
    started = time.monotonic()
    try:
        # Only the status counts: a body that never ends must not hold the probe.
        with client.stream("GET", f"{url}{path}", headers=headers, timeout=timeout) as resp:
            code = resp.status_code
    except httpx.ConnectError as exc:
        if connect_refused(exc):
            return HealthResult(state="down", detail="connection refused", failure="refused")
        return HealthResult(state="down", detail=f"unreachable: {exc}", failure="unreachable")
    except httpx.TimeoutException:
        return HealthResult(
            state="unknown", detail=f"no answer within {timeout:g}s", failure="timeout"
        )
    except httpx.HTTPError as exc:
        return HealthResult(state="unknown", detail=f"{type(exc).__name__}: {exc}")
    latency = round((time.monotonic() - started) * 1000, 2)
    if code == 200:
        return HealthResult(state="up", latency_ms=latency, status_code=code)
    if code == 503:
        # SGLang answers 503 while it warms up, and also when draining or when its health
        # generation timed out: not "down", but not known to be only starting either.
        return HealthResult(
            state="starting",
            latency_ms=latency,
            status_code=code,
            detail="not ready (HTTP 503: starting, draining or unhealthy)",
        )
    detail = "authentication failed" if code in (401, 403) else f"HTTP {code}"
    return HealthResult(state="unknown", latency_ms=latency, status_code=code, detail=detail)


def wait_http(
    url: str,
    *,
    deadline_s: float = 120.0,
    want: int = 200,
    proc: subprocess.Popen[bytes] | None = None,
    log: Path | None = None,
) -> None:
    """Until GET `url` answers `want`: how the sandbox, the tests and the benchmarks wait for a
    server they started. With `proc`, a server that exits fails at once, with its log's tail
    rather than a wait to the deadline."""
    deadline = time.monotonic() + deadline_s
    last = "nothing yet"
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise InfraError(f"the server for {url} exited ({proc.returncode}){_tail(log)}")
        try:
            status = httpx.get(url, timeout=2).status_code
            if status == want:
                return
            last = f"HTTP {status}"
        except httpx.HTTPError as exc:
            last = type(exc).__name__
        time.sleep(0.1)
    raise InfraError(
        f"{url} did not answer {want} within {deadline_s:g}s (last: {last}){_tail(log)}"
    )


def _tail(log: Path | None, chars: int = 3000) -> str:
    if log is None:
        return ""
    try:
        return ":\n" + log.read_text(errors="replace")[-chars:]
    except OSError:
        return f" (no log at {log})"
