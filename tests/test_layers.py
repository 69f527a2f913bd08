"""The package's layers import one way (docs/design.md, "Layers"):

    api -> backend -> passes
               \\--> runtime

and all of them may use the base (config, report, cache, arena, bindings, kernels,
models, `_compat/`), which imports no layer above it. The runtime never imports the
passes, nor the passes the runtime; the api reaches both only through the backend.
Tools (bench, cli) and the package's `__init__` (the public API) may import anything.

Imports inside functions count too: a deferred import is still a dependency.
Private torch (`torch._dynamo`, `torch.utils._pytree`, ...) is named only in
`_compat/`, so a torch upgrade that moves something breaks one folder. A module
holds one idea and a function one step: no module past 400 lines, no function past 60.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "graphopt"

BASE = "base"
LAYER_FOLDERS = ("passes", "runtime", "backend", "api")  # a package per layer: its folder names it
TOOLS = ("bench", "cli", "__init__", "__main__")


def layer_of(first: str) -> str:
    """The layer of a module, from the first part of its dotted name below graphopt: a
    layer's folder, a tool, or else the base (top-level modules, kernels/, models/, _compat/)."""
    if first in LAYER_FOLDERS:
        return first
    return "tools" if first in TOOLS else BASE


MAY_IMPORT = {
    BASE: {BASE},
    "passes": {BASE, "passes"},
    "runtime": {BASE, "runtime"},
    "backend": {BASE, "passes", "runtime", "backend"},
    "api": {BASE, "backend", "api"},
    "tools": {BASE, *LAYER_FOLDERS, "tools"},
}


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def dotted(path: Path) -> list[str]:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts


def imported(path: Path) -> set[tuple[str, int]]:
    """(first part below graphopt of each graphopt module `path` imports, line)."""
    here = dotted(path)
    package = here if path.name == "__init__.py" else here[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            target = package[:len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
            found |= {(target[0] if target else alias.name, node.lineno) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("graphopt"):
            below = node.module.split(".")[1:]
            found |= {(below[0] if below else alias.name, node.lineno) for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {(alias.name.split(".")[1], node.lineno) for alias in node.names
                      if alias.name.startswith("graphopt.")}
    return found


def test_each_layer_is_a_folder():
    assert all((PACKAGE / folder).is_dir() for folder in LAYER_FOLDERS)
    assert layer_of("backend") == "backend" and layer_of("cli") == "tools" and layer_of("cache") == BASE


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_go_one_way(path: Path):
    layer = layer_of(dotted(path)[0])
    wrong = sorted(f"line {line}: imports {name} ({layer_of(name)})" for name, line in imported(path)
                   if layer_of(name) not in MAY_IMPORT[layer])
    assert not wrong, f"{path.relative_to(PACKAGE)} ({layer}) may import only {sorted(MAY_IMPORT[layer])}: {wrong}"


def test_the_check_sees_a_wrong_import(tmp_path, monkeypatch):
    """The scan reads relative, absolute and deferred imports."""
    monkeypatch.setattr(__import__(__name__), "PACKAGE", tmp_path)
    (tmp_path / "runtime").mkdir()
    module = tmp_path / "runtime" / "x.py"
    module.write_text("from ..passes.memory_plan import plan\nimport graphopt.api\n"
                      "def f():\n    from .. import backend\n    from . import capture\n")
    assert imported(module) == {("passes", 1), ("api", 2), ("backend", 4), ("runtime", 5)}


PRIVATE_TORCH = re.compile(r"torch\._[A-Za-z]|^\s*(from|import) torch(\.\w+)*\._\w+")


def test_private_torch_only_in_compat():
    found = [f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}" for path in modules()
             if "_compat" not in path.relative_to(PACKAGE).parts
             for number, line in enumerate(path.read_text().splitlines(), 1) if PRIVATE_TORCH.search(line)]
    assert not found, "private torch outside _compat/ (wrap it in the _compat/ module of its part of torch, " \
        "or add a name to _compat/names.py):\n" + "\n".join(found)


def test_compat_re_exports_nothing():
    """Callers import the `_compat/` module of the part of torch they use, so a
    monkeypatch of a wrapper on that module reaches every call of it."""
    tree = ast.parse((PACKAGE / "_compat" / "__init__.py").read_text())
    assert [type(node) for node in tree.body] == [ast.Expr], "_compat/__init__.py holds only its docstring"


def test_the_private_torch_check_sees_each_form():
    lines = ["x = torch._dynamo.config", "from torch.utils._pytree import tree_map",
             "import torch.distributed._functional_collectives as funcol", "isinstance(t, torch._ops.OpOverload)"]
    assert all(PRIVATE_TORCH.search(line) for line in lines)
    assert not any(PRIVATE_TORCH.search(line) for line in ["import torch.fx", "torch.ops.aten._to_copy", "t._base"])


MODULE_LINES, FUNCTION_LINES = 400, 60


def test_modules_and_functions_stay_readable_in_one_sitting():
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        name = path.relative_to(PACKAGE)
        if source.count("\n") > MODULE_LINES:
            too_long.append(f"{name}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                    node.end_lineno - node.lineno >= FUNCTION_LINES:
                too_long.append(f"{name}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not too_long, f"split these (modules <= {MODULE_LINES} lines, functions <= {FUNCTION_LINES}):\n" + \
        "\n".join(too_long)
