"""sign-off: a named person's approval, with a note, for what no program can decide (a soak
period watched on dashboards, a change window agreed with the product owner)."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import ClassVar

from kdctl.checks._base import Gate, GateContext
from kdctl.errors import InputError
from kdctl.records import GateResult, utcnow

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


class SignOffGate(Gate):
    name = "sign-off"
    asks_engine = False
    freshness_window = timedelta(days=30)
    description = "a named person's approval with a note (kdctl signoff)"
    runnable: ClassVar[bool] = False

    def run(self, ctx: GateContext, backend: str, baseline: str | None) -> GateResult:
        raise InputError(
            "a sign-off is given by a person: kdctl signoff -b BACKEND --by NAME --note TEXT"
        )


def sign_off(ctx: GateContext, backend: str, by: str, note: str) -> GateResult:
    who, why = by.strip(), note.strip()
    if not who or _CONTROL.search(who) or len(who) > 200:
        raise InputError("--by: give the approver's name (one line, at most 200 characters)")
    if not why or _CONTROL.search(why.replace("\n", " ")) or len(why) > 4000:
        raise InputError("--note: say what was checked (at most 4000 characters)")
    return SignOffGate().result(
        ctx,
        backend,
        started=utcnow(),
        verdict="pass",
        reasons=[f"signed off by {who}: {why}"],
        details={"by": who, "note": why},
    )
