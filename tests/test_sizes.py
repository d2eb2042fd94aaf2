"""The package's units stay small enough to read: one concept per module, classes and functions a screen or a few.

Limits: a module under 600 lines, a class under 400, a function (or method) at most 80; in DiLoCo's core and
fault tolerance (diloco/, ft/), where a second front door drives the same classes, a class under 330.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "lightning_gradcomp"
MODULE_LINES, CLASS_LINES, FUNCTION_LINES = 600, 400, 80


#: the folders whose classes stay under CORE_CLASS_LINES
CORE, CORE_CLASS_LINES = ("diloco", "ft"), 330


def oversized(root: Path) -> list[str]:
    """``path: what (lines)`` for every module, class or function of ``root`` over its limit."""
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        name = str(path.relative_to(root))
        if len(text.splitlines()) >= MODULE_LINES:
            found.append(f"{name}: module ({len(text.splitlines())})")
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if not isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            limit = CORE_CLASS_LINES if path.relative_to(root).parts[0] in CORE else CLASS_LINES
            if isinstance(node, ast.ClassDef) and lines >= limit:
                found.append(f"{name}: class {node.name} ({lines})")
            elif not isinstance(node, ast.ClassDef) and lines > FUNCTION_LINES:
                found.append(f"{name}: function {node.name} ({lines})")
    return found


def test_no_module_class_or_function_is_over_its_limit():
    assert oversized(ROOT) == []


def test_the_check_sees_a_long_function_and_a_long_class(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(FUNCTION_LINES))
    (tmp_path / "long.py").write_text(f"def f():\n{body}\n\nclass C:\n{body * 5}")
    assert oversized(tmp_path) == [f"long.py: function f ({FUNCTION_LINES + 1})", "long.py: class C (401)"]
    (tmp_path / "diloco").mkdir()
    (tmp_path / "diloco" / "core.py").write_text("class D:\n" + "    x = 0\n" * CORE_CLASS_LINES)
    assert f"diloco/core.py: class D ({CORE_CLASS_LINES + 1})" in oversized(tmp_path)


DOCS = ROOT.parent / "docs"
PAGE_BYTES, DOCS_BYTES, CHANGELOG_BYTES, BULLET_CHARS = 30_000, 300_000, 40_000, 400


def test_the_docs_and_the_changelog_stay_short_enough_to_read():
    """A page a user reads in minutes; measurement logs belong in benchmarks/results/; a line or two per change."""
    pages = {page.name: len(page.read_bytes()) for page in DOCS.glob("*.md")}
    assert {name: size for name, size in pages.items() if size > PAGE_BYTES} == {}
    assert sum(pages.values()) < DOCS_BYTES
    changelog = (ROOT.parent / "CHANGELOG.md").read_text()
    assert len(changelog.encode()) < CHANGELOG_BYTES
    bullets, current = [], ""
    for line in changelog.splitlines():
        if line.startswith("- "):
            bullets.append(current)
            current = line
        elif line.startswith("  ") and current:
            current += " " + line.strip()
        else:
            bullets.append(current)
            current = ""
    bullets.append(current)
    assert [b[:80] for b in bullets if len(b) > BULLET_CHARS] == []
