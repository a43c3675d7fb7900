"""Every name that bench/ and scripts/ import from mechdiag exists: a bench broken by a refactor fails here,
not on the day its figures are needed."""

from __future__ import annotations

import ast
import importlib

import pytest

from mechdiag.paths import REPO_ROOT

SCRIPTS = sorted([*(REPO_ROOT / "bench").glob("*.py"), *(REPO_ROOT / "scripts").glob("*.py")])


def _imports(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "mechdiag":
            for alias in node.names:
                yield node.module, alias.name, node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "mechdiag":
                    yield alias.name, None, node.lineno


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_mechdiag_name_a_script_imports_exists(path):
    missing = []
    for module, name, line in _imports(path):
        mod = importlib.import_module(module)
        if name is not None and not hasattr(mod, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ModuleNotFoundError:
                missing.append(f"{path.name}:{line}: {module}.{name}")
    assert not missing, missing
