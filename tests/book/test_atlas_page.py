"""The atlas page's table in a headless browser: filters and sorting work offline, each family's
card opens in place and links to its modeling file at the probed transformers version.

The counts are computed here from the committed atlas JSON (``normtools/cards/data/atlas.json``),
not from the table. One test opens the table alone (``atlas_table_html`` and
``book/_static/atlas-table.js`` in a page from disk: no book build needed); one opens the built
page (``_build/html/book/atlas.html``, after ``make book``)."""

import json
from pathlib import Path

import pytest

from test_reader_experience import CHROMIUM, CHROMIUM_ARGS, ROOT, _require, browser, site  # noqa: F401

pytest.importorskip("transformers")

SCRIPT = ROOT / "book" / "_static" / "atlas-table.js"
SHOWN = "() => [...document.querySelectorAll('table.atlas-table tr[data-family]')].filter(r => !r.hidden)" \
        ".map(r => r.dataset.family)"


def _committed():
    return json.loads((ROOT / "normtools" / "cards" / "data" / "atlas.json").read_text())


def _check_table(page, committed):
    families = committed["families"]
    assert page.inner_text(".atlas-count") == f"{len(families)} of {len(families)} families shown"
    per_layer = sorted(t for t, r in families.items() if r["spec"]["qk_norm"]["scope"] == "per_layer")
    page.select_option('select[data-column="qk_norm"]', "per_layer")
    assert sorted(page.evaluate(SHOWN)) == per_layer and per_layer
    assert page.inner_text(".atlas-count") == f"{len(per_layer)} of {len(families)} families shown"
    # the filter offers a value under the short text its cells show (the legend's)
    label = page.inner_text('select[data-column="qk_norm"] option[value="per_layer"]')
    shown = page.evaluate("() => [...document.querySelectorAll('tr[data-family]:not([hidden]) "
                          "td[data-value=\"per_layer\"]')].map(c => c.textContent)")
    assert len(shown) == len(per_layer) and set(shown) == {label}
    page.select_option('select[data-column="qk_norm"]', "")
    # QK-Norm on some layers only: the families whose card has a QK-Norm layer pattern
    some = sorted(t for t, r in families.items()
                  if any(field == "qk_norm" for field, _ in r["spec"].get("layer_pattern", ())))
    page.select_option('select[data-column="qk_layers"]', "some")
    assert sorted(page.evaluate(SHOWN)) == some and "llama4_text" in some
    page.select_option('select[data-column="qk_layers"]', "")
    # sort by eps, descending on the second click
    page.click('th[data-key="eps"]')
    page.click('th[data-key="eps"]')
    eps = page.evaluate("() => [...document.querySelectorAll('tr[data-family] td:nth-child(5)')]"
                        ".map(c => parseFloat(c.dataset.value))")
    assert eps == sorted((r["spec"]["block_norm"]["eps"] for r in families.values()), reverse=True)
    # one family's card, in place, with its modeling file at the probed version
    page.fill('input[data-column="model_type"]', "olmo2")
    page.click('tr[data-family="olmo2"] summary')
    card = page.locator('tr[data-family="olmo2"] .atlas-card')
    assert card.is_visible() and "post_sublayer" in card.inner_text()
    href = card.locator("a").first.get_attribute("href")
    assert href == (f"https://github.com/huggingface/transformers/blob/v{committed['transformers']}"
                    "/src/transformers/models/olmo2/modeling_olmo2.py")


@pytest.fixture
def chromium():  # closed before the built page's test opens its own (one Playwright at a time)
    _require(CHROMIUM is not None, "Chromium is not installed (apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _require(False, "playwright is not installed (pip install playwright)")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield launched
        launched.close()


def test_atlas_table_filters_and_sorts_from_disk(chromium, tmp_path):
    from normtools.cards.atlas.html import atlas_table_html

    committed = _committed()
    page_file = tmp_path / "atlas.html"
    page_file.write_text('<!doctype html><html><head><meta charset="utf-8"></head><body>'
                         f'{atlas_table_html()}<script src="{SCRIPT.as_uri()}"></script></body></html>')
    page = chromium.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(page_file.as_uri())
    _check_table(page, committed)
    assert not errors


def test_built_atlas_page_filters_and_sorts_offline(site, browser):  # noqa: F811
    chromium_browser, base = browser
    _require((Path(site) / "book" / "atlas.html").exists(), "no atlas page in the build")
    context = chromium_browser.new_context()
    # offline: every request outside the local server fails
    context.route("**/*", lambda route: route.continue_() if route.request.url.startswith(base) else route.abort())
    page = context.new_page()
    page.goto(f"{base}/book/atlas.html")
    _check_table(page, _committed())
    context.close()
