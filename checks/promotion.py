"""promotion: the router sends all traffic to a backend after a cutover that held its SLOs.

No one runs it: `kdctl cutover` records it when traffic has moved (pass), and a rollback, of the
cutover itself or by `kdctl rollback`, records that it moved back (fail). The newest result
therefore says what the router does, and a roadmap phase can end on it instead of on a person's
word alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, ClassVar

from kdctl.checks._base import Gate, GateContext, provenance_for
from kdctl.errors import InputError
from kdctl.inventory import LoadedInventory
from kdctl.records import GateResult, Metric, Verdict, utcnow


class PromotionGate(Gate):
    name = "promotion"
    asks_engine = False
    description = "all traffic on the backend after a cutover (recorded by kdctl cutover)"
    runnable: ClassVar[bool] = False
    # It stays true until a rollback says otherwise; a month bounds how long it is taken on trust.
    freshness_window = timedelta(days=30)

    def run(self, ctx: GateContext, backend: str, baseline: str | None) -> GateResult:
        raise InputError(
            "a promotion is recorded by the cutover that makes it: kdctl cutover --to BACKEND"
        )


def promotion_result(
    inv: LoadedInventory,
    backend: str,
    *,
    verdict: Verdict,
    reason: str,
    cutover: str,
    from_backend: str,
    strategy: str,
    weights: dict[str, int] | None,
    started_at: datetime,
    watches: Sequence[Mapping[str, Any]] = (),
    downtime_s: float | None = None,
) -> GateResult:
    """What a cutover or a rollback left the router doing, as evidence about `backend`."""
    sent = sum(w.get("sent", 0) for w in watches)
    # The probes went through the front to either engine: where the new one's own counter
    # says it served none of them, their failures (none, say) tell nothing of it.
    served = [w.get("engine_requests") for w in watches]
    known = all(isinstance(n, int | float) for n in served)
    engine_requests = sum(n for n in served if isinstance(n, int | float)) if known else None
    judged = sent > 0 and engine_requests != 0
    metrics = [
        Metric(
            name="weight",
            value=None if weights is None else weights.get(backend, 0),
            unit="%",
            threshold=100,
            comparison=">=",
        ),
        Metric(name="probe_requests", value=sent),
        # A cutover that sent no probe (blue-green has no watch) showed nothing about failures:
        # no count, and no threshold to pass; nor did probes the new engine served none of.
        Metric(
            name="probe_failed",
            value=sum(w.get("failed", 0) for w in watches) if sent else None,
            threshold=0 if judged else None,
            comparison="==" if judged else None,
        ),
    ]
    if watches:
        # How many probes the new one served, by its own counter, is what the watch measured
        # of it (None where it gave none).
        metrics.append(Metric(name="engine_requests", value=engine_requests))
    if downtime_s is not None:
        metrics.append(Metric(name="downtime_s", value=downtime_s, unit="s"))
    notes = [str(w["engine_note"]) for w in watches if w.get("engine_note")]
    return GateResult(
        gate=PromotionGate.name,
        backend=backend,
        # A pool moved from is no one engine to bind the result to: its name is in details.
        baseline=from_backend if from_backend in inv.backends else None,
        verdict=verdict,
        metrics=metrics,
        reasons=[reason, *dict.fromkeys(notes)],
        provenance=provenance_for(inv, backend, None, None),
        details={"cutover": cutover, "from": from_backend, "strategy": strategy},
        started_at=started_at,
        ended_at=utcnow(),
    )
