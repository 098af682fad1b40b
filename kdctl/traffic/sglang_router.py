"""SGLang's router (sglang-router, the SGLang Model Gateway) over its worker registry: add the
new worker, wait for its queued job to land and the worker to be healthy, remove the old one,
wait again. It has no traffic weights: blue-green only, declared as such."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar
from urllib.parse import quote

import httpx
from pydantic import SecretStr

from kdctl._httpclient import http_client
from kdctl.backends import GenerateRequest, bearer, make_backend
from kdctl.backends.errors import BackendAuthError, BackendError, BackendHTTPError
from kdctl.inventory import BackendSpec
from kdctl.traffic._router import Capabilities, Router, RouterError, RouterState, check_weights


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


class SGLangRouter(Router):
    kind = "sglang-router"
    capabilities: ClassVar[Capabilities] = Capabilities(
        weights=False, blue_green=True, read_back=True, drain=False
    )
    wait_s: ClassVar[float] = 60.0
    # One call of the worker API; a router that takes longer is reported, not waited on.
    call_timeout_s: ClassVar[float] = 10.0
    # How long a change is given to answer a generation through the router.
    confirm_s: ClassVar[float] = 10.0

    def _client(self) -> httpx.Client:
        # The router's own key, where it requires one, on its worker API as on its front.
        return http_client(
            resend=False,
            base_url=self.front_url,
            timeout=self.call_timeout_s,
            headers=bearer(self.inv.router_api_key()),
        )

    def _call(self, client: httpx.Client, method: str, path: str, **kw: Any) -> httpx.Response:
        """One request to the worker API; a timeout or a refused connection is a RouterError
        naming it, never an untyped httpx error."""
        try:
            return client.request(method, path, **kw)
        except httpx.HTTPError as exc:
            raise RouterError(
                f"sglang-router at {self.front_url}: {method} {path}: {type(exc).__name__}: {exc}"
            ) from None

    def _workers(self, client: httpx.Client) -> list[dict[str, Any]]:
        r = self._call(client, "GET", "/workers")
        if r.status_code in (401, 403):
            raise RouterError(
                f"sglang-router at {self.front_url}: GET /workers: HTTP {r.status_code}: it "
                "wants an API key (router.api_key_env or router.api_key_file)"
            )
        try:
            r.raise_for_status()
            return list(r.json().get("workers", []))
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            raise RouterError(f"sglang-router at {self.front_url}: GET /workers: {exc}") from None

    def _names(self) -> dict[str, str]:
        return {
            (spec.url or "").rstrip("/"): name
            for name, spec in self.inv.backends.items()
            if spec.url
        }

    def read(self) -> RouterState:
        with self._client() as client:
            workers = self._workers(client)
        by_url = self._names()
        names = sorted(by_url.get(w["url"].rstrip("/"), w["url"]) for w in workers)
        weights = {n: 100 // len(names) for n in names} if names else {}
        if names:
            weights[names[0]] += 100 - sum(weights.values())
        return RouterState(weights=weights, source=f"{self.front_url}/workers")

    def apply(
        self, weights: dict[str, int], *, on_written: Callable[[], None] | None = None
    ) -> RouterState:
        # The registry applies each change as it takes it: there is no written-only state.
        check_weights(self.inv, weights)
        wanted = [n for n, w in weights.items() if w > 0]
        if len(wanted) != 1 or weights[wanted[0]] != 100:
            raise RouterError(f"sglang-router has no weights: it cannot split traffic {weights}")
        (target,) = wanted
        url = (self.inv.backends[target].url or "").rstrip("/")
        # Before anything changes: an engine that does not generate is not given traffic, and
        # the router keeps serving what it served.
        self._generates(target, self.inv.backends[target], self.inv.api_key(target), "directly")
        with self._client() as client:
            present = {w["url"].rstrip("/"): w for w in self._workers(client)}
            if url not in present:
                r = self._call(client, "POST", "/workers", json={"url": url})
                if r.status_code not in (200, 201, 202):
                    raise RouterError(
                        f"sglang-router refused worker {url}: HTTP {r.status_code} {r.text[:200]}"
                    )
                self._wait(
                    client,
                    lambda ws: any(w["url"].rstrip("/") == url and w.get("is_healthy") for w in ws),
                    f"{target} to join as a healthy worker",
                )
            # The new worker serves before the old one leaves: no request finds none.
            for old_url, w in present.items():
                if old_url == url:
                    continue
                ident = w.get("id") or quote(old_url, safe="")
                r = self._call(client, "DELETE", f"/workers/{ident}")
                if r.status_code not in (200, 202, 204):
                    raise RouterError(
                        f"sglang-router refused to remove {old_url}: HTTP {r.status_code}"
                    )
            self._wait(
                client,
                lambda ws: [w["url"].rstrip("/") for w in ws] == [url],
                f"only {target} to remain",
            )
        return self.confirm({target: 100})

    def confirm(self, weights: dict[str, int], *, deadline_s: float | None = None) -> RouterState:
        """The registry read back, and then a one-token generation through the front: the
        registry lists a worker whose engine has died until its health checks fail, and its
        `is_healthy` lags as long, so only an answer says the engine serves through it."""
        state = super().confirm(weights)
        (target,) = state.serving
        spec = self.inv.backends[target].model_copy(update={"url": self.front_url})
        # What a client sends through it: the router's own key, else the engine's.
        key = self.inv.router_api_key() or self.inv.api_key(target)
        self._generates(target, spec, key, "through it", deadline_s)
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
                        f"sglang-router at {self.front_url}: no generation from {target} {how} "
                        f"succeeded within {limit:g}s: {exc}"
                    ) from None
            time.sleep(0.2)

    def _wait(self, client: httpx.Client, done: Any, what: str) -> None:
        """Worker changes are queued jobs: poll the registry until it shows the change."""
        deadline = time.monotonic() + self.wait_s
        while True:
            workers = self._workers(client)
            if done(workers):
                return
            if time.monotonic() > deadline:
                listed = [w["url"] for w in workers]
                raise RouterError(
                    f"sglang-router: waited {self.wait_s:g}s for {what}; it lists {listed}"
                )
            time.sleep(0.1)
