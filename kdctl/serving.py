"""Who serves right now, measured end to end: a real request through the router's front door,
and every backend the router weights asked directly on its own URL.

The router's configuration says what it is meant to do; only an answer through its front says
what it does. Nothing here is taken from the inventory's `serving:` or from a file alone.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import httpx
from pydantic import BaseModel, SecretStr

from kdctl._httpclient import direct_failure, http_client, origin_of, reach
from kdctl.backends import GenerateRequest, HealthResult, make_backend, probe_health
from kdctl.backends.errors import (
    BackendAuthError,
    BackendError,
    BackendHTTPError,
    BackendNotReady,
    BackendTimeout,
    BackendUnavailable,
)
from kdctl.backends.health import BackendState, Failure
from kdctl.errors import InputError, KdctlError
from kdctl.evidence import shared_url
from kdctl.inventory import LoadedInventory
from kdctl.probes import ServiceState
from kdctl.probes.listening import probe_listening
from kdctl.session import Session, using
from kdctl.traffic import Router, make_router, open_journal, router_class

ServingState = Literal["serving", "degraded", "nothing", "unknown"]

# A one-token greedy generation: the cheapest request that proves an engine serves, not only
# that its HTTP server is up. Token 1 exists in every vocabulary.
_PROBE = GenerateRequest(input_ids=[1], max_new_tokens=1, temperature=0.0)


class Routed(BaseModel):
    """The router's weights as read back, and where from. For nginx that is the file kdctl
    wrote: what the router is meant to do, not proof of what it does."""

    weights: dict[str, int] = {}
    source: str | None = None
    draining: bool = False
    # False: the file was written and never applied, so the router still runs what it last
    # loaded; null: the router keeps no record to compare with.
    applied: bool | None = None
    error: str | None = None

    def unknown_workers(self, inv: LoadedInventory) -> list[str]:
        """Workers given traffic by an address no backend has: what they serve is unknown."""
        return sorted(n for n, w in self.weights.items() if w > 0 and n not in inv.backends)


class FrontAnswer(BaseModel):
    """One real request through the router's listen address."""

    url: str
    route: str | None = None
    answered: bool | None
    backend: str | None = None
    status_code: int | None = None
    latency_ms: float | None = None
    detail: str
    # Why nothing answered, where nothing did: refused, unreachable or timeout.
    failure: Failure | None = None
    # How the request travelled where it went through SSH ("reached through SSH to box").
    reached: str | None = None


class EngineAnswer(BaseModel):
    """A backend asked directly on its own URL: its health route, then, where that is up, a
    one-token generation, since an HTTP server can answer health while generation is wedged."""

    name: str
    weight: int = 0
    state: BackendState
    # True: it generated; false: it did not (detail says why); null: not asked, or refused
    # kdctl for want of a key.
    generated: bool | None = None
    latency_ms: float | None = None
    detail: str | None = None
    service: str | None = None
    # How the requests travelled where they went through SSH ("reached through SSH to box").
    reached: str | None = None
    # Its URL refuses or times out from here while its host shows it running: whether it
    # serves anyone is not known from here (detail says why), which is not "down".
    unreachable: bool = False

    @property
    def serves(self) -> bool:
        return self.state == "up" and self.generated is not False


class ServingProbe(BaseModel):
    state: ServingState
    # True: the front answered with an engine's answer; false: it refused, timed out or no
    # engine behind it answered; null: not known from here.
    answered: bool | None
    # The backend that answered through the front, else null.
    backend: str | None = None
    router: str | None = None
    listen: str | None = None
    routed: Routed | None = None
    front: FrontAnswer | None = None
    engines: list[EngineAnswer] = []
    detail: str


def probe_serving(
    inv: LoadedInventory,
    *,
    health: Mapping[str, HealthResult] | None = None,
    services: Mapping[str, ServiceState] | None = None,
    timeout_s: float = 5.0,
    session: Session | None = None,
) -> ServingProbe:
    """Ask the front door and the engines. `health` and `services` are what the caller has
    just measured (`kdctl status` probes every backend anyway), so nothing is asked twice."""
    known = dict(health or {})
    spec = inv.spec.router
    with using(inv, session) as s, http_client() as client:

        def engine(name: str, weight: int = 0) -> EngineAnswer:
            url = inv.backends[name].url
            if url is None:
                return EngineAnswer(name=name, weight=weight, state="unknown", detail="no URL")
            if name not in known:
                known[name] = probe_health(
                    client, url, api_key=inv.api_key(name), timeout=timeout_s
                )
            h = known[name]
            svc = (services or {}).get(name)
            generated, detail = (
                _generate_once(s, name, client, timeout_s) if h.state == "up" else (None, None)
            )
            way = reach(url)
            answer = EngineAnswer(
                name=name,
                weight=weight,
                state=h.state,
                generated=generated,
                latency_ms=h.latency_ms,
                detail=detail or h.detail,
                service=_service_text(svc) if svc else None,
                reached=way.note if way is not None else None,
            )
            if h.status_code is None and h.state in ("down", "unknown"):
                why = _out_of_reach(
                    s,
                    url,
                    inv.backends[name].host,
                    h.detail or h.state,
                    timed_out=h.state == "unknown",
                    service=svc,
                    timeout_s=timeout_s,
                )
                if why is not None:
                    answer.state, answer.detail, answer.unreachable = "unknown", why, True
            return answer

        def ask_all(names: Mapping[str, int]) -> list[EngineAnswer]:
            with ThreadPoolExecutor(max_workers=8) as pool:
                return list(pool.map(lambda n: engine(n, names[n]), names))

        if spec is None:
            return _without_router(ask_all({n: 0 for n, b in inv.backends.items() if b.url}))

        routed = Routed()
        router = make_router(inv, s.pool)
        try:
            state = router.read()
        except KdctlError as exc:
            routed.error = str(exc)
        else:
            if state.applied is None and router.writes_then_applies:
                # Only such a router can hold a change written and not applied; others are
                # read live, and their status opens no journal.
                state = state.model_copy(update={"applied": _journal_applied(inv, state.weights)})
            routed = Routed(
                weights=state.weights,
                source=router.describe_source(state),
                draining=state.draining,
                applied=state.applied,
            )
        weighted = {n: w for n, w in routed.weights.items() if w > 0 and n in inv.backends}
        names = list(weighted) + [n for n, b in inv.backends.items() if b.url and n not in weighted]
        engines = ask_all({n: weighted.get(n, 0) for n in names})
        front = _ask_front(
            inv,
            client,
            router,
            weighted,
            engines,
            timeout_s,
            routed.unknown_workers(inv),
        )
        front = _front_reach(s, front, spec.host, timeout_s)
    return _judge(inv, spec.kind, spec.listen, spec.host, routed, front, engines)


def _journal_applied(inv: LoadedInventory, weights: Mapping[str, int]) -> bool | None:
    """Where the router keeps no record of what it runs: False when kdctl's own journal holds
    the newest change to these weights as written and never applied (kdctl stopped between
    the two), else None (not known)."""
    if not shared_url(inv) and not (inv.state_dir / "traffic.sqlite").exists():
        return None  # no journal: nothing was ever written through kdctl here
    try:
        with open_journal(inv) as journal:
            newest = journal.latest()
    except KdctlError:
        return None
    if newest is None:
        return None
    return False if newest.written_not_done() == dict(weights) else None


def _out_of_reach(
    s: Session,
    url: str,
    host: str,
    failure: str,
    *,
    timed_out: bool,
    service: ServiceState | None,
    timeout_s: float,
) -> str | None:
    """Why a URL that refused or timed out from here is out of reach rather than down: its
    host shows the service running or a socket listening on the URL's port. None where the
    host says nothing runs, or could not say, or the failure is the box's own answer (through
    the tunnel the box itself tried and nobody listens), or where a plain connect succeeds
    (a timeout then is an engine that accepts and never answers: hung, not out of reach)."""
    if s.inventory.hosts[host].transport != "ssh":
        return None  # from here is from there: a refusal is the host's own answer
    way = reach(url)
    if way is not None and way.box_said is not None:
        return None
    if timed_out:
        if way is not None and way.path == "ssh" and way.tunnel_error is None:
            return None  # the tunnel carried it: the engine took it and did not answer
        if (way is None or way.path == "direct") and direct_failure(url) is None:
            return None
    seen = probe_listening(s.transport(host), origin_of(url)[2], timeout=max(timeout_s, 5.0))
    running = service is not None and service.state == "running"
    if seen.listening:
        evidence = f"a socket listens on {', '.join(seen.addresses)} on {host}"
        if service is not None and running:
            evidence += f" and its service is running ({_service_text(service)})"
    elif seen.listening is None and service is not None and running:
        evidence = f"its service is running ({_service_text(service)})"
    else:
        # Nothing listens there (an engine still loading listens only once loaded), or the
        # host could say nothing: not known to be out of reach.
        return None
    tunnel = f" (no tunnel: {way.tunnel_error})" if way is not None and way.tunnel_error else ""
    return f"unreachable from here: {failure}{tunnel}, while {evidence}"


def _front_reach(s: Session, front: FrontAnswer, host: str, timeout_s: float) -> FrontAnswer:
    """The front door's answer, with how it was reached, and where it refused or timed out
    from here while its host shows a socket listening on its port, not known to serve or not
    (an unreachable front is not a router that refuses)."""
    way = reach(front.url)
    front = front.model_copy(update={"reached": way.note if way is not None else None})
    if front.answered is not False or front.status_code is not None:
        return front
    timed_out = front.failure == "timeout"
    failure = f"no answer within {timeout_s:g}s" if timed_out else "connection refused"
    why = _out_of_reach(
        s, front.url, host, failure, timed_out=timed_out, service=None, timeout_s=timeout_s
    )
    if why is None:
        return front
    return front.model_copy(update={"answered": None, "detail": f"it is {why}"})


def _generate_once(
    session: Session, name: str, client: httpx.Client, timeout_s: float
) -> tuple[bool | None, str | None]:
    try:
        with session.backend(name, client=client, timeout=timeout_s) as be:
            be.generate(_PROBE)
    except BackendAuthError:
        return None, "health answers; generation refuses kdctl's key"
    except BackendError as exc:
        return False, f"health answers, but a one-token generation fails: {exc}"
    except KdctlError as exc:
        return None, f"generation not tried: {exc}"
    return True, None


def _service_text(svc: ServiceState) -> str:
    return f"{svc.kind}: {svc.detail or svc.state}"


def front_api_key(inv: LoadedInventory, weighted: Mapping[str, int]) -> SecretStr | None:
    """The front door's own key where the router needs one, else the key of the backend the
    router weights most (nginx passes the header through to it)."""
    spec = inv.spec.router
    key = inv.router_api_key() if spec is not None else None
    if key is not None:
        return key
    for name, _ in sorted(weighted.items(), key=lambda kv: -kv[1]):
        key = inv.api_key(name)
        if key is not None:
            return key
    return None


# Statuses that say the route is not there, rather than that the engine failed the request.
_ROUTE_MISSING = frozenset({404, 405})


def _health_instead(
    client: httpx.Client,
    url: str,
    key: SecretStr | None,
    timeout_s: float,
    refused: BackendError,
    last: dict[str, httpx.Response],
) -> BackendError | None:
    """Generation refused (a key kdctl lacks, a route the engine lacks): the health route
    still tells whether an engine answers behind the front."""
    last.pop("resp", None)
    h = probe_health(client, url, api_key=key, timeout=timeout_s)
    if h.state == "up":
        return None
    if h.state == "down":
        return BackendUnavailable("front", url, h.detail or "", refused=h.failure == "refused")
    if h.status_code:
        return BackendHTTPError("front", url, h.status_code, h.detail or "")
    if h.failure == "timeout":
        return BackendTimeout("front", url, h.detail or "")
    return refused


def _not_asked(url: str, router: Router, why: str) -> FrontAnswer:
    """The front refused the one-token generation, and its /health is the router's own: no
    engine was heard behind it, so whether one serves is not known from here."""
    return FrontAnswer(
        url=url,
        route="/generate",
        answered=None,
        detail=f"cannot be asked for a generation: {why}; {router.kind}'s own /health answers "
        "whatever its workers do, so it tells nothing of who serves",
    )


def _ask_front(
    inv: LoadedInventory,
    client: httpx.Client,
    router: Router,
    weighted: Mapping[str, int],
    engines: list[EngineAnswer],
    timeout_s: float,
    unknown_workers: Sequence[str] = (),
) -> FrontAnswer:
    """A one-token generation through the front, spoken in the protocol of the backend the
    router weights most; the health route where generation is refused (no key, no route).
    `unknown_workers`: those the router lists that no backend of the inventory is."""
    url = router.front_url
    last: dict[str, httpx.Response] = {}

    def keep(resp: httpx.Response) -> None:
        last["resp"] = resp

    speaker = max(weighted.items(), key=lambda kv: kv[1])[0] if weighted else None
    speaker = speaker or next((e.name for e in engines), None)
    key = front_api_key(inv, weighted)
    started = time.monotonic()
    route = "/generate"
    with http_client(event_hooks={"response": [keep]}) as hooked:
        try:
            if speaker is None:
                raise BackendHTTPError("front", url, 404, "no backend to speak for")
            spec = inv.backends[speaker].model_copy(update={"url": url})
            with make_backend(speaker, spec, api_key=key, client=hooked, timeout=timeout_s) as be:
                be.generate(_PROBE)
            error: BackendError | None = None
        except BackendHTTPError as exc:
            # The engine took the request and failed it: that is what a client gets, whatever
            # its health route says. Only a route it lacks sends the probe to /health.
            error = exc
            if exc.status in _ROUTE_MISSING:
                if router.own_health:
                    return _not_asked(url, router, f"it has no {route} (HTTP {exc.status})")
                route, started = "/health", time.monotonic()
                error = _health_instead(hooked, url, key, timeout_s, exc, last)
        except BackendAuthError as exc:
            if router.own_health:
                return _not_asked(url, router, f"it refused kdctl's key ({exc})")
            route, started = "/health", time.monotonic()
            error = _health_instead(hooked, url, key, timeout_s, exc, last)
        except BackendError as exc:
            error = exc
        except KdctlError as exc:
            return FrontAnswer(url=url, answered=None, detail=f"cannot probe the front: {exc}")
    latency = round((time.monotonic() - started) * 1000, 1)
    resp = last.get("resp")
    up = [e.name for e in engines if e.weight > 0 and e.serves]
    who = router.answered_by(resp, up, unknown_workers) if resp is not None else None
    code = resp.status_code if resp is not None else None
    if error is None:
        return FrontAnswer(
            url=url,
            route=route,
            answered=True,
            backend=who,
            status_code=code,
            latency_ms=latency,
            detail=f"answered {route} in {latency:.0f} ms",
        )
    if isinstance(error, BackendUnavailable):
        if error.refused:
            return FrontAnswer(
                url=url,
                route=route,
                answered=False,
                detail="refuses connections",
                failure="refused",
            )
        # From here the router cannot be reached at all: whether it serves others is unknown.
        return FrontAnswer(
            url=url,
            route=route,
            answered=None,
            detail=f"cannot be reached from here ({error})",
            failure="unreachable",
        )
    if isinstance(error, BackendTimeout):
        return FrontAnswer(
            url=url,
            route=route,
            answered=False,
            detail=f"did not answer within {timeout_s:g}s",
            failure="timeout",
        )
    if isinstance(error, BackendAuthError):
        return FrontAnswer(
            url=url,
            route=route,
            answered=None,
            backend=who,
            status_code=code,
            detail=f"refused kdctl's request (HTTP {code}): no valid API key for the front",
        )
    if isinstance(error, BackendNotReady) or code is not None:
        # The error carries the start of the body, where a drain says so.
        draining = isinstance(error, BackendNotReady) and error.draining
        why = (
            "is draining (503 with Retry-After while engines swap)"
            if draining
            else f"answered HTTP {code}: no engine behind it answered"
            if code in (502, 504)
            else f"answered HTTP {code} to {route}: a client's request fails there"
        )
        return FrontAnswer(
            url=url, route=route, answered=False, backend=who, status_code=code, detail=why
        )
    return FrontAnswer(url=url, route=route, answered=None, detail=f"{error}")


def _without_router(engines: list[EngineAnswer]) -> ServingProbe:
    # One whose generation was not tried (or refused kdctl's key) answered its health only,
    # and is said so: a health is not a generation.
    up = [
        e.name
        + (f" ({e.reached})" if e.reached else "")
        + (f" (health only: {e.detail})" if e.generated is None and e.detail else "")
        for e in engines
        if e.serves
    ]
    others = [f"{e.name} is {_engine_words(e)}" for e in engines if not e.serves]
    if up:
        detail = (
            "no router in the inventory; answering on their own URLs: "
            + ", ".join(up)
            + ("; " + "; ".join(others) if others else "")
        )
        serving = [e.name for e in engines if e.serves]
        return ServingProbe(
            state="serving",
            answered=True,
            backend=serving[0] if len(serving) == 1 else None,
            engines=engines,
            detail=detail,
        )
    if any(e.unreachable for e in engines):
        # One that may be serving cannot be seen from here: "nothing" would be a guess.
        return ServingProbe(
            state="unknown",
            answered=None,
            engines=engines,
            detail="no router in the inventory, and no engine answers here; " + "; ".join(others),
        )
    return ServingProbe(
        state="nothing",
        answered=False,
        engines=engines,
        detail="no router in the inventory, and no engine answers on its own URL"
        + ("; " + "; ".join(others) if others else ""),
    )


def _engine_words(e: EngineAnswer) -> str:
    if e.unreachable and e.detail:
        return e.detail
    words = {"up": "up", "down": "down", "starting": "not ready", "unknown": "not answering"}
    text = "up, not generating" if e.state == "up" and e.generated is False else words[e.state]
    why = [w for w in (e.detail, e.service) if w]
    return f"{text} ({'; '.join(why)})" if why else text


def _split(inv: LoadedInventory, kind: str, weighted: list[EngineAnswer]) -> str:
    """How the router divides traffic among the backends it sends to, a pool's replicas
    summed beside each one's share; a router without weights (SGLang's gateway) gives each
    worker it holds healthy an equal share, so that is what a pool gets, and it is said."""
    each = ", ".join(f"{e.name} {e.weight}%" for e in sorted(weighted, key=lambda e: -e.weight))
    by_pool: dict[str, list[EngineAnswer]] = {}
    for e in weighted:
        pool = inv.pool_of(e.name)
        if pool is not None:
            by_pool.setdefault(pool, []).append(e)
    pools = "; ".join(
        f"{p} {sum(e.weight for e in es)}% on {len(es)} replica{'s' if len(es) > 1 else ''}"
        for p, es in sorted(by_pool.items())
    )
    try:
        by_weight = router_class(kind).capabilities.weights
    except InputError:
        by_weight = True
    how = (
        ""
        if by_weight
        else f": {kind} has no weights, each worker it holds healthy takes an equal share, so a "
        "pool's share is its share of the healthy workers"
    )
    return f"the router splits traffic ({f'{pools}: ' if pools else ''}{each}){how}"


def _judge(
    inv: LoadedInventory,
    kind: str,
    listen: str,
    host: str,
    routed: Routed,
    front: FrontAnswer,
    engines: list[EngineAnswer],
) -> ServingProbe:
    where = (
        f"{host}:{listen.rpartition(':')[2]}" if inv.hosts[host].transport != "local" else listen
    )
    weighted = [e for e in engines if e.weight > 0]
    broken = [e for e in weighted if not e.serves]
    idle_up = [e for e in engines if e.weight == 0 and e.serves and e.name != front.backend]
    notes = [f"{e.name} (weight {e.weight}) is {_engine_words(e)}" for e in broken]
    if routed.error:
        notes.append(f"the router's weights were not read back ({routed.error})")
    if routed.applied is False:
        split = ", ".join(f"{n} {w}%" for n, w in routed.weights.items())
        notes.insert(
            0,
            f"the router's configuration file ({split}) is written, not applied: {kind} still "
            "runs the configuration it last loaded (kdctl cutover --resume applies it, kdctl "
            "rollback undoes it)",
        )
    if routed.error:
        # Without the router's weights, which engines it sends to is not known: an engine that
        # answers and did not answer the probe may be taking its share all the same.
        notes += [f"{e.name} is up (its share of the traffic not known)" for e in idle_up]
    else:
        notes += [f"{e.name} is up and receives no traffic" for e in idle_up]
    unknown_workers = routed.unknown_workers(inv)
    if unknown_workers:
        # Whatever they serve takes its share of the traffic, unseen by the inventory.
        notes.insert(
            0,
            f"the router also sends traffic to {', '.join(unknown_workers)}, which no backend in "
            "the inventory is: which engine answers a request is not known",
        )
    if len(weighted) > 1 and routed.applied is not False:
        # One request lands on one of them: which one answered says nothing of the rest.
        notes.insert(0, _split(inv, kind, weighted))
    base = {
        "router": kind,
        "listen": listen,
        "routed": routed,
        "front": front,
        "engines": engines,
    }

    def tail() -> str:
        return ("; " + "; ".join(notes)) if notes else ""

    if front.answered is True:
        who = front.backend
        stray = who is not None and bool(routed.weights) and who not in {e.name for e in weighted}
        if stray:
            # The front is the truth; the file describes a change the router has not made.
            notes.insert(
                0,
                f"the router's configuration file gives {who} no weight: it is written, "
                "not applied",
            )
        by = who or "an engine the router does not name"
        how = f"; {front.reached}" if front.reached else ""
        head = f"{by} through {kind} on {where} ({front.detail}{how})"
        if broken and not stray:
            return ServingProbe(
                state="degraded",
                answered=True,
                backend=who,
                detail=f"{head}, but part of the traffic fails" + tail(),
                **base,
            )
        return ServingProbe(
            state="serving", answered=True, backend=who, detail=head + tail(), **base
        )
    if front.answered is False:
        lead = f"The router on {where} {front.detail}"
        if front.status_code is not None and weighted and len(broken) < len(weighted):
            return ServingProbe(
                state="degraded",
                answered=False,
                detail=lead + ", though a backend it weights answers directly" + tail(),
                **base,
            )
        return ServingProbe(state="nothing", answered=False, detail=lead + tail(), **base)
    return ServingProbe(
        state="unknown",
        answered=None,
        backend=None,
        detail=f"the router on {where} could not be asked: {front.detail}" + tail(),
        **base,
    )
