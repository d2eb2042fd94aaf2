"""The repository holds text and code only, and its scripts import the way an installed package does.

* No model weights or checkpoints are tracked (``*.pt``, ``*.pth``, ``*.ckpt``): a benchmark's result is text (JSON,
  Markdown, logs); the tensors it needs while it runs are scratch that ``.gitignore`` keeps out.
* No file in ``benchmarks/`` or ``tests/`` edits ``sys.path``: a benchmark runs as ``python benchmarks/NAME.py`` (its
  own folder first on the path, the package installed), a test through pytest from the repository root.
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BINARY = ("*.pt", "*.pth", "*.ckpt")
MUTATORS = {"insert", "append", "extend", "remove", "pop", "clear", "__setitem__", "__iadd__"}


def tracked_binaries(root: Path) -> list[str]:
    """The files git tracks in ``root`` whose names match ``BINARY``."""
    out = subprocess.run(["git", "ls-files", *BINARY], cwd=root, capture_output=True, text=True, check=True)
    return out.stdout.split()


def ignored(root: Path, path: str) -> bool:
    """Whether ``.gitignore`` keeps ``path`` (relative to ``root``) out of ``git add``."""
    return subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=root).returncode == 0


def _is_sys_path(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "path"
        and isinstance(node.value, ast.Name)
        and node.value.id == "sys"
    )


def sys_path_edits(path: Path) -> list[int]:
    """The lines of ``path`` that change ``sys.path``: a mutating call, an assignment to it or to a slice of it."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            mutates = _is_sys_path(node.func.value) and node.func.attr in MUTATORS
            if mutates or node.func.attr == "addsitedir":
                lines.append(node.lineno)
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if _is_sys_path(target) or (isinstance(target, ast.Subscript) and _is_sys_path(target.value)):
                    lines.append(node.lineno)
    return sorted(lines)


def test_no_checkpoint_or_tensor_file_is_tracked_and_new_ones_are_ignored():
    assert tracked_binaries(ROOT) == []
    for name in ("benchmarks/results/x.d/final-0-0.pt", "model.pth", "checkpoints/last.ckpt", "w.ckpt"):
        assert ignored(ROOT, name), name
    assert not ignored(ROOT, "benchmarks/results/x.d/final-0-0.json")


def test_the_tracked_file_check_sees_a_tracked_checkpoint(tmp_path):
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "weights.pt").write_bytes(b"\x00")
    (tmp_path / "notes.json").write_text("{}")
    subprocess.run([*git, "add", "weights.pt", "notes.json"], cwd=tmp_path, check=True)
    assert tracked_binaries(tmp_path) == ["weights.pt"]
    assert not ignored(tmp_path, "weights.pt")  # no .gitignore there


@pytest.mark.parametrize("folder", ["benchmarks", "tests"])
def test_no_benchmark_or_test_edits_sys_path(folder):
    edits = {str(p.relative_to(ROOT)): sys_path_edits(p) for p in sorted((ROOT / folder).rglob("*.py"))}
    assert {name: lines for name, lines in edits.items() if lines} == {}


def test_the_sys_path_check_sees_each_way_of_editing_it_and_not_a_mention(tmp_path):
    # the mutating calls are spelled from parts, so that a text search of tests/ finds no edit in this file either
    calls = [f"sys.path.{call}" for call in ("insert(0, 'x')", "append('x')")]
    lines = [
        '"""Runs with ``sys.path`` as Python sets it."""',
        "import site",
        "import sys",
        *calls,
        "sys.path = ['x']",
        "sys.path[:0] = ['x']",
        "sys.path += ['x']",
        "site.addsitedir('x')",
        "print(sys.path, len(sys.path))",
    ]
    source = tmp_path / "script.py"
    source.write_text("\n".join(lines) + "\n")
    assert sys_path_edits(source) == [4, 5, 6, 7, 8, 9]
