"""Loading a roadmap: YAML, schema, then every name checked against the gates and the inventory.

A roadmap is refused whole, every problem on its own line as `FILE:LINE: field: reason`, the way
the inventory is: a phase that names a gate nobody can run would never be done.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

from pydantic import BaseModel, ValidationError

from kdctl.checks import gate_class, gates, with_settings
from kdctl.errors import InputError
from kdctl.inventory import (
    LoadedInventory,
    format_problems,
    local_path,
    pydantic_problems,
    read_mapping,
    unknown_name,
)
from kdctl.roadmap._model import Criterion, Phase, RoadmapSpec

Loc = tuple[str | int, ...]


@dataclass(frozen=True)
class ResolvedCriterion:
    """A criterion with its defaults filled in from the roadmap."""

    name: str
    phase: str
    gate: str
    backend: str
    baseline: str | None
    spec: Criterion
    line: int | None


@dataclass(frozen=True)
class Roadmap:
    spec: RoadmapSpec
    path: Path
    # (phase index, criterion index) to its line in the file, for messages.
    lines: dict[tuple[int, int], int | None]

    def criteria(self, candidate: str | None = None) -> dict[str, list[ResolvedCriterion]]:
        """Every phase's criteria with defaults filled in; `candidate` stands in for the
        roadmap's own wherever a criterion names no backend (a cutover to another candidate
        is judged by the same criteria)."""
        return {
            phase.id: [
                _resolve(self.spec, phase, c, self.lines.get((i, j)), candidate)
                for j, c in enumerate(phase.criteria)
            ]
            for i, phase in enumerate(self.spec.phases)
        }

    def speed_criterion(self, backend: str) -> ResolvedCriterion | None:
        """The roadmap's speed criterion as it would judge `backend`: the named one, else the
        first throughput criterion with a ratio requirement. None when the roadmap has none,
        or when its criterion is pinned to another backend."""
        for i, phase in enumerate(self.spec.phases):
            for j, c in enumerate(phase.criteria):
                name = c.name or _default_name(c, c.backend or self.spec.candidate)
                chosen = (
                    name == self.spec.speed
                    if self.spec.speed is not None
                    else c.gate == "throughput" and any("ratio" in m for m in c.require)
                )
                if chosen:
                    if c.backend is not None and c.backend != backend:
                        return None
                    return _resolve(self.spec, phase, c, self.lines.get((i, j)), backend)
        return None

    @property
    def phases(self) -> list[Phase]:
        return list(self.spec.phases)

    @property
    def target(self) -> str:
        return self.spec.target or self.spec.phases[-1].id

    def phase(self, phase_id: str) -> Phase:
        for p in self.spec.phases:
            if p.id == phase_id:
                return p
        raise InputError(f"{self.path}: no phase {phase_id!r}")

    def prerequisites(self, phase_id: str) -> list[str]:
        """Every phase `phase_id` depends on, directly or not, in roadmap order."""
        wanted: set[str] = set()
        stack = list(self.phase(phase_id).depends_on)
        while stack:
            dep = stack.pop()
            if dep not in wanted:
                wanted.add(dep)
                stack.extend(self.phase(dep).depends_on)
        return [p.id for p in self.spec.phases if p.id in wanted]


def roadmap_path(inv: LoadedInventory, override: Path | None = None) -> Path | None:
    """`--roadmap`, else the inventory's `roadmap:`; a bare name falls back to the shipped ones."""
    chosen = override or inv.spec.roadmap
    if chosen is None:
        return None
    path = local_path(chosen, inv.path.parent) if override is None else chosen
    if path.is_file() or override is not None:
        return path
    shipped = files("kdctl.roadmap").joinpath(Path(chosen).name)
    return Path(str(shipped)) if shipped.is_file() else path


def check_roadmap(inv: LoadedInventory) -> Roadmap | None:
    """`inventory check` checks the roadmap the inventory names too: a phase naming an unknown
    backend is the inventory's problem as much as the roadmap's."""
    path = roadmap_path(inv)
    return load_roadmap(path, inv) if path is not None else None


def load_roadmap(path: Path, inv: LoadedInventory) -> Roadmap:
    doc = read_mapping(path, "roadmap", "'title', 'serving', 'candidate' and 'phases'")
    try:
        spec = RoadmapSpec.model_validate(doc.data)
    except ValidationError as exc:
        raise InputError(format_problems(doc, pydantic_problems(exc, RoadmapSpec))) from None
    problems = list(_cross_check(spec, inv))
    if problems:
        raise InputError(format_problems(doc, problems))
    lines = {
        (i, j): doc.line_of(("phases", i, "criteria", j))
        for i, phase in enumerate(spec.phases)
        for j in range(len(phase.criteria))
    }
    return Roadmap(spec=spec, path=path, lines=lines)


def _default_name(c: Criterion, backend: str) -> str:
    return f"command:{c.command}" if c.gate == "command" and c.command else f"{c.gate}:{backend}"


def _resolve(
    spec: RoadmapSpec, phase: Phase, c: Criterion, line: int | None, candidate: str | None
) -> ResolvedCriterion:
    backend = c.backend or candidate or spec.candidate
    baseline = c.baseline
    cls = gate_class(c.gate)
    if baseline is None and (cls.needs_baseline or cls.takes_baseline):
        baseline = spec.serving
    return ResolvedCriterion(
        name=c.name or _default_name(c, backend),
        phase=phase.id,
        gate=c.gate,
        backend=backend,
        baseline=baseline,
        spec=c,
        line=line,
    )


def _cross_check(spec: RoadmapSpec, inv: LoadedInventory) -> Iterable[tuple[Loc, str]]:
    known_gates = gates()
    backends = inv.backends
    for field in ("serving", "candidate"):
        name = getattr(spec, field)
        if name not in backends:
            yield (field,), unknown_name("backend", name, backends)
    ids: dict[str, int] = {}
    for i, phase in enumerate(spec.phases):
        if phase.id in ids:
            yield (
                ("phases", i, "id"),
                f"phase {phase.id!r} is defined twice (also phases[{ids[phase.id]}])",
            )
        ids.setdefault(phase.id, i)
    if spec.target is not None and spec.target not in ids:
        yield ("target",), unknown_name("phase", spec.target, ids)
    names: dict[str, str] = {}
    for i, phase in enumerate(spec.phases):
        for j, dep in enumerate(phase.depends_on):
            if dep not in ids:
                yield ("phases", i, "depends_on", j), unknown_name("phase", dep, ids)
        for j, c in enumerate(phase.criteria):
            at: Loc = ("phases", i, "criteria", j)
            if c.gate not in known_gates:
                yield (*at, "gate"), unknown_name("gate", c.gate, known_gates)
                continue
            yield from _check_criterion(spec, inv, c, at)
            name = c.name or _default_name(c, c.backend or spec.candidate)
            if name in names:
                yield (
                    at,
                    (
                        f"criterion {name!r} is already defined in phase {names[name]!r}; "
                        "give one of them a 'name'"
                    ),
                )
            names.setdefault(name, phase.id)
    if spec.speed is not None:
        gate = next(
            (
                c.gate
                for p in spec.phases
                for c in p.criteria
                if (c.name or _default_name(c, c.backend or spec.candidate)) == spec.speed
            ),
            None,
        )
        if gate is None:
            yield ("speed",), unknown_name("criterion", spec.speed, names)
        elif gate != "throughput":
            yield ("speed",), f"{spec.speed!r} is a {gate} criterion; speed is a throughput one"
    cycle = _find_cycle(spec)
    if cycle:
        first = next(i for i, p in enumerate(spec.phases) if p.id == cycle[0])
        yield ("phases", first, "depends_on"), "dependency cycle: " + " -> ".join(cycle)


def _check_criterion(
    spec: RoadmapSpec, inv: LoadedInventory, c: Criterion, at: Loc
) -> Iterable[tuple[Loc, str]]:
    backends = inv.backends
    cls = gate_class(c.gate)
    for field in ("backend", "baseline"):
        name = getattr(c, field)
        if name is not None and name not in backends:
            yield (*at, field), unknown_name("backend", name, backends)
    if c.baseline is not None and not (cls.needs_baseline or cls.takes_baseline):
        yield (*at, "baseline"), f"the {c.gate} gate compares with no baseline"
    if c.gate == "command":
        commands = inv.spec.gates.commands
        if c.command is None:
            yield at, "a command criterion names one of the inventory's gates.commands in 'command'"
        elif c.command not in commands:
            yield (*at, "command"), unknown_name("command check", c.command, commands)
    elif c.command is not None:
        yield (*at, "command"), "'command' is for the command gate"
    if c.settings:
        try:
            with_settings(inv, c.gate, c.settings)
        except ValidationError as exc:
            for loc, msg in pydantic_problems(exc, _section(inv, c.gate)):
                yield (*at, "settings", *loc), msg
        except ValueError as exc:
            yield (*at, "settings"), str(exc)


def _section(inv: LoadedInventory, gate: str) -> type[BaseModel]:
    field = gate_class(gate).settings_field
    assert field is not None
    return type(getattr(inv.spec.gates, field))


def _find_cycle(spec: RoadmapSpec) -> list[str] | None:
    deps = {p.id: list(p.depends_on) for p in spec.phases}
    state: dict[str, int] = {}  # 1 on the current path, 2 finished

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in deps.get(node, []):
            if state.get(dep) == 1:
                return [*path[path.index(dep) :], dep] if dep in path else [node, dep]
            if dep in deps and dep not in state:
                found = visit(dep, [*path, dep])
                if found:
                    return found
        state[node] = 2
        return None

    for phase in spec.phases:
        if phase.id not in state:
            found = visit(phase.id, [phase.id])
            if found:
                return found
    return None
