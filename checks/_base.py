"""The Gate interface, the context a gate runs in, and the registry of gates."""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, ClassVar

from kdctl import __version__
from kdctl._httpclient import http_path
from kdctl.backends import Backend, EngineInfo
from kdctl.errors import KdctlError
from kdctl.inventory import LoadedInventory
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
    # Whether its results describe the engine itself, as it said it was (build, model, TP,
    # settings), or only a host, a command or a person's word: a pass of a gate that asks the
    # engine owes every field of the engine's that the engine reports now.
    asks_engine: ClassVar[bool] = True

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

    def unrecorded(
        self,
        ctx: GateContext,
        backend: str,
        baseline: str,
        *,
        said: str,
        workload: str,
        started: datetime,
    ) -> GateResult:
        """Held to the baseline's records only (`recorded_only`: the baseline is stopped), with
        none usable: skipped, `said` (what was not done) and why, never an answer asked of it."""
        why = ctx.passed_over.get(baseline) or f"{baseline} has none recorded"
        return self.result(
            ctx,
            backend,
            started=started,
            baseline=baseline,
            verdict="skipped",
            reasons=[f"{said} ({why})"],
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
