"""The Gate interface, the context a gate runs in, and the registry of gates."""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from importlib.metadata import entry_points
from typing import ClassVar

from kdctl import __version__
from kdctl.backends import Backend, EngineInfo
from kdctl.checks.result import Baseline, BaselineKind, GateResult, Provenance, content_hash
from kdctl.errors import InputError
from kdctl.inventory import LoadedInventory
from kdctl.inventory.models import parse_duration
from kdctl.transports import Transport

# How the caller hands a gate the recorded baseline for a workload: gates read evidence through
# this and never reach into the store, which sits above them.
BaselineLookup = Callable[[str, BaselineKind, str], Baseline | None]

# (what is running, units done, units in all): long gates report through this, the CLI draws it.
ProgressHook = Callable[[str, int, int], None]


@dataclass
class GateContext:
    inventory: LoadedInventory
    backend: Callable[[str], Backend]
    baseline_lookup: BaselineLookup
    progress: ProgressHook | None = None
    # The host's transport, for gates that look at the box itself (tp-health, command).
    transport: Callable[[str], Transport] | None = None
    # The latest earlier result of (gate, backend): what "since the last check" is measured from.
    last_result: Callable[[str, str], GateResult | None] | None = None

    def report(self, what: str, done: int, total: int) -> None:
        if self.progress is not None:
            self.progress(what, done, total)


class Gate(abc.ABC):
    name: ClassVar[str]
    description: ClassVar[str]
    needs_baseline: ClassVar[bool] = False
    # False for gates a person decides (sign-off): `gate run all` passes over them.
    runnable: ClassVar[bool] = True
    # How long a result counts unless `gates.freshness` says otherwise.
    freshness_window: ClassVar[timedelta] = timedelta(days=7)

    @abc.abstractmethod
    def run(self, ctx: GateContext, backend: str, baseline: str | None) -> GateResult: ...


def provenance_of(
    ctx: GateContext, name: str, info: EngineInfo | None, workload: str | None
) -> Provenance:
    """What was measured, as the engine and the inventory describe it now."""
    spec = ctx.inventory.backends[name]
    identity = {
        "model": info.model if info else spec.model,
        "served_name": info.served_name if info else None,
        "version": info.version if info else None,
        "tp_size": info.tp_size if info and info.tp_size else spec.tp_size,
        "context_length": info.context_length if info else None,
    }
    return Provenance(
        engine_version=info.version if info else None,
        model_path=identity["model"],
        config_hash=content_hash(identity)[:16],
        host=spec.host,
        gpus=list(spec.gpus),
        tp_size=identity["tp_size"],
        workload_hash=workload,
        kdctl_version=__version__,
    )


def _builtin() -> dict[str, type[Gate]]:
    from kdctl.checks.api_conformance import ApiConformanceGate
    from kdctl.checks.command import CommandGate
    from kdctl.checks.exactness import ExactnessGate
    from kdctl.checks.health import HealthGate
    from kdctl.checks.signoff import SignOffGate
    from kdctl.checks.throughput import ThroughputGate
    from kdctl.checks.tp_health import TpHealthGate

    builtin: tuple[type[Gate], ...] = (
        HealthGate,
        ExactnessGate,
        ThroughputGate,
        TpHealthGate,
        ApiConformanceGate,
        CommandGate,
        SignOffGate,
    )
    return {g.name: g for g in builtin}


def gates() -> dict[str, type[Gate]]:
    found = _builtin()
    for ep in entry_points(group="kdctl.checks"):
        cls = ep.load()
        if isinstance(cls, type) and issubclass(cls, Gate):
            found.setdefault(ep.name, cls)
    return found


def gate_class(name: str) -> type[Gate]:
    known = gates()
    if name not in known:
        raise InputError(f"unknown gate {name!r} (known: {', '.join(sorted(known))})")
    return known[name]


def freshness_window(inv: LoadedInventory, gate: str) -> timedelta:
    """The window a gate's evidence counts for: the inventory's, else the gate's own."""
    cls = gate_class(gate)
    configured = inv.spec.gates.freshness
    for name in configured:
        if name not in gates():
            raise InputError(f"gates.freshness.{name}: unknown gate {name!r}")
    if gate in configured:
        return parse_duration(configured[gate])
    return cls.freshness_window
