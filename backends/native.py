"""The team's native engine.

In `http` mode it speaks SGLang's API: the SGLang client under its own name. In `command` mode,
before the engine has a server, kdctl runs the engine's binary on its host with a JSON request
file and reads a JSON response file (docs/native-engine-contract.md).
"""

from __future__ import annotations

import json
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import httpx
from pydantic import SecretStr, ValidationError

from kdctl._limits import load_json
from kdctl.backends._base import Backend
from kdctl.backends._http import MAX_ANSWER_BYTES
from kdctl.backends._types import EngineInfo, GenerateRequest, GenerateResult
from kdctl.backends.contract import (
    EXIT_BAD_REQUEST,
    EXIT_ENGINE_FAILURE,
    ContractRequest,
    RequestFile,
    ResponseFile,
)
from kdctl.backends.errors import BackendError, BackendHTTPError, BackendProtocolError
from kdctl.backends.health import HealthResult
from kdctl.backends.sglang import SGLangBackend
from kdctl.errors import InputError, KdctlError
from kdctl.inventory import BackendSpec
from kdctl.transports import Transport


class NativeBackend(SGLangBackend):
    """`mode: http`: the engine serves SGLang's API; this is that client under its own name."""

    kind = "native"


class NativeCommandBackend(Backend):
    """`mode: command`: one run of the engine's binary per batch of requests."""

    kind = "native"

    def __init__(
        self,
        name: str,
        spec: BackendSpec,
        *,
        api_key: SecretStr | None = None,
        timeout: float | None = None,
        client: httpx.Client | None = None,
        transport: Transport | None = None,
    ) -> None:
        super().__init__(name, spec, api_key=api_key, timeout=timeout)
        self.transport = transport
        self.last_batch_s: float | None = None

    @property
    def where(self) -> str:
        return f"{self.spec.host}:{self.spec.command_argv[0]}"

    def _transport(self) -> Transport:
        if self.transport is None:
            raise BackendError(self.name, self.where, "command mode needs its host's transport")
        return self.transport

    def run_batch(
        self, requests: list[GenerateRequest], *, batch_size: int | None = None
    ) -> ResponseFile:
        """Run the engine's binary once on a batch; every request gets a result or an error.
        `batch_size` caps how many generate at once (speed measured at that batch)."""
        transport = self._transport()
        batch = RequestFile(
            requests=[
                ContractRequest(id=f"r{i}", **r.model_dump()) for i, r in enumerate(requests)
            ],
            batch_size=batch_size,
        )
        token = uuid.uuid4().hex[:12]
        workdir = self.spec.workdir.rstrip("/")
        remote_req = f"{workdir}/kdctl-{token}.request.json"
        remote_resp = f"{workdir}/kdctl-{token}.response.json"
        argv = [*self.spec.command_argv, "--request", remote_req, "--response", remote_resp]
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="kdctl-native-") as tmp:
            local_req = Path(tmp) / "request.json"
            # Left out when unset: an engine older than the field may refuse a key it lacks.
            unset = {"batch_size"} if batch_size is None else None
            local_req.write_text(batch.model_dump_json(exclude=unset))
            try:
                transport.put(local_req, remote_req, mode=0o600)
                result = transport.run(argv, timeout=self.spec.command_timeout_s)
                if result.exit_code != 0:
                    tail = (result.stderr or result.stdout).strip().splitlines()[-5:]
                    what = {
                        EXIT_BAD_REQUEST: "refused the request file",
                        EXIT_ENGINE_FAILURE: "could not run",
                        127: "is not installed (command not found)",
                    }.get(result.exit_code, f"exited {result.exit_code}")
                    raise BackendError(
                        self.name, self.where, f"the engine {what}: {' | '.join(tail)}"
                    )
                local_resp = Path(tmp) / "response.json"
                transport.get(remote_resp, local_resp)
                text = local_resp.read_text()
            finally:
                transport.run(["rm", "-f", "--", remote_req, remote_resp], timeout=30)
        self.last_batch_s = time.monotonic() - started
        try:
            response = ResponseFile.model_validate(
                load_json(text, f"{self.where} response file", max_bytes=MAX_ANSWER_BYTES)
            )
        except InputError as exc:
            raise BackendProtocolError(self.name, self.where, str(exc)) from None
        except (json.JSONDecodeError, ValidationError) as exc:
            raise BackendProtocolError(
                self.name, self.where, f"response file breaks the contract: {_first(exc)}"
            ) from None
        ids = [r.id for r in response.results]
        if ids != [r.id for r in batch.requests]:
            raise BackendProtocolError(
                self.name, self.where, f"response answers ids {ids[:5]}, not the requests sent"
            )
        return response

    def generate(self, req: GenerateRequest) -> GenerateResult:
        (result,) = self.generate_batch([req])
        return result

    def generate_batch(
        self, reqs: Sequence[GenerateRequest], *, concurrency: int = 4
    ) -> list[GenerateResult]:
        """One run of the binary for the whole batch: its start (weights loaded, kernels
        built) costs more than the requests, and batching is what the contract is for."""
        out = []
        for result in self.run_batch(list(reqs)).results:
            if result.error is not None:
                raise BackendHTTPError(
                    self.name, self.where, 400, f"{result.error.type}: {result.error.message}"
                )
            fields = result.model_dump(exclude={"id", "error", "timings"})
            fields["finish_reason"] = result.finish_reason or "length"
            out.append(GenerateResult.model_validate(fields))
        return out

    def info(self) -> EngineInfo:
        return self.run_batch([]).engine

    def health(self) -> HealthResult:
        started = time.monotonic()
        try:
            self.run_batch([])
        except KdctlError as exc:
            return HealthResult(state="down", detail=str(exc))
        return HealthResult(state="up", latency_ms=round((time.monotonic() - started) * 1000, 2))


def _first(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        err = exc.errors()[0]
        return f"{'.'.join(map(str, err['loc']))}: {err['msg']}"
    return str(exc)
