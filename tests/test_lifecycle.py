"""Starting and stopping a reference server through a `command` service, locally and over SSH."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kdctl.backends import make_backend
from kdctl.backends.errors import BackendError
from kdctl.backends.reference import serve_argv
from kdctl.errors import InputError
from kdctl.inventory import BackendSpec, HostSpec
from kdctl.transports import CommandResult, LocalTransport, Transport
from kdctl.transports.ssh import SSHTransport
from tests.conftest import need_module, warm_argv
from tests.support.sshd import SshdFleet, free_port

need_module("torch", "reference")


@pytest.fixture
def shared_dir(models: dict[str, Path]) -> Iterator[Path]:
    """A folder both root and the SSH login can use: a copy of the model, pidfile, log."""
    root = Path(tempfile.mkdtemp(prefix="kdctl-life-"))
    root.chmod(0o777)
    shutil.copytree(models["dsv3"], root / "model")
    for p in [root / "model", *(root / "model").iterdir()]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    yield root
    shutil.rmtree(root, ignore_errors=True)


MARKER = "a value; with $(spaces)"
TOKEN = "hf_kdctl_test_5c1e"


class RecordingTransport(LocalTransport):
    """The local transport, keeping every argv it ran: what `ps` on the host would show."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.argvs: list[tuple[str, ...]] = []

    def run(self, argv: Sequence[str], **kwargs: Any) -> CommandResult:
        self.argvs.append(tuple(argv))
        return super().run(argv, **kwargs)


@pytest.fixture(autouse=True)
def hub_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KDCTL_TEST_HUB_TOKEN", TOKEN)


def engine_spec(root: Path, port: int, *, model: Path | None = None) -> BackendSpec:
    return BackendSpec.model_validate(
        {
            "kind": "sglang",
            "host": "h",
            "url": f"http://127.0.0.1:{port}",
            "service": {
                "command": warm_argv(serve_argv(model or root / "model", port)),
                "pidfile": str(root / "engine.pid"),
                "log": str(root / "engine.log"),
                "workdir": str(root),
                "env": {
                    "KDCTL_TEST_MARKER": MARKER,
                    "HF_TOKEN": {"from_env": "KDCTL_TEST_HUB_TOKEN"},
                },
            },
        }
    )


def cycle(transport: Transport, root: Path) -> None:
    port = free_port()
    be = make_backend("engine", engine_spec(root, port))
    control = be.lifecycle(transport)
    assert control.stop().detail == "not running"  # stopping a stopped engine is no error
    started = control.start()
    assert started.changed and started.state.state == "running"
    assert not control.start().changed  # idempotent
    health = control.wait_ready(deadline_s=120)
    assert health.state == "up"
    pid = control.state().pid
    env = transport.run(["cat", f"/proc/{pid}/environ"]).stdout.split("\x00")
    assert f"KDCTL_TEST_MARKER={MARKER}" in env and f"HF_TOKEN={TOKEN}" in env
    restarted = control.restart()
    assert restarted.state.state == "running" and restarted.state.pid != pid
    assert not transport.run(["test", "-e", f"/proc/{pid}"]).ok
    assert control.wait_ready(deadline_s=120).state == "up"
    pid = control.state().pid
    assert f"ready: {be.spec.url}" in control.log_tail()
    stopped = control.stop()
    assert stopped.changed and stopped.state.state == "stopped"
    assert not transport.run(["test", "-e", f"/proc/{pid}"]).ok
    assert not (root / "engine.pid").exists()
    assert be.health().state == "down"


def test_lifecycle_locally(shared_dir: Path) -> None:
    transport = RecordingTransport("local")
    cycle(transport, shared_dir)
    started = [argv for argv in transport.argvs if argv[:2] == ("sh", "-s")]
    assert len(started) == 2  # start and restart
    assert not [argv for argv in transport.argvs if any(TOKEN in a or MARKER in a for a in argv)]


def test_a_missing_from_env_variable_stops_nothing(
    shared_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KDCTL_TEST_HUB_TOKEN")
    control = make_backend("engine", engine_spec(shared_dir, free_port())).lifecycle(
        LocalTransport("local")
    )
    with pytest.raises(InputError) as exc:
        control.start()
    assert str(exc.value) == (
        "backends.engine.service.env.HF_TOKEN: environment variable KDCTL_TEST_HUB_TOKEN "
        "is not set where kdctl runs"
    )
    assert not (shared_dir / "engine.pid").exists()
    assert control.state().state == "stopped"


def test_lifecycle_over_ssh(fleet: SshdFleet, shared_dir: Path) -> None:
    # As root: this machine's Python lives under /root, which the plain test login cannot enter.
    spec = HostSpec.model_validate(fleet.host_entry("plain", user="root"))
    with SSHTransport(
        "plain", spec, known_hosts=fleet.known_hosts, identity_file=fleet.userkey
    ) as t:
        assert t.run(["id", "-u"]).stdout.strip() == "0"
        cycle(t, shared_dir)


def test_a_crashing_engine_fails_fast_with_its_log(shared_dir: Path) -> None:
    be = make_backend("engine", engine_spec(shared_dir, free_port(), model=shared_dir / "nope"))
    control = be.lifecycle(LocalTransport("local"))
    control.start()
    with pytest.raises(BackendError, match="exited while starting") as exc:
        control.wait_ready(deadline_s=60)
    assert "not a model folder" in str(exc.value)
    assert control.stop().detail == "not running"


def test_log_tails_never_carry_the_api_key(tmp_path: Path) -> None:
    from pydantic import SecretStr

    tmp_path.chmod(0o755)
    spec = BackendSpec.model_validate(
        {
            "kind": "sglang",
            "host": "h",
            "url": f"http://127.0.0.1:{free_port()}",
            "api_key_env": None,
            "service": {
                "command": [
                    "sh",
                    "-c",
                    "echo server_args api_key=sk-live-123 --api-key sk-live-123; exit 1",
                ],
                "pidfile": str(tmp_path / "e.pid"),
                "log": str(tmp_path / "e.log"),
            },
        }
    )
    be = make_backend("engine", spec, api_key=SecretStr("sk-live-123"))
    control = be.lifecycle(LocalTransport("local"))
    control.start()
    with pytest.raises(BackendError, match="exited while starting") as exc:
        control.wait_ready(deadline_s=30)
    assert "sk-live-123" not in str(exc.value)
    assert "api_key=***" in str(exc.value) and "--api-key ***" in str(exc.value)
