"""Rendering a card: (field, value) rows, a Markdown card and a Markdown diff."""

import dataclasses
import json

from normtools.cards.types import ModelNormSpec, NormSpec, diff


# x̂: the normalized row in float32 (x.float() * r for RMSNorm, (x.float() - mean) * rstd for LayerNorm)
CASTING_FORMULAS = {
    "llama": "(offset + w) * x̂.to(x.dtype)",
    "gemma": "(x̂ * (offset + w.float())).to(x.dtype)",
    "torch": "torch.nn.LayerNorm in the input dtype",
    "other": "neither convention reproduces the module's bf16 output bit for bit (atlas probe)",
}
# config keys behind each card row, to flag rows whose source value is unconfirmed
_EPS_KEYS = ("rms_norm_eps", "layer_norm_eps")
_SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim")
_COUNT_SOURCE_KEYS = _SHAPE_KEYS + ("intermediate_size", "vocab_size", "tie_word_embeddings", "num_local_experts",
                                    "attention_bias", "mlp_bias")
_ROW_KEYS = {
    "eps": _EPS_KEYS,
    "Final norm": _EPS_KEYS,
    "QK-Norm": _EPS_KEYS + ("use_qk_norm", "qk_norm_type", "qk_layernorm"),
    "Projection biases": ("attention_bias", "mlp_bias"),
    "Shape": _SHAPE_KEYS,
    "Parameters": _COUNT_SOURCE_KEYS,
    "Textbook (bias-free) count": _COUNT_SOURCE_KEYS,
}


def _describe_norm(norm: NormSpec | None) -> str:
    if norm is None:
        return "none"
    kind = "RMSNorm" if norm.kind == "rms" else "LayerNorm"
    scale = ("none (no learned weight)" if not norm.affine else "1 + w" if norm.offset == 1
             else "w" if norm.offset == 0 else f"{norm.offset:g} + w")
    bias = "with bias" if norm.bias else "no bias"
    return f"{kind}, eps={norm.eps:g}, scale {scale}, {bias}, {norm.casting} casting"


def card_rows(spec: ModelNormSpec, counts: dict | None = None) -> list:
    """(field, value) rows of the norm card; values whose config source is unconfirmed say so."""
    b = spec.block_norm
    qk = spec.qk_norm
    if qk.scope == "none":
        qk_text = "none"
    else:
        rope = "before RoPE" if qk.before_rope else "after RoPE"
        qk_text = f"{qk.scope}, {rope}: {_describe_norm(qk.norm)}"
    biases = [k for k, v in dataclasses.asdict(spec.biases).items() if v]
    unknown = [k for k, v in dataclasses.asdict(spec.biases).items() if v is None]
    rows = [
        ("Model type", spec.model_type),
        ("Block norm", "RMSNorm" if b.kind == "rms" else "LayerNorm"),
        ("eps", f"{b.eps:g}"),
        ("Bias", "yes" if b.bias else "no"),
        ("Scale", "none (no learned weight)" if not b.affine else "1 + w (offset 1)" if b.offset == 1
         else f"w (offset {b.offset:g})"),
        ("Casting", f"{b.casting}: {CASTING_FORMULAS[b.casting]}"),
        ("Placement", spec.placement),
        ("Per-layer norms", ", ".join(spec.layer_norms)),
        ("Final norm", _describe_norm(spec.final_norm)),
        ("QK-Norm", qk_text),
        ("Other norms", "; ".join(f"{o.name} ({o.dim}): {_describe_norm(o.norm)}" for o in spec.other_norms) or "none"),
        ("Projection biases", (", ".join(biases) or "none") + (f"; unknown: {', '.join(unknown)}" if unknown else "")),
        ("Attention sinks", "yes" if spec.attention_sinks else "no"),
        ("Shape", f"hidden {spec.hidden_size}, {spec.num_layers} layers, {spec.num_heads} heads "
                  f"({spec.num_kv_heads} kv), head_dim {spec.head_dim}"),
    ]
    rows += [(f"Layers: {field}", pattern) for field, pattern in spec.layer_pattern]
    rows += [("Note", note) for note in spec.notes]
    if counts is not None:
        rows += [("Parameters", f"{counts['total']:,}"),
                 ("Textbook (bias-free) count", f"{counts['textbook_bias_free']:,} "
                  f"(misses {counts['total'] - counts['textbook_bias_free']:,})")]
    if spec.unconfirmed:
        rows = [(name, value + (" (unconfirmed)" if set(_ROW_KEYS.get(name, ())) & set(spec.unconfirmed) else ""))
                for name, value in rows]
        rows.append(("Unconfirmed config values", ", ".join(spec.unconfirmed)))
    return rows


def _markdown_table(header, rows) -> str:
    def cell(value):
        return str(value).replace("|", "\\|")

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def card(spec: ModelNormSpec, counts: dict | None = None) -> str:
    """The norm card as a Markdown table (with parameter counts when ``counts`` is given)."""
    return _markdown_table(("Field", "Value"), card_rows(spec, counts))


def diff_table(a: ModelNormSpec, b: ModelNormSpec, names=("A", "B")) -> str:
    """:func:`diff` as a Markdown table."""
    return _markdown_table(("Field", *names), [(k, json.dumps(x), json.dumps(y)) for k, (x, y) in diff(a, b).items()])
