"""Sphinx extension: author-year labels in the bibliography, to match the author-year citations.

The text cites with ``bibtex_reference_style: author_year`` ("Zhang and Sennrich, 2019"), while
pybtex's styles label the bibliography with numbers ("[1]") or initials ("[ZS19]"). This registers
the pybtex formatting style ``author_year``: pybtex's ``plain`` with the citation text as label
("Cohere, 2025" for one author, "Zhang and Sennrich, 2019" for two, "Ba et al., 2016" for three
or more; a letter follows the year when two entries would get the same label), entries sorted by
that label. ``_config.yml`` selects it with ``bibtex_default_style: author_year``.
"""

from pybtex.plugin import register_plugin
from pybtex.style.formatting.plain import Style as PlainStyle
from pybtex.style.labels import BaseLabelStyle
from pybtex.style.sorting import BaseSortingStyle


def _last_name(person) -> str:
    return " ".join(part.render_as("text") for part in person.rich_last_names)


def author_year_label(entry) -> str:
    """"A, year", "A and B, year" or "A et al., year" from the entry's authors (else editors)."""
    persons = entry.persons.get("author") or entry.persons.get("editor") or []
    names = [_last_name(p) for p in persons]
    if not names:
        names = [entry.key]
    if len(names) == 1:
        who = names[0]
    elif len(names) == 2 and names[1] != "others":
        who = f"{names[0]} and {names[1]}"
    else:
        who = f"{names[0]} et al."
    return f"{who}, {entry.fields.get('year', 'n.d.')}"


class AuthorYearLabelStyle(BaseLabelStyle):
    def format_labels(self, sorted_entries):
        labels = [author_year_label(entry) for entry in sorted_entries]
        for i, label in enumerate(labels):
            same = [j for j, other in enumerate(labels) if other == label]
            yield label if len(same) == 1 else label + "abcdefghijklmnopqrstuvwxyz"[same.index(i)]


class AuthorYearSortingStyle(BaseSortingStyle):
    def sorting_key(self, entry):
        return author_year_label(entry).lower(), entry.fields.get("title", "")


class AuthorYearStyle(PlainStyle):
    default_label_style = "author_year"
    default_sorting_style = "author_year"


def register() -> None:
    """Make the label style and the formatting style known to pybtex (idempotent)."""
    for group, name, plugin in (("pybtex.style.labels", "author_year", AuthorYearLabelStyle),
                                ("pybtex.style.sorting", "author_year", AuthorYearSortingStyle),
                                ("pybtex.style.formatting", "author_year", AuthorYearStyle)):
        try:
            register_plugin(group, name, plugin)
        except Exception:  # already registered (Sphinx may load the extension twice)
            pass


def setup(app):
    register()
    return {"parallel_read_safe": True, "parallel_write_safe": True}
