"""The native kind in command mode, against a command that wraps the reference model."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest

from kdctl.backends import GenerateRequest, make_backend
from kdctl.backends.errors import BackendError, BackendHTTPError, BackendProtocolError
from kdctl.inventory import BackendSpec
from kdctl.transports import LocalTransport
from tests.conftest import kdctl, need_module, warm_argv

need_module("torch", "reference")


def native(command: list[str], tmp_path: Path) -> object:
    command = warm_argv(command)
    spec = BackendSpec.model_validate(
        {
            "kind": "native",
            "mode": "command",
            "host": "local",
            "command": command,
            "workdir": str(tmp_path),
        }
    )
    return make_backend("native", spec, transport=LocalTransport("local"))


def test_command_mode_matches_the_reference_engine(models: dict[str, Path], tmp_path: Path) -> None:
    from kdctl.backends.reference.engine import ReferenceEngine

    be = native(
        [sys.executable, "-m", "kdctl", "reference", "batch", "--model", str(models["dsv3"])],
        tmp_path,
    )
    req = GenerateRequest(input_ids=[40, 41, 42], max_new_tokens=8, top_logprobs=3, ignore_eos=True)
    got = be.generate(req)  # type: ignore[attr-defined]
    want = ReferenceEngine(models["dsv3"]).generate(req)
    assert got.output_ids == want.output_ids
    assert [t.top for t in got.logprobs] == [t.top for t in want.logprobs]
    batch = be.run_batch([req, GenerateRequest(input_ids=[10**7], max_new_tokens=2)])  # type: ignore[attr-defined]
    assert batch.results[0].output_ids == want.output_ids
    assert batch.results[1].error is not None and "input_ids" in batch.results[1].error.message
    info = be.info()  # type: ignore[attr-defined]
    assert info.model == str(models["dsv3"]) and info.context_length == 2048
    assert be.health().state == "up"  # type: ignore[attr-defined]
    with pytest.raises(BackendHTTPError, match="invalid_request"):
        be.generate(GenerateRequest(input_ids=[10**7], max_new_tokens=2))  # type: ignore[attr-defined]
    assert list(tmp_path.iterdir()) == []  # request and response files cleaned up


def test_command_mode_decodes_speculatively_with_a_draft(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """`reference batch --draft-model`: the command contract's result carries spec_verify_ct,
    counted by the engine, and the greedy output stays the target's own."""
    from kdctl.backends.reference.engine import ReferenceEngine

    argv = [sys.executable, "-m", "kdctl", "reference", "batch", "--model", str(models["dsv3"])]
    be = native(
        [*argv, "--draft-model", str(models["dsv3-draft"]), "--draft-tokens", "3"], tmp_path
    )
    req = GenerateRequest(text="def fibonacci(n):", max_new_tokens=24, ignore_eos=True)
    got = be.generate(req)  # type: ignore[attr-defined]
    want = ReferenceEngine(models["dsv3"]).generate(req)
    assert got.output_ids == want.output_ids
    # Every verification adds one to four tokens (three drafted, one of the target's own); the
    # first token comes from the prefill.
    assert got.spec_verify_ct is not None
    assert (len(got.output_ids) - 1) / 4 <= got.spec_verify_ct <= len(got.output_ids) - 1
    assert native(argv, tmp_path).generate(req).spec_verify_ct is None  # type: ignore[attr-defined]


def test_contract_breaches_are_named(tmp_path: Path) -> None:
    script = tmp_path / "engine.sh"
    script.write_text('#!/bin/sh\necho "{\\"contract\\": 1}" > "$4"\n')
    script.chmod(0o755)
    with pytest.raises(BackendProtocolError, match="breaks the contract: engine"):
        native([str(script)], tmp_path).generate(GenerateRequest(input_ids=[1]))  # type: ignore[attr-defined]
    failing = tmp_path / "fail.sh"
    failing.write_text("#!/bin/sh\necho 'CUDA out of memory' >&2\nexit 3\n")
    failing.chmod(0o755)
    with pytest.raises(BackendError, match="could not run: CUDA out of memory"):
        native([str(failing)], tmp_path).generate(GenerateRequest(input_ids=[1]))  # type: ignore[attr-defined]
    with pytest.raises(BackendError, match="not installed"):
        native(["kdtree-no-such-binary"], tmp_path).generate(GenerateRequest(input_ids=[1]))  # type: ignore[attr-defined]
    assert native(["kdtree-no-such-binary"], tmp_path).health().state == "down"  # type: ignore[attr-defined]


def test_reference_batch_refuses_a_bad_request_file(
    models: dict[str, Path], tmp_path: Path
) -> None:
    bad = tmp_path / "req.json"
    bad.write_text(
        json.dumps({"contract": 1, "requests": [{"id": "a", "input_ids": [1], "bogus": 1}]})
    )
    run = kdctl(
        "reference",
        "batch",
        "--model",
        str(models["dsv3"]),
        "--request",
        str(bad),
        "--response",
        str(tmp_path / "resp.json"),
    )
    assert run.code == 2 and "not a valid request file" in run.err
    assert not (tmp_path / "resp.json").exists()


def test_command_mode_over_ssh(fleet, models: dict[str, Path]) -> None:  # type: ignore[no-untyped-def]
    from kdctl.inventory import HostSpec
    from kdctl.transports.ssh import SSHTransport

    # As root: this machine's Python lives under /root, which the plain test login cannot enter.
    host = HostSpec.model_validate(fleet.host_entry("plain", user="root"))
    # A folder of its own: command-mode runs of other tests, in parallel, write to /tmp too.
    workdir = Path(tempfile.mkdtemp(prefix="kdctl-workdir-"))
    spec = BackendSpec.model_validate(
        {
            "kind": "native",
            "mode": "command",
            "host": "plain",
            "workdir": str(workdir),
            "command": [
                sys.executable,
                "-m",
                "kdctl",
                "reference",
                "batch",
                "--model",
                str(models["dsv3"]),
            ],
        }
    )
    with SSHTransport(
        "plain", host, known_hosts=fleet.known_hosts, identity_file=fleet.userkey
    ) as t:
        be = make_backend("native", spec, transport=t)
        got = be.generate(
            GenerateRequest(input_ids=[40, 41, 42], max_new_tokens=5, ignore_eos=True)
        )
        assert got.completion_tokens == 5
        assert be.info().model == str(models["dsv3"])
        # The host is this machine: its work folder holds no request or response file after.
        assert not list(workdir.glob("kdctl-*.json"))
    workdir.rmdir()
