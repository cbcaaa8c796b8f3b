"""book/references.bib as the book renders it: titles keep their capitals, and the bibliography's
labels are author-year, like the citations in the text (book/_ext/bib_author_year.py)."""

import re
import sys
from pathlib import Path

import pytest
import yaml
from pybtex.database import parse_file
from pybtex.plugin import find_plugin
from pybtex.richtext import Text

ROOT = Path(__file__).resolve().parents[2]
BIB = ROOT / "book" / "references.bib"
sys.path.insert(0, str(ROOT / "book" / "_ext"))
import bib_author_year  # noqa: E402

bib_author_year.register()


@pytest.fixture(scope="module")
def formatted():
    entries = parse_file(str(BIB)).entries
    style = find_plugin("pybtex.style.formatting", "author_year")()
    return entries, list(style.format_entries(style.sort(entries.values())))  # as sphinxcontrib-bibtex does


def test_config_selects_the_author_year_style_and_loads_the_extension():
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    sphinx = config["sphinx"]
    assert sphinx["config"]["bibtex_reference_style"] == "author_year"
    assert sphinx["config"]["bibtex_default_style"] == "author_year"
    assert sphinx["local_extensions"]["bib_author_year"] == "book/_ext"


def test_rendered_titles_keep_every_capital(formatted):
    """pybtex's plain style sentence-cases titles; only braces protect a capital."""
    entries, rendered = formatted
    for entry in rendered:
        title = entries[entry.key].fields["title"]
        written = Text.from_latex(title).render_as("text")
        assert written in entry.text.render_as("text"), (
            f"{entry.key}: the bibliography renders the title {title!r} with different case; "
            "put braces around each word that has a capital")


def test_labels_are_author_year_and_unique(formatted):
    entries, rendered = formatted
    labels = [e.label for e in rendered]
    assert len(set(labels)) == len(labels)
    for entry in rendered:
        year = entries[entry.key].fields["year"]
        assert re.fullmatch(rf"[^\d,]+, {year}[a-z]?", entry.label), entry.label
    by_key = {e.key: e.label for e in rendered}
    assert by_key["zhang2019rmsnorm"] == "Zhang and Sennrich, 2019"
    assert by_key["ba2016layernorm"] == "Ba et al., 2016"
    assert labels == sorted(labels, key=str.lower)


def test_same_authors_and_year_get_distinct_letters():
    from pybtex.database import Entry, Person

    def entry(title):
        e = Entry("article", fields={"title": title, "year": "2024"})
        e.persons["author"] = [Person("Doe, Jane")]
        return e

    labels = list(bib_author_year.AuthorYearLabelStyle().format_labels([entry("A"), entry("B")]))
    assert labels == ["Doe, 2024a", "Doe, 2024b"]
