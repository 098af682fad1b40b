"""The command line: parses arguments, calls the library, prints. No logic lives here."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import BaseModel
from rich.console import Console

from kdctl import __version__
from kdctl.errors import KdctlError

app = typer.Typer(
    name="kdctl",
    help="Readiness gates, phases and gated cutover between LLM inference engines.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
inventory_app = typer.Typer(help="Validate and summarise the inventory.", no_args_is_help=True)
app.add_typer(inventory_app, name="inventory")

# Piped output (CI logs, `| less`) gets full-width tables instead of rich's 80 columns.
out = Console(
    highlight=False,
    width=None if sys.stdout.isatty() else int(os.environ.get("COLUMNS") or 200),
)

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


def _load(inventory: Path | None, state_dir: Path | None) -> Any:
    from kdctl.inventory import load_inventory, resolve_inventory_path

    return load_inventory(resolve_inventory_path(inventory), state_dir=state_dir)


def _print_json(doc: BaseModel | dict[str, Any]) -> None:
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
    timeout: Annotated[
        float, typer.Option("--timeout", min=0.1, help="Deadline per host and backend, seconds.")
    ] = 20.0,
) -> None:
    """Hosts, GPUs and backends as live probes see them. Exit 3 when a host is unreachable."""
    from kdctl.render import status_tables
    from kdctl.status import collect_status

    report = collect_status(_load(inventory, state_dir), deadline_s=timeout)
    if json_:
        _print_json(report)
    else:
        out.print(status_tables(report))
    if report.unreachable:
        if not json_:
            sys.stderr.write(f"unreachable: {', '.join(report.unreachable)}\n")
        raise typer.Exit(3)


@inventory_app.command("check")
def inventory_check(
    inventory: InventoryOpt = None, state_dir: StateDirOpt = None, json_: JsonOpt = False
) -> None:
    """Validate the inventory (exit 2 naming file, line and field) and summarise it."""
    from kdctl.render import inventory_summary

    inv = _load(inventory, state_dir)
    if json_:
        _print_json(
            {
                "inventory": str(inv.path),
                "valid": True,
                "state_dir": str(inv.state_dir),
                "spec": inv.spec.model_dump(mode="json"),
            }
        )
    else:
        out.print(inventory_summary(inv))


def main() -> None:
    try:
        app()
    except KdctlError as exc:
        # Unwrapped, one problem a line, so editors and CI logs can jump to FILE:LINE.
        sys.stderr.write(f"{exc}\n")
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        sys.stderr.write("kdctl: interrupted\n")
        sys.exit(130)
