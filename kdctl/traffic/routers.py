"""The router driver an inventory names, on its host's transport."""

from __future__ import annotations

from kdctl.errors import InputError
from kdctl.inventory import LoadedInventory
from kdctl.traffic._router import Router
from kdctl.traffic.nginx import NginxRouter
from kdctl.traffic.sglang_router import SGLangRouter
from kdctl.transports import TransportPool


def make_router(inv: LoadedInventory, pool: TransportPool) -> Router:
    spec = inv.spec.router
    if spec is None:
        raise InputError(f"{inv.path}: no router: set router: to move traffic")
    if spec.kind == "nginx":
        return NginxRouter(inv, spec, pool.get(spec.host))
    return SGLangRouter(inv, spec, pool.get(spec.host))
