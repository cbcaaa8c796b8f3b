"""The atlas: norm cards probed from the running transformers code.

The truth table below was written by reading each family's ``modeling_*.py`` and
``configuration_*.py`` in the installed transformers (norm class and its forward, the decoder
layer's forward, the config defaults), not from the probe's output. The probe's norm
measurements are checked against norm modules built here with known settings (torch's own
LayerNorm and transformers' RMSNorm classes). A sample of families is re-probed and compared with
the committed atlas.
"""

import json

import pytest
import torch

from normtools import cards
from normtools.cards import atlas
from test_card_cli import run_cli

transformers = pytest.importorskip("transformers")

N, T = False, True
NO_BIAS = (N, N, N, N)
QKV = (T, T, T, N)
ALL = (T, T, T, T)
# model_type: (kind, eps, offset, norm bias, casting, placement, final norm, QK scope,
#              QK before RoPE, (q, k, v, o) projection biases, MLP bias)
TRUTH = {
    # LlamaRMSNorm: weight * (x.float() * rsqrt(ms + eps)).to(dtype); input/post_attention pre-norms
    "llama": ("rms", 1e-6, 0, N, "llama", "pre", T, "none", None, NO_BIAS, N),
    "mistral": ("rms", 1e-6, 0, N, "llama", "pre", T, "none", None, NO_BIAS, N),
    "mixtral": ("rms", 1e-5, 0, N, "llama", "pre", T, "none", None, NO_BIAS, N),
    "qwen2": ("rms", 1e-6, 0, N, "llama", "pre", T, "none", None, QKV, N),  # q/k/v bias=True, o no
    "qwen2_moe": ("rms", 1e-6, 0, N, "llama", "pre", T, "none", None, QKV, N),  # qkv_bias default True
    # Qwen3: q_norm/k_norm = RMSNorm(head_dim) on (B, T, H, D) before apply_rotary_pos_emb
    "qwen3": ("rms", 1e-6, 0, N, "llama", "pre", T, "per_head", T, NO_BIAS, N),
    "qwen3_moe": ("rms", 1e-6, 0, N, "llama", "pre", T, "per_head", T, NO_BIAS, N),
    # GemmaRMSNorm: (x̂ * (1 + w.float())).to(dtype)
    "gemma": ("rms", 1e-6, 1, N, "gemma", "pre", T, "none", None, NO_BIAS, N),
    "gemma2": ("rms", 1e-6, 1, N, "gemma", "sandwich", T, "none", None, NO_BIAS, N),
    "gemma3_text": ("rms", 1e-6, 1, N, "gemma", "sandwich", T, "per_head", T, NO_BIAS, N),
    "gemma3": ("rms", 1e-6, 1, N, "gemma", "sandwich", T, "per_head", T, NO_BIAS, N),
    # OlmoLayerNorm: F.layer_norm(x.float(), no weight/bias, eps=1e-5).to(dtype)
    "olmo": ("layer", 1e-5, 0, N, "gemma", "pre", T, "none", None, NO_BIAS, N),
    # Olmo2RMSNorm: (w * x̂).to(dtype); norms on sublayer outputs; q_norm over H*D before RoPE
    "olmo2": ("rms", 1e-5, 0, N, "gemma", "post_sublayer", T, "per_layer", T, NO_BIAS, N),
    "olmo3": ("rms", 1e-5, 0, N, "gemma", "post_sublayer", T, "per_layer", T, NO_BIAS, N),
    # OlmoeRMSNorm is Llama's; q_norm = RMSNorm(hidden_size) on q_proj(x), before RoPE
    "olmoe": ("rms", 1e-5, 0, N, "llama", "pre", T, "per_layer", T, NO_BIAS, N),
    # Phi: nn.LayerNorm, one input_layernorm feeds attention and MLP; qk_layernorm default False
    "phi": ("layer", 1e-5, 0, T, "torch", "parallel", T, "none", None, ALL, T),
    "phi3": ("rms", 1e-5, 0, N, "llama", "pre", T, "none", None, NO_BIAS, N),
    # Falcon defaults: parallel_attn=True, new_decoder_architecture=False, bias=False
    "falcon": ("layer", 1e-5, 0, T, "torch", "parallel", T, "none", None, NO_BIAS, N),
    # GPT-NeoX defaults: use_parallel_residual=True, attention_bias=True
    "gpt_neox": ("layer", 1e-5, 0, T, "torch", "parallel", T, "none", None, ALL, T),
    "gpt2": ("layer", 1e-5, 0, T, "torch", "pre", T, "none", None, ALL, T),
    # CohereLayerNorm: float32 mean/variance, weight in float32, no bias, cast back; parallel block
    "cohere": ("layer", 1e-5, 0, N, "gemma", "parallel", T, "none", None, NO_BIAS, N),
    "cohere2": ("layer", 1e-5, 0, N, "gemma", "parallel", T, "none", None, NO_BIAS, N),
    "starcoder2": ("layer", 1e-5, 0, T, "torch", "pre", T, "none", None, ALL, T),  # use_bias=True
    "deepseek_v3": ("rms", 1e-6, 0, N, "llama", "pre", T, "none", None, NO_BIAS, N),
    # GptOssRMSNorm: (w * x̂).to(dtype); attention_bias=True
    "gpt_oss": ("rms", 1e-5, 0, N, "gemma", "pre", T, "none", None, ALL, N),
    # MiniMaxM2: q_norm = RMSNorm(H * head_dim) before RoPE
    "minimax_m2": ("rms", 1e-6, 0, N, "llama", "pre", T, "per_layer", T, NO_BIAS, N),
    # Glm4: input, post_self_attn, post_attention, post_mlp norms; rms_norm_eps default 1.5625e-7
    "glm4": ("rms", 1.5625e-7, 0, N, "llama", "sandwich", T, "none", None, QKV, N),
    "granite": ("rms", 1e-6, 0, N, "llama", "pre", T, "none", None, NO_BIAS, N),
    # StableLM defaults: use_parallel_residual=False, qk_layernorm=False, use_qkv_bias=False
    "stablelm": ("layer", 1e-5, 0, T, "torch", "pre", T, "none", None, NO_BIAS, N),
    # HunYuan dense: query_layernorm(head_dim) applied after apply_rotary_pos_emb
    "hunyuan_v1_dense": ("rms", 1e-5, 0, N, "llama", "pre", T, "per_head", N, NO_BIAS, N),
    # EXAONE 4: post_attention/post_feedforward norms on sublayer outputs; q_norm(head_dim), then RoPE
    "exaone4": ("rms", 1e-5, 0, N, "llama", "post_sublayer", T, "per_head", T, NO_BIAS, N),
    # MiniMax-01: residual = input_layernorm(x), x = a * residual + b * attn(residual): the residual
    # stream is the norm's output, as in post-norm
    "minimax": ("rms", 1e-5, 0, N, "llama", "post", T, "none", None, NO_BIAS, N),
    # BLOOM: LayerNorm, pre-norm, query_key_value and dense biases
    "bloom": ("layer", 1e-5, 0, T, "torch", "pre", T, "none", None, ALL, T),
    # OPT decoder layer, do_layer_norm_before=True: pre-norm; OPT-350m-style project_out absent
    "opt": ("layer", 1e-5, 0, T, "torch", "pre", T, "none", None, ALL, T),
    # Llama 4 text: Llama4TextRMSNorm pre-norms; one weightless Llama4TextL2Norm (x·rsqrt(ms + eps))
    # called as self.qk_norm on q and on k, (B, T, H, D), after apply_rotary_emb
    "llama4_text": ("rms", 1e-5, 0, N, "llama", "pre", T, "per_head", N, NO_BIAS, N),
    # BERT (BertLMHeadModel): LayerNorm(x + sublayer(x)) inside BertSelfOutput / BertOutput
    "bert": ("layer", 1e-12, 0, T, "torch", "post", T, "none", None, ALL, T),
    # Qwen3-Next, a hybrid: three of every four layers are linear attention (a gated DeltaNet
    # with a Qwen3NextRMSNormGated inside, no q/k norm), the fourth full attention with
    # q_norm/k_norm = Qwen3NextRMSNorm(head_dim) before apply_rotary_pos_emb. Qwen3NextRMSNorm:
    # weight zeros, x̂ · (1 + w.float()), cast back; eps 1e-6; attention_bias False
    "qwen3_next": ("rms", 1e-6, 1, N, "gemma", "pre", T, "per_head", T, NO_BIAS, N),
    # OLMo hybrid: attention layers as OLMo 2 (norms on the sublayer outputs, q_norm over H·D
    # on q_proj(x) before RoPE), linear-attention layers with an input_layernorm: mixed
    "olmo_hybrid": ("rms", 1e-6, 0, N, "gemma", "mixed", T, "per_layer", T, NO_BIAS, N),
    # CTRL: nn.LayerNorm(n_embd, eps=1e-6) before multi_head_attention and ffn (pre-norm); Wq, Wk,
    # Wv, dense = nn.Linear (bias=True); ffn = Sequential(Linear, ReLU, Linear); final layernorm
    "ctrl": ("layer", 1e-6, 0, T, "torch", "pre", T, "none", None, ALL, T),
    # MiniCPM3: Llama-style RMSNorm (eps 1e-5) pre-norms; the final norm reaches lm_head through
    # hidden_states / logits_scaling and slice_logits_to_keep; attention_bias, mlp_bias False
    "minicpm3": ("rms", 1e-5, 0, N, "llama", "pre", T, "none", None, NO_BIAS, N),
    # Nemotron: NemotronLayerNorm1P(nn.LayerNorm): F.layer_norm(x, weight + 1.0, bias, eps) in the
    # input dtype, norm_eps 1e-5; input/post_attention pre-norms; attention_bias, mlp_bias False
    "nemotron": ("layer", 1e-5, 1, T, "torch", "pre", T, "none", None, NO_BIAS, N),
}


@pytest.fixture(scope="module")
def committed():
    return atlas.load_atlas()


def _row(spec):
    b, qk, p = spec.block_norm, spec.qk_norm, spec.biases
    return (b.kind, b.eps, b.offset, b.bias, b.casting, spec.placement, spec.final_norm is not None,
            qk.scope, qk.before_rope, (p.q, p.k, p.v, p.o), p.mlp)


@pytest.mark.parametrize("model_type", sorted(TRUTH))
def test_atlas_matches_the_modeling_code(model_type, committed):
    assert model_type in committed["families"], committed["not_probed"].get(model_type)
    assert _row(atlas.atlas_spec(model_type, committed)) == TRUTH[model_type]


def test_every_causal_lm_family_is_probed_or_listed_with_a_reason(committed):
    types = set(atlas.causal_lm_model_types())
    assert set(committed["families"]) | set(committed["not_probed"]) == types
    assert not set(committed["families"]) & set(committed["not_probed"])
    assert all(reason.strip() for reason in committed["not_probed"].values())
    assert len(committed["families"]) >= 120


def test_the_atlas_is_of_the_installed_transformers(committed):
    assert committed["transformers"] == transformers.__version__
    assert committed["probe_version"] == atlas.PROBE_VERSION


# a sample of families re-probed now must give the committed cards (a few seconds each)
SAMPLE = ("llama", "olmo2", "gemma3_text", "cohere", "deepseek_v3", "gpt_oss", "bert", "llama4_text",
          "qwen3_next")


@pytest.mark.parametrize("model_type", SAMPLE)
def test_reprobing_a_family_gives_the_committed_card(model_type, committed):
    fresh = atlas.probe_family(model_type)
    assert cards.ModelNormSpec.from_dict(fresh["spec"]) == atlas.atlas_spec(model_type, committed)


def test_probe_and_rules_agree_except_where_they_describe_different_models(committed):
    """The hand rules in derive.py describe BERT's encoder (BertModel); the atlas probes the
    causal LM (BertLMHeadModel), whose prediction head has a LayerNorm before the biased decoder."""
    disagreements = atlas.rule_disagreements(committed)
    assert set(disagreements) <= {"bert"}
    assert set(disagreements.get("bert", {})) <= {"final_norm", "biases.lm_head"}


# ------------------------------------------------------------------ one norm, known settings

@pytest.mark.parametrize("make, expected", [
    (lambda: torch.nn.LayerNorm(48, eps=3e-5), ("layer", 3e-5, 0.0, True, "torch")),
    (lambda: transformers.models.llama.modeling_llama.LlamaRMSNorm(48, eps=2e-6), ("rms", 2e-6, 0.0, False, "llama")),
    (lambda: transformers.models.gemma3.modeling_gemma3.Gemma3RMSNorm(48, eps=4e-6), ("rms", 4e-6, 1.0, False, "gemma")),
    (lambda: transformers.models.olmo2.modeling_olmo2.Olmo2RMSNorm(48, eps=5e-5), ("rms", 5e-5, 0.0, False, "gemma")),
])
def test_probe_norm_measures_kind_eps_scale_and_casting(make, expected):
    p = atlas.probe_norm(make(), (3, 5, 48))
    assert (p["kind"], p["eps"], p["offset"], p["bias"], p["casting"]) == expected
    assert p["eps_measured"] == pytest.approx(expected[1], rel=1e-3)


def test_probe_norm_measures_an_eps_the_module_does_not_expose():
    class HiddenEps(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.layer_norm(x, x.shape[-1:], eps=7e-6)

    HiddenEps.__name__ = "HiddenEpsLayerNorm"
    p = atlas.probe_norm(HiddenEps(), (4, 32))
    assert p["kind"] == "layer" and p["eps"] is None and not p["affine"]
    assert p["eps_measured"] == pytest.approx(7e-6, rel=1e-3)


# ------------------------------------------------------------------ CLI

def test_card_and_diff_of_atlas_families(capsys, committed):
    code, out, _ = run_cli(capsys, "card", "glm4")
    assert code == 0 and "| Placement | sandwich |" in out and "| eps | 1.5625e-07 |" in out
    code, out, _ = run_cli(capsys, "diff", "qwen3", "olmo2", "--json")
    assert code == 0 and json.loads(out)["placement"] == ["pre", "post_sublayer"]
    code, _, err = run_cli(capsys, "card", "no_such_family")
    assert code == 2 and "atlas family" in err


def test_atlas_table_json_and_compare(capsys, committed, tmp_path):
    code, out, _ = run_cli(capsys, "atlas")
    assert code == 0 and out.count("\n| ") >= len(committed["families"]) + len(committed["not_probed"])
    code, out, _ = run_cli(capsys, "atlas", "--json")
    assert code == 0 and json.loads(out)["families"].keys() == committed["families"].keys()
    changed = json.loads(json.dumps(committed))
    changed["families"]["llama"]["spec"]["placement"] = "post"
    del changed["families"]["gpt2"]
    (tmp_path / "new.json").write_text(json.dumps(changed))
    code, out, _ = run_cli(capsys, "atlas", "--compare", str(tmp_path / "new.json"))
    d = json.loads(out)
    assert d["changed"] == {"llama": {"placement": ["pre", "post"]}} and d["removed"] == ["gpt2"]


def test_reprobe_flag_shows_no_change_for_a_current_family_and_cards_name_the_reason(capsys, committed):
    code, out, _ = run_cli(capsys, "atlas", "--reprobe", "llama")
    assert code == 0 and json.loads(out)["changed"] == {}
    family, reason = next(iter(sorted(committed["not_probed"].items())))
    code, _, err = run_cli(capsys, "card", family)
    assert code == 2 and "not probed" in err and reason.split(":")[0] in err


def test_refresh_of_named_families_replaces_only_their_rows(capsys, committed, tmp_path):
    copy = tmp_path / "atlas.json"
    atlas.save_atlas(committed, copy)
    code, _, _ = run_cli(capsys, "atlas", "--refresh", "--reprobe", "llama", "--atlas", str(copy))
    assert code == 0
    written = atlas.load_atlas(copy)
    assert written["not_probed"] == committed["not_probed"]
    assert written["families"].keys() == committed["families"].keys()
    assert all(written["families"][t] == row for t, row in committed["families"].items() if t != "llama")
    assert written["families"]["llama"]["spec"] == committed["families"]["llama"]["spec"]


def test_refresh_of_named_families_refuses_an_atlas_of_another_transformers(capsys, committed, tmp_path):
    """Rows probed by two transformers versions must not share a file that names one."""
    copy = tmp_path / "atlas.json"
    atlas.save_atlas({**committed, "transformers": "0.0.1"}, copy)
    before = copy.read_text()
    code, out, err = run_cli(capsys, "atlas", "--refresh", "--reprobe", "llama", "--atlas", str(copy))
    assert code == 2 and out == "" and err.count("\n") == 1 and "0.0.1" in err
    assert copy.read_text() == before


@pytest.mark.parametrize("flags", [["--compare", "OTHER", "--refresh"], ["--compare", "OTHER", "--reprobe", "llama"],
                                   ["--compare", "OTHER", "--json"], ["--json", "--reprobe", "llama"]])
def test_atlas_flags_that_ask_for_two_things_are_refused(capsys, committed, tmp_path, flags):
    copy, other = tmp_path / "atlas.json", tmp_path / "other.json"
    atlas.save_atlas(committed, copy)
    atlas.save_atlas({**committed, "families": {}}, other)
    argv = [str(other) if f == "OTHER" else f for f in flags]
    code, out, err = run_cli(capsys, "atlas", *argv, "--atlas", str(copy))
    named = [f for f in flags if f.startswith("--")]
    assert code == 2 and out == "" and err.count("\n") == 1 and all(f in err for f in named)


def test_reprobe_refuses_a_name_that_is_not_a_causal_lm_model_type(capsys):
    assert "llama" in atlas.causal_lm_model_types() and "lama" not in atlas.causal_lm_model_types()
    code, out, err = run_cli(capsys, "atlas", "--reprobe", "llama", "lama")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "--reprobe: lama: not a causal-LM model type" in err


@pytest.mark.parametrize("flag", ["--atlas", "--compare"])
@pytest.mark.parametrize("break_llama, missing", [
    (lambda row: row.pop("spec"), "spec"),
    (lambda row: row["probe"].pop("tiny_config"), "tiny_config"),
    (lambda row: row["spec"].pop("block_norm"), "block_norm"),
])
def test_a_malformed_atlas_gives_one_line_naming_the_file_and_the_fault(capsys, committed, tmp_path, flag,
                                                                       break_llama, missing):
    broken = json.loads(json.dumps(committed))
    break_llama(broken["families"]["llama"])
    path = tmp_path / "broken.json"
    atlas.save_atlas(broken, path)
    code, out, err = run_cli(capsys, "atlas", flag, str(path))
    assert code == 2 and out == "" and err.count("\n") == 1
    assert str(path) in err and "'llama'" in err and missing in err


def test_an_atlas_without_probed_families_prints_its_not_probed_ones(capsys, committed, tmp_path):
    path = tmp_path / "atlas.json"
    atlas.save_atlas({**committed, "families": {}, "not_probed": {"llama": "a reason"}}, path)
    code, out, _ = run_cli(capsys, "atlas", "--atlas", str(path))
    assert code == 0 and "0 families probed, 1 not" in out and "| llama | a reason |" in out


def test_qk_weight_shape_is_named_per_scope(committed):
    rows = {r["model_type"]: r for r in atlas.atlas_rows(committed)}
    assert rows["qwen3"]["qk_weight"] == "head_dim"  # Qwen3RMSNorm(self.head_dim)
    assert rows["olmo2"]["qk_weight"] == "H*head_dim"  # Olmo2RMSNorm(num_attention_heads * head_dim)
    assert rows["llama"]["qk_weight"] == "none"


def test_llama4_weightless_qk_norm_is_recorded_as_its_qk_norm(committed):
    """Llama 4's attention holds one parameterless ``qk_norm`` (Llama4TextL2Norm) that it applies
    to q and to k per head after RoPE (read from transformers' module and its forward): the atlas
    records it as the QK-Norm (per head, no weight, after RoPE), not among the other norms."""
    import inspect

    from transformers.models.llama4 import modeling_llama4

    config = transformers.AutoConfig.for_model(
        "llama4_text", vocab_size=64, hidden_size=32, intermediate_size=48, intermediate_size_mlp=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        use_qk_norm=True, no_rope_layers=[1, 1])
    attn = modeling_llama4.Llama4TextAttention(config, layer_idx=0)
    assert type(attn.qk_norm).__name__ == "Llama4TextL2Norm" and not list(attn.qk_norm.parameters())
    x = torch.randn(2, 5, 4, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps)
    torch.testing.assert_close(attn.qk_norm(x), want)          # per head: over head_dim only
    source = inspect.getsource(modeling_llama4.Llama4TextAttention.forward)
    assert source.index("apply_rotary_emb(") < source.index("self.qk_norm(query_states)")
    spec = atlas.atlas_spec("llama4_text", committed)
    assert (spec.qk_norm.scope, spec.qk_norm.before_rope) == ("per_head", False)
    assert spec.qk_norm.norm.kind == "rms" and spec.qk_norm.norm.eps == config.rms_norm_eps
    assert not [o for o in spec.other_norms if "qk_norm" in o.name]
    row = next(r for r in atlas.atlas_rows(committed) if r["model_type"] == "llama4_text")
    assert (row["qk_norm"], row["qk_weight"]) == ("per_head", "no weight")


def test_gated_norms_of_linear_attention_are_norms_and_named(committed):
    """Qwen3-Next's linear-attention layers hold a Qwen3NextRMSNormGated (its forward takes a
    gate); it is a norm module, and the card holds it with a note that it is gated."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    from normtools.cards.params import is_norm_module

    assert is_norm_module(Qwen3NextRMSNormGated(8))
    spec = atlas.atlas_spec("qwen3_next", committed)
    assert any(note.startswith("linear_attn.norm: Qwen3NextRMSNormGated is gated") for note in spec.notes), spec.notes
    assert "linear_attn.norm" in [o.name for o in spec.other_norms]


@pytest.mark.parametrize("model_type", ["qwen3_next", "olmo_hybrid", "qwen3"])
def test_qk_norm_is_read_from_the_first_layer_with_full_attention(model_type, committed):
    """In a hybrid the first layers are linear attention: the QK-Norm is read from the first
    layer whose config type is full attention (layer 0 when the config has no layer types)."""
    config = transformers.AutoConfig.for_model(**cards.tiny_config(model_type, from_defaults=True))
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    assert committed["families"][model_type]["probe"]["qk_layer"] == layer_types.index("full_attention")


def test_biases_are_read_from_every_layer_and_a_per_expert_score_bias_is_the_routers(committed):
    """AFMoE's first layer is dense (num_dense_layers = 1); its MoE layers hold
    ``expert_bias = nn.Parameter(zeros(num_experts))``, added to the router's scores before
    top-k: a router bias, and the experts' projections have none (bias=False)."""
    biases = atlas.atlas_spec("afmoe", committed).biases
    assert (biases.router, biases.experts) == (True, False)


def test_the_tiny_model_has_a_layer_of_each_kind(committed):
    """Jamba's defaults put attention on every 8th layer from layer 4 (attn_layer_period,
    attn_layer_offset): a tiny model of its first layers would be all Mamba. The tiny config
    keeps one layer of each kind, and the probe sees the attention layer's norms."""
    config = transformers.AutoConfig.for_model(**cards.tiny_config("jamba", from_defaults=True))
    assert set(config.layers_block_type) == {"mamba", "attention"}
    sublayers = committed["families"]["jamba"]["probe"]["sublayer_placements"]
    assert any("self_attn" in layer for layer in sublayers), sublayers


# ------------------------------------------------------------------ issue 30: classes of error

def test_an_unmapped_biased_linear_is_never_reported_as_no_bias(committed):
    """CTRL's attention holds Wq, Wk, Wv (capitals) and dense, each nn.Linear with a bias: the
    name rules match in any case. Mamba's dt_proj (nn.Linear, bias=True) is never called as a
    module (the mixer multiplies ``self.dt_proj.weight`` itself), so the probe cannot see what it
    feeds: q/k/v/o biases are unknown (None), never False."""
    import inspect

    from transformers.models.mamba import modeling_mamba

    assert atlas.atlas_spec("ctrl", committed).biases == cards.ProjectionBiases(
        q=True, k=True, v=True, o=True, mlp=True, lm_head=True)
    assert "time_step = self.dt_proj.weight @ " in inspect.getsource(modeling_mamba.MambaMixer)
    biases = atlas.atlas_spec("mamba", committed).biases
    assert (biases.q, biases.k, biases.v, biases.o) == (None, None, None, None)
    row = next(r for r in atlas.atlas_rows(committed) if r["model_type"] == "mamba")
    assert row["attn_bias"] is None and "q?" in row["proj_biases"]


def test_final_norm_is_found_through_a_scalar_and_a_token_slice(committed):
    """MiniCPM3ForCausalLM: ``hidden_states / config.logits_scaling``, then
    ``slice_logits_to_keep``, then lm_head: its model.norm is the final norm, not an other norm.
    And the comparison itself: a norm's rows divided by a scalar with the first rows dropped reach
    the head; rows of another direction do not."""
    import inspect

    from transformers.models.minicpm3 import modeling_minicpm3

    from normtools.cards.atlas.card import _reaches

    source = inspect.getsource(modeling_minicpm3.MiniCPM3ForCausalLM.forward)
    assert source.index("/ self.config.logits_scaling") < source.index("self.lm_head(")
    spec = atlas.atlas_spec("minicpm3", committed)
    assert spec.final_norm == cards.NormSpec("rms", 1e-5, False, 0.0, "llama")
    assert not [o for o in spec.other_norms if o.name == "norm"]
    gen = torch.Generator().manual_seed(0)
    normed = torch.nn.functional.rms_norm(torch.randn(1, 7, 64, generator=gen), (64,))
    assert _reaches(normed, normed[:, 3:] / 9.0)
    assert not _reaches(normed, normed[:, 3:] / 9.0 + 0.01)


def test_a_norm_is_recognised_by_what_it_does_not_its_name():
    """NemotronLayerNorm1P subclasses nn.LayerNorm and calls F.layer_norm with weight + 1.0 and
    a bias: a norm (of class and of behaviour), LayerNorm with scale 1 + w and a bias, against
    torch's own layer_norm in float64."""
    from transformers.models.nemotron.modeling_nemotron import NemotronLayerNorm1P

    from normtools.cards.atlas.norm import behaves_as_norm
    from normtools.cards.params import is_norm_module

    norm = NemotronLayerNorm1P(48, eps=3e-5)
    assert is_norm_module(norm) and behaves_as_norm(norm)
    assert not behaves_as_norm(torch.nn.Linear(48, 48))
    p = atlas.probe_norm(norm, (3, 5, 48))
    assert (p["kind"], p["eps"], p["offset"], p["bias"], p["casting"]) == ("layer", 3e-5, 1.0, True, "torch")
    x = torch.randn(3, 48, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
        torch.testing.assert_close(norm.double()(x), torch.nn.functional.layer_norm(
            x, (48,), norm.weight + 1.0, norm.bias, 3e-5))


def test_weightless_and_partial_qk_norm_and_a_norm_in_two_roles(committed):
    """Llama 4: the QK-Norm (Llama4TextL2Norm) has no weight, and runs only where
    ``use_qk_norm and self.use_rope``: no_rope_layers (default: every fourth layer without RoPE,
    48 layers) gives QK-Norm on three layers of four. nanochat: one weightless ``norm`` applied to
    the embeddings and after the layers: the final norm and an other norm."""
    import inspect

    from transformers.models.llama4 import modeling_llama4
    from transformers.models.nanochat import modeling_nanochat

    assert "if self.config.use_qk_norm and self.use_rope" in inspect.getsource(modeling_llama4.Llama4TextAttention)
    config = transformers.Llama4TextConfig()
    assert config.num_hidden_layers == 48 and config.no_rope_layers == [1, 1, 1, 0] * 12
    spec = atlas.atlas_spec("llama4_text", committed)
    assert spec.qk_norm.norm.affine is False
    assert dict(spec.layer_pattern)["qk_norm"] == "(qk×3, none)×12"
    assert atlas.atlas_spec("qwen3", committed).qk_norm.norm.affine is True
    assert inspect.getsource(modeling_nanochat.NanoChatModel.forward).count("self.norm(hidden_states)") == 2
    nanochat = atlas.atlas_spec("nanochat", committed)
    assert nanochat.final_norm is not None and not nanochat.final_norm.affine
    assert [o.name for o in nanochat.other_norms] == ["norm (also the final norm)"]


def test_an_other_norm_has_its_default_size(committed):
    """MiniMax-01's linear attention: ``self.norm = MiniMaxRMSNorm(self.head_dim *
    self.num_attention_heads)``; the defaults have 32 heads and hidden 4096, head_dim None
    (hidden / heads): the norm is 4096 wide, not the tiny model's 32."""
    config = transformers.MiniMaxConfig()
    spec = atlas.atlas_spec("minimax", committed)
    norm = next(o for o in spec.other_norms if o.name == "self_attn.norm")
    assert norm.dim == config.hidden_size // config.num_attention_heads * config.num_attention_heads == 4096


def test_a_gated_norm_is_probed_with_a_gate_whose_silu_is_the_identity(committed):
    """Qwen3-Next's linear attention: ``Qwen3NextRMSNormGated(head_v_dim, eps=1e-6)``, weight *
    x̂, times silu(gate.float()): probed with gate 32 (silu(32) == 32 in float32), the card holds
    an RMSNorm of eps 1e-6 over linear_value_head_dim (128), scale w."""
    gate = torch.tensor(32.0)
    assert torch.nn.functional.silu(gate) == gate
    spec = atlas.atlas_spec("qwen3_next", committed)
    norm = next(o for o in spec.other_norms if o.name == "linear_attn.norm")
    assert (norm.dim, norm.norm) == (transformers.Qwen3NextConfig().linear_value_head_dim,
                                     cards.NormSpec("rms", 1e-6, False, 0.0, "llama"))
    assert any("gated" in n and "after the norm" in n for n in spec.notes)


def test_layer_varying_families_show_their_pattern(capsys, committed):
    """Qwen3-Next's defaults: layer_types (linear_attention x3, full_attention) x12 over 48 layers,
    q/k norms only in full attention; the card, ``normtools card`` and ``normtools diff`` show it."""
    config = transformers.Qwen3NextConfig()
    assert config.num_hidden_layers == 48
    assert config.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 12
    pattern = dict(atlas.atlas_spec("qwen3_next", committed).layer_pattern)
    assert pattern == {"qk_norm": "(none×3, qk)×12", "attention": "(linear_attention×3, full_attention)×12"}
    code, out, _ = run_cli(capsys, "card", "qwen3_next")
    assert code == 0 and "| Layers: attention | (linear_attention×3, full_attention)×12 |" in out
    code, out, _ = run_cli(capsys, "diff", "qwen3", "qwen3_next", "--json")
    assert code == 0 and json.loads(out)["layer_pattern"][0] == []
    assert atlas.atlas_spec("llama", committed).layer_pattern == ()


def test_checkpoint_cards_differ_from_default_cards_where_the_configs_do(committed):
    """Llama 3 8B's config.json sets rms_norm_eps 1e-5 and 8 kv heads; LlamaConfig's defaults
    are 1e-6 and 32 (num_key_value_heads None: as many as the heads)."""
    from normtools.cards.sources import load_bundled_config

    published = load_bundled_config("llama-3-8b")
    default = transformers.LlamaConfig()
    d = atlas.checkpoint_differences(committed)["llama-3-8b"]
    assert d["block_norm.eps"] == [default.rms_norm_eps, published["rms_norm_eps"]]
    assert d["num_kv_heads"] == [default.num_attention_heads, published["num_key_value_heads"]]
