"""Traffic: router drivers (nginx, SGLang's router), the cutover planner and state machine,
and its journal. Routers are driven through their host's transport; every change is read back."""

from kdctl.traffic._router import (
    BACKEND_HEADER,
    Capabilities,
    Router,
    RouterError,
    RouterState,
)
from kdctl.traffic.cutover import DEFAULT_STEPS, CutoverOutcome, Plan, Step, plan_cutover
from kdctl.traffic.journal import CutoverRecord, Journal, LockHeld
from kdctl.traffic.operations import Refused, cutover, make_router, preflight, rollback

__all__ = [
    "BACKEND_HEADER",
    "DEFAULT_STEPS",
    "Capabilities",
    "CutoverOutcome",
    "CutoverRecord",
    "Journal",
    "LockHeld",
    "Plan",
    "Refused",
    "Router",
    "RouterError",
    "RouterState",
    "Step",
    "cutover",
    "make_router",
    "plan_cutover",
    "preflight",
    "rollback",
]
