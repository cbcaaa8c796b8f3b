"""TinyLM: each placement's forward equals its printed equation, computed by hand in float64.

The hand computation below does not use normtools.lab.tinylm: norms, RoPE (as complex rotation),
attention (explicit loops over heads with the GQA head map), SwiGLU and each placement's
block are written out from their definitions, reading the model's weights. The designs of
chapter 7 too: DeepNorm's α and β from Wang et al. (2022)'s formulas, Admin's ω ⊙ x and its
profiling pass (the variances recomputed by hand), Mix-LN's layer split, LayerNorm Scaling's
1/√ℓ, nGPT (v/‖v‖ everywhere, its eigen learning rates, s_qk with the √d_k softmax scale, s_u,
s_v, s_z, and its matrices back on the sphere after an optimizer step), and DyT's
w·tanh(α·x) + b.
"""

import math
import re

import pytest
import torch

import normtools
from normtools.lab.blocks import PLACEMENT_NAMES, RELATED_PLACEMENTS, block_equation
from normtools.lab.tinylm import DyT, SphereNorm, TinyLM, TinyLMConfig, set_backend


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# What the book prints for each placement (the forms, with the norms named).
EXPECTED_TEXT = {
    "post": "x = N_attn_res(x + Attn(x))\nx = N_mlp_res(x + MLP(x))",
    "pre": "x = x + Attn(N_attn_in(x))\nx = x + MLP(N_mlp_in(x))",
    "sandwich": "x = x + N_attn_out(Attn(N_attn_in(x)))\nx = x + N_mlp_out(MLP(N_mlp_in(x)))",
    "post_sublayer": "x = x + N_attn_out(Attn(x))\nx = x + N_mlp_out(MLP(x))",
    "parallel": "x = x + Attn(N_in(x)) + MLP(N_in(x))",
    "none": "x = x + Attn(x)\nx = x + MLP(x)",
    "deepnorm": "x = N_attn_res(α·x + Attn(x))\nx = N_mlp_res(α·x + MLP(x))",
    "admin": "x = N_attn_res(ω_attn ⊙ x + Attn(x))\nx = N_mlp_res(ω_mlp ⊙ x + MLP(x))",
    "lns": "x = x + Attn(N_attn_in(x)/√ℓ)\nx = x + MLP(N_mlp_in(x)/√ℓ)",
    "ngpt": ("x = N_attn_res(x + α_attn ⊙ (N_attn_out(Attn(x)) − x))\n"
             "x = N_mlp_res(x + α_mlp ⊙ (N_mlp_out(MLP(x)) − x))"),
}


def d64(t):
    return t.detach().to(torch.float64)


def hand_sphere(x):
    """nGPT's normalization: each row scaled to L2 norm 1."""
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True)


def ngpt_vector(module):
    """An nGPT scaling vector as the paper parameterizes it: the stored p times init / scale."""
    return d64(module.weight) * module.gain


def hand_norm(norm, x, eps):
    if isinstance(norm, SphereNorm):
        return hand_sphere(x)
    w = d64(norm.weight)
    if isinstance(norm, DyT):
        return w * torch.tanh(d64(norm.alpha) * x) + d64(norm.bias)
    if isinstance(norm, normtools.RMSNorm):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * w + d64(norm.bias)


def hand_rms_rows(x, w, row, eps):
    """RMSNorm of each consecutive ``row``-long piece of the last dim, weight tiled over pieces."""
    shape = x.shape
    x = x.reshape(*shape[:-1], -1, row)
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y.reshape(shape) * w.repeat(shape[-1] // w.numel())


def hand_rope(x, theta):
    """x (T, d): the pair (x_i, x_{i+d/2}) as the complex number x_i + i·x_{i+d/2}, times e^{i·t·ω_i}."""
    T, d = x.shape
    omega = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    z = torch.complex(x[:, : d // 2], x[:, d // 2:]) * torch.polar(
        torch.ones(T, d // 2, dtype=torch.float64), torch.arange(T, dtype=torch.float64)[:, None] * omega)
    return torch.cat([z.real, z.imag], dim=-1)


def hand_attention(attn, h, cfg):
    """h (T, width) of one sequence → attention output (T, width)."""
    T = h.shape[0]
    d, H, Hk = cfg.head_dim, cfg.heads, cfg.n_kv_heads
    q, k, v = h @ d64(attn.q_proj.weight).T, h @ d64(attn.k_proj.weight).T, h @ d64(attn.v_proj.weight).T
    if cfg.qk_norm != "none":
        per_head = cfg.qk_norm == "per_head"
        q = hand_rms_rows(q, d64(attn.qk_norm.q_weight), d if per_head else H * d, cfg.eps)
        k = hand_rms_rows(k, d64(attn.qk_norm.k_weight), d if per_head else Hk * d, cfg.eps)
    heads_out = []
    for head in range(H):
        kv = head * Hk // H                        # GQA: query head → its kv head
        qh = hand_rope(q[:, head * d:(head + 1) * d], cfg.rope_theta)
        kh = hand_rope(k[:, kv * d:(kv + 1) * d], cfg.rope_theta)
        vh = v[:, kv * d:(kv + 1) * d]
        if cfg.placement == "ngpt":                # q, k on the unit sphere per head, times s_qk
            s_qk = ngpt_vector(attn.s_qk)[head * d:(head + 1) * d]
            qh, kh = s_qk * hand_sphere(qh), s_qk * hand_sphere(kh)
            scores = qh @ kh.T * math.sqrt(d)      # nGPT's softmax scale √d_k
        else:
            scores = qh @ kh.T / math.sqrt(d)
        scores = scores.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
        heads_out.append(torch.softmax(scores, dim=-1) @ vh)
    return torch.cat(heads_out, dim=-1) @ d64(attn.o_proj.weight).T


def hand_mlp(mlp, h):
    gate, up = h @ d64(mlp.gate_proj.weight).T, h @ d64(mlp.up_proj.weight).T
    if mlp.ngpt:                                   # u = s_u ⊙ u, ν = s_v ⊙ ν · √d_model
        gate, up = ngpt_vector(mlp.s_v) * gate * math.sqrt(h.shape[-1]), ngpt_vector(mlp.s_u) * up
    return (gate * torch.sigmoid(gate) * up) @ d64(mlp.down_proj.weight).T


def hand_block(block, x, cfg, layer):
    """The printed equation of cfg.placement, written out by hand for one sequence x (T, width)
    in decoder layer ``layer`` (0-based)."""
    def N(name, v):
        return hand_norm(block.norms[name], v, cfg.eps)

    def Attn(v):
        return hand_attention(block.self_attn, v, cfg)

    def MLP(v):
        return hand_mlp(block.mlp, v)

    L = cfg.depth
    p = cfg.placement
    if p == "mix_ln":       # Li et al. 2024: Post-LN in the first ⌊fraction·L⌋ layers
        p = "post" if layer < int(cfg.post_ln_fraction * L) else "pre"
    if p == "deepnorm":     # Wang et al. 2022, decoder-only: α = (2L)^(1/4)
        alpha = (2 * L) ** 0.25
        x = N("attn_res", alpha * x + Attn(x))
        x = N("mlp_res", alpha * x + MLP(x))
    elif p == "lns":        # Sun et al. 2025: the norm's output times 1/√ℓ, ℓ = layer + 1
        x = x + Attn(N("attn_in", x) / math.sqrt(layer + 1))
        x = x + MLP(N("mlp_in", x) / math.sqrt(layer + 1))
    elif p == "admin":      # Liu et al. 2020: x_i = LN(ω_i ⊙ x_{i-1} + f_i(x_{i-1}))
        x = N("attn_res", d64(block.omegas["attn"]) * x + Attn(x))
        x = N("mlp_res", d64(block.omegas["mlp"]) * x + MLP(x))
    elif p == "ngpt":       # Loshchilov et al. 2025: h ← S(h + α ⊙ (S(f(h)) − h))
        a_attn, a_mlp = ngpt_vector(block.rates["attn"]), ngpt_vector(block.rates["mlp"])
        x = hand_sphere(x + a_attn * (hand_sphere(Attn(x)) - x))
        x = hand_sphere(x + a_mlp * (hand_sphere(MLP(x)) - x))
    elif p == "post":
        x = N("attn_res", x + Attn(x))
        x = N("mlp_res", x + MLP(x))
    elif p == "pre":
        x = x + Attn(N("attn_in", x))
        x = x + MLP(N("mlp_in", x))
    elif p == "sandwich":
        x = x + N("attn_out", Attn(N("attn_in", x)))
        x = x + N("mlp_out", MLP(N("mlp_in", x)))
    elif p == "post_sublayer":
        x = x + N("attn_out", Attn(x))
        x = x + N("mlp_out", MLP(x))
    elif p == "parallel":
        h = N("in", x)
        x = x + Attn(h) + MLP(h)
    else:
        x = x + Attn(x)
        x = x + MLP(x)
    return x


def randomized_model(**config):
    """A TinyLM whose norm weights and biases are random too, so that each one matters."""
    torch.manual_seed(0)
    model = TinyLM(TinyLMConfig.tiny(backend="torch", **config))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() <= 1 or "q_weight" in name or "k_weight" in name:
                param.add_(0.3 * torch.randn_like(param))
    return model


CASES = [dict(placement=p) for p in PLACEMENT_NAMES] + [
    dict(placement="pre", norm="layer", heads=4, kv_heads=2),
    dict(placement="post", norm="layer", qk_norm="per_layer"),
    dict(placement="sandwich", qk_norm="per_head", heads=4, kv_heads=1),
    dict(placement="parallel", qk_norm="per_layer", heads=4, kv_heads=2),
    dict(placement="deepnorm", norm="layer"),
    dict(placement="admin", norm="layer"),
    dict(placement="admin", depth=3),
    dict(placement="mix_ln", post_ln_fraction=0.5, depth=3),
    dict(placement="lns", depth=3, qk_norm="per_head"),
    dict(placement="ngpt", depth=3),
    dict(placement="ngpt", heads=4, kv_heads=2),
    dict(placement="pre", norm="dyt"),
    dict(placement="post", norm="dyt", final_norm=True),
]


def expected_text(cfg, layer):
    if cfg.placement == "mix_ln":
        return EXPECTED_TEXT["post" if layer < int(cfg.post_ln_fraction * cfg.depth) else "pre"]
    return EXPECTED_TEXT[cfg.placement]


@pytest.mark.parametrize("config", CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_forward_equals_printed_equation(config):
    model = randomized_model(**config)
    cfg = model.config
    for layer in range(cfg.depth):
        assert block_equation(cfg, layer=layer) == expected_text(cfg, layer)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    x = model.embed(ids)
    for layer, block in enumerate(model.layers):
        got = block(x)
        want = torch.stack([hand_block(block, d64(seq), cfg, layer) for seq in x])
        torch.testing.assert_close(d64(got), want, rtol=1e-5, atol=1e-5)
        x = got
    # the whole model: blocks, then the final norm where the config has one, then the head
    logits, _ = model(ids)
    h = d64(x)
    if cfg.has_final_norm:
        h = hand_norm(model.final_norm, h, cfg.eps)
    want = h @ d64(model.lm_head.weight).T
    if cfg.placement == "ngpt":                    # nGPT's logit scaling s_z
        want = ngpt_vector(model.s_z) * want
    torch.testing.assert_close(d64(logits), want, rtol=1e-5, atol=1e-5)


def test_mix_ln_equation_names_its_layers():
    cfg = TinyLMConfig(placement="mix_ln", depth=8)           # ⌊0.25 · 8⌋ = 2 Post-LN layers
    assert block_equation(cfg) == ("layers 0-1 (post):\n" + EXPECTED_TEXT["post"]
                                   + "\nlayers 2-7 (pre):\n" + EXPECTED_TEXT["pre"])
    assert block_equation(cfg.replace(post_ln_fraction=0.0)) == "layers 0-7 (pre):\n" + EXPECTED_TEXT["pre"]
    model = TinyLM(cfg.replace(width=32, heads=2, max_seq_len=8))
    assert [b.placement for b in model.layers] == ["post"] * 2 + ["pre"] * 6


def test_final_norm_defaults():
    expected = {"post": False, "pre": True, "sandwich": True, "post_sublayer": True,
                "parallel": True, "none": False, "deepnorm": False, "admin": False,
                "mix_ln": True, "lns": True, "ngpt": False}
    for placement, on in expected.items():
        model = TinyLM(TinyLMConfig.tiny(placement=placement, backend="torch"))
        assert isinstance(model.final_norm, normtools.RMSNorm) is on
    model = TinyLM(TinyLMConfig.tiny(placement="post", final_norm=True, norm="layer"))
    assert isinstance(model.final_norm, normtools.LayerNorm)


@pytest.mark.parametrize("placement", PLACEMENT_NAMES + RELATED_PLACEMENTS)
def test_latex_equation_has_the_same_structure(placement):
    cfg = TinyLMConfig(placement=placement)
    text, latex = block_equation(cfg, "text"), block_equation(cfg, "latex")
    assert latex.startswith(r"\begin{aligned}") and latex.endswith(r"\end{aligned}")
    assert latex.count(r"\leftarrow") == text.count("x = ")
    assert latex.count(r"\text{layers") == text.count("layers ")
    assert latex.count(r"\alpha") == text.count("α·") + text.count("α_")
    assert latex.count(r"\omega") == text.count("ω_")
    assert latex.count(r"\sqrt{\ell}") == text.count("√ℓ")
    assert latex.count(r"\odot") == text.count("⊙")
    assert latex.count(r"\mathrm{N}") == text.count("N_")
    assert latex.count(r"\mathrm{Attn}") == text.count("Attn(")
    assert latex.count(r"\mathrm{MLP}") == text.count("MLP(")


@pytest.mark.parametrize("norm, kind", [("layer", normtools.LayerNorm), ("dyt", DyT)])
def test_norm_modules_follow_the_equation(norm, kind):
    """Each block holds exactly the norms its equation names, of the configured kind (nGPT's
    are always weightless sphere norms)."""
    for placement in PLACEMENT_NAMES + RELATED_PLACEMENTS:
        if placement == "ngpt" and norm != "rms":
            continue
        cfg = TinyLMConfig.tiny(placement=placement, norm=norm, depth=4)
        for layer, block in enumerate(TinyLM(cfg).layers):
            names = set(re.findall(r"N_(\w+)\(", expected_text(cfg, layer)))
            assert set(block.norms.keys()) == names
            assert all(isinstance(n, kind) for n in block.norms.values())
    ngpt = TinyLM(TinyLMConfig.tiny(placement="ngpt"))
    assert all(isinstance(n, SphereNorm) for b in ngpt.layers for n in b.norms.values())
    assert not [name for name, _ in ngpt.named_parameters() if "norms" in name]


def test_dyt_and_ngpt_initial_values():
    cfg = TinyLMConfig.tiny(norm="dyt", dyt_alpha=0.7)
    dyt = TinyLM(cfg).layers[0].norms["attn_in"]
    assert dyt.alpha.shape == () and dyt.alpha.item() == pytest.approx(0.7)
    assert torch.equal(dyt.weight, torch.ones(32)) and torch.equal(dyt.bias, torch.zeros(32))
    model = TinyLM(TinyLMConfig.tiny(placement="ngpt", ngpt_alpha=0.1))
    block, base_scale = model.layers[1], 32 ** -0.5
    # the paper's (init, scale) of each vector: α_A, α_M (ngpt_alpha, 1/√d), s_qk (1, 1/√d),
    # s_u, s_v (1, 1), s_z (1, 1/√d); the stored parameter starts at the scale
    vectors = [(block.rates["attn"], 0.1, base_scale), (block.rates["mlp"], 0.1, base_scale),
               (block.self_attn.s_qk, 1.0, base_scale), (block.mlp.s_u, 1.0, 1.0),
               (block.mlp.s_v, 1.0, 1.0), (model.s_z, 1.0, base_scale)]
    for vector, init, scale in vectors:
        assert torch.allclose(vector.weight, torch.full_like(vector.weight, scale))
        assert torch.allclose(vector(), torch.full_like(vector.weight, init))
    admin = TinyLM(TinyLMConfig.tiny(placement="admin")).layers[0]
    assert all(torch.equal(w, torch.ones(32)) for w in admin.omegas.values())  # before profiling


def test_init_is_gpt2_like():
    torch.manual_seed(0)
    depth = 8
    for scaled in (False, True):
        model = TinyLM(width=256, depth=depth, heads=4, scaled_residual_init=scaled, backend="torch")
        q_std = model.layers[0].self_attn.q_proj.weight.std().item()
        o_std = model.layers[0].self_attn.o_proj.weight.std().item()
        down_std = model.layers[0].mlp.down_proj.weight.std().item()
        assert abs(q_std - 0.02) < 0.001
        expected = 0.02 / math.sqrt(2 * depth) if scaled else 0.02
        assert abs(o_std - expected) < 0.05 * expected
        assert abs(down_std - expected) < 0.05 * expected
        assert torch.equal(model.layers[0].norms["attn_in"].weight, torch.ones(256))


def test_deepnorm_init_scales_v_o_and_mlp_by_beta():
    """Wang et al. 2022 (decoder-only): β = (8L)^(−1/4) on v, o and the FFN; q, k unscaled."""
    torch.manual_seed(0)
    depth = 6
    model = TinyLM(width=256, depth=depth, heads=4, placement="deepnorm", backend="torch")
    beta = (8 * depth) ** -0.25
    layer = model.layers[0]
    stds = {name: getattr(sub, name).weight.std().item()
            for sub, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                               (layer.mlp, ("gate_proj", "up_proj", "down_proj")))
            for name in names}
    for name, std in stds.items():
        expected = 0.02 * (1.0 if name in ("q_proj", "k_proj") else beta)
        assert abs(std - expected) < 0.05 * expected, name


def test_set_backend_switches_every_norm():
    model = TinyLM(TinyLMConfig.tiny(placement="sandwich", qk_norm="per_head"))
    set_backend(model, "torch")
    norms = [m for m in model.modules() if isinstance(m, (normtools.RMSNorm, normtools.QKNorm))]
    assert len(norms) == 2 * 4 + 2 + 1          # 4 block norms and 1 QK-Norm per layer, final norm
    assert all(m.backend == "torch" for m in norms)
    assert model.config.backend == "torch"
    with pytest.raises(ValueError, match="backend"):
        set_backend(model, "cuda")


@pytest.mark.parametrize("placement, qk_norm, norm", [("sandwich", "per_head", "rms"),
                                                      ("post", "per_layer", "layer")])
def test_triton_backend_gives_the_same_forward_and_gradients(placement, qk_norm, norm):
    """All norms switched to the Triton kernels (Triton's interpreter on CPU) agree with the
    PyTorch reference: values and gradients of every parameter."""
    model = randomized_model(placement=placement, qk_norm=qk_norm, norm=norm)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(2))
    results = []
    for backend in ("torch", "triton"):
        set_backend(model, backend)
        model.zero_grad()
        logits, loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        results.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (want_logits, want_grads), (got_logits, got_grads) = results
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("bad, match", [
    (dict(placement="postln"), "placement"),
    (dict(norm="batch"), "norm"),
    (dict(qk_norm="global"), "qk_norm"),
    (dict(width=30, heads=4), "divisible"),
    (dict(width=36, heads=4), "even"),
    (dict(heads=4, kv_heads=3), "multiple"),
    (dict(eps=0.0), "eps"),
    (dict(backend="cuda"), "backend"),
    (dict(placement="mix_ln", post_ln_fraction=1.5), "post_ln_fraction"),
    (dict(norm="dyt", dyt_alpha=0.0), "positive"),
    (dict(placement="ngpt", norm="layer"), "ngpt"),
    (dict(placement="ngpt", qk_norm="per_head"), "ngpt"),
])
def test_config_rejects_bad_values(bad, match):
    with pytest.raises(ValueError, match=match):
        TinyLMConfig(**bad)


def test_forward_rejects_too_long_input():
    model = TinyLM(TinyLMConfig.tiny(backend="torch"))
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, model.config.max_seq_len + 1, dtype=torch.long))


def test_admin_profiling_sets_omega_from_the_variances_by_hand():
    """Admin's profiling pass (Liu et al. 2020; the authors' Transformer-Clinic code): ω_1 = 1,
    then sublayer after sublayer ω_{i+1} = sqrt(Var[ω_i ⊙ x_{i−1}] + Var[f_i(x_{i−1})]),
    variances over all elements of the batch. Recomputed here in float64 from the equations."""
    torch.manual_seed(0)
    model = TinyLM(TinyLMConfig.tiny(placement="admin", depth=3, backend="torch"))
    ids = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(4))
    report = model.initialize_from_data(ids)
    cfg = model.config

    def var(t):
        return ((t - t.mean()) ** 2).mean().item()

    ratio, want_omega, want_var = 1.0, [], []
    x = d64(model.embed(ids))
    for block in model.layers:
        for f, fn in (("attn", lambda v: hand_attention(block.self_attn, v, cfg)),
                      ("mlp", lambda v: hand_mlp(block.mlp, v))):
            h = torch.stack([fn(seq) for seq in x])
            want_omega.append(ratio)
            want_var.append(var(h))
            ratio = math.sqrt(var(ratio * x) + var(h))
            x = hand_norm(block.norms[f"{f}_res"], want_omega[-1] * x + h, cfg.eps)
    assert [r["omega"] for r in report] == pytest.approx(want_omega, rel=1e-5)
    assert [r["sublayer_variance"] for r in report] == pytest.approx(want_var, rel=1e-4)
    for i, block in enumerate(model.layers):   # every ω is filled with its sublayer's value
        for j, f in enumerate(("attn", "mlp")):
            assert torch.allclose(d64(block.omegas[f]), torch.full((32,), want_omega[2 * i + j],
                                                                   dtype=torch.float64))
    assert want_omega[1] != pytest.approx(1.0)    # the pass changed something
    assert TinyLM(TinyLMConfig.tiny()).initialize_from_data(ids) is None


def test_ngpt_weights_are_on_the_sphere_at_init_and_after_a_training_step():
    """Every nGPT matrix has unit norm along its embedding dimension (embedding and output
    head rows, q/k/v/gate/up input rows, o/down output columns), at initialization and again
    after an optimizer step of normtools.lab.train.train, which moves them off it."""
    from normtools.lab.data import TextData
    from normtools.lab.train import train

    torch.manual_seed(0)
    model = TinyLM(TinyLMConfig.tiny(placement="ngpt", backend="torch"))
    width = model.config.width

    def norms_along_embedding(m):
        out = {}
        for name, module in m.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("embed", "lm_head", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj",
                        "o_proj", "down_proj"):
                w = d64(module.weight)
                dim = [i for i, n in enumerate(w.shape) if n == width]
                dim = dim[-1] if leaf not in ("o_proj", "down_proj") else 0
                out[name] = torch.linalg.vector_norm(w, dim=dim)
        return out

    assert len(norms_along_embedding(model)) == 2 + 7 * model.config.depth
    for name, n in norms_along_embedding(model).items():
        torch.testing.assert_close(n, torch.ones_like(n), msg=name)
    data = TextData(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0)),
                    torch.randint(0, 256, (512,), generator=torch.Generator().manual_seed(1)))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    train(model, data, steps=2, lr=1e-2, batch_size=2, eval_batches=0, quiet=True)
    assert not torch.equal(before["layers.0.self_attn.q_proj.weight"],
                           model.layers[0].self_attn.q_proj.weight)
    for name, n in norms_along_embedding(model).items():
        torch.testing.assert_close(n, torch.ones_like(n), msg=name)
    # a plain AdamW step, without the renormalization, leaves them off the sphere
    model.after_optimizer_step = lambda: None
    train(model, data, steps=1, lr=1e-2, batch_size=2, eval_batches=0, quiet=True)
    off = norms_along_embedding(model)["layers.0.self_attn.q_proj"]
    assert (off - 1).abs().max() > 1e-4
