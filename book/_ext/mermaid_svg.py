"""Sphinx extension: mermaid diagrams as inline static SVG, rendered once at build time.

Replaces sphinxcontrib-mermaid, whose diagrams are drawn by a script in the reader's browser
(fixed-height boxes, and raw source when the page is opened from ``file://``). A ```` ```mermaid ````
fence (``myst_fence_as_directive``) or a ``{mermaid}`` directive becomes the SVG that
:func:`normtools.book.diagrams.render_svgs` made with the vendored mermaid in headless Chromium,
kept in the committed cache ``book/_diagrams`` (a diagram is rendered only when it is new).
"""

import html
from pathlib import Path

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.util.docutils import SphinxDirective

MERMAID_JS = Path("book/_static/vendor/mermaid/mermaid.min.js")
CACHE = Path("book/_diagrams")


class MermaidSvg(SphinxDirective):
    """The diagram in the directive's body, as an inline SVG in a ``<figure class="diagram">``."""

    has_content = True
    option_spec = {"alt": directives.unchanged, "caption": directives.unchanged}

    def run(self):
        from normtools.book.diagrams import render_svgs

        source = "\n".join(self.content).strip()
        if not source:
            raise self.error("an empty mermaid diagram")
        root = Path(self.env.srcdir)
        try:
            (svg,) = render_svgs([source], root / CACHE, root / MERMAID_JS).values()
        except ValueError as error:
            raise self.error(str(error)) from None
        svg = _legible(svg)
        label = html.escape(self.options.get("alt") or self.options.get("caption") or "diagram")
        caption = self.options.get("caption")
        figure = (f'<figure class="diagram" role="img" aria-label="{label}" '
                  f'style="margin: 1em 0; text-align: center; overflow-x: auto">{svg}'
                  + (f"<figcaption>{html.escape(caption)}</figcaption>" if caption else "") + "</figure>")
        return [nodes.raw("", figure, format="html")]


#: The smallest scale a diagram is drawn at: mermaid's 16 px labels stay >= 9 px on a phone. A
#: wider diagram than the page allows at that scale scrolls sideways inside its figure.
MIN_SCALE = 0.56


def _legible(svg):
    """Add a ``min-width`` of ``MIN_SCALE`` times the natural width to mermaid's ``max-width``."""
    from normtools.book.diagrams import svg_size

    width, _ = svg_size(svg)
    return svg.replace('style="max-width:', f'style="min-width: {MIN_SCALE * width:.0f}px; max-width:', 1)


def setup(app):
    app.add_directive("mermaid", MermaidSvg)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
