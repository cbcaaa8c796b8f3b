"""``normtools.patch``: a tiny random HF model gives the same logits before and after its norm
modules are swapped for normtools ones; unsupported layouts are refused before anything changes."""

import dataclasses

import pytest
import torch

import normtools
from normtools import cards
from normtools.core.modules import LayerNorm, RMSNorm
from normtools.cards.patching import PatchError

pytest.importorskip("transformers")

PATCHABLE = [
    ("llama", {}), ("qwen3", {}), ("olmo2", {}), ("olmo3", {}), ("gemma2", {}), ("gemma3_text", {}),
    ("gpt_oss", {}), ("minimax_m2", {}), ("deepseek_v3", {}), ("cohere", dict(use_qk_norm=False)),
]
DTYPES = [torch.float32, torch.bfloat16]


def tiny_model(family, dtype=torch.float32, **changes):
    """A tiny random model whose norm weights are random too (so that offset and casting matter)."""
    torch.manual_seed(0)
    model = cards.build_model(cards.tiny_config(family, **changes)).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower():
                p.normal_(1.0, 0.3)
    return model


def logits(model):
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(ids.to(model.device)).logits


def hf_norm_names(model):
    return {name for name, m in model.named_modules() if type(m).__name__.endswith(("RMSNorm", "LayerNorm"))
            and not isinstance(m, (RMSNorm, LayerNorm))}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family, changes", PATCHABLE, ids=[f for f, _ in PATCHABLE])
def test_torch_backend_gives_the_same_logits_bit_for_bit(family, changes, dtype):
    model = tiny_model(family, dtype, **changes)
    before, norms = logits(model), hf_norm_names(model)
    replaced = normtools.patch(model, backend="torch")
    assert set(replaced) == norms and not hf_norm_names(model)  # every HF norm module, nothing else
    after = logits(model)
    assert after.dtype == before.dtype and torch.equal(after, before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", ["llama", "qwen3", "olmo2", "gemma3_text"])
def test_triton_backend_matches_within_tolerance(family, dtype):
    model = tiny_model(family, dtype)
    before = logits(model)
    normtools.patch(model, backend="triton")
    torch.testing.assert_close(logits(model), before)  # default tolerances of the dtype


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", ["llama", "qwen3", "olmo2", "gemma3_text", "gpt_oss"])
def test_compiled_triton_backend_on_cuda(family, dtype):
    model = tiny_model(family, dtype).cuda()
    before = logits(model)
    normtools.patch(model, backend="auto")  # auto: the compiled kernels on CUDA
    torch.testing.assert_close(logits(model), before)


def test_the_spec_decides_offset_casting_and_scope():
    gemma = tiny_model("gemma3_text")
    normtools.patch(gemma, backend="torch")
    layer = gemma.model.layers[0]
    assert (layer.input_layernorm.offset, layer.input_layernorm.casting) == (1.0, "gemma")
    assert layer.self_attn.q_norm.weight.shape == (8,)  # per_head: (head_dim,)
    olmo = tiny_model("olmo2")
    normtools.patch(olmo, backend="auto")
    attn = olmo.model.layers[0].self_attn
    assert (attn.q_norm.weight.shape, attn.k_norm.weight.shape) == ((32,), (16,))  # per_layer: H*head_dim
    assert (attn.q_norm.offset, attn.q_norm.casting, attn.q_norm.backend) == (0.0, "gemma", "auto")
    llama = tiny_model("llama")
    normtools.patch(llama)
    assert llama.model.norm.casting == "llama"


@pytest.mark.parametrize("family, changes, reason", [
    ("phi", {}, "torch.nn.LayerNorm"),
    ("cohere", dict(use_qk_norm=True), r"one weight per head, shape \(H, head_dim\)"),
    ("bert", {}, "cannot patch bert: its norms are torch.nn.LayerNorm"),
])
def test_unsupported_layouts_are_refused(family, changes, reason):
    model = tiny_model(family, **changes)
    with pytest.raises(PatchError, match=reason):
        normtools.patch(model)


def test_a_model_that_disagrees_with_its_spec_is_refused_and_left_untouched():
    model = tiny_model("qwen3")
    model.model.layers[1].self_attn.k_norm.variance_epsilon = 1e-3
    model.model.layers[0].post_attention_layernorm = torch.nn.Identity()
    before = logits(model)
    with pytest.raises(PatchError) as err:
        normtools.patch(model)
    message = str(err.value)
    assert "model.layers.1.self_attn.k_norm has eps 0.001" in message
    assert "model.layers.0.post_attention_layernorm is a Identity, the spec says RMSNorm" in message
    assert not any(isinstance(m, RMSNorm) for m in model.modules())
    assert torch.equal(logits(model), before)


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown backend"):
        normtools.patch(tiny_model("llama"), backend="cuda")
    with pytest.raises(PatchError, match="not a transformers decoder model"):
        normtools.patch(torch.nn.Linear(2, 2))


# ----------------------------------------------------------------------------- QK-Norm + RoPE

FUSABLE = ["qwen3", "olmo2", "gemma3_text"]


def fused_rope_calls(monkeypatch):
    """Count the calls of each modeling module's apply_rotary_pos_emb during ``logits``."""
    calls = []
    for name in ("qwen3", "olmo2", "gemma3"):
        modeling = __import__(f"transformers.models.{name}.modeling_{name}",
                              fromlist=["apply_rotary_pos_emb"])
        real = modeling.apply_rotary_pos_emb
        monkeypatch.setattr(modeling, "apply_rotary_pos_emb",
                            lambda *a, real=real, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", FUSABLE)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fused_qk_norm_rope_gives_the_same_logits(family, dtype, backend, monkeypatch):
    """With fuse_qk_rope the model's own q_norm, k_norm and apply_rotary_pos_emb no longer run
    (one qk_norm_rope does), and the logits are the same: bit for bit with the torch backend,
    and with the Triton backend in bfloat16 too (the fused kernel equals the model's rounding
    there); float32 Triton within rounding. Gradients flow to every norm weight."""
    model = tiny_model(family, dtype)
    before = logits(model)
    normtools.patch(model, backend=backend, fuse_qk_rope=True)
    calls = fused_rope_calls(monkeypatch)
    after = logits(model)
    assert calls == [], "the model's apply_rotary_pos_emb still runs"
    if backend == "torch":
        assert torch.equal(after, before)
    else:
        torch.testing.assert_close(after, before)
    model.zero_grad()
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(2))
    model(ids).logits.float().pow(2).mean().backward()
    attn = model.get_decoder().layers[0].self_attn
    assert attn.q_norm.weight.grad is not None and attn.q_norm.weight.grad.abs().sum() > 0
    assert attn.k_norm.weight.grad is not None and attn.k_norm.weight.grad.abs().sum() > 0


def test_fused_patch_refuses_other_families_and_other_transformers_code(monkeypatch):
    llama = tiny_model("llama")
    with pytest.raises(PatchError, match="no attention module with q_norm"):
        normtools.patch(llama, fuse_qk_rope=True)
    model = tiny_model("qwen3")
    from normtools.cards import patching
    monkeypatch.setitem(patching.FUSABLE_ATTENTION, "Qwen3Attention", dataclasses.replace(
        patching.FUSABLE_ATTENTION["Qwen3Attention"], source_sha256="0" * 16))
    before = [type(m).__name__ for m in model.modules()]
    with pytest.raises(PatchError, match="not the transformers version"):
        normtools.patch(model, fuse_qk_rope=True)
    assert [type(m).__name__ for m in model.modules()] == before     # untouched
