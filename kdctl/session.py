"""One command's connections, and what it learned of the engines, built once and shared.

As an httpx `Client` owns its connection pool, a `Session` owns one transport per host and
hands out backends bound to them. Status, the assessment, gates, cutover and rollback take the
same one, so a command opens one SSH connection per host and asks each engine who it is once
(again only after the command itself started or stopped it).

It also says how HTTP reaches each SSH host's engines and router (the host's `http:`): their
URLs are registered with kdctl's HTTP clients for the life of the session, carried where needed
by channels of the same one connection per host (kdctl/_httpclient.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType

import httpx

from kdctl._httpclient import ChannelOpener, TcpChannel, Tunnels
from kdctl.backends import Backend, HttpBackend, make_backend
from kdctl.checks import Baseline, GateResult, Provenance, provenance_for
from kdctl.errors import InputError, KdctlError
from kdctl.evidence import EvidenceStore
from kdctl.inventory import LoadedInventory
from kdctl.probes.identity import probe_executable, probe_host_identity, probe_weights
from kdctl.transports import Transport, TransportPool, fan_out


@dataclass(frozen=True)
class Identity:
    """What a backend is now, to hold evidence against: the engine's own word when it answers
    (`live`), else what the inventory declares, with the reason it is not live."""

    provenance: Provenance
    live: bool
    note: str | None = None


# What a command-mode engine last said it was, from the evidence: its provenance, and where
# that was read (e.g. "exactness result of 2026-12-01 09:12").
Recorded = Callable[[str], tuple[Provenance, str] | None]
# How a person has a command-mode engine's binary run to ask it: status, phases and report alike.
_DEEP = "kdctl status --deep runs it, as phases --deep and report --deep do"


class Session:
    def __init__(self, inventory: LoadedInventory, *, recorded: Recorded | None = None) -> None:
        """`recorded`: where given, an engine in command mode is not run to ask who it is
        (its binary loads a model on the GPUs that serve); it is described by its newest
        recorded identity instead, said as such."""
        self.inventory = inventory
        self.pool = TransportPool(inventory)
        self._identities: dict[str, Identity] = {}
        self.binder = Binder(self)
        self.recorded = recorded
        self.tunnels = Tunnels()
        try:
            self._route_http()
        except InputError:
            self.tunnels.close()
            raise

    def _route_http(self) -> None:
        """Register every engine's and the router's URL on a host whose HTTP may go through
        its SSH connection; nothing is dialled until a request is sent."""
        inv = self.inventory
        places = [(b.url, b.host) for b in inv.backends.values() if b.url]
        router = inv.spec.router
        if router is not None:
            places.append((router.front_url(inv.hosts[router.host]), router.host))
        # Places reached directly first: a tunnel that would take one of their URLs is refused.
        for url, host in sorted(places, key=lambda p: self._tunnelled(p[1])):
            spec = inv.hosts[host]
            if not self._tunnelled(host):
                self.tunnels.claim(url, host)
                continue
            assert spec.http != "direct"
            self.tunnels.add(
                url,
                via=host,
                mode=spec.http,
                ssh_address=spec.address,
                opener=self._opener(host),
            )

    def _tunnelled(self, host: str) -> bool:
        spec = self.inventory.hosts[host]
        return spec.transport == "ssh" and spec.http != "direct"

    def _opener(self, host: str) -> ChannelOpener:
        def open_channel(address: str, port: int, timeout: float) -> TcpChannel:
            return self.pool.get(host).open_channel(address, port, timeout=timeout)

        return open_channel

    def transport(self, host: str) -> Transport:
        return self.pool.get(host)

    def backend(
        self, name: str, *, timeout: float | None = None, client: httpx.Client | None = None
    ) -> Backend:
        """The inventory's backend `name`, with its key and its host's transport."""
        check_names(self.inventory, name)
        spec = self.inventory.backends[name]
        return make_backend(
            name,
            spec,
            api_key=self.inventory.api_key(name),
            transport=self.pool.get(spec.host),
            timeout=timeout,
            client=client,
        )

    def identify(self, names: Iterable[str], *, timeout_s: float = 15.0) -> dict[str, Identity]:
        """Who each engine is now, asked once per session and in parallel; one that does not
        answer in time is described by the inventory alone."""
        wanted = sorted(set(names))
        check_names(self.inventory, *wanted)
        missing = [n for n in wanted if n not in self._identities]
        if missing:
            outcomes = fan_out(
                lambda n: self._ask(n, timeout_s), missing, max_workers=8, deadline_s=timeout_s + 5
            )
            for name in missing:
                out = outcomes[name]
                if isinstance(out.value, Identity):
                    self._identities[name] = out.value
                else:
                    why = "no answer in time" if out.timed_out else str(out.error)
                    self._identities[name] = self._declared(
                        name, f"{name} did not say what it serves ({why}); held to the inventory"
                    )
        return {n: self._identities[n] for n in wanted}

    def remember(self, identities: dict[str, Identity]) -> None:
        """What the caller has just measured, so that it is not asked again."""
        self._identities.update(identities)

    def forget(self, name: str) -> None:
        """The engine was started or stopped: who it is must be asked again."""
        self._identities.pop(name, None)

    def forget_all(self) -> None:
        """Time has passed (a person's answer awaited): every engine, host and checkpoint is
        asked again, since any of them may have been replaced meanwhile."""
        self._identities.clear()
        self.binder = Binder(self)

    def _declared(self, name: str, note: str) -> Identity:
        prov = provenance_for(self.inventory, name, None, None)
        return Identity(self.binder.bind(name, prov), live=False, note=note)

    def _ask(self, name: str, timeout_s: float) -> Identity:
        spec = self.inventory.backends[name]
        if self.recorded is not None and spec.kind == "native" and spec.mode == "command":
            return self._as_recorded(name)
        try:
            with self.backend(name, timeout=timeout_s) as be:
                # An engine that describes itself but is not ready (503: wedged, loading,
                # draining) serves nobody: its word is not taken as "answering".
                health = be.health() if isinstance(be, HttpBackend) else None
                if health is not None and health.state != "up":
                    return self._declared(
                        name,
                        f"{name} is not ready ({health.detail or health.state}); "
                        "held to the inventory",
                    )
                info = be.info()
        except KdctlError as exc:
            return self._declared(
                name, f"{name} did not say what it serves ({exc}); held to the inventory"
            )
        prov = provenance_for(self.inventory, name, info, None)
        return Identity(self.binder.bind(name, prov), live=True)

    def _as_recorded(self, name: str) -> Identity:
        assert self.recorded is not None
        found = self.recorded(name)
        if found is None:
            return self._declared(
                name,
                f"{name} runs in command mode and was not run to ask who it is ({_DEEP}); no "
                "result records it either: held to the inventory",
            )
        recorded, where = found
        # Its build as recorded, on the deployment the inventory declares: a record made on
        # another model or machine must not vouch for this one by matching itself.
        declared = provenance_for(self.inventory, name, None, None)
        prov = declared.model_copy(
            update={
                "engine_version": recorded.engine_version,
                "engine_settings": recorded.engine_settings,
            }
        )
        return Identity(
            self.binder.bind(name, prov),
            live=False,
            note=f"{name} runs in command mode and was not run to ask who it is ({_DEEP}): "
            f"described as its {where} recorded it",
        )

    def close(self) -> None:
        self.tunnels.close()
        self.pool.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


@contextmanager
def using(
    inventory: LoadedInventory, session: Session | None, *, recorded: Recorded | None = None
) -> Iterator[Session]:
    """The caller's session, left open; else one of its own for this call (taking `recorded`),
    closed after it."""
    if session is not None:
        yield session
        return
    with Session(inventory, recorded=recorded) as own:
        yield own


def recorded_identities(inventory: LoadedInventory, store: EvidenceStore) -> Recorded:
    """Who each command-mode engine is by its newest result that recorded its build, for a
    session that does not run binaries to ask (each loads its model). Read here, once: the
    session asks from its own threads, and a store is one thread's."""
    known: dict[str, tuple[Provenance, str] | None] = {}
    for name, spec in inventory.backends.items():
        if spec.kind == "native" and spec.mode == "command":
            newest = (
                r for r in store.results(backend=name, limit=50) if r.provenance.engine_version
            )
            r = next(newest, None)
            known[name] = (
                (r.provenance, f"{r.gate} result of {r.ended_at:%Y-%m-%d %H:%M}") if r else None
            )
    return known.get


def check_names(inv: LoadedInventory, *names: str | None) -> None:
    for name in names:
        if name is not None and name in inv.pools:
            replicas = ", ".join(inv.pools[name])
            raise InputError(f"{name} is a pool: name one of its replicas ({replicas})")
        if name is not None and name not in inv.backends:
            known = ", ".join(sorted(inv.backends)) or "none"
            raise InputError(f"unknown backend {name!r} (known: {known})")


class Binder:
    """Reads, once per host and checkpoint, what a provenance is bound to: the host's own
    identity and the fingerprint of the weights at the model path it names."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self._hosts: dict[str, str | None] = {}
        self._weights: dict[tuple[str, str], str | None] = {}
        self._programs: dict[tuple[str, str], str | None] = {}

    @property
    def _transport(self) -> Callable[[str], Transport]:
        return self.session.transport

    def host_id(self, host: str) -> str | None:
        if host not in self._hosts:
            self._hosts[host] = probe_host_identity(self._transport(host))
        return self._hosts[host]

    def weights(self, host: str, path: str | None) -> str | None:
        if path is None:
            return None
        if (host, path) not in self._weights:
            self._weights[(host, path)] = probe_weights(self._transport(host), path)
        return self._weights[(host, path)]

    def program(self, host: str, argv: list[str]) -> str | None:
        """The fingerprint of a command-mode engine's program on its host."""
        if not argv:
            return None
        if (host, argv[0]) not in self._programs:
            self._programs[(host, argv[0])] = probe_executable(self._transport(host), argv[0])
        return self._programs[(host, argv[0])]

    def bind(self, name: str, prov: Provenance) -> Provenance:
        spec = self.session.inventory.backends[name]
        command = spec.mode == "command"
        return prov.model_copy(
            update={
                "weights": self.weights(spec.host, prov.model_path),
                "host_id": self.host_id(spec.host),
                "engine_binary": self.program(spec.host, spec.command_argv) if command else None,
            }
        )

    def bind_result(self, result: GateResult, recorded: Baseline | None = None) -> GateResult:
        """A result about to be recorded, bound to what its backend serves now, as the engine
        describes itself, and to the baseline it was compared with: the recorded run's own
        identity where it was compared with one (what was measured then, not what serves
        now), else the baseline engine's now."""
        prov = self.bind(result.backend, result.provenance)
        if recorded is not None:
            prov = prov.with_baseline(recorded.provenance)
        elif result.baseline is not None:
            (base,) = self.session.identify([result.baseline]).values()
            prov = prov.with_baseline(base.provenance)
        return result.model_copy(update={"provenance": prov})
