"""The Gate interface, the context a gate runs in, and the registry of gates."""

from __future__ import annotations

import abc
import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from importlib.metadata import entry_points
from typing import Any, ClassVar

from kdctl import __version__
from kdctl._httpclient import http_path
from kdctl.backends import Backend, EngineInfo
from kdctl.errors import InputError, KdctlError
from kdctl.inventory import LoadedInventory
from kdctl.inventory.models import parse_duration
from kdctl.records import (
    Baseline,
    BaselineKind,
    GateResult,
    Metric,
    Provenance,
    Verdict,
    content_hash,
    decide,
    utcnow,
)
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
    # The recorded baselines the lookup handed out, by backend: a result compared with one is
    # bound to what that one measured.
    used_baselines: dict[str, Baseline] = field(default_factory=dict)
    # Why recorded baselines were passed over, by backend: said where the gate then fails.
    passed_over: dict[str, str] = field(default_factory=dict)
    # The baseline is not asked live, only through what it recorded (stopped for a swap).
    recorded_only: bool = False

    def report(self, what: str, done: int, total: int) -> None:
        if self.progress is not None:
            self.progress(what, done, total)


class Gate(abc.ABC):
    name: ClassVar[str]
    description: ClassVar[str]
    needs_baseline: ClassVar[bool] = False
    # Compares with a baseline when given one, and decides less without (throughput).
    takes_baseline: ClassVar[bool] = False
    # False for gates a person decides (sign-off): `gate run all` passes over them.
    runnable: ClassVar[bool] = True
    # How long a result counts unless `gates.freshness` says otherwise.
    freshness_window: ClassVar[timedelta] = timedelta(days=7)
    # The field of the inventory's `gates:` that tunes it, if any; a roadmap criterion may
    # override it, and each result records the settings it ran with.
    settings_field: ClassVar[str | None] = None

    @abc.abstractmethod
    def run(self, ctx: GateContext, backend: str, baseline: str | None) -> GateResult: ...

    def workloads(self, inv: LoadedInventory) -> frozenset[str] | None:
        """The hashes of the workloads this gate would send under `inv`'s settings, the same
        way each result records its own (`provenance.workload_hash`): a prompt file edited in
        place keeps its name in the settings and changes only this. None where a gate's
        settings say all of what it sends. Raises InputError where the workload cannot be
        read now (a prompt file gone)."""
        return None

    def result(
        self,
        ctx: GateContext,
        backend: str,
        *,
        started: datetime,
        baseline: str | None = None,
        verdict: Verdict | None = None,
        metrics: Sequence[Metric] = (),
        reasons: Sequence[str] = (),
        info: EngineInfo | None = None,
        workload: str | None = None,
        details: dict[str, Any] | None = None,
    ) -> GateResult:
        """This gate's result, ending now, with the provenance of what it measured; the
        verdict, unless given, is `decide(metrics)`: a threshold unmeasured never passes."""
        return GateResult(
            gate=self.name,
            backend=backend,
            baseline=baseline,
            verdict=decide(metrics) if verdict is None else verdict,
            metrics=list(metrics),
            reasons=list(reasons),
            provenance=provenance_of(ctx, backend, info, workload),
            details=details or {},
            started_at=started,
            ended_at=utcnow(),
        )

    def errored(
        self,
        ctx: GateContext,
        backend: str,
        baseline: str | None,
        exc: KdctlError,
        *,
        info: EngineInfo | None,
        workload: str | None,
        started: datetime,
    ) -> GateResult:
        """A run that could not measure: verdict error, saying why, with what was known."""
        why = ctx.passed_over.get(baseline) if baseline is not None else None
        return self.result(
            ctx,
            backend,
            started=started,
            baseline=baseline,
            verdict="error",
            reasons=[str(exc), *([why] if why else [])],
            info=info,
            workload=workload,
        )


def engine_now(ctx: GateContext, backend: str) -> EngineInfo | None:
    """Who the engine says it is while a host-level gate looks at its box, where it answers
    (a served engine over HTTP, one in command mode by running its binary): such a result is
    about the build that ran then."""
    try:
        with ctx.backend(backend) as be:
            return be.info()
    except KdctlError:
        return None


def provenance_of(
    ctx: GateContext, name: str, info: EngineInfo | None, workload: str | None
) -> Provenance:
    """What was measured, as the engine and the inventory describe it now."""
    return provenance_for(ctx.inventory, name, info, workload)


def provenance_for(
    inv: LoadedInventory, name: str, info: EngineInfo | None, workload: str | None
) -> Provenance:
    """Without the engine's own info (a gate that looks at the host, not the engine) the
    engine's fields stay unset, and freshness does not hold the result to them."""
    spec = inv.backends[name]
    identity = {
        "model": info.model if info else spec.model,
        "served_name": info.served_name if info else None,
        "version": info.version if info else None,
        # A live engine that does not report its TP has none recorded: the inventory's figure
        # would bind the result to a split nobody measured.
        "tp_size": info.tp_size if info else spec.tp_size,
        "context_length": info.context_length if info else None,
    }
    return Provenance(
        engine_version=info.version if info else None,
        model_path=identity["model"],
        config_hash=content_hash(identity)[:16] if info else None,
        host=spec.host,
        gpus=list(spec.gpus),
        tp_size=identity["tp_size"],
        workload_hash=workload,
        kdctl_version=__version__,
        # The path this command's requests to it took, where they took one.
        http_path=http_path(spec.url),
    ).with_settings(info.settings if info else None)


def _builtin() -> dict[str, type[Gate]]:
    from kdctl.checks.api_conformance import ApiConformanceGate
    from kdctl.checks.command import CommandGate
    from kdctl.checks.exactness import ExactnessGate
    from kdctl.checks.health import HealthGate
    from kdctl.checks.promotion import PromotionGate
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
        PromotionGate,
    )
    return {g.name: g for g in builtin}


def gates() -> dict[str, type[Gate]]:
    return dict(_known())


@functools.cache
def _known() -> dict[str, type[Gate]]:
    # Read once a process: the installed distributions do not change under a command, and
    # scanning their metadata costs milliseconds each of the dozens of times a status asks.
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
        # `baseline`: how long a recorded baseline stands (kdctl.recording.baseline_window).
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
