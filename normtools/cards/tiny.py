"""Tiny configs: config.json dicts of random-weight models small enough to build and run on a
CPU in a second, for demos, tests and the atlas's probe (nothing is downloaded).

:func:`tiny_config` has two sources of sizes:

* a family the cards cover (and two the book compares, ``llama4_text`` and ``chameleon``): one
  fixed table, hidden 32, 2 layers, 4 heads of 8, 2 kv heads, MLP 48, vocabulary 64, and what
  the family needs besides (sliding windows, experts, MLA ranks, the QK-Norm switches);
* ``from_defaults=True``, any transformers model type: its config class's defaults shrunk by
  name rules (hidden 64, 2-4 layers, 4 heads of 8, 2 kv heads, MLP 96, 4 experts, MLA latent
  ranks 40 and 24), the atlas's probe model. H*D = 32 differs from hidden 64, so that a
  per-layer QK-Norm cannot pass for a block norm, and the latent ranks differ from both.

:func:`forced_flags` lists the boolean settings of the fixed table that differ from the
family's published default (phi's ``qk_layernorm``, cohere's ``use_qk_norm``);
``default_flags=True`` resets them.
"""

import json
import re

from normtools.cards.types import SUPPORTED_MODEL_TYPES, SpecError

# --------------------------------------------------------------------------------------------
# the fixed table
# --------------------------------------------------------------------------------------------

_TINY_COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                    pad_token_id=0, bos_token_id=1, eos_token_id=2)
_TINY_MOE = dict(num_local_experts=4, num_experts_per_tok=2)
_TINY_EXTRA = {  # None: the config class's default
    "gemma2": dict(query_pre_attn_scalar=8, sliding_window=16),
    "gemma3_text": dict(query_pre_attn_scalar=8, sliding_window=16),
    "gpt_oss": dict(_TINY_MOE, sliding_window=16, max_position_embeddings=131072),
    "minimax_m2": dict(_TINY_MOE),
    "cohere": dict(use_qk_norm=True),
    "phi": dict(qk_layernorm=True),
    "deepseek_v3": dict(num_key_value_heads=4, head_dim=None, rms_norm_eps=1e-5, q_lora_rank=16, kv_lora_rank=8, qk_rope_head_dim=4,
                        qk_nope_head_dim=4, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
                        n_group=1, topk_group=1, first_k_dense_replace=1, moe_intermediate_size=16),
    "bert": dict(num_key_value_heads=None, head_dim=None, type_vocab_size=2),
    # QK-Norm variants the cards do not cover (normtools.lab.designs.transformers_qk_norm)
    "llama4_text": dict(intermediate_size_mlp=48, use_qk_norm=True, no_rope_layers=[1, 1],
                        max_position_embeddings=None, pad_token_id=None, bos_token_id=None, eos_token_id=None),
    "chameleon": dict(head_dim=None, max_position_embeddings=None, pad_token_id=None, bos_token_id=None,
                      eos_token_id=None),
}


def tiny_config(model_type: str, *, from_defaults=False, default_flags=False, **overrides) -> dict:
    """A config.json dict of a tiny model of ``model_type``, then ``overrides``.

    Fixed sizes (hidden 32, 2 layers, 4 heads of 8) for a family of ``SUPPORTED_MODEL_TYPES`` or
    of the table; ``default_flags``: every :func:`forced_flags` switch back at the config class's
    default (the published architecture). ``from_defaults``: any transformers model type, its
    config class's defaults with the sizes of :func:`_shrink_values` (hidden 64, 2-4 layers, 4
    heads of 8, 4 experts), every key kept (None included)."""
    if from_defaults:
        from transformers import CONFIG_MAPPING

        defaults = CONFIG_MAPPING[model_type]().to_dict()
        values = {**defaults, **_shrink_values(defaults), **overrides}
        return {"model_type": model_type, **{k: v for k, v in values.items()
                                             if k not in ("model_type", "transformers_version", "architectures")}}
    if model_type not in SUPPORTED_MODEL_TYPES and model_type not in _TINY_EXTRA:
        raise SpecError(f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if model_type == "gemma3":
        model_type = "gemma3_text"
    if default_flags:
        overrides = {**{k: default for k, (_, default) in forced_flags(model_type).items()}, **overrides}
    values = {**_TINY_COMMON, **_TINY_EXTRA.get(model_type, {}), **overrides}
    return {"model_type": model_type, **{k: v for k, v in values.items() if v is not None}}


def forced_flags(model_type: str) -> dict[str, tuple[bool, bool]]:
    """{flag: (value in :func:`tiny_config`, the config class's default)} for every boolean
    setting of the tiny config that differs from the family's published default."""
    from transformers import AutoConfig

    config = tiny_config(model_type)
    default = AutoConfig.for_model(config["model_type"])
    return {k: (v, getattr(default, k)) for k, v in config.items()
            if isinstance(v, bool) and hasattr(default, k) and getattr(default, k) != v}


# --------------------------------------------------------------------------------------------
# any family: its defaults, shrunk
# --------------------------------------------------------------------------------------------

_HIDDEN, _HEADS, _KV_HEADS, _HEAD_DIM, _FFN = 64, 4, 2, 8, 96
_Q_LORA, _KV_LORA = 40, 24

_SIZE_RULES = (  # (regex on a config key, value for an int default larger than it)
    (r"(hidden_size|n_embd|d_model|embed_dim|hidden_dim|model_dim|dim|word_embed_proj_dim)", _HIDDEN),
    (r".*(intermediate_size|ffn_dim|ffn_hidden_size|n_inner|d_ff|mlp_dim|inner_hidden_size).*", _FFN),
    (r"(num_hidden_layers|n_layer|n_layers|num_layers|decoder_layers|encoder_layers|num_decoder_layers)", 2),
    (r"(num_attention_heads|n_head|n_heads|num_heads|decoder_attention_heads|encoder_attention_heads)", _HEADS),
    (r"(head_dim|kv_channels|attention_head_dim|attention_head_size)", _HEAD_DIM),
    (r"(num_experts|num_local_experts|n_routed_experts|moe_num_experts)", 4),
    (r"(num_experts_per_tok|moe_topk|top_k|num_selected_experts|moe_k)", 2),
    (r"(n_group|topk_group|first_k_dense_replace)", 1),
    (r"q_lora_rank", _Q_LORA),
    (r"kv_lora_rank", _KV_LORA),
    (r"(qk_rope_head_dim|qk_nope_head_dim)", _HEAD_DIM),
    (r"v_head_dim", _HEAD_DIM),
    (r"rotary_dim", _HEAD_DIM),
    (r".*hash.*vocab.*", 512),
)
_KV_KEYS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num")
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")


def _shrink_values(defaults: dict) -> dict:
    """Overrides that make a config's defaults tiny (see :data:`_SIZE_RULES`), as a dict.

    Per-layer lists (``layer_types``, ``mlp_layer_types``, per-layer sizes) keep the first layer
    of every distinct kind (at least two layers, at most four); per-layer dicts keyed by layer
    index follow them. A layer pattern given by a period and an offset (Jamba's attention every
    8 layers from layer 4) gets period 2, so that the tiny model has a layer of each kind.
    Unset head sizes get the probe's sizes."""
    out = {}
    heads = next((defaults[k] for k in ("num_attention_heads", "n_head", "n_heads") if isinstance(defaults.get(k), int)), None)
    for key, value in defaults.items():
        if isinstance(value, dict) and key.endswith("_config"):
            out[key] = {**value, **_shrink_values(value)}
            continue
        if value is None and key in ("head_dim",) + _KV_KEYS:
            out[key] = _HEAD_DIM if key == "head_dim" else _HEADS
            continue
        small = _small_int(key, value, heads)
        if small is not None:
            out[key] = small
    if "d_head" in defaults and isinstance(out.get("d_model"), int):  # XLNet: d_head = d_model / n_head
        out["d_head"] = out["d_model"] // out.get("n_head", _HEADS)
    for expand, n_heads, head_dim in (("expand", "num_heads", "head_dim"),
                                      ("mamba_expand", "mamba_n_heads", "mamba_d_head")):
        if all(isinstance(defaults.get(k), int) for k in (expand, n_heads, head_dim)):  # Mamba-2 heads
            out[n_heads] = out.get("hidden_size", _HIDDEN) * defaults[expand] // out.get(head_dim, defaults[head_dim])
    special = [v for k, v in defaults.items() if k.endswith("token_id") and isinstance(v, int)]
    special += [v for k, v in defaults.items() if k.endswith("token_ids") and isinstance(v, list)
                for v in v if isinstance(v, int)]
    if isinstance(defaults.get("vocab_size"), int):
        out["vocab_size"] = min(defaults["vocab_size"], max([256] + [v + 1 for v in special]))
    if "is_decoder" in defaults:
        out["is_decoder"] = True
    out.update(_keep_layer_kinds(defaults, heads))
    for kind in ("attn", "expert"):   # Jamba: layer i is attention if i % period == offset
        period, offset = (defaults.get(f"{kind}_layer_{k}") for k in ("period", "offset"))
        if isinstance(period, int) and isinstance(offset, int) and period > 2:
            out[f"{kind}_layer_period"], out[f"{kind}_layer_offset"] = 2, offset % period and 1
    return out


def _small_int(key, value, heads):
    """The probe's size for an int config value (None: keep the default)."""
    if not isinstance(value, int) or isinstance(value, bool):
        return None
    if key in _KV_KEYS:
        return 1 if value == 1 else (_HEADS if value == heads else _KV_HEADS)
    for pattern, small in _SIZE_RULES:
        if re.fullmatch(pattern, key) and value > small:
            return small
    return None


def _keep_layer_kinds(defaults, heads) -> dict:
    """Per-layer lists and dicts cut to the first layer of every distinct kind (2-4 layers)."""
    num_layers = next((defaults[k] for k in _LAYER_KEYS if isinstance(defaults.get(k), int)), None)
    if not num_layers:
        return {}
    per_layer = {k: v for k, v in defaults.items() if isinstance(v, list) and len(v) == num_layers and num_layers > 1}
    if not per_layer:
        return {}
    kinds = [tuple(json.dumps(v[i], sort_keys=True) for v in per_layer.values()) for i in range(num_layers)]
    keep = sorted({kinds.index(k) for k in kinds} | {0, 1})[:4]
    out = {k: [_small_int(k, v[i], heads) or v[i] for i in keep] for k, v in per_layer.items()}
    for key, value in defaults.items():
        if key.startswith("per_layer") and isinstance(value, dict):
            out[key] = {str(new) if isinstance(next(iter(value), 0), str) else new: value[old]
                        for new, old in enumerate(keep) for old in (old, str(old)) if old in value}
    for key in _LAYER_KEYS:
        if key in defaults:
            out[key] = len(keep)
    return out
