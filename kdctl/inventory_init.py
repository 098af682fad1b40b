"""`kdctl init`: an inventory written from what a host shows, so that nobody guesses by hand
which engine runs where, on which port, from which weights, behind which key.

The host is only read (kdctl.probes.discovery). Each engine's own API is asked where it
answers, through the SSH connection kdctl holds (the box's sshd dials the engine, so an engine
on the box's loopback answers too). Every value written is commented with where it was found;
what the host did not show is marked `guess:`. The file is checked as `kdctl inventory check`
checks it before it is written, and an existing file is never replaced without `force`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib.resources import files
from pathlib import Path
from typing import Any

import httpx
import yaml
from pydantic import BaseModel, ValidationError

from kdctl import _redact
from kdctl._httpclient import TcpChannel, Tunnels, http_client
from kdctl.errors import HostKeyError, InputError, KdctlError
from kdctl.inventory import BackendSpec, HostSpec, load_inventory
from kdctl.probes.discovery import (
    FoundEngine,
    HostFacts,
    NginxSetup,
    find_engines,
    read_host,
    secret_values,
)
from kdctl.roadmap import check_roadmap
from kdctl.transports import LocalTransport, Transport

KIMI_ROADMAP = "roadmap/kimi-k26-native.yaml"
# Kimi K2.x and DeepSeek V3/R1 share the architecture the Kimi roadmap is written for.
_KIMI_NAMES = re.compile(r"kimi|deepseek[-_]?v3|deepseek[-_]?r1", re.IGNORECASE)
_KIMI_CONFIG_TYPES = {"deepseek_v3", "kimi_k2", "kimi_k25"}
_LOOPBACK = {"127.0.0.1", "::1", "localhost"}
_ANYWHERE = {"0.0.0.0", "::", "*", ""}  # noqa: S104 - wildcard addresses, compared
_HTTP_TIMEOUT_S = 8.0
_BODY_CAP = 4 * 1024 * 1024
_KIND_OF = {"sglang": "sglang", "reference": "sglang", "vllm": "openai"}
_WHAT = {
    "sglang": "SGLang (sglang.launch_server)",
    "reference": "kdctl reference serve, which speaks SGLang's API",
    "vllm": "vLLM, through its OpenAI API",
    "sglang-router": "SGLang's router (sglang_router.launch_router)",
}


@dataclass(frozen=True)
class InitRequest:
    """What `kdctl init` was asked: one host (an SSH address, or this machine) and where the
    inventory goes."""

    output: Path
    host: str | None = None
    local: bool = False
    user: str | None = None
    port: int = 22
    identity_file: Path | None = None
    known_hosts: Path | None = None
    accept_new: bool = False
    force: bool = False
    timeout_s: float = 20.0


class BackendFound(BaseModel):
    name: str
    kind: str
    url: str | None
    running: bool
    service: str | None
    model: str | None
    tp_size: int | None
    served_name: str | None
    key_env: str | None
    written: bool


class InitResult(BaseModel):
    path: Path
    host: str
    target: str
    backends: list[BackendFound]
    router: str | None
    roadmap: str | None
    # Chosen but left commented (the backends it judges are not all there yet).
    roadmap_suggested: str | None = None
    guesses: int
    notes: list[str]

    def lines(self) -> list[str]:
        running = sum(1 for b in self.backends if b.running)
        stopped = len(self.backends) - running
        if self.roadmap:
            roadmap = self.roadmap
        elif self.roadmap_suggested:
            roadmap = f"{self.roadmap_suggested} suggested (commented out)"
        else:
            roadmap = "left for you to choose"
        lines = [
            f"wrote {self.path} for {self.host} ({self.target}): {running} engine(s) running, "
            f"{stopped} stopped, router {self.router or 'none found'}, roadmap {roadmap}"
        ]
        for b in self.backends:
            state = "running" if b.running else "stopped"
            parts = [f"  {b.name}: {b.kind}", b.url or "no url", state]
            if b.service:
                parts.append(b.service)
            if b.model:
                parts.append(f"model {b.model}")
            if b.tp_size:
                parts.append(f"tp {b.tp_size}")
            if b.key_env:
                parts.append(f"key ${b.key_env}")
            if not b.written:
                parts.append("(commented out)")
            lines.append(", ".join(parts))
        lines += [f"  note: {n}" for n in self.notes]
        if self.guesses:
            lines.append(f"{self.guesses} value(s) marked `# guess:` in the file: check them.")
        lines.append(f"next: kdctl inventory check -i {self.path}")
        return lines


# --- the engines' own API, asked from the host ---------------------------------------------


class EngineAnswer(BaseModel):
    """What an engine said of itself; `refused` where it wants a key kdctl does not hold."""

    route: str | None = None
    model: str | None = None
    served_name: str | None = None
    tp_size: int | None = None
    version: str | None = None
    requires_key: bool = False
    refused: str | None = None
    error: str | None = None


def _get(client: httpx.Client, url: str) -> tuple[int, bytes]:
    """GET `url`: its status and at most _BODY_CAP bytes of its body, read no further (an
    engine answers these routes in a few KiB; a stray server may not stop)."""
    with client.stream("GET", url, headers={"Accept": "application/json"}) as answer:
        body = bytearray()
        for chunk in answer.iter_bytes():
            body += chunk
            if len(body) >= _BODY_CAP:
                break
        return answer.status_code, bytes(body[:_BODY_CAP])


EngineAsker = Callable[[str, str, int], EngineAnswer]


@contextlib.contextmanager
def _engine_asker(transport: Transport) -> Iterator[EngineAsker]:
    """(kind, host, port) -> what that engine says, asked as the host itself dials it: on this
    machine directly, else through channels of the transport's one SSH connection (kdctl's
    HTTP tunnel, as `http: ssh` sends it), so an engine on the box's loopback answers too."""
    tunnels = Tunnels()

    def opener(host: str, port: int, timeout: float) -> TcpChannel:
        return transport.open_channel(host, port, timeout=timeout)

    def ask(kind: str, host: str, port: int) -> EngineAnswer:
        url = f"http://{_netloc(host, port)}"
        if not isinstance(transport, LocalTransport):
            tunnels.add(url, via=transport.name, mode="ssh", ssh_address=None, opener=opener)
        # No environment proxy: the request is the host's own, to its own address.
        with http_client(trust_env=False, timeout=_HTTP_TIMEOUT_S) as client:
            return ask_engine(client, kind, url)

    try:
        yield ask
    finally:
        tunnels.close()


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None


def ask_engine(client: httpx.Client, kind: str, url: str) -> EngineAnswer:
    """The engine's own word on its model, served name and TP size: SGLang's `/server_info`
    (`/get_server_info` before 0.4.6) and `/v1/models`; vLLM's `/v1/models`."""
    answer = EngineAnswer()
    routes = ["/v1/models"] if kind == "vllm" else ["/server_info", "/v1/models"]
    for route in routes:
        try:
            status, body = _get(client, url + route)
            if status == 404 and route == "/server_info":
                route = "/get_server_info"
                status, body = _get(client, url + route)
        except httpx.HTTPError as exc:  # the tunnel's failures come as httpx's too
            answer.error = f"{route}: {type(exc).__name__}: {exc}".strip()[:200]
            return answer
        if status in (401, 403):
            answer.requires_key = True
            answer.refused = f"{route} answered {status}"
            continue
        data = _json(body)
        if status != 200 or not isinstance(data, dict):
            continue
        if route.endswith("server_info"):
            answer.route = route
            answer.model = _text(data.get("model_path"))
            answer.served_name = _text(data.get("served_model_name"))
            tp = data.get("tp_size")
            answer.tp_size = tp if isinstance(tp, int) and tp >= 1 else None
            answer.version = _text(data.get("version"))
            # Whether a key is set, never the key: the value is not kept.
            answer.requires_key = answer.requires_key or bool(data.get("api_key"))
        else:
            cards = data.get("data")
            card = cards[0] if isinstance(cards, list) and cards else None
            if isinstance(card, dict):
                answer.route = answer.route or route
                answer.served_name = answer.served_name or _text(card.get("id"))
                if kind == "vllm":
                    answer.model = _text(card.get("root")) or answer.model
    return answer


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


# --- writing YAML with comments ----------------------------------------------------------


def _comment(note: str) -> str:
    """A note as comment text: nothing in it can end the comment's line (YAML counts NEL and
    the Unicode line and paragraph separators as line breaks too)."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in note)


@dataclass
class _Yaml:
    """A YAML document built line by line from PyYAML's own rendering of each entry, each
    line then given its note as a comment; the data it must load back as is kept beside it."""

    lines: list[str] = field(default_factory=list)
    guesses: int = 0

    def comment(self, text: str, indent: int = 0) -> None:
        for line in text.splitlines() or [""]:
            self.lines.append(" " * indent + "# " + _comment(line) if line else "#")

    def _note(self, note: str | None, guess: bool) -> str | None:
        if note is None:
            return None
        if guess:
            self.guesses += 1
            return f"guess: {note}"
        return note

    def open(self, key: str, indent: int, note: str | None = None, guess: bool = False) -> None:
        # The key rendered by PyYAML (as `KEY: {}`), the empty mapping dropped.
        rendered = _dump({key: {}})
        assert rendered.endswith(" {}")
        self._add(indent, [rendered[: -len(" {}")]], self._note(note, guess))

    def put(
        self, key: str, value: Any, indent: int, note: str | None = None, guess: bool = False
    ) -> None:
        self._add(indent, _dump({key: value}).split("\n"), self._note(note, guess))

    def _add(self, indent: int, rendered: list[str], note: str | None) -> None:
        pad = " " * indent
        if note and len(rendered) == 1:
            self.lines.append(f"{pad}{rendered[0]}  # {_comment(note)}")
            return
        if note:
            self.lines.append(f"{pad}# {_comment(note)}")
        self.lines += [pad + line for line in rendered]

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def _dump(data: dict[str, Any]) -> str:
    # Flow style for the innermost collections only (`gpus: [0, 1]`, `service: {systemd: x}`);
    # PyYAML would take a mapping of scalars, the entry itself, as one of them.
    nested = any(isinstance(v, dict | list) and v for v in data.values())
    return yaml.safe_dump(
        data,
        sort_keys=False,
        default_flow_style=None if nested else False,
        width=2**30,
        allow_unicode=False,
    ).rstrip("\n")


# --- from facts to an inventory --------------------------------------------------------------


@dataclass
class _Value:
    value: Any
    note: str | None = None
    guess: bool = False


@dataclass
class _Backend:
    name: str
    engine: FoundEngine
    fields: dict[str, _Value]
    answer: EngineAnswer | None
    # Why it is not written (then it is shown commented out).
    problem: str | None = None
    remarks: list[str] = field(default_factory=list)


def _name(text: str, fallback: str) -> str:
    cleaned = re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-._")[:63]
    return cleaned if cleaned and cleaned[0].isalnum() else fallback


def _unique(name: str, taken: set[str]) -> str:
    chosen, n = name, 2
    while chosen in taken:
        chosen = f"{name}-{n}"
        n += 1
    taken.add(chosen)
    return chosen


def _engine_name(engine: FoundEngine) -> str:
    if engine.unit is not None:
        return _name(engine.unit.name.removesuffix(".service"), engine.command.kind)
    return f"{engine.command.kind}-{engine.command.port}"


def _flag(found: str) -> str:
    """The option a value came from (`--tp`), or the words naming a positional argument."""
    return found.split()[0].split("=")[0] if found.startswith("-") else found


def _url_host(bind: str, address: str | None) -> tuple[str, str, bool]:
    """(host in the URL, host the box dials, whether only the box's loopback reaches it)."""
    if bind in _LOOPBACK:
        host = "::1" if bind == "::1" else "127.0.0.1"
        return host, host, True
    if bind in _ANYWHERE:
        return (address or "127.0.0.1"), "127.0.0.1", address is None
    return bind, bind, False


def _netloc(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _key_name(name: str) -> str:
    return re.sub(r"[^A-Z0-9_]", "_", name.upper()) + "_API_KEY"


def _backend(
    name: str,
    engine: FoundEngine,
    answer: EngineAnswer | None,
    *,
    host_name: str,
    address: str | None,
    host_gpus: int,
) -> _Backend:
    cmd = engine.command
    found = cmd.found
    source = engine.source
    f: dict[str, _Value] = {}
    f["kind"] = _Value(_KIND_OF[cmd.kind], f"{_WHAT[cmd.kind]}, {source}")
    f["host"] = _Value(host_name)
    url_host, _, _ = _url_host(cmd.bind, address)
    url = f"http://{_netloc(url_host, cmd.port)}"
    flags = [_flag(found[k]) for k in ("bind", "port") if k in found]
    origin = f"{source} {', '.join(flags)}" if flags else f"{source}: {cmd.kind}'s defaults"
    if engine.listener is not None:
        f["url"] = _Value(url, f"from {origin}; listening ({engine.listener.address})")
    elif engine.running:
        f["url"] = _Value(url, f"from {origin}; {engine.socket_note}", guess=True)
    else:
        f["url"] = _Value(url, f"from {origin} (the unit is stopped)")
    answered = answer is not None and answer.route is not None
    api = answer.route if answer is not None and answer.route else None

    def pick(key: str, from_api: Any, from_args: Any) -> None:
        if from_api is not None and answered:
            differs = from_args is not None and from_args != from_api
            note = f"from {api}" + (f" (its command line says {from_args!r})" if differs else "")
            f[key] = _Value(from_api, note)
        elif from_args is not None:
            arg_key = {"model": "model", "served_model_name": "served_name"}.get(key, key)
            f[key] = _Value(from_args, f"from {source} {_flag(found[arg_key])}")

    pick("model", answer.model if answer else None, cmd.model)
    pick("served_model_name", answer.served_name if answer else None, cmd.served_name)
    tp_api = answer.tp_size if answer else None
    if tp_api is not None and answered:
        pick("tp_size", tp_api, cmd.tp_size)
    elif cmd.tp_size is not None:
        f["tp_size"] = _Value(cmd.tp_size, f"from {source} {_flag(found['tp_size'])}")
    elif cmd.kind in ("sglang", "vllm", "reference"):
        f["tp_size"] = _Value(1, f"{cmd.kind}'s default: no TP size on its command line")
    tp = f["tp_size"].value if "tp_size" in f else 1
    requires_key = cmd.requires_key or (answer is not None and answer.requires_key)
    if cmd.key_env:
        f["api_key_env"] = _Value(
            cmd.key_env, f"from {found.get('key_from', source)} {found['key']}"
        )
    elif requires_key:
        why = (
            "--api-key on its command line"
            if cmd.requires_key
            else (answer.refused if answer and answer.refused else "its /server_info")
        )
        f["api_key_env"] = _Value(
            _key_name(name),
            f"it requires a key ({why}); export the key under this name where kdctl runs",
            guess=True,
        )
    gpus = engine.gpus
    if gpus and (len(gpus) < tp or (host_gpus and max(gpus) >= host_gpus)):
        gpus = []
    if gpus:
        f["gpus"] = _Value(gpus, f"from {engine.gpus_source}")
    elif host_gpus and tp == host_gpus:
        f["gpus"] = _Value(list(range(tp)), f"TP {tp} on a host of {tp} GPUs", guess=True)
    if engine.unit is not None:
        state = f" ({engine.unit.active_state})" if engine.unit.active_state else ""
        how = {"MainPID": "its MainPID", "cgroup": "its cgroup", "ExecStart": "its ExecStart"}
        tie = f", {how[engine.linked_by]} is this process" if engine.linked_by else ""
        f["service"] = _Value({"systemd": engine.unit.name}, f"from {engine.unit.path}{state}{tie}")
    elif engine.process is not None and engine.pidfile:
        argv = engine.process.argv
        log = engine.log
        if secret_values(argv):
            remark = "its command line holds a key: write its service with the key in env"
            return _Backend(name, engine, f, answer, remarks=[remark])
        service: dict[str, Any] = {"command": argv, "pidfile": engine.pidfile}
        if log:
            service["log"] = log
            note = f"pidfile {engine.pidfile} holds pid {engine.process.pid}; log: its stdout"
            f["service"] = _Value(service, note)
        else:
            service["log"] = str(Path(engine.pidfile).with_suffix(".log"))
            note = f"the log path (pidfile {engine.pidfile} holds pid {engine.process.pid})"
            f["service"] = _Value(service, note, guess=True)
    return _Backend(name, engine, f, answer)


def _is_kimi(engines: list[_Backend], facts: HostFacts) -> str | None:
    """The model that makes the Kimi roadmap the one to follow, if any engine serves one."""
    for b in engines:
        model = b.fields.get("model")
        names = [str(v.value) for k, v in b.fields.items() if k in ("model", "served_model_name")]
        if any(_KIMI_NAMES.search(n) for n in names):
            return names[0]
        config = facts.model_configs.get(str(model.value)) if model else None
        data = _json(config.encode()) if config else None
        if isinstance(data, dict):
            archs = data.get("architectures") or []
            kind = data.get("model_type")
            if kind in _KIMI_CONFIG_TYPES or any(
                isinstance(a, str) and ("DeepseekV3" in a or "Kimi" in a) for a in archs
            ):
                return f"{model.value if model else '?'} ({kind or archs[0]})"
    return None


def _roadmap_backends() -> set[str]:
    """Backends the Kimi roadmap names: it judges them, so the inventory must have them."""
    text = files("kdctl.roadmap").joinpath(Path(KIMI_ROADMAP).name).read_text()
    spec = yaml.safe_load(text)
    names = {spec.get("serving"), spec.get("candidate")}
    for phase in spec.get("phases") or []:
        for criterion in phase.get("criteria") or []:
            names |= {criterion.get("backend"), criterion.get("baseline")}
    return {n for n in names if isinstance(n, str)}


def _router_entry(
    facts: HostFacts, backends: list[_Backend], host_name: str, address: str | None
) -> tuple[dict[str, _Value] | None, list[str]]:
    """The router kdctl would move traffic with: nginx in front of a found engine, else SGLang's
    router. Others found are described in comments."""
    notes: list[str] = []

    def backend_at(target: str) -> str | None:
        host, _, port = target.rpartition(":")
        host = host.strip("[]")
        for b in backends:
            cmd = b.engine.command
            if not port.isdigit() or int(port) != cmd.port:
                continue
            same = host in _LOOPBACK | _ANYWHERE or host in (cmd.bind, address)
            if same and b.problem is None:
                return b.name
        return None

    chosen: dict[str, _Value] | None = None
    for setup in facts.nginx:
        for front in setup.fronts:
            served = sorted(
                ((w, t) for t, w in front.targets.items() if backend_at(t)), reverse=True
            )
            if not served:
                notes.append(
                    f"nginx (pid {setup.pid}) on {', '.join(front.listen)} proxies to "
                    f"{', '.join(front.targets)}: no engine found there"
                )
                continue
            if chosen is not None:
                notes.append(f"nginx on {', '.join(front.listen)} also proxies to engines")
                continue
            chosen = _nginx_entry(setup, front.listen, host_name, served, backend_at)
            if chosen is None:
                notes.append(f"nginx listens on {front.listen}: no address kdctl can name")
                continue
            if front.written_by_kdctl and front.file:
                chosen["include"] = _Value(front.file, "kdctl's own file, named in its first line")
            else:
                where = front.file or setup.conf
                chosen["include"] = _Value(
                    "/etc/nginx/conf.d/kdctl.conf",
                    f"the file kdctl will own; its upstream now is in {where}: include kdctl's "
                    "file at http level in its place before a cutover",
                    guess=True,
                )
    for b in list(backends):
        cmd = b.engine.command
        if cmd.kind != "sglang-router" or not b.engine.running:
            continue
        workers = [w for w in cmd.worker_urls if backend_at(w.split("//", 1)[-1].rstrip("/"))]
        if chosen is not None or not workers:
            notes.append(f"SGLang's router on port {cmd.port} ({b.engine.source}) not written")
            continue
        bind = "0.0.0.0" if cmd.bind in _ANYWHERE else cmd.bind  # noqa: S104
        serving = backend_at(workers[0].split("//", 1)[-1].rstrip("/"))
        chosen = {
            "kind": _Value("sglang-router", f"{_WHAT[cmd.kind]}, {b.engine.source}"),
            "host": _Value(host_name),
            "listen": _Value(_netloc(bind, cmd.port), f"from {b.engine.source}"),
            "serving": _Value(serving, f"its first worker, {workers[0]}"),
        }
        if cmd.key_env:
            chosen["api_key_env"] = _Value(cmd.key_env, f"from {cmd.found['key']}")
    return chosen, notes


def _nginx_entry(
    setup: NginxSetup,
    listen: list[str],
    host_name: str,
    served: list[tuple[int, str]],
    backend_at: Callable[[str], str | None],
) -> dict[str, _Value] | None:
    usable = [a for a in listen if not a.startswith("[")] or [
        "0.0.0.0:" + a.rpartition(":")[2] for a in listen
    ]
    if not usable:
        return None
    weight, target = served[0]
    entry: dict[str, _Value] = {
        "kind": _Value("nginx", f"nginx's master process, pid {setup.pid}"),
        "host": _Value(host_name),
        "listen": _Value(usable[0], f"from {setup.source or 'its configuration'}"),
        "serving": _Value(
            backend_at(target),
            f"{target}, weight {weight} of its upstream" if len(served) > 1 else target,
        ),
    }
    if setup.binary.startswith("/"):
        entry["nginx"] = _Value(setup.binary, f"nginx's master process, pid {setup.pid}")
    if setup.prefix:
        entry["prefix"] = _Value(setup.prefix, "-p of nginx's master process")
    if setup.conf != "/etc/nginx/nginx.conf":
        entry["conf"] = _Value(setup.conf, "-c of nginx's master process")
    return entry


# --- the command -----------------------------------------------------------------------------

_OPTION_OF = {
    "address": "--host",
    "user": "--user",
    "port": "--port",
    "identity_file": "--identity-file",
    "known_hosts": "--known-hosts",
}


def _host_spec(req: InitRequest) -> HostSpec:
    if req.local:
        return HostSpec(transport="local")
    values: dict[str, Any] = {"transport": "ssh", "address": req.host, "port": req.port}
    if req.user is not None:
        values["user"] = req.user
    if req.identity_file is not None:
        values["identity_file"] = req.identity_file.expanduser().absolute()
    if req.known_hosts is not None:
        values["known_hosts"] = req.known_hosts.expanduser().absolute()
    if req.accept_new:
        values["host_key_policy"] = "accept-new"
    try:
        return HostSpec.model_validate(values)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            key = str(error["loc"][0]) if error["loc"] else "?"
            message = str(error["msg"]).removeprefix("Value error, ")
            given = values.get(key)
            problems.append(f"{_OPTION_OF.get(key, key)} {given!s}: {message}")
        raise InputError("\n".join(problems)) from None


def _check_request(req: InitRequest) -> HostSpec:
    if req.local == (req.host is not None):
        raise InputError("kdctl init: give --host ADDRESS, or --local for this machine")
    out = req.output
    if out.is_dir():
        raise InputError(f"-o {out}: is a folder; name the inventory file to write")
    if out.exists() and not req.force:
        raise InputError(f"{out} exists: kdctl init does not overwrite it (--force replaces it)")
    if not out.parent.is_dir():
        raise InputError(f"-o {out}: folder {out.parent} does not exist")
    spec = _host_spec(req)
    if spec.identity_file is not None and not spec.identity_file.is_file():
        raise InputError(f"--identity-file {req.identity_file}: no such file")
    if req.known_hosts is not None and not spec.known_hosts.is_file() and not req.accept_new:
        raise InputError(f"--known-hosts {req.known_hosts}: no such file")
    return spec


def _transport(spec: HostSpec) -> Transport:
    if spec.transport == "local":
        return LocalTransport("local")
    from kdctl.transports.ssh import SSHTransport

    assert spec.address is not None
    return SSHTransport(
        spec.address,
        spec,
        known_hosts=spec.known_hosts.expanduser(),
        identity_file=spec.identity_file,
    )


def _connect(transport: Transport) -> None:
    try:
        transport.connect()
    except HostKeyError as exc:
        if "is not in" not in exc.message:
            raise
        # The transport's advice names the inventory field; here the option says the same.
        why = exc.message.removeprefix(f"{exc.host}: ").split("; verify")[0]
        raise HostKeyError(
            exc.host,
            f"{why}: verify it and add it to known_hosts, or run kdctl init with --accept-new "
            "to record it",
            exc.fingerprint,
        ) from None


def init_inventory(req: InitRequest) -> InitResult:
    """Read the host, ask its engines, write the inventory; InputError (exit 2) for bad input
    or an existing file, InfraError (exit 3) for a host that cannot be reached or whose key
    is unknown."""
    spec = _check_request(req)
    transport = _transport(spec)
    try:
        _connect(transport)
        facts = read_host(transport, timeout=req.timeout_s)
        # Keys written on command lines are never printed, whatever text they reach.
        for p in facts.processes:
            _redact.register(*secret_values(p.argv))
        return _write(req, spec, transport, facts)
    finally:
        transport.close()


def _write(req: InitRequest, spec: HostSpec, transport: Transport, facts: HostFacts) -> InitResult:
    local = spec.transport == "local"
    host_name = "local" if local else _name((facts.hostname or "").split(".")[0], "box")
    address = None if local else spec.address
    engines = find_engines(facts)
    taken: set[str] = set()
    backends: list[_Backend] = []
    host_gpus = len(facts.gpus.gpus)
    loopback_only = False
    # An engine that serves here first: it keeps its name and URL over a same-named one in a
    # container or one still loading.
    order = sorted(
        engines,
        key=lambda e: (not e.running, e.elsewhere, e.listener is None, _engine_name(e)),
    )
    with _engine_asker(transport) as ask:
        for engine in order:
            name = _unique(_engine_name(engine), taken)
            cmd = engine.command
            answer = None
            _, dial, only_loopback = _url_host(cmd.bind, address)
            if engine.listener is not None and not engine.elsewhere and cmd.kind != "sglang-router":
                answer = ask(cmd.kind, dial, cmd.port)
            if engine.running and not engine.elsewhere and only_loopback and not local:
                loopback_only = True
            backend = _backend(
                name, engine, answer, host_name=host_name, address=address, host_gpus=host_gpus
            )
            backends.append(backend)
    doc = _Yaml()
    data: dict[str, Any] = {}
    target = "this machine" if local else spec.target
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    doc.comment(
        f"Written by kdctl init from what {facts.hostname or target} ({target}) showed on "
        f"{stamp}.\nEach value says where it was found; `guess:` marks what the host did not "
        "show: check those.\nThen: kdctl inventory check, kdctl status."
    )
    notes: list[str] = []
    _hosts_section(doc, data, spec, facts, host_name, loopback_only)

    written: dict[str, dict[str, Any]] = {}
    urls: dict[str, str] = {}
    for b in backends:
        if b.engine.command.kind == "sglang-router":
            continue
        values = {k: v.value for k, v in b.fields.items()}
        if b.engine.elsewhere:
            b.problem = (
                "it runs in another network namespace (a container?): the port it listens on "
                "there is not this host's"
            )
        if b.problem is None:
            try:
                BackendSpec.model_validate(values)
            except ValidationError as exc:
                b.problem = "; ".join(e["msg"] for e in exc.errors())[:200]
        if b.problem is None and values.get("url") in urls:
            b.problem = f"{values['url']} is also {urls[values['url']]}'s: one of them can serve"
        if b.problem is None:
            urls[values["url"]] = b.name
            written[b.name] = values
    routable = [
        b for b in backends if b.name in written or b.engine.command.kind == "sglang-router"
    ]
    router, router_notes = _router_entry(facts, routable, host_name, address)
    notes += router_notes

    if written:
        doc.open("backends", 0)
        data["backends"] = {}
    else:
        doc.comment("backends: none found (no SGLang, vLLM or kdctl engine runs or has a unit)")
    for b in backends:
        if b.engine.command.kind == "sglang-router":
            continue
        if b.name in written:
            doc.open(b.name, 2)
            for key, v in b.fields.items():
                doc.put(key, v.value, 4, v.note, v.guess)
            data["backends"][b.name] = written[b.name]
        else:
            shown = {k: v.value for k, v in b.fields.items()}
            doc.comment(f"{b.name}: not written: {b.problem}", 2)
            for line in _dump({b.name: shown}).split("\n"):
                doc.comment(line, 2)
            notes.append(f"{b.name}: not written ({b.problem})")
            continue
        notes += [f"{b.name}: {remark}" for remark in b.remarks]
        if b.answer is not None and b.answer.error:
            notes.append(f"{b.name}: its API did not answer ({b.answer.error})")
        elif b.answer is not None and b.answer.refused and not b.answer.route:
            notes.append(f"{b.name}: {b.answer.refused} (a key): values from its command line")
        unserviced = b.engine.unit is None and "service" not in b.fields and not b.remarks
        if b.engine.process is not None and unserviced:
            notes.append(
                f"{b.name}: no unit runs it and no pidfile holds its pid (process "
                f"{b.engine.process.pid}): add a service so kdctl can stop and start it"
            )

    if router is not None:
        doc.open("router", 0)
        data["router"] = {}
        for key, v in router.items():
            doc.put(key, v.value, 2, v.note, v.guess)
            data["router"][key] = v.value

    kimi = _is_kimi([b for b in backends if b.name in written], facts)
    roadmap = None
    if kimi:
        missing = sorted(_roadmap_backends() - set(written))
        if missing:
            why = (
                f"Chosen for {kimi} (a Kimi/DeepSeek-V3-like model), this roadmap judges "
                f"backends this host does not show yet: {', '.join(missing)}. Add them "
                "(examples/ct200-8gpu.yaml shows each), then uncomment:"
            )
            doc.comment("\n".join(textwrap.wrap(why, 94)))
            doc.comment(f"roadmap: {KIMI_ROADMAP}")
            notes.append(f"roadmap {KIMI_ROADMAP} left commented: add {', '.join(missing)}")
        else:
            doc.put("roadmap", KIMI_ROADMAP, 0, f"a Kimi/DeepSeek-V3-like model is served: {kimi}")
            data["roadmap"] = KIMI_ROADMAP
            roadmap = KIMI_ROADMAP
    else:
        doc.comment(
            "roadmap: roadmap/kimi-k26-native.yaml  # choose the roadmap your migration follows"
        )
    text = doc.text()
    try:
        same = yaml.safe_load(text) == data
    except yaml.YAMLError:
        same = False
    if not same:
        raise KdctlError("kdctl init: the inventory written would not read back as built")
    _save(req, text)
    return InitResult(
        path=req.output,
        host=host_name,
        target=target,
        backends=[
            BackendFound(
                name=b.name,
                kind=b.engine.command.kind,
                url=b.fields["url"].value if "url" in b.fields else None,
                running=b.engine.running,
                service=b.engine.unit.name if b.engine.unit else None,
                model=b.fields["model"].value if "model" in b.fields else None,
                tp_size=b.fields["tp_size"].value if "tp_size" in b.fields else None,
                served_name=(
                    b.fields["served_model_name"].value if "served_model_name" in b.fields else None
                ),
                key_env=b.fields["api_key_env"].value if "api_key_env" in b.fields else None,
                written=b.name in written,
            )
            for b in backends
            if b.engine.command.kind != "sglang-router"
        ],
        router=str(router["kind"].value) if router else None,
        roadmap=roadmap,
        roadmap_suggested=KIMI_ROADMAP if kimi and not roadmap else None,
        guesses=doc.guesses,
        notes=notes + facts.notes,
    )


def _hosts_section(
    doc: _Yaml,
    data: dict[str, Any],
    spec: HostSpec,
    facts: HostFacts,
    host_name: str,
    loopback_only: bool,
) -> None:
    doc.open("hosts", 0)
    doc.open(host_name, 2, f"from uname -n: {facts.hostname}" if facts.hostname else None)
    entry: dict[str, Any] = {}

    def put(key: str, value: Any, note: str | None = None) -> None:
        doc.put(key, value, 4, note)
        entry[key] = value

    if spec.transport == "local":
        put("transport", "local", "kdctl init --local: this machine")
    else:
        put("transport", "ssh")
        put("address", spec.address, "the address kdctl init connected to")
        if spec.port != 22:
            put("port", spec.port)
        if spec.user:
            put("user", spec.user)
        if spec.identity_file:
            put("identity_file", str(spec.identity_file))
        if "known_hosts" in spec.model_fields_set:
            put("known_hosts", str(spec.known_hosts))
        if spec.host_key_policy == "accept-new":
            doc.comment("its host key was recorded by kdctl init --accept-new; keys are", 4)
            doc.comment("checked against that record from now on (host_key_policy: reject)", 4)
    gpus = facts.gpus
    if gpus.visible and gpus.gpus:
        first = gpus.gpus[0]
        memory = f", {first.memory_total_mib:.0f} MiB each" if first.memory_total_mib else ""
        put("gpus", len(gpus.gpus), f"from nvidia-smi: {len(gpus.gpus)} x {first.name}{memory}")
        if first.name:
            put("gpu_model", first.name, "from nvidia-smi")
    else:
        why = gpus.error or gpus.note or "none visible"
        put("gpus", 0, f"from nvidia-smi: {why}")
    if loopback_only:
        put(
            "http",
            "ssh",
            "its engines listen on its loopback only: kdctl's HTTP goes through SSH",
        )
    data["hosts"] = {host_name: entry}


def _save(req: InitRequest, text: str) -> None:
    """Checked as `kdctl inventory check` checks it (beside the target, so relative paths
    resolve the same), then put in place: created only if absent, unless `force`."""
    out = req.output
    fd, tmp_name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".yaml")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        try:
            inv = load_inventory(tmp)
            check_roadmap(inv)
        except InputError as exc:
            raise KdctlError(f"kdctl init: the inventory built does not check: {exc}") from None
        if req.force:
            os.replace(tmp, out)
            return
        try:
            with out.open("x", encoding="utf-8") as fh:
                fh.write(text)
        except FileExistsError:
            raise InputError(
                f"{out} exists: kdctl init does not overwrite it (--force replaces it)"
            ) from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
