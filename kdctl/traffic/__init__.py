"""Traffic: the router drivers (nginx, SGLang's router, and those other distributions
register) and what they hold now, and the cutover journal. Moving traffic (the plan, the
analysis, the runner, cutover and rollback) lives in `kdctl.cutover`, a layer above the
readiness answers it consults; nothing here imports it."""

from kdctl.traffic._router import (
    BACKEND_HEADER,
    Capabilities,
    Router,
    RouterError,
    RouterState,
    equal_shares,
    front_url,
)
from kdctl.traffic.journal import (
    CutoverRecord,
    Journal,
    LockHeld,
    PostgresJournal,
    SqliteJournal,
    open_journal,
)
from kdctl.traffic.routers import make_router, router_class
from kdctl.traffic.sglang_router import router_argv

__all__ = [
    "BACKEND_HEADER",
    "Capabilities",
    "CutoverRecord",
    "Journal",
    "LockHeld",
    "PostgresJournal",
    "Router",
    "RouterError",
    "RouterState",
    "SqliteJournal",
    "equal_shares",
    "front_url",
    "make_router",
    "open_journal",
    "router_argv",
    "router_class",
]
