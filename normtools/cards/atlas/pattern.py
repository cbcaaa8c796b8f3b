"""The per-layer pattern of a layer-varying family over its default depth (:func:`layer_pattern`):
block placement, QK-Norm presence and attention kind, as run-length text.

The tiny model keeps the first layer of every distinct kind of the default config
(:func:`normtools.cards.tiny.tiny_config`): per-layer lists (``layer_types``,
``no_rope_layers``, ...), a period and an offset (Jamba's ``attn_layer_period``), a number of
dense first layers (``first_k_dense_replace``). A default layer is read as the tiny layer of
its kind; a layer whose kind the tiny model lacks is "?"."""

import re

from normtools.cards.atlas.probed import config_attr

_DENSE_FIRST = re.compile(r"(first_k_dense_replace|num_dense_layers|first_k_dense|n_dense_layers)")
_KIND_LISTS = ("layer_types", "layers_block_type", "attn_type_list", "layer_block_types")


def layer_pattern(pm, readings) -> tuple:
    """((field, run-length text), ...) of the fields that vary over the default layers: "placement"
    (block placement), "qk_norm" ("qk" or "none") and "attention" (the layer's kind in the config:
    its ``layer_types`` entry, "+nope" on a layer without RoPE)."""
    depth = config_attr(pm.defaults, "num_hidden_layers", None)
    if not isinstance(depth, int) or depth < 1:
        return ()
    tiny_kinds = [_kind(pm.text, i, len(readings)) for i in range(len(readings))]
    tiny_attention_kinds = [_kind(pm.text, i, len(readings), mlp=False) for i in range(len(readings))]
    per_tiny = {"placement": [r.placement for r in readings],
                "qk_norm": ["qk" if r.qk else "none" for r in readings],
                "attention": [_attention(pm.text, i) for i in range(len(readings))]}
    out = []
    for field, values in per_tiny.items():
        default_values = []
        for j in range(depth):
            kind, attention_kind = _kind(pm.defaults, j, depth), _kind(pm.defaults, j, depth, mlp=False)
            default_values.append(values[tiny_kinds.index(kind)] if kind in tiny_kinds else
                                  values[tiny_attention_kinds.index(attention_kind)]
                                  if attention_kind in tiny_attention_kinds else "?")
        if len(set(default_values)) > 1:
            out.append((field, run_length(default_values)))
    return tuple(out)


def _per_layer_lists(config, depth) -> dict:
    """The config's lists of one value per layer (not lists of layer indices, Llama 4's
    ``moe_layers``)."""
    def indices(v):
        return all(isinstance(x, int) and not isinstance(x, bool) for x in v) and sorted(v) == list(range(depth))

    return {k: v for k, v in config.to_dict().items()
            if isinstance(v, list) and len(v) == depth and depth > 1 and not indices(v)}


def _kind(config, i, depth, mlp=True) -> tuple:
    """What makes layer ``i`` of ``config`` (``depth`` layers) a kind of its own; ``mlp`` False
    leaves out what only chooses its MLP (an expert period, dense first layers), for a default
    layer whose exact kind the tiny model lacks (Jamba's attention layers are MoE or dense)."""
    import json

    kind = tuple(json.dumps(v[i], sort_keys=True) for k, v in sorted(_per_layer_lists(config, depth).items())
                 if mlp or not re.match(r".*(mlp|moe|expert|dense).*", k))
    for what in ("attn", "expert") if mlp else ("attn",):
        period, offset = (config_attr(config, f"{what}_layer_{k}", None) for k in ("period", "offset"))
        if isinstance(period, int) and isinstance(offset, int) and period > 0:
            kind += (i % period == offset,)
    for key, value in config.to_dict().items():
        if mlp and _DENSE_FIRST.fullmatch(key) and isinstance(value, int):
            kind += (i < value,)
    return kind


def _attention(config, i) -> str:
    """Layer ``i``'s attention kind: its entry of the config's layer-kind list ("attention" when
    the config has none), "+nope" when ``no_rope_layers`` says it has no RoPE."""
    kinds = next((config_attr(config, k, None) for k in _KIND_LISTS
                  if isinstance(config_attr(config, k, None), list)), None)
    kind = str(kinds[i]) if kinds and i < len(kinds) else "attention"
    rope = config_attr(config, "no_rope_layers", None)
    if isinstance(rope, list) and i < len(rope) and not rope[i]:
        kind += "+nope"
    return kind


def run_length(values) -> str:
    """Run-length text of a list: ``a×3, b`` for [a, a, a, b]; a repeated unit once, times its
    count: ``(a×3, b)×12``."""
    runs = []
    for v in values:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    unit, repeats = runs, 1
    for period in range(1, len(runs) // 2 + 1):
        if len(runs) % period == 0 and runs == runs[:period] * (len(runs) // period):
            unit, repeats = runs[:period], len(runs) // period
            break
    text = ", ".join(f"{v}×{n}" if n > 1 else str(v) for v, n in unit)
    return f"({text})×{repeats}" if repeats > 1 else text
