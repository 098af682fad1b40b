"""Moving traffic: the plan (`plan`: strategy and steps), the canary's analysis (`analysis`),
the runner that executes a plan under the lock with every step journaled (`runner`), a
rolling cutover's steps on a box and its pause (`rolling`), and cutover, resume and rollback as
the CLI runs them (`operations`). The router drivers and the
journal it writes through stay in `kdctl.traffic`, a layer below the readiness answers this
package consults."""

from kdctl.cutover.analysis import AnalysisFailed, WatchResult
from kdctl.cutover.operations import (
    Order,
    Refused,
    cutover,
    cutover_in_progress,
    order,
    rollback,
)
from kdctl.cutover.plan import DEFAULT_STEPS, Plan, Step, Strategy, parse_steps, plan_cutover
from kdctl.cutover.rolling import RollingOptions
from kdctl.cutover.runner import CutoverAborted, CutoverOutcome, preflight

__all__ = [
    "DEFAULT_STEPS",
    "AnalysisFailed",
    "CutoverAborted",
    "CutoverOutcome",
    "Order",
    "Plan",
    "Refused",
    "RollingOptions",
    "Step",
    "Strategy",
    "WatchResult",
    "cutover",
    "cutover_in_progress",
    "order",
    "parse_steps",
    "plan_cutover",
    "preflight",
    "rollback",
]
