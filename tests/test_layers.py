"""The package's layers: imports point one way, down.

    book  →  lab, measure  →  cards  →  core  →  _kernels

Every ``import`` in every module of normtools (function-level imports included) is read from
the source and checked against this order: a module may import its own subpackage and any layer
below it, never a layer above or a peer (lab and measure do not import each other).
"""

import ast
from pathlib import Path

import pytest

import normtools

PACKAGE = Path(normtools.__file__).parent
RANK = {"_kernels": 0, "core": 1, "tp": 2, "cards": 2, "lab": 3, "measure": 3, "book": 4, "cli": 5, "__main__": 6}


def _layer(module: str) -> str:
    parts = module.split(".")
    assert parts[0] == "normtools"
    return parts[1] if len(parts) > 1 else "normtools"


def _imports(path: Path):
    """(line, imported normtools module) for every import statement in ``path``."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names if a.name.startswith("normtools"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "normtools":  # from normtools import x: x is a layer or a public name
                yield from ((node.lineno, f"normtools.{a.name}") for a in node.names)
            elif node.module.startswith("normtools"):
                yield node.lineno, node.module


def _modules():
    return sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" or p.parent != PACKAGE)


def test_every_module_belongs_to_a_layer():
    for path in _modules():
        top = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
        assert top in RANK, f"{path.relative_to(PACKAGE)} is in no layer of {sorted(RANK)}"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down(path):
    own = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
    for line, module in _imports(path):
        target = _layer(module)
        assert target in RANK, f"{path.name}:{line} imports {module}, which is in no layer"
        ok = target == own or RANK[target] < RANK[own]
        assert ok, f"{path.relative_to(PACKAGE)}:{line} imports {module}: {own} may not import {target}"


def test_the_checker_sees_an_upward_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from normtools.book import analysis\n")
    assert [m for _, m in _imports(bad)] == ["normtools.book"]
