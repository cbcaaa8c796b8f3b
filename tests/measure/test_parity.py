"""normtools.measure.parity: ulps against torch.nextafter, compare() against PyTorch's own isclose, the
backend parity table against the Hugging Face norm modules, learned shapes against configs."""

import pytest
import torch
from collections import Counter
from transformers import GPT2Config, GPT2Model, Qwen2Config, Qwen2Model, Qwen3Config, Qwen3Model
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from normtools.measure.parity import NAN_ULPS, compare, learned_shapes, norm_parity, ulp_distance

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def step(x, steps, direction):
    """Move each element of x by steps[i] representable values towards ±inf (torch.nextafter)."""
    target = torch.full_like(x, direction * float("inf"))
    for k in range(int(steps.max()) + 1):
        x = torch.where(steps > k, torch.nextafter(x, target), x)
    return x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("direction", (1, -1))
def test_ulp_distance_counts_nextafter_steps(dtype, direction):
    g = torch.Generator().manual_seed(1)
    tiny = torch.finfo(dtype).tiny
    a = torch.cat([torch.randn(500, generator=g) * 10.0 ** torch.randint(-3, 4, (500,), generator=g),
                   # around zero, so that steps cross from negative to positive (−0 and +0 are
                   # one point) and through the subnormals
                   torch.tensor([-tiny, tiny, 0.0, -0.0, -tiny / 4, tiny / 4])]).to(dtype)
    steps = torch.randint(0, 7, a.shape, generator=g)
    b = step(a, steps, direction)
    assert torch.equal(ulp_distance(a, b), steps)
    assert torch.equal(ulp_distance(b, a), steps)


def test_ulp_distance_special_values():
    big = torch.finfo(torch.bfloat16).max
    a = torch.tensor([0.0, float("nan"), float("nan"), big, float("inf"), -1.0], dtype=torch.bfloat16)
    b = torch.tensor([-0.0, float("nan"), 1.0, float("inf"), float("inf"), 1.0], dtype=torch.bfloat16)
    # −1 → 1 crosses zero: from −1 down to the smallest negative, −0/+0, up to 1.
    ones_to_zero = int(torch.tensor(1.0, dtype=torch.bfloat16).view(torch.int16))
    expected = torch.tensor([0, 0, NAN_ULPS, 1, 0, 2 * ones_to_zero])
    assert torch.equal(ulp_distance(a, b), expected)


def test_ulp_distance_rejects_bad_input():
    x = torch.zeros(3)
    with pytest.raises(TypeError):
        ulp_distance(x, x.double())
    with pytest.raises(TypeError):
        ulp_distance(x.double(), x.double())
    with pytest.raises(ValueError):
        ulp_distance(x, torch.zeros(4))
    with pytest.raises(TypeError):
        ulp_distance(x, [0.0, 0.0, 0.0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_compare_sees_a_perturbation(dtype):
    g = torch.Generator().manual_seed(2)
    exact = torch.randn(64, 33, generator=g)
    candidate = exact.to(dtype)
    steps = torch.zeros(candidate.shape, dtype=torch.int64)
    steps[3, 5], steps[40, 0], steps[63, 32] = 3, 7, 2
    candidate = step(candidate, steps, 1)

    p = compare(exact, candidate)
    rounded = exact.to(dtype)
    assert p.max_ulps == int(ulp_distance(rounded, candidate).max())
    # exact rounds to the nearest value; 7 steps above it are 7 ulps away (or 6, 8 at a power
    # of two), never fewer than 6
    assert 6 <= p.max_ulps <= 8
    err = (candidate.double() - exact.double()).abs()
    assert p.max_abs == pytest.approx(float(err.max()), rel=0, abs=0)
    assert p.max_rel == pytest.approx(float((err / exact.double().abs()).max()), rel=1e-12)
    close = torch.isclose(candidate.double(), exact.double(), rtol=p.rtol, atol=p.atol)
    assert p.n_mismatch == int((~close).sum())
    assert p.allclose == bool(close.all())
    assert p.shape == (64, 33) and p.dtype == str(dtype).removeprefix("torch.")


def test_compare_equal_and_nan_and_inf():
    x = torch.tensor([1.0, float("nan"), float("inf"), -2.0])
    assert compare(x, x.clone()).allclose
    assert compare(x, x.clone()).max_ulps == 0
    moved_nan = torch.tensor([1.0, 0.0, float("inf"), float("nan")])
    p = compare(x, moved_nan)
    assert p.n_nan_mismatch == 2 and p.n_mismatch == 2 and not p.allclose
    finite_for_inf = torch.tensor([1.0, float("nan"), 3.0e38, -2.0])
    p = compare(x, finite_for_inf)
    assert p.n_mismatch == 1 and not p.allclose
    with pytest.raises(ValueError):
        compare(x, x[:3])
    with pytest.raises(TypeError):
        compare(x, x.double())


def _llama_norm(n, dtype):
    module = LlamaRMSNorm(n, eps=1e-6)
    with torch.no_grad():
        module.weight.copy_(1 + 0.1 * torch.randn(n, generator=torch.Generator().manual_seed(3)))
    return module.to(dtype)


def _gemma_norm(n, dtype):
    module = Gemma3RMSNorm(n, eps=1e-6)
    with torch.no_grad():
        module.weight.copy_(0.1 * torch.randn(n, generator=torch.Generator().manual_seed(4)))
    return module.to(dtype)


def _rows(rows, reference):
    return {r["candidate"]: r for r in rows if r["reference"] == reference}


@pytest.mark.parametrize("make, casting, offset", [(_llama_norm, "llama", 0.0),
                                                   (_gemma_norm, "gemma", 1.0)])
def test_norm_parity_against_hf_modules(make, casting, offset):
    module = make(64, torch.bfloat16)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    rows = norm_parity(module, x, casting=casting, offset=offset,
                       backends=("normtools torch", "normtools triton"))
    vs_hf = _rows(rows, "HF module")
    # The plain-PyTorch backend reproduces the HF module bit for bit.
    assert vs_hf["normtools torch"]["status"] == "ok"
    assert vs_hf["normtools torch"]["max_ulps"] == 0
    assert vs_hf["normtools torch"]["max_abs"] == 0.0
    # Triton (the interpreter on CPU) computes the same function to within one rounding.
    assert vs_hf["normtools triton"]["status"] == "ok"
    assert vs_hf["normtools triton"]["max_ulps"] <= 1
    vs_exact = _rows(rows, "float32 math")
    assert set(vs_exact) == {"HF module", "normtools torch", "normtools triton"}
    assert vs_exact["HF module"]["allclose"]
    assert vs_exact["HF module"]["max_ulps"] <= 2  # llama casting rounds twice


def test_norm_parity_detects_a_wrong_convention():
    """Gemma's module run as if it were Llama's convention: the table must show it."""
    module = _gemma_norm(64, torch.bfloat16)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    rows = norm_parity(module, x, casting="llama", offset=0.0, backends=("normtools torch",))
    wrong = _rows(rows, "HF module")["normtools torch"]
    assert not wrong["allclose"] and wrong["max_ulps"] > 10


def test_norm_parity_layer_norm_and_unknown_backend():
    module = torch.nn.LayerNorm(32, eps=1e-5)
    with torch.no_grad():
        module.weight.normal_(1.0, 0.1)
        module.bias.normal_(0.0, 0.1)
    x = torch.randn(4, 32)
    rows = norm_parity(module, x, backends=("normtools torch",))
    # float32 LayerNorm: ATen's fused kernel and the reference sum in different orders
    assert _rows(rows, "HF module")["normtools torch"]["allclose"]
    assert _rows(rows, "float32 math")["HF module"]["allclose"]
    with pytest.raises(ValueError, match="unknown backends"):
        norm_parity(module, x, backends=("cuda graphs",))


def test_norm_parity_torch_compile_row():
    module = _llama_norm(64, torch.float32)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(7))
    (row,) = [r for r in norm_parity(module, x, backends=("torch.compile",))
              if r["reference"] == "HF module"]
    if row["status"] == "ok":   # inductor needs a C++ compiler on CPU; else a reason is given
        # float32: the fused kernel sums in another order, a few ulps apart
        assert row["allclose"] and row["max_ulps"] <= 16
    else:
        assert row["status"] == "skipped" and row["reason"]


@pytest.mark.gpu
@pytest.mark.parametrize("make, casting, offset", [(_llama_norm, "llama", 0.0),
                                                   (_gemma_norm, "gemma", 1.0)])
def test_norm_parity_compiled_backends_on_cuda(make, casting, offset):
    module = make(4096, torch.bfloat16).cuda()
    x = torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16)
    rows = norm_parity(module, x, casting=casting, offset=offset)
    vs_hf = _rows(rows, "HF module")
    for backend in ("normtools torch", "normtools triton", "torch.compile"):
        assert vs_hf[backend]["status"] == "ok", vs_hf[backend]
        assert vs_hf[backend]["max_ulps"] <= 1, vs_hf[backend]
    assert all(r["allclose"] for r in _rows(rows, "float32 math").values())


def _kinds_and_shapes(rows):
    return Counter((r["kind"], r["shape"]) for r in rows)


def test_learned_shapes_qwen3_norms_and_qk_norms():
    cfg = Qwen3Config(vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    rows = learned_shapes(Qwen3Model(cfg))
    layers = cfg.num_hidden_layers
    assert _kinds_and_shapes(rows) == Counter({
        ("norm scale", (cfg.hidden_size,)): 2 * layers + 1,  # input, post-attention, final
        ("norm scale", (cfg.head_dim,)): 2 * layers,         # q_norm, k_norm
    })
    assert {r["dtype"] for r in rows} == {"float32"}
    assert any(r["module"] == "layers.1.self_attn.k_norm" for r in rows)


def test_learned_shapes_qwen2_projection_biases():
    cfg = Qwen2Config(vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    rows = learned_shapes(Qwen2Model(cfg))
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    biases = Counter(r["shape"] for r in rows if r["kind"] == "projection bias")
    assert biases == Counter({(cfg.num_attention_heads * head_dim,): 1,       # q_proj
                              (cfg.num_key_value_heads * head_dim,): 2})      # k_proj, v_proj


def test_learned_shapes_gpt2_layer_norm_bias_and_conv1d():
    cfg = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    rows = learned_shapes(GPT2Model(cfg))
    n, layers = cfg.n_embd, cfg.n_layer
    assert _kinds_and_shapes(rows) == Counter({
        ("norm scale", (n,)): 2 * layers + 1,
        ("norm bias", (n,)): 2 * layers + 1,
        ("projection bias", (3 * n,)): layers,    # c_attn
        ("projection bias", (n,)): 2 * layers,    # attn.c_proj, mlp.c_proj
        ("projection bias", (4 * n,)): layers,    # mlp.c_fc
    })


def test_learned_shapes_tinylm_qk_norm_weights():
    from normtools.lab.tinylm import TinyLM, TinyLMConfig

    cfg = TinyLMConfig(qk_norm="per_head")
    rows = learned_shapes(TinyLM(cfg))
    qk = [r for r in rows if r["parameter"] in ("q_weight", "k_weight")]
    assert qk and all(r["kind"] == "norm scale" for r in qk)
    params = dict(TinyLM(cfg).named_parameters())
    for r in rows:   # every row names a real parameter of that shape
        assert tuple(params[f"{r['module']}.{r['parameter']}"].shape) == r["shape"]


def _hf_bias_numel(model):
    """Independent of the code under test: the model's own parameter names, filtered by hand.

    A bias is the last name component ``bias`` or ``*_bias``; a norm's is the one under a
    submodule whose name contains "norm" (input_layernorm, q_norm, ln_f, ...)."""
    total = 0
    for name, p in model.named_parameters():
        owner, leaf = name.rpartition(".")[0], name.rpartition(".")[2]
        if (leaf == "bias" or leaf.endswith("_bias")) and "norm" not in owner.rpartition(".")[2] \
                and not owner.rpartition(".")[2].startswith("ln"):
            total += p.numel()
    return total


def test_learned_shapes_gpt_oss_expert_biases():
    """gpt-oss's experts hold gate_up_proj_bias (E, 2I) and down_proj_bias (E, H) beside 3-D
    expert tensors, with no 2-D weight: they are projection biases too."""
    from normtools import cards

    config = cards.tiny_config("gpt_oss")
    model = cards.build_model(config, device="meta")
    hf = model.config
    rows = learned_shapes(model)
    E, H, I, L = hf.num_local_experts, hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers
    expert = Counter((r["parameter"], r["shape"]) for r in rows if r["module"].endswith("mlp.experts"))
    assert expert == Counter({("gate_up_proj_bias", (E, 2 * I)): L, ("down_proj_bias", (E, H)): L})
    assert all(r["kind"] == "projection bias" for r in rows if r["module"].endswith("mlp.experts"))


@pytest.mark.parametrize("name", ["gemma-3-4b", "gpt-oss-20b", "llama-3-8b", "minimax-m2",
                                  "olmo-2-1124-7b", "qwen3-8b"])
def test_projection_bias_total_matches_the_model_and_count_parameters(name):
    """The bundled published configs on the meta device: the projection-bias elements of
    learned_shapes equal the model's own bias parameters and count_parameters' bias keys."""
    from normtools import cards
    from normtools.cards.params import BIAS_KEYS

    config = cards.load_bundled_config(name)
    model = cards.build_model(config, device="meta")
    rows = learned_shapes(model)
    listed = sum(r["numel"] for r in rows if r["kind"] == "projection bias")
    counts = cards.count_parameters(config)
    assert listed == _hf_bias_numel(model) == sum(counts[k] for k in BIAS_KEYS)
    if name == "gpt-oss-20b":   # chapter 3's figure: attention, expert and router biases
        assert listed == counts["attention_biases"] + counts["mlp_biases"] + counts["router_biases"]
        assert counts["mlp_biases"] > 0


def test_bias_parameters_gpt2_conv1d_and_no_norm_bias():
    from normtools.cards.params import bias_parameters

    cfg = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    model = GPT2Model(cfg)
    names = set(bias_parameters(model))
    assert "h.0.attn.c_attn.bias" in names and "h.1.mlp.c_proj.bias" in names
    assert not any("ln_" in n for n in names)   # LayerNorm biases are norm parameters
    assert sum(p.numel() for p in bias_parameters(model).values()) == _hf_bias_numel(model)


def test_agreement_verdicts_follow_ulps_and_tolerance():
    from normtools.measure.parity import agreement

    x = torch.linspace(-3, 3, 101, dtype=torch.bfloat16)
    for steps, expected in ((0, "≤ 1 ulp"), (1, "≤ 1 ulp"), (2, "within tolerance")):
        r = compare(x, step(x, torch.full_like(x, steps, dtype=torch.int64), 1))
        assert agreement(r.max_ulps, r.allclose) == expected
    far = compare(x, x + 1)
    assert agreement(far.max_ulps, far.allclose) == "outside tolerance"
