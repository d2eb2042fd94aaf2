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


#: The layers, by folder: what each folder of the package may import from the package besides itself. The engine is
#: torch only and knows no compressor; the compressors know the engine; the two strategies know both and the shared
#: Lightning runtime, never each other; fault tolerance (ft: torchft's manager, the lighthouse) knows the engine and
#: sits below DiLoCo and the Lightning runtime; callbacks, transforms, auto, the CLI and the root sit above all of them.
MAY_IMPORT = {
    "engine": {"validation"},
    "compressors": {"engine", "validation"},
    "runtime": {"engine", "ft", "validation"},
    "ddp": {"compressors", "engine", "optim", "runtime", "validation"},
    "diloco": {"compressors", "engine", "ft", "runtime", "validation"},
    "ft": {"engine", "validation"},
}
#: folders that never import Lightning: the engine, the compressors and fault tolerance run on plain torch.distributed
TORCH_ONLY = ("engine", "compressors", "ft")
#: the modules of diloco/ that may import Lightning: the two front doors (DiLoCo over DDPStrategy, ShardedDiLoCo over
#: ModelParallelStrategy with its mesh and checkpoint) and the monitor; the round, the memberships, the exchange and
#: the merges are a torch-only core both drive
DILOCO_FRONT_DOORS = [
    "diloco/front_door.py",
    "diloco/monitor.py",
    "diloco/sharded.py",
    "diloco/sharded_checkpoint.py",
    "diloco/sharded_mesh.py",
    "diloco/strategy.py",
]


def _folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def upward_imports(graph: dict[str, set[str]], folder: str) -> list[tuple[str, str]]:
    """The imports of ``folder``'s modules that :data:`MAY_IMPORT` does not allow."""
    allowed = MAY_IMPORT[folder] | {folder}
    return sorted(
        (module, target)
        for module, targets in graph.items()
        if _folder(module) == folder
        for target in targets
        if _folder(target) not in allowed
    )


@pytest.mark.parametrize("folder", sorted(MAY_IMPORT))
def test_layers_import_only_downward(folder):
    offenders = upward_imports(import_graph(), folder)
    assert not offenders, f"{folder}/ imports above its layer: {offenders}"


def lightning_imports(root: Path, folder: str) -> list[str]:
    """The modules of ``folder`` that import ``lightning`` (at module level or in a function)."""
    found = []
    for path in sorted((root / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            if any(name == "lightning" or name.startswith("lightning.") for name in names):
                found.append(str(path.relative_to(root)))
    return found


@pytest.mark.parametrize("folder", TORCH_ONLY)
def test_the_torch_only_folders_import_no_lightning(folder):
    assert not lightning_imports(ROOT, folder), f"{folder}/ imports Lightning"


def test_diloco_s_core_imports_no_lightning_and_ft_nothing_of_diloco():
    assert sorted(set(lightning_imports(ROOT, "diloco"))) == DILOCO_FRONT_DOORS
    graph = import_graph()
    assert not [(m, t) for m, ts in graph.items() if _folder(m) == "ft" for t in ts if _folder(t) == "diloco"]


def private_imports(root: Path) -> list[str]:
    """``module: name`` for every private name (``_name``) a module imports from another of the package."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith(PACKAGE)):
                found += [f"{path.relative_to(root)}: {a.name}" for a in node.names if a.name.startswith("_")]
    return found


def test_no_module_imports_another_module_s_private_name(tmp_path):
    """A private name is its module's own; one another module needs is part of that module's interface."""
    assert not private_imports(ROOT), "private names imported across modules"
    (tmp_path / "a.py").write_text("from lightning_gradcomp.diloco.round import Round, _hidden\n")
    assert private_imports(tmp_path) == ["a.py: _hidden"], "the check itself sees one"


def test_the_layer_rules_see_an_upward_import(tmp_path):
    """The check itself: an engine module importing a compressor, or Lightning, is reported."""
    package = tmp_path / PACKAGE
    for folder in ("engine", "compressors"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "compressors" / "topk.py").write_text("X = 1\n")
    (package / "engine" / "driver.py").write_text("def f():\n    from lightning_gradcomp.compressors.topk import X\n")
    assert upward_imports(import_graph(package), "engine") == [
        ("lightning_gradcomp.engine.driver", "lightning_gradcomp.compressors"),
        ("lightning_gradcomp.engine.driver", "lightning_gradcomp.compressors.topk"),
    ]
    assert upward_imports(import_graph(package), "compressors") == []
    (package / "engine" / "driver.py").write_text("import lightning.pytorch as pl\n")
    assert lightning_imports(package, "engine") == ["engine/driver.py"]
    assert lightning_imports(package, "compressors") == []


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
