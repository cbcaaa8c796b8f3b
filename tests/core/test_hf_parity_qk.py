"""HF parity: normtools.qk_norm reproduces the q/k normalization inside the attention of tiny
random Qwen3, Gemma 3, OLMo 2 and MiniMax-M2 models.

Forward hooks on each layer's ``q_norm`` / ``k_norm`` record what the model itself feeds them
and gets back during a real forward pass (so the norms are applied exactly as each model
applies them: Qwen3 on (B, S, H, D) before the transpose, Gemma 3 on (B, H, S, D) after it,
OLMo 2 and MiniMax-M2 on the flat (B, S, H·D) projection). ``backend="torch"`` must give the
same bits; the Triton kernel (interpreter on CPU) must agree to rounding.
"""

import pytest
import torch
import transformers

import normtools

TINY = dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=64, bos_token_id=0, eos_token_id=1, pad_token_id=None)

# family: (config class, model class, extra config, scope, offset, casting, norm input is
#          (B, H, S, D) rather than (B, S, H, D) / (B, S, H·D))
FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3Model", {}, "per_head", 0.0, "llama", False),
    "gemma3": ("Gemma3TextConfig", "Gemma3TextModel", {}, "per_head", 1.0, "gemma", True),
    "olmo2": ("Olmo2Config", "Olmo2Model", {}, "per_layer", 0.0, "gemma", False),
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2Model",
                   dict(num_local_experts=2, num_experts_per_tok=1), "per_layer", 0.0, "llama",
                   False),
}


def tiny_model(family, dtype):
    """A 2-layer random model of ``family`` in ``dtype`` with non-trivial q/k norm weights."""
    config_name, model_name, extra, _, offset, _, _ = FAMILIES[family]
    config = getattr(transformers, config_name)(**TINY, **extra)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for layer in model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                # scale offset + w spread around 1 (Gemma stores w around 0)
                norm.weight.copy_(1.0 - offset + 0.3 * torch.randn(norm.weight.shape))
    return model.to(dtype), config


def recorded_qk_norms(model):
    """Run a forward pass; per layer, the (input, output) of q_norm and of k_norm."""
    records, hooks = [], []
    for layer in model.layers:
        record = {}
        records.append(record)
        for name in ("q_norm", "k_norm"):
            def hook(module, args, output, record=record, name=name):
                record[name] = (args[0].detach(), output.detach())
            hooks.append(getattr(layer.self_attn, name).register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(torch.randint(0, TINY["vocab_size"], (2, 5),
                                generator=torch.Generator().manual_seed(1)))
    finally:
        for h in hooks:
            h.remove()
    return records


def normtools_qk(family, model, config, layer, q_in, k_in, backend, scope=None):
    """normtools.qk_norm on the tensors the model fed its q_norm / k_norm."""
    *_, family_scope, offset, casting, heads_first = FAMILIES[family]
    attn = model.layers[layer].self_attn
    if heads_first:                                   # (B, H, S, D) → (B, S, H, D) and back
        q_in, k_in = q_in.transpose(1, 2), k_in.transpose(1, 2)
    q_out, k_out = normtools.qk_norm(q_in, k_in, attn.q_norm.weight.detach(),
                                     attn.k_norm.weight.detach(), config.rms_norm_eps,
                                     head_dim=config.head_dim, scope=scope or family_scope,
                                     offset=offset, casting=casting, backend=backend)
    if heads_first:
        q_out, k_out = q_out.transpose(1, 2), k_out.transpose(1, 2)
    return q_out, k_out


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_torch_backend_is_bit_exact(family, dtype):
    model, config = tiny_model(family, dtype)
    for layer, record in enumerate(recorded_qk_norms(model)):
        (q_in, q_hf), (k_in, k_hf) = record["q_norm"], record["k_norm"]
        q_out, k_out = normtools_qk(family, model, config, layer, q_in, k_in, "torch")
        assert q_out.dtype == q_hf.dtype and torch.equal(q_out, q_hf), (family, layer, "q")
        assert k_out.dtype == k_hf.dtype and torch.equal(k_out, k_hf), (family, layer, "k")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_backend_matches_to_rounding(family, dtype):
    model, config = tiny_model(family, dtype)
    tol = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1e-2, atol=2e-2)}
    for layer, record in enumerate(recorded_qk_norms(model)):
        (q_in, q_hf), (k_in, k_hf) = record["q_norm"], record["k_norm"]
        q_out, k_out = normtools_qk(family, model, config, layer, q_in, k_in, "triton")
        torch.testing.assert_close(q_out, q_hf, **tol[dtype])
        torch.testing.assert_close(k_out, k_hf, **tol[dtype])


@pytest.mark.parametrize("family", ["qwen3", "olmo2"])
def test_other_scope_differs(family):
    """The parity is not vacuous: with the same per-element scale, statistics over the other
    scope give a different result on the same tensors."""
    model, config = tiny_model(family, torch.float32)
    (q_in, q_hf), (k_in, _) = recorded_qk_norms(model)[0].values()
    attn, d = model.layers[0].self_attn, config.head_dim
    q_weight, k_weight = attn.q_norm.weight.detach(), attn.k_norm.weight.detach()
    if family == "qwen3":      # per_head model, normalized per layer: weight repeated per head
        q_wrong, _ = normtools.qk_norm(q_in.flatten(-2), k_in.flatten(-2),
                                       q_weight.repeat(q_in.shape[-2]),
                                       k_weight.repeat(k_in.shape[-2]), config.rms_norm_eps,
                                       head_dim=d, scope="per_layer", backend="torch")
    else:                      # per_layer model, normalized per head: weight as (H, D) rows
        q_wrong, _ = normtools.qk_norm(q_in, k_in, q_weight.view(-1, d), k_weight.view(-1, d),
                                       config.rms_norm_eps, head_dim=d, scope="per_head",
                                       casting="gemma", backend="torch")
    assert not torch.allclose(q_wrong.view(q_hf.shape), q_hf, rtol=1e-3, atol=1e-3)
