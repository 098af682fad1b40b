"""The backend kinds: those kdctl ships and those other distributions register under the
`kdctl.backends` entry point group; a backend made for an inventory entry."""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any

from kdctl.backends._base import Backend
from kdctl.backends.native import NativeBackend, NativeCommandBackend
from kdctl.backends.openai import OpenAIBackend
from kdctl.backends.reference.backend import ReferenceBackend
from kdctl.backends.sglang import SGLangBackend
from kdctl.errors import InputError
from kdctl.inventory import BackendSpec

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
    if kind in _BUILTIN:
        return _BUILTIN[kind]
    for ep in entry_points(group="kdctl.backends"):
        if ep.name == kind:
            cls = ep.load()
            if not (isinstance(cls, type) and issubclass(cls, Backend)):
                raise InputError(f"entry point kdctl.backends:{kind} is not a Backend class")
            return cls
    raise InputError(f"unknown backend kind {kind!r}")


def make_backend(name: str, spec: BackendSpec, **kwargs: Any) -> Backend:
    """A backend for an inventory entry; `transport` reaches kinds that run on the host."""
    cls = backend_class(spec.kind)
    if spec.kind == "native" and spec.mode == "command":
        return NativeCommandBackend(name, spec, **kwargs)
    kwargs.pop("transport", None)
    return cls(name, spec, **kwargs)
