"""Running gates and recording baselines: the glue between backends, checks and evidence."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from kdctl.backends import Backend, HttpBackend, make_backend
from kdctl.checks._gate import (
    GateContext,
    ProgressHook,
    gate_class,
    gate_settings,
    gates,
    provenance_for,
)
from kdctl.checks.api_conformance import record_api
from kdctl.checks.exactness import record_golden
from kdctl.checks.result import Baseline, BaselineKind, GateResult, Provenance, utcnow
from kdctl.checks.signoff import sign_off
from kdctl.checks.throughput import record_throughput
from kdctl.errors import InputError, KdctlError
from kdctl.evidence import EvidenceStore
from kdctl.inventory import LoadedInventory
from kdctl.probes.identity import probe_host_identity, probe_weights
from kdctl.transports import Transport, TransportPool, fan_out


@contextmanager
def gate_context(
    inv: LoadedInventory, store: EvidenceStore, progress: ProgressHook | None = None
) -> Iterator[GateContext]:
    with TransportPool(inv) as pool:

        def backend(name: str) -> Backend:
            spec = inv.backends[name]
            return make_backend(
                name, spec, api_key=inv.api_key(name), transport=pool.get(spec.host)
            )

        def lookup(name: str, kind: BaselineKind, workload: str) -> Baseline | None:
            found = store.baselines(backend=name, kind=kind, workload_hash=workload)
            return found[0] if found else None

        yield GateContext(
            inventory=inv,
            backend=backend,
            baseline_lookup=lookup,
            progress=progress,
            transport=pool.get,
            last_result=store.latest,
        )


def _check_names(inv: LoadedInventory, *names: str | None) -> None:
    for name in names:
        if name is not None and name not in inv.backends:
            known = ", ".join(sorted(inv.backends)) or "none"
            raise InputError(f"unknown backend {name!r} (known: {known})")


def run_gates(
    inv: LoadedInventory,
    store: EvidenceStore,
    gate: str,
    backend: str,
    baseline: str | None,
    *,
    on_start: Callable[[str], None] | None = None,
    progress: ProgressHook | None = None,
) -> list[GateResult]:
    """Run one gate or `all`, record every result as evidence, and return them."""
    _check_names(inv, backend, baseline)
    names = (
        sorted(n for n, g in gates().items() if g.runnable)
        if gate == "all"
        else [gate_class(gate).name]
    )
    results = []
    with gate_context(inv, store, progress) as ctx:
        assert ctx.transport is not None
        binder = Binder(inv, ctx.transport)
        for name in names:
            cls = gate_class(name)
            if on_start:
                on_start(name)
            if cls.needs_baseline and baseline is None:
                now = utcnow()
                result = GateResult(
                    gate=name,
                    backend=backend,
                    verdict="skipped",
                    reasons=["needs --baseline"],
                    started_at=now,
                    ended_at=now,
                )
            else:
                result = cls().run(ctx, backend, baseline)
            result.settings = gate_settings(inv, name)
            result = binder.bind_result(result)
            store.record(result)
            results.append(result)
    return results


BASELINE_KINDS: tuple[BaselineKind, ...] = ("golden", "throughput", "api")


def record_baseline(
    inv: LoadedInventory,
    store: EvidenceStore,
    backend: str,
    kinds: tuple[BaselineKind, ...] = BASELINE_KINDS,
    *,
    progress: ProgressHook | None = None,
) -> list[Baseline]:
    """Golden outputs and a throughput run from the engine serving today, kept as evidence.

    Each is stored as soon as it is measured, so a failure in the second keeps the first.
    """
    _check_names(inv, backend)
    recorders = {"golden": record_golden, "throughput": record_throughput, "api": record_api}
    recorded = []
    with gate_context(inv, store, progress) as ctx:
        assert ctx.transport is not None
        binder = Binder(inv, ctx.transport)
        for kind in kinds:
            baseline = recorders[kind](ctx, backend)
            baseline.provenance = binder.bind(backend, baseline.provenance)
            store.record_baseline(baseline)
            recorded.append(baseline)
    return recorded


def record_signoff(
    inv: LoadedInventory, store: EvidenceStore, backend: str, by: str, note: str
) -> GateResult:
    """A person's approval, kept as evidence like any gate's result."""
    _check_names(inv, backend)
    with gate_context(inv, store) as ctx:
        assert ctx.transport is not None
        result = Binder(inv, ctx.transport).bind_result(sign_off(ctx, backend, by, note))
    store.record(result)
    return result


class Binder:
    """Reads, once per host and checkpoint, what a provenance is bound to: the host's own
    identity and the fingerprint of the weights at the model path it names."""

    def __init__(self, inv: LoadedInventory, transport: Callable[[str], Transport]) -> None:
        self.inv = inv
        self.transport = transport
        self._hosts: dict[str, str | None] = {}
        self._weights: dict[tuple[str, str], str | None] = {}
        self._baselines: dict[str, Identity] = {}

    def host_id(self, host: str) -> str | None:
        if host not in self._hosts:
            self._hosts[host] = probe_host_identity(self.transport(host))
        return self._hosts[host]

    def weights(self, host: str, path: str | None) -> str | None:
        if path is None:
            return None
        if (host, path) not in self._weights:
            self._weights[(host, path)] = probe_weights(self.transport(host), path)
        return self._weights[(host, path)]

    def bind(self, name: str, prov: Provenance) -> Provenance:
        host = self.inv.backends[name].host
        return prov.model_copy(
            update={
                "weights": self.weights(host, prov.model_path),
                "host_id": self.host_id(host),
            }
        )

    def bind_baseline(self, prov: Provenance, baseline: Provenance) -> Provenance:
        return prov.model_copy(
            update={"baseline_weights": baseline.weights, "baseline_host_id": baseline.host_id}
        )

    def bind_result(self, result: GateResult) -> GateResult:
        """A result about to be recorded, bound to what its backend (and the baseline it was
        compared with) serve now, as the engine describes itself."""
        prov = self.bind(result.backend, result.provenance)
        if result.baseline is not None:
            if result.baseline not in self._baselines:
                self._baselines.update(identify_backends(self.inv, {result.baseline}))
            prov = self.bind_baseline(prov, self._baselines[result.baseline].provenance)
        return result.model_copy(update={"provenance": prov})


@dataclass(frozen=True)
class Identity:
    """What a backend is now, to hold evidence against: the engine's own word when it answers
    (`live`), else what the inventory declares, with the reason it is not live."""

    provenance: Provenance
    live: bool
    note: str | None = None


def identify_backends(
    inv: LoadedInventory, names: Iterable[str], *, timeout_s: float = 15.0
) -> dict[str, Identity]:
    """Ask every backend what it serves, in parallel; one that does not answer in time is
    described by the inventory alone."""
    wanted = sorted(set(names))
    _check_names(inv, *wanted)
    with TransportPool(inv) as pool:
        binder = Binder(inv, pool.get)

        def ask(name: str) -> Identity:
            spec = inv.backends[name]
            try:
                with make_backend(
                    name,
                    spec,
                    api_key=inv.api_key(name),
                    transport=pool.get(spec.host),
                    timeout=timeout_s,
                ) as be:
                    # An engine that describes itself but is not ready (503: wedged, loading,
                    # draining) serves nobody: its word is not taken as "answering".
                    health = be.health() if isinstance(be, HttpBackend) else None
                    if health is not None and health.state != "up":
                        return Identity(
                            binder.bind(name, provenance_for(inv, name, None, None)),
                            live=False,
                            note=f"{name} is not ready ({health.detail or health.state}); "
                            "held to the inventory",
                        )
                    info = be.info()
            except KdctlError as exc:
                return Identity(
                    binder.bind(name, provenance_for(inv, name, None, None)),
                    live=False,
                    note=f"{name} did not say what it serves ({exc}); held to the inventory",
                )
            return Identity(binder.bind(name, provenance_for(inv, name, info, None)), live=True)

        outcomes = fan_out(ask, wanted, max_workers=8, deadline_s=timeout_s + 5)
    found = {}
    for name in wanted:
        out = outcomes[name]
        if isinstance(out.value, Identity):
            found[name] = out.value
        else:
            why = "no answer in time" if out.timed_out else str(out.error)
            found[name] = Identity(
                provenance_for(inv, name, None, None),
                live=False,
                note=f"{name} did not say what it serves ({why}); held to the inventory",
            )
    return found
