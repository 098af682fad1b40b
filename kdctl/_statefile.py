"""kdctl's own SQLite files in the state directory (evidence, the traffic journal): every
failure to open, read or write one becomes a message naming the file and what to do, never a
traceback. SQLite's transactions mean a failed write leaves nothing half-written."""

from __future__ import annotations

import errno
import functools
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

from kdctl.errors import InfraError, InputError, KdctlError

P = ParamSpec("P")
R = TypeVar("R")


def explain(path: Path, exc: BaseException) -> KdctlError:
    """The error a person can act on: a damaged file or a state directory kdctl cannot write
    is bad input (exit 2), a full disk or a busy file an infrastructure failure (exit 3)."""
    text = str(exc).lower()
    code = getattr(exc, "errno", None)
    if "not a database" in text or "malformed" in text or "corrupt" in text:
        return InputError(
            f"{path}: the file is damaged ({exc}); nothing in it was changed. Move it aside and "
            "restore a backup, or import an export (kdctl evidence import), then run again"
        )
    if (
        "readonly" in text
        or "read-only" in text
        or "unable to open" in text
        or code in (errno.EACCES, errno.EPERM, errno.EROFS)
    ):
        return InputError(
            f"{path}: cannot write it ({exc}): the state directory is read-only or not this "
            "user's; fix its permissions, or choose another with --state-dir or KDCTL_STATE_DIR"
        )
    if "full" in text or code in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        return InfraError(
            f"{path}: the disk is full ({exc}); nothing was half-written. Free space on it and "
            "run again"
        )
    if "disk i/o error" in text:
        # SQLite reports a write the disk refused (full, or past a size limit) as I/O.
        return InfraError(
            f"{path}: a write failed ({exc}): the disk may be full or failing; nothing was "
            "half-written. Free space on it, or check the disk, and run again"
        )
    if "locked" in text or "busy" in text:
        return InfraError(f"{path}: another kdctl holds it ({exc}); run again when it is done")
    return InfraError(f"{path}: {exc}")


def guarded(
    method: Callable[Concatenate[Any, P], R],
) -> Callable[Concatenate[Any, P], R]:
    """A method of an object with a `path` (its file), its SQLite and file errors explained."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return method(self, *args, **kwargs)
        except (sqlite3.Error, OSError) as exc:
            raise explain(self.path, exc) from None

    return cast("Callable[Concatenate[Any, P], R]", wrapper)


def explained(
    method: Callable[Concatenate[Any, P], R],
) -> Callable[Concatenate[Any, P], R]:
    """A method of a store that knows its database's errors (`errors`) and how to say them
    (`explain`): SQLite's file, PostgreSQL's server."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return method(self, *args, **kwargs)
        except self.errors as exc:
            raise self.explain(exc) from None

    return cast("Callable[Concatenate[Any, P], R]", wrapper)
