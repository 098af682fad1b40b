"""What a host and an engine's weights really are, read on the host: the host's machine id
and GPU serials rather than the inventory's name for it, and a fingerprint of the checkpoint
files rather than their path. Evidence is bound to these, so a box swapped under the same name
or weights replaced under the same path no longer count as what was measured.
"""

from __future__ import annotations

import hashlib
import posixpath

from kdctl.errors import KdctlError
from kdctl.transports import Transport


def parse_machine_identity(machine_id: str, serials: str) -> str | None:
    """A stable id from /etc/machine-id and the GPUs' serial numbers (either may be empty)."""
    parts = [machine_id.strip(), *sorted(s.strip() for s in serials.splitlines() if s.strip())]
    if not any(parts):
        return None
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def probe_host_identity(transport: Transport, *, timeout: float = 10.0) -> str | None:
    """None when the host says nothing that identifies it (no machine id, no GPU)."""
    try:
        mid = transport.run(["cat", "/etc/machine-id"], timeout=timeout)
        gpus = transport.run(
            ["nvidia-smi", "--query-gpu=serial", "--format=csv,noheader"], timeout=timeout
        )
    except KdctlError:
        return None
    return parse_machine_identity(
        mid.stdout if mid.ok else "", gpus.stdout if gpus.ok and not gpus.not_found else ""
    )


def probe_executable(transport: Transport, program: str, *, timeout: float = 10.0) -> str | None:
    """A fingerprint of the file `program` (a command's first word, found on the host's PATH
    where it is a bare name): its size, change time and inode, so a binary rebuilt or replaced
    differs while one left alone does not, without reading it. None where the host cannot say."""
    script = 'p=$(command -v -- "$1") || exit 127; find -L "$p" -maxdepth 0 -type f -printf "$2"'
    try:
        found = transport.run(["sh", "-c", script, "sh", program, _FIND_FORMAT], timeout=timeout)
    except KdctlError:
        return None
    if not found.ok:
        return None
    return parse_checkpoint_listing(found.stdout)


# name, size, change time (ns since the epoch, which no copy tool can set back) and inode of
# each file in the checkpoint's folder and one level below (sharded checkpoints keep
# sub-folders). A replaced or rewritten file changes its change time; a file restored by
# `cp -p` or `rsync -a` keeps its mtime, never its ctime.
_FIND_FORMAT = "%P\\t%s\\t%C@\\t%i\\n"


def parse_checkpoint_listing(listing: str) -> str | None:
    lines = sorted(ln for ln in listing.splitlines() if ln.strip())
    if not lines:
        return None
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def probe_weights(transport: Transport, model_path: str, *, timeout: float = 30.0) -> str | None:
    """A fingerprint of the checkpoint at `model_path` on the host; None when the path is not
    a folder there (a hub id, an engine that reports only a served name)."""
    if not posixpath.isabs(model_path):
        return None
    try:
        found = transport.run(
            [
                "find",
                "-L",
                model_path,
                "-mindepth",
                "1",
                "-maxdepth",
                "2",
                "-type",
                "f",
                "-printf",
                _FIND_FORMAT,
            ],
            timeout=timeout,
        )
    except KdctlError:
        return None
    if not found.ok:
        return None
    return parse_checkpoint_listing(found.stdout)
