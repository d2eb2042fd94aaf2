"""Every private Lightning and torch API the package uses still exists (the table in docs/concepts.md).

The table is the one list: this test reads it, so a row added there is checked here, and an upgrade of Lightning or
torch that removes or renames one of them fails here, naming it. The package's own imports of private names from
Lightning and torch must all be in the table.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SECTION = "## Private Lightning and torch APIs"


def listed_apis(text: str | None = None) -> list[str]:
    """The dotted names in the first column of the section's table."""
    text = (ROOT / "docs" / "concepts.md").read_text() if text is None else text
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([\w.]+)` \|", section, flags=re.MULTILINE)


def _assigned_on_self(cls: type, name: str) -> bool:
    """Whether ``cls`` or a base assigns ``self.<name>`` in its source (an attribute set in ``__init__``).

    Plain assignments count, and ``__setattr__("<name>", ...)`` (how ``nn.Module`` sets its own registries).
    """
    escaped = re.escape(name)
    pattern = re.compile(rf"\bself\.{escaped}\s*(:[^=\n]+)?=[^=]|__setattr__\(\s*[\"']{escaped}[\"']")
    for klass in cls.__mro__:
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):  # a builtin or C extension class: no source
            continue
        if pattern.search(source):
            return True
    return False


def resolves(dotted: str) -> bool:
    """Whether ``dotted`` names a module attribute, a class attribute, or an attribute a class sets on its instances."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        break
    else:
        return False
    for i, name in enumerate(parts[split:], start=split):
        if hasattr(obj, name):
            obj = getattr(obj, name)
        elif i == len(parts) - 1 and inspect.isclass(obj):
            return _assigned_on_self(obj, name)
        else:
            return False
    return True


@pytest.mark.parametrize("api", listed_apis())
def test_the_private_api_still_exists(api):
    assert resolves(api), f"{api} (listed in docs/concepts.md, '{SECTION[3:]}') no longer exists"


def test_a_name_that_does_not_exist_is_reported_missing():
    """The check can fail: made-up names of each kind do not resolve."""
    assert not resolves("lightning.fabric.utilities.optimizer._no_such_function")
    assert not resolves("torch.nn.parallel.DistributedDataParallel._no_such_attribute")
    assert not resolves("torch.no_such_module._anything")
    # and the kinds the table holds do: a module function, a class attribute, one set in __init__
    assert resolves("lightning.fabric.utilities.optimizer._optimizers_to_device")
    assert resolves("torch.Tensor._indices")
    assert resolves("lightning.pytorch.strategies.DDPStrategy._ddp_kwargs")


def test_the_table_is_read():
    apis = listed_apis()
    assert len(apis) >= 30
    table = f"{SECTION}\n\n| API |\n|---|\n| `torch._a` | x |\n| `torch._b` | y |\n\n## Next\n| `torch._c` |"
    assert listed_apis(table) == ["torch._a", "torch._b"]


def _private_imports() -> set[str]:
    """``module._name`` for every ``from lightning... / torch... import _name`` in the package."""
    found = set()
    for path in (ROOT / "lightning_gradcomp").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("lightning", "torch"):
                found.update(f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_"))
    return found


def test_every_private_name_the_package_imports_is_listed():
    missing = _private_imports() - set(listed_apis())
    assert not missing, f"private names imported but not listed in docs/concepts.md: {sorted(missing)}"
