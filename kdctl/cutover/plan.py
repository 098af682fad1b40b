"""The plan of a cutover: its strategy, chosen by what the router can do and where the engines
run, and its steps, in Argo Rollouts' terms.

- blue-green: the candidate already up and gated takes all traffic at once; the old backend
  stays warm for a rollback.
- canary: weight steps (5, 25, 50, 100 by default) with an SLO watch between them; a breach rolls
  back at once and says which SLO broke.
- swap: the two engines need the same GPUs on one host, so the old one must stop before the new
  one starts: drain (503 with Retry-After), stop, start, wait ready, smoke gate, reopen; any
  failure stops the new one and restarts the old. The downtime is measured.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, TypeAdapter

from kdctl.errors import InputError
from kdctl.inventory import LoadedInventory
from kdctl.traffic import Router, RouterState

Strategy = Literal["blue-green", "canary", "swap"]
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

    def describe(self) -> str:
        return (
            f"smoke gate on {self.backend}: health, and exactness against the golden outputs of "
            "the engine it replaces where they are recorded"
        )


# One step of a plan, told apart by `kind`; a journal row holds its fields as they were dumped
# (rows of earlier releases carry the others as nulls, which are ignored).
Step = Annotated[SetWeights | Watch | Drain | Stop | Start | SmokeGate, Field(discriminator="kind")]
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
) -> Plan:
    if to not in inv.backends:
        raise InputError(f"--to: unknown backend {to!r} (known: {', '.join(sorted(inv.backends))})")
    serving = current.serving
    if len(serving) != 1:
        raise InputError(
            f"the router sends traffic to {serving or 'nothing'}: finish or roll back the "
            "cutover in progress first (kdctl cutover --resume, kdctl rollback)"
        )
    (src,) = serving
    if src == to:
        raise InputError(f"{to} already takes all traffic")
    caps = router.capabilities
    shared = inv.backends[src].shares_gpus_with(inv.backends[to])
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
