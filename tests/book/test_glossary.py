"""The glossary table: every link target exists, every citation is in the bibliography, the
chapter's rendered glossary is in sync with normtools/glossary.py, and {term} links resolve."""

import re
from pathlib import Path

import nbformat
import pytest
import yaml

from normtools.book import glossary
from normtools.book.glossary import TERMS, Term

ROOT = Path(__file__).resolve().parents[2]
BOOK = ROOT / "book"
GLOSSARY_NOTEBOOK = BOOK / "06_glossary.ipynb"


def _book_sources():
    """(path, text) of every chapter source: markdown cells of notebooks, and .md pages."""
    for path in sorted(BOOK.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        yield path, "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    for path in sorted(BOOK.glob("*.md")):
        yield path, path.read_text()


def test_every_chapter_link_target_exists_and_is_in_the_toc():
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    listed = {c["file"] for part in toc["parts"] for c in part["chapters"]}
    for chapter in glossary.chapters():
        assert any((BOOK / f"{chapter}{ext}").exists() for ext in (".ipynb", ".md")), chapter
        assert f"book/{chapter}" in listed, f"{chapter} is not in _toc.yml"


def test_every_cited_key_is_in_the_bibliography():
    bib_keys = set(re.findall(r"@\w+\{([^,\s]+),", (BOOK / "references.bib").read_text()))
    for t in TERMS:
        for group in re.findall(r"\{cite(?::\w+)?\}`([^`]+)`", t.definition):
            for key in group.split(","):
                assert key.strip() in bib_keys, f"{t.term}: unknown cite key {key!r}"


def test_entries_are_one_line_with_a_vietnamese_term():
    for t in TERMS:
        for value in (t.term, t.definition, t.chapter, t.vietnamese):
            assert value.strip() and "\n" not in value, t
    assert len({t.term.lower() for t in TERMS}) == len(TERMS)


def test_the_issue_terms_are_all_defined():
    required = {"residual branch", "pre-norm", "post-norm", "sandwich norm", "post-sublayer norm",
                "parallel block", "QK-Norm", "per-head QK-Norm", "per-layer QK-Norm", "RMS",
                "epsilon", "scale parameterization", "offset", "casting", "GQA",
                "tensor parallelism", "all-reduce"}
    assert required <= {t.term for t in TERMS}


def _parse_glossary(text):
    """{term: body} from a ```{glossary} block, read line by line (independent of to_myst)."""
    lines = text.strip().splitlines()
    assert lines[0] == "```{glossary}" and lines[-1] == "```"
    entries, term = {}, None
    for line in lines[1:-1]:
        if line.startswith(":") or not line.strip():
            continue
        if line.startswith("  "):
            entries[term] = line.strip()
        else:
            term = line
    return entries


def test_to_myst_renders_every_term_with_its_chapter_and_vietnamese():
    entries = _parse_glossary(glossary.to_myst())
    assert set(entries) == {t.term for t in TERMS}
    for t in TERMS:
        body = entries[t.term]
        assert body.startswith(t.definition)
        assert f"*Vietnamese:* {t.vietnamese}." in body
        assert body.endswith(f"See {{doc}}`{t.chapter}`.")


def test_bad_tables_are_refused():
    one = Term("x", "a definition", "01_definition", "x")
    with pytest.raises(ValueError, match="duplicate"):
        glossary.to_myst((one, Term("X", "another", "02_flow", "y")))
    with pytest.raises(ValueError, match="one non-empty line"):
        glossary.to_myst((Term("y", "two\nlines", "02_flow", "y"),))
    with pytest.raises(ValueError, match="one non-empty line"):
        glossary.to_myst((Term("z", "a definition", "02_flow", ""),))
    with pytest.raises(TypeError):
        glossary.to_myst((("a", "b", "c", "d"),))


def test_chapter_cell_is_the_rendering_of_the_table():
    nb = nbformat.read(GLOSSARY_NOTEBOOK, as_version=4)
    cells = [c.source for c in nb.cells if c.cell_type == "markdown" and "{glossary}" in c.source]
    assert cells == [glossary.to_myst()], (
        "book/06_glossary.ipynb is out of date with normtools/glossary.py: regenerate its glossary "
        "cell from normtools.book.glossary.to_myst()")


def test_every_term_link_in_the_book_resolves():
    defined = {t.term.lower() for t in TERMS}
    for path, text in _book_sources():
        for target in re.findall(r"\{term\}`([^`]+)`", text):
            # {term}`text <target>` links to target
            name = re.sub(r"^.*<(.+)>$", r"\1", target).strip().lower()
            assert name in defined, f"{path.name}: {{term}}`{target}` is not in normtools/glossary.py"


def test_sync_notebook_rewrites_only_the_glossary_cell(tmp_path):
    copy = tmp_path / "glossary.ipynb"
    nb = nbformat.read(GLOSSARY_NOTEBOOK, as_version=4)
    (cell,) = [c for c in nb.cells if c.cell_type == "markdown" and "{glossary}" in c.source]
    cell.source = "```{glossary}\nold term\n  stale definition\n```"
    nbformat.write(nb, copy)
    assert glossary.sync_notebook(copy) is True
    synced = nbformat.read(copy, as_version=4)
    assert [c.source for c in synced.cells if "{glossary}" in c.source] == [glossary.to_myst()]
    others = [c.source for c in synced.cells if "{glossary}" not in c.source]
    assert others == [c.source for c in nb.cells if "{glossary}" not in c.source]
    assert glossary.sync_notebook(copy) is False


def test_sync_notebook_needs_exactly_one_glossary_cell(tmp_path):
    path = tmp_path / "none.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# no glossary")]), path)
    with pytest.raises(ValueError, match="found 0"):
        glossary.sync_notebook(path)
