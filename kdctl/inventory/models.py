"""The inventory's schema: hosts, backends, the router, gate settings, where state lives.

Field names are the inventory format docs/reference/inventory.md documents; scripts and
reports rely on that shape. Every model forbids unknown fields, so a typo is an error with a
line number rather than a silent default.
"""

from __future__ import annotations

import re
import shlex
from datetime import timedelta
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import httpx
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
_ADDRESS = re.compile(r"[A-Za-z0-9][A-Za-z0-9.:_-]*")
_USER = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}")
_ENV_VAR = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# systemd's own alphabet for unit names; the suffix is required so a typo is not a new unit.
_UNIT = re.compile(r"[A-Za-z0-9:_.\\@-]+\.(service|socket|target|timer|mount|scope|slice)")

BUILTIN_BACKEND_KINDS = ("sglang", "openai", "native", "reference")
# Router drivers kdctl ships (kdctl.traffic.routers); others register under `kdctl.routers`.
BUILTIN_ROUTER_KINDS = ("nginx", "sglang-router")


def _name(value: str) -> str:
    if not _NAME.fullmatch(value):
        raise ValueError(
            f"{value!r} is not a valid name (letters, digits, '_', '.', '-'; at most 63)"
        )
    return value


def _address(value: str) -> str:
    if not _ADDRESS.fullmatch(value):
        raise ValueError(f"{value!r} is not a host name or IP address")
    return value


def _user(value: str) -> str:
    if not _USER.fullmatch(value):
        raise ValueError(f"{value!r} is not a valid user name")
    return value


def _env_var(value: str) -> str:
    if not _ENV_VAR.fullmatch(value):
        raise ValueError(f"{value!r} is not an environment variable name")
    return value


def _unit(value: str) -> str:
    if value.startswith("-") or not _UNIT.fullmatch(value):
        raise ValueError(f"{value!r} is not a systemd unit name (e.g. sglang.service)")
    return value


def _absolute(value: str) -> str:
    if "\x00" in value or not PurePosixPath(value).is_absolute():
        raise ValueError(f"{value!r} must be an absolute path on the host")
    return value


def _absolute_or_name(value: str) -> str:
    """A program: an absolute path, or a bare name looked up on the host's PATH."""
    if not re.fullmatch(r"/?[A-Za-z0-9._+/-]+", value) or ".." in value.split("/"):
        raise ValueError(f"{value!r} is not a program name or an absolute path")
    return value


def _url(value: str) -> str:
    try:
        url = httpx.URL(value)
    except (httpx.InvalidURL, TypeError) as exc:
        raise ValueError(f"{value!r} is not a URL: {exc}") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise ValueError(f"{value!r} must be an http:// or https:// URL with a host")
    if url.userinfo or url.query:
        # Secrets belong in api_key_env or api_key_file, never in a file people share.
        raise ValueError("must not carry credentials or a query string; use api_key_env")
    return str(url).rstrip("/")


def _listen(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{value!r} must be ADDRESS:PORT with a port from 1 to 65535")
    _address(host.strip("[]"))
    return value


def _backend_ref(value: str) -> str:
    pool, at, host = value.partition("@")
    _name(pool)
    if at:
        _name(host)
    return value


Name = Annotated[str, AfterValidator(_name)]
# A backend as another part of the inventory names it: NAME, or POOL@HOST for one replica.
BackendRef = Annotated[str, AfterValidator(_backend_ref)]
UnitName = Annotated[str, AfterValidator(_unit)]
HostPath = Annotated[str, AfterValidator(_absolute)]
EnvVar = Annotated[str, AfterValidator(_env_var)]
Port = Annotated[int, Field(ge=1, le=65535)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class HostSpec(_Model):
    transport: Literal["ssh", "local"] = "ssh"
    address: Annotated[str, AfterValidator(_address)] | None = None
    port: Port = 22
    user: Annotated[str, AfterValidator(_user)] | None = None
    identity_file: Path | None = None
    known_hosts: Path = Path("~/.ssh/known_hosts")
    host_key_policy: Literal["reject", "accept-new"] = "reject"
    connect_timeout_s: Annotated[float, Field(gt=0, le=300)] = 10.0
    gpus: Annotated[int, Field(ge=0)] = 0
    gpu_model: str | None = None
    # How kdctl's HTTP reaches this host's engines and router: `direct` to their URLs, `ssh`
    # through a channel of the SSH connection kdctl holds (the box's sshd dials the URL, so
    # 127.0.0.1 there is the box's own loopback), `auto`: direct, falling back to SSH where a
    # URL cannot be reached from here and the host is an SSH host, saying so.
    http: Literal["auto", "direct", "ssh"] = "auto"

    @field_validator("http")
    @classmethod
    def _http_needs_ssh(cls, value: str, info: ValidationInfo) -> str:
        if value == "ssh" and info.data.get("transport") != "ssh":
            raise ValueError(
                "http: ssh sends HTTP through the host's SSH connection, which needs "
                "transport: ssh (a local host's URLs are reached directly)"
            )
        return value

    @property
    def target(self) -> str:
        """How a person names this host: user@address:port for SSH, 'local' otherwise."""
        if self.transport == "local":
            return "local"
        user = f"{self.user}@" if self.user else ""
        port = f":{self.port}" if self.port != 22 else ""
        return f"{user}{self.address}{port}"


class SystemdService(_Model):
    systemd: UnitName
    scope: Literal["system", "user"] = "system"


class FromEnv(_Model):
    """A value taken from kdctl's own environment when the engine starts: a secret such as a
    hub token then lives in neither the inventory nor anything kdctl prints."""

    from_env: EnvVar


def _env_value_tag(value: Any) -> str:
    return "from-env" if isinstance(value, dict | FromEnv) else "literal"


# Tagged, so that a bad value gets one message, not one per shape it failed to be.
EnvValue = Annotated[
    Annotated[str, Tag("literal")] | Annotated[FromEnv, Tag("from-env")],
    Discriminator(_env_value_tag),
]

# Parts of a variable's name that say it holds a credential (HF_TOKEN, OPENAI_API_KEY).
_SECRET_WORDS = {"TOKEN", "SECRET", "PASSWORD", "PASSWD", "KEY", "CREDENTIALS"}


def _env_values(env: dict[str, str | FromEnv]) -> dict[str, str | FromEnv]:
    for name, value in env.items():
        if not isinstance(value, str):
            continue
        if "\x00" in value:
            raise ValueError(f"{name}: a value cannot hold a NUL character")
        if _SECRET_WORDS & set(name.upper().split("_")):
            # As for URLs: secrets belong in kdctl's environment, never in a file people share.
            raise ValueError(
                f"{name} looks like a secret; write {{from_env: {name}}} and export it where "
                "kdctl runs instead of putting the value here"
            )
    return env


def split_command(command: str | list[str]) -> list[str]:
    """A command as its arguments: a string is split as a shell would, a list taken as it is."""
    return shlex.split(command) if isinstance(command, str) else list(command)


class _Command(_Model):
    """A program to run: one shell-like string, split as a shell would, or a list of args."""

    command: str | list[str]

    @property
    def argv(self) -> list[str]:
        return split_command(self.command)

    @model_validator(mode="after")
    def _splits(self) -> _Command:
        try:
            argv = self.argv
        except ValueError as exc:
            raise ValueError(f"command cannot be split into arguments: {exc}") from None
        if not argv or not argv[0]:
            raise ValueError("command must not be empty")
        return self


class CommandService(_Command):
    pidfile: HostPath
    log: HostPath
    workdir: HostPath | None = None
    env: Annotated[dict[EnvVar, EnvValue], AfterValidator(_env_values)] = Field(
        default_factory=dict
    )


def _service_tag(value: Any) -> str | None:
    if isinstance(value, dict):
        if "systemd" in value:
            return "systemd-unit"
        if "command" in value:
            return "command-line"
    elif isinstance(value, SystemdService):
        return "systemd-unit"
    elif isinstance(value, CommandService):
        return "command-line"
    return None


Service = Annotated[
    Annotated[SystemdService, Tag("systemd-unit")] | Annotated[CommandService, Tag("command-line")],
    Discriminator(
        _service_tag,
        custom_error_type="service_kind",
        custom_error_message="must have either 'systemd: UNIT' or 'command: ...' "
        "with 'pidfile' and 'log'",
    ),
]
# Union tags pydantic puts in an error's location; a person names the field without them.
UNION_TAGS = (
    "backend:one",
    "backend:pool",
    "systemd-unit",
    "command-line",
    "literal",
    "from-env",
    "router:nginx",
    "router:sglang-router",
    "router:plugin",
)


class EngineSpec(_Model):
    """What an engine is and how kdctl talks to it, wherever it runs: one backend on one host,
    or every replica of a pool."""

    kind: str
    mode: Literal["http", "command"] | None = None
    api_key_env: EnvVar | None = None
    api_key_file: Path | None = None
    gpus: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    tp_size: Annotated[int, Field(ge=1)] = 1
    model: str | None = None
    served_model_name: str | None = None
    service: Service | None = None
    # `native` in command mode: the engine's binary, run once per batch of requests
    # (docs/native-engine-contract.md). kdctl appends --request FILE --response FILE.
    command: str | list[str] | None = None
    workdir: HostPath = "/tmp"
    command_timeout_s: Annotated[float, Field(gt=0)] = 600.0
    # The longest one answer may take, start to end (a generation of max_new_tokens included):
    # an engine that never answers, or never stops answering, fails the gate by then.
    request_timeout_s: Annotated[float, Field(gt=0)] = 60.0

    @property
    def command_argv(self) -> list[str]:
        return [] if self.command is None else split_command(self.command)


class BackendSpec(EngineSpec):
    host: Name
    url: Annotated[str, AfterValidator(_url)] | None = None

    def shares_gpus_with(self, other: BackendSpec) -> bool:
        """Whether the two need some of the same GPUs of one host: one must stop before the
        other can start."""
        return self.host == other.host and bool(set(self.gpus) & set(other.gpus))


class Replica(_Model):
    """One engine of a pool: its box, where it answers, and GPUs of its own where they differ
    from the pool's."""

    host: Name
    url: Annotated[str, AfterValidator(_url)] | None = None
    gpus: list[Annotated[int, Field(ge=0)]] | None = None


class ReplicaGroup(_Model):
    """One replica on every host of a group, each answering on the host's address."""

    group: Name
    port: Port
    scheme: Literal["http", "https"] = "http"


class PoolSpec(EngineSpec):
    """The same engine on several boxes (each replica its own service, GPUs and identity),
    behind one router. Loaded, each replica is a backend of its own named POOL@HOST."""

    replicas: Annotated[list[Replica], Field(min_length=1)] | ReplicaGroup
    # Requests (running and queued) one replica carries; a rolling cutover takes boxes out
    # only while those left can carry the load measured then. Unset, headroom is not judged.
    capacity_per_replica: Annotated[int, Field(ge=1)] | None = None


def _backend_tag(value: Any) -> str:
    if isinstance(value, dict):
        return "backend:pool" if "replicas" in value else "backend:one"
    return "backend:pool" if isinstance(value, PoolSpec) else "backend:one"


# A backend entry is one engine (host, url) or a pool of them (replicas).
BackendEntry = Annotated[
    Annotated[BackendSpec, Tag("backend:one")] | Annotated[PoolSpec, Tag("backend:pool")],
    Discriminator(_backend_tag),
]


class RouterSpec(_Model):
    """What every router driver takes; a driver with settings of its own has a spec of its own
    below (one another distribution registers takes these)."""

    # A driver's name: nginx, sglang-router, or one another distribution registers.
    kind: str
    host: Name
    listen: Annotated[str, AfterValidator(_listen)]
    serving: BackendRef
    # The key the front door itself requires (a gateway with its own auth); unset, kdctl sends
    # the key of the backend the router weights most, which nginx passes through.
    api_key_env: EnvVar | None = None
    api_key_file: Path | None = None

    def front_url(self, host: HostSpec) -> str:
        """Where clients reach the router (`host`, the spec of the host it runs on)."""
        return listen_url(self.listen, host)


def listen_url(listen: str, host: HostSpec) -> str:
    """The URL of a server listening on ADDRESS:PORT on `host`: a wildcard address taken as
    the host's."""
    address, _, port = listen.rpartition(":")
    address = address.strip("[]")
    if address in ("0.0.0.0", "::", ""):  # noqa: S104 - the address it listens on
        address = "127.0.0.1" if host.transport == "local" else (host.address or "127.0.0.1")
    return f"http://{address}:{port}"


class NginxRouterSpec(RouterSpec):
    kind: Literal["nginx"] = "nginx"
    # The file kdctl owns (upstream, map, server), included at http level by the main
    # configuration; the previous version is kept beside it as FILE.prev.
    include: HostPath = "/etc/nginx/conf.d/kdctl.conf"
    # The binary, and its -p prefix and -c configuration when they are not the default.
    nginx: Annotated[str, AfterValidator(_absolute_or_name)] = "nginx"
    prefix: HostPath | None = None
    conf: HostPath | None = None
    # Client connections are not kept alive through the front: a request sent on an idle
    # kept-alive connection as a reload closes it fails (6 in 625 measured; 0 without).
    keepalive: bool = False


# What only nginx's driver reads: on another router each is refused, never silently ignored.
NGINX_ONLY_FIELDS = tuple(
    f for f in NginxRouterSpec.model_fields if f not in RouterSpec.model_fields
)


class GatewayPeer(_Model):
    """Another replica of SGLang's gateway in front of the same engines: it keeps a worker
    registry of its own, which kdctl changes and reads back as it does the first's."""

    host: Name
    listen: Annotated[str, AfterValidator(_listen)]

    def front_url(self, host: HostSpec) -> str:
        return listen_url(self.listen, host)


class SGLangRouterSpec(RouterSpec):
    kind: Literal["sglang-router"] = "sglang-router"
    # The gateway's other replicas, where it runs several (they do not share registries).
    peers: list[GatewayPeer] = Field(default_factory=list)


def _router_tag(value: Any) -> str:
    kind = value.get("kind") if isinstance(value, dict) else getattr(value, "kind", None)
    return f"router:{kind}" if kind in BUILTIN_ROUTER_KINDS else "router:plugin"


# The router's spec by its kind: nginx's fields belong to nginx alone.
AnyRouterSpec = Annotated[
    Annotated[NginxRouterSpec, Tag("router:nginx")]
    | Annotated[SGLangRouterSpec, Tag("router:sglang-router")]
    | Annotated[RouterSpec, Tag("router:plugin")],
    Discriminator(_router_tag),
]


class ThroughputWorkload(_Model):
    """What the load generator sends. Its hash ties a candidate's run to the baseline's."""

    input_len: Annotated[int, Field(ge=1)] = 1024
    output_len: Annotated[int, Field(ge=1)] = 256
    concurrency: list[Annotated[int, Field(ge=1)]] = Field(
        default_factory=lambda: [1, 8, 32], min_length=1
    )
    num_prompts: Annotated[int, Field(ge=1)] = 200
    # Requests a second (Poisson, or gamma with burstiness); unset sends all at once, paced
    # only by the concurrency cap.
    request_rate: Annotated[float, Field(gt=0)] | None = None
    burstiness: Annotated[float, Field(gt=0)] = 1.0
    # Excluded from the figures; unset means one per concurrency slot.
    warmup_requests: Annotated[int, Field(ge=0)] | None = None
    # What the prompts are. random-ids: token ids drawn from the seed (no download). text:
    # `prompts`, else the shipped corpus of chat, code, math and long prompts. auto: `prompts`
    # if set, else random ids unless the candidate or the baseline decodes speculatively (asked
    # of the engine itself), whose speed depends on the text it drafts on: then text.
    source: Literal["auto", "random-ids", "text"] = "auto"
    # A JSONL prompt file (as the exactness corpus).
    prompts: Path | None = None
    # Random token ids are drawn from [low, high): keep it inside the model's vocabulary.
    token_range: tuple[Annotated[int, Field(ge=0)], Annotated[int, Field(ge=1)]] = (10, 1000)
    seed: int = 0
    ignore_eos: bool = True

    @model_validator(mode="after")
    def _range(self) -> ThroughputWorkload:
        if self.token_range[0] >= self.token_range[1]:
            raise ValueError("token_range must be [low, high) with low < high")
        if self.source == "random-ids" and self.prompts is not None:
            raise ValueError("prompts is set, but source is random-ids: drop one")
        return self


def _served_unset(value: str | None) -> str | None:
    # The served comparison is kept as no mode at all: results recorded before the setting
    # existed were served loads, and still meet the criteria that ask for one.
    return None if value == "served" else value


class ThroughputSettings(_Model):
    workload: ThroughputWorkload = ThroughputWorkload()
    # What is compared. served (unset): kdctl's load generator against the engine's server.
    # offline-batch: a command-mode engine's own timings of its batch runs, at batch 1 and at
    # every concurrency, against the baseline's served run of the same prompts at that
    # concurrency; never a result that meets a criterion asking for the served comparison.
    mode: Annotated[Literal["served", "offline-batch"] | None, AfterValidator(_served_unset)] = None
    # Candidate output token throughput over the baseline's, at every concurrency.
    min_ratio: Annotated[float, Field(gt=0)] = 1.0
    slo_ttft_ms: Annotated[float, Field(gt=0)] | None = None
    slo_itl_ms: Annotated[float, Field(gt=0)] | None = None
    slo_tpot_ms: Annotated[float, Field(gt=0)] | None = None
    slo_e2el_ms: Annotated[float, Field(gt=0)] | None = None
    # Which percentile of each latency the SLOs bound.
    slo_percentile: Literal["p50", "p90", "p99"] = "p99"
    max_failed_requests: Annotated[int, Field(ge=0)] = 0
    client: Literal["aiohttp", "httpx"] = "aiohttp"
    # The longest one request may take, start to end (with httpx, the longest wait for a read).
    request_timeout_s: Annotated[float, Field(gt=0)] = 600.0
    # Load runs per concurrency and engine; the median run by output throughput is the one
    # judged (and recorded), so one unlucky run on a noisy machine decides nothing.
    repeats: Annotated[int, Field(ge=1)] = 1
    # Where the baseline's figures come from. recorded: its recorded run of the same workload
    # (`kdctl baseline record`), else measured now as under interleaved; the way for engines
    # that cannot serve at once. interleaved: measured now, alternating with the candidate run
    # by run, so both meet the same machine; the way for engines that share one.
    baseline_run: Literal["recorded", "interleaved"] = "recorded"


class ExactnessSettings(_Model):
    corpus: Path | None = None
    max_new_tokens: Annotated[int, Field(ge=1)] = 64
    mode: Literal["strict", "logprob-close"] = "logprob-close"
    top_k: Annotated[int, Field(ge=1, le=20)] = 5
    min_match_rate: Annotated[float, Field(ge=0, le=1)] = 1.0
    concurrency: Annotated[int, Field(ge=1)] = 4


def _judged_unset(value: bool | None) -> bool | None:
    # Judging the engine's memory is kept as no value at all: results recorded before the
    # setting existed judged it, and still meet the criteria that ask for it.
    return None if value else value


class TpHealthSettings(_Model):
    # Bus bandwidth at the large size and latency at the small one, across the TP ranks, for
    # 8 PCIe GPUs. 33 GB/s: 0.9 x 37.6, the lowest tuned 8x RTX PRO 6000 nccl-tests figure
    # (local-inference-lab/rtx6kpro hardware/pcie-bandwidth.md), 0.9 as nccl-tests' own
    # NCCL_TESTS_MIN_BW rule. 61 us: NCCL's 24.2 to 24.5 us at 8 to 32 KiB on those 8 GPUs
    # (same page) plus the 36.2 us kdctl's probe read on one H200 rank with engines loaded,
    # nothing crossing a link (docs/gpu-validation.md): what torch's call costs around NCCL's.
    min_busbw_gbps: Annotated[float, Field(ge=0)] = 33.0
    max_small_latency_us: Annotated[float, Field(gt=0)] = 61.0
    # The watchdog: a broken P2P path hangs the all-reduce without logging an Xid.
    timeout_s: Annotated[float, Field(gt=0)] = 120.0
    large_size_mib: Annotated[float, Field(gt=0)] = 256.0
    small_size_kib: Annotated[float, Field(gt=0)] = 16.0
    iters: Annotated[int, Field(ge=1)] = 20
    warmup: Annotated[int, Field(ge=0)] = 5
    # The host's Python with torch, which runs the probe under torchrun.
    python: Annotated[str, AfterValidator(_absolute_or_name)] = "python3"
    # HGX boxes: every pair of TP GPUs on NVLink (NV# in `nvidia-smi topo -m`).
    require_nvlink: bool = False
    # Whether the engine must hold memory on every TP GPU (true or unset). false checks the box
    # for an engine that cannot serve on it yet (a TP-8 phase before the server's): every other
    # rule holds.
    engine_memory: Annotated[bool | None, AfterValidator(_judged_unset)] = None


_THRESHOLD = re.compile(r"^\s*(>=|<=|==|>|<)\s*(-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)\s*$")


def _threshold(value: str) -> str:
    if not _THRESHOLD.match(value):
        raise ValueError(f"{value!r} is not a threshold such as '>= 900' or '== 0'")
    return value


Threshold = Annotated[str, AfterValidator(_threshold)]


class CommandCheck(_Command):
    """A program on the backend's host that prints one JSON object of metrics (the native
    engine's kernel benchmark, its test suite), judged by thresholds on those metrics."""

    workdir: HostPath | None = None
    timeout_s: Annotated[float, Field(gt=0)] = 600.0
    thresholds: dict[str, Threshold] = Field(min_length=1)
    # The backends it judges (a pool: each of its replicas); unset, every backend.
    backends: list[BackendRef] | None = None

    def parsed(self) -> dict[str, tuple[str, float]]:
        return {metric: parse_threshold(text) for metric, text in self.thresholds.items()}


def parse_threshold(text: str) -> tuple[str, float]:
    """'>= 2.5' as ('>=', 2.5); the text must have passed the Threshold check."""
    m = _THRESHOLD.match(text)
    if m is None:
        raise ValueError(f"{text!r} is not a threshold")
    return m.group(1), float(m.group(2))


_DURATION = re.compile(r"^(\d+)([smhd])$")


def _duration(value: str) -> str:
    if not _DURATION.match(value) or int(value[:-1]) == 0:
        raise ValueError(f"{value!r} is not a duration such as '15m', '24h' or '7d'")
    return value


def parse_duration(value: str) -> timedelta:
    m = _DURATION.match(value)
    if m is None:
        raise ValueError(f"{value!r} is not a duration")
    unit = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}[m.group(2)]
    return timedelta(**{unit: int(m.group(1))})


Duration = Annotated[str, AfterValidator(_duration)]


class GateSettings(_Model):
    throughput: ThroughputSettings = ThroughputSettings()
    exactness: ExactnessSettings = ExactnessSettings()
    tp_health: TpHealthSettings = TpHealthSettings()
    commands: dict[Name, CommandCheck] = Field(default_factory=dict)
    # How long a gate's result counts, by gate name, over the gate's own default window.
    freshness: dict[str, Duration] = Field(default_factory=dict)


class EvidenceSettings(_Model):
    # Imports must carry an HMAC made with KDCTL_EVIDENCE_KEY: a bare digest proves only that
    # the file is intact, since anyone can edit a result and compute the digest again.
    require_signed: bool = False
    # A store the team shares (postgresql://user@host:port/db; KDCTL_EVIDENCE_URL wins), else
    # SQLite in the state directory. Its password comes from the environment or a file.
    url: str | None = None
    password_env: EnvVar | None = None
    password_file: Path | None = None

    @field_validator("url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value)
        if parts.scheme not in ("postgresql", "postgres") or not parts.hostname:
            raise ValueError("must be postgresql://USER@HOST[:PORT]/DATABASE")
        if parts.password is not None:
            # Said without echoing it: the message is printed, the password must not be.
            raise ValueError(
                "holds a password: put it in evidence.password_env or evidence.password_file"
            )
        return value

    @model_validator(mode="after")
    def _one_password(self) -> EvidenceSettings:
        if self.password_env and self.password_file:
            raise ValueError("set evidence.password_env or evidence.password_file, not both")
        return self


class Inventory(_Model):
    hosts: dict[Name, HostSpec]
    # Hosts that run the same thing: a pool's `replicas: {group: NAME, port: PORT}`.
    groups: dict[Name, Annotated[list[Name], Field(min_length=1)]] = Field(default_factory=dict)
    backends: dict[Name, BackendEntry] = Field(default_factory=dict)
    router: AnyRouterSpec | None = None
    gates: GateSettings = GateSettings()
    roadmap: Path | None = None
    evidence: EvidenceSettings = EvidenceSettings()
    state_dir: Path = Path("~/.local/state/kdctl")
