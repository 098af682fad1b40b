"""Typed failures of a backend, each naming the backend and the URL it was talking to."""

from __future__ import annotations

from kdctl.errors import InfraError


class BackendError(InfraError):
    def __init__(self, backend: str, url: str, message: str) -> None:
        super().__init__(f"backend {backend} ({url}): {message}")
        self.backend = backend
        self.url = url


class BackendUnavailable(BackendError):
    """Nothing answers at the URL: connection refused (`refused`), host unreachable."""

    def __init__(self, backend: str, url: str, message: str, *, refused: bool = False) -> None:
        super().__init__(backend, url, message)
        self.refused = refused


class BackendNotReady(BackendError):
    """The engine answers 503: starting (SGLang does so until warm-up ends) or draining (a
    front that says so while engines swap)."""

    def __init__(self, backend: str, url: str, message: str, *, draining: bool = False) -> None:
        super().__init__(backend, url, message)
        self.draining = draining


class BackendTimeout(BackendError):
    """No answer, or no next byte of a stream, within the deadline."""


class BackendAuthError(BackendError):
    """The engine refused the API key (401 or 403)."""


class BackendHTTPError(BackendError):
    def __init__(self, backend: str, url: str, status: int, message: str) -> None:
        super().__init__(backend, url, f"HTTP {status}: {message}")
        self.status = status


class BackendProtocolError(BackendError):
    """The engine answered something that is not its API: bad JSON, a cut-off stream."""
