"""Mermaid diagrams rendered once into static SVG, for the HTML book and the Colab edition.

A diagram is rendered by the real renderer (the vendored ``mermaid.min.js`` in headless
Chromium, through Playwright), so its boxes size to their text and the page needs no script: it
reads from ``file://`` and in any notebook viewer. Each SVG is stored under a key that hashes
the diagram's source, the renderer's configuration and the mermaid build (:func:`diagram_key`),
in a cache folder that the repository commits (``book/_diagrams``): a build renders only the
diagrams it has not seen, and a fresh clone needs no browser until a diagram changes.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

#: mermaid's configuration for every diagram: one font family, measured where it renders.
#: (Labels stay HTML in a foreignObject, which browsers also draw inside an ``<img>``; mermaid's
#: SVG-text labels cannot break lines at ``<br/>``.)
_MERMAID_CONFIG = {
    "startOnLoad": False,
    "securityLevel": "strict",
    "theme": "default",
    "flowchart": {"useMaxWidth": True},
    "fontFamily": "DejaVu Sans, Verdana, Arial, sans-serif",
}

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]

# mermaid returns HTML markup (``<br>`` in labels); re-serializing the parsed element gives XML,
# which an SVG file (an ``<img>``, a notebook attachment) needs.
_RENDER = """async ([key, source, config]) => {
  mermaid.initialize(config);
  const {svg} = await mermaid.render(key, source);
  const holder = document.createElement('div');
  holder.innerHTML = svg;
  return new XMLSerializer().serializeToString(holder.firstElementChild);
}"""


def diagram_key(source: str, mermaid_js: Path) -> str:
    """``mermaid-`` and 16 hex digits of sha256 over the mermaid build, the config and the source."""
    digest = hashlib.sha256(mermaid_js.read_bytes())
    digest.update(json.dumps(_MERMAID_CONFIG, sort_keys=True).encode())
    digest.update(source.strip().encode())
    return "mermaid-" + digest.hexdigest()[:16]


def _chromium_executable() -> str | None:
    """Debian's Chromium (CI installs it), or None where Playwright's own browser must serve."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


def render_svgs(sources: list[str], cache: Path, mermaid_js: Path) -> dict[str, str]:
    """Map each diagram source to its SVG, rendering only those missing from ``cache``.

    One headless Chromium renders every missing diagram; each result is written to
    ``cache/<key>.svg``. A syntax error in a diagram raises ``ValueError`` naming the diagram.
    """
    keys = {source: diagram_key(source, mermaid_js) for source in sources}
    missing = [s for s, k in keys.items() if not (cache / f"{k}.svg").exists()]
    if missing:
        from playwright.sync_api import Error, sync_playwright

        cache.mkdir(parents=True, exist_ok=True)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=_chromium_executable(), args=CHROMIUM_ARGS)
            page = browser.new_page()
            page.route("**/*", lambda route: route.abort())          # nothing leaves the machine
            page.set_content("<!doctype html><html><body></body></html>")
            page.add_script_tag(content=mermaid_js.read_text(encoding="utf-8"))
            for source in missing:
                try:
                    svg = page.evaluate(_RENDER, [keys[source], source.strip(), _MERMAID_CONFIG])
                except Error as error:
                    raise ValueError(f"mermaid cannot render this diagram:\n{source}\n{error}") from None
                (cache / f"{keys[source]}.svg").write_text(_round_coordinates(svg) + "\n", encoding="utf-8")
            browser.close()
    return {source: (cache / f"{key}.svg").read_text(encoding="utf-8").strip() for source, key in keys.items()}


def _round_coordinates(svg: str, digits: int = 1) -> str:
    """Round the numbers inside attribute values (path data, transforms) to ``digits`` decimals:
    mermaid writes 16 significant digits, which makes a small diagram 100 kB."""
    def round_attribute(match):
        value = re.sub(r"-?\d+\.\d{%d,}" % (digits + 1), lambda m: f"{float(m.group()):.{digits}f}", match.group(2))
        return f'{match.group(1)}="{value}"'

    return re.sub(r'(\s[\w:-]+)="([^"]*)"', round_attribute, svg)


_FENCE = re.compile(r"^(`{3,}|~{3,})\{?mermaid\}?[ \t]*\n(.*?)^\1[ \t]*$", re.M | re.S)


def diagram_sources(markdown: str) -> list[str]:
    """The mermaid diagrams of a Markdown text: ```` ```mermaid ```` fences and ```` ```{mermaid} ````
    directives (their ``:option:`` lines dropped), in order."""
    return ["\n".join(line for line in body.splitlines() if not line.startswith(":")).strip()
            for _, body in _FENCE.findall(markdown)]


def book_diagram_sources(book: Path) -> list[str]:
    """Every diagram of the book's Markdown pages and notebooks' markdown cells, in file order."""
    sources = []
    for path in sorted(book.glob("*.md")) + sorted(book.glob("*.ipynb")):
        if path.suffix == ".md":
            texts = [path.read_text(encoding="utf-8")]
        else:
            cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
            texts = ["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"]
        for text in texts:
            sources += [s for s in diagram_sources(text) if s not in sources]
    return sources


def _refresh_cache(book: Path) -> tuple[int, list[str]]:
    """Render the book's new diagrams into ``book/_diagrams`` and delete SVGs no diagram uses.

    Returns the number of diagrams and the names of the deleted files.
    """
    cache, mermaid_js = book / "_diagrams", book / "_static" / "vendor" / "mermaid" / "mermaid.min.js"
    sources = book_diagram_sources(book)
    render_svgs(sources, cache, mermaid_js)
    used = {f"{diagram_key(s, mermaid_js)}.svg" for s in sources}
    stale = sorted(p.name for p in cache.glob("*.svg") if p.name not in used)
    for name in stale:
        (cache / name).unlink()
    return len(sources), stale


def svg_size(svg: str) -> tuple[float, float]:
    """Width and height of a rendered diagram, from its ``viewBox``."""
    match = re.search(r'viewBox="[-\d.]+ [-\d.]+ ([\d.]+) ([\d.]+)"', svg)
    if match is None:
        raise ValueError("the SVG has no viewBox")
    return float(match.group(1)), float(match.group(2))


def standalone_svg(svg: str) -> str:
    """The SVG as a file for an ``<img>``: explicit width and height (its natural size) instead
    of mermaid's ``width="100%"`` and ``max-width`` style, which size it only inline."""
    width, height = svg_size(svg)
    head, rest = svg.split(">", 1)
    head = re.sub(r'\swidth="[^"]*"', "", head)
    head = re.sub(r'\sstyle="max-width:[^"]*"', "", head)
    head = head.replace("<svg", f'<svg width="{width:g}" height="{height:g}"', 1)
    return head + ">" + rest


if __name__ == "__main__":
    count, deleted = _refresh_cache(Path("book"))
    print(f"book/_diagrams: {count} diagrams" + (f", deleted unused {deleted}" if deleted else ""))
