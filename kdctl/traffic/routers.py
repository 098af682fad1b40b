"""The router drivers: those kdctl ships and those other distributions register under the
`kdctl.routers` entry point group, each a `Router` subclass; the one an inventory names, on its
host's transport."""

from __future__ import annotations

import functools
from importlib.metadata import entry_points

from kdctl.errors import InputError
from kdctl.inventory import LoadedInventory, router_kinds
from kdctl.traffic._router import Router
from kdctl.traffic.nginx import NginxRouter
from kdctl.traffic.sglang_router import SGLangRouter
from kdctl.transports import TransportPool

_BUILTIN: dict[str, type[Router]] = {"nginx": NginxRouter, "sglang-router": SGLangRouter}


@functools.cache
def router_class(kind: str) -> type[Router]:
    """The driver registered as `kind`; InputError naming the known ones for any other."""
    if kind in _BUILTIN:
        return _BUILTIN[kind]
    for ep in entry_points(group="kdctl.routers"):
        if ep.name == kind:
            cls = ep.load()
            if not (isinstance(cls, type) and issubclass(cls, Router)):
                raise InputError(f"router kind {kind!r}: {ep.value} is not a kdctl Router")
            return cls
    raise InputError(f"unknown router kind {kind!r} (known: {', '.join(router_kinds())})")


def make_router(inv: LoadedInventory, pool: TransportPool) -> Router:
    spec = inv.spec.router
    if spec is None:
        raise InputError(f"{inv.path}: no router: set router: to move traffic")
    return router_class(spec.kind)(inv, spec, pool.get(spec.host))
