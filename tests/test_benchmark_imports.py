"""The benchmarks import helpers from one another (python puts their folder on sys.path):
every name one imports from another must still be defined there. A benchmark is run by
hand, rarely, so a helper renamed in one would otherwise break another unnoticed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("*.py"))


def top_level_names(tree: ast.Module) -> set[str]:
    """Every name a module defines or imports at its top level."""
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {alias.asname or alias.name.split(".")[0] for alias in node.names}
    return names


def sibling_imports(tree: ast.Module) -> list[tuple[str, str, int]]:
    """(module, name, line) of every ``from <another benchmark> import name``, at any depth."""
    siblings = {path.stem for path in SCRIPTS}
    return [(node.module, alias.name, node.lineno) for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in siblings
            for alias in node.names]


def test_the_benchmarks_import_one_another():
    # the test below would pass vacuously if the benchmarks stopped sharing helpers
    assert any(sibling_imports(ast.parse(path.read_text())) for path in SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS, ids=[path.name for path in SCRIPTS])
def test_every_name_imported_from_another_benchmark_exists_there(script):
    for module, name, line in sibling_imports(ast.parse(script.read_text())):
        defined = top_level_names(ast.parse((BENCHMARKS / f"{module}.py").read_text()))
        assert name in defined, (f"{script.name}:{line} imports {name} from {module}.py, "
                                 f"which does not define it")
