"""The documentation: the API reference builds from the docstrings, public API is documented, links resolve."""

import glob
import inspect
import os
import re

import pytest

import lightning_gradcomp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _public_objects():
    for module_name in lightning_gradcomp.__all__:
        module = getattr(lightning_gradcomp, module_name)
        members = [module] if not inspect.ismodule(module) else [getattr(module, n) for n in module.__all__]
        yield from ((f"{module_name}.{getattr(m, '__name__', '')}", m) for m in members)


@pytest.mark.parametrize(("name", "obj"), list(_public_objects()), ids=lambda v: v if isinstance(v, str) else "")
def test_public_api_is_documented(name, obj):
    assert inspect.getdoc(obj), f"{name} has no docstring"
    if inspect.isclass(obj):
        for attr, member in vars(obj).items():
            if not attr.startswith("_") and inspect.isfunction(member):
                assert inspect.getdoc(member), f"{name}.{attr} has no docstring"


def test_api_reference_builds_from_the_docstrings(tmp_path):
    pdoc = pytest.importorskip("pdoc")
    pdoc.render.configure(docformat="google")
    pdoc.pdoc("lightning_gradcomp", output_directory=tmp_path)
    pages = {os.path.relpath(p, tmp_path) for p in glob.glob(str(tmp_path / "**" / "*.html"), recursive=True)}
    assert {"lightning_gradcomp.html", "lightning_gradcomp/compressors.html", "lightning_gradcomp/tasks.html"} <= pages
    compressors = (tmp_path / "lightning_gradcomp" / "compressors.html").read_text()
    assert "PowerSGD" in compressors
    assert "Vogels" in compressors


MARKDOWN = [
    os.path.join(ROOT, "README.md"),
    os.path.join(ROOT, "CHANGELOG.md"),
    *glob.glob(os.path.join(ROOT, "docs", "*.md")),
]


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_resolve(path):
    with open(path) as f:
        text = f.read()
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target:
            continue
        assert os.path.exists(os.path.join(os.path.dirname(path), target)), f"{path}: broken link {target}"


def _heading_anchors(path):
    """The anchors GitHub gives the headings of a Markdown file (lower case, punctuation dropped, spaces as hyphens)."""
    anchors, seen, in_code = set(), {}, False
    with open(path) as f:
        for line in f:
            if line.startswith("```"):
                in_code = not in_code
            heading = None if in_code else re.match(r"#{1,6}\s+(.*)", line)
            if heading:
                anchor = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
                anchors.add(anchor if anchor not in seen else f"{anchor}-{seen[anchor]}")
                seen[anchor] = seen.get(anchor, 0) + 1
    return anchors


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: os.path.relpath(p, ROOT))
def test_anchors_resolve(path):
    """A link to ``page.md#section`` (or ``#section`` on the same page) names a heading that exists."""
    with open(path) as f:
        text = f.read()
    for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", text):
        page = os.path.normpath(os.path.join(os.path.dirname(path), target)) if target else path
        if "://" in target or not page.endswith(".md") or not os.path.exists(page):
            continue  # external links; a missing page is test_relative_links_resolve's to report
        assert anchor in _heading_anchors(page), f"{path}: no heading for #{anchor} in {os.path.relpath(page, ROOT)}"


def _documented_defaults(page: str) -> list[tuple[str | None, str, str]]:
    """``(class or None, argument, default cell)`` of every row of a page's table of arguments and defaults."""
    rows, header = [], None
    with open(os.path.join(ROOT, "docs", page)) as f:
        lines = f.read().splitlines()
    for line in lines:
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else None
        if cells is None:
            header = None
        elif header is None and "argument" in cells and "default" in cells:
            header = cells
        elif header is not None and not set(line) <= set("|- "):
            row = dict(zip(header, cells))
            rows.append((row.get("compressor", "").strip("`") or None, row["argument"].strip("`"), row["default"]))
    return rows


#: the page that documents each class's arguments and defaults
DEFAULTS_PAGES = {
    "accordion.md": "callbacks.Accordion",
    "adacomp.md": "compressors.AdaComp",
    "dense_warmup.md": "callbacks.DenseWarmup",
    "dgc.md": "compressors.DGC",
    "diloco.md": "DiLoCo",
    "index.md": "CompressedDDP",
    "lgc.md": "compressors.LGC",
    "optimizers.md": "optim.NovoGrad",
    "pactrain.md": "callbacks.PacTrain",
    "powersgd.md": "compressors.PowerSGD",
    "pufferfish.md": "transforms.Pufferfish",
    "qsgd.md": "compressors.QSGD",
    "randomk.md": "compressors.RandomK",
    "scalecom.md": "compressors.ScaleCom",
    "sharded_diloco.md": "ShardedDiLoCo",
    "signsgd.md": "compressors.SignSGD",
    "terngrad.md": "compressors.TernGrad",
    "topk.md": "compressors.TopK",
    "tracin.md": "callbacks.TracIn",
}


@pytest.mark.parametrize("page", sorted(DEFAULTS_PAGES))
def test_every_documented_default_is_the_signatures(page):
    import ast
    import importlib

    module, _, name = DEFAULTS_PAGES[page].rpartition(".")
    owner = importlib.import_module(f"lightning_gradcomp.{module}" if module else "lightning_gradcomp")
    checked = 0
    for cls_name, argument, cell in _documented_defaults(page):
        cls = getattr(importlib.import_module("lightning_gradcomp.compressors"), cls_name) if cls_name else None
        parameters = inspect.signature(cls or getattr(owner, name)).parameters
        if argument not in parameters:
            continue  # a row of another kind ("**kwargs", "(none)")
        default = parameters[argument].default
        text = cell.split("(")[0].strip().strip("`") if cell.startswith("`None` (") else cell.strip("`")
        try:
            documented = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            assert default is not inspect.Parameter.empty or "required" in cell, (argument, cell)
            continue  # not a literal (`Identity()`, "(required)"): not compared
        expected = list(default) if isinstance(default, tuple) and isinstance(documented, list) else default
        assert documented == expected, f"{page}: `{argument}` is documented as {cell}, the signature says {default!r}"
        checked += 1
    assert checked > 0


@pytest.mark.parametrize("path", ["README.md", *sorted(glob.glob("docs/*.md", root_dir=ROOT))])
def test_docs_carry_no_project_history(path):
    # a user cannot act on "issue 11's target" or "the next session": that history belongs in CHANGELOG.md
    with open(os.path.join(ROOT, path)) as f:
        found = re.findall(r".{0,40}\b(?:issue \d+|issue's|session)\b.{0,40}", f.read(), flags=re.I)
    assert not found, found


def _strategy_table(text):
    """The rows of the ``| name | strategy |`` table: (name, the strategy cell)."""
    rows, inside = [], False
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if cells == ["name", "strategy"]:
            inside = True
        elif inside and cells and not set(line) <= set("|- "):
            rows.append((cells[0].strip("`"), "|".join(cells[1:])))
        elif inside and not cells:
            break
    return rows


def _registered(entry):
    """A registry entry as (the strategy class, its arguments): a preset's compressor built, "auto" kept."""
    import functools

    strategy, arguments = entry["strategy"], dict(entry["init_params"])
    if isinstance(strategy, functools.partial):  # ddp/names.py's _build(strategy_class, make_compressor)
        strategy, make = strategy.args
        arguments["compressor"] = make() if callable(make) else make
    return strategy, arguments


def _same(a, b):
    if isinstance(a, str) or isinstance(b, str) or not hasattr(a, "__dict__"):
        return a == b
    return type(a) is type(b) and vars(a) == vars(b)


def strategy_table_mismatches(text):
    """What the strategy-names table says that the registry or the signatures do not (empty: the table is right)."""
    import ast

    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_gradcomp import compressors

    namespace = {**vars(compressors), **vars(lightning_gradcomp)}
    classes = {v for v in namespace.values() if isinstance(v, type)}
    ours = {n for n in StrategyRegistry.available_strategies() if _registered(StrategyRegistry[n])[0] in classes}
    rows = _strategy_table(text)
    missing = sorted(ours - {n for n, _ in rows})
    found = [f"registered but not in the table: {missing}"] if missing else []
    for name, cell in rows:
        if name not in ours:
            found.append(f"{name}: not a registered name")
            continue
        cls, arguments = _registered(StrategyRegistry[name])
        expression, *claims = re.findall(r"`([^`]+)`", cell)
        call = ast.parse(expression, mode="eval").body
        if getattr(namespace.get(getattr(call.func, "id", None)), "__name__", None) != cls.__name__:
            found.append(f"{name}: `{expression}` is not a {cls.__name__}")
            continue
        documented = {k.arg: eval(compile(ast.Expression(k.value), name, "eval"), namespace) for k in call.keywords}
        if documented.keys() != arguments.keys() or not all(_same(documented[k], arguments[k]) for k in arguments):
            found.append(f"{name}: `{expression}`, registered with {arguments}")
        parameters = inspect.signature(cls).parameters
        for claim in claims:
            argument, equals, value = claim.partition("=")
            if equals and argument in parameters and parameters[argument].default != ast.literal_eval(value):
                found.append(f"{name}: `{claim}`, the default is {parameters[argument].default!r}")
    return found


def test_the_strategy_names_table_is_the_registry_and_the_signatures():
    with open(os.path.join(ROOT, "docs", "index.md")) as f:
        text = f.read()
    assert len(_strategy_table(text)) >= 7
    assert strategy_table_mismatches(text) == []


def test_the_strategy_names_check_sees_a_wrong_default_class_argument_or_name():
    table = "| name | strategy |\n|---|---|\n"
    right = [
        "| `compressed_ddp` | `CompressedDDP()` |",
        '| `compressed_ddp_spawn` | `CompressedDDP(start_method="spawn")` |',
        "| `compressed_ddp_powersgd` | `CompressedDDP(compressor=PowerSGD(rank=2))` |",
        "| `compressed_ddp_fp16` | `CompressedDDP(compressor=FP16())` |",
        "| `compressed_ddp_bf16` | `CompressedDDP(compressor=BF16())` |",
        '| `compressed_ddp_auto` | `CompressedDDP(compressor="auto")` |',
        '| `diloco` | `DiLoCo()` (`sync_every="auto"`) |',
        "| `diloco_sharded` | `ShardedDiLoCo()` |",
    ]
    assert strategy_table_mismatches(table + "\n".join(right)) == []
    wrong = {
        6: ("| `diloco` | `DiLoCo()` (`sync_every=500`) |", "diloco: `sync_every=500`, the default is 'auto'"),
        2: ("| `compressed_ddp_powersgd` | `CompressedDDP(compressor=PowerSGD(rank=4))` |", "compressed_ddp_powersgd:"),
        3: ("| `compressed_ddp_fp16` | `CompressedDDP(compressor=BF16())` |", "compressed_ddp_fp16:"),
        1: ("| `compressed_ddp_spawn` | `DiLoCo()` |", "compressed_ddp_spawn: `DiLoCo()` is not a CompressedDDP"),
        0: ("| `compressed_ddp_topk` | `CompressedDDP()` |", "compressed_ddp_topk: not a registered name"),
    }
    for index, (row, message) in wrong.items():
        rows = [*right[:index], row, *right[index + 1 :]]
        found = strategy_table_mismatches(table + "\n".join(rows))
        assert any(m.startswith(message) for m in found), (row, found)
