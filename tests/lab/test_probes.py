"""depth_profile: its numbers against direct computations, on TinyLM and on tiny HF models."""

import math

import matplotlib
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from normtools import cards
from normtools.core.reference import rope_reference
from normtools.lab.tinylm import TinyLM, TinyLMConfig
from normtools.lab.probes import PROFILE_COLUMNS, depth_profile, plot_depth_profile, profile_placements

matplotlib.use("Agg")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def batch_of(vocab, B=3, T=17, seed=0):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def direct_logits(attn, h, cfg):
    """Pre-mask attention logits (B, H, T, T) in float64 from the attention's weights."""
    B, T, _ = h.shape
    d = cfg.head_dim
    h = h.double()
    q = (h @ attn.q_proj.weight.double().T).view(B, T, cfg.heads, d).transpose(1, 2)
    k = (h @ attn.k_proj.weight.double().T).view(B, T, cfg.n_kv_heads, d).transpose(1, 2)
    cos, sin = attn.rope_cos[:T].double(), attn.rope_sin[:T].double()
    q, k = rope_reference(q, cos, sin), rope_reference(k, cos, sin)
    k = k[:, [i * cfg.n_kv_heads // cfg.heads for i in range(cfg.heads)]]
    return torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(d)


def direct_stats(logits):
    """max, p99, mean |s|, entropy over causal pairs, with numpy."""
    T = logits.shape[-1]
    causal = np.tril(np.ones((T, T), dtype=bool))
    s = logits.detach().numpy()
    attended = s[..., causal]
    shifted = np.where(causal, s, -np.inf)
    p = np.exp(shifted - shifted.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        plogp = np.where(p > 0, p * np.log(p), 0.0)
    return {"logit_max": attended.max(), "logit_p99": np.percentile(attended, 99),
            "logit_abs_mean": np.abs(attended).mean(), "attn_entropy": -plogp.sum(-1).mean()}


@pytest.mark.parametrize("placement", ["pre", "post", "sandwich"])
def test_profile_equals_direct_computation_on_two_layers(placement):
    torch.manual_seed(0)
    model = TinyLM(TinyLMConfig.tiny(placement=placement, heads=4, kv_heads=2, backend="torch"))
    cfg = model.config
    ids = batch_of(cfg.vocab_size)
    df = depth_profile(model, ids)
    assert list(df.columns[:len(PROFILE_COLUMNS)]) == list(PROFILE_COLUMNS)
    assert len(df) == 2 and (df["placement"] == placement).all()
    assert all(p.grad is None for p in model.parameters())     # gradients cleared afterwards

    x, y = ids[:, :-1], ids[:, 1:]
    logits, _ = model(x)
    loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), y.reshape(-1))
    assert df.attrs["loss"] == pytest.approx(loss.item(), rel=1e-6)
    h = model.embed(x)
    for i, block in enumerate(model.layers):
        row = df.iloc[i]
        attn_in = block.norms["attn_in"](h) if "attn_in" in block.norms else h
        attn_out = block.self_attn(attn_in)
        after_attn = h + (block.norms["attn_out"](attn_out) if "attn_out" in block.norms else attn_out)
        if "attn_res" in block.norms:
            after_attn = block.norms["attn_res"](after_attn)
        mlp_in = block.norms["mlp_in"](after_attn) if "mlp_in" in block.norms else after_attn
        mlp_out = block.mlp(mlp_in)
        out = block(h)
        for column, value in (("residual_rms", out), ("attn_out_rms", attn_out), ("mlp_out_rms", mlp_out)):
            assert row[column] == pytest.approx(value.double().pow(2).mean().sqrt().item(), rel=1e-5)
        for column, module in (("grad_norm", block), ("grad_norm_attn", block.self_attn),
                               ("grad_norm_mlp", block.mlp)):
            grads = torch.autograd.grad(loss, list(module.parameters()), retain_graph=True)
            want = math.sqrt(sum(g.double().pow(2).sum().item() for g in grads))
            assert row[column] == pytest.approx(want, rel=1e-5), column
        for name, value in direct_stats(direct_logits(block.self_attn, attn_in, cfg)).items():
            assert row[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
        h = out


def test_depth_24_pre_ln_grows_post_ln_stays_near_one():
    """Xiong et al. 2020 at initialization: Pre-LN's residual stream grows with depth, each
    block adding to it; Post-LN renormalizes it after every sublayer."""
    ids = batch_of(256, B=4, T=33)
    profiles = {}
    for placement in ("pre", "post"):
        torch.manual_seed(0)
        model = TinyLM(width=64, depth=24, heads=4, max_seq_len=32, placement=placement, backend="torch")
        profiles[placement] = depth_profile(model, ids)["residual_rms"].to_numpy()
    pre, post = profiles["pre"], profiles["post"]
    assert np.all(np.abs(post - 1.0) < 0.01)
    assert pre[-1] > 3 * pre[0]
    assert np.corrcoef(np.arange(24), pre)[0, 1] > 0.95      # a steady rise, not one jump
    assert np.mean(np.diff(pre) > 0) > 0.9


HF_MODELS = ["llama", "qwen3", "olmo2", "gemma3"]


def tiny_hf(kind, attn_implementation="sdpa"):
    """A random tiny HF model (normtools.cards.tiny_config), 3 layers, Gemma 3 window 8."""
    torch.manual_seed(0)
    extra = {"sliding_window": 8} if kind == "gemma3" else {}
    config = cards.tiny_config(kind, num_hidden_layers=3, attn_implementation=attn_implementation, **extra)
    return cards.build_model(config).eval()


@pytest.mark.parametrize("kind", HF_MODELS)
def test_profile_of_hf_models_matches_their_own_outputs(kind):
    """Residual RMS from HF's hidden states, entropy from HF's eager attention probabilities,
    loss from HF's own loss; the probe leaves the model's attention implementation as it was."""
    model = tiny_hf(kind)
    ids = batch_of(64, B=2, T=21)
    df = depth_profile(model, ids)
    assert model.config._attn_implementation == "sdpa"
    assert len(df) == 3 and df["model_type"].iloc[0] == model.config.model_type

    eager = tiny_hf(kind, attn_implementation="eager")
    eager.load_state_dict(model.state_dict())
    with torch.no_grad():
        out = eager(ids[:, :-1], output_hidden_states=True, output_attentions=True)
    loss = F.cross_entropy(out.logits.reshape(-1, 64), ids[:, 1:].reshape(-1))
    assert df.attrs["loss"] == pytest.approx(loss.item(), rel=1e-5)
    # hidden_states[i + 1] is layer i's output, except the last (HF applies the final norm to it)
    for i in range(2):
        want = out.hidden_states[i + 1].double().pow(2).mean().sqrt().item()
        assert df["residual_rms"].iloc[i] == pytest.approx(want, rel=1e-5)
    for i, probs in enumerate(out.attentions):
        p = probs.double()
        entropy = -(torch.where(p > 0, p * p.log(), torch.zeros_like(p))).sum(-1).mean().item()
        assert df["attn_entropy"].iloc[i] == pytest.approx(entropy, rel=1e-4)
    assert (df["logit_max"] >= df["logit_p99"]).all()
    assert np.isfinite(df[list(PROFILE_COLUMNS)].to_numpy()).all()


def test_gemma3_sliding_window_limits_the_attended_pairs():
    """On a local layer with window w each query attends at most w keys: an entropy ≤ log(w)."""
    model = tiny_hf("gemma3")
    df = depth_profile(model, batch_of(64, B=2, T=33))
    local = [i for i, t in enumerate(model.config.layer_types) if t == "sliding_attention"]
    assert local
    assert (df["attn_entropy"].iloc[local] <= math.log(model.config.sliding_window) + 1e-6).all()


def test_plot_depth_profile_labels_and_lines():
    config = TinyLMConfig.tiny(depth=3, backend="torch")
    df = profile_placements(batch_of(256), ("pre", "post"), seed=0, config=config)
    torch.manual_seed(0)
    post = depth_profile(TinyLM(config, placement="post"), batch_of(256))
    fig = plot_depth_profile(df, metrics=("residual_rms", "grad_norm", "logit_max"), by="placement")
    axes = fig.axes
    assert len(axes) == 3
    assert [a.get_xlabel() for a in axes] == ["layer"] * 3
    assert axes[1].get_ylabel() == "gradient norm of the layer"
    assert [line.get_label() for line in axes[0].get_lines()] == ["pre", "post"]
    np.testing.assert_allclose(axes[0].get_lines()[1].get_ydata(), post["residual_rms"])
    with pytest.raises(ValueError, match="axes"):
        plot_depth_profile(df, metrics=("residual_rms", "grad_norm"), ax=axes[0])
