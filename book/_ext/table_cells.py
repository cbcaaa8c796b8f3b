"""Sphinx extension: where the cells of an output table may wrap, and where they may not.

Table cells break between words only (book/_static/normbook.css), never inside a number. Two
cases need help from the HTML itself:

* a long snake_case column name (attn_spacing_at_max) gets a ``<wbr>`` after each underscore,
  so a wide table can still fit the column at desktop width, wrapping the name there and only
  there;
* a number with an exponent or a sign (``1e-06``, ``-0.5``) is wrapped in
  ``<span class="number">`` (``white-space: nowrap``): browsers break after its hyphen.
"""

import re

from docutils import nodes

_CELL = re.compile(r"(<t([hd])\b[^>]*>)([^<]*)(</t\2>)")
_SIGNED_OR_EXPONENT = re.compile(r"(?<![\w.])(?:[-+−]\d[\d.,]*(?:[eE][-+−]?\d+)?|\d[\d.,]*[eE][-+−]?\d+)")


def _cell(match):
    opening, kind, text, closing = match.groups()
    text = _SIGNED_OR_EXPONENT.sub(lambda m: f'<span class="number">{m.group(0)}</span>', text)
    if kind == "h":
        text = re.sub(r"_(?=\w)", "_<wbr>", text)
    return opening + text + closing


def _table_cells(app, doctree, docname):
    for raw in doctree.findall(nodes.raw):
        if raw.get("format") == "html" and "<t" in raw.astext():
            raw.children = [nodes.Text(_CELL.sub(_cell, raw.astext()))]


def setup(app):
    app.connect("doctree-resolved", _table_cells)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
