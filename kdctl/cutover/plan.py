"""The plan of a cutover: its strategy, chosen by what the router can do and where the engines
run, and its steps, in Argo Rollouts' terms.

- blue-green: the candidate already up and gated takes all traffic at once; the old backend
  stays warm for a rollback.
- canary: weight steps (5, 25, 50, 100 by default) with an SLO watch between them; a breach rolls
  back at once and says which SLO broke.
- swap: the two engines need the same GPUs on one host, so the old one must stop before the new
  one starts: drain (503 with Retry-After), stop, start, wait ready, smoke gate, reopen; any
  failure stops the new one and restarts the old. The downtime is measured.
- rolling: a pool moved to another engine's pool box by box, in waves of `max_unavailable`
  boxes, never surging (a box runs one engine or the other): before each wave the load is held
  against what the boxes left can carry; per box, out of every router, drained, the old engine
  stopped and its GPUs seen free, the new one started and judged alone, put back; then the
  whole front soaks under a probe load.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, TypeAdapter

from kdctl.errors import InputError
from kdctl.inventory import LoadedInventory
from kdctl.traffic import Router, RouterState

Strategy = Literal["blue-green", "canary", "swap", "rolling"]
DEFAULT_STEPS = (5, 25, 50, 100)


def parse_steps(text: str) -> tuple[int, ...]:
    """`--steps 5,25,50,100`: the canary's weights; the planner judges their order and range."""
    try:
        return tuple(int(w) for w in text.split(","))
    except ValueError:
        raise InputError(
            f"--steps: {text!r} is not a list of percentages like 5,25,50,100"
        ) from None


class SetWeights(BaseModel):
    kind: Literal["set-weights"] = "set-weights"
    weights: dict[str, int]

    def describe(self) -> str:
        return "set weights " + ", ".join(f"{k} {v}%" for k, v in self.weights.items())


class Watch(BaseModel):
    kind: Literal["watch"] = "watch"
    seconds: float

    def describe(self) -> str:
        return f"watch SLOs for {self.seconds:g}s under a probe load"


class Drain(BaseModel):
    kind: Literal["drain"] = "drain"

    def describe(self) -> str:
        return "drain: the router answers 503 with Retry-After"


class _OnEngine(BaseModel):
    """A step on one engine's service, described by its kind: "stop candidate"."""

    kind: str
    backend: str

    def describe(self) -> str:
        return f"{self.kind} {self.backend}"


class Stop(_OnEngine):
    kind: Literal["stop"] = "stop"


class Start(_OnEngine):
    kind: Literal["start"] = "start"


class SmokeGate(BaseModel):
    kind: Literal["smoke-gate"] = "smoke-gate"
    backend: str
    # The engine it takes over from, whose recorded golden outputs it is held to; unset, the
    # plan's `from_backend` (a swap's).
    replaces: str | None = None

    def describe(self) -> str:
        return (
            f"smoke gate on {self.backend}: health, and exactness against the golden outputs of "
            f"{self.replaces or 'the engine it replaces'} where they are recorded"
        )


class Headroom(BaseModel):
    """Before a wave: the load every engine in the routers holds now, against what those left
    once `out` leaves could carry."""

    kind: Literal["headroom"] = "headroom"
    wave: int
    out: list[str]

    def describe(self) -> str:
        return f"wave {self.wave}: headroom for taking out {', '.join(self.out)}"


class RemoveFromRouters(_OnEngine):
    kind: Literal["remove-from-routers"] = "remove-from-routers"

    def describe(self) -> str:
        return f"take {self.backend} out of the router, read back"


class DrainEngine(_OnEngine):
    """The engine's own running requests to zero, from its gauges, within `deadline_s`."""

    kind: Literal["drain-engine"] = "drain-engine"
    deadline_s: float

    def describe(self) -> str:
        return f"drain {self.backend}: its running requests to 0 (at most {self.deadline_s:g}s)"


class GpusFree(_OnEngine):
    """No compute process left on the stopped engine's GPUs, as its host shows them."""

    kind: Literal["gpus-free"] = "gpus-free"

    def describe(self) -> str:
        return f"confirm {self.backend}'s GPUs hold no compute process"


class AddToRouters(_OnEngine):
    kind: Literal["add-to-routers"] = "add-to-routers"

    def describe(self) -> str:
        return f"put {self.backend} in the router, read back and generate through it"


class Soak(BaseModel):
    """The whole front under a probe load after a wave, its new engines each healthy."""

    kind: Literal["soak"] = "soak"
    wave: int
    seconds: float
    backends: list[str]

    def describe(self) -> str:
        return f"wave {self.wave}: soak the front for {self.seconds:g}s under a probe load"


# One step of a plan, told apart by `kind`; a journal row holds its fields as they were dumped
# (rows of earlier releases carry the others as nulls, which are ignored).
Step = Annotated[
    SetWeights
    | Watch
    | Drain
    | Stop
    | Start
    | SmokeGate
    | Headroom
    | RemoveFromRouters
    | DrainEngine
    | GpusFree
    | AddToRouters
    | Soak,
    Field(discriminator="kind"),
]
_STEP = TypeAdapter(Step)


def step_from(row: dict[str, Any]) -> Step:
    """The step a journal row holds."""
    return _STEP.validate_python({k: v for k, v in row.items() if v is not None})


class Plan(BaseModel):
    from_backend: str
    to_backend: str
    strategy: Strategy
    reason: str
    steps: list[Step]


def plan_cutover(
    inv: LoadedInventory,
    router: Router,
    current: RouterState,
    to: str,
    *,
    strategy: Strategy | None = None,
    weights: tuple[int, ...] = DEFAULT_STEPS,
    watch_s: float = 10.0,
    max_unavailable: int = 1,
) -> Plan:
    split = strategy in ("canary", "blue-green")
    if strategy == "rolling" or (to in inv.pools and not split):
        if strategy not in (None, "rolling"):
            raise InputError(
                f"--strategy {strategy}: a pool is moved box by box (rolling), or split by "
                "weight from another pool on boxes of its own (canary, blue-green)"
            )
        return plan_rolling(
            inv, router, current, to, max_unavailable=max_unavailable, watch_s=watch_s
        )
    if to in inv.pools:
        src = serving_pool(inv, current.serving)
        _own_boxes(inv, src, to, str(strategy))
        shared = False
    else:
        if to not in inv.backends:
            known = ", ".join(sorted(inv.backends))
            raise InputError(f"--to: unknown backend {to!r} (known: {known})")
        serving = current.serving
        if len(serving) != 1:
            raise InputError(
                f"the router sends traffic to {serving or 'nothing'}: finish or roll back the "
                "cutover in progress first (kdctl cutover --resume, kdctl rollback)"
            )
        (src,) = serving
        shared = inv.backends[src].shares_gpus_with(inv.backends[to])
    if src == to:
        raise InputError(f"{to} already takes all traffic")
    caps = router.capabilities
    if strategy is None:
        if shared:
            strategy, why = "swap", f"{src} and {to} need the same GPUs on {inv.backends[to].host}"
        elif caps.weights:
            strategy, why = "canary", f"{router.kind} splits traffic by weight"
        else:
            strategy, why = "blue-green", f"{router.kind} has no weights: all at once"
    else:
        why = "chosen with --strategy"
        if shared and strategy != "swap":
            raise InputError(
                f"--strategy {strategy}: {src} and {to} share GPUs "
                f"{sorted(set(inv.backends[src].gpus) & set(inv.backends[to].gpus))} on "
                f"{inv.backends[to].host}; both cannot run at once, only swap can move traffic"
            )
        if strategy == "canary" and not caps.weights:
            raise InputError(f"--strategy canary: {router.kind} has no traffic weights")
        if strategy == "swap" and not caps.drain:
            raise InputError(f"--strategy swap: {router.kind} cannot drain")
    steps: list[Step] = []
    if strategy == "blue-green":
        steps.append(SetWeights(weights={src: 0, to: 100}))
    elif strategy == "canary":
        if not weights or sorted(weights) != list(weights) or weights[-1] != 100:
            raise InputError(f"--steps {weights}: weights must rise and end at 100")
        for w in weights:
            steps.append(SetWeights(weights={src: 100 - w, to: w}))
            # --watch 0 asks for no watch: no step that would report a window never measured.
            if w < 100 and watch_s > 0:
                steps.append(Watch(seconds=watch_s))
    else:
        # A swap stops one engine and starts the other, and a rollback starts the first again:
        # both must be startable before anything is drained.
        for name in (to, src):
            inv.service_env(name)
        steps += [
            Drain(),
            Stop(backend=src),
            Start(backend=to),
            SmokeGate(backend=to),
            SetWeights(weights={src: 0, to: 100}),
        ]
    return Plan(from_backend=src, to_backend=to, strategy=strategy, reason=why, steps=steps)


def serving_pool(inv: LoadedInventory, serving: list[str]) -> str:
    """The one pool whose replicas are all the router sends to; InputError otherwise."""
    src = {inv.pool_of(n) for n in serving}
    if len(src) != 1 or None in src:
        raise InputError(
            f"the router sends traffic to {serving or 'nothing'}, not to one pool: finish or "
            "roll back the cutover in progress first (kdctl cutover --resume, kdctl rollback)"
        )
    (pool,) = src
    assert pool is not None
    return pool


def _own_boxes(inv: LoadedInventory, src: str, to: str, strategy: str) -> None:
    """Two pools split by weight run at once: no replica of one may need another's GPUs."""
    for a in inv.pools[src]:
        for b in inv.pools[to]:
            if inv.backends[a].shares_gpus_with(inv.backends[b]):
                raise InputError(
                    f"--strategy {strategy}: {a} and {b} need the same GPUs on "
                    f"{inv.backends[b].host}, and a box runs one engine or the other: move "
                    "the pool box by box (--strategy rolling)"
                )


def plan_rolling(
    inv: LoadedInventory,
    router: Router,
    current: RouterState,
    to: str,
    *,
    max_unavailable: int = 1,
    watch_s: float = 10.0,
    drain_s: float = 60.0,
) -> Plan:
    """Box by box from the pool the router sends to now onto pool `to`, whose replica on each
    box takes the old one's place there."""
    if to not in inv.pools:
        known = ", ".join(sorted(inv.pools)) or "none"
        raise InputError(f"--to {to}: a rolling cutover moves to a pool (known: {known})")
    serving = current.serving
    from_pool = serving_pool(inv, serving)
    if from_pool == to:
        raise InputError(f"{to} already takes all traffic")
    if max_unavailable < 1:
        raise InputError("--max-unavailable must be at least 1")
    new_on = {inv.backends[n].host: n for n in inv.pools[to]}
    boxes: list[tuple[str, str]] = []
    for old in serving:
        host = inv.backends[old].host
        if host not in new_on:
            raise InputError(
                f"{to} has no replica on {host}, where {old} serves: nothing to move it to"
            )
        boxes.append((old, new_on[host]))
    if max_unavailable >= len(boxes):
        raise InputError(
            f"--max-unavailable {max_unavailable} would take all {len(boxes)} boxes of "
            f"{from_pool} out at once; a rolling cutover keeps some serving"
        )
    for name in {n for pair in boxes for n in pair}:
        inv.service_env(name)  # both ends of every box must be startable before anything moves
    steps: list[Step] = []
    for w, at in enumerate(range(0, len(boxes), max_unavailable), start=1):
        wave = boxes[at : at + max_unavailable]
        steps.append(Headroom(wave=w, out=[old for old, _ in wave]))
        for old, new in wave:
            steps += [
                RemoveFromRouters(backend=old),
                DrainEngine(backend=old, deadline_s=drain_s),
                Stop(backend=old),
                GpusFree(backend=old),
                Start(backend=new),
                SmokeGate(backend=new, replaces=old),
                AddToRouters(backend=new),
            ]
        if watch_s > 0:
            steps.append(Soak(wave=w, seconds=watch_s, backends=[new for _, new in wave]))
    return Plan(
        from_backend=from_pool,
        to_backend=to,
        strategy="rolling",
        reason=f"{len(boxes)} boxes, {max_unavailable} at a time: each runs one engine or another",
        steps=steps,
    )
