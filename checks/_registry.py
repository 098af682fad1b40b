"""The gates: those kdctl ships and those other distributions register under the
`kdctl.checks` entry point group, and what depends on knowing every gate (freshness windows,
settings pinned by criteria, whether a result was measured under other settings)."""

from __future__ import annotations

import functools
import json
from dataclasses import replace
from datetime import timedelta
from typing import Any

from kdctl._plugins import load_plugin, plugged
from kdctl.checks._base import Gate
from kdctl.checks.api_conformance import ApiConformanceGate
from kdctl.checks.command import CommandGate
from kdctl.checks.exactness import ExactnessGate
from kdctl.checks.health import HealthGate
from kdctl.checks.promotion import PromotionGate
from kdctl.checks.signoff import SignOffGate
from kdctl.checks.throughput import ThroughputGate
from kdctl.checks.tp_health import TpHealthGate
from kdctl.errors import InputError
from kdctl.inventory import LoadedInventory
from kdctl.inventory.models import parse_duration
from kdctl.records import GateResult


def _builtin() -> dict[str, type[Gate]]:
    builtin: tuple[type[Gate], ...] = (
        HealthGate,
        ExactnessGate,
        ThroughputGate,
        TpHealthGate,
        ApiConformanceGate,
        CommandGate,
        SignOffGate,
        PromotionGate,
    )
    return {g.name: g for g in builtin}


def gates() -> dict[str, type[Gate]]:
    return dict(_known())


@functools.cache
def _known() -> dict[str, type[Gate]]:
    found = _builtin()
    for name in plugged("kdctl.checks"):
        if name not in found:
            cls = load_plugin("kdctl.checks", name, Gate)  # type: ignore[type-abstract]
            assert cls is not None
            found[name] = cls
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
        # `baseline`: how long a recorded baseline stands (kdctl.evidence.baseline_window).
        if name not in gates() and name != "baseline":
            raise InputError(f"gates.freshness.{name}: unknown gate {name!r}")
    if gate in configured:
        return parse_duration(configured[gate])
    return cls.freshness_window


def gate_settings(inv: LoadedInventory, gate: str) -> dict[str, Any]:
    """The settings a gate runs with under this inventory, as JSON: kept on every result so a
    roadmap criterion that asks for other settings is not met by it."""
    field = gate_class(gate).settings_field
    if field is None:
        return {}
    value = getattr(inv.spec.gates, field)
    if isinstance(value, dict):
        return {k: v.model_dump(mode="json") for k, v in value.items()}
    return value.model_dump(mode="json")  # type: ignore[no-any-return]


def with_settings(inv: LoadedInventory, gate: str, overrides: dict[str, Any]) -> LoadedInventory:
    """The inventory with a gate's settings overridden, validated as the inventory's own are.

    Raises ValueError (pydantic's ValidationError is one) naming what does not fit, so the
    caller can point at its own file and line.
    """
    if not overrides:
        return inv
    field = gate_class(gate).settings_field
    if field is None:
        raise ValueError(f"the {gate} gate takes no settings")
    current = getattr(inv.spec.gates, field)
    if isinstance(current, dict):
        raise ValueError(f"the {gate} gate's settings are chosen by name, not overridden")
    merged = type(current).model_validate(current.model_dump() | overrides)
    gates = inv.spec.gates.model_copy(update={field: merged})
    return replace(inv, spec=inv.spec.model_copy(update={"gates": gates}))


# The workloads a gate sends under given settings, computed once per assessment:
# a throughput workload of random ids is a few hundred thousand draws to hash.
Workloads = dict[tuple[str, str], "frozenset[str] | InputError | None"]


def measured_otherwise(
    inv: LoadedInventory, result: GateResult, memo: Workloads | None = None
) -> str | None:
    """Why `result` does not stand for its gate as the gate would run now under `inv`: other
    settings, or another workload under the same settings; None where it does. Freshness says
    whether the engine is the one measured; this, whether the measurement is the one asked."""
    field = gate_class(result.gate).settings_field
    named = field is not None and isinstance(getattr(inv.spec.gates, field), dict)
    changed = _settings_changed(gate_settings(inv, result.gate), result.settings, named=named)
    if changed:
        return (
            f"measured under other {result.gate} settings ({', '.join(changed)} differ from "
            "the inventory's now)"
        )
    return workload_changed(inv, result, memo)


def workload_changed(
    inv: LoadedInventory, result: GateResult, memo: Workloads | None = None
) -> str | None:
    """Why `result` was measured on another workload than its gate sends now under `inv`'s
    settings (a prompt file edited in place keeps its name in the settings); None where it was
    not, or where the gate's settings say all it sends."""
    memo = {} if memo is None else memo
    key = (result.gate, json.dumps(gate_settings(inv, result.gate), sort_keys=True))
    if key not in memo:
        try:
            memo[key] = gate_class(result.gate)().workloads(inv)
        except InputError as exc:
            memo[key] = exc
    sends = memo[key]
    if isinstance(sends, InputError):
        return f"its workload cannot be read now to compare ({sends})"
    if sends is None or result.provenance.workload_hash in sends:
        return None
    had = result.provenance.workload_hash or "none recorded"
    return (
        f"measured on another workload (workload {had}; the gate sends "
        f"{' or '.join(sorted(sends))} now): its prompts changed under the same settings"
    )


def _settings_changed(
    now: dict[str, Any], had: dict[str, Any], at: str = "", *, named: bool = False
) -> list[str]:
    """The settings, dotted, whose value now differs from the one a result ran with. Settings
    chosen by name (commands) are compared by the names both hold: a command added since
    changes none of the others."""
    keys = now.keys() & had.keys() if named else now.keys()
    out = []
    for k in sorted(keys):
        a, b = now.get(k), had.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _settings_changed(a, b, f"{at}{k}.")
        elif a != b:
            out.append(f"{at}{k}")
    return out
