"""The package's layers: imports point one way, down.

    book  →  lab, measure  →  cards  →  core  →  _kernels

Every ``import`` in every module of normtools (function-level imports included) is read from
the source and checked against this order: a module may import its own subpackage and any layer
below it, never a layer above or a peer (lab and measure do not import each other).
"""

import ast
import json
import re
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


# --- the map: every module is on the README's layer table and in its package's docstring -------

README = PACKAGE.parent / "README.md"
BOOK = PACKAGE.parent / "book"
LAYERS = ("core", "cards", "lab", "measure", "book")


def _layer_modules(layer):
    """Modules of one layer as dotted names relative to it (``ops``, ``atlas.card``, ``bench.cli``)."""
    root = PACKAGE / layer
    names = set()
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] in ("__init__", "__main__"):
            continue
        names.add(".".join(parts))
    return names


def _readme_map():
    """{layer: the backticked names in its row of the README's layer table}."""
    rows = {}
    for line in README.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`normtools."):
            layer = cells[0].strip("`").removeprefix("normtools.")
            rows[layer] = set(re.findall(r"`([A-Za-z_][\w.]*)`", cells[2]))
    return rows


def test_the_readme_map_lists_every_module_and_no_other():
    rows = _readme_map()
    assert set(rows) == set(LAYERS), f"README layer table rows: {sorted(rows)}"
    for layer in LAYERS:
        actual = _layer_modules(layer)
        subpackages = {name.rsplit(".", 1)[0] for name in actual if "." in name}
        missing = actual - rows[layer]
        unknown = rows[layer] - actual - subpackages
        assert not missing, f"normtools.{layer}: modules not on the README's map: {sorted(missing)}"
        assert not unknown, f"normtools.{layer}: the README's map names what does not exist: {sorted(unknown)}"


@pytest.mark.parametrize("package", [p for p in sorted(PACKAGE.rglob("__init__.py")) if p.parent != PACKAGE],
                         ids=lambda p: str(p.parent.relative_to(PACKAGE)))
def test_each_package_docstring_names_its_modules(package):
    doc = ast.get_docstring(ast.parse(package.read_text())) or ""
    for path in sorted(package.parent.glob("*.py")):
        if path.stem in ("__init__", "__main__"):
            continue
        assert f"``{path.stem}``" in doc, f"{package.relative_to(PACKAGE)}'s docstring does not name ``{path.stem}``"
    for sub in sorted(p for p in package.parent.iterdir() if (p / "__init__.py").exists()):
        assert f"``{sub.name}``" in doc, f"{package.relative_to(PACKAGE)}'s docstring does not name ``{sub.name}``"


def _sources_outside_core():
    """(where, source) of every Python source outside normtools.core: the other layers, the tests,
    bench/ and the chapters' code cells."""
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] != "core":
            yield str(path.relative_to(PACKAGE.parent)), path.read_text()
    for folder in (PACKAGE.parent / "tests", PACKAGE.parent / "bench"):
        for path in sorted(folder.rglob("*.py")):
            if path == Path(__file__):   # this file's own examples of what the check refuses
                continue
            if path.relative_to(PACKAGE.parent / "tests").parts[0] == "core":
                continue                 # the tests of core may test its private modules
            yield str(path.relative_to(PACKAGE.parent)), path.read_text()
    for path in sorted(BOOK.glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        yield str(path.relative_to(PACKAGE.parent)), code


PRIVATE_CORE = re.compile(r"normtools\.core\._\w+|from\s+normtools\.core\s+import\s+[^\n]*\b_[a-z]\w*")


def test_nothing_outside_core_imports_a_private_module_of_core():
    offenders = [f"{where}: {m.group(0)}" for where, text in _sources_outside_core()
                 for m in PRIVATE_CORE.finditer(text)]
    assert not offenders, "private modules of normtools.core used outside it:\n" + "\n".join(offenders)


def test_the_private_import_check_sees_both_spellings():
    assert PRIVATE_CORE.search("from normtools.core import _launch")
    assert PRIVATE_CORE.search("import normtools.core._validate as v")
    assert not PRIVATE_CORE.search("from normtools.core import launcher, ops")
