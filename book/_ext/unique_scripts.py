"""Sphinx extension: drop repeated inline <script> bodies from each page.

Jupyter Book 1.x fires sphinx-thebe's setup hook twice, which declares ``const THEBE_JS_URL``
twice on every page, a JavaScript error in the reader's browser. This keeps the first copy.
"""


def _drop_repeated_inline_scripts(app, pagename, templatename, context, doctree):
    seen, unique = set(), []
    for script in context.get("script_files", []):
        body = script.attributes.get("body") if hasattr(script, "attributes") else None
        if body:
            if body in seen:
                continue
            seen.add(body)
        unique.append(script)
    context["script_files"] = unique


def setup(app):
    app.connect("html-page-context", _drop_repeated_inline_scripts, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
