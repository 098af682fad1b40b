"""The layers data flows through (docs/architecture.md): no module imports one above it, not
even inside a function, and every module imports on its own."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

# Lowest first. A module may import its own layer and the ones before it.
LAYERS: list[tuple[str, ...]] = [
    (
        "kdctl",
        "kdctl.errors",
        "kdctl._limits",
        "kdctl._redact",
        "kdctl._statefile",
        "kdctl._plugins",
    ),
    ("kdctl.inventory",),
    # What a gate decides and evidence keeps: GateResult, Baseline, Metric, Provenance.
    ("kdctl.records",),
    ("kdctl.transports",),
    ("kdctl.probes",),
    ("kdctl.backends",),
    ("kdctl.loadgen",),
    ("kdctl.checks",),
    ("kdctl.evidence",),
    # One command's connections and who each engine is, shared by everything above.
    ("kdctl.session",),
    ("kdctl.recording",),
    ("kdctl.roadmap",),
    # `kdctl init`: what a host shows, its engines asked, written as an inventory.
    ("kdctl.inventory_init",),
    # What a router holds now, read back, and the journal: read by the answers below.
    (
        "kdctl.traffic",
        "kdctl.traffic._router",
        "kdctl.traffic.nginx",
        "kdctl.traffic.sglang_router",
        "kdctl.traffic.routers",
        "kdctl.traffic.journal",
    ),
    ("kdctl.serving",),
    ("kdctl.readiness",),
    # Moving traffic consults the answers (the preflight).
    ("kdctl.cutover",),
    ("kdctl.status", "kdctl.tables", "kdctl.report", "kdctl.sandbox"),
    ("kdctl.cli", "kdctl.__main__"),
]
# Where each installed package lives in the checkout (pyproject's package-dir).
ROOTS = {
    "kdctl": REPO / "kdctl",
    "kdctl.backends": REPO / "backends",
    "kdctl.checks": REPO / "checks",
    "kdctl.roadmap": REPO / "roadmap",
}


def layer_of(module: str) -> int:
    """The layer of the longest name in LAYERS that `module` is, or is inside."""
    best, depth = -1, -1
    for i, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > depth:
                best, depth = i, len(name)
    if best < 0:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS and the docs")
    return best


def imported(source: str, module: str) -> list[tuple[int, str]]:
    """(line, module) for every kdctl import in the source, at any depth, relative ones
    resolved against `module`."""
    found = []
    package = module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("kdctl")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if base.startswith("kdctl"):
                found.append((node.lineno, base))
    return found


def upward(source: str, module: str) -> list[str]:
    mine = layer_of(module)
    return [
        f"{module}:{line} imports {target} (layer {layer_of(target)} above {mine})"
        for line, target in imported(source, module)
        if layer_of(target) > mine
    ]


def modules() -> list[tuple[str, Path]]:
    found = []
    for package, root in ROOTS.items():
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([package, *parts])
            inner = any(name.startswith(p + ".") for p in ROOTS if p != package and p != "kdctl")
            if package == "kdctl" and inner:
                continue
            found.append((name, path))
    return found


def test_no_module_imports_a_layer_above_its_own() -> None:
    problems = [p for name, path in modules() for p in upward(path.read_text(), name)]
    assert problems == [], "\n".join(problems)


def private_crossings(source: str, module: str) -> list[str]:
    """Imports, at any depth, of a private module (`_name`) of a package `module` is not in:
    another package reaches it only through that package's public names."""
    found = []
    for line, target in imported(source, module):
        parts = target.split(".")
        for i, part in enumerate(parts):
            if part.startswith("_") and not part.startswith("__"):
                owner = ".".join(parts[:i])
                if module != owner and not module.startswith(owner + "."):
                    found.append(f"{module}:{line} imports {target}, private to {owner}")
                break
    return found


def test_no_module_imports_another_packages_private_module() -> None:
    problems = [p for name, path in modules() for p in private_crossings(path.read_text(), name)]
    assert problems == [], "\n".join(problems)
    planted = "def f():\n    from kdctl.evidence._freshness import age_text\n"
    assert private_crossings(planted, "kdctl.readiness") == [
        "kdctl.readiness:2 imports kdctl.evidence._freshness, private to kdctl.evidence"
    ]
    # Inside its own package, a private module is the package's own business.
    assert private_crossings(planted, "kdctl.evidence.store") == []


def circles(sources: dict[str, str]) -> list[list[str]]:
    """The import circles among these modules (name: source), imports inside functions
    included: an import of a package's name counts as one of the package itself."""
    graph: dict[str, set[str]] = {}
    for name, source in sources.items():
        deps = set()
        for _, target in imported(source, name):
            while target and target not in sources:
                target = target.rpartition(".")[0]
            if target and target != name:
                deps.add(target)
        graph[name] = deps
    found, done = [], set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            found.append(path[path.index(node) :])
            return
        if node in done:
            return
        for dep in sorted(graph[node]):
            visit(dep, [*path, node])
        done.add(node)

    for name in sorted(graph):
        visit(name, [])
    return found


def test_no_import_circle_function_local_imports_included() -> None:
    assert circles({name: path.read_text() for name, path in modules()}) == []
    planted = {
        "kdctl.backends._base": "def f():\n    from kdctl.backends.sglang import X\n",
        "kdctl.backends.sglang": "from kdctl.backends._base import Backend\n",
    }
    assert circles(planted) == [["kdctl.backends._base", "kdctl.backends.sglang"]]


def test_a_planted_upward_import_is_caught() -> None:
    planted = "def f():\n    from kdctl.readiness import assess\n    return assess\n"
    readiness, evidence = layer_of("kdctl.readiness"), layer_of("kdctl.evidence.store")
    traffic = layer_of("kdctl.traffic.journal")
    assert upward(planted, "kdctl.evidence.store") == [
        f"kdctl.evidence.store:2 imports kdctl.readiness (layer {readiness} above {evidence})"
    ]
    assert upward("from ..readiness import assess\n", "kdctl.traffic.journal") == [
        f"kdctl.traffic.journal:1 imports kdctl.readiness (layer {readiness} above {traffic})"
    ]


IMPORT_EACH = """
import importlib, sys, traceback
failed = []
for name in sys.argv[1:]:
    # kdctl's own modules forgotten before each: every module is imported first, in the
    # order its own imports give; third-party modules stay loaded, they are not under test.
    for loaded in [m for m in sys.modules if m == "kdctl" or m.startswith("kdctl.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception:
        failed.append(name + ": " + traceback.format_exc(limit=3))
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_module_imports_on_its_own() -> None:
    """No circle held together by import order: each module imported first, on its own."""
    import subprocess
    import sys

    # __main__ runs the CLI when imported.
    names = [n for n, _ in modules() if not n.endswith("__main__")]
    run = subprocess.run(
        [sys.executable, "-c", IMPORT_EACH, *names], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
