"""SGLang's router (sglang-router, the SGLang Model Gateway, smg) over its worker registry: add
the new workers, wait until the registry lists them healthy, remove the old ones, wait again,
on every gateway replica the inventory lists, since each keeps a registry of its own. It has no
traffic weights: blue-green only, declared as such; a backend's share is its share of the
healthy workers.

Three generations of the worker API are in the field, found by probing once per gateway
(answers recorded from each release in tests/fixtures/sglang-router/):

- `add_worker` (0.1): `GET /list_workers` lists URLs only; `POST /add_worker?url=` blocks until
  the worker is healthy; `POST /remove_worker?url=` answers 200 whatever it removed.
- `workers-by-url` (0.2): `GET /workers` with each worker's id its URL; `POST /workers` and
  `DELETE /workers/{url}` answer 202 for a queued job, for an unknown worker too.
- `workers-by-id` (0.3, smg): the same routes with UUID worker ids.

A 202, or a 200 from `remove_worker`, is a request, not a result: every change is confirmed by
reading the registry back, and a failed job shows nowhere for long.
"""

from __future__ import annotations

import abc
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar
from urllib.parse import quote

import httpx

from kdctl._httpclient import http_client
from kdctl.backends import bearer
from kdctl.inventory import LoadedInventory, RouterSpec, SGLangRouterSpec
from kdctl.traffic._router import (
    Capabilities,
    Router,
    RouterError,
    RouterState,
    check_weights,
    equal_shares,
)
from kdctl.transports import Transport


def router_argv(
    port: int, workers: Sequence[str], *, prometheus_port: int, api_key: str | None = None
) -> list[str]:
    """The command line that starts SGLang's router on loopback in front of `workers`, round
    robin: what the sandbox, a benchmark or a test runs. Its metrics listener defaults to port
    29000, so a second router on one machine needs its own. With `api_key`, the router requires
    it of every client (its flag is the only way in: keep such a router's host to yourself)."""
    argv = [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *workers,
        "--policy",
        "round_robin",
        "--prometheus-port",
        str(prometheus_port),
    ]
    return argv if api_key is None else [*argv, "--api-key", api_key]


@dataclass(frozen=True)
class Worker:
    url: str
    # The id the registry addresses it by (its URL before 0.3); None where it has none.
    id: str | None = None
    # None where the registry does not say (`list_workers` lists URLs only).
    healthy: bool | None = None


Call = Callable[..., httpx.Response]


class WorkerApi(abc.ABC):
    """One generation of the gateway's worker API, over one gateway's `call`."""

    generation: ClassVar[str]

    def __init__(self, call: Call, where: str) -> None:
        self._call = call
        self.where = where

    @abc.abstractmethod
    def list(self) -> list[Worker]: ...

    @abc.abstractmethod
    def add(self, url: str) -> str | None:
        """Ask for `url` to be added; RouterError where the gateway refuses. Returns the key
        its job can be asked about by, where it has one."""

    def job_failure(self, key: str) -> str | None:
        """Why the job behind `key` failed, where the gateway says so; None otherwise."""
        return None

    @abc.abstractmethod
    def remove(self, worker: Worker) -> None:
        """Ask for `worker` to be removed; RouterError where the gateway refuses."""

    def _json(self, r: httpx.Response, what: str) -> Any:
        if r.status_code in (401, 403):
            raise RouterError(
                f"{self.where}: {what}: HTTP {r.status_code}: it wants an API key "
                "(router.api_key_env or router.api_key_file)"
            )
        if not r.is_success:
            raise RouterError(f"{self.where}: {what}: HTTP {r.status_code} {r.text[:200]}")
        try:
            return r.json()
        except ValueError as exc:
            raise RouterError(f"{self.where}: {what}: not JSON: {exc}") from None

    def _refused(self, r: httpx.Response, what: str, ok: tuple[int, ...]) -> None:
        if r.status_code not in ok:
            raise RouterError(f"{self.where} refused {what}: HTTP {r.status_code} {r.text[:200]}")


class _AddWorkerApi(WorkerApi):
    generation = "add_worker"

    def list(self) -> list[Worker]:
        r = self._call("GET", "/list_workers")
        if r.status_code == 404:
            raise RouterError(
                f"{self.where} has no worker list (GET /list_workers and GET /workers: 404; "
                "sglang-router 0.1.4 and earlier): a change to it cannot be read back"
            )
        doc = self._json(r, "GET /list_workers")
        try:
            return [Worker(url=str(u)) for u in doc["urls"]]
        except (KeyError, TypeError):
            raise RouterError(f"{self.where}: GET /list_workers: no 'urls' list") from None

    def add(self, url: str) -> str | None:
        # It answers once the worker is healthy, or 400 saying why not (its startup timeout
        # included): given as long as a change is waited for, not one call's time.
        r = self._call("POST", "/add_worker", params={"url": url}, timeout=SGLangRouter.wait_s)
        if not (r.status_code == 400 and "already exists" in r.text):
            self._refused(r, f"worker {url}", (200,))
        return None

    def remove(self, worker: Worker) -> None:
        r = self._call("POST", "/remove_worker", params={"url": worker.url})
        self._refused(r, f"to remove {worker.url}", (200,))


class _WorkersApi(WorkerApi):
    generation = "workers-by-url"

    def list(self) -> list[Worker]:
        doc = self._json(self._call("GET", "/workers"), "GET /workers")
        try:
            return [
                Worker(
                    url=str(w["url"]), id=str(w.get("id") or w["url"]), healthy=w.get("is_healthy")
                )
                for w in doc.get("workers", [])
            ]
        except (KeyError, TypeError, AttributeError):
            raise RouterError(f"{self.where}: GET /workers: not a list of workers") from None

    def add(self, url: str) -> str | None:
        r = self._call("POST", "/workers", json={"url": url})
        # 409: the gateway has it already (smg); earlier ones queue a job that fails quietly.
        self._refused(r, f"worker {url}", (200, 201, 202, 409))
        try:
            key = r.json().get("worker_id")
        except (ValueError, AttributeError):
            key = None
        return str(key) if key else None

    def job_failure(self, key: str) -> str | None:
        # A queued job's fate shows only here, and only for a while (0.2 and 0.3): a 202 is a
        # request, and a worker that never becomes healthy is otherwise only absent.
        r = self._call("GET", "/workers/" + quote(key, safe=""))
        try:
            job = r.json().get("job_status") or {}
        except (ValueError, AttributeError):
            return None
        if r.is_success and isinstance(job, dict) and job.get("status") == "failed":
            return str(job.get("message") or "failed")
        return None

    def remove(self, worker: Worker) -> None:
        ident = quote(worker.id or worker.url, safe="")
        r = self._call("DELETE", f"/workers/{ident}")
        self._refused(r, f"to remove {worker.url}", (200, 202, 204, 404))


class _WorkersByIdApi(_WorkersApi):
    generation = "workers-by-id"


def probe_worker_api(call: Call, where: str) -> WorkerApi:
    """Which generation a gateway speaks, from its own answers: `GET /workers` is missing
    before 0.2; from 0.3 a URL given as a worker id is a bad request (400, "expected UUID"),
    where 0.2 answers 200 for any id. Every listed worker has an `id` from 0.2 on, so the ids
    alone cannot tell the two apart."""
    r = call("GET", "/workers")
    if r.status_code == 404:
        legacy = _AddWorkerApi(call, where)
        legacy.list()  # a gateway that lists no workers at all is refused here, by name
        return legacy
    api = _WorkersApi(call, where)
    workers = api.list()  # its key, its shape: refused here, by name
    # Any URL tells (0.2 answers for one it never had); a listed one is asked where there is.
    url = workers[0].url if workers else "http://127.0.0.1:1"
    probe = call("GET", "/workers/" + quote(url, safe=""))
    return _WorkersByIdApi(call, where) if probe.status_code == 400 else api


class SGLangRouter(Router):
    kind = "sglang-router"
    capabilities: ClassVar[Capabilities] = Capabilities(
        weights=False, blue_green=True, read_back=True, drain=False
    )
    own_health: ClassVar[bool] = True
    wait_s: ClassVar[float] = 60.0
    # One call of the worker API; a router that takes longer is reported, not waited on.
    call_timeout_s: ClassVar[float] = 10.0

    def __init__(self, inv: LoadedInventory, spec: RouterSpec, transport: Transport) -> None:
        super().__init__(inv, spec, transport)
        peers = spec.peers if isinstance(spec, SGLangRouterSpec) else []
        # Every gateway replica's front: the first is the one clients are sent to.
        self.fronts = [self.front_url] + [p.front_url(inv.hosts[p.host]) for p in peers]

    def _client(self, front: str) -> httpx.Client:
        # The router's own key, where it requires one, on its worker API as on its front.
        return http_client(
            resend=False,
            base_url=front,
            timeout=self.call_timeout_s,
            headers=bearer(self.inv.router_api_key()),
        )

    def _api(self, client: httpx.Client, front: str) -> WorkerApi:
        def call(method: str, path: str, **kw: Any) -> httpx.Response:
            """One request to the worker API; a timeout or a refused connection is a
            RouterError naming it, never an untyped httpx error."""
            try:
                return client.request(method, path, **kw)
            except httpx.HTTPError as exc:
                raise RouterError(
                    f"sglang-router at {front}: {method} {path}: {type(exc).__name__}: {exc}"
                ) from None

        return probe_worker_api(call, f"sglang-router at {front}")

    def _names(self) -> dict[str, str]:
        return {
            (spec.url or "").rstrip("/"): name
            for name, spec in self.inv.backends.items()
            if spec.url
        }

    def generations(self) -> dict[str, str]:
        """Each gateway's worker API generation, by its front URL."""
        out = {}
        for front in self.fronts:
            with self._client(front) as client:
                out[front] = self._api(client, front).generation
        return out

    def read(self) -> RouterState:
        """The first gateway's registry; the others' are held to it by `confirm`."""
        with self._client(self.front_url) as client:
            workers = self._api(client, self.front_url).list()
        return self._state([w.url for w in workers], f"{self.front_url}/workers")

    def _state(self, urls: Sequence[str], source: str) -> RouterState:
        # No weights: each worker's share is its share of the registry.
        by_url = self._names()
        names = [by_url.get(u.rstrip("/"), u) for u in urls]
        return RouterState(weights=equal_shares(names) if names else {}, source=source)

    def apply(
        self, weights: dict[str, int], *, on_written: Callable[[], None] | None = None
    ) -> RouterState:
        # The registry applies each change as it takes it: there is no written-only state.
        check_weights(self.inv, weights)
        wanted = [n for n, w in weights.items() if w > 0]
        if len(wanted) != 1 or weights[wanted[0]] != 100:
            raise RouterError(f"sglang-router has no weights: it cannot split traffic {weights}")
        (target,) = wanted
        # Before anything changes: an engine that does not generate is not given traffic, and
        # the router keeps serving what it served.
        self._generates(target, self.inv.backends[target], self.inv.api_key(target), "directly")
        self.set_workers([target])
        return self.confirm({target: 100})

    def set_members(self, names: Sequence[str]) -> RouterState:
        if not names:
            raise RouterError("a router must send to at least one backend")
        for name in names:
            spec = self.inv.backends[name]
            self._generates(name, spec, self.inv.api_key(name), "directly")
        self.set_workers(names)
        return self.confirm(equal_shares(names))

    def set_workers(self, names: Sequence[str]) -> None:
        """Make every gateway's registry hold exactly these backends: each missing one added
        and waited for until listed healthy, and only then the others removed, so that no
        request finds no worker."""
        urls = [(self.inv.backends[n].url or "").rstrip("/") for n in names]
        for front in self.fronts:
            with self._client(front) as client:
                api = self._api(client, front)
                present = {w.url.rstrip("/"): w for w in api.list()}
                for url, name in zip(urls, names, strict=True):
                    if url not in present:
                        key = api.add(url)
                        self._wait(
                            api,
                            _joined(url),
                            f"{name} to join as a healthy worker",
                            job=key,
                        )
                for url, worker in present.items():
                    if url not in urls:
                        api.remove(worker)
                self._wait(
                    api,
                    lambda ws: sorted(w.url.rstrip("/") for w in ws) == sorted(urls),
                    f"only {', '.join(names)} to remain",
                )

    def confirm(self, weights: dict[str, int], *, deadline_s: float | None = None) -> RouterState:
        """Every gateway's registry read back, and then a one-token generation through each
        front: the registry lists a worker whose engine has died until its health checks fail,
        and its `is_healthy` lags as long, so only an answer says the engine serves through
        it."""
        state = super().confirm(weights)
        for front in self.fronts[1:]:
            with self._client(front) as client:
                listed = [w.url for w in self._api(client, front).list()]
            theirs = self._state(listed, f"{front}/workers")
            if theirs.weights != state.weights:
                raise RouterError(
                    f"sglang-router at {front} lists {theirs.serving}, not {state.serving}: "
                    "its registry differs from the first gateway's"
                )
        # In the protocol of the backends it sends to (a pool's replicas speak alike).
        target = state.serving[0]
        for front in self.fronts:
            self._generates_through(front, target, f"through {front}", deadline_s)
        return state

    def _wait(
        self,
        api: WorkerApi,
        done: Callable[[list[Worker]], bool],
        what: str,
        *,
        job: str | None = None,
    ) -> None:
        """Worker changes are queued jobs (or, before 0.2, answered whatever they did): poll
        the registry until it shows the change, or the job says it failed."""
        deadline = time.monotonic() + self.wait_s
        while True:
            workers = api.list()
            if done(workers):
                return
            failed = api.job_failure(job) if job is not None else None
            if failed is not None:
                raise RouterError(f"{api.where}: waiting for {what}, its job failed: {failed}")
            if time.monotonic() > deadline:
                listed = [w.url for w in workers]
                raise RouterError(
                    f"{api.where}: waited {self.wait_s:g}s for {what}; it lists {listed}"
                )
            time.sleep(0.1)


def _joined(url: str) -> Callable[[list[Worker]], bool]:
    """Whether the registry lists `url` and does not call it unhealthy (the oldest API lists
    URLs only, and answered the add once the worker was healthy)."""
    return lambda workers: any(w.url.rstrip("/") == url and w.healthy is not False for w in workers)
