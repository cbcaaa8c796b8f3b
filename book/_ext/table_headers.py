"""Sphinx extension: a long column name of an output table may wrap after each underscore.

Table cells never break inside a word or a number (book/_static/normbook.css), so a table of long
snake_case column names (attn_spacing_at_max) could not fit the column at desktop width. A
``<wbr>`` after each underscore of a header lets the name wrap there, and only there.
"""

import re

from docutils import nodes

_HEADER = re.compile(r"(<th\b[^>]*>)([^<]*)(</th>)")


def _breakable_headers(app, doctree, docname):
    for raw in doctree.findall(nodes.raw):
        if raw.get("format") == "html" and "<th" in raw.astext():
            text = _HEADER.sub(lambda m: m.group(1) + m.group(2).replace("_", "_<wbr>") + m.group(3), raw.astext())
            raw.children = [nodes.Text(text)]


def setup(app):
    app.connect("doctree-resolved", _breakable_headers)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
