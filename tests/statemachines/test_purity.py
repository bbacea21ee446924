"""The lifecycle module (statemachines/): the state machines are pure Python: no torch, no anyio imports in
the package."""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import statemachines

FORBIDDEN = ("torch", "anyio")
PACKAGE_DIR = Path(statemachines.__file__).parent
MODULES = sorted(PACKAGE_DIR.glob("*.py"))


def _imported_roots(tree: ast.AST) -> set[str]:
    """Top-level package of every import statement anywhere in the module (functions included)."""
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            roots.add(node.args[0].value.split(".")[0])
    return roots


def test_no_module_of_the_package_imports_torch_or_anyio():
    assert {p.name for p in MODULES} >= {"__init__.py", "request.py"}
    offenders = {
        p.name: sorted(_imported_roots(ast.parse(p.read_text(), str(p))) & set(FORBIDDEN)) for p in MODULES
    }
    assert not any(offenders.values()), offenders


def test_importing_every_module_loads_neither_torch_nor_anyio():
    """Transitively too: a fresh interpreter imports each module, then neither package is loaded."""
    names = ["statemachines"] + [
        f"statemachines.{m.name}" for m in pkgutil.iter_modules([str(PACKAGE_DIR)]) if not m.ispkg
    ]
    assert "statemachines.request" in names
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        f"loaded = sorted(m for m in {FORBIDDEN!r} if m in sys.modules)\n"
        "assert not loaded, loaded\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=PACKAGE_DIR.parent,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
