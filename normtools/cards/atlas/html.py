"""The atlas as one HTML table for the book's atlas page (:func:`atlas_table_html`): one row per
probed family, its card inside the row (a ``<details>`` under the family's name) with a link to
its modeling file in transformers at the probed version. ``book/_static/atlas-table.js`` adds
the filters (columns marked ``data-filter``) and the sorting in the browser; without it the
table is a plain table."""

import html
import os

from normtools.cards.atlas.table import atlas_rows, atlas_spec, load_atlas
from normtools.cards.render import card_rows

# (row key, header, filter: "select" / "search" / None, sort: "number" / None)
COLUMNS = (
    ("model_type", "family", "search", None),
    ("placement", "placement", "select", None),
    ("norm", "norm", "select", None),
    ("scale", "scale", "select", None),
    ("eps", "eps", "select", "number"),
    ("bias", "norm bias", "select", None),
    ("casting", "casting", "select", None),
    ("qk_norm", "QK-Norm", "select", None),
    ("qk_layers", "QK layers", "select", None),
    ("qk_before_rope", "QK before RoPE", "select", None),
    ("qk_weight", "QK weight", "select", None),
    ("proj_biases", "projection biases", "select", None),
    ("final_norm", "final norm", "select", None),
    ("layer_pattern", "layer pattern", None, None),
)


def modeling_url(model_type: str, version: str) -> str:
    """The family's modeling file in the transformers repository at tag ``v<version>`` (its model
    folder when the installed transformers has no ``modeling_<folder>.py``)."""
    import transformers
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    folder = model_type_to_module_name(model_type)
    base = f"https://github.com/huggingface/transformers/blob/v{version}/src/transformers/models/{folder}"
    installed = os.path.join(os.path.dirname(transformers.__file__), "models", folder, f"modeling_{folder}.py")
    return f"{base}/modeling_{folder}.py" if os.path.exists(installed) else base


def _text(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return "unknown" if value is None else str(value)


def _card_html(model_type, atlas) -> str:
    rows = "".join(f"<tr><th>{html.escape(field)}</th><td>{html.escape(str(value))}</td></tr>"
                   for field, value in card_rows(atlas_spec(model_type, atlas)))
    url = modeling_url(model_type, atlas["transformers"])
    return (f'<div class="atlas-card"><p><a href="{html.escape(url)}">{html.escape(url.rsplit("/", 1)[-1])}</a> '
            f'in transformers {html.escape(atlas["transformers"])}</p><table>{rows}</table></div>')


def atlas_table_html(atlas=None) -> str:
    """The atlas table (class ``atlas-table``): one ``<tr data-family>`` per probed family, each
    cell's ``data-value`` the value its filter and sorting read."""
    atlas = atlas or load_atlas()
    head = "".join(f'<th data-key="{key}"' + (f' data-filter="{f}"' if f else "") +
                   (f' data-sort="{sort}"' if sort else "") + f">{html.escape(label)}</th>"
                   for key, label, f, sort in COLUMNS)
    body = []
    for row in atlas_rows(atlas):
        cells = []
        for key, _, _, _ in COLUMNS:
            value = _text(row[key])
            shown = (f"<details><summary>{html.escape(value)}</summary>{_card_html(row['model_type'], atlas)}</details>"
                     if key == "model_type" else html.escape(value))
            data = repr(row[key]) if key == "eps" else value
            cells.append(f'<td data-value="{html.escape(data)}">{shown}</td>')
        body.append(f'<tr data-family="{html.escape(row["model_type"])}">{"".join(cells)}</tr>')
    return (f'<table class="atlas-table"><thead><tr>{head}</tr></thead>'
            f'<tbody>{"".join(body)}</tbody></table>')
