"""Chapter 7's comparisons (normtools.lab.designs) and the QK-Norm variants it reads from
transformers: each against an independent computation (float64 equations, transformers' own
modules and configs, hand-made tables)."""

import inspect
import math

import numpy as np
import pandas as pd
import pytest
import torch

import normtools
from normtools.lab import designs
from normtools.lab.data import load_corpus
from normtools.lab.probes import depth_profile
from normtools.lab.tinylm import DyT, TinyLM, TinyLMConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_every_design_builds_the_model_it_names():
    expected = {"Pre-LN": ("pre", "rms"), "Post-LN": ("post", "rms"), "DeepNorm": ("deepnorm", "rms"),
                "Admin": ("admin", "rms"), "Mix-LN": ("mix_ln", "rms"),
                "LayerNorm Scaling": ("lns", "rms"), "Peri-LN (sandwich)": ("sandwich", "rms"),
                "res-post-norm": ("post_sublayer", "rms"), "nGPT": ("ngpt", "rms"),
                "DyT (Pre-LN)": ("pre", "dyt")}
    assert set(designs.DESIGNS) == set(expected)
    for name, fields in designs.DESIGNS.items():
        model = TinyLM(TinyLMConfig.tiny(**fields))
        assert (model.config.placement, model.config.norm) == expected[name]
    dyt = TinyLM(TinyLMConfig.tiny(**designs.DESIGNS["DyT (Pre-LN)"]))
    assert isinstance(dyt.final_norm, DyT)
    with pytest.raises(ValueError, match="unknown designs"):
        designs.depth_profiles(["Pre-LN", "BatchNorm"], None, [0], TinyLMConfig())


def test_depth_summary_is_last_over_first_rms_and_first_over_last_grad():
    profiles = pd.DataFrame({
        "design": ["A"] * 3 + ["B"] * 2, "seed": [0] * 5, "layer": [2, 0, 1, 0, 1],
        "residual_rms": [4.0, 1.0, 2.0, 3.0, 1.5], "grad_norm": [2.0, 6.0, 3.0, 1.0, 4.0],
    })
    got = designs.depth_summary(profiles).set_index("design")
    assert got.loc["A", "rms_growth"] == pytest.approx(4.0)
    assert got.loc["A", "grad_ratio"] == pytest.approx(3.0)
    assert got.loc["B", "rms_growth"] == pytest.approx(0.5)
    assert got.loc["B", "grad_ratio"] == pytest.approx(0.25)


def test_depth_profiles_one_row_per_design_seed_and_layer():
    config = TinyLMConfig.tiny(depth=3, backend="torch")
    batch = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    df = designs.depth_profiles(["Pre-LN", "Post-LN"], batch, [0, 1], config)
    assert len(df) == 2 * 2 * 3
    assert df.groupby(["design", "seed"]).size().eq(3).all()
    # the seed sets the initialization: the same design and seed gives the same profile
    again = designs.depth_profiles(["Post-LN"], batch, [1], config)
    mine = df[(df["design"] == "Post-LN") & (df["seed"] == 1)].reset_index(drop=True)
    np.testing.assert_allclose(again["residual_rms"], mine["residual_rms"], rtol=1e-6)
    assert not np.allclose(df.loc[df["seed"] == 0, "residual_rms"], df.loc[df["seed"] == 1, "residual_rms"])


def test_admin_is_profiled_before_the_depth_probe_and_the_training():
    """Both measurements run Admin's profiling pass first. Before it, an Admin model is Post-LN
    exactly (ω = 1, same initialization), so equal numbers would mean it did not run."""
    from normtools.lab.grid import run_cell

    config = TinyLMConfig.tiny(depth=2, backend="torch")
    batch = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    admin = designs.depth_profiles(["Admin"], batch, [0], config)
    plain = designs.depth_profiles(["Post-LN"], batch, [0], config)
    assert not np.allclose(admin["residual_rms"], plain["residual_rms"], rtol=1e-3)
    torch.manual_seed(0)
    unprofiled = depth_profile(TinyLM(config.replace(placement="admin")), batch)
    np.testing.assert_allclose(unprofiled["residual_rms"], plain["residual_rms"], rtol=1e-5)
    runs = {p: run_cell({"placement": p, "lr": 1e-3}, load_corpus(), config, steps=2, batch_size=2,
                        eval_batches=0).records for p in ("admin", "post")}
    assert not np.allclose(runs["admin"]["loss"], runs["post"]["loss"], rtol=1e-4)


def test_seed_spread():
    table = pd.DataFrame({"design": ["A", "A", "A", "B", "B", "C", "C"],
                          "loss": [1.0, 2.0, 4.0, 5.0, 6.0, 3.0, 7.0]})
    spread = designs.seed_spread(table, "loss")
    assert list(spread.index) == ["A", "B", "C"]
    assert spread.loc["A", "mean"] == pytest.approx(7 / 3)
    assert spread.loc["A", "median"] == 2.0 and spread.loc["B", "median"] == 5.5
    assert (spread.loc["A", "min"], spread.loc["A", "max"], spread.loc["A", "seeds"]) == (1.0, 4.0, 3)


def test_train_designs_one_row_per_design_lr_and_seed():
    config = TinyLMConfig.tiny(max_seq_len=16, backend="torch")
    table = designs.train_designs(["Pre-LN", "DyT (Pre-LN)"], load_corpus(), config, lrs=[1e-2],
                                  seeds=[0, 1], steps=3, batch_size=2, eval_batches=1)
    assert list(table[["design", "seed"]].itertuples(index=False, name=None)) == [
        ("Pre-LN", 0), ("Pre-LN", 1), ("DyT (Pre-LN)", 0), ("DyT (Pre-LN)", 1)]
    assert {"final_loss", "logit_max_peak", "grad_norm_spike_score", "diverged"} <= set(table.columns)
    assert np.isfinite(table["final_loss"]).all()


def d64(t):
    return t.detach().to(torch.float64)


def test_llama4_qk_norm_is_a_weightless_rms_norm_after_rope():
    """Llama4TextL2Norm: x · rsqrt(mean(x²) + eps) over head_dim, no parameters — an RMSNorm
    without scale (so √d times x/‖x‖₂ up to eps, not x/‖x‖₂), applied after RoPE."""
    q_norm, k_norm, config = designs.transformers_qk_norm("llama4_text")
    assert q_norm is k_norm and not list(q_norm.parameters())
    x = torch.randn(3, 5, config.num_attention_heads, config.head_dim, generator=torch.Generator().manual_seed(0))
    want = d64(x) / torch.sqrt(d64(x).pow(2).mean(-1, keepdim=True) + config.rms_norm_eps)
    torch.testing.assert_close(d64(q_norm(x)), want, rtol=1e-6, atol=1e-6)
    unit = d64(x) / torch.linalg.vector_norm(d64(x), dim=-1, keepdim=True)
    torch.testing.assert_close(want, unit * math.sqrt(config.head_dim), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(want, unit, rtol=0.1)
    torch.testing.assert_close(normtools.rms_norm(x, None, config.rms_norm_eps, backend="torch"), q_norm(x))
    from transformers.models.llama4.modeling_llama4 import Llama4TextAttention

    source = inspect.getsource(Llama4TextAttention.forward)
    assert source.index("apply_rotary_emb(") < source.index("self.qk_norm(query_states)")


def test_chameleon_qk_norm_is_a_layer_norm_per_head_with_per_head_weights_before_rope():
    q_norm, k_norm, config = designs.transformers_qk_norm("chameleon")
    heads, head_dim = config.num_attention_heads, config.hidden_size // config.num_attention_heads
    assert q_norm.weight.shape == q_norm.bias.shape == (heads, head_dim)
    assert k_norm.weight.shape == (config.num_key_value_heads, head_dim)
    with torch.no_grad():
        q_norm.weight.normal_(1.0, 0.3, generator=torch.Generator().manual_seed(1))
        q_norm.bias.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(2))
    x = torch.randn(7, heads, head_dim, generator=torch.Generator().manual_seed(0)) + 0.5
    xd = d64(x)
    mean = xd.mean(-1, keepdim=True)
    var = ((xd - mean) ** 2).mean(-1, keepdim=True)
    want = (xd - mean) / torch.sqrt(var + 1e-5) * d64(q_norm.weight) + d64(q_norm.bias)
    torch.testing.assert_close(d64(q_norm(x)), want, rtol=1e-5, atol=1e-5)
    from transformers.models.chameleon.modeling_chameleon import ChameleonAttention

    source = inspect.getsource(ChameleonAttention.forward)
    assert source.index("self.q_norm(") < source.index("apply_rotary_pos_emb(")


def test_released_designs_match_transformers():
    from transformers import AutoConfig

    table = designs.released_designs().set_index("model")
    assert (table.loc["gemma-3-4b", "placement"], table.loc["gemma-3-4b", "qk_norm"]) == ("sandwich", "per_head")
    assert (table.loc["olmo-2-1124-7b", "placement"], table.loc["olmo-2-1124-7b", "qk_norm"]) == (
        "post_sublayer", "per_layer")
    gemma2 = AutoConfig.for_model("gemma2")
    assert f"attn_logit_softcapping = {gemma2.attn_logit_softcapping}" in table.loc["gemma2", "softcapping"]
    assert table.loc["gemma-3-4b", "softcapping"] == "-"
    model = normtools.cards.build_model(normtools.cards.tiny_config("deepseek_v3"))
    latent = sorted({name.split("layers.0.")[1] for name, _ in model.named_modules()
                     if name.startswith("model.layers.0.") and name.endswith("a_layernorm")})
    assert set(table.loc["deepseek_v3", "other_norms"].split(", ")) == set(latent) == {
        "self_attn.q_a_layernorm", "self_attn.kv_a_layernorm"}


def test_sizes_build_valid_models_and_trained_designs_are_designs():
    for size, settings in designs.RELATED_SIZES.items():
        for key in ("probe_model", "model"):
            TinyLMConfig(**settings[key])
        assert settings["steps"] > 0 and settings["lrs"], size
    assert set(designs.TRAINED_DESIGNS) <= set(designs.DESIGNS)
    assert designs.RELATED_SIZES["cpu"]["probe_model"]["depth"] > designs.RELATED_SIZES["cpu"]["model"]["depth"]


def test_atlas_table_is_the_atlas_with_other_norm_names():
    from normtools.cards.atlas import atlas_spec, load_atlas

    atlas = load_atlas()
    table = designs.atlas_table(atlas).set_index("model_type")
    assert set(table.index) == set(atlas["families"])
    for model_type in ("olmo2", "gemma3_text", "deepseek_v3", "llama"):
        spec = atlas_spec(model_type, atlas)
        assert table.loc[model_type, "placement"] == spec.placement
        assert table.loc[model_type, "qk_norm"] == spec.qk_norm.scope
        names = table.loc[model_type, "other_norm_names"]
        assert (names.split(", ") if names != "-" else []) == [o.name for o in spec.other_norms]


def test_depth_profiles_takes_ids_or_an_inputs_targets_pair():
    config = TinyLMConfig.tiny(depth=2, backend="torch")
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))
    from_ids = designs.depth_profiles(["Mix-LN"], ids, [0], config)
    from_pair = designs.depth_profiles(["Mix-LN"], (ids[:, :-1], ids[:, 1:]), [0], config)
    np.testing.assert_allclose(from_pair["grad_norm"], from_ids["grad_norm"], rtol=1e-6)


def test_train_designs_scores_spikes_with_the_window_it_is_given():
    """A run no longer than the window has no spike score (NaN); with a shorter window (chapter
    4a's adaptation, scaled down here) it has one, equal to spike_score of its gradient norms."""
    from normtools.lab.grid import run_cell
    from normtools.lab.train import spike_score

    config = TinyLMConfig.tiny(max_seq_len=16, backend="torch")
    kwargs = dict(lrs=[1e-2], seeds=[0], steps=6, batch_size=2, eval_batches=0)
    default = designs.train_designs(["Pre-LN"], load_corpus(), config, **kwargs)
    assert np.isnan(default["grad_norm_spike_score"]).all()
    short = designs.train_designs(["Pre-LN"], load_corpus(), config, spike_window=3, spike_k=0.5, **kwargs)
    run = run_cell({"placement": "pre", "lr": 1e-2}, load_corpus(), config, steps=6, batch_size=2,
                   seed=0, eval_batches=0)
    assert short["grad_norm_spike_score"].iloc[0] == pytest.approx(
        spike_score(run.records["grad_norm"], 3, 0.5))


def test_glossary_terms_of_this_chapter_point_to_its_sections():
    """Every glossary entry that points to chapter 7 names one of its section labels, and that
    label is defined in the chapter ("(label)=" in a markdown cell)."""
    import json
    import re
    from pathlib import Path

    from normtools.book.glossary import TERMS

    nb = json.loads((Path(__file__).resolve().parents[2] / "book" / "07_related.ipynb").read_text())
    labels = set(re.findall(r"^\(([\w-]+)\)=$", "\n".join(
        "".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown"), re.M))
    terms = [t for t in TERMS if t.chapter == "07_related"]
    assert {"DeepNorm", "Admin", "Mix-LN", "LayerNorm Scaling", "nGPT", "DyT"} <= {t.term for t in terms}
    for t in terms:
        assert t.section in labels, (t.term, t.section)
