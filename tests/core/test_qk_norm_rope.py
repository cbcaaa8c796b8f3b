"""normtools.qk_norm_rope: QK-Norm then RoPE, fused, against transformers and float64 math.

* Against the models themselves: in tiny random Qwen3, OLMo 2 (per-layer) and Gemma 3 models,
  forward hooks record what each layer feeds its q_norm / k_norm (test_hf_parity_qk), and a
  wrapper around the modeling module's own ``apply_rotary_pos_emb`` records the rotated q and
  k it returns (and the cos / sin it was given). ``backend="torch"`` must give the same bits
  in float32 and bfloat16; the Triton kernel the same bits in bfloat16 and, in float32, within a few ulps of the largest
  value (its sum of squares adds the two halves of a head separately, so r can differ in the
  last bit: float32 bit-exactness would need transformers' own reduction order).
* Gradients (q, k and both weights) against autograd of float64 math (``_oracle``), for both
  scopes, shared and per-head weights, and both casting conventions; OLMo 2's float32 tables
  with the cast back to bfloat16.
* The torch backend's eager autograd node: one for q and k, whose forward gives the no-grad
  bits.
"""

import importlib

import pytest
import torch
from _oracle import assert_close_to_oracle, make_input, rms_norm_f64, run_with_grads
from test_hf_parity_qk import FAMILIES, recorded_qk_norms, tiny_model
from test_numerics import ulps

import normtools
from normtools.core.reference import rms_norm_reference, rope_reference

ROPE_FAMILIES = ["qwen3", "olmo2", "gemma3"]
# OLMo 2's rotary tables are float32 and its apply_rotary_pos_emb casts back to q's dtype
CAST_BACK = {"qwen3": False, "olmo2": True, "gemma3": False}


def recorded_norm_and_rope(family, model, monkeypatch):
    """Per layer: the q_norm / k_norm inputs and the (q, k, cos, sin) → (q_embed, k_embed) of
    the model's own apply_rotary_pos_emb call that follows them."""
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    real_rope = modeling.apply_rotary_pos_emb
    ropes = []

    def recording_rope(q, k, cos, sin, *args, **kwargs):
        out = real_rope(q, k, cos, sin, *args, **kwargs)
        ropes.append((cos.detach(), sin.detach(), out[0].detach(), out[1].detach()))
        return out

    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", recording_rope)
    norms = [{name: inputs for name, (inputs, _) in record.items()}
             for record in recorded_qk_norms(model)]
    assert len(ropes) == len(norms) == len(model.layers)
    return list(zip(norms, ropes))


def fused_like_the_model(family, model, config, layer, record, rope, backend):
    """normtools.qk_norm_rope on the tensors the model normalized, laid out as the model's
    rotated q / k: (B, H, S, D)."""
    *_, scope, offset, casting, heads_first = FAMILIES[family]
    attn = model.layers[layer].self_attn
    q_in, k_in = record["q_norm"], record["k_norm"]
    if heads_first:                                   # (B, H, S, D) → (B, S, H, D)
        q_in, k_in = q_in.transpose(1, 2), k_in.transpose(1, 2)
    cos, sin, q_ref, k_ref = rope
    q_out, k_out = normtools.qk_norm_rope(
        q_in, k_in, attn.q_norm.weight.detach(), attn.k_norm.weight.detach(), cos, sin,
        config.rms_norm_eps, head_dim=config.head_dim, scope=scope, offset=offset,
        casting=casting, cast_back=CAST_BACK[family], backend=backend)
    if q_out.dim() == 3:                              # OLMo 2: (B, S, H·D) → (B, S, H, D)
        q_out = q_out.unflatten(-1, (-1, config.head_dim))
        k_out = k_out.unflatten(-1, (-1, config.head_dim))
    return q_out.transpose(1, 2), k_out.transpose(1, 2), q_ref, k_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("family", ROPE_FAMILIES)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_equals_the_models_norm_then_rope(family, dtype, backend, monkeypatch):
    model, config = tiny_model(family, dtype)
    for layer, (record, rope) in enumerate(recorded_norm_and_rope(family, model, monkeypatch)):
        q_out, k_out, q_ref, k_ref = fused_like_the_model(family, model, config, layer, record,
                                                          rope, backend)
        for name, got, want in (("q", q_out, q_ref), ("k", k_out, k_ref)):
            what = f"{family} {dtype} {backend} layer {layer} {name}"
            assert got.shape == want.shape and got.dtype == want.dtype, what
            if backend == "torch" or dtype != torch.float32:
                assert torch.equal(got, want), (
                    f"{what}: {(got != want).double().mean():.2%} of elements differ, up to "
                    f"{ulps(got, want, dtype).max():.0f} ulps")
            else:   # a few ulps of the largest value (a rotation may cancel to ~0)
                worst = (got - want).abs().max() / want.abs().max()
                assert worst <= 4 * torch.finfo(dtype).eps, f"{what}: {worst:.3g}"


def test_the_model_comparison_can_fail(monkeypatch):
    """Without the rotation (plain qk_norm) or with the other casting, the same comparison
    fails: the parity above is not vacuous."""
    model, config = tiny_model("qwen3", torch.bfloat16)
    record, rope = recorded_norm_and_rope("qwen3", model, monkeypatch)[0]
    attn = model.layers[0].self_attn
    q_norm_only, _ = normtools.qk_norm(record["q_norm"], record["k_norm"],
                                       attn.q_norm.weight.detach(), attn.k_norm.weight.detach(),
                                       config.rms_norm_eps, head_dim=config.head_dim)
    assert not torch.equal(q_norm_only.transpose(1, 2), rope[2])
    cos, sin = rope[0], rope[1]
    q_gemma, _ = normtools.qk_norm_rope(record["q_norm"], record["k_norm"],
                                        attn.q_norm.weight.detach(), attn.k_norm.weight.detach(),
                                        cos, sin, config.rms_norm_eps, head_dim=config.head_dim,
                                        casting="gemma", backend="triton")
    assert not torch.equal(q_gemma.transpose(1, 2), rope[2])


# ----------------------------------------------------------------------------- gradients

def rope_tables(tokens, head_dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    angles = torch.randn(*tokens, head_dim // 2, generator=gen) * 3
    emb = torch.cat((angles, angles), -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def oracle(q, k, qw, kw, cos, sin, eps, head_dim, scope, offset):
    """Float64 norm (rows per scope) then RoPE of q and k, both (T, H, D)."""
    def one(x, w):
        if scope == "per_layer":
            y = rms_norm_f64(x.flatten(-2), w, eps, offset).unflatten(-1, (-1, head_dim))
        else:
            y = rms_norm_f64(x, w, eps, offset)
        return rope_reference(y, cos.double()[:, None], sin.double()[:, None])
    return one(q, qw), one(k, kw)


def same_dtype(q, k, qw, kw, cos, sin, eps, head_dim, scope, offset, casting):
    """The reference ops in the input dtype (PyTorch autograd through them)."""
    def one(x, w):
        rows = x.flatten(-2) if scope == "per_layer" else x
        y = rms_norm_reference(rows, w, eps, offset, casting)
        return rope_reference(y.view(x.shape), cos[:, None], sin[:, None])
    return one(q, qw), one(k, kw)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("scope, weights", [("per_head", "shared"), ("per_head", "per_head"),
                                            ("per_layer", "per_layer")])
@pytest.mark.parametrize("dtype, casting, offset", [(torch.float32, "llama", 0.0),
                                                    (torch.bfloat16, "llama", 0.0),
                                                    (torch.bfloat16, "gemma", 1.0)], ids=str)
def test_gradients_match_float64(backend, scope, weights, dtype, casting, offset, tokens=(3, 4),
                                 heads=(4, 2)):
    (hq, hk), d = heads, 16
    q = make_input((*tokens, hq, d), dtype, seed=0)
    k = make_input((*tokens, hk, d), dtype, seed=1, scale=2.0)
    shape = {"shared": lambda h: (d,), "per_head": lambda h: (h, d),
             "per_layer": lambda h: (h * d,)}[weights]
    gen = torch.Generator().manual_seed(2)
    qw = (0.5 - offset + torch.rand(shape(hq), generator=gen)).to(dtype)
    kw = (0.5 - offset + torch.rand(shape(hk), generator=gen)).to(dtype)
    cos, sin = rope_tables(tokens, d, dtype, seed=3)
    eps = 1e-6
    dqo = make_input(q.shape, dtype, seed=4)
    dko = make_input(k.shape, dtype, seed=5)

    def fused(q, k, qw, kw):
        return normtools.qk_norm_rope(q, k, qw, kw, cos, sin, eps, head_dim=d, scope=scope,
                                      offset=offset, casting=casting, backend=backend)

    outs, grads = run_with_grads(fused, (q, k, qw, kw), [dqo, dko])
    outs_same, grads_same = run_with_grads(
        lambda *a: same_dtype(*[t.flatten(0, 1) if t.dim() > 2 else t for t in a],
                              cos.flatten(0, 1), sin.flatten(0, 1), eps, d, scope, offset,
                              casting), (q, k, qw, kw), [dqo.flatten(0, 1), dko.flatten(0, 1)])
    outs64, grads64 = run_with_grads(
        lambda *a: oracle(*[t.flatten(0, 1) if t.dim() > 2 else t for t in a],
                          cos.flatten(0, 1), sin.flatten(0, 1), eps, d, scope, offset),
        (q, k, qw, kw), [dqo.flatten(0, 1), dko.flatten(0, 1)], cast=torch.float64)
    for name, got, same, ref in zip(["q_out", "k_out"], outs, outs_same, outs64):
        assert_close_to_oracle(got.flatten(0, 1), ref, same, dtype, name)
    for name, got, same, ref in zip(["dq", "dk", "dq_weight", "dk_weight"], grads, grads_same,
                                    grads64):
        assert got.shape == same.shape and got.dtype == same.dtype, name
        assert_close_to_oracle(got, ref, same, dtype, f"{scope}/{weights} {name}")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_olmo2_cast_back_gradients_match_float64(backend):
    """OLMo 2's layout: bfloat16 q and k normalized per layer, float32 rotary tables, the
    rotation computed in float32 and cast back to bfloat16 (``cast_back=True``); outputs and
    gradients against float64, with the same operations in PyTorch as the rounding baseline."""
    tokens, hq, hk, d, eps, dtype = 10, 4, 2, 16, 1e-6, torch.bfloat16
    q = make_input((tokens, hq * d), dtype, seed=0)
    k = make_input((tokens, hk * d), dtype, seed=1, scale=2.0)
    gen = torch.Generator().manual_seed(2)
    qw, kw = ((0.5 + torch.rand(h * d, generator=gen)).to(dtype) for h in (hq, hk))
    cos, sin = rope_tables((tokens,), d, torch.float32, seed=3)
    douts = [make_input(q.shape, dtype, seed=4), make_input(k.shape, dtype, seed=5)]

    def fused(q, k, qw, kw):
        return normtools.qk_norm_rope(q, k, qw, kw, cos, sin, eps, head_dim=d,
                                      scope="per_layer", cast_back=True, backend=backend)

    def same_ops(q, k, qw, kw):
        return tuple(rope_reference(rms_norm_reference(x, w, eps).unflatten(-1, (-1, d)),
                                    cos[:, None], sin[:, None]).to(dtype).flatten(-2)
                     for x, w in ((q, qw), (k, kw)))

    def exact(q, k, qw, kw):
        return tuple(t.flatten(-2) for t in oracle(q.unflatten(-1, (-1, d)),
                                                   k.unflatten(-1, (-1, d)), qw, kw, cos, sin,
                                                   eps, d, "per_layer", 0.0))

    inputs = (q, k, qw, kw)
    outs, grads = run_with_grads(fused, inputs, douts)
    outs_same, grads_same = run_with_grads(same_ops, inputs, douts)
    outs64, grads64 = run_with_grads(exact, inputs, douts, cast=torch.float64)
    for name, got, same, ref in zip(["q_out", "k_out"], outs, outs_same, outs64):
        assert got.dtype == dtype and torch.equal(got, same), name   # the model's bits
        assert_close_to_oracle(got, ref, same, dtype, name)
    for name, got, same, ref in zip(["dq", "dk", "dq_weight", "dk_weight"], grads, grads_same,
                                    grads64):
        assert got.shape == same.shape and got.dtype == same.dtype, name
        assert_close_to_oracle(got, ref, same, dtype, name)


@pytest.mark.parametrize("scope, headed", [("per_head", True), ("per_head", False),
                                           ("per_layer", False)])
def test_torch_backend_records_one_node_with_the_no_grad_bits(scope, headed, monkeypatch):
    """Eager, with a gradient to record, the torch backend differentiates q's and k's norm and
    rotation in one autograd node (``_TorchQKNormRope``) whose forward gives the bits of the
    no-grad path (the transformers bits, test_equals_the_models_norm_then_rope); with
    NORMTOOLS_RMS_NORM_BACKWARD=autograd it records the reference operations instead."""
    from normtools.core import ops
    tokens, d, dtype = (2, 5), 16, torch.bfloat16
    q = make_input((*tokens, 4, d) if headed else (*tokens, 4 * d), dtype, seed=0)
    k = make_input((*tokens, 2, d) if headed else (*tokens, 2 * d), dtype, seed=1)
    qw, kw = (torch.linspace(0.5, 1.5, n).to(dtype)
              for n in ((d, d) if scope == "per_head" else (4 * d, 2 * d)))
    cos, sin = rope_tables(tokens, d, dtype, seed=2)

    def fused(*tensors):
        return normtools.qk_norm_rope(*tensors, cos, sin, head_dim=d, scope=scope,
                                      backend="torch")

    with torch.no_grad():
        expected = fused(q, k, qw, kw)
    for mode, node in (("analytic", "_TorchQKNormRopeBackward"), ("autograd", None)):
        monkeypatch.setattr(ops, "RMS_NORM_BACKWARD", mode)
        outs = fused(q.requires_grad_(), k.requires_grad_(), qw, kw)
        nodes = {type(o.grad_fn if headed else o.grad_fn.next_functions[0][0]).__name__
                 for o in outs}
        assert (nodes == {node}) if node else ("_TorchQKNormRopeBackward" not in nodes), mode
        for got, want in zip(outs, expected):
            assert torch.equal(got, want), mode


def test_bad_rope_tables_raise_before_launch():
    q, k = torch.randn(3, 4, 8), torch.randn(3, 2, 8)
    w = torch.ones(8)
    cos, sin = rope_tables((3,), 8, torch.float32, seed=0)
    bad = [
        (ValueError, dict(cos=cos[:, :4])),                       # not head_dim wide
        (ValueError, dict(cos=torch.ones(5, 8))),                 # other token count
        (TypeError, dict(sin=sin.double())),
        (TypeError, dict(sin=sin.half())),                        # dtype differs from cos
        (ValueError, dict(cos=cos.clone().requires_grad_())),
        (ValueError, dict(cos=cos.to("meta"))),
        (TypeError, dict(cos=None)),
    ]
    for error, change in bad:
        args = dict(cos=cos, sin=sin) | change
        with pytest.raises(error):
            normtools.qk_norm_rope(q, k, w, w, args["cos"], args["sin"], head_dim=8,
                                   backend="triton")
    with pytest.raises(ValueError, match="even"):
        normtools.qk_norm_rope(torch.randn(3, 4, 7), torch.randn(3, 2, 7), torch.ones(7),
                               torch.ones(7), torch.ones(3, 7), torch.ones(3, 7), head_dim=7)
    # broadcast tables: one row per position, shared by the batch
    qb, kb = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 2, 8)
    out = normtools.qk_norm_rope(qb, kb, w, w, cos[None], sin[None], head_dim=8, backend="triton")
    ref = normtools.qk_norm_rope(qb, kb, w, w, cos.expand(2, 3, 8), sin.expand(2, 3, 8),
                                 head_dim=8, backend="torch")
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("scope, weights", [("per_head", "shared"), ("per_head", "per_head"),
                                            ("per_layer", "per_layer")])
@pytest.mark.parametrize("dtype, casting, offset", [(torch.float32, "llama", 0.0),
                                                    (torch.bfloat16, "gemma", 1.0)], ids=str)
def test_split_rows_and_unequal_q_k_programs(scope, weights, dtype, casting, offset,
                                            monkeypatch, nan_filled_float32):
    """The kernel paths the default CPU tiles never reach: tiles of 16 values (one head of
    D = 16 per tile, so per_head has a slot per head and a per_layer row is 4 or 2 tiles,
    read twice), 12 tokens with 5 programs allowed per slot (per head: 4 programs of 3
    tokens per head slot; per layer, q's row twice k's: 6 q programs of 2 tokens and 3 k
    programs of 4), and float32 buffers full of NaN, so a partial that no program writes
    cannot pass. Outputs and gradients against float64."""
    from normtools.core import launch_plans
    from normtools.core.rope import launch_shape
    n_slots = 2 if scope == "per_layer" else 4 + 2
    monkeypatch.setattr(launch_plans, "MAX_CHUNK_BYTES", 64 if dtype == torch.float32 else 32)
    monkeypatch.setitem(launch_plans.TILE_ELEMENTS, "cpu", 16)
    monkeypatch.setattr(launch_plans, "CPU_PROGRAMS", 5 * n_slots)
    plan = launch_shape("qk_norm_rope_bwd", 12, 4, 2, 16, scope == "per_layer", dtype, "cpu")[0]
    assert plan.block_n == 16 and plan.block_m == 1
    expected = ((1, 6, 2), (1, 3, 4)) if scope == "per_layer" else ((4, 4, 3), (2, 4, 3))
    assert [(s.slots, s.groups, s.rows_per_program) for s in plan.shares] == list(expected)
    test_gradients_match_float64("triton", scope, weights, dtype, casting, offset)


@pytest.mark.parametrize("weights", ["shared", "per_head"])
@pytest.mark.parametrize("dtype, casting, offset", [(torch.float32, "llama", 0.0),
                                                    (torch.bfloat16, "gemma", 1.0)], ids=str)
def test_programs_that_take_several_tiles(weights, dtype, casting, offset, monkeypatch,
                                          nan_filled_float32):
    """Per head, a program takes the plan's units_per_slot tiles of heads one after another:
    tiles of one head (D = 16), Hq = 10 and Hk = 5, 4 tokens and 10 programs allowed. The plan
    puts q in 3 slots of 4 tiles (the last slot holds two) and k in 2 (the last holds one),
    2 programs of 2 tokens per slot, in both directions; float32 buffers full of NaN, so a
    head no program covers, or a partial it does not write, cannot pass. Outputs and
    gradients against float64."""
    from normtools.core import launch_plans
    from normtools.core.rope import launch_shape
    monkeypatch.setattr(launch_plans, "MAX_CHUNK_BYTES", 64 if dtype == torch.float32 else 32)
    monkeypatch.setitem(launch_plans.TILE_ELEMENTS, "cpu", 16)
    monkeypatch.setattr(launch_plans, "CPU_PROGRAMS", 10)
    for kernel in ("qk_norm_rope_fwd", "qk_norm_rope_bwd"):
        plan = launch_shape(kernel, 4, 10, 5, 16, False, dtype, "cpu")[0]
        assert plan.block_n == 16 and plan.block_m == 1
        assert [(s.slots, s.units_per_slot, s.groups, s.rows_per_program)
                for s in plan.shares] == [(3, 4, 2, 2), (2, 4, 2, 2)], kernel
        assert plan.programs == 10, kernel    # a grid program per program: not paired
    test_gradients_match_float64("triton", "per_head", weights, dtype, casting, offset,
                                 tokens=(1, 4), heads=(10, 5))


FLOAT32_LLAMA, BFLOAT16_GEMMA = (torch.float32, "llama", 0.0), (torch.bfloat16, "gemma", 1.0)


@pytest.mark.parametrize("scope, weights, tokens, heads, programs, dtype, casting, offset", [
    ("per_head", "shared", (2, 4), (10, 5), 10, *FLOAT32_LLAMA),
    ("per_head", "per_head", (2, 4), (10, 5), 10, *BFLOAT16_GEMMA),
    ("per_layer", "per_layer", (2, 3), (4, 2), 6, *FLOAT32_LLAMA),
    ("per_layer", "per_layer", (2, 3), (4, 2), 6, *BFLOAT16_GEMMA)], ids=str)
def test_paired_q_and_k_programs(scope, weights, tokens, heads, programs, dtype, casting, offset,
                                 monkeypatch, nan_filled_float32):
    """A paired plan (launch_plans.pair_programs): tiles of one head (D = 16) and as many
    programs allowed as there are tokens, so that a token's q and k heads together (Hq + Hk
    heads) are a shorter program than the split's (per head, Hq = 10 and Hk = 5: 15 heads of
    one token against 16 head-tokens; per layer, Hq = 4 and Hk = 2: 6 against q's 8). Each
    grid program runs the q program and the k program of its token, in both directions, into
    float32 buffers full of NaN: a grid program that ran only its first program leaves k
    unwritten and cannot pass. Outputs and gradients against float64."""
    from normtools.core import launch_plans
    from normtools.core.rope import launch_shape
    n_tokens = tokens[0] * tokens[1]
    monkeypatch.setattr(launch_plans, "MAX_CHUNK_BYTES", 64 if dtype == torch.float32 else 32)
    monkeypatch.setitem(launch_plans.TILE_ELEMENTS, "cpu", 16)
    monkeypatch.setattr(launch_plans, "CPU_PROGRAMS", programs)
    for kernel in ("qk_norm_rope_fwd", "qk_norm_rope_bwd"):
        plan = launch_shape(kernel, n_tokens, *heads, 16, scope == "per_layer", dtype, "cpu")[0]
        assert plan.block_m == 1 and [(s.slots, s.groups, s.rows_per_program)
                                      for s in plan.shares] == [(1, n_tokens, 1)] * 2, kernel
        assert plan.programs == n_tokens, kernel     # half the shares' programs
    test_gradients_match_float64("triton", scope, weights, dtype, casting, offset,
                                 tokens=tokens, heads=heads)
