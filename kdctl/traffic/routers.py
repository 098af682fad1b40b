"""The router drivers: those kdctl ships and those other distributions register under the
`kdctl.routers` entry point group, each a `Router` subclass; the one an inventory names, on its
host's transport."""

from __future__ import annotations

from kdctl._plugins import load_plugin
from kdctl.errors import InputError
from kdctl.inventory import LoadedInventory, router_kinds
from kdctl.traffic._router import Router
from kdctl.traffic.nginx import NginxRouter
from kdctl.traffic.sglang_router import SGLangRouter
from kdctl.transports import TransportPool

_BUILTIN: dict[str, type[Router]] = {"nginx": NginxRouter, "sglang-router": SGLangRouter}


def router_class(kind: str) -> type[Router]:
    """The driver registered as `kind`; InputError naming the known ones for any other."""
    cls = _BUILTIN.get(kind) or load_plugin("kdctl.routers", kind, Router)  # type: ignore[type-abstract]
    if cls is None:
        raise InputError(f"unknown router kind {kind!r} (known: {', '.join(router_kinds())})")
    return cls


def make_router(inv: LoadedInventory, pool: TransportPool) -> Router:
    spec = inv.spec.router
    if spec is None:
        raise InputError(f"{inv.path}: no router: set router: to move traffic")
    return router_class(spec.kind)(inv, spec, pool.get(spec.host))
