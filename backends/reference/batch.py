"""The native-engine command contract, implemented by the reference engine.

It is both an executable example for the engine's authors and what kdctl's own tests and the
sandbox run as a `native` backend in command mode.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from pydantic import ValidationError

from kdctl import __version__
from kdctl.backends._types import EngineInfo
from kdctl.backends.contract import (
    EXIT_BAD_REQUEST,
    EXIT_ENGINE_FAILURE,
    EXIT_OK,
    ContractError,
    ContractResult,
    RequestFile,
    ResponseFile,
)
from kdctl.errors import InputError


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
    results = []
    for req in batch.requests:
        try:
            out = engine.generate(req)
        except InputError as exc:
            results.append(
                ContractResult(
                    id=req.id, error=ContractError(type="invalid_request", message=str(exc))
                )
            )
            continue
        results.append(ContractResult(id=req.id, **out.model_dump()))
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
