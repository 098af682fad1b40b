"""YAML loading that remembers where every value came from, so errors can name the line."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kdctl._limits import MAX_CONFIG_BYTES, MAX_DEPTH, check_size, check_yaml_nodes
from kdctl.errors import InputError

Loc = tuple[str | int, ...]


@dataclass(frozen=True)
class Document:
    """A parsed YAML document and its node tree, for mapping a field path back to a line."""

    data: Any
    root: yaml.Node | None
    source: str

    def line_of(self, loc: Loc) -> int | None:
        """The 1-based line of the deepest node on `loc` that exists in the file."""
        node = self.root
        if node is None:
            return None
        line = node.start_mark.line + 1
        for part in loc:
            child = _child(node, part)
            if child is None:
                break
            node = child
            line = node.start_mark.line + 1
        return line


def _child(node: yaml.Node, part: str | int) -> yaml.Node | None:
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode) and key.value == str(part):
                return value  # type: ignore[no-any-return]
    elif (
        isinstance(node, yaml.SequenceNode)
        and isinstance(part, int)
        and 0 <= part < len(node.value)
    ):
        return node.value[part]  # type: ignore[no-any-return]
    return None


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys: PyYAML keeps the last one silently."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise InputError(
                    f"{self.name}:{line}: duplicate key {key!r} (first defined on line {seen[key]})"
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


# libyaml's parser where PyYAML was built with it: the depth scan below reads every event.
_EVENTS_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _check_depth(text: str, source: str) -> None:
    """Nesting counted on the parser's events, before any node is composed: PyYAML's composer
    recurses once a level, so a document nested past the interpreter's stack (a thousand
    `[`) would end in RecursionError there, before the node checks see it."""
    depth = 0
    for event in yaml.parse(text, Loader=_EVENTS_LOADER):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                line = event.start_mark.line + 1 if event.start_mark else 1
                raise InputError(f"{source}:{line}: nested more than {MAX_DEPTH} levels deep")
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1


def parse(text: str, source: str) -> Document:
    """Parse one YAML document; syntax errors become InputError naming file, line and column."""
    check_size(len(text.encode()), MAX_CONFIG_BYTES, source)
    try:
        _check_depth(text, source)
        loader = _StrictLoader(text)
        loader.name = source
        try:
            root = loader.get_single_node()
            # Before construction: a tree of nested aliases is refused before anything walks it.
            check_yaml_nodes(root, source)
            data = loader.construct_document(root) if root is not None else None
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        raise InputError(f"{where}: invalid YAML: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise InputError(f"{source}: invalid YAML: {exc}") from None
    return Document(data=data, root=root, source=source)


def read_mapping(path: Path, what: str, shape: str) -> Document:
    """Read and parse a YAML file that must hold one mapping; errors name the file (and the
    line): `what` is the kind of file, `shape` what its top level must hold."""
    source = str(path)
    try:
        check_size(path.stat().st_size, MAX_CONFIG_BYTES, source)
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{source}: no such {what} file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{source}: cannot read {what}: {exc}") from None
    doc = parse(text, source)
    if not isinstance(doc.data, dict):
        raise InputError(f"{source}:1: the {what} must be a mapping with {shape}")
    return doc
