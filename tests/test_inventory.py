"""Inventories, good and bad, through the real CLI: exit 2 and FILE:LINE: field: message."""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from kdctl.errors import InputError
from kdctl.inventory import load_inventory, resolve_inventory_path
from tests.conftest import REPO, kdctl, ssh_home

GOOD = """\
hosts:
  box:
    address: 10.0.0.5
    user: ops
    gpus: 4
backends:
  sglang:
    kind: sglang
    host: box
    url: http://10.0.0.5:30000
    gpus: [0, 1, 2, 3]
    tp_size: 4
"""

COMMAND_SERVICE = """\
    service:
      command: serve
      pidfile: /run/x.pid
      log: /var/log/x.log
"""

# (name, inventory text, expected line, text the message must contain)
BAD = [
    ("bad yaml", "hosts:\n  box: [unclosed\n  other: 1\n", 3, "invalid YAML"),
    (
        "wrong type",
        "hosts:\n  box:\n    address: h\n    port: twenty\n",
        4,
        "hosts.box.port: must be an integer",
    ),
    (
        "negative port",
        "hosts:\n  box:\n    address: h\n    port: -22\n",
        4,
        "hosts.box.port: must be >= 1",
    ),
    (
        "tp size zero",
        GOOD.replace("tp_size: 4", "tp_size: 0"),
        12,
        "backends.sglang.tp_size: must be >= 1",
    ),
    (
        "tp larger than gpus",
        GOOD.replace("tp_size: 4", "tp_size: 8"),
        12,
        "backends.sglang.tp_size: tp_size 8 is larger than the 4 GPU(s)",
    ),
    (
        "unknown kind",
        GOOD.replace("kind: sglang", "kind: tgi"),
        8,
        "backends.sglang.kind: unknown backend kind 'tgi'",
    ),
    (
        "unknown host",
        GOOD.replace("host: box", "host: bx"),
        9,
        "unknown host 'bx' (known: box); did you mean 'box'?",
    ),
    (
        "duplicate names",
        GOOD + "  sglang:\n    kind: openai\n    host: box\n",
        13,
        "duplicate key 'sglang' (first defined on line 7)",
    ),
    (
        "typo in a field",
        GOOD.replace("tp_size", "tp_szie"),
        12,
        "backends.sglang.tp_szie: unknown field; did you mean 'tp_size'?",
    ),
    (
        "gpu beyond the host",
        GOOD.replace("[0, 1, 2, 3]", "[0, 1, 2, 9]"),
        11,
        "backends.sglang.gpus[3]: GPU 9 does not exist: host 'box' has 4 GPU(s)",
    ),
    (
        "gpu listed twice",
        GOOD.replace("[0, 1, 2, 3]", "[0, 1, 1, 3]"),
        11,
        "backends.sglang.gpus: lists a GPU more than once",
    ),
    (
        "ssh host without address",
        "hosts:\n  box:\n    user: ops\n",
        3,
        "hosts.box: an ssh host needs an 'address'",
    ),
    (
        "credentials in url",
        GOOD.replace("http://10.0.0.5", "http://admin:hunter2@10.0.0.5"),
        10,
        "backends.sglang.url: must not carry credentials",
    ),
    (
        "router serves nothing known",
        GOOD + "router:\n  kind: nginx\n  host: box\n  listen: 0.0.0.0:8000\n  serving: native\n",
        17,
        "router.serving: unknown backend 'native'",
    ),
    (
        "service of no known shape",
        GOOD + "    service: {unit: sglang.service}\n",
        13,
        "backends.sglang.service: must have either 'systemd: UNIT' or 'command: ...'",
    ),
    (
        "unit name with shell",
        GOOD + "    service: {systemd: 'sglang.service; touch /tmp/x'}\n",
        13,
        "is not a systemd unit name",
    ),
    (
        "relative pidfile",
        GOOD + "    service: {command: serve, pidfile: run/x.pid, log: /var/log/x.log}\n",
        13,
        "backends.sglang.service.pidfile: 'run/x.pid' must be an absolute path",
    ),
    (
        "host key policy",
        "hosts:\n  box:\n    address: h\n    host_key_policy: yolo\n",
        4,
        "must be one of 'reject' or 'accept-new' (got 'yolo')",
    ),
    (
        "env from a bad variable name",
        GOOD + COMMAND_SERVICE + "      env: {HF_TOKEN: {from_env: 'HF TOKEN'}}\n",
        17,
        "backends.sglang.service.env.HF_TOKEN.from_env: 'HF TOKEN' is not an environment",
    ),
    ("not a mapping", "- hosts\n- backends\n", 1, "must be a mapping"),
    (
        "roadmap that does not exist",
        GOOD + "roadmap: roadmap/nope.yaml\n",
        13,
        "roadmap: roadmap/nope.yaml does not exist",
    ),
    (
        "corpus that does not exist",
        GOOD + "gates: {exactness: {corpus: prompts/nope.jsonl}}\n",
        13,
        "gates.exactness.corpus: prompts/nope.jsonl does not exist",
    ),
    (
        "identity file that does not exist",
        GOOD.replace("    user: ops\n", "    user: ops\n    identity_file: /nonexistent/id\n"),
        5,
        "hosts.box.identity_file: /nonexistent/id does not exist",
    ),
    (
        "known_hosts that does not exist",
        GOOD.replace("    user: ops\n", "    user: ops\n    known_hosts: /nonexistent/kh\n"),
        5,
        "hosts.box.known_hosts: /nonexistent/kh does not exist",
    ),
    (
        "nested aliases",
        "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
        + "".join(
            f"{n}: &{n} [{', '.join(['*' + p] * 10)}]\n"
            for p, n in zip("abcdefg", "bcdefgh", strict=True)
        )
        + "hosts: {h: {transport: local}}\n",
        6,
        "expands to more than 200,000 values (nested aliases?)",
    ),
    ("nesting too deep", "hosts: " + "[" * 100 + "]" * 100 + "\n", 1, "nested more than 64"),
    # Past the composer's recursion (a thousand levels, and libyaml's own limit): refused
    # before anything is composed, never a RecursionError.
    ("nesting past the parser", "hosts: " + "[" * 1_000 + "\n", 1, "nesting depth"),
    ("nesting far past it", "hosts: " + "[" * 50_000 + "\n", 1, "nesting depth"),
    (
        "block nesting too deep",
        "hosts:\n" + "".join(" " * i + f"k{i}:\n" for i in range(1, 200)) + " " * 200 + "x\n",
        65,
        "nested more than 64",
    ),
    ("no hosts", "backends: {}\n", 1, "hosts: required field is missing"),
    (
        "bad listen",
        GOOD + "router: {kind: nginx, host: box, listen: 'localhost', serving: sglang}\n",
        13,
        "must be ADDRESS:PORT",
    ),
]


@pytest.mark.parametrize(("name", "text", "line", "needle"), BAD, ids=[b[0] for b in BAD])
def test_malformed_inventory_is_refused_with_line_and_field(
    tmp_path: Path, name: str, text: str, line: int, needle: str
) -> None:
    path = tmp_path / "inventory.yaml"
    path.write_text(text)
    run = kdctl("inventory", "check", "--inventory", str(path))
    assert run.code == 2, (run.out, run.err)
    assert "Traceback" not in run.err + run.out
    assert f"{path}:{line}:" in run.err, run.err
    assert needle in run.err, run.err


def test_an_unset_api_key_variable_warns_at_check_and_refuses_where_kdctl_talks(
    tmp_path: Path,
) -> None:
    """The variable is needed when kdctl talks to the engine, not to validate a file."""
    path = tmp_path / "inventory.yaml"
    path.write_text(GOOD + "    api_key_env: KDCTL_TEST_UNSET_KEY\n")
    want = f"{path}:13: backends.sglang.api_key_env: environment variable KDCTL_TEST_UNSET_KEY"
    check = kdctl("inventory", "check", "-i", str(path), "--json")
    assert check.code == 0, check.err
    assert f"warning: {want} is not set" in check.err
    assert json.loads(check.out)["warnings"][0].startswith(f"{want} is not set")
    for args in (("status",), ("gate", "run", "health", "-b", "sglang")):
        run = kdctl(*args, "-i", str(path))
        assert run.code == 2, (args, run.err)
        assert f"{want} is not set" in run.err and "Traceback" not in run.err


def test_a_secret_in_a_service_env_is_refused_without_echoing_it(tmp_path: Path) -> None:
    path = tmp_path / "inventory.yaml"
    env = "      env: {MAX_TOKENS: '64', HF_TOKEN: hf_s3cr3t}\n"
    path.write_text(GOOD + COMMAND_SERVICE + env)
    run = kdctl("inventory", "check", "-i", str(path))
    assert run.code == 2
    assert f"{path}:17: backends.sglang.service.env: HF_TOKEN looks like a secret" in run.err
    assert "hf_s3cr3t" not in run.err + run.out
    # Named, not given: the value is read where kdctl runs, and only the name is shown.
    path.write_text(GOOD + COMMAND_SERVICE + env.replace("hf_s3cr3t", "{from_env: HF_TOKEN}"))
    run = kdctl("inventory", "check", "-i", str(path), "--json", env={"HF_TOKEN": "hf_s3cr3t"})
    assert run.code == 0, run.err
    assert "hf_s3cr3t" not in run.out
    service = json.loads(run.out)["spec"]["backends"]["sglang"]["service"]
    assert service["env"] == {"MAX_TOKENS": "64", "HF_TOKEN": {"from_env": "HF_TOKEN"}}


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    path = tmp_path / "inv.yaml"
    path.write_text(GOOD.replace("tp_size: 4", "tp_size: 0") + "    bogus: 1\n")
    with pytest.raises(InputError) as exc:
        load_inventory(path)
    lines = str(exc.value).splitlines()
    assert len(lines) == 2
    assert lines[0].startswith(f"{path}:12: backends.sglang.tp_size")
    assert lines[1].startswith(f"{path}:13: backends.sglang.bogus: unknown field")


def test_missing_file_is_bad_input(tmp_path: Path) -> None:
    run = kdctl("inventory", "check", "-i", str(tmp_path / "nope.yaml"))
    assert run.code == 2
    assert "no such inventory file" in run.err


def test_shipped_inventories_are_valid(tmp_path: Path) -> None:
    run = kdctl("inventory", "check", "--json", cwd=REPO)
    assert run.code == 0, run.err
    assert '"valid": true' in run.out
    run = kdctl(
        "inventory",
        "check",
        "-i",
        "examples/ct200-8gpu.yaml",
        env={"SGLANG_API_KEY": "s3cret-sglang", "NATIVE_API_KEY": "s3cret-native"},
        cwd=REPO,
    )
    # The key and known_hosts files it names are read by kdctl: checked at once.
    assert run.code == 2
    assert "examples/ct200-8gpu.yaml:9: hosts.ct200.identity_file: ~/.ssh/id_ed25519" in run.err
    run = kdctl(
        "inventory",
        "check",
        "-i",
        "examples/ct200-8gpu.yaml",
        env={
            "SGLANG_API_KEY": "s3cret-sglang",
            "NATIVE_API_KEY": "s3cret-native",
            **ssh_home(tmp_path),
        },
        cwd=REPO,
    )
    assert run.code == 0, run.err
    assert "NVIDIA RTX PRO 6000 Blackwell" in run.out


def test_example_box_describes_the_team_setup(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HOME", ssh_home(tmp_path)["HOME"])
    monkeypatch.setenv("SGLANG_API_KEY", "k1")
    monkeypatch.setenv("NATIVE_API_KEY", "k2")
    inv = load_inventory(REPO / "examples" / "ct200-8gpu.yaml")
    assert inv.hosts["ct200"].gpus == 8
    sglang, native = inv.backends["sglang"], inv.backends["native"]
    assert sglang.tp_size == 8 and sglang.url and sglang.url.endswith(":30000")
    assert (
        sglang.service is not None and getattr(sglang.service, "systemd", None) == "sglang.service"
    )
    assert native.url != sglang.url and set(native.gpus) == set(sglang.gpus)
    assert inv.spec.router is not None and inv.spec.router.kind == "nginx"
    assert inv.api_key("sglang") is not None
    assert inv.api_key("sglang").get_secret_value() == "k1"  # type: ignore[union-attr]
    assert "k1" not in repr(inv.api_key("sglang"))


def test_inventory_and_state_dir_precedence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = tmp_path / "a.yaml"
    a.write_text(GOOD + "state_dir: st\n")
    monkeypatch.delenv("KDCTL_INVENTORY", raising=False)
    monkeypatch.delenv("KDCTL_STATE_DIR", raising=False)
    assert resolve_inventory_path(None) == Path("inventory.yaml")
    monkeypatch.setenv("KDCTL_INVENTORY", str(a))
    assert resolve_inventory_path(None) == a
    assert resolve_inventory_path("b.yaml") == Path("b.yaml")
    # Relative to the inventory's folder, not to wherever kdctl was started.
    assert load_inventory(a).state_dir == tmp_path / "st"
    monkeypatch.setenv("KDCTL_STATE_DIR", str(tmp_path / "env"))
    assert load_inventory(a).state_dir == tmp_path / "env"
    assert load_inventory(a, state_dir=tmp_path / "opt").state_dir == tmp_path / "opt"
    run = kdctl("inventory", "check", "--json", "--state-dir", str(tmp_path / "cli"))
    assert run.code == 0, run.err
    assert str(tmp_path / "cli") in run.out


def test_api_key_from_file(tmp_path: Path) -> None:
    (tmp_path / "key").write_text("from-file\n")
    path = tmp_path / "i.yaml"
    path.write_text(GOOD + "    api_key_file: key\n")
    assert load_inventory(path).api_key("sglang").get_secret_value() == "from-file"  # type: ignore[union-attr]
    path.write_text(GOOD + "    api_key_file: missing-key\n")
    with pytest.raises(InputError, match=r"i\.yaml:13: backends\.sglang\.api_key_file"):
        load_inventory(path)


def test_values_are_text_not_markup(tmp_path: Path) -> None:
    path = tmp_path / "i.yaml"
    path.write_text(
        textwrap.dedent(
            """\
            hosts:
              box: {transport: local, gpus: 1, gpu_model: "[bold red]x[/]"}
            """
        )
    )
    run = kdctl("inventory", "check", "-i", str(path))
    assert run.code == 0, run.err
    assert "[bold red]x[/]" in run.out  # shown as written, not taken as markup


def test_an_api_key_with_a_newline_is_refused_without_echoing_it(tmp_path: Path) -> None:
    path = tmp_path / "i.yaml"
    path.write_text(GOOD + "    api_key_env: KDCTL_TEST_NL_KEY\n")
    run = kdctl("inventory", "check", "-i", str(path), env={"KDCTL_TEST_NL_KEY": "sk-abc\ndef"})
    assert run.code == 2 and "control characters" in run.err
    assert "sk-abc" not in run.err + run.out
    ok = kdctl("inventory", "check", "-i", str(path), env={"KDCTL_TEST_NL_KEY": "sk-abc\n"})
    assert ok.code == 0, (
        ok.err
    )  # a trailing newline, as `export K=$(cat file)` can leave, is stripped


def test_bounded_input_is_refused_quickly(tmp_path: Path, report: Any) -> None:
    """A few hundred bytes of nested aliases, JSON nested past any real export, and files past
    their size bound: each a clear exit 2 naming the file, in well under a second of work."""
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(
        "a: &a [x, x, x, x, x, x, x, x, x]\n"
        + "".join(
            f"{n}: &{n} [{', '.join(['*' + p] * 9)}]\n"
            for p, n in zip("abcdefgh", "bcdefghi", strict=True)
        )
        + "hosts: {h: {transport: local}, x: *i}\n"
    )
    deep = tmp_path / "deep.json"
    deep.write_text('{"kind": "kdctl-evidence", "results": ' + "[" * 5000 + "]" * 5000 + "}")
    huge = tmp_path / "huge.yaml"
    huge.write_text("hosts: {h: {transport: local}}\n" + "# padding\n" * 200_000)
    inv = tmp_path / "inv.yaml"
    inv.write_text("hosts: {h: {transport: local}}\nstate_dir: st\n")
    cases = [
        (("inventory", "check", "-i", str(bomb)), f"{bomb}:", "nested aliases"),
        (("evidence", "import", str(deep), "-i", str(inv)), f"{deep}:", "nested more than 64"),
        (("inventory", "check", "-i", str(huge)), f"{huge}:", "is more than the 1,048,576"),
    ]
    for args, where, why in cases:
        started = time.monotonic()
        run = kdctl(*args)
        took = time.monotonic() - started
        name = Path(where.rstrip(":")).name
        report(f"bounded input: {' '.join(args[:2])} {name}: exit {run.code} in {took:.2f}s")
        assert run.code == 2, run.err
        assert where in run.err and why in run.err, run.err
        assert "Traceback" not in run.err
        assert took < 10, took
