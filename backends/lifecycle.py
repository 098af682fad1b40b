"""Starting and stopping an engine through its service, on its host's transport.

These are operations: they change a host. Each one is idempotent (starting a running engine or
stopping a stopped one does nothing and says so) and quotes every value it sends to the shell.
"""

from __future__ import annotations

import re
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import SecretStr

from kdctl.backends.errors import BackendError, BackendTimeout
from kdctl.backends.health import HealthResult
from kdctl.inventory import BackendSpec, CommandService, SystemdService, resolve_service_env
from kdctl.probes import ServiceState, probe_service
from kdctl.transports import Transport

_KEY_ARGS = re.compile(r"""((?:--)?api[_-]key['"]?\s*[=:]?\s*['"]?)[^\s'",)]+""", re.IGNORECASE)


@dataclass(frozen=True)
class LifecycleResult:
    action: str
    changed: bool
    state: ServiceState
    detail: str = ""


class ServiceControl:
    def __init__(
        self,
        name: str,
        spec: BackendSpec,
        transport: Transport,
        health: Callable[[], HealthResult],
        api_key: SecretStr | None = None,
    ) -> None:
        if spec.service is None:
            raise BackendError(name, spec.url or name, "has no service to start or stop")
        self.name = name
        self.spec = spec
        self.service: SystemdService | CommandService = spec.service
        self.transport = transport
        self._health = health
        self.api_key = api_key

    @property
    def where(self) -> str:
        return self.spec.url or self.name

    def state(self) -> ServiceState:
        return probe_service(self.transport, self.service)

    def _systemctl(self, verb: str) -> None:
        assert isinstance(self.service, SystemdService)
        argv = ["systemctl"] + (["--user"] if self.service.scope == "user" else [])
        result = self.transport.run([*argv, verb, "--", self.service.systemd], timeout=120)
        if not result.ok:
            raise BackendError(
                self.name, self.where, f"systemctl {verb} failed: {result.stderr.strip()[-300:]}"
            )

    def _known(self, action: str) -> ServiceState:
        state = self.state()
        if state.state == "unknown":
            # Acting blind could start a second engine on the same GPUs or orphan the first.
            raise BackendError(
                self.name, self.where, f"cannot {action}: service state unknown ({state.detail})"
            )
        return state

    def start(self) -> LifecycleResult:
        before = self._known("start")
        if before.state in ("running", "starting"):
            return LifecycleResult("start", False, before, "already running")
        if isinstance(self.service, SystemdService):
            self._systemctl("start")
        else:
            self._spawn(self.service)
        return LifecycleResult("start", True, self.state())

    def _spawn(self, svc: CommandService) -> None:
        # setsid: the engine outlives the SSH session and leads its own process group, so stop
        # can signal it together with its children (tokenizer workers, TP ranks).
        # Names are validated identifiers (inventory); values are quoted. As assignments before
        # the command they reach the engine's environment without `env`, which would take a
        # program name containing "=" for one more assignment.
        values = resolve_service_env(self.name, svc)
        env = "".join(f"{k}={shlex.quote(v)} " for k, v in sorted(values.items()))
        # The engine writes its own pid ($$ of the shell that then execs it): `$!` after `&`
        # names a subshell under bash, which would leave a pidfile pointing at the wrong process.
        inner = 'echo $$ > "$1" && shift && exec "$@"'
        pidfile = shlex.quote(svc.pidfile)
        script = (
            f"cd -- {shlex.quote(svc.workdir or '/')} || exit 1\n"
            f": >> {shlex.quote(svc.log)} || exit 1\n"
            f"{env}setsid sh -c {shlex.quote(inner)} sh {pidfile} "
            f"{shlex.join(svc.argv)} >> {shlex.quote(svc.log)} 2>&1 < /dev/null &\n"
            # Done once the pid runs the engine: until the wrapper's exec, /proc shows the
            # wrapper's own command line, which a state probe would take for a reused pid.
            f"i=0; while [ $i -lt 50 ]; do\n"
            f"  if [ -s {pidfile} ]; then\n"
            f'    pid=$(cat {pidfile}); tr "\\000" "\\n" < "/proc/$pid/cmdline" 2>/dev/null'
            f" | grep -qxF -- {shlex.quote(inner)} || exit 0\n"
            f"  fi\n  sleep 0.1; i=$((i + 1))\ndone\nexit 1"
        )
        # On stdin, not in argv: the values (a hub token) would show in `ps` on the host.
        result = self.transport.run(["sh", "-s"], stdin=script.encode(), timeout=60)
        if not result.ok:
            why = result.stderr.strip()[-300:] or "the engine had not started within 5s"
            raise BackendError(
                self.name, self.where, f"could not start: {why}; last log lines:\n{self.log_tail()}"
            )

    def stop(self, *, grace_s: float = 20.0) -> LifecycleResult:
        before = self._known("stop")
        if isinstance(self.service, SystemdService):
            if before.state == "stopped":
                return LifecycleResult("stop", False, before, "not running")
            self._systemctl("stop")
            return LifecycleResult("stop", True, self.state())
        svc = self.service
        if before.state != "running" or before.pid is None:
            self.transport.run(["rm", "-f", "--", svc.pidfile], timeout=30)
            return LifecycleResult("stop", False, before, "not running")
        group = f"-{before.pid}"  # the engine leads its own process group (setsid)

        def alive() -> bool:
            # Any member of the group: TP ranks and tokenizer workers outlive a dead leader.
            return self.transport.run(["kill", "-0", "--", group], timeout=30).ok

        sent = self.transport.run(["kill", "-TERM", "--", group], timeout=30)
        if not sent.ok and alive():
            raise BackendError(
                self.name, self.where, f"cannot signal pid {before.pid}: {sent.stderr.strip()}"
            )
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and alive():
            time.sleep(0.1)
        forced = alive()
        if forced:
            self.transport.run(["kill", "-KILL", "--", group], timeout=30)
            time.sleep(0.2)
            if alive():
                raise BackendError(
                    self.name, self.where, f"pid {before.pid}'s group survived SIGKILL"
                )
        self.transport.run(["rm", "-f", "--", svc.pidfile], timeout=30)
        detail = f"killed after {grace_s:g}s" if forced else "stopped"
        return LifecycleResult("stop", True, self.state(), detail)

    def restart(self) -> LifecycleResult:
        if isinstance(self.service, CommandService):
            # Before the stop: an engine that cannot be started again must not be stopped.
            resolve_service_env(self.name, self.service)
        self.stop()
        started = self.start()
        return LifecycleResult("restart", True, started.state)

    def log_tail(self, lines: int = 30) -> str:
        if isinstance(self.service, SystemdService):
            argv = ["journalctl"] + (["--user"] if self.service.scope == "user" else [])
            argv += ["-u", self.service.systemd, "-n", str(lines), "--no-pager"]
        else:
            argv = ["tail", "-n", str(lines), "--", self.service.log]
        result = self.transport.run(argv, timeout=30)
        text = result.stdout if result.ok else f"(log unreadable: {result.stderr.strip()})"
        return self._redact(text)

    def _redact(self, text: str) -> str:
        # Engines print their arguments at start-up, API key included: never pass that on.
        if self.api_key:
            text = text.replace(self.api_key.get_secret_value(), "***")
        return _KEY_ARGS.sub(r"\1***", text)

    def wait_ready(self, *, deadline_s: float = 300.0, poll_s: float = 0.5) -> HealthResult:
        """Poll health until `up`; fail early, with the log's tail, if the engine dies."""
        end = time.monotonic() + deadline_s
        while True:
            health = self._health()
            if health.state == "up":
                return health
            if self.state().state in ("stopped", "failed"):
                raise BackendError(
                    self.name,
                    self.where,
                    f"the engine exited while starting; last log lines:\n{self.log_tail()}",
                )
            if time.monotonic() >= end:
                raise BackendTimeout(
                    self.name,
                    self.where,
                    f"not ready within {deadline_s:g}s ({health.state}: {health.detail}); "
                    f"last log lines:\n{self.log_tail()}",
                )
            time.sleep(poll_s)
