"""The command line: parses arguments, calls the library, prints. No logic lives here."""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TextIO, cast

import typer
from pydantic import BaseModel
from rich.console import Console

from kdctl import __version__
from kdctl.errors import KdctlError

if TYPE_CHECKING:
    from kdctl.evidence import EvidenceStore
    from kdctl.inventory import LoadedInventory
    from kdctl.sandbox import SandboxStatus

app = typer.Typer(
    name="kdctl",
    help="Readiness gates, phases and gated cutover between LLM inference engines.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
inventory_app = typer.Typer(help="Validate and summarise the inventory.", no_args_is_help=True)
app.add_typer(inventory_app, name="inventory")
gate_app = typer.Typer(help="Readiness gates: list them, run them.", no_args_is_help=True)
app.add_typer(gate_app, name="gate")
baseline_app = typer.Typer(help="Baselines from the engine serving today.", no_args_is_help=True)
app.add_typer(baseline_app, name="baseline")
evidence_app = typer.Typer(
    help="Recorded gate results and baselines: list, show, export, import.", no_args_is_help=True
)
app.add_typer(evidence_app, name="evidence")
sandbox_app = typer.Typer(
    help="The embedded default: engines and a router on this machine.", no_args_is_help=True
)
app.add_typer(sandbox_app, name="sandbox")
reference_app = typer.Typer(
    help="The reference model and server (needs the `reference` extra).", no_args_is_help=True
)
app.add_typer(reference_app, name="reference")


def _consoles() -> tuple[Console, Console]:
    """The consoles a command prints on, read from the environment it runs in (not the one
    the module was imported in). Piped output (CI logs, `| less`) gets full-width tables
    instead of rich's 80 columns; progress goes to stderr, so `--json` and piped tables on
    stdout stay clean."""
    width = None if sys.stdout.isatty() else int(os.environ.get("COLUMNS") or 200)
    return Console(highlight=False, width=width), Console(stderr=True, highlight=False)


out, err = _consoles()

InventoryOpt = Annotated[
    Path | None,
    typer.Option(
        "--inventory",
        "-i",
        help="Inventory file [default: $KDCTL_INVENTORY, else ./inventory.yaml]",
    ),
]
StateDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--state-dir", help="State directory [default: $KDCTL_STATE_DIR, else the inventory's]"
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document instead of tables.")]
WideOpt = Annotated[
    bool, typer.Option("--wide", help="Every column, for a terminal wider than 80 columns.")
]
TimeoutOpt = Annotated[
    float, typer.Option("--timeout", min=0.1, help="Deadline per host and backend, seconds.")
]
DeepOpt = Annotated[
    bool,
    typer.Option(
        "--deep",
        help="Run command-mode engines' binaries to ask who they are (they load the model).",
    ),
]


def _load(
    inventory: Path | None, state_dir: Path | None, *, engines: bool = True
) -> LoadedInventory:
    """The inventory; with `engines`, one whose engines kdctl can talk to now, so an unset
    API-key variable is refused (exit 2) before any request goes out without its key."""
    from kdctl.errors import InputError
    from kdctl.inventory import load_inventory, resolve_inventory_path

    inv = load_inventory(resolve_inventory_path(inventory), state_dir=state_dir)
    if engines and inv.unset_keys:
        raise InputError("\n".join(inv.unset_keys.values()))
    return inv


def _seconds(option: str, value: str) -> float | None:
    """A duration option ('90s', '30m', '2h'), or 'none'."""
    from kdctl.errors import InputError
    from kdctl.inventory.models import parse_duration

    if value == "none":
        return None
    try:
        return parse_duration(value).total_seconds()
    except ValueError:
        raise InputError(
            f"{option} {value!r}: not a duration such as '90s', '30m' or '2h', nor 'none'"
        ) from None


def _print_json(doc: BaseModel | dict[str, object]) -> None:
    data = doc.model_dump(mode="json") if isinstance(doc, BaseModel) else doc
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


def _version(value: bool) -> None:
    if value:
        out.print(f"kdctl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    """kdctl answers: is a speed-optimized engine serving, what phases remain, can we cut over."""


@app.command()
def status(
    inventory: InventoryOpt = None,
    state_dir: StateDirOpt = None,
    json_: JsonOpt = False,
    timeout: TimeoutOpt = 20.0,
    wide: WideOpt = False,
    deep: DeepOpt = False,
) -> None:
    """Hosts, GPUs and backends as live probes see them. Exit 3 when a host is unreachable."""
    from kdctl.status import status_report
    from kdctl.tables import status_tables

    inv = _load(inventory, state_dir)
    with _store_for(inv) as store:
        report = status_report(inv, store, deadline_s=timeout, deep=deep)
    if json_:
        _print_json(report)
    else:
        out.print(status_tables(report, wide=wide))
    if report.unreachable:
        if not json_:
            sys.stderr.write(f"unreachable: {', '.join(report.unreachable)}\n")
        raise typer.Exit(3)


TargetOpt = Annotated[
    str | None, typer.Option("--target", help="The phase to reach [default: the roadmap's].")
]
CandidateOpt = Annotated[
    str | None,
    typer.Option("--candidate", help="Judge another backend by the roadmap's criteria."),
]
RoadmapOpt = Annotated[
    Path | None,
    typer.Option("--roadmap", help="Roadmap file [default: the inventory's roadmap:]"),
]


@app.command()
def phases(
    inventory: InventoryOpt = None,
    state_dir: StateDirOpt = None,
    roadmap: RoadmapOpt = None,
    json_: JsonOpt = False,
    target: TargetOpt = None,
    candidate: CandidateOpt = None,
    run: Annotated[
        bool,
        typer.Option("--run", help="First run the gate behind every unmet criterion."),
    ] = False,
    only: Annotated[
        list[str] | None, typer.Option("--phase", help="With --run: only this phase (repeat).")
    ] = None,
    wide: WideOpt = False,
    timeout: TimeoutOpt = 15.0,
    deep: DeepOpt = False,
) -> None:
    """The roadmap's phases from evidence: done, in progress, blocked, remaining, and every
    unmet criterion with its threshold, last value and age, under the three answers. Exit 0
    when traffic may move to the candidate now, 1 when not."""
    from kdctl.readiness import assess_phases
    from kdctl.tables import answers_text, evidence_table, phases_table, progress_bars

    inv = _load(inventory, state_dir)
    with _store_for(inv) as store, progress_bars(err, run and not json_) as progress:
        found = assess_phases(
            inv,
            store,
            roadmap=roadmap,
            target=target,
            candidate=candidate,
            run=run,
            only=only,
            timeout_s=timeout,
            deep=deep,
            on_start=None if json_ else lambda what: err_print(f"running {what}..."),
            progress=progress,
        )
    assert found.phases is not None
    if json_:
        _print_json(found.phases_document())
    else:
        if found.ran:
            out.print(evidence_table(found.ran))
        out.print(answers_text(found.answers))
        out.print(phases_table(found.phases, wide=wide))
    if found.answers.cutover.can_cut_over is not True:
        raise typer.Exit(1)


@app.command()
def report(
    inventory: InventoryOpt = None,
    state_dir: StateDirOpt = None,
    roadmap: RoadmapOpt = None,
    formats: Annotated[
        str,
        typer.Option("--format", "-f", help="Comma-separated: markdown, html, junit, json."),
    ] = "markdown,html,junit,json",
    output: Annotated[Path, typer.Option("--output", "-o", help="Folder to write into.")] = Path(
        "kdctl-report"
    ),
    target: TargetOpt = None,
    candidate: CandidateOpt = None,
    json_: JsonOpt = False,
    timeout: TimeoutOpt = 15.0,
    deep: DeepOpt = False,
) -> None:
    """The readiness report for CI. Exit 0 when the target phase is reachable now, 1 when not."""
    from kdctl.cutover import cutover_in_progress
    from kdctl.readiness import assess
    from kdctl.report import parse_formats, render_reports

    chosen = parse_formats(formats)
    inv = _load(inventory, state_dir)
    with _store_for(inv) as store:
        found = assess(
            inv,
            store,
            roadmap=roadmap,
            target=target,
            candidate=candidate,
            timeout_s=timeout,
            deep=deep,
        )
        routed = found.answers.serving.routed
        written = render_reports(
            found,
            store,
            chosen,
            output,
            inventory=str(inv.path),
            in_progress=cutover_in_progress(inv, routed.weights if routed else {}),
        )
    # The exit code is answer 3 itself: a CI job gated on it agrees with the text.
    reachable = found.answers.cutover.can_cut_over is True
    if json_:
        _print_json(
            {
                "files": [str(p) for p in written],
                "target_reachable": reachable,
                "answers": found.answers.model_dump(mode="json"),
            }
        )
    else:
        for line in found.answers.lines():
            out.print(line, markup=False)
        for path in written:
            out.print(f"wrote {path}", markup=False)
    if not reachable:
        raise typer.Exit(1)


def _confirmer(yes: bool) -> Callable[[str], bool]:
    """--yes answers for scripts; a terminal is asked; with neither, kdctl refuses rather
    than wait for an answer that cannot come."""

    def confirm(question: str) -> bool:
        if yes:
            err_print(f"{question} yes (--yes)")
            return True
        if not sys.stdin.isatty():
            from kdctl.cutover import Refused

            raise Refused(f"{question} No terminal to ask and no --yes: refusing; nothing changed")
        return typer.confirm(question, default=False, err=True)

    return confirm


@app.command("cutover")
def cutover_cmd(
    action: Annotated[
        Literal["pause", "promote", "abort"] | None,
        typer.Argument(
            help="A rolling cutover in the journal: pause or abort it at its next box; promote "
            "a paused one (--full: skip its remaining soaks)."
        ),
    ] = None,
    to: Annotated[str | None, typer.Option("--to", help="The backend to move traffic to.")] = None,
    strategy: Annotated[
        Literal["blue-green", "canary", "swap", "rolling"] | None,
        typer.Option("--strategy", help="[default: chosen by the plan; rolling for a pool]"),
    ] = None,
    max_unavailable: Annotated[
        int,
        typer.Option(
            "--max-unavailable", min=1, help="Rolling: boxes taken out of the pool at a time."
        ),
    ] = 1,
    on_fail: Annotated[
        Literal["pause", "abort"],
        typer.Option(
            "--on-fail", help="Rolling: a failed box pauses the rollout, or moves every box back."
        ),
    ] = "pause",
    progress_deadline: Annotated[
        str,
        typer.Option(
            "--progress-deadline",
            help="Rolling: a step not done this long after it began (a soak: past its own "
            "length) aborts the rollout, every box back; 'none': no deadline.",
        ),
    ] = "30m",
    steps: Annotated[
        str, typer.Option("--steps", help="Canary weights, percent, rising to 100.")
    ] = "5,25,50,100",
    watch: Annotated[
        float,
        typer.Option(
            "--watch", min=0, help="Seconds of SLO watch between canary steps, or after a wave."
        ),
    ] = 10.0,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the plan; change nothing.")
    ] = False,
    force: Annotated[
        bool, typer.Option("--force", help="Go past unmet prerequisites (asked, and journaled).")
    ] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Answer yes to every question.")] = False,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue the interrupted cutover in the journal.")
    ] = False,
    full: Annotated[
        bool, typer.Option("--full", help="promote: skip the remaining soaks.")
    ] = False,
    inventory: InventoryOpt = None,
    state_dir: StateDirOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Move traffic to a backend, gated by the roadmap's prerequisites. Exit 0 when traffic
    moved, 1 when refused or rolled back, 3 when a router or host failed."""
    from kdctl.cutover import (
        CutoverOutcome,
        Plan,
        RollingOptions,
        cutover,
        order,
        parse_steps,
    )
    from kdctl.tables import outcome_line, plan_lines

    weights = parse_steps(steps)
    inv = _load(inventory, state_dir)
    if action is not None:
        with _store_for(inv) as store:
            done = order(inv, store, action, confirm=_confirmer(yes), full=full)
        if isinstance(done, str):
            if json_:
                _print_json({"said": done})
            else:
                out.print(done, markup=False)
            return
        result: Plan | CutoverOutcome = done
    else:
        with _store_for(inv) as store:
            result = cutover(
                inv,
                store,
                to,
                confirm=_confirmer(yes),
                strategy=strategy,
                steps=weights,
                watch_s=watch,
                force=force,
                dry_run=dry_run,
                resume=resume,
                rolling=RollingOptions(
                    max_unavailable=max_unavailable,
                    on_fail=on_fail,
                    progress_deadline_s=_seconds("--progress-deadline", progress_deadline),
                ),
                on_step=None
                if json_
                else lambda i, step: err_print(f"step {i + 1}: {step.describe()}"),
            )
    if json_:
        _print_json(result)
    elif isinstance(result, Plan):
        _print_lines(plan_lines(result))
    else:
        _print_lines([outcome_line(result)])
    if not isinstance(result, Plan) and result.state != "succeeded":
        raise typer.Exit(1)


@app.command("rollback")
def rollback_cmd(
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Answer yes to every question.")] = False,
    inventory: InventoryOpt = None,
    state_dir: StateDirOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Back to the backend that served before the last cutover: no gates, one router write,
    confirmed by reading the router back; a rolling cutover's boxes one at a time."""
    from kdctl.cutover import rollback

    inv = _load(inventory, state_dir)
    with _store_for(inv) as store:
        backend, state = rollback(inv, store, confirm=_confirmer(yes))
    if json_:
        _print_json({"serving": backend, "router": state.model_dump(mode="json")})
    else:
        out.print(f"rolled back: the router sends {state.weights} ({state.source})", markup=False)


@inventory_app.command("check")
def inventory_check(
    inventory: InventoryOpt = None, state_dir: StateDirOpt = None, json_: JsonOpt = False
) -> None:
    """Validate the inventory (exit 2 naming file, line and field) and summarise it."""
    from kdctl.roadmap import check_roadmap
    from kdctl.tables import inventory_summary

    inv = _load(inventory, state_dir, engines=False)
    check_roadmap(inv)
    for warning in inv.warnings:
        err_print(f"warning: {warning}")
    if json_:
        _print_json(
            {
                "inventory": str(inv.path),
                "valid": True,
                "warnings": inv.warnings,
                "state_dir": str(inv.state_dir),
                "spec": inv.spec.model_dump(mode="json"),
            }
        )
    else:
        out.print(inventory_summary(inv))


@app.command("init")
def init_cmd(
    host: Annotated[
        str | None, typer.Option("--host", help="The box to read, over SSH (its address).")
    ] = None,
    local: Annotated[bool, typer.Option("--local", help="Read this machine instead.")] = False,
    user: Annotated[str | None, typer.Option("--user", help="SSH login.")] = None,
    port: Annotated[int, typer.Option("--port", min=1, max=65535, help="SSH port.")] = 22,
    identity_file: Annotated[
        Path | None, typer.Option("--identity-file", help="SSH private key.")
    ] = None,
    known_hosts: Annotated[
        Path | None, typer.Option("--known-hosts", help="[default: ~/.ssh/known_hosts]")
    ] = None,
    accept_new: Annotated[
        bool, typer.Option("--accept-new", help="Record an unknown host key (never a changed one).")
    ] = False,
    output: Annotated[Path, typer.Option("--output", "-o", help="The file to write.")] = Path(
        "inventory.yaml"
    ),
    force: Annotated[bool, typer.Option("--force", help="Replace an existing file.")] = False,
) -> None:
    """Write an inventory from what a host shows: GPUs, engines running or stopped (units,
    processes, sockets, their own API), nginx; each value commented with where it was found."""
    from kdctl.inventory_init import InitRequest, init_inventory

    result = init_inventory(
        InitRequest(
            output=output,
            host=host,
            local=local,
            user=user,
            port=port,
            identity_file=identity_file,
            known_hosts=known_hosts,
            accept_new=accept_new,
            force=force,
        )
    )
    _print_lines(result.lines())


@gate_app.command("list")
def gate_list(json_: JsonOpt = False) -> None:
    """The gates kdctl knows, built in and from plugins."""
    from kdctl.checks import gates
    from kdctl.tables import gate_lines, gates_document

    if json_:
        _print_json(gates_document(gates()))
    else:
        _print_lines(gate_lines(gates()))


@gate_app.command("run")
def gate_run(
    gate: Annotated[str, typer.Argument(help="A gate name, or `all`.")],
    backend: Annotated[str, typer.Option("--backend", "-b", help="The backend to judge.")],
    baseline: Annotated[
        str | None, typer.Option("--baseline", help="The backend to compare with.")
    ] = None,
    inventory: InventoryOpt = None,
    state_dir: StateDirOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Run a gate and record its result. Exit 0 pass, 1 fail or inconclusive, 3 error.
    Without --baseline, gates that compare use the roadmap's serving backend."""
    from kdctl.readiness import default_baseline
    from kdctl.recording import run_gates
    from kdctl.tables import evidence_table, progress_bars

    inv = _load(inventory, state_dir)
    if baseline is None:
        baseline = default_baseline(inv, backend)
        if baseline is not None and not json_:
            err_print(f"comparing with {baseline}, the roadmap's serving backend (--baseline)")
    with _store_for(inv) as store, progress_bars(err, not json_) as progress:
        results = run_gates(
            inv,
            store,
            gate,
            backend,
            baseline,
            on_start=None if json_ else lambda name: err_print(f"running {name} on {backend}..."),
            progress=progress,
        )
    if json_:
        _print_json({"results": [r.model_dump(mode="json") for r in results]})
    else:
        out.print(evidence_table(results))
    verdicts = {r.verdict for r in results}
    if "error" in verdicts:
        raise typer.Exit(3)
    if verdicts & {"fail", "inconclusive"}:
        raise typer.Exit(1)


@baseline_app.command("record")
def baseline_record(
    backend: Annotated[str, typer.Option("--backend", "-b", help="The engine serving today.")],
    inventory: InventoryOpt = None,
    state_dir: StateDirOpt = None,
    json_: JsonOpt = False,
    only: Annotated[
        Literal["golden", "throughput", "api"] | None,
        typer.Option("--only", help="Record only this kind."),
    ] = None,
    plan: Annotated[
        bool,
        typer.Option(
            "--plan", help="Print what would run and the box time it may take; run nothing."
        ),
    ] = False,
) -> None:
    """Record golden outputs (token ids and top-k logprobs over the exactness corpus) and a
    throughput run of the gate's workload, from the engine serving today."""
    from kdctl.recording import BASELINE_KINDS, plan_baseline, record_baseline
    from kdctl.tables import baseline_line, progress_bars, recording_plan_lines

    kinds = BASELINE_KINDS if only is None else (only,)
    inv = _load(inventory, state_dir)
    if plan:
        with _store_for(inv) as store:
            planned = plan_baseline(inv, store, backend, kinds)
        if json_:
            _print_json({"plan": [p.model_dump(mode="json") for p in planned]})
        else:
            _print_lines(recording_plan_lines(backend, planned))
        return
    with _store_for(inv) as store, progress_bars(err, not json_) as progress:
        recorded = record_baseline(inv, store, backend, kinds, progress=progress)
    if json_:
        _print_json({"baselines": [b.model_dump(mode="json") for b in recorded]})
        return
    for b in recorded:
        out.print(baseline_line(b), markup=False)


@app.command("signoff")
def signoff(
    backend: Annotated[str, typer.Option("--backend", "-b", help="The backend approved.")],
    by: Annotated[str, typer.Option("--by", help="Who approves, by name.")],
    note: Annotated[str, typer.Option("--note", help="What was checked.")],
    inventory: InventoryOpt = None,
    state_dir: StateDirOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Record a named person's sign-off for a backend, as evidence for the `sign-off` gate."""
    from kdctl.recording import record_signoff

    inv = _load(inventory, state_dir)
    with _store_for(inv) as store:
        result = record_signoff(inv, store, backend, by, note)
    if json_:
        _print_json(result.model_dump(mode="json"))
    else:
        out.print(
            f"recorded sign-off {result.id[:12]} for {backend}: {result.reasons[0]}", markup=False
        )


def err_print(message: str) -> None:
    sys.stderr.write(message + "\n")


def _print_lines(lines: list[str]) -> None:
    # Whole lines, as print writes them: a path or URL broken across lines cannot be pasted.
    for line in lines:
        out.print(line, markup=False, soft_wrap=True)


def _store_for(inv: LoadedInventory) -> EvidenceStore:
    from kdctl.evidence import open_store

    return open_store(inv)


def _store(inventory: Path | None, state_dir: Path | None) -> EvidenceStore:
    return _store_for(_load(inventory, state_dir, engines=False))


@evidence_app.command("list")
def evidence_list(
    inventory: InventoryOpt = None,
    state_dir: StateDirOpt = None,
    json_: JsonOpt = False,
    gate: Annotated[str | None, typer.Option("--gate")] = None,
    backend: Annotated[str | None, typer.Option("--backend")] = None,
    limit: Annotated[int, typer.Option("--limit", min=1)] = 50,
) -> None:
    """Gate results, newest first."""
    from kdctl.tables import evidence_table

    with _store(inventory, state_dir) as store:
        results = store.results(gate=gate, backend=backend, limit=limit)
    if json_:
        _print_json({"results": [r.model_dump(mode="json") for r in results]})
    else:
        out.print(evidence_table(results))


@evidence_app.command("show")
def evidence_show(
    result_id: Annotated[str, typer.Argument(help="A result id, or an unambiguous prefix.")],
    inventory: InventoryOpt = None,
    state_dir: StateDirOpt = None,
    json_: JsonOpt = False,
) -> None:
    """One gate result, whole."""
    from kdctl.errors import InputError
    from kdctl.tables import evidence_detail

    with _store(inventory, state_dir) as store:
        result = store.get(result_id)
    if result is None:
        raise InputError(f"no result with id {result_id!r}")
    if json_:
        _print_json(result)
    else:
        out.print(evidence_detail(result))


@evidence_app.command("export")
def evidence_export(
    inventory: InventoryOpt = None,
    state_dir: StateDirOpt = None,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="File to write [default: stdout].")
    ] = None,
    gate: Annotated[str | None, typer.Option("--gate")] = None,
    backend: Annotated[str | None, typer.Option("--backend")] = None,
) -> None:
    """Results and baselines as one JSON file with a digest, to import on another machine."""
    from kdctl.evidence import export_evidence

    with _store(inventory, state_dir) as store:
        doc = export_evidence(store, gate=gate, backend=backend)
    if output is None:
        sys.stdout.write(doc.text())
        return
    doc.write(output)
    sys.stderr.write(
        f"exported {len(doc.results)} result(s) and {len(doc.baselines)} baseline(s) to {output}\n"
    )


@evidence_app.command("import")
def evidence_import(
    file: Annotated[Path, typer.Argument(help="A file `kdctl evidence export` wrote.")],
    inventory: InventoryOpt = None,
    state_dir: StateDirOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Add an export's results and baselines, all or none; a changed file is refused. Without
    KDCTL_EVIDENCE_KEY the file is only checked for damage and is imported as unsigned."""
    from kdctl.evidence import import_evidence
    from kdctl.tables import imported_line

    inv = _load(inventory, state_dir, engines=False)
    with _store_for(inv) as store:
        done = import_evidence(store, file, require_signed=inv.spec.evidence.require_signed)
    if json_:
        _print_json({"file": str(file)} | done.model_dump())
        return
    _print_lines([imported_line(file, done)])


@evidence_app.command("migrate")
def evidence_migrate(
    to: Annotated[
        str, typer.Option("--to", help="postgresql://USER@HOST[:PORT]/DATABASE to copy into.")
    ],
    inventory: InventoryOpt = None,
    state_dir: StateDirOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Copy this inventory's store (SQLite by default) into a PostgreSQL store, in one
    transaction, verified by counts and a digest of every record. The password comes from the
    inventory's evidence.password_env / password_file, or PGPASSWORD / PGPASSFILE."""
    from kdctl.evidence import migrate, open_url

    inv = _load(inventory, state_dir, engines=False)
    with _store_for(inv) as source, open_url(to, password=inv.evidence_password()) as target:
        done = migrate(source, target)
    if json_:
        _print_json(done)
    else:
        _print_lines(
            [
                f"copied {done.results} result(s) and {done.baselines} baseline(s) from "
                f"{done.source} to {done.target} ({done.added} added, {done.already_present} "
                f"already there); verified: digest {done.digest[:16]}"
            ]
        )


SandboxDirOpt = Annotated[
    Path, typer.Option("--dir", help="The sandbox's folder: models, pidfiles, logs, state.")
]


def _sandbox_out(st: SandboxStatus, json_: bool) -> None:
    from kdctl.tables import sandbox_lines

    if json_:
        _print_json(st.model_dump(mode="json") | {"up": st.up})
    else:
        _print_lines(sandbox_lines(st))


@sandbox_app.command("up")
def sandbox_up(
    dir_: SandboxDirOpt = Path("sandbox"),
    router: Annotated[
        Literal["auto", "nginx", "sglang-router"],
        typer.Option("--router", help="auto: nginx when installed, else sglang-router."),
    ] = "auto",
    baseline: Annotated[
        Literal["reference", "sglang"] | None,
        typer.Option(
            "--baseline",
            help="What serves as baseline: kdctl's reference server, or SGLang itself (its CPU "
            "build, from scripts/bootstrap-sglang). [default: reference; a sandbox already up "
            "keeps its own]",
        ),
    ] = None,
    port_offset: Annotated[
        int | None,
        typer.Option(
            "--port-offset",
            help="Added to every port the sandbox binds (front :8000, engines :30000, :31000, "
            ":31001, :31002). [default: 0; a sandbox already up keeps its own]",
        ),
    ] = None,
    json_: JsonOpt = False,
) -> None:
    """Make the models and start the engines and the router, reusing whatever already runs."""
    from kdctl.sandbox import up
    from kdctl.tables import progress_bars

    with progress_bars(err, not json_) as progress:
        st = up(
            dir_,
            router_choice=router,
            baseline=baseline,
            port_offset=port_offset,
            progress=progress,
        )
    _sandbox_out(st, json_)


@sandbox_app.command("history")
def sandbox_history(dir_: SandboxDirOpt = Path("sandbox"), json_: JsonOpt = False) -> None:
    """Measure the INT4 engine's earlier builds and the one it serves, dated a week apart,
    so status and phases forecast from a real history (once; then it lists them)."""
    from kdctl.sandbox import record_history
    from kdctl.tables import history_lines, progress_bars

    with progress_bars(err, not json_) as progress:
        points = record_history(dir_, progress=progress)
    if json_:
        _print_json({"history": [p.model_dump(mode="json") for p in points]})
    else:
        _print_lines(history_lines(points))


@sandbox_app.command("status")
def sandbox_status(dir_: SandboxDirOpt = Path("sandbox"), json_: JsonOpt = False) -> None:
    """Which of the sandbox's processes run. Exit 1 when any is stopped."""
    from kdctl.sandbox import status

    st = status(dir_)
    _sandbox_out(st, json_)
    if not st.up:
        raise typer.Exit(1)


@sandbox_app.command("down")
def sandbox_down(dir_: SandboxDirOpt = Path("sandbox"), json_: JsonOpt = False) -> None:
    """Stop everything `sandbox up` started, by its pidfiles."""
    from kdctl.sandbox import down

    _sandbox_out(down(dir_), json_)


@reference_app.command("make-model")
def reference_make_model(
    out_dir: Annotated[Path, typer.Option("--out", help="Folder to write the model into.")],
    arch: Annotated[
        Literal["deepseek_v3", "llama"], typer.Option("--arch", help="deepseek_v3 is Kimi K2's.")
    ] = "deepseek_v3",
    train_steps: Annotated[int, typer.Option("--train-steps", min=0)] = 300,
    quantize: Annotated[
        Literal["w4a16"] | None,
        typer.Option("--quantize", help="w4a16: INT4 per-group weights, dequantized."),
    ] = None,
    group_size: Annotated[int, typer.Option("--group-size", min=1)] = 32,
    from_model: Annotated[
        Path | None, typer.Option("--from", help="Quantize this model instead of making one.")
    ] = None,
    size: Annotated[
        Literal["tiny", "large"],
        typer.Option(
            "--size",
            help="tiny (CPU, seconds) or large (deepseek_v3 of about 1.5B parameters, for a GPU).",
        ),
    ] = "tiny",
    device: Annotated[
        str, typer.Option("--device", help="Where the weights are made and trained: cpu, cuda.")
    ] = "cpu",
    set_: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            metavar="FIELD=VALUE",
            help="A config field to change, after --size (repeatable): hidden_size=512.",
        ),
    ] = None,
    json_: JsonOpt = False,
) -> None:
    """Write a model with a locally trained tokenizer; the same arguments, the same bytes (on
    the CPU)."""
    from kdctl.backends.reference.model import make_sized_model

    report = make_sized_model(
        arch,
        out_dir,
        size=size,
        settings=set_ or (),
        device=device,
        train_steps=train_steps,
        quantize=quantize,
        group_size=group_size,
        from_model=from_model,
    )
    if json_:
        _print_json(report.document())
    else:
        _print_lines([report.describe()])


@reference_app.command("serve")
def reference_serve(
    model: Annotated[Path, typer.Option("--model", help="A model folder (make-model's output).")],
    port: Annotated[int, typer.Option("--port", min=1, max=65535)] = 30000,
    host: Annotated[str, typer.Option("--host")] = "127.0.0.1",
    served_model_name: Annotated[str | None, typer.Option("--served-model-name")] = None,
    api_key_env: Annotated[
        str | None, typer.Option("--api-key-env", help="Variable holding the API key to require.")
    ] = None,
    device: Annotated[str, typer.Option("--device")] = "cpu",
    dtype: Annotated[Literal["float32", "bfloat16", "float16"], typer.Option("--dtype")] = (
        "float32"
    ),
    draft_model: Annotated[
        Path | None,
        typer.Option(
            "--draft-model",
            help="Decode speculatively: a smaller model of the same tokenizer drafts, --model "
            "verifies (greedy requests).",
        ),
    ] = None,
    draft_tokens: Annotated[
        int, typer.Option("--draft-tokens", min=1, help="Tokens drafted per verification.")
    ] = 4,
    sglang_version: Annotated[
        str | None,
        typer.Option(
            "--sglang-version",
            help="Answer in this SGLang release's shape (0.4.3, 0.4.10, 0.5.1, 0.5.6, 0.5.23, "
            "0.5.23-incremental; unset, 0.5.6).",
        ),
    ] = None,
) -> None:
    """Serve a reference model behind SGLang's HTTP API (503 until it is loaded)."""
    from kdctl.backends.reference.server import serve

    serve(
        model,
        host=host,
        port=port,
        served_name=served_model_name,
        api_key_env=api_key_env,
        device=device,
        dtype=dtype,
        draft=draft_model,
        draft_tokens=draft_tokens,
        sglang_version=sglang_version,
    )


@reference_app.command("batch")
def reference_batch(
    model: Annotated[Path, typer.Option("--model", help="A model folder.")],
    request: Annotated[Path, typer.Option("--request", help="The contract's request file.")],
    response: Annotated[Path, typer.Option("--response", help="Where to write the response.")],
    draft_model: Annotated[
        Path | None, typer.Option("--draft-model", help="Decode speculatively with this draft.")
    ] = None,
    draft_tokens: Annotated[int, typer.Option("--draft-tokens", min=1)] = 4,
) -> None:
    """Answer a native-engine contract request file with the reference model."""
    from kdctl.backends.reference.batch import run_contract

    raise typer.Exit(
        run_contract(model, request, response, draft=draft_model, draft_tokens=draft_tokens)
    )


@functools.cache
def command() -> Callable[[], Any]:
    """The click command typer makes of `app`, made once per process: making it evaluates
    every option's annotations (50 ms), which forks of a process that made it (the test
    suite's warm CLI server) then skip."""
    return typer.main.get_command(app)


def main() -> None:
    from kdctl._redact import ScrubbingStream

    global out, err
    out, err = _consoles()
    # Whatever kdctl prints passes a scrubber: an engine's log quoted in an error, a result's
    # reasons, a table. Consoles are built on these streams below.
    sys.stdout = out.file = cast(TextIO, ScrubbingStream(sys.stdout))
    sys.stderr = err.file = cast(TextIO, ScrubbingStream(sys.stderr))
    try:
        command()()
    except KdctlError as exc:
        # Unwrapped, one problem a line, so editors and CI logs can jump to FILE:LINE.
        sys.stderr.write(f"{exc}\n")
        sys.exit(exc.exit_code)
