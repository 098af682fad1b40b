"""Loading an inventory file: YAML, schema, cross-references, secrets, in that order.

Every problem found is reported, each as `FILE:LINE: field.path: message`, so one run of
`kdctl inventory check` shows all of them, the way a compiler does.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, get_args, get_origin

from pydantic import BaseModel, SecretStr, ValidationError

from kdctl import _redact as redact
from kdctl._plugins import plugged
from kdctl.errors import InputError
from kdctl.inventory._yaml import Document, read_mapping
from kdctl.inventory.models import (
    BUILTIN_BACKEND_KINDS,
    BUILTIN_ROUTER_KINDS,
    NGINX_ONLY_FIELDS,
    UNION_TAGS,
    BackendSpec,
    CommandService,
    EngineSpec,
    HostSpec,
    Inventory,
    PoolSpec,
    Replica,
    RouterSpec,
)

Loc = tuple[str | int, ...]

ENV_INVENTORY = "KDCTL_INVENTORY"
ENV_STATE_DIR = "KDCTL_STATE_DIR"
DEFAULT_INVENTORY = Path("inventory.yaml")
# The key under which the router's own API-key variable is tracked beside the backends'.
ROUTER_KEY = "router"
# Kinds that talk HTTP and so need a URL; `reference` runs in-process, `native` in command mode
# runs a binary.
_URL_KINDS = {"sglang", "openai"}


@dataclass(frozen=True)
class LoadedInventory:
    """An inventory that passed every check, with the file it came from."""

    spec: Inventory
    path: Path
    state_dir: Path
    # API-key variables the environment lacks, by backend (or ROUTER_KEY): each message names
    # the file, line and variable.
    unset_keys: Mapping[str, str] = field(default_factory=dict)
    # Every engine by name, a pool's replicas each as a backend of its own (POOL@HOST), and
    # each pool's replicas in the file's order.
    engines: Mapping[str, BackendSpec] = field(default_factory=dict)
    pools: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def warnings(self) -> list[str]:
        return [f"{m} (needed when kdctl talks to the engine)" for m in self.unset_keys.values()]

    @property
    def hosts(self) -> Mapping[str, HostSpec]:
        return self.spec.hosts

    @property
    def backends(self) -> Mapping[str, BackendSpec]:
        """Every engine, a pool's replicas each under its own name."""
        return self.engines

    def members(self, name: str) -> tuple[str, ...]:
        """The backends a name stands for: a pool's replicas, or the backend itself."""
        return self.pools.get(name, (name,))

    def pool_of(self, backend: str) -> str | None:
        return next((pool for pool, names in self.pools.items() if backend in names), None)

    def replica_weights(
        self, weights: Mapping[str, int], *, sent_to: bool = False
    ) -> dict[str, int]:
        """Weights that may name pools, as the backends a router holds: a pool's weight split
        over its replicas as evenly as whole percents allow, the remainder to the first ones
        (a pool given less than it has replicas leaves some of them none); `sent_to`: only
        those given some, as a router reads back."""
        if sent_to:
            return {n: w for n, w in self.replica_weights(weights).items() if w > 0}
        out: dict[str, int] = {}
        for name, weight in weights.items():
            replicas = self.members(name)
            for i, replica in enumerate(replicas):
                share = weight // len(replicas) + (1 if i < weight % len(replicas) else 0)
                out[replica] = out.get(replica, 0) + share
        return out

    def api_key(self, backend: str) -> SecretStr | None:
        """The backend's key; an InputError when its variable is unset, since a request sent
        without it would only be refused."""
        owner = self.pool_of(backend) or backend
        if owner in self.unset_keys:
            raise InputError(self.unset_keys[owner])
        return resolve_api_key(self.engines[backend], self.path.parent)

    def evidence_password(self) -> str | None:
        return evidence_password(self.spec, self.path.parent)

    def router_api_key(self) -> SecretStr | None:
        """The key the router's front door itself requires, where it requires one."""
        router = self.spec.router
        if router is None:
            return None
        if ROUTER_KEY in self.unset_keys:
            raise InputError(self.unset_keys[ROUTER_KEY])
        return resolve_api_key(router, self.path.parent)

    def service_env(self, backend: str) -> dict[str, str]:
        """What a command service hands its engine; InputError naming this file and each
        variable kdctl's environment lacks."""
        service = self.engines[backend].service
        if not isinstance(service, CommandService):
            return {}
        return resolve_service_env(backend, service, source=str(self.path))


def backend_kinds() -> list[str]:
    """Built-in kinds and those other distributions register under `kdctl.backends`."""
    return sorted(set(BUILTIN_BACKEND_KINDS) | set(plugged("kdctl.backends")))


def router_kinds() -> list[str]:
    """Built-in router drivers and those other distributions register under `kdctl.routers`."""
    return sorted(set(BUILTIN_ROUTER_KINDS) | set(plugged("kdctl.routers")))


def resolve_inventory_path(option: str | Path | None) -> Path:
    """`--inventory`, else `KDCTL_INVENTORY`, else `./inventory.yaml`."""
    if option:
        return Path(option)
    env = os.environ.get(ENV_INVENTORY)
    return Path(env) if env else DEFAULT_INVENTORY


def load_inventory(path: Path, *, state_dir: str | Path | None = None) -> LoadedInventory:
    """Load and check an inventory; raise InputError listing every problem found."""
    doc = read_mapping(path, "inventory", "at least 'hosts'")

    try:
        spec = Inventory.model_validate(doc.data)
    except ValidationError as exc:
        raise InputError(format_problems(doc, pydantic_problems(exc))) from None

    base = path.parent
    problems = list(_pool_problems(spec))
    engines = _expand(spec)
    if not problems:
        problems = list(_cross_check(spec, engines, base)) + list(_missing_files(spec, base))
    if problems:
        raise InputError(format_problems(doc, problems))

    _register_secrets(spec, base)
    unset = {
        owner: format_problems(doc, [(at, f"environment variable {var} is not set")])
        for owner, at, var in _key_variables(spec)
        if not os.environ.get(var)
    }
    chosen = state_dir or os.environ.get(ENV_STATE_DIR) or spec.state_dir
    return LoadedInventory(
        spec=spec,
        path=path,
        state_dir=local_path(Path(chosen), base),
        unset_keys=unset,
        engines={name: e.spec for name, e in engines.items()},
        pools={
            pool: tuple(n for n, e in engines.items() if e.pool == pool)
            for pool, entry in spec.backends.items()
            if isinstance(entry, PoolSpec)
        },
    )


# Where a replica's own fields are written, so a problem with one is shown on its line.
_REPLICA_FIELDS = ("host", "url", "gpus")


@dataclass(frozen=True)
class _Engine:
    """One engine the inventory defines, and where in the file it is written."""

    spec: BackendSpec
    entry: str
    pool: str | None = None
    # Its index in the pool's `replicas` list; None for a group's replica.
    replica: int | None = None

    def at(self, *path: str | int) -> Loc:
        if self.pool is not None and path and path[0] in _REPLICA_FIELDS:
            if self.replica is None:
                return ("backends", self.entry, "replicas")
            return ("backends", self.entry, "replicas", self.replica, *path)
        return ("backends", self.entry, *path)


def replica_name(pool: str, host: str) -> str:
    """A replica's backend name: its pool's and its host's, which no name in a file can be."""
    return f"{pool}@{host}"


def _replicas(spec: Inventory, pool: PoolSpec) -> list[tuple[int | None, Replica]]:
    if isinstance(pool.replicas, list):
        return list(enumerate(pool.replicas))
    group = pool.replicas
    out: list[tuple[int | None, Replica]] = []
    for name in spec.groups.get(group.group, []):
        host = spec.hosts.get(name)
        if host is None:
            continue
        address = "127.0.0.1" if host.transport == "local" else (host.address or "")
        address = f"[{address}]" if ":" in address else address
        url = f"{group.scheme}://{address}:{group.port}"
        out.append((None, Replica(host=name, url=url)))
    return out


def _expand(spec: Inventory) -> dict[str, _Engine]:
    """Every engine by name: a backend as written, a pool as one backend per replica."""
    out: dict[str, _Engine] = {}
    for name, entry in spec.backends.items():
        if isinstance(entry, BackendSpec):
            out[name] = _Engine(entry, name)
            continue
        common = {f: getattr(entry, f) for f in EngineSpec.model_fields}
        for index, replica in _replicas(spec, entry):
            gpus = entry.gpus if replica.gpus is None else replica.gpus
            one = BackendSpec(**{**common, "gpus": gpus}, host=replica.host, url=replica.url)
            out[replica_name(name, replica.host)] = _Engine(one, name, name, index)
    return out


def _pool_problems(spec: Inventory) -> Iterable[tuple[Loc, str]]:
    """A pool's replicas: each on a host the file defines, one per host."""
    for group, members in spec.groups.items():
        for i, host in enumerate(members):
            if host not in spec.hosts:
                yield ("groups", group, i), unknown_name("host", host, spec.hosts)
        if len(set(members)) != len(members):
            yield ("groups", group), "lists a host more than once"
    for name, entry in spec.backends.items():
        if not isinstance(entry, PoolSpec):
            continue
        at: Loc = ("backends", name, "replicas")
        if not isinstance(entry.replicas, list):
            if entry.replicas.group not in spec.groups:
                yield (*at, "group"), unknown_name("group", entry.replicas.group, spec.groups)
            continue
        seen: set[str] = set()
        for i, replica in enumerate(entry.replicas):
            if replica.host not in spec.hosts:
                yield (*at, i, "host"), unknown_name("host", replica.host, spec.hosts)
            elif replica.host in seen:
                yield (*at, i, "host"), f"{replica.host} already runs a replica of {name}"
            seen.add(replica.host)


def evidence_password(spec: Inventory, base: Path) -> str | None:
    """The shared evidence store's password, from the variable or the file the inventory names
    (None leaves it to libpq: PGPASSWORD, PGPASSFILE)."""
    settings = spec.evidence
    if settings.password_env:
        return os.environ.get(settings.password_env) or None
    if settings.password_file:
        try:
            return local_path(settings.password_file, base).read_text(encoding="utf-8").strip()
        except OSError:
            return None
    return None


def _register_secrets(spec: Inventory, base: Path) -> None:
    """Every secret value this inventory leads kdctl to hold, so none is printed or kept."""
    redact.register(evidence_password(spec, base))
    owners: list[EngineSpec | RouterSpec] = list(spec.backends.values())
    if spec.router is not None:
        owners.append(spec.router)
    for owner in owners:
        key = resolve_api_key(owner, base)
        redact.register(key.get_secret_value() if key else None)
    for be in spec.backends.values():
        if isinstance(be.service, CommandService):
            redact.register(
                *(
                    os.environ.get(v.from_env)
                    for v in be.service.env.values()
                    if not isinstance(v, str)
                )
            )


def _key_variables(spec: Inventory) -> Iterable[tuple[str, Loc, str]]:
    for name, be in spec.backends.items():
        if be.api_key_env:
            yield name, ("backends", name, "api_key_env"), be.api_key_env
    if spec.router is not None and spec.router.api_key_env:
        yield ROUTER_KEY, ("router", "api_key_env"), spec.router.api_key_env


def local_path(path: Path, base: Path) -> Path:
    """A path on the machine running kdctl: `~` expanded, relative to the inventory's folder."""
    expanded = path.expanduser()
    return expanded if expanded.is_absolute() else base / expanded


_HEADER_SAFE = re.compile(r"[\x21-\x7e]+")


def resolve_api_key(backend: EngineSpec | RouterSpec, base: Path) -> SecretStr | None:
    if backend.api_key_env:
        value = (os.environ.get(backend.api_key_env) or "").strip()
        return SecretStr(value) if value else None
    if backend.api_key_file:
        key_path = local_path(backend.api_key_file, base)
        try:
            return SecretStr(key_path.read_text(encoding="utf-8").strip())
        except OSError:
            return None
    return None


def resolve_service_env(
    backend: str,
    service: CommandService,
    *,
    source: str | None = None,
) -> dict[str, str]:
    """The engine's environment with every `from_env` filled in; an unset variable is an
    InputError. Read when the engine starts, not when the inventory loads: `kdctl status` on a
    laptop needs no hub token."""
    values: dict[str, str] = {}
    missing: list[str] = []
    for name, value in service.env.items():
        if isinstance(value, str):
            values[name] = value
        elif value.from_env in os.environ:
            values[name] = os.environ[value.from_env]
        else:
            where = f"{source}: " if source else ""
            missing.append(
                f"{where}backends.{backend}.service.env.{name}: environment variable "
                f"{value.from_env} is not set where kdctl runs"
            )
    if missing:
        raise InputError("\n".join(missing))
    return values


def _missing_files(spec: Inventory, base: Path) -> Iterable[tuple[Loc, str]]:
    """Every file the inventory names that kdctl itself reads must be there now, not only when
    a later command opens it."""
    from importlib.resources import files

    def shipped(kind: str, name: str) -> bool:
        folder = files("kdctl.roadmap")
        return (
            (folder.joinpath("prompts") if kind == "prompts" else folder).joinpath(name).is_file()
        )

    named = spec.evidence.password_file
    if named is not None and not local_path(named, base).is_file():
        yield ("evidence", "password_file"), f"{named} does not exist"
    if spec.roadmap is not None:
        found = local_path(spec.roadmap, base).is_file() or shipped("roadmap", spec.roadmap.name)
        if not found:
            yield ("roadmap",), f"{spec.roadmap} does not exist (nor is it a shipped roadmap)"
    prompt_files = [
        (("gates", "exactness", "corpus"), spec.gates.exactness.corpus),
        (("gates", "throughput", "workload", "prompts"), spec.gates.throughput.workload.prompts),
    ]
    for at, named in prompt_files:
        if named is None:
            continue
        if not (local_path(named, base).is_file() or shipped("prompts", named.name)):
            yield at, f"{named} does not exist (nor is it a shipped corpus)"
    for name, host in spec.hosts.items():
        if host.transport != "ssh":
            continue
        if host.identity_file is not None and not local_path(host.identity_file, base).is_file():
            yield ("hosts", name, "identity_file"), f"{host.identity_file} does not exist"
        known = local_path(host.known_hosts, base)
        # accept-new may create the file on the first connection; its folder must exist. The
        # default file is OpenSSH's, which a fresh machine lacks until its first connection:
        # only a file the inventory names is held to exist.
        creatable = host.host_key_policy == "accept-new" and known.parent.is_dir()
        chosen = "known_hosts" in host.model_fields_set
        if chosen and not known.is_file() and not creatable:
            yield ("hosts", name, "known_hosts"), f"{host.known_hosts} does not exist"


def _key_problems(owner: EngineSpec | RouterSpec, at: Loc, base: Path) -> Iterable[tuple[Loc, str]]:
    if owner.api_key_env and owner.api_key_file:
        yield (*at, "api_key_env"), "set api_key_env or api_key_file, not both"
    elif owner.api_key_env and not os.environ.get(owner.api_key_env):
        # Needed when kdctl talks to the engine, not to check a file: a warning at load,
        # a refusal from LoadedInventory.api_key.
        return
    elif owner.api_key_file and not local_path(owner.api_key_file, base).is_file():
        yield (*at, "api_key_file"), f"{owner.api_key_file} does not exist"
    elif owner.api_key_env or owner.api_key_file:
        key = resolve_api_key(owner, base)
        if key is None or not _HEADER_SAFE.fullmatch(key.get_secret_value()):
            # Never echo the key: say only where it came from and what is wrong.
            source = "api_key_env" if owner.api_key_env else "api_key_file"
            yield (
                (*at, source),
                "the API key is empty or holds spaces or control characters "
                "(a trailing newline inside the value?)",
            )


def _cross_check(
    spec: Inventory, engines: Mapping[str, _Engine], base: Path
) -> Iterable[tuple[Loc, str]]:
    """What one model cannot see: names that point elsewhere, secrets, GPU arithmetic. A
    problem common to a pool's replicas is said once, on the pool's line."""
    seen: set[tuple[Loc, str]] = set()
    for problem in _engine_problems(spec, engines, base):
        if problem not in seen:
            seen.add(problem)
            yield problem
    yield from _router_problems(spec, engines, base)


def _engine_problems(
    spec: Inventory, engines: Mapping[str, _Engine], base: Path
) -> Iterable[tuple[Loc, str]]:
    hosts = spec.hosts
    kinds = backend_kinds()
    for name, host in hosts.items():
        if host.transport == "ssh" and not host.address:
            yield ("hosts", name), "an ssh host needs an 'address'"
    urls: dict[str, str] = {}
    for name, engine in engines.items():
        be, at = engine.spec, engine.at
        if be.kind not in kinds:
            yield at("kind"), f"unknown backend kind {be.kind!r} (known: {', '.join(kinds)})"
        if be.host not in hosts:
            yield at("host"), unknown_name("host", be.host, hosts)
        if be.mode is not None and be.kind != "native":
            yield at("mode"), "only a 'native' backend has a mode"
        if be.mode == "command" and not be.command:
            yield at(), "a native backend in command mode needs 'command' (the engine's binary)"
        if be.command is not None and be.mode != "command":
            yield at("command"), "'command' is for a native backend in command mode"
        if be.command is not None:
            try:
                if not be.command_argv:
                    yield at("command"), "must not be empty"
            except ValueError as exc:
                yield at("command"), f"cannot be split into arguments: {exc}"
        needs_url = be.kind in _URL_KINDS or (be.kind == "native" and be.mode != "command")
        if needs_url and not be.url:
            yield at("url") if engine.pool else at(), f"a {be.kind!r} backend needs a 'url'"
        if be.url:
            if be.url in urls:
                yield at("url"), f"{be.url} is already the URL of backend {urls[be.url]!r}"
            urls.setdefault(be.url, name)
        yield from _key_problems(be, at(), base)
        if len(set(be.gpus)) != len(be.gpus):
            yield at("gpus"), "lists a GPU more than once"
        if be.gpus and be.tp_size > len(be.gpus):
            yield (
                at("tp_size"),
                (f"tp_size {be.tp_size} is larger than the {len(be.gpus)} GPU(s) listed in gpus"),
            )
        owner = hosts.get(be.host)
        if owner and owner.gpus:
            for i, gpu in enumerate(be.gpus):
                if gpu >= owner.gpus:
                    yield (
                        at("gpus", i),
                        (f"GPU {gpu} does not exist: host {be.host!r} has {owner.gpus} GPU(s)"),
                    )


def _router_problems(
    spec: Inventory, engines: Mapping[str, _Engine], base: Path
) -> Iterable[tuple[Loc, str]]:
    hosts = spec.hosts
    # What a router or a check may name: a backend, a pool, or one replica of a pool.
    named = {**spec.backends, **engines}
    if spec.router:
        yield from _key_problems(spec.router, ("router",), base)
        known = router_kinds()
        if spec.router.kind not in known:
            yield (
                ("router", "kind"),
                (f"unknown router kind {spec.router.kind!r} (known: {', '.join(known)})"),
            )
        if spec.router.host not in hosts:
            yield ("router", "host"), unknown_name("host", spec.router.host, hosts)
        for i, peer in enumerate(getattr(spec.router, "peers", [])):
            if peer.host not in hosts:
                yield ("router", "peers", i, "host"), unknown_name("host", peer.host, hosts)
        if spec.router.serving not in named:
            yield ("router", "serving"), unknown_name("backend", spec.router.serving, spec.backends)
    for check_name, check in spec.gates.commands.items():
        for i, target in enumerate(check.backends or []):
            if target not in named:
                yield (
                    ("gates", "commands", check_name, "backends", i),
                    unknown_name("backend", target, spec.backends),
                )


def unknown_name(what: str, name: str, known: Mapping[str, Any]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    listed = ", ".join(sorted(known)) or "none defined"
    return f"unknown {what} {name!r} (known: {listed}){hint}"


_FIELD_WORDS = {
    "missing": "required field is missing",
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "dict_type": "must be a mapping",
    "model_type": "must be a mapping",
    "model_attributes_type": "must be a mapping",
}


def pydantic_problems(
    exc: ValidationError, root: type[BaseModel] = Inventory
) -> list[tuple[Loc, str]]:
    problems: list[tuple[Loc, str]] = []
    for err in exc.errors(include_url=False):
        loc = tuple(p for p in err["loc"] if p not in UNION_TAGS and p != "[key]")
        kind, ctx = err["type"], err.get("ctx") or {}
        bounds = {
            "greater_than_equal": ">=",
            "greater_than": ">",
            "less_than_equal": "<=",
            "less_than": "<",
        }
        if kind in bounds:
            limit = next(iter(ctx.values()))
            msg = f"must be {bounds[kind]} {limit} (got {err['input']!r})"
        elif kind == "extra_forbidden" and loc[:1] == ("router",) and loc[-1] in NGINX_ONLY_FIELDS:
            msg = f"only an nginx router has {loc[-1]!r}"
        elif kind == "extra_forbidden":
            msg = "unknown field"
            fields = _fields_at(root, loc[:-1])
            close = difflib.get_close_matches(str(loc[-1]), fields, n=1) if fields else []
            if close:
                msg += f"; did you mean {close[0]!r}?"
        elif kind == "literal_error":
            msg = f"must be one of {ctx.get('expected')} (got {err['input']!r})"
        elif kind == "value_error":
            msg = str(ctx.get("error", err["msg"]))
        elif kind in _FIELD_WORDS:
            got = "" if kind == "missing" else f" (got {err['input']!r})"
            msg = _FIELD_WORDS[kind] + got
        else:
            msg = err["msg"][0].lower() + err["msg"][1:]
        problems.append((loc, msg))
    return problems


def _fields_at(root: type[BaseModel], loc: Loc) -> list[str]:
    """The field names the model at `loc` accepts, for 'did you mean' hints."""
    model: Any = root
    for part in loc:
        if isinstance(part, str) and _is_model(model) and part in model.model_fields:
            model = _model_in(model.model_fields[part].annotation)
        elif isinstance(part, str) and get_origin(model) is dict:
            model = _model_in(get_args(model)[1])  # hosts.NAME, backends.NAME
        elif isinstance(part, int) and get_origin(model) is list:
            model = _model_in(get_args(model)[0])  # phases[0]
        else:
            return []
    return list(model.model_fields) if _is_model(model) else []


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _model_in(tp: Any) -> Any:
    """Unwrap Annotated and Optional down to a model or a dict type."""
    if get_origin(tp) is Annotated:
        return _model_in(get_args(tp)[0])
    if _is_model(tp) or get_origin(tp) in (dict, list):
        return tp
    for arg in get_args(tp):
        inner = _model_in(arg)
        if inner is not None:
            return inner
    return None


def format_problems(doc: Document, problems: list[tuple[Loc, str]]) -> str:
    lines = []
    for loc, msg in problems:
        line = doc.line_of(loc)
        where = f"{doc.source}:{line}" if line else doc.source
        lines.append(f"{where}: {_dotted(loc)}: {msg}" if loc else f"{where}: {msg}")
    return "\n".join(lines)


def _dotted(loc: Loc) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out
