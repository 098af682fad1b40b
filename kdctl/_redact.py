"""Secrets kdctl knows (API keys, `from_env` values handed to engines, key files' contents)
scrubbed from everything it prints, stores or exports, wherever the text came from: an engine
that prints its hub token before it dies must not put it into a cutover's output, the evidence
or the journal.

One registry per process: the inventory registers what it resolves; the CLI's output streams,
the evidence store and the journal scrub what passes through them.
"""

from __future__ import annotations

import threading
from typing import Any, TextIO

MASK = "***"
# Shorter values are not secrets anyone relies on, and masking them would garble text.
_MIN_LEN = 6

_lock = threading.Lock()
_secrets: tuple[str, ...] = ()


def register(*values: str | None) -> None:
    global _secrets
    fresh = {v.strip() for v in values if v and len(v.strip()) >= _MIN_LEN}
    with _lock:
        # Longest first, so a secret that contains another is masked whole.
        _secrets = tuple(sorted(set(_secrets) | fresh, key=len, reverse=True))


def scrub(text: str) -> str:
    for secret in _secrets:
        if secret in text:
            text = text.replace(secret, MASK)
    return text


def scrub_data(value: Any) -> Any:
    """Every string inside a JSON-like value, keys included."""
    if not _secrets:
        return value
    if isinstance(value, str):
        return scrub(value)
    if isinstance(value, dict):
        return {scrub_data(k): scrub_data(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [scrub_data(v) for v in value]
    return value


class ScrubbingStream:
    """A text stream that masks secrets in what is written to it (kdctl's stdout and stderr)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(scrub(text))
        return len(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)
