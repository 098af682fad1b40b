"""`kdctl status`: what every host and backend looks like right now, read from live probes."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Literal

import httpx
from pydantic import BaseModel, PrivateAttr, SecretStr, computed_field

from kdctl._httpclient import http_client
from kdctl.backends import HEALTH_TIMEOUT_S, EngineInfo, HealthResult, make_backend, probe_health
from kdctl.backends.health import BackendState
from kdctl.checks import provenance_for
from kdctl.cutover import cutover_in_progress
from kdctl.errors import KdctlError
from kdctl.evidence import EvidenceStore
from kdctl.inventory import BackendSpec, LoadedInventory
from kdctl.probes import (
    GpuProbe,
    ServiceState,
    XidProbe,
    probe_gpus,
    probe_reachability,
    probe_service,
    probe_xids,
)
from kdctl.readiness import Answers, LatestVerdict, assess, latest_verdicts
from kdctl.recording import BaselineCoverage, baseline_coverage
from kdctl.serving import FrontAnswer, ServingProbe, probe_serving
from kdctl.session import Identity, Session, recorded_identities, using
from kdctl.transports import fan_out


class HostStatus(BaseModel):
    name: str
    transport: str
    target: str
    reachable: bool
    connect_ms: float | None = None
    rtt_ms: float | None = None
    error: str | None = None
    gpus: GpuProbe | None = None
    xids: XidProbe | None = None


class BackendStatus(BaseModel):
    name: str
    kind: str
    host: str
    url: str | None
    state: BackendState
    latency_ms: float | None = None
    http_status: int | None = None
    detail: str | None = None
    model: str | None = None
    served_name: str | None = None
    version: str | None = None
    tp_size: int
    # Whether the engine itself reported tp_size; else it is the inventory's figure.
    tp_size_reported: bool = False
    # Whether `model` is the engine's own word, not the inventory's.
    model_reported: bool = False
    context_length: int | None = None
    # Whether the engine decodes speculatively, by its own settings (its algorithm), and its
    # own lifetime count of tokens per verification; None where it does not say.
    speculative: str | None = None
    spec_accept_length: float | None = None
    identity: Literal["live", "declared"] = "declared"
    service: ServiceState | None = None
    # Whether the one-token generation the serving probe sent it succeeded: false, with why
    # in `detail`, for an engine whose health answers and whose generation fails; null where
    # it was not asked (not up) or refused kdctl's key.
    generates: bool | None = None

    @property
    def serves(self) -> bool:
        """Up and not failing its generation: what a pool counts as a replica up."""
        return self.state == "up" and self.generates is not False


class PoolStatus(BaseModel):
    """A pool rolled up from its replicas' own probes: how many of them answer."""

    name: str
    kind: str
    # Its replicas' backend names, in the inventory's order, and those whose health check
    # answered now (on SGLang, a one-token generation).
    replicas: list[str]
    up: list[str]

    @computed_field  # type: ignore[prop-decorator]
    @property
    def summary(self) -> str:
        return f"{len(self.up)}/{len(self.replicas)} replicas up"


def pool_statuses(inventory: LoadedInventory, backends: list[BackendStatus]) -> list[PoolStatus]:
    states = {b.name: b for b in backends}
    return [
        PoolStatus(
            name=pool,
            kind=inventory.backends[names[0]].kind if names else "",
            replicas=list(names),
            up=[n for n in names if n in states and states[n].serves],
        )
        for pool, names in inventory.pools.items()
    ]


class TrafficStatus(BaseModel):
    """The router: the weights its configuration holds (what it is meant to do), and the
    backend that answered a request through its front (what it does)."""

    router: str | None = None
    router_host: str | None = None
    listen: str | None = None
    # The backend that answered through the front just now; null when none did.
    serving: str | None = None
    weights: dict[str, int] = {}
    source: str | None = None
    draining: bool = False
    # False: the configuration was written and not applied (see ServingProbe.routed).
    applied: bool | None = None
    detail: str | None = None
    front: FrontAnswer | None = None
    # The journal's cutover that has not finished, if any: id, from, to, strategy, steps done.
    cutover_in_progress: dict[str, Any] | None = None


class StatusReport(BaseModel):
    inventory: str
    hosts: list[HostStatus]
    backends: list[BackendStatus]
    # Each pool of replicas, rolled up from their rows in `backends`.
    pools: list[PoolStatus] = []
    traffic: TrafficStatus
    # The three answers, and the newest verdict of every gate for every backend.
    answers: Answers | None = None
    gates: list[LatestVerdict] = []
    # The recorded baselines: what each holds, its age, whether it describes the engine now.
    baselines: list[BaselineCoverage] = []
    # The end-to-end probe the traffic line and the serving answer are both built from.
    _serving: ServingProbe | None = PrivateAttr(default=None)

    @property
    def serving(self) -> ServingProbe | None:
        return self._serving

    @property
    def unreachable(self) -> list[str]:
        return [h.name for h in self.hosts if not h.reachable]


class _HostFacts(BaseModel):
    host: HostStatus
    services: dict[str, ServiceState] = {}


def _declared(name: str, spec: BackendSpec) -> BackendStatus:
    """What the inventory says of a backend, before anything answered."""
    return BackendStatus(
        name=name,
        kind=spec.kind,
        host=spec.host,
        url=spec.url,
        state="unknown",
        model=spec.model,
        tp_size=spec.tp_size,
    )


def _identify(
    status: BackendStatus,
    spec: BackendSpec,
    name: str,
    api_key: SecretStr | None,
    client: httpx.Client,
    *,
    timeout: float,
) -> EngineInfo | None:
    """Fill in what the engine says it is, and flag where that contradicts the inventory."""
    try:
        with make_backend(name, spec, api_key=api_key, client=client, timeout=timeout) as be:
            info = be.info()
    except KdctlError as exc:
        status.detail = f"engine info unavailable: {exc}"
        return None
    status.identity = "live"
    status.model = info.model or status.model
    status.model_reported = bool(info.model)
    status.served_name = info.served_name
    status.version = info.version
    status.context_length = info.context_length
    if info.settings is not None and "speculative_algorithm" in info.settings:
        status.speculative = str(info.settings["speculative_algorithm"] or "none")
    status.spec_accept_length = info.spec_accept_length
    notes = []
    if info.tp_size is not None:
        if info.tp_size != spec.tp_size:
            notes.append(f"engine reports TP {info.tp_size}, inventory says {spec.tp_size}")
        status.tp_size = info.tp_size
        status.tp_size_reported = True
    if spec.model and info.model and info.model != spec.model:
        notes.append(f"engine serves {info.model}, inventory says {spec.model}")
    status.detail = "; ".join(notes) or None
    return info


def status_report(
    inventory: LoadedInventory,
    store: EvidenceStore,
    *,
    deadline_s: float = 20.0,
    deep: bool = False,
) -> StatusReport:
    """`kdctl status`: the live probes, then the three answers from the same session, so
    every host is dialled and every engine asked who it is once. An engine in command mode
    is run only with `deep`: otherwise who it is comes from its newest recorded identity."""
    with Session(
        inventory, recorded=None if deep else recorded_identities(inventory, store)
    ) as session:
        report = collect_status(inventory, deadline_s=deadline_s, session=session)
        report.answers = assess(
            inventory,
            store,
            timeout_s=min(deadline_s, 15.0),
            serving=report.serving,
            services={b.name: b.service for b in report.backends if b.service is not None},
            session=session,
        ).answers
        identities = session.identify(inventory.backends, timeout_s=min(deadline_s, 15.0))
    for b in report.backends:
        ident = identities.get(b.name)
        if b.url is None and ident is not None:
            # A command-mode engine: who it is, as far as this status knows, and from where.
            b.detail = ident.note if not ident.live else b.detail
            if ident.provenance.engine_version:
                b.version = ident.provenance.engine_version + ("" if ident.live else " (recorded)")
    report.gates = latest_verdicts(inventory, store, identities=identities)
    report.baselines = baseline_coverage(inventory, store, identities)
    return report


def collect_status(
    inventory: LoadedInventory,
    *,
    deadline_s: float = 20.0,
    max_workers: int = 32,
    session: Session | None = None,
) -> StatusReport:
    """Probe every host and backend in parallel; a dead host costs its deadline, no more.
    Who each engine is goes into the session, for the assessment that follows."""
    with using(inventory, session) as s:
        return _collect(inventory, s, deadline_s, max_workers)


def _collect(
    inventory: LoadedInventory, s: Session, deadline_s: float, max_workers: int
) -> StatusReport:
    by_host: dict[str, list[str]] = defaultdict(list)
    for name, backend in inventory.backends.items():
        if backend.service is not None:
            by_host[backend.host].append(name)

    partial: dict[str, HostStatus] = {}
    identities: dict[str, Identity] = {}
    healths: dict[str, HealthResult] = {}
    with http_client() as client:
        binder = s.binder

        def host_probe(name: str) -> _HostFacts:
            spec = inventory.hosts[name]
            transport = s.transport(name)
            reach = probe_reachability(transport, timeout=deadline_s)
            status = HostStatus(
                name=name,
                transport=spec.transport,
                target=spec.target,
                **reach.model_dump(),
            )
            if not reach.reachable:
                return _HostFacts(host=status)
            # Known reachable from here on: a probe that hangs or breaks later (nvidia-smi
            # stuck after an Xid 79) must not turn the host into "unreachable".
            partial[name] = status
            services: dict[str, ServiceState] = {}
            try:
                status.gpus = probe_gpus(transport, timeout=deadline_s)
                status.xids = probe_xids(transport, timeout=deadline_s)
                for backend_name in by_host.get(name, []):
                    service = inventory.backends[backend_name].service
                    assert service is not None
                    services[backend_name] = probe_service(transport, service, timeout=deadline_s)
            except Exception as exc:
                status.error = f"probe failed: {type(exc).__name__}: {exc}"
            return _HostFacts(host=status, services=services)

        def backend_probe(name: str) -> BackendStatus:
            spec = inventory.backends[name]
            base = _declared(name, spec)
            if spec.url is None:
                base.detail = "no URL: not a served engine"
                return base
            api_key = inventory.api_key(name)
            health = probe_health(
                client, spec.url, api_key=api_key, timeout=min(deadline_s, HEALTH_TIMEOUT_S)
            )
            healths[name] = health
            status = base.model_copy(
                update=health.model_dump(exclude={"status_code"})
                | {"http_status": health.status_code}
            )
            info = None
            if health.state == "up":
                info = _identify(status, spec, name, api_key, client, timeout=min(deadline_s, 10.0))
            identities[name] = (
                Identity(binder.bind(name, provenance_for(inventory, name, info, None)), live=True)
                if info is not None
                else Identity(
                    binder.bind(name, provenance_for(inventory, name, None, None)),
                    live=False,
                    note=(
                        f"{name} did not say what it serves ({status.detail or health.state}); "
                        "held to the inventory"
                    ),
                )
            )
            return status

        # Hosts and backends go out together: a slow engine should not wait behind SSH.
        jobs = [("host", h) for h in inventory.hosts] + [("backend", b) for b in inventory.backends]

        def probe(job: str) -> _HostFacts | BackendStatus:
            kind, _, name = job.partition(":")
            return host_probe(name) if kind == "host" else backend_probe(name)

        outcomes = fan_out(
            probe, [f"{k}:{n}" for k, n in jobs], max_workers=max_workers, deadline_s=deadline_s
        )

    hosts: list[HostStatus] = []
    services: dict[str, ServiceState] = {}
    for name, host_spec in inventory.hosts.items():
        out = outcomes[f"host:{name}"]
        if isinstance(out.value, _HostFacts):
            hosts.append(out.value.host)
            services.update(out.value.services)
        elif name in partial:
            late = partial[name].model_copy()
            late.error = f"reachable, but its probes did not finish within {deadline_s:g}s"
            hosts.append(late)
        else:
            why = (
                f"no answer within {deadline_s:g}s"
                if out.timed_out
                else f"probe failed: {out.error}"
            )
            hosts.append(
                HostStatus(
                    name=name,
                    transport=host_spec.transport,
                    target=host_spec.target,
                    reachable=False,
                    error=why,
                )
            )
    backends: list[BackendStatus] = []
    for name, backend_spec in inventory.backends.items():
        out = outcomes[f"backend:{name}"]
        if isinstance(out.value, BackendStatus):
            status = out.value
        else:
            status = _declared(name, backend_spec)
            status.detail = f"no answer within {deadline_s:g}s" if out.timed_out else str(out.error)
        status.service = services.get(name)
        svc = status.service
        if status.state == "down" and svc is not None and svc.state == "running":
            # SGLang listens only once its weights are loaded: a refused connection from an
            # engine whose process runs is an engine starting, not one that is down.
            status.state = "starting"
            status.detail = f"nothing listens yet, but its {svc.kind} service runs (loading?)"
        backends.append(status)

    serving = probe_serving(
        inventory,
        session=s,
        health={
            n: h
            for n, h in healths.items()
            if isinstance(outcomes[f"backend:{n}"].value, BackendStatus)
        },
        services=services,
        timeout_s=min(deadline_s, 5.0),
    )
    # The front-door probe asked each host whether an engine that refused from here listens
    # there: such an engine is out of reach from here, not down, nor starting.
    answered = {e.name: e for e in serving.engines}
    for status in backends:
        e = answered.get(status.name)
        if e is not None and e.unreachable:
            status.state, status.detail = "unknown", e.detail
            continue
        if e is not None and status.state == "up":
            status.generates = e.generated
            if e.generated is False:
                status.detail = e.detail
        if e is not None and e.reached and status.detail is None:
            status.detail = e.reached
    report = StatusReport(
        inventory=str(inventory.path),
        hosts=hosts,
        backends=backends,
        pools=pool_statuses(inventory, backends),
        traffic=traffic_status(inventory, serving),
    )
    report._serving = serving
    # Only what finished within the deadline: a backend still being asked is asked again.
    s.remember(
        {
            name: ident
            for name, ident in identities.items()
            if isinstance(outcomes[f"backend:{name}"].value, BackendStatus)
        }
    )
    return report


def traffic_status(inventory: LoadedInventory, serving: ServingProbe) -> TrafficStatus:
    """The router's configured weights beside who answered through its front, and any cutover
    the journal left open."""
    router = inventory.spec.router
    if router is None:
        return TrafficStatus()
    routed = serving.routed
    traffic = TrafficStatus(
        router=router.kind,
        router_host=router.host,
        listen=router.listen,
        serving=serving.backend if serving.answered else None,
        front=serving.front,
    )
    if routed is not None:
        traffic.weights, traffic.source, traffic.draining, traffic.applied = (
            routed.weights,
            routed.source,
            routed.draining,
            routed.applied,
        )
        if routed.error:
            traffic.detail = f"router not read back ({routed.error})"
    traffic.cutover_in_progress = cutover_in_progress(
        inventory, routed.weights if routed is not None else {}
    )
    return traffic
