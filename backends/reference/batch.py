"""The native-engine command contract, implemented by the reference engine.

It is both an executable example for the engine's authors and what kdctl's own tests and the
sandbox run as a `native` backend in command mode.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from kdctl import __version__
from kdctl.backends._types import EngineInfo, GenerateResult
from kdctl.backends.contract import (
    EXIT_BAD_REQUEST,
    EXIT_ENGINE_FAILURE,
    EXIT_OK,
    ContractError,
    ContractRequest,
    ContractResult,
    ContractTimings,
    RequestFile,
    ResponseFile,
)
from kdctl.errors import InputError

if TYPE_CHECKING:
    from kdctl.backends.reference.engine import ReferenceEngine


def run_contract(
    model_dir: Path,
    request: Path,
    response: Path,
    *,
    draft: Path | None = None,
    draft_tokens: int = 4,
) -> int:
    try:
        batch = RequestFile.model_validate(json.loads(request.read_text()))
    except (OSError, json.JSONDecodeError, ValidationError) as exc:
        print(f"{request}: not a valid request file: {exc}", file=sys.stderr)
        return EXIT_BAD_REQUEST
    try:
        from kdctl.backends.reference.speculative import open_engine, reference_settings

        engine = open_engine(model_dir, draft, draft_tokens=draft_tokens)
    except Exception as exc:
        print(f"cannot load {model_dir}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_ENGINE_FAILURE
    results = generate_timed(engine, batch.requests, batch.batch_size or 1)
    answer = ResponseFile(
        engine=EngineInfo(
            model=str(model_dir),
            served_name=model_dir.name,
            version=f"kdctl-reference {__version__}",
            tp_size=1,
            context_length=engine.context_length,
            settings=reference_settings(model_dir, draft, draft_tokens),
        ),
        results=results,
    )
    # Written whole or not at all: a reader never sees half a file.
    fd, tmp = tempfile.mkstemp(dir=response.parent, prefix=f".{response.name}.")
    with os.fdopen(fd, "w") as fh:
        fh.write(answer.model_dump_json())
    os.replace(tmp, response)
    return EXIT_OK


@dataclass
class _Slot:
    """One admitted request: its steps, and the clock read around them."""

    req: ContractRequest
    steps: Iterator[tuple[GenerateResult, bool]]
    admitted: float
    first: float | None = None
    last: float = 0.0
    yields: int = 0
    result: GenerateResult | None = None


def generate_timed(
    engine: ReferenceEngine, requests: list[ContractRequest], batch_size: int
) -> list[ContractResult]:
    """Every request's result and the timings of its steps: up to `batch_size` generate at
    once, admitted in order, the next as one finishes. The engine computes one step at a
    time, so the admitted take turns step by step, as they do in its server under that many
    clients: a turn waited for is in the figures, never left out of them."""
    results: dict[str, ContractResult] = {}
    waiting = list(reversed(requests))
    active: list[_Slot] = []
    origin: float | None = None
    while waiting or active:
        while waiting and len(active) < batch_size:
            req = waiting.pop()
            now = time.perf_counter()
            origin = now if origin is None else origin
            active.append(_Slot(req=req, steps=engine.steps(req), admitted=now))
        for slot in list(active):
            try:
                slot.result, finish = next(slot.steps)
            except InputError as exc:
                error = ContractError(type="invalid_request", message=str(exc))
                results[slot.req.id] = ContractResult(id=slot.req.id, error=error)
                active.remove(slot)
                continue
            except StopIteration:
                finish = True
            else:
                slot.last = time.perf_counter()
                slot.first = slot.last if slot.first is None else slot.first
                slot.yields += 1
            if finish:
                assert origin is not None and slot.result is not None and slot.first is not None
                timings = ContractTimings(
                    start_s=slot.admitted - origin,
                    ttft_s=slot.first - slot.admitted,
                    decode_s=slot.last - slot.first,
                    decode_steps=slot.yields - 1,
                )
                results[slot.req.id] = ContractResult(
                    id=slot.req.id, timings=timings, **slot.result.model_dump()
                )
                active.remove(slot)
    return [results[r.id] for r in requests]
