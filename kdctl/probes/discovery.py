"""What serves on a host and how it was started, read and never changed: listening TCP sockets
and their owners (`ss`), processes and their exact command lines (`ps`, /proc), systemd units
(running and stopped: a stopped engine is known only by its unit's ExecStart), the inference
engines among them with the values their arguments give, and nginx with what it proxies to.

Every parser takes captured text, so each is tested on recorded output; the readers run
constant commands whose only variable parts are argument-list entries, quoted by the
transport, or positional parameters of a constant shell script.
"""

from __future__ import annotations

import fnmatch
import posixpath
import re
import shlex
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from pydantic import BaseModel

from kdctl.errors import InfraError
from kdctl.probes.gpus import GpuProbe, probe_gpus
from kdctl.transports import Transport

EngineKind = Literal["sglang", "vllm", "reference", "sglang-router"]

# Where unit files live, in systemd's order of precedence: a unit in /etc hides one of the same
# name below it.
UNIT_DIRS = (
    "/etc/systemd/system",
    "/run/systemd/system",
    "/lib/systemd/system",
    "/usr/lib/systemd/system",
)
# Only unit files that may start an engine, a router or nginx are read whole: a box has hundreds.
_UNIT_PATTERN = r"sglang|vllm|kdctl|nginx|model.gateway|launch_router"
# Separators in the output of the scripts below: ASCII's record and unit separators, which no
# path or command line a person writes holds.
_RS, _US = "\x1e", "\x1f"
_READ_CAP = 262144

# Defaults of each engine's own argument parser, used where the command line leaves them out.
_DEFAULT_PORT: dict[EngineKind, int] = {
    "sglang": 30000,
    "vllm": 8000,
    "reference": 30000,
    "sglang-router": 30000,
}
_DEFAULT_BIND: dict[EngineKind, str] = {
    "sglang": "127.0.0.1",
    "vllm": "0.0.0.0",  # noqa: S104 - vLLM's own default: every interface
    "reference": "127.0.0.1",
    "sglang-router": "127.0.0.1",
}
# Arguments whose value is a credential: never shown, never written.
SECRET_OPTIONS = ("--api-key", "--admin-api-key", "--hf-token", "--token")
_VAR_REF = re.compile(r"^\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))$")
_ANY_REF = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*\}|\$[A-Za-z_][A-Za-z0-9_]*")
# Environment values kept from a unit: what says where an engine runs. Every other value may be
# a credential, so only its name is kept.
_KEPT_ENV = ("CUDA_VISIBLE_DEVICES",)


class Listener(BaseModel):
    """One listening TCP socket; its owners are known where `ss -p` may show them (root, or
    the owner's own user)."""

    address: str
    port: int
    pids: list[int] = []
    programs: list[str] = []
    # The socket's inode: the same socket seen from two processes' views of the network.
    inode: int | None = None


class Process(BaseModel):
    pid: int
    ppid: int
    user: str
    argv: list[str]
    # From /proc/PID/cmdline, NUL-separated; else `ps`'s text split at spaces.
    exact: bool = False
    # The systemd unit whose cgroup holds it, where systemd runs.
    unit: str | None = None
    # What listens in its own network namespace (/proc/PID/net/tcp, readable by every login);
    # None where that could not be read.
    own_listeners: list[Listener] | None = None


class Unit(BaseModel):
    """A systemd service unit as its files say (the unit file and its drop-ins)."""

    name: str
    path: str
    exec_start: list[str] | None = None
    # With ExecStart's `@` prefix, the program run is not argv[0].
    executable: str | None = None
    env: dict[str, str] = {}
    env_names: list[str] = []
    environment_files: list[str] = []
    working_directory: str | None = None
    user: str | None = None
    drop_ins: list[str] = []
    # From systemctl where systemd runs; None where the files are all there is.
    active_state: str | None = None
    sub_state: str | None = None
    main_pid: int | None = None


class EngineCommand(BaseModel):
    """What an engine's or router's command line says about it."""

    kind: EngineKind
    bind: str
    port: int
    model: str | None = None
    served_name: str | None = None
    tp_size: int | None = None
    # Whether it requires an API key, and the variable that holds it where the command line
    # names one (`--api-key ${VAR}` in a unit, `--api-key-env VAR`).
    requires_key: bool = False
    key_env: str | None = None
    worker_urls: list[str] = []
    # field -> the argument it came from ("--tp 8"); a field absent here is the engine's default.
    # `key_from` names where the key's argument was read when not on this command line.
    found: dict[str, str] = {}


class NginxFront(BaseModel):
    """One nginx server block that proxies: where it listens and the engines behind it."""

    listen: list[str]
    # host:port of each server it proxies to, with its weight.
    targets: dict[str, int] = {}
    upstream: str | None = None
    # The file holding the upstream, and whether kdctl's nginx driver wrote it.
    file: str | None = None
    written_by_kdctl: bool = False


class NginxSetup(BaseModel):
    pid: int
    binary: str
    prefix: str | None = None
    conf: str
    # "nginx -T", or "its configuration files" where nginx -T was refused.
    source: str | None = None
    fronts: list[NginxFront] = []
    problems: list[str] = []


class HostFacts(BaseModel):
    hostname: str | None = None
    systemd: bool = False
    gpus: GpuProbe
    listeners: list[Listener] = []
    # Whether `ss` could name sockets' owners (root, or engines of the login's own user).
    owners_shown: bool = False
    processes: list[Process] = []
    units: list[Unit] = []
    nginx: list[NginxSetup] = []
    # Model folders' config.json, by path, where the host let it be read.
    model_configs: dict[str, str] = {}
    # Engine processes' pidfiles and the files their output goes to, by pid.
    pidfiles: dict[int, str] = {}
    logs: dict[int, str] = {}
    notes: list[str] = []


# --- sockets ---------------------------------------------------------------------------------

_USERS = re.compile(r'\("([^"]*)",pid=(\d+),fd=\d+\)')


def _split_endpoint(text: str) -> tuple[str, int] | None:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        return None
    host = host.strip("[]").split("%", 1)[0]
    if host.startswith("::ffff:") and "." in host:
        host = host[len("::ffff:") :]
    return host or "*", int(port)


_INODE = re.compile(r"\bino:(\d+)")


def parse_ss(text: str) -> list[Listener]:
    """`ss -Hltnpe`: State Recv-Q Send-Q Local:Port Peer:Port [users:((...))] [ino:N] ..."""
    found = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 5 or fields[0] != "LISTEN":
            continue
        endpoint = _split_endpoint(fields[3])
        if endpoint is None:
            continue
        rest = " ".join(fields[5:])
        users = _USERS.findall(rest)
        inode = _INODE.search(rest)
        found.append(
            Listener(
                address=endpoint[0],
                port=endpoint[1],
                pids=sorted({int(pid) for _, pid in users}),
                programs=sorted({name for name, _ in users}),
                inode=int(inode.group(1)) if inode and inode.group(1) != "0" else None,
            )
        )
    return found


def _hex_address(text: str) -> str:
    raw = bytes.fromhex(text)
    if len(raw) == 4:
        return ".".join(str(b) for b in reversed(raw))
    # /proc/net/tcp6: four little-endian 32-bit words.
    words = [raw[i : i + 4][::-1] for i in range(0, 16, 4)]
    flat = b"".join(words)
    if flat[:12] == b"\x00" * 10 + b"\xff\xff":
        return ".".join(str(b) for b in flat[12:])
    groups = [f"{int.from_bytes(flat[i : i + 2], 'big'):x}" for i in range(0, 16, 2)]
    text6 = ":".join(groups)
    # The two forms people read: every interface and loopback.
    return {"0:0:0:0:0:0:0:0": "::", "0:0:0:0:0:0:0:1": "::1"}.get(text6, text6)


def parse_proc_net_tcp(text: str) -> list[Listener]:
    """/proc/net/tcp and tcp6 (where `ss` is missing): sockets in state 0A, LISTEN."""
    found = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 4 or fields[3] != "0A" or ":" not in fields[1]:
            continue
        address, _, port = fields[1].partition(":")
        inode = fields[9] if len(fields) > 9 and fields[9].isdigit() else "0"
        try:
            found.append(
                Listener(
                    address=_hex_address(address),
                    port=int(port, 16),
                    inode=int(inode) or None,
                )
            )
        except ValueError:
            continue
    return found


# --- processes -------------------------------------------------------------------------------


def parse_ps(text: str) -> list[Process]:
    """`ps -eww -o pid=,ppid=,user:32=,args=`."""
    found = []
    for line in text.splitlines():
        fields = line.split(None, 3)
        if len(fields) < 4 or not fields[0].isdigit() or not fields[1].isdigit():
            continue
        found.append(
            Process(pid=int(fields[0]), ppid=int(fields[1]), user=fields[2], argv=fields[3].split())
        )
    return found


class ProcRecord(BaseModel):
    argv: list[str]
    cgroup: str = ""
    # None: its /proc/PID/net could not be read.
    listeners: list[Listener] | None = None


def parse_proc_records(text: str) -> dict[int, ProcRecord]:
    """The output of _PROC_SCRIPT: per pid its NUL-separated command line, its cgroup and the
    listening sockets of its network namespace."""
    found: dict[int, ProcRecord] = {}
    for record in text.split(_RS):
        pid, sep, rest = record.partition(_US)
        if not sep or not pid.isdigit():
            continue
        cmdline, _, rest = rest.partition(_US)
        cgroup, _, net = rest.partition(_US)
        argv = [a for a in cmdline.split("\x00") if a]
        if argv:
            found[int(pid)] = ProcRecord(
                argv=argv,
                cgroup=cgroup,
                listeners=parse_proc_net_tcp(net) if net.strip() else None,
            )
    return found


def unit_of_cgroup(cgroup: str) -> str | None:
    """The service unit of a /proc/PID/cgroup text (`0::/system.slice/sglang.service`)."""
    for line in cgroup.splitlines():
        path = line.split(":", 2)[-1]
        for part in reversed(path.split("/")):
            if part.endswith(".service"):
                return part
    return None


# --- engine command lines --------------------------------------------------------------------


def _option(argv: Sequence[str], *names: str) -> tuple[str, str] | None:
    """The value of the last of `names` in argv (`--port 1` or `--port=1`) and how it was
    written."""
    hit = None
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name and i + 1 < len(argv):
                hit = (argv[i + 1], f"{name} {argv[i + 1]}")
            elif arg.startswith(name + "="):
                hit = (arg[len(name) + 1 :], arg)
    return hit


def _values(argv: Sequence[str], name: str) -> list[str]:
    """Every value after `name` up to the next option (argparse's nargs='+')."""
    for i, arg in enumerate(argv):
        if arg == name:
            values = []
            for value in argv[i + 1 :]:
                if value.startswith("-"):
                    break
                values.append(value)
            return values
        if arg.startswith(name + "="):
            return [arg[len(name) + 1 :]]
    return []


def _module_after(argv: Sequence[str], module: str) -> int | None:
    """Where `-m MODULE` ends, for a Python interpreter's command line."""
    for i, arg in enumerate(argv[:-1]):
        if arg == "-m" and argv[i + 1] == module:
            return i + 2
        if arg == f"-m{module}":
            return i + 1
    return None


def engine_kind(argv: Sequence[str]) -> tuple[EngineKind, int] | None:
    """Which engine or router a command line starts, and where its own arguments begin."""
    for module, kind in (
        ("sglang.launch_server", "sglang"),
        ("vllm.entrypoints.openai.api_server", "vllm"),
        ("sglang_router.launch_router", "sglang-router"),
    ):
        at = _module_after(argv, module)
        if at is not None:
            return kind, at  # type: ignore[return-value]
    names = [posixpath.basename(a) for a in argv[:4]]
    for i, name in enumerate(names):
        following = argv[i + 1] if i + 1 < len(argv) else ""
        if name == "vllm" and following == "serve":
            return "vllm", i + 2
        if name == "sglang" and following == "serve":
            return "sglang", i + 2
        if name in ("sglang-router", "sgl-model-gateway"):
            return "sglang-router", i + 1
    at = _module_after(argv, "kdctl")
    if at is None and "kdctl" in names:
        at = names.index("kdctl") + 1
    if at is not None and list(argv[at : at + 2]) == ["reference", "serve"]:
        return "reference", at + 2
    return None


def _variable(value: str) -> str | None:
    match = _VAR_REF.match(value)
    return (match.group(1) or match.group(2)) if match else None


def _port(value: str) -> int | None:
    return int(value) if value.isdigit() and 1 <= int(value) <= 65535 else None


def parse_engine_command(argv: Sequence[str]) -> EngineCommand | None:
    """The engine a command line starts and what its arguments say, None for anything else."""
    known = engine_kind(argv)
    if known is None:
        return None
    kind, at = known
    args = list(argv[at:])
    found: dict[str, str] = {}
    bind = _DEFAULT_BIND[kind]
    port = _DEFAULT_PORT[kind]
    if hit := _option(args, "--host"):
        bind, found["bind"] = hit
    if (hit := _option(args, "--port")) and (number := _port(hit[0])) is not None:
        port, found["port"] = number, hit[1]
    cmd = EngineCommand(kind=kind, bind=bind, port=port)
    model_flags = {
        "sglang": ("--model-path", "--model"),
        "vllm": ("--model",),
        "reference": ("--model",),
        "sglang-router": (),
    }[kind]
    if model_flags and (hit := _option(args, *model_flags)):
        cmd.model, found["model"] = hit
    elif kind == "vllm" and args and not args[0].startswith("-"):
        # `vllm serve MODEL`: the model is the first positional argument.
        cmd.model, found["model"] = args[0], f"serve {args[0]}"
    if kind != "sglang-router" and (names := _values(args, "--served-model-name")):
        cmd.served_name = names[0]
        found["served_name"] = f"--served-model-name {names[0]}"
    tp_flags = ("--tp-size", "--tp", "--tensor-parallel-size", "-tp")
    if kind in ("sglang", "vllm") and (hit := _option(args, *tp_flags)) and hit[0].isdigit():
        cmd.tp_size = max(int(hit[0]), 1)
        found["tp_size"] = hit[1]
    if kind == "reference" and (hit := _option(args, "--api-key-env")):
        cmd.requires_key, cmd.key_env = True, hit[0]
        found["key"] = hit[1]
    elif hit := _option(args, "--api-key"):
        cmd.requires_key = True
        cmd.key_env = _variable(hit[0])
        # Only the variable's name, or that a key is there: never the key.
        found["key"] = f"--api-key {hit[0]}" if cmd.key_env else "--api-key"
    if kind == "sglang-router":
        cmd.worker_urls = _values(args, "--worker-urls")
        if cmd.worker_urls:
            found["worker_urls"] = "--worker-urls"
    cmd.found = found
    return cmd


def mask_secrets(argv: Sequence[str]) -> list[str]:
    """argv with every credential's value replaced (a variable reference is kept: it is a
    name, not a key)."""
    masked = list(argv)
    for i, arg in enumerate(masked):
        for name in SECRET_OPTIONS:
            if arg == name and i + 1 < len(masked) and _variable(masked[i + 1]) is None:
                masked[i + 1] = "***"
            elif arg.startswith(name + "=") and _variable(arg[len(name) + 1 :]) is None:
                masked[i] = f"{name}=***"
    return masked


def secret_values(argv: Sequence[str]) -> list[str]:
    """The credentials written on a command line (to keep them out of everything printed)."""
    values = []
    for i, arg in enumerate(argv):
        for name in SECRET_OPTIONS:
            if arg == name and i + 1 < len(argv):
                values.append(argv[i + 1])
            elif arg.startswith(name + "="):
                values.append(arg[len(name) + 1 :])
    return [v for v in values if _variable(v) is None]


def same_command(running: Sequence[str], started: Sequence[str]) -> bool:
    """Whether a process runs a unit's ExecStart: the same arguments, a variable reference in
    the unit standing for whatever it expanded to, the program by name or path."""
    if len(running) != len(started) or not running:
        return False
    for i, (have, want) in enumerate(zip(running, started, strict=True)):
        if i == 0 and posixpath.basename(have) == posixpath.basename(want):
            continue
        if have == want:
            continue
        if _ANY_REF.search(want):
            pattern = "".join(
                ".*" if _ANY_REF.fullmatch(piece) else re.escape(piece)
                for piece in re.split(f"({_ANY_REF.pattern})", want)
                if piece
            )
            if re.fullmatch(pattern, have, re.DOTALL):
                continue
        return False
    return True


# --- systemd units ---------------------------------------------------------------------------


def _unit_lines(text: str) -> Iterable[tuple[str, str, str]]:
    """(section, key, value) of a unit file, continuation lines joined."""
    section = ""
    pending = ""
    for raw in text.splitlines():
        line = pending + raw.strip() if pending else raw.strip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, sep, value = line.partition("=")
        if sep:
            yield section, key.strip(), value.strip()


def _split_unit_words(value: str) -> list[str]:
    # systemd's quoting is close to the shell's; where they differ, words split at spaces.
    try:
        return shlex.split(value)
    except ValueError:
        return value.split()


def _exec_words(value: str) -> tuple[list[str], str | None]:
    """ExecStart's value as argv, its prefixes (`-@:+!`) dropped; with `@`, the program run
    is the first word and the second is the argv[0] the process sees."""
    prefix = re.match(r"^[-@:+!]*", value)
    flags = prefix.group(0) if prefix else ""
    words = _split_unit_words(value[len(flags) :])
    if "@" in flags and len(words) >= 2:
        return words[1:], words[0]
    return words, None


def parse_unit_file(name: str, path: str, texts: Sequence[str]) -> Unit:
    """A unit from its file and then its drop-ins, in order: a later setting wins, and an
    empty `ExecStart=` clears the ones before it, as systemd reads them."""
    unit = Unit(name=name, path=path)
    env: dict[str, str | None] = {}
    for text in texts:
        for section, key, value in _unit_lines(text):
            if section != "Service":
                continue
            if key == "ExecStart":
                if not value:
                    unit.exec_start, unit.executable = None, None
                elif unit.exec_start is None:
                    unit.exec_start, unit.executable = _exec_words(value)
            elif key == "Environment":
                for word in _split_unit_words(value):
                    var, sep, val = word.partition("=")
                    if sep:
                        env[var] = val
            elif key == "EnvironmentFile" and value:
                unit.environment_files.append(value.lstrip("-"))
            elif key == "WorkingDirectory":
                unit.working_directory = value.lstrip("-") or None
            elif key == "User":
                unit.user = value or None
    unit.env_names = sorted(env)
    unit.env = {k: v for k, v in env.items() if k in _KEPT_ENV and v is not None}
    return unit


def parse_unit_dump(text: str) -> list[Unit]:
    """The output of _UNITS_SCRIPT: files from the unit folders, the first of each name in
    precedence order, each with its drop-ins (`NAME.service.d/*.conf`, by file name)."""
    files: dict[str, str] = {}
    for record in text.split(_RS):
        path, sep, content = record.partition(_US)
        if sep and path.startswith("/"):
            files.setdefault(path, content)
    units: dict[str, Unit] = {}
    for path in files:
        name = posixpath.basename(path)
        if not name.endswith(".service") or name in units:
            continue
        drop_ins = sorted(
            (p for p in files if posixpath.basename(posixpath.dirname(p)) == f"{name}.d"),
            key=posixpath.basename,
        )
        unit = parse_unit_file(name, path, [files[path], *(files[p] for p in drop_ins)])
        unit.drop_ins = drop_ins
        units[name] = unit
    return list(units.values())


def parse_systemctl_show(text: str) -> dict[str, dict[str, str]]:
    """`systemctl show --property=Id,... UNIT...`: one block of KEY=VALUE lines per unit."""
    blocks: dict[str, dict[str, str]] = {}
    for block in re.split(r"\n\s*\n", text):
        props = dict(line.split("=", 1) for line in block.splitlines() if "=" in line)
        if props.get("Id"):
            blocks[props["Id"]] = props
    return blocks


def parse_exec_start_property(value: str) -> list[str] | None:
    """systemctl's ExecStart value (`{ path=... ; argv[]=ARGS ; ... }`) as argv."""
    match = re.search(r"argv\[\]=(.*?) ; ", value)
    return _split_unit_words(match.group(1)) if match else None


# --- nginx -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Directive:
    name: str
    args: list[str]
    file: str
    block: list[Directive] | None = None


def _nginx_tokens(text: str) -> Iterable[str]:
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c.isspace():
            i += 1
        elif c == "#":
            end = text.find("\n", i)
            i = n if end < 0 else end
        elif c in "{};":
            yield c
            i += 1
        elif c in "\"'":
            j, word = i + 1, []
            while j < n and text[j] != c:
                if text[j] == "\\" and j + 1 < n:
                    j += 1
                word.append(text[j])
                j += 1
            yield "".join(word)
            i = j + 1
        else:
            j = i
            while j < n and not text[j].isspace() and text[j] not in "{};":
                j += 1
            yield text[i:j]
            i = j


def parse_nginx_conf(text: str, file: str) -> list[Directive]:
    """One nginx configuration file as directives; includes are left as directives."""
    stack: list[list[Directive]] = [[]]
    words: list[str] = []
    for piece in _nginx_tokens(text):
        if piece == ";":
            if words:
                stack[-1].append(Directive(name=words[0], args=words[1:], file=file))
            words = []
        elif piece == "{":
            block: list[Directive] = []
            name = words[0] if words else ""
            stack[-1].append(Directive(name=name, args=words[1:], block=block, file=file))
            stack.append(block)
            words = []
        elif piece == "}":
            if len(stack) > 1:
                stack.pop()
            words = []
        else:
            words.append(piece)
    return stack[0]


def parse_nginx_dump(text: str) -> dict[str, str]:
    """`nginx -T`'s output: every file it read, each after `# configuration file PATH:`."""
    files: dict[str, str] = {}
    current: str | None = None
    lines: list[str] = []
    for line in text.splitlines():
        match = re.match(r"^# configuration file (.+):$", line)
        if match:
            if current is not None:
                files[current] = "\n".join(lines)
            current, lines = match.group(1), []
        elif current is not None:
            lines.append(line)
    if current is not None:
        files[current] = "\n".join(lines)
    return files


def _expand(
    directives: list[Directive], files: dict[str, str], conf_dir: str, depth: int = 0
) -> list[Directive]:
    """Directives with every `include` replaced by the files it names (globs as nginx expands
    them, in name order), as far as the files read hold them."""
    out: list[Directive] = []
    for d in directives:
        if d.name == "include" and d.args and depth < 16:
            pattern = d.args[0]
            if not pattern.startswith("/"):
                pattern = posixpath.join(conf_dir, pattern)
            for path in sorted(p for p in files if fnmatch.fnmatchcase(p, pattern)):
                parsed = parse_nginx_conf(files[path], path)
                out.extend(_expand(parsed, files, conf_dir, depth + 1))
        elif d.block is not None:
            out.append(replace(d, block=_expand(d.block, files, conf_dir, depth)))
        else:
            out.append(d)
    return out


def _listen_address(args: list[str]) -> str | None:
    if not args:
        return None
    text = args[0]
    if text.startswith("unix:"):
        return None
    if text.isdigit():
        return f"0.0.0.0:{text}"
    if ":" in text and (not text.startswith("[") or "]:" in text):
        return text
    return f"{text}:80"


def _proxy_target(url: str) -> tuple[str | None, str | None]:
    """(upstream name, host:port) of a proxy_pass URL; variables leave both unknown."""
    match = re.match(r"^https?://([^/]+)", url)
    if not match or "$" in url:
        return None, None
    hostport = match.group(1)
    if re.search(r":\d+$", hostport):
        return None, hostport
    return hostport, None


def nginx_fronts(files: dict[str, str], conf: str) -> list[NginxFront]:
    """The proxying server blocks of the configuration rooted at `conf`."""
    if conf not in files:
        return []
    tree = _expand(parse_nginx_conf(files[conf], conf), files, posixpath.dirname(conf))
    http = [d for d in tree if d.name == "http" and d.block is not None]
    fronts: list[NginxFront] = []
    for block in http:
        assert block.block is not None
        upstreams: dict[str, tuple[dict[str, int], str]] = {}
        for d in block.block:
            if d.name == "upstream" and d.args and d.block is not None:
                servers: dict[str, int] = {}
                for s in d.block:
                    if s.name == "server" and s.args:
                        weight = next(
                            (int(a[7:]) for a in s.args[1:] if re.fullmatch(r"weight=\d+", a)), 1
                        )
                        servers[s.args[0]] = weight
                upstreams[d.args[0]] = (servers, d.file)
        for d in block.block:
            if d.name != "server" or d.block is None:
                continue
            listen = [a for s in d.block if s.name == "listen" if (a := _listen_address(s.args))]
            passes = [
                p.args[0]
                for loc in d.block
                if loc.name == "location" and loc.block is not None
                for p in loc.block
                if p.name == "proxy_pass" and p.args
            ]
            passes += [p.args[0] for p in d.block if p.name == "proxy_pass" and p.args]
            for url in passes:
                name, hostport = _proxy_target(url)
                front = NginxFront(listen=listen or ["0.0.0.0:80"])
                if name is not None and name in upstreams:
                    servers, file = upstreams[name]
                    front.targets, front.upstream, front.file = dict(servers), name, file
                    front.written_by_kdctl = files.get(file, "").startswith("# Written by kdctl")
                elif hostport is not None:
                    front.targets = {hostport: 1}
                    front.file = d.file
                else:
                    continue
                fronts.append(front)
    return fronts


def nginx_master(argv: Sequence[str]) -> tuple[str, str | None, str | None] | None:
    """(binary, -p prefix, -c conf) of an nginx master's command line; nginx rewrites its
    title to `nginx: master process /usr/sbin/nginx -c ...`, one string."""
    words = " ".join(argv).split()
    if words[:3] != ["nginx:", "master", "process"] or len(words) < 4:
        return None
    words = words[3:]
    prefix = _option(words, "-p")
    conf = _option(words, "-c")
    return words[0], prefix[0] if prefix else None, conf[0] if conf else None


# --- reading a host --------------------------------------------------------------------------

# Each pid's command line and cgroup, the pids being the script's arguments.
_PROC_SCRIPT = (
    'for p do printf "\\036%s\\037" "$p"; cat "/proc/$p/cmdline" 2>/dev/null; '
    'printf "\\037"; cat "/proc/$p/cgroup" 2>/dev/null; '
    'printf "\\037"; cat "/proc/$p/net/tcp" "/proc/$p/net/tcp6" 2>/dev/null; done'
)
# Unit files (and drop-ins) that mention an engine, a router or nginx, from the folders given
# as arguments; each at most _READ_CAP bytes.
_UNITS_SCRIPT = (
    'pattern="$1"; shift; for d do for f in "$d"/*.service "$d"/*.service.d/*.conf; do '
    '[ -f "$f" ] || continue; grep -qiE "$pattern" "$f" 2>/dev/null || continue; '
    f'printf "\\036%s\\037" "$f"; head -c {_READ_CAP} "$f"; done; done'
)
# Files matching the glob given as $1 (nginx's include), each at most _READ_CAP bytes; the
# pattern is expanded by the shell as nginx would, never evaluated.
_GLOB_SCRIPT = (
    f'IFS=""; for f in $1; do [ -f "$f" ] || continue; printf "\\036%s\\037" "$f"; '
    f'head -c {_READ_CAP} "$f"; done'
)


def _run(transport: Transport, argv: list[str], timeout: float) -> tuple[int, str, str]:
    result = transport.run(argv, timeout=timeout)
    return result.exit_code, result.stdout, result.stderr


def read_listeners(transport: Transport, *, timeout: float = 15.0) -> tuple[list[Listener], bool]:
    """Listening TCP sockets, and whether their owners could be named."""
    code, out, _ = _run(transport, ["ss", "-Hltnpe"], timeout)
    if code == 0:
        found = parse_ss(out)
        return found, any(s.pids for s in found)
    code, out, _ = _run(transport, ["cat", "/proc/net/tcp", "/proc/net/tcp6"], timeout)
    return (parse_proc_net_tcp(out) if out else []), False


def read_processes(transport: Transport, *, systemd: bool, timeout: float = 15.0) -> list[Process]:
    """Every process, with the exact command line of those that may be engines, routers or
    nginx (read from /proc, NUL-separated, so an argument holding a space stays one)."""
    code, out, err = _run(transport, ["ps", "-eww", "-o", "pid=,ppid=,user:32=,args="], timeout)
    if code != 0:
        raise InfraError(f"{transport.name}: ps failed: {(err or out).strip()[:200]}")
    processes = parse_ps(out)
    wanted = [p for p in processes if _maybe_interesting(p.argv)]
    if wanted:
        script = ["sh", "-c", _PROC_SCRIPT, "sh", *(str(p.pid) for p in wanted)]
        _, records, _ = _run(transport, script, timeout)
        exact = parse_proc_records(records)
        # ps listed it, /proc had no command line for it a moment later: it exited in between
        # (an engine shutting down), or is a zombie. No engine runs there, whatever ps said.
        gone = {p.pid for p in wanted if p.pid not in exact}
        processes = [p for p in processes if p.pid not in gone]
        for p in wanted:
            if p.pid in exact:
                got = exact[p.pid]
                p.argv, p.exact, p.own_listeners = got.argv, True, got.listeners
                if systemd:
                    p.unit = unit_of_cgroup(got.cgroup)
    return processes


def _maybe_interesting(argv: Sequence[str]) -> bool:
    text = " ".join(argv[:8])
    return bool(re.search(_UNIT_PATTERN, text, re.IGNORECASE))


def read_units(transport: Transport, *, systemd: bool, timeout: float = 20.0) -> list[Unit]:
    """Service units that may start an engine, a router or nginx, from their files; with
    systemd running, their state and main pid from systemctl."""
    script = ["sh", "-c", _UNITS_SCRIPT, "sh", _UNIT_PATTERN, *UNIT_DIRS]
    _, out, _ = _run(transport, script, timeout)
    units = parse_unit_dump(out)
    if systemd and units:
        props = "Id,ActiveState,SubState,MainPID,FragmentPath,ExecStart"
        argv = ["systemctl", "show", f"--property={props}", "--no-pager", "--"]
        code, shown, _ = _run(transport, argv + [u.name for u in units], timeout)
        if code == 0:
            states = parse_systemctl_show(shown)
            for unit in units:
                state = states.get(unit.name, {})
                unit.active_state = state.get("ActiveState") or None
                unit.sub_state = state.get("SubState") or None
                unit.main_pid = int(state.get("MainPID") or 0) or None
                if unit.exec_start is None and state.get("ExecStart"):
                    unit.exec_start = parse_exec_start_property(state["ExecStart"])
    return units


def _read_files(transport: Transport, pattern: str, timeout: float) -> dict[str, str]:
    _, out, _ = _run(transport, ["sh", "-c", _GLOB_SCRIPT, "sh", pattern], timeout)
    files: dict[str, str] = {}
    for record in out.split(_RS):
        path, sep, content = record.partition(_US)
        if sep:
            files[path] = content
    return files


def read_nginx(transport: Transport, master: Process, *, timeout: float = 15.0) -> NginxSetup:
    """What one nginx master proxies to: `nginx -T` where the login may run it, else its
    configuration files read one include at a time."""
    parts = nginx_master(master.argv)
    assert parts is not None
    binary, prefix, conf = parts
    # Debian's compiled-in path; a relative -c is under the prefix, as nginx reads it.
    conf = conf or "/etc/nginx/nginx.conf"
    if not conf.startswith("/"):
        conf = posixpath.join(prefix or "/etc/nginx", conf)
    setup = NginxSetup(pid=master.pid, binary=binary, prefix=prefix, conf=conf)
    files: dict[str, str] = {}
    # A process's title is whatever its owner wrote: nginx -T runs (and loads the modules its
    # configuration names) only as root's own nginx was started, never on another user's word.
    trusted = master.user == "root" and binary.startswith("/")
    if trusted and posixpath.basename(binary) == "nginx":
        argv = [binary, *(["-p", prefix] if prefix else []), "-c", conf, "-T"]
        code, out, err = _run(transport, argv, timeout)
        files = parse_nginx_dump(out) if code == 0 else {}
        if conf not in files:
            why = (err.strip().splitlines() or [f"exit {code}"])[-1]
            setup.problems.append(f"nginx -T: {why[:200]}")
    else:
        setup.problems.append(f"nginx -T not run: its master runs as {master.user}")
    if conf in files:
        setup.source = "nginx -T"
    else:
        files = _read_files(transport, conf, timeout)
        # Includes, breadth first, as far as the login may read them.
        pending = [conf]
        seen: set[str] = set()
        while pending and len(seen) < 64:
            path = pending.pop(0)
            if path in seen or path not in files:
                continue
            seen.add(path)
            for d in _walk(parse_nginx_conf(files[path], path)):
                if d.name == "include" and d.args:
                    pattern = d.args[0]
                    if not pattern.startswith("/"):
                        pattern = posixpath.join(posixpath.dirname(conf), pattern)
                    new = _read_files(transport, pattern, timeout)
                    files.update(new)
                    pending.extend(sorted(new))
        if conf in files:
            setup.source = "its configuration files"
        else:
            setup.problems.append(f"{conf} could not be read")
    setup.fronts = nginx_fronts(files, conf)
    return setup


def _walk(directives: list[Directive]) -> Iterable[Directive]:
    for d in directives:
        yield d
        if d.block is not None:
            yield from _walk(d.block)


# Pidfiles where services keep them (each one's first bytes), then where each pid's stdout goes:
# a command started with a pidfile and a log is a service kdctl can stop and start again.
_PIDFILES_SCRIPT = (
    "for f in /run/*.pid /run/*/*.pid /var/run/*.pid /var/run/*/*.pid /tmp/*/*.pid; do "
    '[ -f "$f" ] && printf "\\036%s\\037%s" "$f" "$(head -c 32 "$f" 2>/dev/null)"; done; '
    'for p do printf "\\036fd1:%s\\037%s" "$p" "$(readlink "/proc/$p/fd/1" 2>/dev/null)"; done'
)


def parse_pidfiles(text: str) -> tuple[dict[int, str], dict[int, str]]:
    """The output of _PIDFILES_SCRIPT: pid -> the first pidfile holding it, and pid -> the file
    its stdout is written to (where the login may see it)."""
    pidfiles: dict[int, str] = {}
    logs: dict[int, str] = {}
    for record in text.split(_RS):
        left, sep, right = record.partition(_US)
        if not sep:
            continue
        if left.startswith("fd1:") and left[4:].isdigit():
            # A pipe, a socket or a terminal is not a log kdctl can read back.
            if right.startswith("/") and not right.startswith(("/dev/", "/proc/")):
                logs[int(left[4:])] = right.strip()
        elif left.startswith("/") and right.strip().isdigit():
            # /var/run is /run on most systems: the first path found names it.
            pidfiles.setdefault(int(right.strip()), left)
    return pidfiles, logs


def read_pidfiles(
    transport: Transport, pids: Sequence[int], *, timeout: float = 15.0
) -> tuple[dict[int, str], dict[int, str]]:
    script = ["sh", "-c", _PIDFILES_SCRIPT, "sh", *(str(p) for p in pids)]
    _, out, _ = _run(transport, script, timeout)
    return parse_pidfiles(out)


def read_model_config(transport: Transport, model: str, *, timeout: float = 10.0) -> str | None:
    """A model folder's config.json, where the path is a folder the login may read."""
    if not model.startswith("/"):
        return None
    path = posixpath.join(model, "config.json")
    code, out, _ = _run(transport, ["head", "-c", "1048576", "--", path], timeout)
    return out if code == 0 else None


def read_host(transport: Transport, *, timeout: float = 20.0) -> HostFacts:
    """Everything `kdctl init` needs from a host, read without changing anything."""
    code, hostname, _ = _run(transport, ["uname", "-n"], timeout)
    systemd = _run(transport, ["test", "-d", "/run/systemd/system"], timeout)[0] == 0
    facts = HostFacts(
        hostname=(hostname.strip() or None) if code == 0 else None,
        systemd=systemd,
        gpus=probe_gpus(transport, timeout=timeout),
    )
    facts.listeners, facts.owners_shown = read_listeners(transport, timeout=timeout)
    facts.processes = read_processes(transport, systemd=systemd, timeout=timeout)
    facts.units = read_units(transport, systemd=systemd, timeout=timeout)
    for process in facts.processes:
        if nginx_master(process.argv) is None:
            continue
        if in_another_netns(process, facts):
            facts.notes.append(
                f"nginx (pid {process.pid}) runs in another network namespace: not read"
            )
            continue
        facts.nginx.append(read_nginx(transport, process, timeout=timeout))
    models = {
        cmd.model
        for argv in [p.argv for p in facts.processes] + [u.exec_start or [] for u in facts.units]
        if (cmd := parse_engine_command(argv)) is not None and cmd.model
    }
    for model in sorted(models):
        text = read_model_config(transport, model, timeout=timeout)
        if text is not None:
            facts.model_configs[model] = text
    engine_pids = [p.pid for p in facts.processes if parse_engine_command(p.argv) is not None]
    if engine_pids:
        facts.pidfiles, facts.logs = read_pidfiles(transport, engine_pids, timeout=timeout)
    return facts


# --- engines: processes, units and sockets joined ----------------------------------------------


class FoundEngine(BaseModel):
    """An engine or router on the host: running (a process), stopped (a unit alone), or both
    a unit and its process."""

    command: EngineCommand
    # Where the command line came from: "sglang.service ExecStart", "process 1234".
    source: str
    running: bool
    process: Process | None = None
    unit: Unit | None = None
    # How the unit and the process were tied: "MainPID", "cgroup", "ExecStart".
    linked_by: str | None = None
    listener: Listener | None = None
    # Why its socket is not what its command line says (held by another program, absent).
    socket_note: str | None = None
    # It runs in another network namespace (a container): its port there is not the host's.
    elsewhere: bool = False
    gpus: list[int] = []
    gpus_source: str | None = None
    pidfile: str | None = None
    log: str | None = None


def descendants(processes: Sequence[Process], pid: int) -> set[int]:
    """`pid` and every process below it."""
    children: dict[int, list[int]] = {}
    for p in processes:
        children.setdefault(p.ppid, []).append(p.pid)
    found, pending = {pid}, [pid]
    while pending:
        for child in children.get(pending.pop(), []):
            if child not in found:
                found.add(child)
                pending.append(child)
    return found


def _binds_match(bind: str, address: str) -> bool:
    anywhere = {"0.0.0.0", "::", "*", ""}  # noqa: S104 - the wildcard addresses, compared
    if bind in anywhere or address in anywhere:
        return bind in anywhere and address in anywhere
    loopback = {"127.0.0.1", "::1", "localhost"}
    return bind == address or (bind in loopback and address in loopback)


def in_another_netns(process: Process, facts: HostFacts) -> bool:
    """Whether a process runs in another network namespace than the login reading the host
    (a container's): none of the sockets listening in its namespace is one listening in ours.
    Unknown (either side unread, or nothing listening) counts as the same."""
    own = {s.inode for s in process.own_listeners or [] if s.inode}
    ours = {s.inode for s in facts.listeners if s.inode}
    return bool(own and ours and not own & ours)


def _listener_for(
    facts: HostFacts, cmd: EngineCommand, tree: set[int], process: Process | None
) -> tuple[Listener | None, str | None]:
    on_port = [s for s in facts.listeners if s.port == cmd.port]
    loading = f"nothing listens on port {cmd.port} (still loading?)"
    if process is not None and process.own_listeners is not None:
        # Its own namespace's sockets: on its port, the one socket that is its, by inode.
        inodes = {s.inode for s in process.own_listeners if s.port == cmd.port and s.inode}
        on_port = [s for s in on_port if s.inode in inodes] if inodes else []
        if not on_port:
            return None, loading
    mine = [s for s in on_port if set(s.pids) & tree] or [
        s for s in on_port if not s.pids and _binds_match(cmd.bind, s.address)
    ]
    if mine:
        return mine[0], None
    others = [s for s in on_port if s.pids]
    if others:
        owner = others[0]
        programs = ", ".join(owner.programs) or "another process"
        return None, f"port {cmd.port} is held by {programs} (pid {owner.pids[0]}), not by it"
    if on_port:
        return on_port[0], None
    return None, loading


def _unit_key(cmd: EngineCommand, unit: Unit | None) -> None:
    """Where the unit names the key's variable: its ExecStart (`--api-key ${VAR}`), or vLLM's
    own VLLM_API_KEY in its environment."""
    if unit is None:
        return
    from_unit = parse_engine_command(unit.exec_start or [])
    if from_unit is not None and from_unit.key_env:
        cmd.requires_key, cmd.key_env = True, from_unit.key_env
        cmd.found["key"] = from_unit.found.get("key", "--api-key")
        cmd.found["key_from"] = f"{unit.name} ExecStart"
    elif cmd.kind == "vllm" and "VLLM_API_KEY" in unit.env_names:
        cmd.requires_key, cmd.key_env = True, "VLLM_API_KEY"
        cmd.found["key"] = "VLLM_API_KEY"
        cmd.found["key_from"] = f"{unit.name} Environment"


def find_engines(facts: HostFacts) -> list[FoundEngine]:
    """Every engine and router the host shows, running or stopped, each once."""
    by_pid = {p.pid: p for p in facts.processes}
    engines: dict[int, EngineCommand] = {}
    for p in facts.processes:
        cmd = parse_engine_command(p.argv)
        if cmd is not None:
            engines[p.pid] = cmd
    # A forked worker keeps its parent's command line: the engine is the topmost one.
    for pid in list(engines):
        parent = by_pid.get(by_pid[pid].ppid)
        while parent is not None:
            if parent.pid in engines and parent.argv == by_pid[pid].argv:
                engines.pop(pid, None)
                break
            parent = by_pid.get(parent.ppid)
    units = [u for u in facts.units if u.exec_start and parse_engine_command(u.exec_start)]
    unit_of: dict[int, tuple[Unit, str]] = {}
    for candidate in units:
        assert candidate.exec_start is not None
        # The main pid may be a wrapper (a shell script) that started the engine.
        under_main = descendants(facts.processes, candidate.main_pid) if candidate.main_pid else ()
        for pid in engines:
            p = by_pid[pid]
            if pid in under_main:
                tie = "MainPID"
            elif p.unit == candidate.name:
                tie = "cgroup"
            elif p.exact and same_command(p.argv, candidate.exec_start):
                tie = "ExecStart"
            else:
                continue
            unit_of.setdefault(pid, (candidate, tie))
    gpu_pids = {g.pid: g.gpu_index for g in facts.gpus.processes if g.gpu_index is not None}
    found: list[FoundEngine] = []
    for pid, cmd in engines.items():
        p = by_pid[pid]
        unit, how = unit_of.get(pid, (None, None))
        _unit_key(cmd, unit)
        tree = descendants(facts.processes, pid)
        listener, note = _listener_for(facts, cmd, tree, p)
        engine = FoundEngine(
            command=cmd,
            source=f"{unit.name} ExecStart" if unit and how == "ExecStart" else f"process {pid}",
            running=True,
            process=p,
            unit=unit,
            linked_by=how,
            listener=listener,
            socket_note=note,
            pidfile=facts.pidfiles.get(pid),
            log=facts.logs.get(pid),
            elsewhere=in_another_netns(p, facts),
        )
        on_gpus = sorted({i for q, i in gpu_pids.items() if q in tree})
        if on_gpus:
            engine.gpus, engine.gpus_source = on_gpus, "nvidia-smi (its processes)"
        elif unit and (visible := _visible_devices(unit)):
            engine.gpus, engine.gpus_source = visible, f"{unit.name} CUDA_VISIBLE_DEVICES"
        found.append(engine)
    linked = {u.name for u, _ in unit_of.values()}
    for unit in units:
        if unit.name in linked:
            continue
        assert unit.exec_start is not None
        cmd = parse_engine_command(unit.exec_start)
        assert cmd is not None
        _unit_key(cmd, unit)
        engine = FoundEngine(
            command=cmd,
            source=f"{unit.name} ExecStart",
            # Where systemd runs, its word; else no process runs its ExecStart.
            running=unit.active_state in ("active", "activating", "reloading"),
            unit=unit,
        )
        if visible := _visible_devices(unit):
            engine.gpus, engine.gpus_source = visible, f"{unit.name} CUDA_VISIBLE_DEVICES"
        if engine.running:
            engine.listener, engine.socket_note = _listener_for(facts, cmd, set(), None)
        found.append(engine)
    return found


def _visible_devices(unit: Unit) -> list[int]:
    value = unit.env.get("CUDA_VISIBLE_DEVICES", "")
    parts = [v.strip() for v in value.split(",") if v.strip()]
    return [int(v) for v in parts] if parts and all(v.isdigit() for v in parts) else []
