"""One probe on many hosts at once, where a dead host costs its own deadline and no more."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Outcome(Generic[T]):
    """A host's result: a value, the error it raised, or nothing because it ran out of time."""

    host: str
    value: T | None = None
    error: BaseException | None = None
    timed_out: bool = False
    duration_s: float = 0.0


def fan_out(
    probe: Callable[[str], T],
    hosts: Sequence[str],
    *,
    max_workers: int = 16,
    deadline_s: float = 30.0,
) -> dict[str, Outcome[T]]:
    """Run `probe(host)` for every host on at most `max_workers` threads.

    Each host's deadline counts from when its probe starts. A probe past it is abandoned on a
    daemon thread (a stuck socket cannot be interrupted from outside) and a fresh worker takes
    its place, so a queue behind a dead host keeps moving.
    """
    if len(set(hosts)) != len(hosts):
        raise ValueError("fan_out: host names must be unique")
    pending = list(reversed(hosts))
    started: dict[str, float] = {}
    results: dict[str, Outcome[T]] = {}
    cond = threading.Condition()

    def worker() -> None:
        while True:
            with cond:
                if not pending:
                    return
                host = pending.pop()
                started[host] = time.monotonic()
            try:
                outcome: Outcome[T] = Outcome(host, value=probe(host))
            except Exception as exc:
                outcome = Outcome(host, error=exc)
            with cond:
                if host not in results:  # not already given up on
                    elapsed = time.monotonic() - started[host]
                    results[host] = Outcome(host, outcome.value, outcome.error, duration_s=elapsed)
                    cond.notify_all()
                else:
                    return  # this worker was replaced when its host timed out

    def spawn() -> None:
        threading.Thread(target=worker, name="kdctl-fanout", daemon=True).start()

    for _ in range(min(max_workers, len(hosts))):
        spawn()
    with cond:
        while len(results) < len(hosts):
            now = time.monotonic()
            running = [h for h in started if h not in results]
            for host in running:
                if now - started[host] >= deadline_s:
                    results[host] = Outcome(host, timed_out=True, duration_s=now - started[host])
                    spawn()
            waits = [started[h] + deadline_s - now for h in running if h not in results]
            cond.wait(timeout=max(min(waits, default=deadline_s), 0.01))
    return {h: results[h] for h in hosts}
