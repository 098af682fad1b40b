"""The documentation against the code it describes, so neither drifts from the other: links
resolve, the CLI reference names real commands and options (and all of them), the inventory
reference names every field of the pydantic models and no other, every gate has its heading,
the JSON reference lists the keys the documents carry, README.md stays short, and every
example on every page is real: each `kdctl` line (fenced or inline) names commands and options
the CLI has, and each YAML example validates as what it is an example of. (The shell wrapper in
roadmap/README.md is run by tests/test_phases.py.) Nothing here starts a server; each check is
shown failing on a planted mistake too."""

from __future__ import annotations

import re
import textwrap
import types
import typing
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any

import pytest
import typer
import yaml
from pydantic import BaseModel, ValidationError

import kdctl.cli
from kdctl.checks import gates
from kdctl.inventory.models import Inventory

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
README = REPO / "README.md"
CLI_MD = DOCS / "reference" / "cli.md"
INVENTORY_MD = DOCS / "reference" / "inventory.md"
GATES_MD = DOCS / "reference" / "gates.md"
JSON_MD = DOCS / "reference" / "json.md"
README_MAX_LINES = 160

_FENCE = re.compile(r"^(```|~~~)")


def pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def every_page() -> list[Path]:
    """Every page a reader meets, the contributors' and the roadmap folder's too."""
    return [*pages(), REPO / "CONTRIBUTING.md", REPO / "roadmap" / "README.md"]


def prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans: where links are links."""
    kept, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            kept.append(line)
    return re.sub(r"`[^`\n]*`", "", "\n".join(kept))


def fenced_blocks(text: str) -> list[str]:
    blocks, current, fenced = [], [], False
    for line in text.splitlines():
        if _FENCE.match(line.lstrip()):
            if fenced:
                blocks.append("\n".join(current))
                current = []
            fenced = not fenced
            continue
        if fenced:
            current.append(line)
    return blocks


# [text](target) and [text](target "title"); the text may run over a line break.
_LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)", re.M)


def relative_links(text: str) -> list[str]:
    found = _LINK.findall(prose(text)) + _REFERENCE.findall(prose(text))
    return [t for t in found if not re.match(r"^[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def broken_links(page: Path) -> list[str]:
    """Every relative link of `page` whose file (its #fragment aside) does not exist."""
    broken = []
    for target in relative_links(page.read_text(encoding="utf-8")):
        path = target.split("#", 1)[0].split("?", 1)[0]
        if not (page.parent / path).exists():
            broken.append(target)
    return broken


# --- the command line ------------------------------------------------------------------------


def cli_root() -> Any:
    return typer.main.get_command(kdctl.cli.app)


def subcommands(cmd: Any) -> Mapping[str, Any]:
    return getattr(cmd, "commands", None) or {}


def walk(cmd: Any, path: tuple[str, ...] = ("kdctl",)) -> Iterator[tuple[tuple[str, ...], Any]]:
    yield path, cmd
    for name, sub in subcommands(cmd).items():
        yield from walk(sub, (*path, name))


def options_of(cmd: Any) -> set[str]:
    """Every spelling of every option the command takes, --help included."""
    names = {"--help"}
    for param in cmd.params:
        if param.param_type_name == "option" and not getattr(param, "hidden", False):
            names.update(param.opts)
            names.update(param.secondary_opts)
    return names


def command_lines(text: str) -> list[str]:
    """The `kdctl ...` lines of the fenced blocks, a line ending in a backslash joined to the
    next, a `$ ` prompt dropped."""
    lines = []
    for block in fenced_blocks(text):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.strip().removeprefix("$ ")
            if line.startswith("kdctl ") or line == "kdctl":
                lines.append(line)
    return lines


def parse_command_line(root: Any, line: str) -> tuple[tuple[str, ...], Any, list[str], list[str]]:
    """(the command's path, the command, the options the line shows, problems)."""
    words = line.replace("|", " | ").split()[1:]
    cmd, path, problems = root, ("kdctl",), []
    while words and subcommands(cmd) and not words[0].startswith(("-", "[", "(")):
        name = words.pop(0)
        if name.isupper():  # a placeholder: `kdctl COMMAND --help`
            return path, None, [], problems
        if name not in subcommands(cmd):
            problems.append(f"`{line}`: {' '.join(path)} has no command {name!r}")
            return path, None, [], problems
        cmd, path = subcommands(cmd)[name], (*path, name)
    shown = []
    for word in words:
        word = word.strip("[]()")
        if re.match(r"^--?[A-Za-z]", word):
            shown.append(word.split("=", 1)[0])
    return path, cmd, shown, problems


def inline_commands(text: str) -> list[str]:
    """The `kdctl ...` code spans of the prose: examples as much as the fenced ones."""
    return re.findall(r"`(kdctl(?: [^`\n]*)?)`", text)


def cli_problems(
    text: str, root: Any, *, inline: bool = False
) -> tuple[list[str], set[tuple[str, ...]]]:
    """What the lines of `text` show that the CLI does not have, and the commands they show;
    with `inline`, its code spans' too."""
    problems: list[str] = []
    seen: set[tuple[str, ...]] = set()
    for line in command_lines(text) + (inline_commands(text) if inline else []):
        path, cmd, shown, wrong = parse_command_line(root, line)
        problems += wrong
        if cmd is None:
            continue
        seen.add(path)
        known = options_of(cmd)
        problems += [
            f"`{line}`: {' '.join(path)} has no option {opt}" for opt in shown if opt not in known
        ]
    return problems, seen


def undocumented_cli(text: str, root: Any) -> list[str]:
    """Commands with no usage line of their own, and options no usage line of theirs shows."""
    shown: dict[tuple[str, ...], set[str]] = {}
    for line in command_lines(text):
        path, cmd, options, _ = parse_command_line(root, line)
        if cmd is not None:
            shown.setdefault(path, set()).update(options)
    missing = []
    for path, cmd in walk(root):
        if subcommands(cmd) and len(path) > 1:
            continue  # a group (`kdctl gate`) is shown through its commands
        if path not in shown and (len(path) > 1 or options_of(cmd) != {"--help"}):
            missing.append(f"no usage line for {' '.join(path)}")
            continue
        for param in cmd.params:
            if param.param_type_name != "option" or getattr(param, "hidden", False):
                continue
            spellings = set(param.opts) | set(param.secondary_opts)
            if not spellings & shown.get(path, set()):
                missing.append(f"{' '.join(path)}: option {param.opts[0]} is not shown")
    return missing


# --- the inventory ---------------------------------------------------------------------------


def _models_in(tp: Any, keyed: bool = False) -> Iterator[tuple[type[BaseModel], bool]]:
    """The models a field's type holds, and whether each sits under a mapping's keys."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        yield tp, keyed
        return
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        yield from _models_in(args[0], keyed)
    elif origin in (dict, Mapping):
        yield from _models_in(args[1], True)
    elif origin in (typing.Union, types.UnionType, list, tuple, set, frozenset):
        for arg in args:
            yield from _models_in(arg, keyed)


def model_paths(model: type[BaseModel], prefix: str = "") -> set[str]:
    """Every field of `model` and of the models under it, dotted; a mapping's key is `<>`."""
    paths = set()
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        paths.add(path)
        for sub, keyed in _models_in(field.annotation):
            paths |= model_paths(sub, f"{path}.<>." if keyed else f"{path}.")
    return paths


_HEADING = re.compile(r"^(#{1,6})\s+(.*)$")
_PATH = re.compile(r"^[a-z_]+(?:\.(?:[a-z_]+|<[^>]*>))*$")


def _placeholders(path: str) -> str:
    return re.sub(r"<[^>]*>", "<>", path)


def sections(text: str) -> Iterator[tuple[str, str | None, list[list[list[str]]]]]:
    """(heading, the dotted path the heading names in backticks or None, the tables under it,
    each a list of rows of cells), outside fenced blocks."""
    heading, path, tables = "", None, []
    fenced, in_table = False, False
    for line in text.splitlines():
        if _FENCE.match(line.lstrip()):
            fenced, in_table = not fenced, False
            continue
        if fenced:
            continue
        m = _HEADING.match(line)
        if m:
            yield heading, path, tables
            heading, tables, in_table = m.group(2), [], False
            named = [t for t in re.findall(r"`([^`]+)`", heading) if _PATH.match(t)]
            path = _placeholders(named[0]) if named else None
        elif line.startswith("|"):
            if not in_table:
                tables.append([])
                in_table = True
            tables[-1].append([c.strip() for c in line.strip().strip("|").split("|")])
        else:
            in_table = False
    yield heading, path, tables


def table_keys(tables: list[list[list[str]]], header: str) -> list[str]:
    """The first column of the tables whose header's first cell is `header`, one backticked
    name a row."""
    keys = []
    for rows in tables:
        if not rows or rows[0][0] != header:
            continue
        for row in rows[1:]:
            if re.fullmatch(r":?-+:?", row[0]):
                continue
            m = re.fullmatch(r"`([^`]+)`", row[0])
            keys.append(m.group(1) if m else row[0])
    return keys


def documented_fields(text: str) -> set[str]:
    """The inventory fields a page documents: each heading's path (less a trailing key), and
    each `field` table row under it, prefixed by that path."""
    found = set()
    for _, path, tables in sections(text):
        if path is not None:
            found.add(re.sub(r"\.<>$", "", path))
        prefix = f"{path}." if path else ""
        found |= {f"{prefix}{key}" for key in table_keys(tables, "field")}
    return found


def inventory_problems(text: str) -> list[str]:
    expected = model_paths(Inventory)
    documented = documented_fields(text)
    return [f"documented, not in the models: {p}" for p in sorted(documented - expected)] + [
        f"in the models, not documented: {p}" for p in sorted(expected - documented)
    ]


# --- gates -----------------------------------------------------------------------------------


def builtin_gates() -> set[str]:
    """The gates kdctl registers itself; a plugin installed here documents its own."""
    return {n for n, cls in gates().items() if cls.__module__.startswith("kdctl.checks.")}


def gate_headings(text: str) -> set[str]:
    return {
        m.group(1)
        for heading, _, _ in sections(text)
        if (m := re.fullmatch(r"`([a-z][a-z0-9-]*)`", heading.strip()))
    }


def gate_problems(text: str, known: set[str]) -> list[str]:
    headed = gate_headings(text)
    return [f"no heading for gate {g}" for g in sorted(known - headed)] + [
        f"a heading for no gate: {g}" for g in sorted(headed - set(gates()))
    ]


# --- JSON documents --------------------------------------------------------------------------


def json_models() -> dict[str, tuple[type[BaseModel], set[str]]]:
    """Headings of json.md, and the model whose keys each table lists (with keys added)."""
    from kdctl.readiness import (
        Answers,
        CutoverAnswer,
        LatestVerdict,
        ServingAnswer,
    )
    from kdctl.recording import BaselineCoverage
    from kdctl.roadmap import CriterionStatus, PhaseReport, PhaseStatus
    from kdctl.status import BackendStatus, HostStatus, StatusReport, TrafficStatus

    return {
        "`kdctl status --json`": (StatusReport, set()),
        "`hosts[]`": (HostStatus, set()),
        "`backends[]`": (BackendStatus, set()),
        "`traffic`": (TrafficStatus, set()),
        "`gates[]`": (LatestVerdict, set()),
        "`baselines[]`": (BaselineCoverage, set()),
        "`kdctl phases --json`": (PhaseReport, {"answers"}),
        "`phases[]`": (PhaseStatus, set()),
        "`phases[].criteria[]`": (CriterionStatus, set()),
        "The `answers` object": (Answers, set()),
        "`answers.serving`": (ServingAnswer, set()),
        "`answers.cutover`": (CutoverAnswer, set()),
    }


def json_problems(text: str) -> list[str]:
    wanted = json_models()
    problems, seen = [], set()
    for heading, _, tables in sections(text):
        if heading not in wanted:
            continue
        seen.add(heading)
        model, extra = wanted[heading]
        keys = set(table_keys(tables, "key"))
        fields = set(model.model_fields) | extra
        problems += [f"{heading}: documents {k}, which it has not" for k in sorted(keys - fields)]
        problems += [f"{heading}: {k} is not documented" for k in sorted(fields - keys)]
    problems += [f"no section {h}" for h in sorted(set(wanted) - seen)]
    return problems


# --- README.md ------------------------------------------------------------------------------


def readme_problems(text: str) -> list[str]:
    lines = text.splitlines()
    problems = []
    if len(lines) > README_MAX_LINES:
        problems.append(f"README.md has {len(lines)} lines, over {README_MAX_LINES}")
    # CI runs the README's test command (.ci/run calls `make test`): it must still say so.
    if not re.search(r"^make test +# the test suite", text, re.M):
        problems.append("README.md no longer shows the test command, `make test`")
    return problems


# --- the checks on the real pages -----------------------------------------------------------


def test_every_relative_link_resolves() -> None:
    checked = [link for page in pages() for link in relative_links(page.read_text("utf-8"))]
    assert len(checked) >= 30, checked  # the pages do link to each other
    broken = [f"{page.relative_to(REPO)}: {t}" for page in pages() for t in broken_links(page)]
    assert broken == []


def test_the_cli_reference_shows_real_commands_and_options() -> None:
    root = cli_root()
    text = CLI_MD.read_text(encoding="utf-8")
    problems, seen = cli_problems(text, root)
    assert problems == []
    assert ("kdctl", "cutover") in seen and ("kdctl", "evidence", "migrate") in seen, seen


def test_the_cli_reference_shows_every_command_and_option() -> None:
    assert undocumented_cli(CLI_MD.read_text(encoding="utf-8"), cli_root()) == []


def test_the_inventory_reference_names_every_field_and_no_other() -> None:
    text = INVENTORY_MD.read_text(encoding="utf-8")
    assert "backends.<>.service.env.<>.from_env" in documented_fields(text)
    assert inventory_problems(text) == []


def test_every_gate_has_a_heading() -> None:
    known = builtin_gates()
    assert {"health", "exactness", "throughput", "promotion"} <= known
    assert gate_problems(GATES_MD.read_text(encoding="utf-8"), known) == []


def test_the_json_reference_lists_the_documents_keys() -> None:
    assert json_problems(JSON_MD.read_text(encoding="utf-8")) == []


def test_the_readme_stays_short() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) >= 40  # the README itself, not an empty file
    assert readme_problems(text) == []


# --- the examples ------------------------------------------------------------------------------

_YAML_BLOCK = re.compile(r"^```yaml\n(.*?)^```", re.S | re.M)
# A fragment names hosts it does not declare: the box every example runs on.
_EXAMPLE_HOSTS = {"hosts": {"ct200": {"address": "ct200.example.internal"}}}


def yaml_problems(text: str) -> tuple[list[str], int]:
    """Each YAML example validated by the model it is an example of: a roadmap (it has
    `phases`), a list of criteria, or an inventory or a part of one; the problems, and how many
    examples there were."""
    from kdctl.roadmap import Criterion, RoadmapSpec

    problems = []
    blocks = _YAML_BLOCK.findall(text)
    for block in blocks:
        data = yaml.safe_load(textwrap.dedent(block))
        try:
            if isinstance(data, list):
                for criterion in data:
                    Criterion.model_validate(criterion)
            elif "phases" in data:
                RoadmapSpec.model_validate(data)
            else:
                Inventory.model_validate({**_EXAMPLE_HOSTS, **data})
        except ValidationError as exc:
            first = block.strip().splitlines()[0]
            problems.append(f"the example starting {first!r}: {exc}")
    return problems, len(blocks)


def test_every_command_line_in_the_docs_is_real() -> None:
    root = cli_root()
    shown = 0
    for page in every_page():
        text = page.read_text(encoding="utf-8")
        shown += len(command_lines(text)) + len(inline_commands(text))
        problems, _ = cli_problems(text, root, inline=True)
        assert problems == [], page
    assert shown >= 60, shown


def test_every_yaml_example_is_valid() -> None:
    seen = 0
    for page in every_page():
        problems, count = yaml_problems(page.read_text(encoding="utf-8"))
        assert problems == [], page
        seen += count
    assert seen >= 8, seen


# --- each check fails on a planted mistake -------------------------------------------------


def test_a_link_to_a_missing_file_is_caught(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("x")
    page.write_text(
        "[ok](there.md#part) [gone](nowhere.md) [web](https://example.com) [top](#top)\n"
        "`[code](not-a-link.md)`\n```\n[fenced](not-either.md)\n```\n"
    )
    assert broken_links(page) == ["nowhere.md"]


def test_a_command_or_option_the_cli_lacks_is_caught() -> None:
    root = cli_root()
    text = (
        "```\nkdctl status --json --no-such-flag\nkdctl gate frobnicate\n"
        "kdctl cutover --to B \\\n    [--strategy canary] [--bogus]\n```\n"
    )
    problems, seen = cli_problems(text, root)
    assert len(problems) == 3, problems
    assert any("--no-such-flag" in p for p in problems)
    assert any("frobnicate" in p for p in problems)
    assert any("--bogus" in p for p in problems)
    assert ("kdctl", "status") in seen


def test_a_command_or_option_left_out_is_caught() -> None:
    root = cli_root()
    text = CLI_MD.read_text(encoding="utf-8")
    without_rollback = "\n".join(
        line for line in text.splitlines() if not line.startswith("kdctl rollback")
    )
    assert "no usage line for kdctl rollback" in undocumented_cli(without_rollback, root)
    without_deep = text.replace("[--deep] ", "")
    assert "kdctl status: option --deep is not shown" in undocumented_cli(without_deep, root)


def test_an_inventory_field_missing_or_invented_is_caught() -> None:
    text = INVENTORY_MD.read_text(encoding="utf-8")
    planted = re.sub(r"^\| `connect_timeout_s` .*\n", "", text, flags=re.M)
    planted += "\n## `router`\n\n| field | meaning |\n|---|---|\n| `weightz` | typo |\n"
    problems = inventory_problems(planted)
    assert "in the models, not documented: hosts.<>.connect_timeout_s" in problems
    assert "documented, not in the models: router.weightz" in problems


def test_a_gate_without_a_heading_is_caught() -> None:
    text = GATES_MD.read_text(encoding="utf-8").replace("## `tp-health`", "## TP health")
    assert gate_problems(text, builtin_gates()) == ["no heading for gate tp-health"]


def test_a_json_key_missing_or_invented_is_caught() -> None:
    text = JSON_MD.read_text(encoding="utf-8")
    planted = re.sub(r"^\| `rtt_ms` .*\n", "", text, flags=re.M)
    planted = planted.replace("| `reachable` |", "| `reachabel` |")
    problems = json_problems(planted)
    assert "`hosts[]`: rtt_ms is not documented" in problems
    assert "`hosts[]`: documents reachabel, which it has not" in problems


def test_a_long_readme_is_caught() -> None:
    text = README.read_text(encoding="utf-8")
    longer = text + "more\n" * (README_MAX_LINES + 1 - len(text.splitlines()))
    assert readme_problems(longer) == [
        f"README.md has {README_MAX_LINES + 1} lines, over {README_MAX_LINES}"
    ]
    assert readme_problems(text.replace("make test ", "make check ")) == [
        "README.md no longer shows the test command, `make test`"
    ]


def test_an_invalid_yaml_example_is_caught() -> None:
    page = (
        "```yaml\nbackends:\n  native: {kind: native, host: ct200, urll: http://x:1}\n```\n"
        "```yaml\nphases:\n  - {id: a, title: A, criteria: [{gate: health, require: 3}]}\n```\n"
        "```yaml\n- {gate: throughput, settings: {mode: offline-batch}, requires: {}}\n```\n"
    )
    problems, count = yaml_problems(page)
    assert count == 3 and len(problems) == 3, problems
    assert "urll" in problems[0] and "require" in problems[1] and "requires" in problems[2]


def test_a_command_line_with_an_unknown_option_in_any_page_is_caught() -> None:
    problems, _ = cli_problems("```\n$ kdctl phases --run --fast\n```\n", cli_root())
    assert problems == ["`kdctl phases --run --fast`: kdctl phases has no option --fast"]
