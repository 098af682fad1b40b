"""Bounds on every YAML and JSON document kdctl reads, from files and from engines.

A few hundred bytes of nested YAML aliases expand to millions of nodes, and a deeply nested
JSON answer exhausts the parser's stack: each is refused with a message naming its source,
before anything walks the expanded tree.
"""

from __future__ import annotations

import json
from typing import Any

import yaml

from kdctl.errors import InputError

# Inventories and roadmaps are written by hand: a megabyte is far beyond any real one.
MAX_CONFIG_BYTES = 1 << 20
# Nodes after alias expansion, and nesting depth, for every document.
MAX_NODES = 200_000
MAX_DEPTH = 64


class TooLarge(InputError):
    pass


def check_size(size: int, limit: int, source: str) -> None:
    if size > limit:
        raise TooLarge(f"{source}: {size:,} bytes is more than the {limit:,} kdctl reads")


def check_yaml_nodes(root: yaml.Node | None, source: str) -> None:
    """Count the nodes the document expands to (an alias counts as everything it names, each
    time) and its depth, without expanding it: each distinct node is sized once."""
    if root is None:
        return
    sizes: dict[int, int] = {}
    on_path: set[int] = set()

    def size(node: yaml.Node, depth: int) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if depth > MAX_DEPTH:
            raise TooLarge(
                f"{source}:{node.start_mark.line + 1}: nested more than {MAX_DEPTH} levels deep"
            )
        if key in on_path:
            raise TooLarge(f"{source}:{node.start_mark.line + 1}: an alias refers to itself")
        on_path.add(key)
        total = 1
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                total += size(k, depth + 1) + size(v, depth + 1)
        elif isinstance(node, yaml.SequenceNode):
            for item in node.value:
                total += size(item, depth + 1)
        on_path.discard(key)
        if total > MAX_NODES:
            raise TooLarge(
                f"{source}:{node.start_mark.line + 1}: expands to more than {MAX_NODES:,} "
                "values (nested aliases?); refusing it"
            )
        sizes[key] = total
        return total

    size(root, 0)


def check_depth(value: Any, source: str, limit: int = MAX_DEPTH) -> None:
    """JSON's nesting depth, walked without recursion."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            raise TooLarge(f"{source}: nested more than {limit} levels deep")
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)


def load_json(text: str | bytes, source: str, *, max_bytes: int) -> Any:
    """json.loads with a size and depth bound; InputError naming `source` otherwise."""
    check_size(len(text), max_bytes, source)
    try:
        value = json.loads(text)
    except RecursionError:
        raise TooLarge(f"{source}: nested more than {MAX_DEPTH} levels deep") from None
    check_depth(value, source)
    return value
