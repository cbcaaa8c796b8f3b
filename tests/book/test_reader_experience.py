"""The built book as a reader gets it: every page opened in headless Chromium, offline.

Uses the build in ``_build/html`` (``make book``; ``.ci/run`` builds it before the tests). Outside
CI a missing build or a missing Chromium skips these tests; under CI (``CI=true``) it fails them.
Screenshots go to ``_build/screenshots/`` (a CI artifact), the page-weight report to
``_build/page_weight.json``.
"""

import functools
import http.server
import json
import os
import re
import shutil
import threading
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
# NORMBOOK_SITE points the tests at a build elsewhere (e.g. one made from a copy of the sources).
SITE = Path(os.environ.get("NORMBOOK_SITE", ROOT / "_build" / "html"))
SCREENSHOTS = ROOT / "_build" / "screenshots"
README_SCREENSHOT = ROOT / "book" / "_static" / "readme" / "chapter-page.png"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
CONFIG = yaml.safe_load((ROOT / "_config.yml").read_text())
CHAPTER_NOTEBOOKS = sorted((ROOT / "book").glob("*.ipynb"))


def _require(condition, reason):
    if not condition:
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)


@pytest.fixture(scope="module")
def site():
    _require((SITE / "index.html").exists(), "no built book in _build/html: run `make book` first")
    return SITE


def _pages(site):
    skip = {"genindex.html", "search.html"}
    return sorted(p for p in site.rglob("*.html") if p.name not in skip and "_static" not in p.parts)


def _ids(html_path, cache={}):
    from bs4 import BeautifulSoup

    if html_path not in cache:
        soup = BeautifulSoup(html_path.read_text(encoding="utf-8"), "html.parser")
        cache[html_path] = {t.get("id") for t in soup.find_all(id=True)} | {
            t.get("name") for t in soup.find_all(attrs={"name": True})}
    return cache[html_path]


def test_internal_links_and_anchors_resolve(site):
    """Every relative href/src points at a file of the build, and every #anchor exists there."""
    from bs4 import BeautifulSoup

    for page in _pages(site):
        soup = BeautifulSoup(page.read_text(encoding="utf-8"), "html.parser")
        for tag, attr in (("a", "href"), ("link", "href"), ("img", "src"), ("script", "src")):
            for element in soup.find_all(tag, attrs={attr: True}):
                url = urlsplit(element[attr])
                if url.scheme or url.netloc or element[attr].startswith(("mailto:", "javascript:")):
                    continue
                target = (page.parent / unquote(url.path)).resolve() if url.path else page
                if target.is_dir():
                    target = target / "index.html"
                where = f"{page.relative_to(site)}: <{tag} {attr}={element[attr]!r}>"
                assert target.exists(), f"broken link {where}"
                if url.fragment and target.suffix == ".html":
                    assert unquote(url.fragment) in _ids(target), f"missing anchor {where}"


def _cited_keys():
    pattern = re.compile(r"\{cite(?::[a-z]+)?\}`([^`]+)`")
    keys = set()
    for path in sorted((ROOT / "book").glob("*.ipynb")) + sorted((ROOT / "book").glob("*.md")):
        for match in pattern.finditer(path.read_text(encoding="utf-8")):
            keys |= {k.strip() for k in match.group(1).split(",")}
    return keys


def _bib_keys():
    text = (ROOT / "book" / "references.bib").read_text(encoding="utf-8")
    return set(re.findall(r"^@\w+\{([^,\s]+),", text, flags=re.M))


def test_every_citation_resolves_and_every_source_is_cited(site):
    cited, known = _cited_keys(), _bib_keys()
    assert cited, "no {cite} in the chapters"
    unknown = sorted(cited - known)
    assert not unknown, f"cited but not in references.bib: {unknown[0]}"
    uncited = sorted(known - cited)
    assert not uncited, f"in references.bib but cited from no chapter: {uncited[0]}"
    from bs4 import BeautifulSoup

    sources = BeautifulSoup((site / "book" / "08_sources.html").read_text(encoding="utf-8"), "html.parser")
    entries = {div["id"] for div in sources.find_all("div", attrs={"role": "doc-biblioentry"})}
    assert len(entries) == len(known), f"{len(entries)} entries on the Sources page for {len(known)} keys"
    for page in _pages(site):
        soup = BeautifulSoup(page.read_text(encoding="utf-8"), "html.parser")
        for link in soup.find_all("a", href=re.compile(r"08_sources\.html#")):
            anchor = link["href"].split("#", 1)[1]
            if link.find_parent(attrs={"role": "doc-biblioentry"}) is None and anchor.startswith("id"):
                assert anchor in entries, f"{page.name}: citation link {link['href']} is not a bibliography entry"


def test_every_stored_figure_is_on_its_page(site):
    """Each chapter's PNG outputs reach its page as images (a headless backend would drop them)."""
    for notebook in CHAPTER_NOTEBOOKS:
        cells = json.loads(notebook.read_text())["cells"]
        figures = sum("image/png" in output.get("data", {})
                      for cell in cells if cell["cell_type"] == "code" for output in cell.get("outputs", []))
        page = (site / "book" / notebook.name).with_suffix(".html").read_text(encoding="utf-8")
        shown = len(re.findall(r'<img[^>]+src="(?!\.\./_static/)[^"]+\.png"', page))
        assert shown >= figures, f"{notebook.name}: {figures} figures stored, {shown} on the page"


def test_colab_buttons_point_at_the_colab_edition_in_the_repository(site):
    repository = CONFIG["repository"]
    owner_repo = urlsplit(repository["url"]).path.strip("/")
    for notebook in CHAPTER_NOTEBOOKS:
        relative = notebook.relative_to(ROOT).as_posix()
        edition = f"{repository['path_to_book']}/{relative}"          # colab/book/<chapter>.ipynb
        assert (ROOT / edition).exists(), f"no Colab edition {edition}: run `make colab`"
        expected = (f"{CONFIG['launch_buttons']['colab_url']}/github/{owner_repo}/blob/"
                    f"{repository['branch']}/{edition}")
        page = (site / relative).with_suffix(".html").read_text(encoding="utf-8")
        assert expected in page, f"{relative}: no Colab button to {expected}"
        first_code_cell = next(c for c in json.loads(notebook.read_text())["cells"] if c["cell_type"] == "code")
        assert f'REPOSITORY_URL = "{repository["url"]}"' in "".join(first_code_cell["source"])


@pytest.fixture(scope="module")
def browser(site):
    _require(CHROMIUM is not None, "Chromium is not installed (apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _require(False, "playwright is not installed (pip install playwright)")
    handler = functools.partial(QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium, f"http://127.0.0.1:{server.server_address[1]}"
        chromium.close()
    server.shutdown()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


# Diagrams are static SVG (book/_ext/mermaid_svg.py): a figure.diagram holding an <svg> with
# drawn content; any mermaid source left for a script to draw (pre.mermaid) counts as unrendered.
READ_PAGE_STATE = """async () => {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) { await MathJax.startup.promise; }
  const maths = [...document.querySelectorAll('.math')];
  const diagrams = [...document.querySelectorAll('figure.diagram')];
  const drawn = d => { const svg = d.querySelector(':scope > svg');
    return svg && svg.querySelectorAll('g, path, rect').length > 3 && svg.textContent.trim().length > 0; };
  return {
    math: maths.length,
    math_unrendered: maths.filter(m => !m.querySelector('mjx-container') && m.tagName !== 'MJX-CONTAINER').length,
    math_errors: document.querySelectorAll('mjx-merror').length,
    mermaid: diagrams.length,
    mermaid_unrendered: diagrams.filter(d => !drawn(d)).length
      + document.querySelectorAll('pre.mermaid, div.mermaid, code.language-mermaid').length,
    images_broken: [...document.images].filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src),
  };
}"""


def test_every_page_renders_offline_without_errors(site, browser):
    chromium, base = browser
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    context = chromium.new_context(viewport={"width": 1280, "height": 900})
    problems = []
    for path in _pages(site):
        name = path.relative_to(site).as_posix()
        if 'http-equiv="refresh"' in path.read_text(encoding="utf-8").lower():
            continue  # a redirect stub (index.html -> book/intro.html); its target is checked itself
        page = context.new_page()
        errors, external = [], []
        page.on("pageerror", lambda e, errors=errors: errors.append(f"exception: {e}"))
        page.on("console", lambda m, errors=errors: errors.append(f"console: {m.text}") if m.type == "error" else None)
        page.on("requestfailed", lambda r, errors=errors: errors.append(f"failed request: {r.url}"))

        def route(request_route, external=external):
            if request_route.request.url.startswith(base):
                request_route.continue_()
            else:
                external.append(request_route.request.url)
                request_route.abort()

        page.route("**/*", route)
        page.goto(f"{base}/{name}", wait_until="load")
        state = page.evaluate(READ_PAGE_STATE)
        page.screenshot(path=str(SCREENSHOTS / (name.replace("/", "__").removesuffix(".html") + ".png")),
                        full_page=True)
        if name == "book/01_definition.html" and os.environ.get("NORMBOOK_UPDATE_README_SCREENSHOT"):
            README_SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(README_SCREENSHOT))
        page.close()
        errors = [e for e in errors if not any(u in e for u in external)]
        for label, bad in (("JavaScript errors", errors), ("requests leaving the machine", external),
                           ("math left unrendered", state["math_unrendered"]),
                           ("MathJax errors", state["math_errors"]),
                           ("mermaid diagrams left unrendered", state["mermaid_unrendered"]),
                           ("images that did not load", state["images_broken"])):
            if bad:
                problems.append(f"{name}: {label}: {bad}")
    context.close()
    assert not problems, "\n".join(problems)


def test_math_and_mermaid_are_present_where_the_book_uses_them(site, browser):
    """The checks above must have something to check: the Flow chapter has a diagram, the
    Definition chapter has math, and both render in the browser."""
    chromium, base = browser
    page = chromium.new_page()
    page.route("**/*", lambda r: r.continue_() if r.request.url.startswith(base) else r.abort())
    page.goto(f"{base}/book/02_flow.html", wait_until="load")
    flow = page.evaluate(READ_PAGE_STATE)
    page.goto(f"{base}/book/01_definition.html", wait_until="load")
    definition = page.evaluate(READ_PAGE_STATE)
    page.close()
    assert flow["mermaid"] >= 1 and flow["mermaid_unrendered"] == 0
    assert definition["math"] >= 1 and definition["math_unrendered"] == 0


def test_page_weight_is_reported_and_figures_are_sensible(site):
    from PIL import Image

    files = [p for p in site.rglob("*") if p.is_file()]
    pages = _pages(site)
    largest = max(pages, key=lambda p: p.stat().st_size)
    images = sorted((site / "_images").glob("*")) if (site / "_images").exists() else []
    report = {
        "site_bytes": sum(p.stat().st_size for p in files),
        "site_files": len(files),
        "largest_page": largest.relative_to(site).as_posix(),
        "largest_page_bytes": largest.stat().st_size,
        "figures": [{"file": p.name, "bytes": p.stat().st_size,
                     "pixels": list(Image.open(p).size) if p.suffix == ".png" else None} for p in images],
    }
    (site.parent / "page_weight.json").write_text(json.dumps(report, indent=1))
    print(f"\nsite: {report['site_bytes'] / 2**20:.1f} MiB in {report['site_files']} files; largest page "
          f"{report['largest_page']} {report['largest_page_bytes'] / 2**10:.0f} KiB")
    assert report["largest_page_bytes"] < 4 * 2**20, "a page over 4 MiB"
    for figure in report["figures"]:
        if figure["pixels"]:
            assert max(figure["pixels"]) <= 2400, f"{figure['file']}: {figure['pixels']} px is more than a page needs"
            assert figure["bytes"] <= 400 * 2**10, f"{figure['file']}: {figure['bytes']} bytes"


def test_readme_shows_a_chapter_screenshot_made_by_this_test():
    readme = (ROOT / "README.md").read_text()
    assert README_SCREENSHOT.relative_to(ROOT).as_posix() in readme
    assert README_SCREENSHOT.exists(), "run NORMBOOK_UPDATE_README_SCREENSHOT=1 make test"


DIAGRAM_GEOMETRY = """() => [...document.querySelectorAll('figure.diagram')].map(d => {
  const svg = d.querySelector(':scope > svg');
  if (!svg) { return {svg: false}; }
  const box = svg.getBoundingClientRect(), view = svg.viewBox.baseVal;
  return {svg: true, width: box.width, height: box.height, view_width: view.width,
          figure_right: d.getBoundingClientRect().right,
          view_height: view.height, shapes: svg.querySelectorAll('g, path, rect').length,
          text: svg.textContent.trim().slice(0, 40)};
})"""


def _diagram_counts():
    from normtools.book.diagrams import diagram_sources

    counts = {}
    for notebook in CHAPTER_NOTEBOOKS:
        cells = json.loads(notebook.read_text())["cells"]
        counts[notebook.stem] = sum(len(diagram_sources("".join(c["source"])))
                                    for c in cells if c["cell_type"] == "markdown")
    return {stem: n for stem, n in counts.items() if n}


@pytest.mark.parametrize("width", [1280, 390])
def test_diagrams_render_from_disk_and_size_to_their_content(site, browser, width):
    """Opened from file:// (no server, no script), every diagram is a drawn SVG, none shows its
    source, each is as tall as its content at the page's width (no fixed-height box), its labels
    stay legible (drawn at >= 0.55 of its size; a wider one scrolls inside its figure), and no
    figure runs off the page."""
    chromium, _ = browser
    counts = _diagram_counts()
    assert counts, "no mermaid diagram in any chapter: this test checks nothing"
    context = chromium.new_context(viewport={"width": width, "height": 900})
    problems = []
    for stem, expected in counts.items():
        page = context.new_page()
        page.route("**/*", lambda r: r.continue_() if r.request.url.startswith("file:") else r.abort())
        page.goto((site / "book" / f"{stem}.html").as_uri(), wait_until="load")
        diagrams = page.evaluate(DIAGRAM_GEOMETRY)
        raw_source = page.evaluate("() => /(^|\\n)\\s*(flowchart|graph) (LR|TD|TB|RL)/.test(document.body.innerText)")
        page.close()
        if len(diagrams) != expected or raw_source:
            problems.append(f"{stem}: {len(diagrams)} diagrams for {expected} in the source; raw source shown: {raw_source}")
            continue
        for i, d in enumerate(diagrams):
            where = f"{stem} diagram {i} at {width} px"
            if not d["svg"] or d["shapes"] <= 3 or not d["text"]:
                problems.append(f"{where}: not drawn ({d})")
            elif not (20 <= d["height"] <= 700 and d["figure_right"] <= width):
                problems.append(f"{where}: {d['width']:.0f} x {d['height']:.0f} px, figure ends at "
                                f"{d['figure_right']:.0f} px")
            elif d["width"] / d["view_width"] < 0.55:                  # 16 px labels below 9 px
                problems.append(f"{where}: drawn at {d['width'] / d['view_width']:.2f} of its size")
            elif abs(d["height"] / d["width"] - d["view_height"] / d["view_width"]) > 0.02:
                problems.append(f"{where}: box {d['width']:.0f} x {d['height']:.0f} px for a "
                                f"{d['view_width']:.0f} x {d['view_height']:.0f} drawing (empty space)")
    context.close()
    assert not problems, "\n".join(problems)


def test_no_page_draws_diagrams_with_a_script(site):
    """Diagrams are drawn at build time: no page loads mermaid's JavaScript."""
    for page in _pages(site):
        text = page.read_text(encoding="utf-8")
        assert not re.search(r"<script[^>]+mermaid", text), f"{page.name} loads mermaid"


CUT_OUTPUTS = """() => [...document.querySelectorAll('.cell_output *')]
  .filter(e => e.scrollWidth > e.clientWidth + 2 && getComputedStyle(e).overflowX !== 'visible')
  .filter(e => !e.closest('figure.diagram'))
  .filter((e, _, all) => !all.some(o => o !== e && o.contains(e)))
  .map(e => ({tag: e.tagName.toLowerCase(), shown: e.clientWidth, needs: e.scrollWidth,
              text: e.innerText.trim().slice(0, 50)}))"""


def test_no_output_is_cut_at_the_right_at_1280_px(site, browser):
    """Issue 17: at desktop width no cell output (text or table) needs sideways scrolling, the
    atlas's filterable table of every family included (issue 29)."""
    chromium, _ = browser
    context = chromium.new_context(viewport={"width": 1280, "height": 900})
    cut = []
    for notebook in CHAPTER_NOTEBOOKS:
        html = site / "book" / f"{notebook.stem}.html"
        if not html.exists():
            continue
        page = context.new_page()
        page.route("**/*", lambda r: r.continue_() if r.request.url.startswith("file:") else r.abort())
        page.goto(html.as_uri(), wait_until="load")
        cut += [f"{notebook.stem}: <{c['tag']}> shows {c['shown']} of {c['needs']} px: {c['text']!r}"
                for c in page.evaluate(CUT_OUTPUTS)]
        page.close()
    context.close()
    assert not cut, f"{len(cut)} outputs cut at 1280 px:\n" + "\n".join(cut[:40])


# ------------------------------------------------------------- issue 29: reading at 1280 and 390 px

def _chapter_pages(site):
    return [(n.stem, site / "book" / f"{n.stem}.html") for n in CHAPTER_NOTEBOOKS
            if (site / "book" / f"{n.stem}.html").exists()]


def _open_each_chapter(chromium, site, width, script, dark=False, height=900, stems=None):
    """``script``'s result on every chapter page (or those of ``stems``) opened from disk in a
    ``width`` x ``height`` px viewport."""
    context = chromium.new_context(viewport={"width": width, "height": height})
    results = {}
    for stem, html in _chapter_pages(site):
        if stems is not None and stem not in stems:
            continue
        page = context.new_page()
        page.route("**/*", lambda r: r.continue_() if r.request.url.startswith("file:") else r.abort())
        page.goto(html.as_uri(), wait_until="load")
        if dark:
            page.evaluate("() => { document.documentElement.dataset.theme = 'dark'; }")
        results[stem] = page.evaluate(script)
        page.close()
    context.close()
    return results


# A number (1024, 131072, 1.076x, 3.1e-05, -0.5, 20,914,757,184) drawn on more than one line.
SPLIT_NUMBERS = r"""() => {
  const number = /(?<![\w.])(?:(?<![\w.-])[-+−])?\d[\d.,]*(?:[eE][-+−]?\d+)?[%x×]?/g, split = [];
  for (const cell of document.querySelectorAll('article td, article th')) {
    const walker = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
      for (const match of node.data.matchAll(number)) {
        if (match[0].length < 2) continue;
        const range = document.createRange();
        range.setStart(node, match.index); range.setEnd(node, match.index + match[0].length);
        const tops = new Set([...range.getClientRects()].filter(r => r.width > 0).map(r => Math.round(r.top)));
        if (tops.size > 1) split.push(match[0] + ' in "' + cell.innerText.trim().slice(0, 30) + '"');
      }
    }
  }
  return split;
}"""


@pytest.mark.parametrize("width", [1280, 390])
def test_no_table_cell_splits_a_number_across_lines(site, browser, width):
    """Issue 29: at 390 px `4096` showed as `40|96` and `131072` as `131|072`."""
    chromium, _ = browser
    split = {stem: found for stem, found in _open_each_chapter(chromium, site, width, SPLIT_NUMBERS).items() if found}
    assert not split, f"numbers split across lines at {width} px: " + "; ".join(
        f"{stem}: {found[:4]}" for stem, found in split.items())


PHONE_GEOMETRY = """() => ({
  page: document.documentElement.scrollWidth,
  widest: [...document.querySelectorAll('article *')]
    .filter(e => e.getBoundingClientRect().right > window.innerWidth + 1)
    .filter(e => { for (let p = e.parentElement; p; p = p.parentElement) {
      if (getComputedStyle(p).overflowX !== 'visible') return false; } return true; })
    .slice(0, 3).map(e => e.tagName.toLowerCase() + ': ' + (e.innerText || '').trim().slice(0, 40)),
  diagrams: [...document.querySelectorAll('figure.diagram')].map(d => {
    const box = d.getBoundingClientRect(), svg = d.querySelector('svg');
    return {left: box.left, right: box.right,
            ground: svg ? getComputedStyle(svg).backgroundColor : null}; }),
})"""


def _lightness(css_color):
    """0 (black or transparent) to 1 (white) of a computed ``rgb(a)`` colour."""
    values = [float(v) for v in re.findall(r"[\d.]+", css_color)]
    if len(values) == 4 and values[3] == 0:
        return 0.0
    return sum(values[:3]) / (3 * 255)


def test_no_page_or_diagram_is_wider_than_a_phone(site, browser):
    """Issue 29: at 390 px three pages were 397-454 px wide (long inline code names) and wide
    diagrams lost 121-218 px off-screen; a wide table or diagram scrolls inside its own box."""
    chromium, _ = browser
    problems = []
    for stem, geometry in _open_each_chapter(chromium, site, 390, PHONE_GEOMETRY).items():
        if geometry["page"] > 390:
            problems.append(f"{stem}: page {geometry['page']} px wide: {geometry['widest']}")
        for i, d in enumerate(geometry["diagrams"]):
            if d["left"] < 0 or d["right"] > 390:
                problems.append(f"{stem} diagram {i}: from {d['left']:.0f} to {d['right']:.0f} px")
    assert not problems, "\n".join(problems)


def test_diagram_lines_stay_visible_in_dark_mode(site, browser):
    """Mermaid draws its arrows in dark grey: on the dark theme each diagram keeps a light ground."""
    chromium, _ = browser
    dark = _open_each_chapter(chromium, site, 1280, PHONE_GEOMETRY, dark=True)
    grounds = [(stem, d["ground"]) for stem, g in dark.items() for d in g["diagrams"]]
    assert grounds, "no diagram to check"
    assert all(_lightness(ground) > 0.8 for _, ground in grounds), [g for g in grounds if _lightness(g[1]) <= 0.8]


IN_PAGE_CONTENTS = """() => {
  const toc = document.querySelector('.bd-sidebar-secondary');
  const box = toc ? toc.getBoundingClientRect() : null;
  return {shown: !!toc && getComputedStyle(toc).display !== 'none' && box.width > 100 && box.left < innerWidth,
          links: toc ? toc.querySelectorAll('a[href^="#"]').length : 0,
          sections: document.querySelectorAll('article section section').length};
}"""


def test_the_page_contents_show_at_desktop_width(site, browser):
    """Issue 29: the in-page table of contents was hidden at >= 960 px; pages run 16-26 thousand
    pixels and the sidebar lists chapters only."""
    chromium, _ = browser
    missing = [stem for stem, toc in _open_each_chapter(chromium, site, 1280, IN_PAGE_CONTENTS).items()
               if toc["sections"] >= 2 and not (toc["shown"] and toc["links"] >= 2)]
    assert not missing, f"no in-page contents at 1280 px: {missing}"


def _stored_captions(notebook):
    """(caption, cell tags) for every printed line that a cell's next output (a table or a
    figure) follows directly in the notebook: the line that introduces that output. Read from the
    executed copy the page was built from (a caption may state the run's load average)."""
    captions = []
    for cell in json.loads(notebook.read_text())["cells"]:
        outputs = cell.get("outputs", []) if cell["cell_type"] == "code" else []
        for before, after in zip(outputs, outputs[1:]):
            if before["output_type"] == "stream" and before["name"] == "stdout" and after["output_type"] in (
                    "display_data", "execute_result") and {"text/html", "image/png"} & set(after.get("data", {})):
                lines = "".join(before["text"]).rstrip("\n").split("\n")
                captions.append((lines[-1].strip(), set(cell["metadata"].get("tags", []))))
    return captions


def test_each_output_is_directly_under_its_caption(site):
    """Issue 29: where one cell prints a caption, shows a table, prints the next caption and shows
    the next table, the page must keep that order (myst-nb's merged streams put every caption
    above the first table)."""
    from bs4 import BeautifulSoup

    checked, problems = 0, []
    for stem, html in _chapter_pages(site):
        soup = BeautifulSoup(html.read_text(encoding="utf-8"), "html.parser")
        streams = soup.select("div.cell_output div.output.stream")
        executed = site.parent / "src" / "book" / f"{stem}.ipynb"    # what the page was built from
        source = executed if executed.exists() else ROOT / "book" / f"{stem}.ipynb"
        for caption, tags in _stored_captions(source):
            if tags & {"remove-cell", "remove-output"} or not caption:
                continue
            holding = [s for s in streams if caption in s.get_text()]
            if not holding:
                problems.append(f"{stem}: caption {caption!r} is not on the page")
                continue
            ok = False
            for stream in holding:
                last_line = stream.get_text().rstrip("\n").split("\n")[-1].strip()
                after = stream.find_next_sibling()                    # a table's div or a figure's img
                ok |= last_line == caption and after is not None and (
                    after.name == "img" or "output" in after.get("class", []))
            checked += 1
            if not ok:
                problems.append(f"{stem}: {caption!r} is not directly above its output")
    assert checked >= 5, "no caption followed by a table or figure in the chapters: nothing checked"
    assert not problems, "\n".join(problems)


def test_no_table_on_a_page_drops_rows(site):
    """A displayed DataFrame over pandas' display.max_rows shows '...' rows and 'N rows x M
    columns': every row of a table reaches the reader (full_table, or pandas options)."""
    from bs4 import BeautifulSoup

    dropped = []
    for stem, html in _chapter_pages(site):
        soup = BeautifulSoup(html.read_text(encoding="utf-8"), "html.parser")
        for table in soup.select("div.cell_output table"):
            rows = table.select("tbody > tr")
            ellipsis_rows = [r for r in rows if r.find_all(["td", "th"]) and
                             all(c.get_text(strip=True) in ("...", "…") for c in r.find_all("td"))]
            footer = table.find_next_sibling("p")
            declared = re.match(r"\s*(\d+) rows × \d+ columns", footer.get_text()) if footer else None
            if ellipsis_rows or (declared and int(declared.group(1)) != len(rows)):
                dropped.append(f"{stem}: {table.get_text(' ', strip=True)[:60]!r}: {len(rows)} rows shown"
                               + (f" of {declared.group(1)}" if declared else ""))
    assert not dropped, "\n".join(dropped)


def _glue_statement(node):
    """A statement that only glues a number for the prose: glue(...)/glue_number(...), assigned
    or not, or a loop of such statements."""
    import ast

    if isinstance(node, (ast.Expr, ast.Assign)) and isinstance(node.value, ast.Call):
        func = node.value.func
        return getattr(func, "id", getattr(func, "attr", None)) in ("glue", "glue_number")
    if isinstance(node, ast.For):
        return all(_glue_statement(n) for n in node.body)
    return False


def test_no_visible_cell_is_mostly_glue_calls():
    """Glue is bookkeeping for the prose: a cell the reader sees shows the computation, and a cell
    made mostly of glue calls is tagged to be hidden (remove-cell / hide-input)."""
    import ast

    visible_glue = []
    for notebook in CHAPTER_NOTEBOOKS:
        for cell in json.loads(notebook.read_text())["cells"]:
            if cell["cell_type"] != "code" or set(cell["metadata"].get("tags", [])) & {
                    "remove-cell", "remove-input", "hide-input", "hide-cell"}:
                continue
            try:
                body = ast.parse("".join(cell["source"])).body
            except SyntaxError:                                   # IPython magics
                continue
            glue = sum(map(_glue_statement, body))
            if glue and 2 * glue > len(body):
                visible_glue.append(f"{notebook.stem} cell {cell.get('id')}: {glue} of {len(body)} statements glue")
    assert not visible_glue, "\n".join(visible_glue)


def test_colab_edition_links_into_the_book_resolve(site):
    """Every link of the Colab edition into the HTML book (GitHub Pages address) names a page of
    the build and an anchor on it, as test_internal_links_and_anchors_resolve does for the HTML
    (issue 29: `#term-rope` and `#term-qk-norm` missed their terms)."""
    from normtools.book.colab import html_book_url

    base = html_book_url(CONFIG["repository"]["url"])
    links = re.compile(r"\]\((" + re.escape(base) + r"[^)\s]*)\)")
    checked, broken = 0, []
    for edition in sorted((ROOT / "colab" / "book").glob("*.ipynb")):
        for cell in json.loads(edition.read_text())["cells"]:
            if cell["cell_type"] != "markdown":
                continue
            for url in links.findall("".join(cell["source"])):
                path, _, anchor = url[len(base):].partition("#")
                target = site / (path or "index.html")
                checked += 1
                if not target.exists():
                    broken.append(f"{edition.name}: {url} (no page)")
                elif anchor and unquote(anchor) not in _ids(target):
                    broken.append(f"{edition.name}: {url} (no anchor)")
    assert checked > 20, f"only {checked} links into the book in the Colab edition"
    assert not broken, "\n".join(broken)


# ------------------------------------------------------------- issue 36: a lesson in ten screens

SCREEN = {"width": 1280, "height": 800}   # a laptop screen; one "screen" is the viewport's height
CORE_CHAPTERS = ("01_definition", "02_flow", "03_solution", "05_examples")
MAX_SCREENS = 10

PAGE_HEIGHT = """async () => {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) { await MathJax.startup.promise; }
  return {height: document.documentElement.scrollHeight,
          open: [...document.querySelectorAll('details')].filter(d => d.open).length
            + document.querySelectorAll('.admonition.toggle:not(.toggle-hidden)').length};
}"""


def test_each_core_chapter_is_at_most_ten_screens_at_desktop_width(site, browser):
    """Issue 36: chapters 1, 2, 3 and 5 are each a lesson of at most ten screens at 1280 x 800,
    with collapsed sections (dropdowns, hide-cell/hide-input/hide-output toggles) as a reader
    first sees them: closed. The whole document's height counts, page header and footer included."""
    chromium, _ = browser
    states = _open_each_chapter(chromium, site, SCREEN["width"], PAGE_HEIGHT,
                                height=SCREEN["height"], stems=CORE_CHAPTERS)
    assert set(states) == set(CORE_CHAPTERS), "a core chapter's page is missing from the build"
    screens, problems = {}, []
    for stem, state in states.items():
        screens[stem] = state["height"] / SCREEN["height"]
        if state["open"]:
            problems.append(f"{stem}: {state['open']} collapsed sections open on load")
        if screens[stem] > MAX_SCREENS:
            problems.append(f"{stem}: {screens[stem]:.2f} screens of {SCREEN['height']} px")
    print("\nscreens at 1280 x 800:", {stem: round(n, 2) for stem, n in screens.items()})
    assert not problems, "\n".join(problems)


# ------------------------------------------------- issue 29: figure legends legible at phone width

PHONE_COLUMN_PX = 358      # the widest a chapter figure is drawn in a 390 px viewport (measured)
MIN_LEGEND_PX = 8          # the legend's font size on the phone's screen, in CSS pixels


def _legend_font_points(source):
    """The font size, in points, of every legend a cell's code draws (``.legend(...)`` and
    ``legend_below(...)``): its ``fontsize`` argument, or matplotlib's default for a legend."""
    import ast

    import matplotlib
    from matplotlib.font_manager import font_scalings

    def points(value):
        if isinstance(value, (int, float)):
            return float(value)
        return font_scalings[value] * matplotlib.rcParamsDefault["font.size"]

    sizes = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in (
                "legend", "legend_below"):
            given = [k.value for k in node.keywords if k.arg == "fontsize"]
            if given and not isinstance(given[0], ast.Constant):
                raise ValueError(f"a legend font size this check cannot read: {ast.unparse(given[0])}")
            sizes.append(points(given[0].value if given else matplotlib.rcParamsDefault["legend.fontsize"]))
    return sizes


def legend_px_at_phone_width(legend_points, png_width, dpi):
    """CSS pixels of a legend's font on a 390 px screen: points × dpi / 72 in the saved image,
    scaled by the width the page gives the image over its natural width."""
    return legend_points * dpi / 72 * min(1.0, PHONE_COLUMN_PX / png_width)


def test_legend_px_at_phone_width_is_the_scaled_font():
    assert legend_px_at_phone_width(10, 358, 100) == pytest.approx(10 * 100 / 72)
    assert legend_px_at_phone_width(10, 716, 100) == pytest.approx(10 * 100 / 72 / 2)
    assert legend_px_at_phone_width(10, 200, 100) == pytest.approx(10 * 100 / 72)
    assert _legend_font_points('ax.legend(fontsize="small")\nlegend_below(fig, ax)') == [
        pytest.approx(8.33, abs=0.01), 10.0]


@pytest.mark.parametrize("notebook", CHAPTER_NOTEBOOKS, ids=[n.stem for n in CHAPTER_NOTEBOOKS])
def test_figure_legends_are_legible_at_phone_width(notebook):
    """Issue 29: legends ended up about 5 px tall at 390 px (a small font beside the axes of a
    wide image). Each figure's legend font, scaled as the phone scales the stored image, is at
    least MIN_LEGEND_PX."""
    import base64
    import io

    from PIL import Image

    small = []
    for cell in json.loads(notebook.read_text())["cells"]:
        if cell["cell_type"] != "code":
            continue
        images = [Image.open(io.BytesIO(base64.b64decode(o["data"]["image/png"])))
                  for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
        if not images:
            continue
        try:
            legends = _legend_font_points("".join(cell["source"]))
        except SyntaxError:                                   # IPython magics
            continue
        for image in images:
            dpi = image.info.get("dpi", (72, 72))[0]
            for points in legends:
                px = legend_px_at_phone_width(points, image.width, dpi)
                if px < MIN_LEGEND_PX:
                    small.append(f"cell {cell.get('id')}: a {points:.1f} pt legend on a {image.width} px "
                                 f"figure at {dpi:.0f} dpi is {px:.1f} px at 390 px")
    assert not small, f"{notebook.stem}:\n" + "\n".join(small)


def test_legend_below_keeps_the_axes_and_the_legend_apart():
    """normtools.book.notebook.legend_below: the legend sits under every axes' drawn box (x-label
    included), in the figure's text size, and the saved image is no wider than the figure, so a
    long title keeps clear of the y-label (issue 29: a title over axes narrowed by a legend beside
    them ran into the y-label)."""
    import matplotlib

    matplotlib.use("Agg")
    import io

    import matplotlib.pyplot as plt
    from PIL import Image

    from normtools.book.notebook import legend_below

    fig, ax = plt.subplots(figsize=(5.6, 3.6), dpi=100)
    for i in range(5):
        ax.plot(range(10), [i * x for x in range(10)], label=f"a long label for line {i}")
    ax.set(xlabel="step", ylabel="gradient norm (before clipping)",
           title="peak lr 0.1: median and range over seeds")
    fig.tight_layout()
    legend = legend_below(fig, ax)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legend_box = legend.get_window_extent(renderer)
    assert legend_box.y1 <= ax.get_tightbbox(renderer).y0 + 0.5
    assert legend.get_texts()[0].get_fontsize() >= matplotlib.rcParams["font.size"]
    title_box = ax.title.get_window_extent(renderer)
    assert not title_box.overlaps(ax.yaxis.label.get_window_extent(renderer))
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", bbox_inches="tight")
    plt.close(fig)
    assert Image.open(buffer).width <= 5.6 * 100


def test_no_two_sources_are_cited_with_the_same_text(site):
    """Issue 29: DeepSeek-V2 and DeepSeek-V3 (both DeepSeek-AI, 2024) were cited as the same
    "DeepSeek-AI, 2024": a reader could not tell which source a citation meant. Every citation
    text on the pages points at one bibliography entry."""
    from bs4 import BeautifulSoup

    targets = {}
    for page in _pages(site):
        soup = BeautifulSoup(page.read_text(encoding="utf-8"), "html.parser")
        for link in soup.find_all("a", href=re.compile(r"08_sources\.html#|^#id")):
            if link.find_parent(attrs={"role": "doc-biblioentry"}) is not None:
                continue
            anchor = link["href"].split("#", 1)[1]
            if page.name != "08_sources.html" and "08_sources.html#" not in link["href"]:
                continue
            targets.setdefault(link.get_text(" ", strip=True), set()).add(anchor)
    assert len(targets) > 20, f"only {len(targets)} citation texts found"
    shared = {text: sorted(anchors) for text, anchors in targets.items() if len(anchors) > 1}
    assert not shared, f"citation texts that name more than one source: {shared}"

