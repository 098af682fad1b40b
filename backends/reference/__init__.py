"""The reference backend: a Hugging Face model in-process (needs the `reference` extra)."""

from __future__ import annotations

from importlib.util import find_spec

from kdctl.errors import InputError

_EXTRA = ("torch", "transformers", "tokenizers", "starlette", "uvicorn")


def require_extra(*modules: str) -> None:
    """Say which install is missing, instead of a traceback from deep inside an import."""
    missing = [m for m in (modules or _EXTRA) if find_spec(m) is None]
    if missing:
        raise InputError(
            f"the reference model needs {', '.join(missing)}: pip install 'kdctl[reference]'"
        )
