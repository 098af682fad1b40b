"""Kinds other distributions add to kdctl (backends, gates, router drivers): entry points of a
group, each naming a subclass of kdctl's own base class."""

from __future__ import annotations

import functools
from importlib.metadata import EntryPoint, entry_points
from typing import TypeVar

from kdctl.errors import InputError

T = TypeVar("T")


@functools.cache
def _registered(group: str) -> dict[str, EntryPoint]:
    # Read once a process: the installed distributions do not change under a command, and
    # scanning their metadata costs milliseconds each of the dozens of times a status asks.
    return {ep.name: ep for ep in entry_points(group=group)}


def plugged(group: str) -> list[str]:
    """The names registered under the entry point group `group`."""
    return sorted(_registered(group))


def load_plugin(group: str, name: str, base: type[T]) -> type[T] | None:
    """The class registered as `name` under `group`; None where none is. One that is not a
    `base` is refused, naming the entry point, never used as though it were."""
    ep = _registered(group).get(name)
    if ep is None:
        return None
    cls = ep.load()
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise InputError(f"entry point {group}:{name} ({ep.value}) is not a kdctl {base.__name__}")
    return cls
