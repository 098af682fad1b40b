"""The reference backend: a Hugging Face model in-process (needs the `reference` extra)."""

from __future__ import annotations

import sys
from importlib.util import find_spec
from pathlib import Path

from kdctl.errors import InputError

_EXTRA = ("torch", "transformers", "tokenizers", "starlette", "uvicorn")


def require_extra(*modules: str) -> None:
    """Say which install is missing, instead of a traceback from deep inside an import."""
    missing = [m for m in (modules or _EXTRA) if find_spec(m) is None]
    if missing:
        raise InputError(
            f"the reference model needs {', '.join(missing)}: pip install 'kdctl[reference]'"
        )


def serve_argv(
    model: Path | str,
    port: int,
    *,
    served_name: str | None = None,
    api_key_env: str | None = None,
    draft: Path | str | None = None,
    draft_tokens: int | None = None,
    sglang_version: str | None = None,
    python: str | None = None,
) -> list[str]:
    """The command line of `kdctl reference serve`: what a service, a test or a benchmark runs
    to put the reference model behind SGLang's API on loopback (decoding speculatively with a
    `draft` model), under `python` (default: kdctl's own interpreter)."""
    argv = [python or sys.executable, "-m", "kdctl", "reference", "serve", "--model", str(model)]
    argv += ["--port", str(port)]
    if draft is not None:
        argv += ["--draft-model", str(draft)]
    if draft_tokens is not None:
        argv += ["--draft-tokens", str(draft_tokens)]
    if sglang_version is not None:
        argv += ["--sglang-version", sglang_version]
    if served_name:
        argv += ["--served-model-name", served_name]
    if api_key_env:
        argv += ["--api-key-env", api_key_env]
    return argv


def batch_argv(model: Path | str, python: str | None = None) -> list[str]:
    """The command line of `kdctl reference batch`: the reference model as a command-mode
    engine (kdctl appends the request and response files), under `python` (default: kdctl's
    own interpreter)."""
    return [python or sys.executable, "-m", "kdctl", "reference", "batch", "--model", str(model)]
