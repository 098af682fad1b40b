"""Whether a result or a recorded baseline still counts: young enough, measured on what is
deployed now, and (a result) the measurement its gate would make now. Every answer kdctl gives
asks here: `currency` for a result, `baseline_gaps` for a baseline."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from kdctl.checks import (
    Workloads,
    freshness_window,
    gate_class,
    measured_otherwise,
    workload_changed,
)
from kdctl.errors import InputError
from kdctl.inventory import LoadedInventory
from kdctl.inventory.models import parse_duration
from kdctl.records import Baseline, BaselineKind, GateResult, Provenance, utcnow

# The fields that say "this is the same engine on the same model and hardware".
_IDENTITY = (
    "engine_version",
    "model_path",
    "config_hash",
    "host",
    "gpus",
    "tp_size",
    "host_id",
    "weights",
    "baseline_host_id",
    "baseline_weights",
    "baseline_engine_version",
    "engine_settings",
    "baseline_engine_settings",
    "engine_binary",
)
# A result without the identity of the machine it ran on, or naming a model without a
# fingerprint of its weights, where either can be read now, cannot say that what it measured
# is what is there: a stripped or hand-made record would otherwise count on any box. A pass
# owes more (`_PASS_OWES`).
_BOUND = (
    "weights",
    "host_id",
    "baseline_weights",
    "baseline_host_id",
    "engine_settings",
    "baseline_engine_settings",
    # The build: the native engine is rebuilt daily on the same weights, so a result that
    # does not say which build it measured cannot be said to describe today's.
    "engine_version",
    "baseline_engine_version",
)
# What a pass owes besides: the engine's own fields (of a gate that asks the engine) where the
# engine reports them now, and what the host shows of its backend (host, GPUs, program). A pass
# whose record lacks one cannot say it measured what runs: nothing null in it passes as a match.
_ENGINE_FIELDS = ("engine_version", "model_path", "config_hash", "tp_size", "engine_settings")
# What the host shows of every result's backend, the engine answering or not.
_HOST_FIELDS = ("host", "gpus", "engine_binary")
_PASS_OWES = (*_ENGINE_FIELDS, *_HOST_FIELDS, "baseline_engine_version")
_OWED = {
    "host_id": "an identity",
    "engine_settings": "the engine's settings",
    "engine_version": "the engine's build",
    "model_path": "the model it served",
    "config_hash": "the engine's configuration",
    "tp_size": "its TP size",
    "host": "its host",
    "gpus": "its GPUs",
    "engine_binary": "its program's fingerprint",
}


@dataclass(frozen=True)
class Freshness:
    fresh: bool
    reason: str
    age: timedelta
    # Why it is stale, by name: "age" (older than the window), "future" (ended after now), or
    # each identity field that changed.
    changed: tuple[str, ...] = ()


def age_text(delta: timedelta) -> str:
    secs = int(delta.total_seconds())
    if secs < 120:
        return f"{secs}s"
    if secs < 7200:
        return f"{secs // 60}m"
    if secs < 172800:
        return f"{secs // 3600}h"
    return f"{secs // 86400}d"


def _asks_engine(result: GateResult) -> bool:
    try:
        return gate_class(result.gate).asks_engine
    except InputError:
        # A gate this machine does not have: by what its result recorded of an engine.
        p = result.provenance
        return any(getattr(p, name) is not None for name in _ENGINE_FIELDS)


def _names(result: GateResult, field: str) -> bool:
    """Whether the result must carry `field` where it can be read now: every result ran on
    some machine; a weights fingerprint is owed by one that names the model it loaded, and
    the baseline's by one that compared with a baseline; a pass, every field of what it
    measured (`_PASS_OWES`)."""
    if field in _PASS_OWES and result.verdict == "pass":
        if field in _HOST_FIELDS:
            return True
        if field == "baseline_engine_version":
            return result.baseline is not None and _asks_engine(result)
        return _asks_engine(result)
    if field in _PASS_OWES and field not in _BOUND:
        return False  # a result that is no pass claims nothing of these
    if field == "weights":
        return result.provenance.model_path is not None
    if field == "host_id":
        return True
    if field == "engine_settings":
        # Owed by a result that asked the engine what it runs; a host's gate asked no engine.
        return result.provenance.engine_version is not None
    if field == "baseline_engine_settings":
        return result.provenance.baseline_engine_version is not None
    if field == "engine_version":
        # Owed by a result that asked the engine what it runs (its settings are recorded); a
        # host's gate, or a cutover's promotion, asked no engine.
        return result.provenance.engine_settings is not None
    if field == "baseline_engine_version":
        return result.provenance.baseline_engine_settings is not None
    return result.baseline is not None


def freshness(
    result: GateResult,
    *,
    window: timedelta,
    current: Provenance,
    now: datetime | None = None,
    live: bool = True,
) -> Freshness:
    """Stale evidence counts as missing.

    A field the result never measured (a host-level gate records no engine version) is not
    held against it. With `live`, `current` is what the running engine reports, and a field it
    cannot report is a mismatch: a result that cannot be tied to what runs now proves nothing
    about it. Without (the engine did not answer), `current` is what the inventory declares,
    and only the fields it declares are compared.
    """
    age = (now or utcnow()) - result.ended_at
    if age > window:
        return Freshness(
            False, f"stale: {age_text(age)} old, window {age_text(window)}", age, ("age",)
        )
    if age < timedelta(0):
        return Freshness(False, "stale: ended in the future (clock skew?)", age, ("future",))
    changed = []
    fields: list[str] = []
    for name in _IDENTITY:
        then, now_value = getattr(result.provenance, name), getattr(current, name)
        # The engine's own fields are owed where it reports them now; held to the inventory
        # (it did not answer), only to what the host shows of every result's backend.
        owed = name in _BOUND or (name in _PASS_OWES and (live or name in _HOST_FIELDS))
        if owed and then in (None, []) and now_value not in (None, []) and _names(result, name):
            what = _OWED.get(name.removeprefix("baseline_"), "a fingerprint")
            changed.append(f"{name}: recorded without {what}, now {now_value}")
            fields.append(name)
            continue
        if then in (None, []):
            continue
        if now_value in (None, []) and (not live or name.startswith("baseline_")):
            # Not live: held to what is declared. A baseline's fields: only a criterion that
            # compares with a baseline asks for its identity.
            continue
        if then != now_value:
            fields.append(name)
            if name.endswith("engine_settings"):
                baseline = name.startswith("baseline_")
                changed.append(result.provenance.settings_change(current, baseline=baseline))
                continue
            shown_now = "unknown" if now_value in (None, []) else now_value
            changed.append(f"{name} {then} -> {shown_now}")
    if changed:
        return Freshness(
            False, "stale: deployment changed: " + "; ".join(changed), age, tuple(fields)
        )
    return Freshness(True, f"fresh: {age_text(age)} old, window {age_text(window)}", age)


@dataclass(frozen=True)
class FrontNow:
    """What a request through the router's front just found: whether an engine's answer came
    back, the engine that answered (None where the router names none), the weights the router
    reads back, and what was seen."""

    answered: bool | None
    backend: str | None
    weights: dict[str, int]
    detail: str
    # Why the router's weights could not be read back, where they could not: one answer
    # through the front then shows an engine serving, not that it serves all traffic.
    unread: str | None = None

    def promoted(self, backend: str) -> str | None:
        """Why a recorded promotion of `backend` does not hold now; None when it does."""
        if self.answered is not True:
            now = "serves nothing" if self.answered is False else "cannot be asked from here"
            return f"the front {now} ({self.detail}): all traffic on {backend} is not seen"
        if self.unread is not None:
            return (
                f"the router's weights could not be read ({self.unread}): all traffic on "
                f"{backend} is not seen"
            )
        if self.backend == backend and self.weights in ({}, {backend: 100}):
            return None
        if self.backend is None and self.weights == {backend: 100}:
            return None
        who = self.backend or "no engine it names"
        return (
            f"the front answers from {who} now, the router sending {self.weights or 'unknown'} "
            f"({self.detail}): all traffic on {backend} no longer holds"
        )


def currency(
    result: GateResult,
    *,
    window: timedelta,
    current: Provenance | None,
    live: bool,
    ways: Sequence[LoadedInventory],
    baseline: Provenance | None = None,
    settings_matched: bool = False,
    front: FrontNow | None = None,
    now: datetime | None = None,
    memo: Workloads | None = None,
) -> Freshness:
    """Whether `result` still stands for its gate now: the one rule behind every answer.

    Young enough for `window`; measured on what runs now (`current`: what the engine reports
    where `live`, else what the inventory declares; None where neither could be had), with
    `baseline`'s identity beside it for a result compared with one; and the measurement its
    gate would make now under one of `ways` (the inventory's settings, or a roadmap
    criterion's): the same settings, unless the caller chose the result by them
    (`settings_matched`), and the same workload, since a prompt file edited in place keeps its
    name in the settings. A passed promotion says what the router did then: it holds while
    `front`, what a request through the router's front found just now, still agrees."""
    now = now or utcnow()
    if current is None:
        return Freshness(
            False, "stale: the backend's identity is unknown", now - result.ended_at, ("identity",)
        )
    if baseline is not None:
        current = current.with_baseline(baseline)
    f = freshness(result, window=window, current=current, now=now, live=live)
    if not f.fresh:
        return f
    check = workload_changed if settings_matched else measured_otherwise
    whys = [check(way, result, memo) for way in ways]
    if whys and None not in whys:
        return Freshness(False, f"stale: {whys[0]}", f.age, ("workload",))
    if front is not None and result.gate == "promotion" and result.verdict == "pass":
        moved = front.promoted(result.backend)
        if moved is not None:
            return Freshness(False, f"stale: {moved}", f.age, ("front",))
    return f


def baseline_window(inv: LoadedInventory, kind: BaselineKind) -> tuple[timedelta, str] | None:
    """How long a recorded baseline of `kind` stands, and the window's name. The engine serving
    today must be restarted to be measured again, so its records may have a window of their
    own (`gates.freshness.baseline`); unset, a throughput run stands as long as the throughput
    gate's results (a speed is the machine's as much as the build's: drivers, clocks, firmware,
    none of which the identity holds), and golden outputs and API answers as long as what they
    were measured on is what runs."""
    configured = inv.spec.gates.freshness
    if "baseline" in configured:
        return parse_duration(configured["baseline"]), "the baseline window"
    if kind == "throughput":
        return freshness_window(inv, "throughput"), "the throughput window"
    return None


def baseline_gaps(
    inv: LoadedInventory, b: Baseline, current: Provenance, *, live: bool
) -> list[str]:
    """Why a recorded baseline does not describe the engine as it is now; empty where it does.
    An engine that answers (`live`) is held to what it reports; one that does not (stopped for
    a swap) to what its host shows (the checkpoint's fingerprint, the host's id) and the
    inventory declares."""
    fields = None if live else ("weights", "host_id")
    if fields is not None and all(getattr(current, f) is None for f in fields):
        # Neither the engine nor its host answered: nothing now to hold the record to, and a
        # comparison skips what is not known, so it would find no difference.
        return ["neither it nor its host could be read: nothing now to hold the record to"]
    gaps = b.provenance.differs_from(current, fields)
    window = baseline_window(inv, b.kind)
    age = utcnow() - b.created_at
    if not gaps and window is not None and age > window[0]:
        gaps.append(f"recorded {age_text(age)} ago, past {window[1]} of {age_text(window[0])}")
    return gaps
