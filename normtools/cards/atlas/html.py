"""The atlas as one HTML table for the book's atlas page (:func:`atlas_table_html`): one row per
probed family, its card inside the row (a ``<details>`` under the family's name) with a link to
its modeling file in transformers at the probed version. ``book/_static/atlas-table.js`` adds
the filters (columns marked ``data-filter``) and the sorting in the browser; without it the
table is a plain table.

The table fits the book's text column at desktop width: short headers and short values, both
explained in a legend above the table (:data:`COLUMNS`, :data:`SHOWN`); the layer pattern's runs
are in each family's card, and its column names only the fields that vary by layer. Each cell's
``data-value`` keeps the atlas row's own value, which the filters and sorting read."""

import html
import os

from normtools.cards.atlas.table import atlas_rows, atlas_spec, load_atlas
from normtools.cards.render import card_rows

# (row key, short header, what the header and its values mean, filter: "select" / "search" /
# None, sort: "number" / None)
COLUMNS = (
    ("model_type", "family", "open a name for the family's whole card and its modeling file",
     "search", None),
    ("placement", "place", "placement of the block norms: pre, post, sandwich, parallel, "
     "post_sub (post-sublayer: the norm on the sublayer's output, before the residual add), "
     "mixed (layers differ)", "select", None),
    ("norm", "norm", "rms (RMSNorm) or layer (LayerNorm)", "select", None),
    ("scale", "scale", "w, 1+w, or none (no learned weight)", "select", None),
    ("eps", "eps", "the block norm's eps", "select", "number"),
    ("bias", "bias", "the block norm has a bias", "select", None),
    ("casting", "cast", "casting: the convention that reproduces the module's bf16 output bit for "
     "bit (chapter 3)", "select", None),
    ("final_norm", "final", "a final norm before the LM head", "select", None),
    ("proj_biases", "biased", "the projections with a bias, ? where the probe could not tell",
     "select", None),
    ("qk_norm", "QK", "QK-Norm's scope: head (per head), layer (per layer, one norm over all heads), "
     "? (the perturbation fits neither), – (no QK-Norm)", "select", None),
    ("qk_layers", "QK layers", "all layers, or some (those the layer pattern names)", "select", None),
    ("qk_before_rope", "QK RoPE", "QK-Norm before or after RoPE, ? where the probe could not tell",
     "select", None),
    ("qk_weight", "QK weight", "the q-norm weight's shape: d (head_dim), H·d (one vector of heads × "
     "head_dim), H×d (a heads by head_dim matrix), none (no learned weight), else the shape itself",
     "select", None),
    ("varies", "per layer", "the card fields that differ between layers (place, QK, attn: "
     "attention kind); the runs are in the family's card", "select", None),
)

# The text a cell shows for an atlas row's value, where it differs from the value itself.
SHOWN = {
    "placement": {"post_sublayer": "post_sub"},
    "bias": {True: "yes", False: "no"},
    "final_norm": {True: "yes", False: "no"},
    "qk_norm": {"per_head": "head", "per_layer": "layer", "unrecognised": "?", "none": "–"},
    "qk_layers": {"none": "–"},
    "qk_before_rope": {True: "before", False: "after", None: "?", "none": "–"},
    "qk_weight": {"head_dim": "d", "H*head_dim": "H·d", "H x head_dim": "H×d", "no weight": "none",
                  "none": "–"},
    "varies": {"placement": "place", "qk_norm": "QK", "attention": "attn", "none": "–"},
}


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


def _value(key, row):
    """The row's value for a column: "none" in every QK-Norm column of a family without QK-Norm."""
    return "none" if key.startswith("qk_") and row["qk_norm"] == "none" else row[key]


def _shown(key, value) -> str:
    """The cell's text: the short form of ``value`` (:data:`SHOWN`)."""
    short = SHOWN.get(key, {})
    if key == "varies":
        return " ".join(short.get(field, field) for field in value.split())
    return short.get(value, _text(value))


def _card_html(model_type, atlas) -> str:
    rows = "".join(f"<tr><th>{html.escape(field)}</th><td>{html.escape(str(value))}</td></tr>"
                   for field, value in card_rows(atlas_spec(model_type, atlas)))
    url = modeling_url(model_type, atlas["transformers"])
    return (f'<div class="atlas-card"><p><a href="{html.escape(url)}">{html.escape(url.rsplit("/", 1)[-1])}</a> '
            f'in transformers {html.escape(atlas["transformers"])}</p><table>{rows}</table></div>')


def atlas_legend_html() -> str:
    """The legend above the table: each short header with what it and its values mean."""
    items = "".join(f"<dt>{html.escape(label)}</dt><dd>{html.escape(meaning)}</dd>"
                    for _, label, meaning, _, _ in COLUMNS + (("", "–", "does not apply", None, None),))
    return f'<dl class="atlas-legend">{items}</dl>'


def atlas_table_html(atlas=None) -> str:
    """The legend and the atlas table (class ``atlas-table``): one ``<tr data-family>`` per probed
    family, each cell's ``data-value`` the value its filter and sorting read."""
    atlas = atlas or load_atlas()
    head = "".join(f'<th data-key="{key}" data-label="{html.escape(label)}"' +
                   (f' data-filter="{f}"' if f else "") + (f' data-sort="{sort}"' if sort else "") +
                   f">{html.escape(label)}</th>"
                   for key, label, _, f, sort in COLUMNS)
    body = []
    for row in atlas_rows(atlas):
        row = {**row, "varies": " ".join(field for field, _ in atlas_spec(row["model_type"], atlas).layer_pattern)
               or "none"}
        cells = []
        for key, _, _, _, _ in COLUMNS:
            value = _value(key, row)
            shown = html.escape(_shown(key, value))
            if key == "model_type":
                shown = f"<details><summary>{shown}</summary>{_card_html(row['model_type'], atlas)}</details>"
            data = repr(value) if key == "eps" else _text(value)
            cells.append(f'<td data-value="{html.escape(data)}">{shown}</td>')
        body.append(f'<tr data-family="{html.escape(row["model_type"])}">{"".join(cells)}</tr>')
    return (f'{atlas_legend_html()}<table class="atlas-table"><thead><tr>{head}</tr></thead>'
            f'<tbody>{"".join(body)}</tbody></table>')
