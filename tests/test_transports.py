"""Local and SSH transports against the real thing: subprocess and OpenSSH's sshd."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

from kdctl.errors import CommandTimeout, HostKeyError, TransportError
from kdctl.inventory.models import CommandService, HostSpec, SystemdService
from kdctl.probes import probe_service
from kdctl.transports import LocalTransport
from kdctl.transports.ssh import SSHTransport
from tests.conftest import kdctl, write_inventory
from tests.support.sshd import SshdFleet, known_hosts_line

HOSTILE = [
    "; touch {canary}",
    "$(touch {canary})",
    "`touch {canary}`",
    "x' ; touch {canary}; echo '",
    'x" ; touch {canary}; echo "',
    "a b  c && touch {canary}",
    "| touch {canary}",
    "\n touch {canary}",
]


def ssh(
    fleet: SshdFleet, name: str, known_hosts: Path | None = None, **spec: object
) -> SSHTransport:
    entry = fleet.host_entry(name, **spec)
    kh = known_hosts or fleet.known_hosts
    entry["known_hosts"] = str(kh)
    return SSHTransport(
        name, HostSpec.model_validate(entry), known_hosts=kh, identity_file=fleet.userkey
    )


def test_local_run_and_files(tmp_path: Path) -> None:
    t = LocalTransport("local")
    res = t.run(["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert (res.exit_code, res.stdout, res.stderr) == (3, "out\n", "err\n")
    assert res.duration_s > 0
    assert t.run(["kdctl-no-such-program"]).not_found
    assert t.run(["cat"], stdin=b"piped").stdout == "piped"
    src = tmp_path / "src"
    src.write_text("payload")
    t.put(src, str(tmp_path / "dst"), mode=0o600)
    assert (tmp_path / "dst").read_text() == "payload"
    assert (tmp_path / "dst").stat().st_mode & 0o777 == 0o600
    t.get(str(tmp_path / "dst"), tmp_path / "back")
    assert (tmp_path / "back").read_text() == "payload"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["back", "dst", "src"]


def test_local_timeout_kills_the_whole_tree(tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    # Durations no other process on the machine is sleeping, so `ps` finds only these.
    first, second = (f"{n}.{int(marker[:6], 16) % 1000:03d}" for n in (30, 31))
    started = time.monotonic()
    with pytest.raises(CommandTimeout):
        LocalTransport("local").run(
            ["sh", "-c", f"sleep {first} & sleep {second}; echo {marker}"], timeout=0.5
        )
    assert time.monotonic() - started < 5
    time.sleep(0.2)
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    left = {line.strip() for line in ps.splitlines()}
    assert f"sleep {first}" not in left and f"sleep {second}" not in left


@pytest.mark.parametrize("template", HOSTILE)
def test_local_arguments_are_literal(tmp_path: Path, template: str) -> None:
    canary = tmp_path / "pwned"
    value = template.format(canary=canary)
    res = LocalTransport("local").run(["printf", "%s", value])
    assert res.stdout == value
    assert not canary.exists()


def test_ssh_run_put_get(fleet: SshdFleet, tmp_path: Path) -> None:
    with ssh(fleet, "plain") as t:
        res = t.run(["id", "-un"])
        assert res.ok and res.stdout.strip() == fleet.user
        res = t.run(["sh", "-c", "echo out; echo err >&2; exit 7"])
        assert (res.exit_code, res.stdout, res.stderr) == (7, "out\n", "err\n")
        assert t.run(["kdctl-no-such-program"]).not_found
        assert t.run(["cat"], stdin=b"over ssh").stdout == "over ssh"
        big = tmp_path / "big"
        big.write_bytes(os.urandom(300_000))
        remote = f"/tmp/kdctl-put-{uuid.uuid4().hex}"
        try:
            t.put(big, remote, mode=0o640)
            assert t.run(["stat", "-c", "%a %s", remote]).stdout.split() == ["640", "300000"]
            t.get(remote, tmp_path / "back")
            assert (tmp_path / "back").read_bytes() == big.read_bytes()
            # Written under a temporary name and renamed: nothing half-written is left.
            assert (
                t.run(["sh", "-c", "ls -a /tmp | grep -c '^\\.kdctl-put' || true"]).stdout.strip()
                == "0"
            )
        finally:
            t.run(["rm", "-f", remote])
        with pytest.raises(TransportError, match="cannot read /nonexistent"):
            t.get("/nonexistent/file", tmp_path / "x")


def test_ssh_reuses_one_connection(fleet: SshdFleet) -> None:
    log = fleet.hosts["plain2"].root / "log"
    before = log.read_text().count("Accepted publickey")
    with ssh(fleet, "plain2") as t:
        for _ in range(5):
            assert t.run(["true"]).ok
    assert log.read_text().count("Accepted publickey") - before == 1


@pytest.mark.parametrize("template", HOSTILE)
def test_ssh_arguments_reach_the_remote_side_literally(fleet: SshdFleet, template: str) -> None:
    canary = f"/tmp/kdctl-pwned-{uuid.uuid4().hex}"
    value = template.format(canary=canary)
    with ssh(fleet, "plain") as t:
        assert t.run(["printf", "%s", value]).stdout == value
        # The same values as a service's unit name and pidfile: still one literal argument.
        probe_service(t, SystemdService.model_construct(systemd=value, scope="system"))
        state = probe_service(
            t, CommandService.model_construct(command="serve", pidfile=value, log="/dev/null")
        )
        assert state.state == "stopped" and state.detail == "no pidfile"
        assert not t.run(["test", "-e", canary]).ok, "a hostile value ran on the host"
    assert not Path(canary).exists()


def test_ssh_timeout_ends_the_remote_command(fleet: SshdFleet) -> None:
    marker = f"{uuid.uuid4().int % 10_000 + 40_000}"
    with ssh(fleet, "plain") as t:
        started = time.monotonic()
        with pytest.raises(CommandTimeout, match="did not finish in 1s"):
            t.run(["sleep", marker], timeout=1)
        assert time.monotonic() - started < 4
        time.sleep(1.5)
        assert marker not in t.run(["ps", "-eo", "args"]).stdout
        assert t.run(["true"]).ok  # the connection survives a timed-out command


def _fingerprint(pub: Path) -> str:
    out = subprocess.run(["ssh-keygen", "-lf", str(pub)], capture_output=True, text=True).stdout
    return out.split()[1]


def test_unknown_host_key_is_refused(fleet: SshdFleet, tmp_path: Path) -> None:
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    fp = _fingerprint(fleet.hosts["plain"].hostkey.with_suffix(".pub"))
    with pytest.raises(HostKeyError) as exc:
        ssh(fleet, "plain", known_hosts=empty).connect()
    assert fp in str(exc.value) and "plain" in str(exc.value)
    assert empty.read_text() == ""


def test_accept_new_records_the_key_but_never_a_changed_one(
    fleet: SshdFleet, tmp_path: Path
) -> None:
    kh = tmp_path / "ssh" / "known_hosts"
    with ssh(fleet, "plain", known_hosts=kh, host_key_policy="accept-new") as t:
        assert t.run(["true"]).ok
    port = fleet.hosts["plain"].port
    assert kh.read_text().startswith(f"[127.0.0.1]:{port} ssh-ed25519 ")
    assert kh.stat().st_mode & 0o777 == 0o600
    with ssh(fleet, "plain", known_hosts=kh) as t:  # now known: plain reject works
        assert t.run(["true"]).ok
    # The same address now presents another host's key: refused even under accept-new.
    other = fleet.hosts["plain2"].hostkey.with_suffix(".pub")
    kh.write_text(known_hosts_line(port, other))
    with pytest.raises(HostKeyError, match="HOST KEY CHANGED") as exc:
        ssh(fleet, "plain", known_hosts=kh, host_key_policy="accept-new").connect()
    assert _fingerprint(fleet.hosts["plain"].hostkey.with_suffix(".pub")) in str(exc.value)
    assert kh.read_text() == known_hosts_line(port, other)


def test_changed_host_key_fails_status_with_exit_3(fleet: SshdFleet, tmp_path: Path) -> None:
    port = fleet.hosts["plain"].port
    kh = tmp_path / "known_hosts"
    kh.write_text(known_hosts_line(port, fleet.hosts["gpu"].hostkey.with_suffix(".pub")))
    inv = write_inventory(
        tmp_path / "inv.yaml",
        {"hosts": {"plain": fleet.host_entry("plain", known_hosts=str(kh))}},
    )
    run = kdctl("status", "-i", str(inv), "--json")
    assert run.code == 3, run.err
    assert "HOST KEY CHANGED" in run.out
    assert _fingerprint(fleet.hosts["plain"].hostkey.with_suffix(".pub")) in run.out


def test_wrong_user_key_is_an_authentication_failure(fleet: SshdFleet, tmp_path: Path) -> None:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "k")], check=True
    )
    spec = HostSpec.model_validate(fleet.host_entry("plain"))
    t = SSHTransport("plain", spec, known_hosts=fleet.known_hosts, identity_file=tmp_path / "k")
    with pytest.raises(TransportError, match="authentication failed"):
        t.connect()


def test_silent_host_times_out_at_connect(fleet: SshdFleet) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)  # accepts the TCP handshake, never says a word of SSH
        port = listener.getsockname()[1]
        spec = HostSpec(address="127.0.0.1", port=port, connect_timeout_s=1)
        t = SSHTransport("silent", spec, known_hosts=fleet.known_hosts, identity_file=fleet.userkey)
        started = time.monotonic()
        with pytest.raises(TransportError, match="cannot connect"):
            t.connect()
        assert time.monotonic() - started < 3


def test_one_transport_serves_threads(fleet: SshdFleet) -> None:
    """Commands that end at once, with and without stdin, from eight threads on one
    connection: none may end the connection under the others (an EOF sent after the
    channel's CLOSE makes sshd drop the connection)."""
    with ssh(fleet, "gpu") as t:
        results: list[str] = []

        def work(i: int) -> None:
            for _ in range(10):
                if i % 2:
                    results.append(t.run(["echo", str(i)]).stdout.strip())
                else:
                    results.append(t.run(["cat"], stdin=str(i).encode()).stdout)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert sorted(results, key=int) == [str(i) for i in range(8) for _ in range(10)]


def test_output_written_after_the_command_exits_is_not_lost(fleet: SshdFleet) -> None:
    # sshd reports the exit status as soon as the shell exits; the child still holds stdout.
    with ssh(fleet, "gpu") as t:
        result = t.run(["sh", "-c", "(sleep 0.3; echo late; echo err >&2) & echo early"])
    assert result.ok
    assert result.stdout.split() == ["early", "late"]
    assert result.stderr.strip() == "err"


def test_a_revoked_host_key_is_refused_even_under_accept_new(
    fleet: SshdFleet, tmp_path: Path
) -> None:
    kh = tmp_path / "known_hosts"
    kind, b64 = fleet.hosts["plain"].hostkey.with_suffix(".pub").read_text().split()[:2]
    kh.write_text(f"@revoked * {kind} {b64}\n")
    with pytest.raises(HostKeyError, match="@revoked"):
        ssh(fleet, "plain", known_hosts=kh, host_key_policy="accept-new").connect()
    assert kh.read_text() == f"@revoked * {kind} {b64}\n"  # not recorded as a new key


@pytest.mark.parametrize("patterns", ["[127.0.0.?]:*", "other,[127.0.0.1]:*", "hashed"])
def test_a_host_under_a_certificate_authority_is_refused_with_the_reason(
    fleet: SshdFleet, tmp_path: Path, patterns: str
) -> None:
    import paramiko

    port = fleet.hosts["plain"].port
    if patterns == "hashed":
        patterns = paramiko.HostKeys.hash_host(f"[127.0.0.1]:{port}")
    ca_key = fleet.userkey.with_suffix(".pub").read_text().split()[:2]
    kh = tmp_path / "known_hosts"
    text = f"other.example {' '.join(ca_key)}\n@cert-authority {patterns} {' '.join(ca_key)}\n"
    kh.write_text(text)
    with pytest.raises(HostKeyError) as exc:
        ssh(fleet, "plain", known_hosts=kh, host_key_policy="accept-new").connect()
    assert f"{kh}:2 trusts a certificate authority (@cert-authority) for [127.0.0.1]:{port}" in (
        str(exc.value)
    )
    assert kh.read_text() == text  # never downgraded to a recorded bare key
    # Outside the CA's scope (negated, or the pattern without the port): then only unknown.
    kh.write_text(
        f"@cert-authority *,![127.0.0.1]:* {' '.join(ca_key)}\n"
        f"@cert-authority 127.0.0.1 {' '.join(ca_key)}\n"
    )
    with pytest.raises(HostKeyError, match="is not in"):
        ssh(fleet, "plain", known_hosts=kh).connect()


def test_a_garbled_known_hosts_line_is_named(fleet: SshdFleet, tmp_path: Path) -> None:
    kh = tmp_path / "known_hosts"
    kh.write_text("# a comment\n[127.0.0.1]:1 ssh-ed25519 not-base64!!\n")
    with pytest.raises(TransportError, match=r"known_hosts:2: unreadable host key line"):
        ssh(fleet, "plain", known_hosts=kh).connect()


@pytest.mark.parametrize(
    "patterns",
    ["*", "port-glob", "other,[127.0.0.1]:*", "hashed", "127.0.0.1", "*,![127.0.0.1]:*"],
)
def test_host_patterns_match_as_openssh_matches_them(
    fleet: SshdFleet, tmp_path: Path, patterns: str
) -> None:
    """known_hosts holds host A's key under a pattern; the server presents key B. Under
    accept-new, kdctl and OpenSSH's own client, each on its own copy of the same file, must
    agree: a pattern covering the host means a changed key (refused, file untouched); one that
    does not cover it means an unknown host (connected, key recorded)."""
    import paramiko

    port = fleet.hosts["plain"].port
    if patterns == "port-glob":
        patterns = f"[127.0.0.1]:{str(port)[:-1]}*"
    elif patterns == "hashed":
        patterns = paramiko.HostKeys.hash_host(f"[127.0.0.1]:{port}")
    kind, b64 = fleet.hosts["plain2"].hostkey.with_suffix(".pub").read_text().split()[:2]
    text = f"{patterns} {kind} {b64}\n"
    theirs, ours = tmp_path / "openssh_known_hosts", tmp_path / "kdctl_known_hosts"
    theirs.write_text(text)
    ours.write_text(text)
    openssh = subprocess.run(
        [
            "ssh",
            "-o",
            "BatchMode=yes",
            "-o",
            "StrictHostKeyChecking=accept-new",
            "-o",
            f"UserKnownHostsFile={theirs}",
            "-o",
            "GlobalKnownHostsFile=/dev/null",
            "-o",
            "CheckHostIP=no",
            "-o",
            "IdentitiesOnly=yes",
            "-i",
            str(fleet.userkey),
            "-p",
            str(port),
            f"{fleet.user}@127.0.0.1",
            "true",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    openssh_refused = openssh.returncode != 0
    try:
        with ssh(fleet, "plain", known_hosts=ours, host_key_policy="accept-new") as t:
            assert t.run(["true"]).ok
        kdctl_refused = False
    except HostKeyError as exc:
        assert "HOST KEY CHANGED" in str(exc)
        kdctl_refused = True
    assert kdctl_refused == openssh_refused, (patterns, openssh.stderr)
    if openssh_refused:
        assert "REMOTE HOST IDENTIFICATION HAS CHANGED" in openssh.stderr
        assert ours.read_text() == text
    else:
        assert ours.read_text().startswith(text) and len(ours.read_text()) > len(text)
