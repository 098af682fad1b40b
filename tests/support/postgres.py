"""A PostgreSQL cluster of the tests' own on loopback: made by initdb in a temporary folder,
started and stopped by pg_ctl as the package's `postgres` user (initdb refuses root), with a
password login, as a team's shared evidence store would have."""

from __future__ import annotations

import glob
import os
import secrets
import shutil
import subprocess
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from tests.support.sshd import free_port

USER = "kdctl"


def pg_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(found[-1]).parent if found else None


@dataclass
class Cluster:
    root: Path
    port: int
    password: str
    bin: Path

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{database}"

    def create_database(self) -> str:
        """A database of its own for one test: the URL to it."""
        import psycopg

        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.url(), password=self.password, autocommit=True) as db:
            db.execute(f"CREATE DATABASE {name}")
        return self.url(name)


def _as_postgres(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["runuser", "-u", "postgres", "--", *args], capture_output=True, text=True, check=False
    )


def start_cluster() -> Cluster:
    bin_dir = pg_bin()
    assert bin_dir is not None
    root = Path(tempfile.mkdtemp(prefix="kdctl-pg-"))
    password = secrets.token_hex(12)
    pwfile = root / "pw"
    pwfile.write_text(password + "\n")
    shutil.chown(root, "postgres", "postgres")
    shutil.chown(pwfile, "postgres", "postgres")
    os.chmod(root, 0o700)
    init = _as_postgres(
        str(bin_dir / "initdb"),
        "-D",
        str(root / "data"),
        "-U",
        USER,
        "--auth=scram-sha-256",
        f"--pwfile={pwfile}",
        "-E",
        "UTF8",
        "--no-sync",
    )
    assert init.returncode == 0, init.stdout + init.stderr
    port = free_port()
    options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off"
    started = _as_postgres(
        str(bin_dir / "pg_ctl"),
        "-D",
        str(root / "data"),
        "-o",
        options,
        "-l",
        str(root / "log"),
        "-w",
        "-t",
        "60",
        "start",
    )
    assert started.returncode == 0, started.stdout + started.stderr + _log(root)
    return Cluster(root, port, password, bin_dir)


def stop_cluster(cluster: Cluster) -> None:
    _as_postgres(
        str(cluster.bin / "pg_ctl"), "-D", str(cluster.root / "data"), "-m", "fast", "stop"
    )
    shutil.rmtree(cluster.root, ignore_errors=True)


def _log(root: Path) -> str:
    try:
        return (root / "log").read_text()[-2000:]
    except OSError:
        return ""
