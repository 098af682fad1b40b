"""The backend kinds: those kdctl ships and those other distributions register under the
`kdctl.backends` entry point group; a backend made for an inventory entry."""

from __future__ import annotations

from typing import Any

from kdctl._plugins import load_plugin
from kdctl.backends._base import Backend
from kdctl.backends.native import NativeBackend, NativeCommandBackend
from kdctl.backends.openai import OpenAIBackend
from kdctl.backends.reference.backend import ReferenceBackend
from kdctl.backends.sglang import SGLangBackend
from kdctl.errors import InputError
from kdctl.inventory import BackendSpec, backend_kinds

# The reference kind's class imports no torch: that is loaded when its engine starts, and a
# missing extra is reported then, by name.
_BUILTIN: dict[str, type[Backend]] = {
    "sglang": SGLangBackend,
    "openai": OpenAIBackend,
    "native": NativeBackend,
    "reference": ReferenceBackend,
}


def backend_class(kind: str) -> type[Backend]:
    """The class for a kind: built in, or registered under the `kdctl.backends` entry points."""
    cls = _BUILTIN.get(kind) or load_plugin("kdctl.backends", kind, Backend)  # type: ignore[type-abstract]
    if cls is None:
        raise InputError(f"unknown backend kind {kind!r} (known: {', '.join(backend_kinds())})")
    return cls


def make_backend(name: str, spec: BackendSpec, **kwargs: Any) -> Backend:
    """A backend for an inventory entry; `transport` reaches kinds that run on the host."""
    cls = backend_class(spec.kind)
    if spec.kind == "native" and spec.mode == "command":
        return NativeCommandBackend(name, spec, **kwargs)
    kwargs.pop("transport", None)
    return cls(name, spec, **kwargs)
