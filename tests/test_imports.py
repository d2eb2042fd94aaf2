"""The package's import graph has no cycle, and the layers import only downward.

The graph is built from the source with ``ast`` (every ``import`` statement, module-level or inside a function), so
an import hidden in a function body, which Python tolerates until the day the import order changes, counts too.
Importing ``lightning_gradcomp.a.b`` runs ``lightning_gradcomp/a/__init__.py`` first, so such an import is also an
edge to the package ``a`` (unless the importing module is itself inside ``a``: that package is then already being
imported). The root package is left out: every module is inside it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "lightning_gradcomp"
PACKAGE = "lightning_gradcomp"


def _modules(root: Path = ROOT) -> dict[str, Path]:
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = [PACKAGE, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _is_package(name: str, modules: dict[str, Path]) -> bool:
    return modules[name].name == "__init__.py"


def _targets(name: str, node: ast.AST, modules: dict[str, Path]) -> set[str]:
    """The package modules an import statement in module ``name`` loads."""
    imported: list[str] = []
    if isinstance(node, ast.Import):
        imported = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative: resolved against the importing module's package
            package = name if _is_package(name, modules) else name.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{base}" if base else package
        imported = [base] + [f"{base}.{alias.name}" for alias in node.names]
    targets = set()
    for full in imported:
        if full != PACKAGE and not full.startswith(PACKAGE + "."):
            continue
        parts = full.split(".")
        for i in range(2, len(parts) + 1):  # every enclosing package's __init__ runs first
            prefix = ".".join(parts[:i])
            if prefix in modules and not (name == prefix or name.startswith(prefix + ".")):
                targets.add(prefix)
    return targets


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """``module -> modules of the package it imports`` for every module under ``root``."""
    modules = _modules(root)
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        graph[name] = set().union(*(_targets(name, node, modules) for node in ast.walk(tree))) - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of modules (first == last), or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_the_package_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


#: lower layers that must not import the named higher ones (the strategy sits below its callbacks and transforms)
FORBIDDEN = {
    "lightning_gradcomp.strategy": ("lightning_gradcomp.callbacks", "lightning_gradcomp.transforms"),
    "lightning_gradcomp.transforms": ("lightning_gradcomp.callbacks",),
    "lightning_gradcomp.compressors": (
        "lightning_gradcomp.strategy", "lightning_gradcomp.callbacks", "lightning_gradcomp.transforms",
    ),
    "lightning_gradcomp.hook": ("lightning_gradcomp.strategy", "lightning_gradcomp.callbacks"),
    # the payload layer knows no process group; the process groups know no compressor, hook or strategy
    "lightning_gradcomp.comm": ("lightning_gradcomp.process_groups", "lightning_gradcomp.hook"),
    "lightning_gradcomp.process_groups": (
        "lightning_gradcomp.compressors", "lightning_gradcomp.hook", "lightning_gradcomp.strategy",
        "lightning_gradcomp.callbacks",
    ),
    # AutoCompression's model, measurements and reports sit below the callback that drives them
    "lightning_gradcomp.auto": ("lightning_gradcomp.strategy", "lightning_gradcomp.callbacks"),
    "lightning_gradcomp.model_transform": ("lightning_gradcomp.strategy", "lightning_gradcomp.callbacks"),
    "lightning_gradcomp.monitor": ("lightning_gradcomp.strategy", "lightning_gradcomp.callbacks"),
    # the two levels' process groups and averages know nothing of the outer state or the strategy
    "lightning_gradcomp.replica_groups": (
        "lightning_gradcomp.outer", "lightning_gradcomp.diloco", "lightning_gradcomp.strategy",
    ),
    "lightning_gradcomp.outer_monitor": (
        "lightning_gradcomp.diloco", "lightning_gradcomp.strategy", "lightning_gradcomp.callbacks",
    ),
    # per-rank files beside a checkpoint serve every strategy: they know none of them
    "lightning_gradcomp.rank_state": (
        "lightning_gradcomp.strategy", "lightning_gradcomp.hook", "lightning_gradcomp.compressors",
        "lightning_gradcomp.callbacks", "lightning_gradcomp.compression_checkpoint",
        "lightning_gradcomp.diloco_checkpoint",
    ),
    "lightning_gradcomp.compression_checkpoint": ("lightning_gradcomp.strategy", "lightning_gradcomp.callbacks"),
    "lightning_gradcomp.diloco_checkpoint": ("lightning_gradcomp.diloco", "lightning_gradcomp.callbacks"),
    # the fused optimizers know nothing of the hook or the strategy: the hook calls them through a callable
    "lightning_gradcomp.fused_optim": (
        "lightning_gradcomp.strategy", "lightning_gradcomp.hook", "lightning_gradcomp.callbacks",
    ),
}  # fmt: skip


@pytest.mark.parametrize("lower", sorted(FORBIDDEN))
def test_layers_import_only_downward(lower):
    graph = import_graph()
    offenders = [
        (module, target)
        for module, targets in graph.items()
        if module == lower or module.startswith(lower + ".")
        for target in targets
        for higher in FORBIDDEN[lower]
        if target == higher or target.startswith(higher + ".")
    ]
    assert not offenders, f"{lower} imports upward: {offenders}"


def test_the_cycle_finder_sees_a_function_level_import_cycle(tmp_path):
    """The check itself: a cycle closed by an import inside a function body is found."""
    package = tmp_path / PACKAGE
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from lightning_gradcomp.sub.b import thing\n")
    (package / "sub" / "__init__.py").write_text("from lightning_gradcomp.sub.b import thing\n")
    (package / "sub" / "b.py").write_text("def thing():\n    from lightning_gradcomp import a\n    return a\n")
    cycle = find_cycle(import_graph(package))
    assert cycle is not None
    assert {"lightning_gradcomp.a", "lightning_gradcomp.sub.b"} <= set(cycle)
    (package / "sub" / "b.py").write_text("def thing():\n    return 1\n")
    assert find_cycle(import_graph(package)) is None
