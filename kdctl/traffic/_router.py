"""The Router interface: what a traffic driver can do, and the state it reads back."""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import httpx
from pydantic import BaseModel, SecretStr

from kdctl.backends import HEALTH_TIMEOUT_S, GenerateRequest, make_backend
from kdctl.backends.errors import BackendAuthError, BackendError, BackendHTTPError
from kdctl.errors import InfraError
from kdctl.inventory import BackendSpec, LoadedInventory, RouterSpec
from kdctl.transports import Transport

# The header every front names the backend that answered with, so a probe can tell.
BACKEND_HEADER = "X-Kdctl-Backend"


@dataclass(frozen=True)
class Capabilities:
    # Traffic split by weight (a canary); without it, only all-at-once switches (blue-green).
    weights: bool
    blue_green: bool
    # The live state can be read back from the router itself after a write.
    read_back: bool
    # New requests can be refused with 503 and Retry-After while engines swap.
    drain: bool


class RouterState(BaseModel):
    """Weights by backend name, in percent, as the router holds them now."""

    weights: dict[str, int]
    draining: bool = False
    source: str
    # Whether the router runs what `source` holds: False for a file written and never
    # reloaded, None where the router cannot tell (no record of what it last loaded).
    applied: bool | None = None

    @property
    def serving(self) -> list[str]:
        return sorted(n for n, w in self.weights.items() if w > 0)


class RouterError(InfraError):
    pass


class Router(abc.ABC):
    kind: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    # Whether a change is written, then applied as a second step (a file, then a reload), so
    # what it reads back may be written and not yet applied; a router read live runs what it
    # says.
    writes_then_applies: ClassVar[bool] = False
    # Whether the front's /health is the router's own, answering whatever its engines do
    # (SGLang's router: 200 with every worker dead), rather than passed to an engine (nginx):
    # such a health says nothing of who serves.
    own_health: ClassVar[bool] = False
    # How long a change is given to answer a generation through the router.
    confirm_s: ClassVar[float] = 10.0

    def __init__(self, inv: LoadedInventory, spec: RouterSpec, transport: Transport) -> None:
        self.inv = inv
        self.spec = spec
        self.transport = transport

    @property
    def front_url(self) -> str:
        return front_url(self.inv, self.spec)

    @abc.abstractmethod
    def read(self) -> RouterState:
        """The live state, from the router itself."""

    @abc.abstractmethod
    def apply(
        self, weights: dict[str, int], *, on_written: Callable[[], None] | None = None
    ) -> RouterState:
        """Send traffic by `weights` (percent, summing to 100) and return the state read back;
        raise RouterError, with the old state still serving, when the change cannot be made.
        `on_written` is called once the change is written and before it is applied, where
        the router has the two steps (nginx: the file, then the reload)."""

    def drain(self) -> RouterState:
        raise RouterError(f"router {self.kind} cannot drain")

    def set_members(self, names: Sequence[str]) -> RouterState:
        """Send to exactly these backends, in equal shares, and return the state read back and
        confirmed: a pool's replicas, one box taken out or put back at a time. A router with
        weights writes them; one without (SGLang's gateway) changes its worker registry."""
        if not names:
            raise RouterError("a router must send to at least one backend")
        if not self.capabilities.weights and len(names) > 1:
            raise RouterError(f"router {self.kind} cannot send to {len(names)} backends at once")
        self.apply(equal_shares(names))
        return self.confirm(equal_shares(names))

    def confirm(self, weights: dict[str, int], *, deadline_s: float = 10.0) -> RouterState:
        """The live state, checked to send `weights`; RouterError where it does not. A router
        whose read-back is the running router itself needs nothing more; one whose read-back
        is a file (nginx) probes its front too."""
        state = self.read()
        if state.weights != {k: v for k, v in weights.items() if v > 0} or state.draining:
            raise RouterError(f"read back {state.weights}, not {weights}")
        return state

    def _generates(
        self,
        target: str,
        spec: BackendSpec,
        key: SecretStr | None,
        how: str,
        deadline_s: float | None = None,
    ) -> None:
        """A one-token generation from `target` at `spec.url`, tried until the deadline; a
        refusal that trying again cannot change (a key, a bad request) ends it at once."""
        limit = self.confirm_s if deadline_s is None else deadline_s
        deadline = time.monotonic() + limit
        while True:
            left = max(deadline - time.monotonic(), 0.5)
            try:
                with make_backend(target, spec, api_key=key, timeout=left) as be:
                    be.generate(GenerateRequest(input_ids=[1], max_new_tokens=1))
                return
            except BackendError as exc:
                final = isinstance(exc, BackendAuthError) or (
                    isinstance(exc, BackendHTTPError) and 400 <= exc.status < 500
                )
                if final or time.monotonic() >= deadline:
                    raise RouterError(
                        f"{self.kind} at {self.front_url}: no generation from {target} {how} "
                        f"succeeded within {limit:g}s: {exc}"
                    ) from None
            time.sleep(0.2)

    def _generates_through(
        self, front: str, target: str, how: str, deadline_s: float | None = None
    ) -> None:
        """A one-token generation from `target` through the front at `front`, in its protocol
        and with the key a client sends there: the router's own, else the engine's."""
        spec = self.inv.backends[target].model_copy(update={"url": front})
        key = self.inv.router_api_key() or self.inv.api_key(target)
        self._generates(target, spec, key, how, deadline_s)

    def describe_source(self, state: RouterState) -> str:
        """Where the weights read back came from, as status says it."""
        return state.source

    def answered_by(
        self, resp: httpx.Response, serving: Sequence[str], unknown_workers: Sequence[str] = ()
    ) -> str | None:
        """The backend whose answer `resp` came back through the front, where it can be told;
        `serving`: the backends given traffic that answer on their own URLs. A router that
        names no backend per answer: the one such backend, when there is exactly one and the
        router lists no worker unknown to the inventory."""
        return serving[0] if len(serving) == 1 and not unknown_workers else None

    def probe(self, client: httpx.Client, path: str = "/health") -> str | None:
        """Which backend answered one request through the front (None when none did). The
        front names the upstream it tried on every answer, a 502 of a dead one included: only
        a success is an answer from it."""
        try:
            r = client.get(self.front_url + path, timeout=HEALTH_TIMEOUT_S)
        except httpx.HTTPError:
            return None
        if not r.is_success:
            return None
        return r.headers.get(BACKEND_HEADER) or None


def equal_shares(names: Sequence[str]) -> dict[str, int]:
    """Percent for each of `names`, as even as whole numbers make them, the remainder to the
    first in name order: the split a registry of equal workers stands for."""
    ordered = sorted(names)
    shares = {n: 100 // len(ordered) for n in ordered}
    for n in ordered[: 100 - sum(shares.values())]:
        shares[n] += 1
    return shares


def front_url(inv: LoadedInventory, spec: RouterSpec) -> str:
    """Where clients reach the router: its listen address, a wildcard one taken as the host's."""
    return spec.front_url(inv.hosts[spec.host])


def check_weights(inv: LoadedInventory, weights: dict[str, int]) -> None:
    from kdctl.errors import InputError

    for name, w in weights.items():
        if name not in inv.backends:
            raise InputError(f"weights: unknown backend {name!r}")
        if not 0 <= w <= 100:
            raise InputError(f"weights: {name} {w} is not between 0 and 100")
    if sum(weights.values()) != 100:
        raise InputError(f"weights {weights} do not sum to 100")
